"""TensorBoard event files, read back with TensorBoard's own event reader: tags, one point per
log interval and per epoch on the optimizer-step axis, hparams, and a run killed after a
checkpoint and resumed showing every step once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import script_env
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.util import tensor_util
from tensorboard.plugins.hparams import metadata as hparams_metadata

from xlatrain.tensorboard import TensorBoardLog, epoch_tag

STEPS_PER_EPOCH, LOG_EVERY = 10, 3
INTERVAL_TAGS = {"train/loss", "train/lr", "train/samples_per_s"}


def _read(path: Path) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(str(path), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return acc


def _points(acc: event_accumulator.EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def _served_points(path: Path, tag: str) -> list[tuple[int, float]]:
    """The points the TensorBoard server shows when it reads with Python (``--load_fast=false``):
    its reader handles a restart marker differently from the standalone one."""
    acc = plugin_event_accumulator.EventAccumulator(str(path), size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, round(tensor_util.make_ndarray(e.tensor_proto).item(), 6)) for e in acc.Tensors(tag)]


def _row(epoch: int, shift: float = 0.0) -> dict:
    return {
        "epoch": epoch, "lr": 0.1 / epoch, "train_loss": 1.0 / epoch + shift, "val_loss": 0.9 / epoch + shift,
        "val_accuracy": 0.5 + epoch / 10, "val_auc_nodule": 0.6, "epoch_time_s": 3.5,
        "input_bound_share": 0.25, "xla_compilations": 6, "best_checkpoint": "step-00000010",
    }


def _fit_like(tb: TensorBoardLog, epochs: range, start: int = 0, *, shift: float = 0.0,
              stop_at: int | None = None) -> None:
    """What the Trainer does: a point per log interval (not at an epoch's last step, which the epoch
    row covers), a row per epoch; optimizer step = micro step without accumulation."""
    for epoch in epochs:
        for step in range(1, STEPS_PER_EPOCH + 1):
            global_step = (epoch - 1) * STEPS_PER_EPOCH + step
            if global_step <= start:
                continue
            if step % LOG_EVERY == 0 and step < STEPS_PER_EPOCH:
                tb.interval(global_step, loss=global_step / 100 + shift, lr=0.1 / epoch, samples_per_s=1000.0)
            if global_step == stop_at:
                return
        tb.epoch(epoch, epoch * STEPS_PER_EPOCH, _row(epoch, shift))


CONFIG = {
    "trainer": {"epochs": 2, "batch_size": 32, "clip_grad_norm": None, "precision": "bf16", "save_best": True},
    "model": {"name": "resnet18", "layers": [2, 2]},
    "optimizer": {"lr": 0.001},
}


def test_a_run_gives_each_tag_one_point_per_interval_and_per_epoch(tmp_path: Path) -> None:
    with TensorBoardLog(tmp_path, enabled=True, is_main=True, start_step=0) as tb:
        _fit_like(tb, range(1, 3))
        tb.hparams(CONFIG, {"val_loss": 0.45, "best_val_loss": 0.45, "note": "not a number"}, step=20)
    acc = _read(tmp_path / "tb")
    epoch_tags = {"epoch/epoch", "epoch/lr", "epoch/train_loss", "val/loss", "val/accuracy", "val/auc_nodule",
                  "epoch/epoch_time_s", "diagnostics/input_bound_share", "diagnostics/xla_compilations"}
    final_tags = {"hparams/val_loss", "hparams/best_val_loss"}
    assert set(acc.Tags()["scalars"]) == INTERVAL_TAGS | epoch_tags | final_tags
    for tag in INTERVAL_TAGS:
        assert [s for s, _ in _points(acc, tag)] == [3, 6, 9, 13, 16, 19]
    assert _points(acc, "train/loss") == [(s, s / 100) for s in (3, 6, 9, 13, 16, 19)]
    for tag in epoch_tags:
        assert [s for s, _ in _points(acc, tag)] == [10, 20], tag
    assert _points(acc, "val/loss") == [(10, 0.9), (20, 0.45)]
    assert _points(acc, "epoch/epoch") == [(10, 1.0), (20, 2.0)]
    assert _points(acc, "hparams/best_val_loss") == [(20, 0.45)]

    content = acc.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
    start = hparams_metadata.parse_session_start_info_plugin_data(content[hparams_metadata.SESSION_START_INFO_TAG])
    assert {k: v.WhichOneof("kind") for k, v in start.hparams.items()} == {
        "trainer.epochs": "number_value", "trainer.batch_size": "number_value", "trainer.precision": "string_value",
        "trainer.save_best": "number_value", "model.name": "string_value", "model.layers": "string_value",
        "optimizer.lr": "number_value",
    }
    assert start.hparams["optimizer.lr"].number_value == 0.001
    assert start.hparams["model.layers"].string_value == "[2, 2]"
    experiment = hparams_metadata.parse_experiment_plugin_data(content[hparams_metadata.EXPERIMENT_TAG])
    assert {m.name.tag for m in experiment.metric_infos} == final_tags
    # In the run's own directory: no sub-run (add_hparams would have made one).
    assert [p.name for p in (tmp_path / "tb").iterdir() if p.is_dir()] == []


def test_every_tag_the_docs_name_is_one_a_run_writes(tmp_path: Path) -> None:
    """performance.md once named ``interval/mfu``, a tag no run wrote: the tags come from a real fit."""
    import functools
    import re

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import xlatrain

    class Counted(nn.Linear):
        tokens_per_sample = 4  # as a language model says it: tokens/s is logged too

    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md")), root / "src/xlatrain/tensorboard.py"]
    named = {tag for page in pages for tag in re.findall(r"`([a-z]+/[a-z_0-9]+)`", page.read_text())
             if tag.split("/")[0] in ("train", "val", "epoch", "diagnostics", "hparams", "interval")}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    xlatrain.Trainer(Counted(8, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                     config=xlatrain.TrainConfig(epochs=2, batch_size=8, log_every=2, run_dir=str(tmp_path)),
                     backend="cpu").fit(data, data)
    written = set(_read(tmp_path / "tb").Tags()["scalars"])
    assert named and named <= written, (sorted(named - written), sorted(written))


def test_history_columns_map_to_grouped_tags() -> None:
    assert epoch_tag("val_loss") == "val/loss"
    assert epoch_tag("input_bound_share") == "diagnostics/input_bound_share"
    assert epoch_tag("xla_host_transfers") == "diagnostics/xla_host_transfers"
    assert epoch_tag("train_loss") == "epoch/train_loss"


@pytest.mark.parametrize("enabled, is_main", [(False, True), (True, False)], ids=["tensorboard=False", "rank-1"])
def test_off_or_not_main_writes_nothing(tmp_path: Path, enabled: bool, is_main: bool) -> None:
    tb = TensorBoardLog(tmp_path, enabled=enabled, is_main=is_main, start_step=0)
    assert not tb.enabled
    _fit_like(tb, range(1, 2))
    tb.hparams(CONFIG, {"val_loss": 0.5}, step=10)
    tb.close()
    assert list(tmp_path.iterdir()) == []


def test_one_point_per_optimizer_step_when_intervals_share_one(tmp_path: Path) -> None:
    with TensorBoardLog(tmp_path, enabled=True, is_main=True, start_step=0) as tb:
        for step, loss in ((1, 0.9), (1, 0.8), (2, 0.7)):
            tb.interval(step, loss=loss, lr=None, samples_per_s=100.0)
    acc = _read(tmp_path / "tb")
    assert _points(acc, "train/loss") == [(1, 0.9), (2, 0.7)]
    assert "train/lr" not in acc.Tags()["scalars"]


def test_device_tensors_are_refused_and_host_tensors_taken(tmp_path: Path) -> None:
    with TensorBoardLog(tmp_path, enabled=True, is_main=True, start_step=0) as tb:
        with pytest.raises(TypeError, match="tensor on meta"):
            tb.interval(1, loss=torch.zeros((), device="meta"), lr=0.1, samples_per_s=1.0)
        tb.interval(2, loss=torch.tensor(0.25), lr=0.1, samples_per_s=1.0)
    assert _points(_read(tmp_path / "tb"), "train/loss") == [(2, 0.25)]


# A first process logs epoch 1 and part of epoch 2, a checkpoint at optimizer step T is implied,
# and it is killed (no close, no flush) at step KILL. Its points are marked by shift=1.
_CRASHED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_tensorboard import _fit_like
from xlatrain.tensorboard import TensorBoardLog
tb = TensorBoardLog({run_dir!r}, enabled=True, is_main=True, start_step=0)
_fit_like(tb, range(1, 3), shift=1.0, stop_at={kill})
os.kill(os.getpid(), signal.SIGKILL)
"""


