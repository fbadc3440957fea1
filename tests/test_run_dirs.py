"""Commands that follow one another in one directory: where a command that trains is given no run
directory, the default one is for the devices it asks for, so `make demo` and then the demo on
four XLA devices (or a config on the CPU and then on XLA) train two runs instead of the second
being refused for the first's checkpoint."""

import json
import sys
from pathlib import Path

import pytest

from conftest import run_bounded, script_env
from xlatrain.cli import main
from xlatrain.config import load_run_config
from xlatrain.recipes.run import run_dir_for_launch, with_launch_run_dir

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_the_default_directory_is_named_for_the_devices_a_command_asks_for():
    assert run_dir_for_launch("runs/demo", accelerator="auto", devices=None) == "runs/demo"
    assert run_dir_for_launch("runs/demo", accelerator="xla", devices=4) == "runs/demo-xla-4"
    assert run_dir_for_launch("runs/demo", accelerator="cpu", devices=None) == "runs/demo-cpu"
    assert run_dir_for_launch("runs/digits", accelerator="auto", devices=None, processes=2) == "runs/digits-auto-2"
    assert run_dir_for_launch("gs://b/runs/pe/", accelerator="tpu", devices=None) == "gs://b/runs/pe-tpu"
    # A config that writes its own backend: its run directory is for that backend.
    assert run_dir_for_launch("runs/own", accelerator="xla", devices=4, default=("xla", 4)) == "runs/own"


def _chosen(path: str, sets: list[str]) -> tuple[str, str | None]:
    config, note = with_launch_run_dir(load_run_config(path, sets), path, sets)
    return config.trainer.run_dir, note


def test_fit_moves_the_configs_run_dir_only_for_devices_the_command_asks_for(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    digits = str(CONFIGS / "digits.yaml")
    assert _chosen(digits, []) == ("runs/digits", None)
    assert _chosen(digits, ["backend.accelerator=auto", "trainer.epochs=3"]) == ("runs/digits", None)
    run_dir, note = _chosen(digits, ["backend.accelerator=xla", "backend.devices=4"])
    assert run_dir == "runs/digits-xla-4"
    assert "runs/digits-xla-4" in note and "accelerator=xla, devices=4" in note and "trainer.run_dir" in note
    # A directory the user names is used as it is.
    assert _chosen(digits, ["backend.accelerator=xla", "backend.devices=4", "trainer.run_dir=runs/mine"]) == ("runs/mine", None)
    own = tmp_path / "own.yaml"
    own.write_text("recipe: digits\ntrainer:\n  run_dir: runs/own\nbackend:\n  accelerator: xla\n  devices: 4\n")
    assert _chosen(str(own), []) == ("runs/own", None)
    assert _chosen(str(own), ["backend.devices=2"])[0] == "runs/own-xla-2"
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun --nproc-per-node 2
    assert _chosen(digits, [])[0] == "runs/digits-auto-2"


def test_the_demo_on_other_devices_trains_beside_the_default_run_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["demo", "--accelerator", "cpu", "--epochs", "1", "--min-accuracy", "0"]) == 0
    out = capsys.readouterr().out
    assert "xlatrain: run dir runs/demo-cpu: this command asks for accelerator=cpu" in out and "--run-dir DIR" in out
    assert len(json.loads((tmp_path / "runs" / "demo-cpu" / "history.json").read_text())) == 1
    assert not (tmp_path / "runs" / "demo").exists()
    assert main(["demo", "--accelerator", "cpu", "--epochs", "1", "--min-accuracy", "0", "--run-dir", "mine"]) == 0
    assert "run dir runs/demo" not in capsys.readouterr().out and (tmp_path / "mine" / "history.json").is_file()


@pytest.mark.xla
def test_make_demo_then_the_demo_on_four_xla_devices_in_one_directory(tmp_path):
    """The README pair that collided (`cannot resume from runs/demo/...: the run cannot continue
    under run.global_batch 32 -> 128`): now each trains its own run, and finds it again."""
    def run(args: list[str], **env: str) -> str:
        proc = run_bounded(args, script_env(env), 600, cwd=tmp_path, warm=True)
        assert proc.returncode == 0, f"{' '.join(args[2:])} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout + proc.stderr

    demo = [sys.executable, "-m", "xlatrain.cli", "demo", "--epochs", "1", "--min-accuracy", "0"]
    xla = [*demo, "--accelerator", "xla", "--devices", "4"]
    first = run(demo)
    second = run(xla, PJRT_DEVICE="CPU")
    assert "global batch 32 = 32 per device x 1" in first
    assert "run dir runs/demo-xla-4" in second and "global batch 128 = 32 per device x 4" in second
    for name in ("demo", "demo-xla-4"):
        assert len(json.loads((tmp_path / "runs" / name / "history.json").read_text())) == 1
    assert "nothing to train" in run(xla, PJRT_DEVICE="CPU")
