"""What a requeue script can rely on when a scheduler stops a run with SIGTERM, under each launcher:
the exit status of what it started, and ``RUN_DIR/status.json``, which says ``preempted`` (with the
checkpoint the same command resumes from) once that checkpoint is complete, ``finished`` at the end,
``failed`` with the error, or ``running`` still (killed before it could write)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_script, script_env
from xlatrain.checkpoint import read_checkpoint

RESUMABLE = str(SCRIPTS / "resumable.py")


def _stop_at(cmd, needle, env=None, sig=signal.SIGTERM):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=script_env(env), stdin=subprocess.DEVNULL)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            proc.send_signal(sig)
            break
    out = "".join(lines) + proc.communicate(timeout=180)[0]
    return proc.returncode, out


def _status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def _preempted_resumable(run_dir: Path) -> None:
    status = _status(run_dir)
    assert status["state"] == "preempted" and status["signal"] == "SIGTERM", status
    read_checkpoint(run_dir / "checkpoints" / status["checkpoint"])  # complete and loadable


def test_plain_python_exits_0_on_sigterm_and_says_preempted_then_finished(tmp_path):
    code, out = _stop_at([sys.executable, RESUMABLE, str(tmp_path), "2", "100", "0.02"], "epoch 1 step 4/")
    assert code == 0, out
    _preempted_resumable(tmp_path)
    run_script([sys.executable, RESUMABLE, str(tmp_path), "2", "100", "0"])
    assert _status(tmp_path)["state"] == "finished"


def test_a_failed_run_says_failed_with_its_error(tmp_path):
    proc = subprocess.run([sys.executable, "-c", f"""
import torch, xlatrain
from torch import nn
def bad(out, y):
    raise RuntimeError("the loss broke")
data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
xlatrain.Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.1), backend="cpu",
                 config=xlatrain.TrainConfig(epochs=1, batch_size=4, run_dir={str(tmp_path)!r}, tensorboard=False),
                 callbacks=[type("C", (), {{"on_epoch_start": lambda self, t, e: (_ for _ in ()).throw(RuntimeError("the callback broke"))}})()],
                 ).fit(data)
"""], env=script_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "the callback broke" in proc.stderr
    status = _status(tmp_path)
    assert status["state"] == "failed" and "the callback broke" in status["error"]


@pytest.mark.multiprocess
def test_under_torchrun_the_workers_exit_0_torchrun_exits_1_and_status_says_preempted(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    code, out = _stop_at([torchrun, "--nproc-per-node", "2", "--standalone", RESUMABLE, str(tmp_path), "2", "100",
                          "0.02", "cpu", "2"], "epoch 1 step 3/")
    # torchrun forwards the signal, waits for its workers (each checkpoints and exits 0), then
    # exits 1 by its own design (SignalException): a requeue script reads status.json instead.
    assert code == 1 and "SignalException" in out and "ChildFailedError" not in out, out
    _preempted_resumable(tmp_path)


@pytest.mark.xla
def test_under_xlatrain_spawn_sigterm_ends_the_process_and_the_run_resumes_from_its_last_checkpoint(tmp_path):
    """torch_xla trains in a thread of each process it starts, where no signal handler can be
    installed: the launcher passes SIGTERM on and waits, the process ends without a checkpoint of
    its step, the launch exits 1, status.json still says running, and the same command resumes."""
    script = [sys.executable, str(SCRIPTS / "spawn_stoppable.py"), str(tmp_path)]
    code, out = _stop_at(script, "epoch 1 step 6/", env={"PJRT_DEVICE": "CPU"})
    assert code == 1 and "terminated abruptly" in out, out
    assert _status(tmp_path)["state"] == "running"
    assert list((tmp_path / "checkpoints").glob("step-*"))  # the periodic ones it wrote before
    resumed = run_script(script, env={"PJRT_DEVICE": "CPU"})
    assert len(resumed) == 3 and _status(tmp_path)["state"] == "finished"
