"""The language-model recipe (``xlatrain fit configs/lm.yaml``): a byte-level transformer learns the
standard library's source, in one process, under FSDP in two, and sharded over four XLA devices."""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from conftest import run_command
from xlatrain.cli import main
from xlatrain.recipes.lm.data import ByteWindows, split_bytes

CONFIGS = Path(__file__).parents[2] / "configs"
SMALL = ["data.max_train_bytes=120000", "data.max_val_bytes=16000", "data.context=64", "trainer.log_every=20",
         "schedule.warmup_steps=10"]


def _args(run_dir, *sets):
    args = ["fit", str(CONFIGS / "lm.yaml")]
    for item in [*SMALL, f"trainer.run_dir={run_dir}", *sets]:
        args += ["--set", item]
    return args


def test_the_split_keeps_whole_files_apart_and_windows_predict_the_next_byte():
    train, val = split_bytes(5, 50_000, 20_000)
    assert len(train) == 50_000 and len(val) == 20_000
    assert bytes(val[:2000]) not in bytes(train)  # a file is on one side only
    windows = ByteWindows(train, context=64)
    x, y = windows[3]
    assert x.shape == y.shape == (64,) and (x[1:] == y[:-1]).all()
    assert bytes(y.tolist()) == bytes(train[3 * 64 + 1: 4 * 64 + 1])


def test_the_lm_recipe_learns_and_reports_bits_per_byte_tokens_per_second_and_mfu(tmp_path, capsys):
    # A model of 64 wide and 2 layers learns as surely as the config's 128 x 4 and costs a third.
    assert main(_args(tmp_path, "trainer.epochs=2", "model.width=64", "model.layers=2")) == 0
    out = capsys.readouterr().out
    history = json.loads((tmp_path / "history.json").read_text())
    # Chance is ln 256 = 5.55 nats per byte; the model is well under it after one short epoch.
    assert history[0]["val_loss"] < 3.5 and history[1]["val_loss"] < history[0]["val_loss"]
    assert history[1]["val_bpb"] == pytest.approx(history[1]["val_loss"] / math.log(2), rel=1e-6)
    assert history[1]["tokens_per_s"] == pytest.approx(64 * history[1]["samples_per_s"], rel=1e-3)
    assert 0 < history[1]["mfu"] < 1
    assert "model FLOPs: " in out and "(ByteGPT.train_flops_per_sample())" in out
    assert "tokens/s, MFU " in out


@pytest.mark.multiprocess
def test_the_lm_recipe_trains_under_fsdp_in_two_processes(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    args = [torchrun, "--nproc-per-node", "2", "--standalone", "-m", "xlatrain.cli",
            *_args(tmp_path, "trainer.epochs=1", "trainer.batch_size=16", "backend.strategy=fsdp", "backend.accelerator=cpu",
                   "model.width=64")]
    out = run_command(args, timeout=600).stdout
    assert "FSDP over 2 process(es), 4 unit(s) (Block)" in out and "global batch 32 = 16 per device x 2" in out
    history = json.loads((tmp_path / "history.json").read_text())
    assert history[0]["val_loss"] < 3.5 and history[0]["mfu"] > 0


@pytest.mark.xla
def test_the_lm_recipe_trains_sharded_over_four_xla_devices(tmp_path):
    args = [sys.executable, "-m", "xlatrain.cli",
            *_args(tmp_path, "trainer.epochs=1", "trainer.batch_size=8", "backend.accelerator=xla", "backend.devices=4",
                   "backend.strategy=fsdp", "data.max_train_bytes=40000", "model.width=64")]
    out = run_command(args, env={"PJRT_DEVICE": "CPU"}, timeout=900).stdout
    assert "SPMD FSDP over an 'fsdp' mesh of 4 device(s)" in out and "tokens/s" in out
    history = json.loads((tmp_path / "history.json").read_text())
    assert history[0]["val_loss"] < 5.0 and history[0]["mfu"] > 0
