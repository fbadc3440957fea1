"""What split a graph or read the device, named as what it was: a host copy (print(t), .cpu()), an op
that ran on the CPU, a read in a callback after an epoch's end; reads too few for a finding listed.

The rules run against a scripted stand-in for torch_xla's counters (fast, in the current-torch
environment); the counters they rely on, and a real fit, are checked on XLA:CPU (marked xla).
"""

import json
import re
import sys
import textwrap
import time

import pytest
import torch

from conftest import SCRIPTS, run_command
from xlatrain.diagnostics import xla_metrics
from xlatrain.diagnostics.run import DiagnosticsError, RunDiagnostics


class _Counters:
    """torch_xla's process counters as the diagnostics read them, moved by hand."""

    def __init__(self):
        self.compiled = self.scalar = self.copies = 0
        self.transfers: list[float] = []
        self.fallback: dict[str, int] = {}

    # what xla_metrics gives the diagnostics
    def step_counters(self):
        return self.compiled, self.scalar, self.copies

    def transfers_since(self, wall_time):
        return sum(1 for t in self.transfers if t > wall_time)

    def fallback_counts(self):
        return dict(self.fallback)

    def snapshot(self):
        return {"compile_count": self.compiled, "compile_s": 0.0, "transfer_from_device_count": len(self.transfers),
                "scalar_reads": self.scalar, "cpu_fallback_ops": dict(self.fallback),
                "persistent_cache_deserialize_failure": 0}

    diff = staticmethod(xla_metrics.diff)

    def compile_seconds(self):
        return 0.0

    def is_spmd(self):
        return False

    def debug_file(self):
        return None

    # what a run does
    def _transfer(self):
        self.transfers.append(time.time())

    def print_tensor(self, graphs=2):
        self.compiled += graphs
        self._transfer()

    def item(self, graphs=0):
        self.compiled += graphs
        self.scalar += 1
        self.copies += 1
        self._transfer()

    def fallback_op(self, name, graphs=2):
        self.compiled += graphs
        self.copies += 1
        self.fallback[name] = self.fallback.get(name, 0) + 1
        self._transfer()


class _Runtime:
    platform = "cpu"
    planned_reads = 0

    def __init__(self, counters):
        self.evidence = counters


class _Strategy:
    num_processes = 1


STEPS = 8


def _fit(tmp_path, counters, *, epochs=3, at=None, after_end=None, strict=False, eval_shapes=None):
    """A fit of ``epochs`` x STEPS training steps; ``at[(epoch, step)]`` runs in that step,
    ``after_end(epoch)`` after each epoch's end (the on_epoch_end callbacks' place). Returns the report."""
    at = at or {}
    diag = RunDiagnostics(_Runtime(counters), _Strategy(), per_device_batch=4, strict=strict)
    for epoch in range(1, epochs + 1):
        for step, _ in enumerate(diag.timed([torch.zeros(4, 3)] * STEPS, "train", epoch), start=1):
            if epoch == 1 and step <= 2:
                counters.compiled += 1  # the warm-up a clean run compiles
            at.get((epoch, step), lambda: None)()
        if eval_shapes is not None:
            for step, _ in enumerate(diag.timed([torch.zeros(s, 3) for s in eval_shapes[epoch - 1]], "eval", 0), 1):
                if epoch == 1 and step <= 2:
                    counters.compiled += 1
                at.get((epoch, f"eval{step}"), lambda: None)()
        diag.end_epoch(epoch)
        if after_end is not None:
            after_end(epoch)
    return diag.finish(tmp_path, is_main=True)


def _finding(report, code):
    found = [f for f in report["findings"] if f["code"] == code]
    assert found, f"no {code} finding in {report['findings']}"
    return found[0]


def test_a_print_of_a_tensor_in_the_step_is_named_as_a_host_copy_not_a_python_number(tmp_path):
    c = _Counters()
    report = _fit(tmp_path, c, at={(1, 5): c.print_tensor})
    found = _finding(report, "recompilation-after-warmup")
    assert ("epoch 1, train step 5: 2 graph(s), 0.00 s; the step copied a device tensor to the host 1 time(s) beyond "
            "the Trainer's planned reads (print(t), t.cpu(), .tolist(), .numpy())") in found["evidence"], found
    assert found["fix"].startswith("Remove print(t), t.cpu(), t.tolist() and t.numpy()")
    assert "Python number" not in found["fix"]


