"""Resume is bit-exact whatever fetches the batches: random augmentation in the dataset and in a
mixup collate, dropout in the model, 0, 2 or "auto" decode workers, killed with SIGKILL in the
middle of an epoch or after one, in one process and under torchrun. Each batch draws from a seed of
(seed, epoch, step, process), so it is the same batch however many workers made it and wherever
a run restarted."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import SCRIPTS, run_script, script_env
from warm import popen as warm_popen

SCRIPT = str(SCRIPTS / "augmented_fit.py")
TIMING = ("samples_per_s", "tokens_per_s", "mfu", "epoch_time_s", "input_bound_share", "warmup_s")


def _numbers(history):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in history]


def _kill_at(cmd, needle, cwd_env=None):
    """Start ``cmd`` in a session of its own, SIGKILL it and everything it started once a line
    holds ``needle``."""
    proc = warm_popen(cmd, script_env(), stderr=subprocess.STDOUT, start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.communicate(timeout=120)
    assert any(needle in line for line in seen), "".join(seen)
    return "".join(seen)


def _same_run(run_dir, reference_dir, history, reference):
    assert _numbers(history) == _numbers(reference)
    a, b = load_file(run_dir / "final.safetensors"), load_file(reference_dir / "final.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole")
    return run_dir, run_script([sys.executable, SCRIPT, str(run_dir), "0"])


@pytest.mark.parametrize("workers, kill_after", [("0", "epoch 2 step 5/"), ("2", "epoch 2 step 5/"),
                                                 ("auto", "epoch 1/3 ")])
def test_a_run_killed_and_resumed_is_the_uninterrupted_run_with_any_workers(uninterrupted, tmp_path, workers, kill_after):
    reference_dir, reference = uninterrupted
    cut = tmp_path / "cut"
    out = _kill_at([sys.executable, SCRIPT, str(cut), workers, "0.01"], kill_after)
    assert "HISTORY" not in out
    resumed = run_script([sys.executable, SCRIPT, str(cut), workers])
    _same_run(cut, reference_dir, resumed, reference)


def test_workers_do_not_change_the_batches(uninterrupted, tmp_path):
    reference_dir, reference = uninterrupted
    two = run_script([sys.executable, SCRIPT, str(tmp_path), "2"])
    _same_run(tmp_path, reference_dir, two, reference)


@pytest.mark.multiprocess
def test_under_torchrun_a_killed_run_resumes_bit_exact_with_workers(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    launcher = [torchrun, "--nproc-per-node", "2", "--standalone"]
    whole = run_script([*launcher, SCRIPT, str(tmp_path / "whole"), "1"])
    cut = tmp_path / "cut"
    _kill_at([*launcher, SCRIPT, str(cut), "1", "0.01"], "epoch 2 step 2/")
    resumed = run_script([*launcher, SCRIPT, str(cut), "1"])
    _same_run(cut, tmp_path / "whole", resumed, whole)
