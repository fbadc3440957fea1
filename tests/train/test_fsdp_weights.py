"""Weights written into an FSDP model between forwards reach the next forward: the EMA swapped in
to be scored (and out again), batch norm recomputed for it (``ema_bn_batches``), and
``xlatrain.load_weights`` (tests/scripts/fsdp_weights.py).

fully_shard keeps the root's weights gathered after a forward for the backward that follows; an
evaluation has none, and the next forward used to reuse that gathered copy: the EMA was scored
with the root's live weights (val_ema_loss == val_loss for a model the root holds whole), and
``load_weights`` raised torch's "mixed torch.Tensor and DTensor". Tolerance: 1e-6 relative, as the
EMA's resume test; FSDP against one process or DDP differs by about 1e-7 (reduction order).
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, job_outputs, run_command

SCRIPT = str(SCRIPTS / "fsdp_weights.py")
REL = 1e-6


def _jobs(root, batch, strategies, launcher=(sys.executable,)):
    proc = run_command([*launcher, SCRIPT, str(root), str(batch), *strategies], timeout=600)
    outputs = job_outputs(proc.stdout, strategies)
    found = {}
    for strategy, out in zip(strategies, outputs):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert len(lines) == 1, f"expected one RESULT line from the main process:\n{out}"
        found[strategy] = json.loads(lines[0][len("RESULT "):])
    return found


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """FSDP over a group of one against the model as it is, at the same batch."""
    root = tmp_path_factory.mktemp("one-process")
    return root, _jobs(root, 16, ["single", "fsdp"])


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """DDP and FSDP under torchrun with two processes of half the batch, in one launch."""
    root = tmp_path_factory.mktemp("two-processes")
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    return root, _jobs(root, 8, ["ddp", "fsdp"], [torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone"])


def _same_ema_scores(fsdp, reference):
    for model in ("blocks", "bn"):
        for (loss, ema), (_, ref_ema) in zip(fsdp[model], reference[model], strict=True):
            assert ema == pytest.approx(ref_ema, rel=REL), (model, fsdp[model], reference[model])
            assert ema != pytest.approx(loss, rel=REL), (model, fsdp[model])  # the EMA lags the weights


def _same_best_weights(root, fsdp, reference):
    from safetensors.torch import load_file

    a, b = (load_file(str(root / name / "blocks" / "best.safetensors")) for name in (fsdp, reference))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fsdp_scores_the_ema_weights_as_one_process_does(one_process):
    # The blocks model: FSDP's units and layers the root holds (the root's used to stay live);
    # batch norm: statistics recomputed for the EMA weights (ema_bn_batches) before it is scored.
    root, runs = one_process
    _same_ema_scores(runs["fsdp"], runs["single"])
    _same_best_weights(root, "fsdp", "single")  # monitor="val_ema_loss" picks the same epoch


@pytest.mark.multiprocess
def test_fsdp_in_two_processes_scores_the_ema_weights_as_ddp_does(two_processes):
    root, runs = two_processes
    _same_ema_scores(runs["fsdp"], runs["ddp"])
    _same_best_weights(root, "fsdp", "ddp")


def _loads_the_best_weights(result):
    # best.safetensors holds the EMA weights of the epoch with the lowest val_ema_loss: loaded into
    # the model, the model scores that.
    best = min(ema for _, ema in result["blocks"])
    assert isinstance(result["loaded"], float), result["loaded"]
    assert result["loaded"] == pytest.approx(best, rel=REL), result
    # strict=True: a file that lacks a weight is refused, naming it, as load_state_dict does.
    assert "Missing key(s)" in result["partial"] and "head.bias" in result["partial"], result["partial"]


def test_load_weights_puts_a_weights_file_into_a_sharded_model(one_process):
    _, runs = one_process
    for strategy in ("single", "fsdp"):
        _loads_the_best_weights(runs[strategy])


@pytest.mark.multiprocess
def test_load_weights_puts_a_weights_file_into_a_model_sharded_over_two_processes(two_processes):
    _, runs = two_processes
    for strategy in ("ddp", "fsdp"):
        _loads_the_best_weights(runs[strategy])