def test_an_op_that_ran_on_the_cpu_is_named_by_its_counter_as_what_split_the_graph(tmp_path):
    c = _Counters()
    c.fallback["aten::nonzero"] = 3  # ran before the fit: not this step's
    report = _fit(tmp_path, c, at={(2, 3): lambda: c.fallback_op("aten::linalg_eig")})
    found = _finding(report, "recompilation-after-warmup")
    assert "epoch 2, train step 3: 2 graph(s), 0.00 s; the step ran aten::linalg_eig on the CPU (1 call(s)" \
        in found["evidence"], found
    assert "Replace aten::linalg_eig with ops XLA lowers" in found["fix"] and "Python number" not in found["fix"]


def test_a_read_in_a_callback_after_each_epoch_is_booked_after_that_epoch_and_the_last_one_counted(tmp_path):
    c = _Counters()
    # The read compiles its graph after epoch 1's end; later epochs reuse it.
    report = _fit(tmp_path, c, after_end=lambda epoch: c.item(graphs=1 if epoch == 1 else 0))
    found = _finding(report, "recompilation-after-warmup")
    assert found["evidence"].startswith(
        "after epoch 1's end: 1 graph(s), 0.00 s; code run after the epoch's end (on_epoch_end and on_epoch_start "
        "callbacks) read a device value 1 time(s)"), found
    assert "epoch 2" not in found["evidence"] and "from the model and loss" not in found["fix"]
    assert "on_epoch_end receives" in found["fix"]
    # Each epoch's rows hold its own steps' reads; the callback's are after it, the last one's too.
    assert [e["after_end"]["scalar_reads"] for e in report["epochs"]] == [1, 1, 1]
    assert all(e["scalar_reads"] == 0 for e in report["epochs"])
    assert any(n.startswith("device reads after epochs' ends: 3 unplanned read(s) after the end of epoch(s) 1-3")
               for n in report["notes"]), report["notes"]


def test_strict_stops_a_callback_read_after_the_epoch_it_follows(tmp_path):
    c = _Counters()
    with pytest.raises(DiagnosticsError, match=r"^strict: after epoch 2's end .* read the device 1 time\(s\)"):
        _fit(tmp_path, c, strict=True, after_end=lambda epoch: c.item(graphs=0) if epoch == 2 else None)
    # The last epoch's read is judged at the fit's end, once the report is written.
    c = _Counters()
    with pytest.raises(DiagnosticsError, match=r"^strict: after epoch 3's end"):
        _fit(tmp_path, c, strict=True, after_end=lambda epoch: c.item(graphs=0) if epoch == 3 else None)
    assert json.loads((tmp_path / "diagnostics.json").read_text())["epochs"][-1]["after_end"]["scalar_reads"] == 1


def test_reads_fewer_than_one_per_two_steps_are_listed_in_a_note(tmp_path):
    c = _Counters()
    report = _fit(tmp_path, c, at={(e, s): c.item for e in (1, 2, 3) for s in (4, 8)})  # 6 reads, 24 steps
    assert "host-sync-per-step" not in {f["code"] for f in report["findings"]}
    note = [n for n in report["notes"] if n.startswith("device reads: ")]
    assert note and note[0].startswith("device reads: 6 unplanned device read(s) in 24 training step(s), fewer than "
                                       "one per two training steps"), report["notes"]
    assert "6 were .item()/float()/bool()" in note[0] and "Remove .item()" in note[0]


