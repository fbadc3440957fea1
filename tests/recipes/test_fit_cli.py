"""`xlatrain fit CONFIG.yaml`: config round trip, overrides, errors, and each recipe end to end."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_command
from xlatrain.cli import main
from xlatrain.config import apply_overrides, dump_yaml, load_run_config, run_config_from_dict

CONFIGS = Path(__file__).parents[2] / "configs"

TINY_PE = [
    "data.num_studies=10", "data.slices_per_study=[6,8]", "data.stored_size=64", "data.image_size=32",
    "data.num_folds=2", "data.pack_workers=1", "model.name=small_cnn", "model.width=8", "trainer.batch_size=8",
    "trainer.epochs=2", "trainer.log_every=1000",
]
TINY_DM = [
    "data.num_train=32", "data.num_val=12", "data.image_size=32", "model.width=4", "model.blocks=[1,1,1,1]",
    "trainer.batch_size=4", "trainer.epochs=2", "trainer.log_every=1000",
]


@pytest.mark.parametrize("name", ["digits", "pe_detection", "depth_mask", "lm"])
def test_every_shipped_config_loads_and_round_trips(name):
    config = load_run_config(str(CONFIGS / f"{name}.yaml"))
    again = run_config_from_dict(yaml.safe_load(dump_yaml(config)))
    assert again == config


def test_set_overrides_reach_the_right_section_with_yaml_types():
    config = load_run_config(
        str(CONFIGS / "digits.yaml"),
        ["trainer.epochs=3", "optimizer.lr=1e-4", "backend.accelerator=xla", "backend.devices=4", "model.pretrained=false"],
    )
    assert (config.trainer.epochs, config.optimizer.lr) == (3, 1e-4)
    assert (config.backend.accelerator, config.backend.devices) == ("xla", 4)
    assert apply_overrides({"data": {"a": 1}}, ["data.b=[1, 2]"]) == {"data": {"a": 1, "b": [1, 2]}}
    with pytest.raises(ValueError, match="write section.key=value"):
        apply_overrides({}, ["epochs"])


def test_unknown_sections_keys_models_and_recipes_list_the_valid_ones(tmp_path, capsys):
    base = str(CONFIGS / "digits.yaml")
    with pytest.raises(ValueError, match=r"unknown TrainConfig key\(s\) trainer.epoch: valid keys are .*epochs"):
        load_run_config(base, ["trainer.epoch=3"])
    with pytest.raises(ValueError, match=r"unknown config section\(s\) optimiser: valid sections are"):
        run_config_from_dict({"recipe": "digits", "optimiser": {}})
    assert main(["fit", base, "--set", "model.name=resnet19", "--set", f"trainer.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "resnet19" in err and "resnet18" in err  # the unknown name and the valid ones
    assert main(["fit", base, "--set", "recipe=mnist"]) == 2
    assert "unknown recipe 'mnist': choose one of depth_mask, digits, lm, pe_detection" in capsys.readouterr().err


def test_pretrained_true_is_refused_with_the_fix(capsys):
    assert main(["fit", str(CONFIGS / "digits.yaml"), "--set", "model.pretrained=true"]) == 2
    assert "local" in capsys.readouterr().err


def _fit(tmp_path, name, extra, env=None):
    """`xlatrain fit configs/NAME.yaml --set ...` in a fresh process; returns the run's history."""
    args = [sys.executable, "-m", "xlatrain.cli", "fit", str(CONFIGS / f"{name}.yaml")]
    extra = [*extra, f"trainer.run_dir={tmp_path / 'run'}"]
    if name == "pe_detection":
        extra.append(f"data.root={tmp_path / 'data'}")
    for item in extra:
        args += ["--set", item]
    run_command(args, env=env, timeout=600)
    return json.loads((tmp_path / "run" / "history.json").read_text())


@pytest.mark.parametrize("source", ["shards", "folder"])
def test_pe_recipe_trains_on_cpu_from_shards_and_from_the_folder(tmp_path, source):
    history = _fit(tmp_path, "pe_detection", [*TINY_PE, f"data.source={source}", "backend.accelerator=cpu"])
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert {"val_mean_auc", "val_weighted_log_loss", "val_auc_pe_present_on_image"} <= set(history[-1])
    assert (tmp_path / "run" / "config.yaml").is_file()


@pytest.mark.xla
def test_pe_recipe_runs_unchanged_on_four_xla_cpu_devices(tmp_path):
    history = _fit(tmp_path, "pe_detection", [*TINY_PE, "trainer.batch_size=2", "backend.accelerator=xla", "backend.devices=4"],
                   env={"PJRT_DEVICE": "CPU"})
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[0]["xla_compilations"] > 0 and history[-1]["xla_compilations"] == 0  # each epoch's own count
    _assert_no_xla_waste(tmp_path)


def _assert_no_xla_waste(tmp_path):
    """No recompilation, shape change or unplanned device read anywhere in the run."""
    report = json.loads((tmp_path / "run" / "diagnostics.json").read_text())
    codes = {f["code"] for f in report["findings"]}
    assert not codes & {"recompilation-after-warmup", "input-shape-change", "host-sync-per-step", "cpu-fallback-ops"}, report


