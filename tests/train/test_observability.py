"""What a fit leaves to look at, through the real Trainer: TensorBoard events, a profiler trace,
torch.compile findings, and progress that reads the device no more often than plain lines."""

import functools
import json
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import SCRIPTS, run_command
from xlatrain import CheckpointConfig, TrainConfig, Trainer


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _trainer(run_dir, model=None, **cfg):
    torch.manual_seed(0)
    cfg = {"epochs": 2, "batch_size": 4, "log_every": 2, "run_dir": str(run_dir), **cfg}
    return Trainer(model or nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                   config=TrainConfig(**cfg), checkpoint=CheckpointConfig(every_steps=3), accelerator="cpu")


def _scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_fit_writes_tensorboard_curves_and_hparams(tmp_path):
    _trainer(tmp_path).fit(_data(40), _data(12, 1))  # 10 steps per epoch, log_every 2
    tags = _scalars(tmp_path)
    # Each interval, the epoch's last step included (heard from the epoch-end read: no extra read).
    assert tags["train/loss"] == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert tags["val/loss"] == [10, 20] and tags["val/accuracy"] == [10, 20]
    assert tags["hparams/val_loss"] == [20]
    _trainer(tmp_path / "off", tensorboard=False).fit(_data(40))
    assert not (tmp_path / "off" / "tb").exists()


def test_a_resumed_run_continues_its_curves_without_gaps_or_repeats(tmp_path):
    """SIGTERM mid-run, then the same command again: every step once on the axis."""
    import signal
    import subprocess

    from conftest import script_env
    from warm import popen as warm_popen

    args = [sys.executable, str(SCRIPTS / "resumable.py"), str(tmp_path), "2", "5", "0.01"]
    proc = warm_popen(args, script_env(), stderr=subprocess.STDOUT)
    for line in proc.stdout:
        if "epoch 1 step 8/12" in line:
            proc.send_signal(signal.SIGTERM)
            break
    proc.communicate(timeout=120)
    run_command(args[:5] + ["0"])
    tags = _scalars(tmp_path)
    assert tags["train/loss"] == list(range(1, 25)), tags["train/loss"]  # each epoch's last step included
    assert tags["val/loss"] == [12, 24]


def test_profile_steps_trace_the_chosen_steps_and_change_no_number(tmp_path):
    plain = _trainer(tmp_path / "plain").fit(_data(40), _data(12, 1))
    traced = _trainer(tmp_path / "traced", profile_steps=(3, 6)).fit(_data(40), _data(12, 1))
    for a, b in zip(plain, traced):
        assert (a["train_loss"], a["val_loss"]) == (b["train_loss"], b["val_loss"])
    summary = json.loads((tmp_path / "traced" / "profile" / "summary.json").read_text())
    assert summary["steps"] == [3, 6] and summary["num_steps"] == 4
    trace = next((tmp_path / "traced" / "profile").glob("*.json"))
    assert "aten::addmm" in trace.read_text()


def test_a_profile_window_the_run_cannot_reach_is_said_before_the_first_step(tmp_path, caplog):
    caplog.set_level("INFO", logger="xlatrain")
    _trainer(tmp_path / "late", profile_steps=(25, 30)).fit(_data(40), _data(12, 1))  # 2 epochs of 10 steps
    said = [r.getMessage() for r in caplog.records]
    note = next(i for i, m in enumerate(said) if m.startswith(
        "note: profile_steps=(25, 30) lies past this run's last step, 20 (2 epoch(s) x 10 steps): nothing will be traced"))
    assert note < next(i for i, m in enumerate(said) if m.startswith("epoch 1/2"))  # before the first step
    assert not (tmp_path / "late" / "profile").exists()

    caplog.clear()
    _trainer(tmp_path / "tail", profile_steps=(18, 30)).fit(_data(40), _data(12, 1))  # reaches 18-20
    assert "note: profile_steps" not in caplog.text
    assert json.loads((tmp_path / "tail" / "profile" / "summary.json").read_text())["steps"] == [18, 20]

    caplog.clear()  # three epochs, going on after the two above: steps 21-30
    _trainer(tmp_path / "tail", epochs=3, profile_steps=(3, 6)).fit(_data(40), _data(12, 1), resume="auto")
    assert "note: profile_steps=(3, 6) ran before this run resumed at step 21: nothing will be traced" in caplog.text


def test_a_compiled_fit_reports_a_graph_break_by_file_and_line(tmp_path):
    class Chatty(nn.Linear):
        def forward(self, x):
            print("forward")  # a graph break
            return super().forward(x)

    _trainer(tmp_path, model=Chatty(4, 2), compile=True).fit(_data(40), _data(12, 1))
    report = json.loads((tmp_path / "diagnostics.json").read_text())
    breaks = [f for f in report["findings"] if f["code"] == "graph-break"]
    assert breaks and "test_observability.py" in breaks[0]["title"], report["findings"]
    assert report["torch_compile"]["graph_breaks"] >= 1


@pytest.mark.xla
def test_the_progress_bar_reads_the_device_as_often_as_plain_lines(tmp_path):
    """In a pseudo-terminal the bar is drawn; on XLA:CPU, where every device read is counted
    (torch_xla's transfer metric), the reads per epoch match a piped run's."""
    import os
    import pty
    import subprocess

    from conftest import script_env

    reads = {}
    for mode in ("pty", "pipe"):
        run_dir = tmp_path / mode
        cmd = [sys.executable, str(SCRIPTS / "resumable.py"), str(run_dir), "2", "100", "0", "xla", "1"]
        if mode == "pty":
            leader, follower = pty.openpty()
            proc = subprocess.Popen(cmd, stdout=follower, stderr=follower, env=script_env({"PJRT_DEVICE": "CPU"}),
                                    stdin=subprocess.DEVNULL)
            os.close(follower)
            out = b""
            while True:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
            os.close(leader)
            proc.wait(timeout=120)
            text = out.decode(errors="replace")
            assert "\r" in text and "samples/s" in text and "it/s" not in text.split("HISTORY")[-1]
        else:
            text = run_command(cmd, env={"PJRT_DEVICE": "CPU"}).stdout
            assert "\r" not in text
        reads[mode] = json.loads((run_dir / "diagnostics.json").read_text())["epochs"]
    assert [e["host_reads"] for e in reads["pty"]] == [e["host_reads"] for e in reads["pipe"]]
    # resumable.py logs every step: every read is a planned one, with or without the bar.
    assert all(e["host_reads"] - e["planned_reads"] <= 0 for e in reads["pty"])


def test_tracing_steps_on_a_cpu_prints_no_profiler_library_noise(tmp_path):
    """torch's CUDA build logs 'gpuGetDeviceCount failed' as an ERROR when it profiles on a machine
    without a GPU, and its start and stop; nothing is wrong, so a CPU run keeps that quiet."""
    import subprocess
    import sys

    from conftest import script_env

    proc = subprocess.run(
        [sys.executable, "-m", "xlatrain.cli", "fit", "configs/digits.yaml", "--set", "trainer.epochs=1",
         "--set", "data.image_size=16", "--set", f"trainer.run_dir={tmp_path}", "--set", "trainer.profile_steps=[3,5]",
         "--set", "backend.accelerator=cpu"],
        capture_output=True, text=True, timeout=300, env=script_env(), cwd=str(__import__("pathlib").Path(__file__).parents[2]),
    )
    assert proc.returncode == 0, proc.stderr
    assert "profile: steps 3-5 traced" in proc.stdout
    assert "gpuGetDeviceCount" not in proc.stderr and "USDT:" not in proc.stderr, proc.stderr