def test_a_shape_new_to_a_passs_first_step_is_named_as_new_inputs(tmp_path):
    # Evaluation's last batch of epoch 1 is narrower; epoch 2's evaluation begins with that shape,
    # the same as the batch before it, but no pass began with it: its first step compiles.
    c = _Counters()
    report = _fit(tmp_path, c, epochs=2, eval_shapes=[(4, 4, 2), (2, 4, 4)],
                  at={(1, "eval3"): lambda: setattr(c, "compiled", c.compiled + 1),
                      (2, "eval1"): lambda: setattr(c, "compiled", c.compiled + 1)})
    evidence = _finding(report, "recompilation-after-warmup")["evidence"]
    assert ("epoch 2, eval step 1: 1 graph(s), 0.00 s; new input shapes or dtypes: batch tensor 0 shape [4, 3] -> "
            "[2, 3] (a ragged batch): no earlier pass began with this shape") in evidence, evidence
    assert "graph changed inside the step" not in evidence


# --- on XLA:CPU ---------------------------------------------------------------------------------

_COUNTERS = textwrap.dedent("""
    import json, io, time, torch, torch_xla
    from xlatrain.diagnostics import xla_metrics as xm
    dev = torch_xla.device()
    x = torch.randn(4, 4, device=dev)
    torch_xla.sync()
    out = {}
    for name, read in (("print", lambda t: print(t, file=io.StringIO())), ("cpu", lambda t: t.cpu()),
                       ("tolist", lambda t: t.tolist()), ("numpy", lambda t: t.cpu().numpy()),
                       ("item", lambda t: t.mean().item()),
                       ("eigvals", lambda t: torch.linalg.eigvals(t[:2, :2]).real.sum())):
        before, since = xm.step_counters(), time.time()
        read(x * len(out) + 1)
        after = xm.step_counters()
        out[name] = {"transfers": xm.transfers_since(since), "scalar": after[1] - before[1],
                     "copies": after[2] - before[2]}
    out["fallback"] = xm.fallback_counts()
    print("COUNTERS " + json.dumps(out))
""")


@pytest.mark.xla
def test_the_counters_the_attribution_reads_exist_and_move_on_xla(tmp_path):
    script = tmp_path / "counters.py"
    script.write_text(_COUNTERS)
    proc = run_command([sys.executable, str(script)], env={"PJRT_DEVICE": "CPU"})
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("COUNTERS "))
    got = json.loads(line[len("COUNTERS "):])
    for read in ("print", "cpu", "tolist", "numpy"):  # a host copy: a transfer, no scalar read, no CPU op
        assert got[read] == {"transfers": 1, "scalar": 0, "copies": 0}, (read, got)
    assert got["item"] == {"transfers": 1, "scalar": 1, "copies": 1}, got
    assert got["eigvals"]["transfers"] >= 1 and got["eigvals"]["copies"] - got["eigvals"]["scalar"] >= 1, got
    assert got["fallback"].get("aten::linalg_eig") == 1 and "aten::_local_scalar_dense" not in got["fallback"]


@pytest.mark.xla
def test_a_fit_on_xla_names_a_print_an_op_on_the_cpu_and_a_callback_read(tmp_path):
    proc = run_command([sys.executable, str(SCRIPTS / "attribution_fit.py"), str(tmp_path / "run")],
                       env={"PJRT_DEVICE": "CPU", "XLATRAIN_CACHE_DIR": str(tmp_path / "cache")})
    report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("HISTORY "))[len("HISTORY "):])
    evidence = _finding(report, "recompilation-after-warmup")["evidence"]
    # (The step numbers are the forwards' count less the checks before the first step.)
    assert re.search(r"epoch 1, train step \d+: \d graph\(s\), [\d.]+ s; the step copied a device tensor to the "
                     r"host 1 time\(s\)", evidence), evidence
    assert re.search(r"epoch 2, train step \d+: 2 graph\(s\), [\d.]+ s; the step ran aten::linalg_eig on the CPU "
                     r"\(1 call\(s\)", evidence), evidence
    assert "after epoch 1's end: 1 graph(s)" in evidence and "code run after the epoch's end" in evidence
    assert "graph changed inside the step" not in evidence, evidence
    assert [e["after_end"]["host_reads"] - e["after_end"]["planned_reads"] for e in report["epochs"]] == [1, 1, 1]
    assert any(n.startswith("device reads: 2 unplanned device read(s) in 24 training step(s)") for n in report["notes"])
