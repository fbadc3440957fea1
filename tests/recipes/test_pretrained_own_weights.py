"""`--fresh --set model.pretrained=RUN_DIR/best.safetensors`, the way on that a resume under a
cosine schedule of another length is refused with, works for every recipe: each recipe's
``model.pretrained`` takes the weights its own runs save."""

from pathlib import Path

import pytest
import torch

from xlatrain.cli import main
from xlatrain.config import load_run_config
from xlatrain.models import load_state_dict_file
from xlatrain.recipes.run import recipe_module

CONFIGS = Path(__file__).parents[2] / "configs"

TINY = {
    "digits": ["data.image_size=16", "trainer.batch_size=64", "schedule.name=cosine", "schedule.step_size=null",
               "schedule.gamma=null"],
    "depth_mask": ["data.num_train=16", "data.num_val=8", "data.image_size=32", "model.width=4", "model.blocks=[1,1,1,1]",
                   "trainer.batch_size=4"],
    "pe_detection": ["data.num_studies=6", "data.slices_per_study=[4,5]", "data.stored_size=32", "data.image_size=32",
                     "data.num_folds=2", "data.pack_workers=1", "model.name=small_cnn", "model.width=4",
                     "trainer.batch_size=8", "schedule.name=cosine", "schedule.step_size=null", "schedule.gamma=null"],
    "lm": ["data.context=32", "data.max_train_bytes=40000", "data.max_val_bytes=8000", "model.width=16", "model.layers=1",
           "model.heads=2", "schedule.name=cosine", "schedule.warmup_steps=null", "schedule.min_lr_ratio=null"],
}


def _sets(name, tmp_path, *more):
    common = ["trainer.log_every=1000", "backend.accelerator=cpu", f"trainer.run_dir={tmp_path / 'run'}"]
    return [*TINY[name], *common, *([f"data.root={tmp_path / 'data'}"] if name == "pe_detection" else []), *more]


def _fit(name, sets, *flags):
    args = ["fit", str(CONFIGS / f"{name}.yaml"), *flags]
    for item in sets:
        args += ["--set", item]
    return main(args)


@pytest.mark.parametrize("name", ["digits", "depth_mask", "pe_detection", "lm"])
def test_a_recipe_starts_a_new_run_from_its_own_best_weights(name, tmp_path, capsys):
    assert _fit(name, _sets(name, tmp_path, "trainer.epochs=1")) == 0
    best = tmp_path / "run" / "best.safetensors"
    capsys.readouterr()
    assert _fit(name, _sets(name, tmp_path, "trainer.epochs=2")) == 2  # the cosine holds the run's length
    assert "--fresh --set model.pretrained=" in capsys.readouterr().err
    assert _fit(name, _sets(name, tmp_path, "trainer.epochs=2", f"model.pretrained={best}"), "--fresh") == 0
    assert "epoch 2/2" in capsys.readouterr().out
    # The model the recipe builds holds those weights.
    config = load_run_config(str(CONFIGS / f"{name}.yaml"), _sets(name, tmp_path, f"model.pretrained={best}"))
    parts = recipe_module(name).build(config)
    saved, built = load_state_dict_file(best), parts.model.state_dict()
    assert set(saved) == set(built) and all(torch.equal(saved[k], built[k]) for k in saved)
    if hasattr(parts.train_data, "close"):
        parts.train_data.close()


def test_pe_weights_that_fit_neither_the_backbone_nor_the_recipes_model_are_refused_naming_both(tmp_path):
    from safetensors.torch import save_file

    from xlatrain.recipes.run import build_recipe_model

    path = tmp_path / "other.safetensors"
    save_file({"backbone.features.0.0.weight": torch.zeros(4, 1, 3, 3), "head.weight": torch.zeros(10, 8)}, str(path))
    config = load_run_config(str(CONFIGS / "pe_detection.yaml"), ["model.name=small_cnn", "model.width=4",
                                                                  f"model.pretrained={path}"])
    with pytest.raises(ValueError, match=r"does not hold weights for this model .*holds it as 'backbone\.' \(every key"):
        build_recipe_model(config, num_outputs=10, in_channels=1, pretrained_prefix="backbone.")


def test_lm_weights_of_another_shape_are_refused_naming_the_keys(tmp_path):
    from xlatrain.checkpoint import save_weights
    from xlatrain.recipes.lm.model import ByteGPT
    from xlatrain.recipes.lm.recipe import build_model

    path = tmp_path / "best.safetensors"
    save_weights(ByteGPT(context=32, width=16, layers=2, heads=2), path)
    config = load_run_config(str(CONFIGS / "lm.yaml"), ["model.width=16", "model.layers=1", "model.heads=2",
                                                        f"model.pretrained={path}"])
    with pytest.raises(ValueError, match=r"does not hold this byte_gpt's weights \(\d+ key\(s\) unexpected: blocks\.1\."):
        build_model(config, context=32)