def _crash(run_dir: Path, kill: int) -> None:
    code = _CRASHED.format(tests=str(Path(__file__).parent), run_dir=str(run_dir), kill=kill)
    proc = subprocess.run([sys.executable, "-c", code], env=script_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr


@pytest.mark.parametrize("checkpoint, kill", [(10, 17), (16, 19), (0, 7)],
                         ids=["epoch-end-checkpoint", "mid-epoch-checkpoint", "no-checkpoint"])
def test_resume_after_a_kill_shows_each_step_once(tmp_path: Path, checkpoint: int, kill: int) -> None:
    _crash(tmp_path, kill)
    crashed = _read(tmp_path / "tb")
    # Everything the killed process logged up to its kill is on disk (each call flushes).
    assert [s for s, _ in _points(crashed, "train/loss")] == [s for s in (3, 6, 9, 13, 16, 19) if s <= kill]

    with TensorBoardLog(tmp_path, enabled=True, is_main=True, start_step=checkpoint) as tb:
        _fit_like(tb, range(checkpoint // STEPS_PER_EPOCH + 1, 3), start=checkpoint)
        tb.hparams(CONFIG, {"val_loss": 0.45}, step=20)

    acc = _read(tmp_path / "tb")
    assert len(list((tmp_path / "tb").iterdir())) == 2
    for tag in INTERVAL_TAGS:
        assert [s for s, _ in _points(acc, tag)] == [3, 6, 9, 13, 16, 19], tag
    for tag in ("val/loss", "epoch/train_loss", "diagnostics/input_bound_share"):
        assert [s for s, _ in _points(acc, tag)] == [10, 20], tag
    # Up to the checkpoint the crashed run's points stay; after it only the resumed run's.
    expected = [(s, round(s / 100 + (1.0 if s <= checkpoint else 0.0), 6)) for s in (3, 6, 9, 13, 16, 19)]
    assert _points(acc, "train/loss") == expected
    assert _served_points(tmp_path / "tb", "train/loss") == expected
    expected_val = [(10, round(0.9 + (1.0 if checkpoint >= 10 else 0.0), 6)), (20, 0.45)]
    assert _points(acc, "val/loss") == expected_val
    assert _served_points(tmp_path / "tb", "val/loss") == expected_val


def test_resume_in_the_crashed_runs_second_still_reads_in_order(tmp_path: Path) -> None:
    """TensorBoard reads a directory's event files in name order, and a name starts with its
    creation second: the resumed file must come after one created in the same second, even by a
    process whose id sorts later."""
    _crash(tmp_path, 17)
    (old,) = (tmp_path / "tb").iterdir()
    same_second = old.with_name(f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.99999999.0")
    os.rename(old, same_second)
    with TensorBoardLog(tmp_path, enabled=True, is_main=True, start_step=10) as tb:
        _fit_like(tb, range(2, 3), start=10)
    names = sorted(p.name for p in (tmp_path / "tb").iterdir())
    assert names[0] == same_second.name
    expected = [(3, 1.03), (6, 1.06), (9, 1.09), (13, 0.13), (16, 0.16), (19, 0.19)]
    assert _points(_read(tmp_path / "tb"), "train/loss") == expected
    assert _served_points(tmp_path / "tb", "train/loss") == expected