@pytest.mark.xla
def test_depth_mask_recipe_on_xla_cpu_has_no_recompilation_after_warm_up(tmp_path):
    history = _fit(tmp_path, "depth_mask", [*TINY_DM, "trainer.epochs=3", "backend.accelerator=xla", "backend.devices=4",
                                            "trainer.batch_size=1"], env={"PJRT_DEVICE": "CPU"})
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert {"val_dice", "val_iou", "val_depth_rmse"} <= set(history[-1])
    assert [row["xla_compilations"] for row in history][1:] == [0, 0]
    _assert_no_xla_waste(tmp_path)


def test_report_writes_pngs_and_a_summary(tmp_path):
    history = _fit(tmp_path, "depth_mask", [*TINY_DM, "backend.accelerator=cpu"])
    assert main(["report", str(tmp_path / "run")]) == 0
    from PIL import Image

    out = tmp_path / "run" / "report"
    for name in ("loss.png", "metrics.png", "lr.png", "timing.png"):
        with Image.open(out / name) as image:
            assert image.size[0] > 100 and image.getextrema() != ((255, 255),) * len(image.getbands())
    summary = (out / "summary.md").read_text()
    assert "best epoch" in summary and "val_dice" in summary and len(history) == 2


@pytest.mark.multiprocess
def test_pe_recipe_runs_unchanged_under_torchrun_with_the_same_global_batch(tmp_path):
    """2 processes x 4 per device = the one-process global batch of 8.

    The trajectories are not compared: the recipe's CNN has BatchNorm, whose statistics DDP
    computes per process (4 rows) where one process uses 8; the Trainer's own equivalence tests
    use a model without it. Both ranks share one generated dataset (local rank 0 makes it).
    """
    import shutil

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    run_dir, data_dir = tmp_path / "run", tmp_path / "data"
    args = [torchrun, "--nproc-per-node", "2", "--standalone", "-m", "xlatrain.cli", "fit", str(CONFIGS / "pe_detection.yaml")]
    for item in [*TINY_PE, "trainer.batch_size=4", "backend.accelerator=cpu", f"trainer.run_dir={run_dir}", f"data.root={data_dir}"]:
        args += ["--set", item]
    out = run_command(args, timeout=600).stdout
    assert "DDP over 2 processes | global batch 8 = 4 per device x 2 device(s)" in out
    assert out.count("generating a synthetic") == 1
    history = json.loads((run_dir / "history.json").read_text())
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["val_weighted_log_loss"] == history[-1]["val_weighted_log_loss"]


def test_a_run_that_stops_inside_its_first_epoch_has_its_config_yaml(tmp_path):
    from torch.utils.data import Dataset

    from xlatrain.recipes.run import build_trainer

    class DiskGoneAfter(Dataset):
        """The recipe's training set, until the disk goes away a few batches in."""

        def __init__(self, data, items):
            self.data, self.items = data, items

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            self.items -= 1
            if self.items < 0:
                raise OSError("the disk went away")
            return self.data[i]

    config = load_run_config(str(CONFIGS / "digits.yaml"), [
        "trainer.epochs=1", "data.image_size=16", "backend.accelerator=cpu", f"trainer.run_dir={tmp_path / 'run'}"])
    trainer, parts = build_trainer(config)
    with pytest.raises(OSError, match="the disk went away"):
        trainer.fit(DiskGoneAfter(parts.train_data, 200), parts.val_data)
    assert not (tmp_path / "run" / "history.json").exists()  # it stopped inside epoch 1 ...
    assert run_config_from_dict(yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())) == config  # ... and says how it ran


def test_the_pe_recipe_reads_a_local_pack_it_is_given_without_a_folder_or_generating_one(tmp_path):
    from xlatrain.recipes.pe_detection.recipe import DataConfig, datasets, prepare_data

    made = DataConfig(root=str(tmp_path / "made"), num_studies=6, slices_per_study=[4, 5], stored_size=48,
                      image_size=32, num_folds=3, pack_workers=1)
    prepare_data(made)  # generates the folder and packs it into made/shards
    # Only the pack now, as after `xlatrain pack`: real data (synthetic off), no folder beside it.
    given = DataConfig(root=str(tmp_path / "no-folder"), shards=str(tmp_path / "made" / "shards"), synthetic=False,
                       num_studies=6, slices_per_study=[4, 5], stored_size=48, image_size=32, num_folds=3)
    split = datasets(given, num_workers=0)
    rows = (tmp_path / "made" / "train.csv").read_text().splitlines()[1:]
    assert len(split.train) + len(split.val) == len(rows)
    assert not (tmp_path / "no-folder").exists()  # nothing generated, nothing asked of data.root


def test_the_object_storage_page_packs_the_labels_the_pe_recipe_reads():
    from xlatrain.recipes.pe_detection.labels import TARGET_NAMES

    page = (Path(__file__).parents[2] / "docs" / "guides" / "object-storage.md").read_text()
    command = page.split("xlatrain pack ", 1)[1].split("xlatrain fit", 1)[0].replace("\\\n", " ")
    labels = command.split("--labels", 1)[1].split("#", 1)[0].split()
    assert set(TARGET_NAMES) <= set(labels) and "--group" in command
