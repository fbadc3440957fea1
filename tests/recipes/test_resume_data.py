"""A resumed recipe run compares every ``data`` key, the ones left at their default included."""

import dataclasses
import json
from pathlib import Path

import pytest

from xlatrain.cli import main
from xlatrain.config import load_run_config
from xlatrain.recipes.run import recipe_module, run_record

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize("name", ["digits", "pe_detection", "depth_mask", "lm"])
def test_the_record_holds_every_data_key_of_the_recipe_with_its_default(name):
    config = load_run_config(str(CONFIGS / f"{name}.yaml"))
    cls = recipe_module(name).DataConfig
    record = run_record(config)
    kept = {f.name for f in dataclasses.fields(cls)} - set(getattr(cls, "RESUME_FREE", ()))
    assert set(record["data"]) == kept == set(record["defaults"]["data"])
    assert record["data"] == {**record["defaults"]["data"], **{k: v for k, v in config.data.items() if k in kept}}


def _fit(run_dir, *sets):
    args = ["fit", str(CONFIGS / "digits.yaml")]
    for item in ("data.image_size=16", "trainer.batch_size=64", "trainer.log_every=1000", "backend.accelerator=cpu",
                 f"trainer.run_dir={run_dir}", *sets):
        args += ["--set", item]
    return main(args)


def _as_older_xlatrain_wrote_it(run_dir):
    """The newest checkpoint's recorded config as xlatrain wrote it before: ``data`` as the YAML
    and --set gave it, no defaults."""
    meta_path = sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"].pop("defaults", None)
    meta["config"]["data"] = {"image_size": 16}
    meta_path.write_text(json.dumps(meta))


def test_a_data_key_left_at_its_default_is_compared_on_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _fit(run_dir, "trainer.epochs=1") == 0
    capsys.readouterr()
    # data.seed is not in digits.yaml: another seed is another train/validation split.
    assert _fit(run_dir, "trainer.epochs=2", "data.seed=7") == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "under data.seed 0 -> 7." in err


def test_a_checkpoint_of_an_older_xlatrain_resumes_unless_a_default_left_out_was_changed(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _fit(run_dir, "trainer.epochs=1") == 0
    _as_older_xlatrain_wrote_it(run_dir)
    capsys.readouterr()
    # Its record lacks data.seed: it stood at the recipe's default then (another seed: another
    # split of the same size, which nothing else would catch).
    assert _fit(run_dir, "trainer.epochs=2", "data.seed=7") == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "under data.seed 0 -> 7." in err
    # Nothing changed but the epochs: the run goes on, and names no data key.
    assert _fit(run_dir, "trainer.epochs=2") == 0
    out = capsys.readouterr().out
    assert "resuming with changed settings: trainer.epochs 1 -> 2\n" in out and "epoch 2/2" in out


def test_a_folder_run_that_set_data_shards_resumes_without_it():
    # An older xlatrain took data.shards under data.source=folder and ignored it; it is refused now,
    # and removing it as told changed the recorded config, which refused the resume.
    from xlatrain.train.state import resume_changes

    config = load_run_config(str(CONFIGS / "pe_detection.yaml"))
    folder = dataclasses.replace(config, data={**config.data, "source": "folder"})
    new = run_record(folder)
    assert "shards" not in new["data"]
    old = json.loads(json.dumps({k: v for k, v in new.items() if k != "defaults"}))
    old["data"] = {**config.data, "source": "folder", "shards": "/elsewhere/shards"}  # as the older record held it
    _continued, refused = resume_changes(old, new, epochs_done=1)
    assert not [line for line in refused if "shards" in line], refused
