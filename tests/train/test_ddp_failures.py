"""Failures under torchrun DDP that xlatrain must explain truthfully: a parameter no gradient
reaches (found by the dry run and handed to DDP, or named when it misses one later), and a
process whose collective fails because another process failed first."""

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import SCRIPTS, run_bounded, run_command, script_env
from xlatrain.train.checks import error_hints, failed_collective, failure_status


def _torchrun(case: str, run_dir: Path) -> list[str]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun is installed with torch"
    return [torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
            str(SCRIPTS / "ddp_failures.py"), case, str(run_dir)]


def _failing(case: str, run_dir: Path) -> str:
    proc = run_bounded(_torchrun(case, run_dir), script_env(), 300)
    assert proc.returncode != 0, proc.stdout[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.multiprocess
def test_a_parameter_the_forward_never_uses_trains_under_ddp_and_the_header_says_so(tmp_path):
    """torch's DDP stopped at epoch 1 step 2 ("Expected to have finished reduction ..."), naming a
    keyword xlatrain gave no way to pass. The dry run's backward finds the head without a gradient
    and DDP is wrapped with find_unused_parameters=True, which the header says, with the names."""
    proc = run_command(_torchrun("unused", tmp_path))
    history = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("HISTORY ")][0][len("HISTORY "):])
    assert [r["epoch"] for r in history] == [1, 2]
    header = [ln for ln in proc.stdout.splitlines() if ln.startswith("xlatrain: ")][0]
    assert "DDP over 2 processes (find_unused_parameters=True: 2 trainable parameter(s)" in header, header
    assert "aux.bias, aux.weight" in header and "requires_grad_(False)" in header, header


@pytest.mark.multiprocess
def test_a_parameter_missed_only_at_a_later_step_is_named_with_the_fix(tmp_path):
    """The head is used by the dry run's batch and skipped later: DDP is not told, and its error at
    the next step gets a note naming the parameters (from DDP's indices) and what to do."""
    out = _failing("unused_later", tmp_path)
    assert "Expected to have finished reduction in the prior iteration" in out
    assert "find_unused_parameters=True:" not in out  # the dry run found nothing unused
    note = [ln for ln in out.splitlines() if "xlatrain: DDP waits each step" in ln]
    assert note, out[-4000:]
    assert "aux.weight, aux.bias got none in the step before this one" in note[0]
    assert "requires_grad_(False)" in note[0] and "0 * their output" in note[0]


@pytest.mark.multiprocess
def test_a_peers_failure_is_not_recorded_as_this_processs_own(tmp_path):
    """Rank 1's dataset raises in epoch 2; rank 0's backward then fails in gloo ("Connection closed
    by peer"). Its note and status.json said it was rank 0's error, in rank 0's batch."""
    out = _failing("peer_fails", tmp_path)
    assert "KeyError: 'bad sample" in out  # rank 1's own error is printed, under [rank1]:
    rank0 = [ln for ln in out.splitlines() if ln.startswith("[rank0]: xlatrain:")]
    assert any("another process failed first" in ln and "epoch 2 step 1" in ln for ln in rank0), rank0
    assert not any("sample indices" in ln for ln in rank0), rank0
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "failed"
    assert status["error"].startswith("another process failed first"), status
    assert "[rankN]: lines" in status["error"] and "this process saw RuntimeError" in status["error"], status


def test_failed_collectives_are_told_from_other_errors():
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:7390. This is ...")
    assert failed_collective(gloo) == "peer"
    assert failed_collective(RuntimeError("Read error [127.0.0.1]:1: Connection reset by peer")) == "peer"
    assert failed_collective(torch.distributed.DistBackendError("NCCL error in: ..., unhandled system error")) \
        == "collective"
    assert failed_collective(KeyError("bad sample")) is None
    assert failed_collective(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert failure_status(KeyError("bad sample")) == "KeyError: 'bad sample'"
    said = failure_status(gloo)
    assert said.startswith("another process failed first") and said.endswith(str(gloo)[:1000])
    assert failure_status(gloo) == said and sum("another process" in n for n in gloo.__notes__) == 1  # noted once


def test_ddps_unused_parameter_error_is_named_from_its_indices_or_its_names():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)  # not in DDP's reducer, so not counted in its indices
    trainer = SimpleNamespace(model=model, strategy=SimpleNamespace(unwrap=lambda m: m))
    head = "Expected to have finished reduction in the prior iteration before starting a new one. ..."
    indices = RuntimeError(f"{head}\nParameter indices which did not receive grad for rank 1: 2 3\n In addition ...")
    hint = [h for h in error_hints(indices, trainer) if "DDP waits" in h]
    assert len(hint) == 1 and "2.weight, 2.bias got none" in hint[0], hint
    detail = RuntimeError(f"{head}\nParameters which did not receive grad for rank 0: 2.bias, 2.weight\n")
    assert "2.bias, 2.weight got none" in error_hints(detail, trainer)[0]
