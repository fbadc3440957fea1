"""Run diagnostics: each cause planted in a real fit is named with its epoch, step, graph and cause.

The XLA tests fit on real XLA:CPU in fresh processes (tests/scripts/diag_fit.py, bad_loop.py);
the platform rules and the Backend contract are tested in the current-torch environment.
"""

import json
import re
import sys

import pytest

from conftest import SCRIPTS, run_command, run_script
from xlatrain.diagnostics.run import INPUT_BOUND_SHARE, XLA_INPUT_BOUND_SHARE, RunDiagnostics

ENV = {"PJRT_DEVICE": "CPU"}


def _fit(tmp_path, name, cause, accelerator="xla", env=None):
    """Run diag_fit.py; returns (diagnostics.json, the report's console lines)."""
    args = [sys.executable, str(SCRIPTS / "diag_fit.py"), str(tmp_path / name), cause, accelerator]
    proc = run_command(args, env={**ENV, "XLATRAIN_CACHE_DIR": str(tmp_path / "cache"), **(env or {})})
    lines = [ln[len("REPORT "):] for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    history = [ln for ln in proc.stdout.splitlines() if ln.startswith("HISTORY ")]
    return json.loads(history[0][len("HISTORY "):]), lines


def _finding(report, code):
    found = [f for f in report["findings"] if f["code"] == code]
    assert found, f"no {code} finding in {report['findings']}"
    return found[0]


@pytest.mark.xla
def test_a_bad_loop_names_each_cause_and_a_good_loop_is_clean(tmp_path):
    bad = run_script([sys.executable, str(SCRIPTS / "bad_loop.py"), str(tmp_path / "bad"), "bad"], env=ENV)
    by_code = {f["code"]: f for f in bad["findings"]}
    shape = by_code["input-shape-change"]["evidence"]
    assert "train from epoch 1 step 3 (3x): batch tensor 0 shape [16, 1, 8, 8] -> [16, 1, 12, 12]" in shape
    assert "[16] -> [3] (a ragged batch)" in shape  # the short last batch
    sync = by_code["host-sync-per-step"]
    reads = re.match(r"(\d+) unplanned device read\(s\) in (\d+) training step\(s\) and \d+ evaluation step", sync["title"])
    assert reads and int(reads[1]) >= int(reads[2]) and ".item()" in sync["evidence"], sync["title"]
    compiled = by_code["recompilation-after-warmup"]["evidence"]
    assert "epoch 1, train step 1: 2 graph(s) where a clean run compiles 1" in compiled
    assert "epoch 1, train step 3: 2 graph(s)" in compiled and "new input shapes" in compiled
    assert "epoch 1, train step 4: 2 graph(s)" in compiled and "(a ragged batch)" in compiled
    assert not bad["clean"]

    good = run_script([sys.executable, str(SCRIPTS / "bad_loop.py"), str(tmp_path / "good"), "good"], env=ENV)
    assert good["clean"] and good["findings"] == []
    assert all(e["compilations"] == 0 for e in good["epochs"][1:])
    assert all(e["host_reads"] == e["planned_reads"] for e in good["epochs"])


@pytest.mark.xla
def test_strict_raises_on_the_bad_loop_only(tmp_path):
    bad = run_command([sys.executable, str(SCRIPTS / "bad_loop.py"), str(tmp_path / "bad"), "bad", "strict"], env=ENV)
    # Its first epoch already recompiles and reads the device every step: said there, not an epoch later.
    assert "STRICT strict: epoch 1, after its warm-up: " in bad.stdout and "unplanned device read(s) in" in bad.stdout
    good = run_command([sys.executable, str(SCRIPTS / "bad_loop.py"), str(tmp_path / "good"), "good", "strict"], env=ENV)
    assert "STRICT" not in good.stdout and "HISTORY" in good.stdout


@pytest.mark.xla
def test_a_clean_fit_compiles_only_its_warm_up_and_says_each_notice_once(tmp_path):
    clean, lines = _fit(tmp_path, "clean", "clean")
    assert clean["clean"] and clean["findings"] == [], clean["findings"]
    assert lines[0] == "diagnostics: clean (no recompilation after warm-up, no unplanned device reads, no CPU fallbacks)"
    assert sum("not judged on XLA:CPU" in ln for ln in lines) == 1  # said once, in the note that says why
    # Everything compiled in epoch 1, at the places a clean fit compiles: nothing was extra.
    events = clean["compilations"]
    assert events and all(e["epoch"] == 1 and e["graphs"] == e["expected"] for e in events), events
    assert [e["compilations"] for e in clean["epochs"][1:]] == [0, 0]
    # Evaluation's first graph compiles in the dry run, before the run (its path runs on two rows there).
    assert any("warm-up:" in n and "train steps 1, 2" in n for n in clean["notes"])
    assert not any("compile cache" in n for n in clean["notes"])  # a fresh cache: written, nothing to load

    # The same fit again, fed by a loader that sleeps: the warm cache cannot load on XLA:CPU, and
    # the wait for batches is no evidence there.
    slow, lines = _fit(tmp_path, "slow", "slow")
    assert slow["input_bound_share"] > XLA_INPUT_BOUND_SHARE  # waited most of the time ...
    assert slow["clean"] and "input-bound" not in {f["code"] for f in slow["findings"]}  # ... and is not judged
    assert sum("input pipeline: not judged on XLA:CPU" in ln for ln in lines) == 1
    cache = [ln for ln in lines if "compile cache" in ln]
    assert len(cache) == 1 and re.search(r"compile cache: \d+ entries could not be loaded on XLA:CPU", cache[0])
    assert "every run recompiles there" in cache[0]
    assert sum("GSPMD" in ln for ln in lines) == 1  # said once, not once per compilation


@pytest.mark.xla
def test_a_skipped_first_step_under_skip_step_moves_the_warm_up_a_step_on_and_strict_lets_the_run_finish(tmp_path):
    """skip_step drops the momentum a NaN first step made; the next step makes it again (its host
    read with it) and the steady graph compiles a step later. That is the warm-up, said so: not
    compilations a clean run would not make, blamed on .item() in the user's code, and a strict
    run is not stopped for it."""
    report, lines = _fit(tmp_path, "nan_first", "nan_first")
    assert report["clean"] and report["findings"] == [], report["findings"]
    events = report["compilations"]
    assert all(e["graphs"] == e["expected"] for e in events), events
    warm = [n for n in report["notes"] if n.startswith("warm-up:")]
    assert len(warm) == 1 and "train steps 1-3" in warm[0] and "as a clean run does but a step later: skip_step" in warm[0]
    assert [e["compilations"] for e in report["epochs"][1:]] == [0, 0]


@pytest.mark.xla
def test_an_ema_scored_and_written_each_epoch_compiles_nothing_after_the_first(tmp_path):
    """Swapping the EMA weights in and out left copies pending that joined the next graph (an
    evaluation batch, a weights file's read), which differed from epoch to epoch: 2 graphs
    compiled again in epoch 2 and a strict run stopped there."""
    report, _ = _fit(tmp_path, "ema", "ema")
    assert report["clean"] and report["findings"] == [], report["findings"]
    assert [e["compilations"] for e in report["epochs"][1:]] == [0, 0]


@pytest.mark.xla
def test_a_python_number_that_becomes_a_constant_is_named_with_its_epoch_step_and_graph(tmp_path):
    report, _ = _fit(tmp_path, "scalar", "scalar")
    found = _finding(report, "recompilation-after-warmup")
    assert found["title"].startswith("3 compilation(s) a clean run would not make (3 after epoch 1)")
    evidence = found["evidence"]
    # The model's gain turns from 0.5 into 1.0 at training step 3 of epoch 2; the evaluation graph
    # that follows uses it too (its first two steps: fresh metric sums, then sums as inputs).
    assert "epoch 2, train step 3: 1 graph(s)" in evidence
    assert "epoch 2, eval steps 1, 2: 2 graph(s)" in evidence
    assert "same input shapes and dtypes as the step before" in evidence
    assert "torch_xla does not say what changed unless the run starts with PT_XLA_DEBUG_LEVEL=1" in evidence
    assert "PT_XLA_DEBUG_LEVEL=1" in found["fix"]

    # With torch_xla's analysis written to a file, the report reads it and says what changed.
    debug = tmp_path / "xla_debug.txt"
    analysed = {"PT_XLA_DEBUG_LEVEL": "1", "PT_XLA_DEBUG_FILE": str(debug)}
    report, _ = _fit(tmp_path, "scalar-debug", "scalar", env=analysed)
    evidence = _finding(report, "recompilation-after-warmup")["evidence"]
    train = re.search(r"epoch 2, train step 3: 1 graph\(s\)[^;]*; same input shapes and dtypes as the step "
                      r"before; torch_xla's analysis: (\d+) graph inputs where this step's previous graph had "
                      r"(\d+): 1 value\(s\) sent as graph inputs before are now constants in the graph", evidence)
    assert train and int(train[1]) == int(train[2]) - 1, evidence
    assert "epoch 2, eval step 1:" in evidence and "PT_XLA_DEBUG_LEVEL=1" not in evidence


@pytest.mark.xla
def test_item_in_the_loss_is_named_as_the_cause_of_compilations_beyond_warm_up(tmp_path):
    report, lines = _fit(tmp_path, "item", "item")
    found = _finding(report, "recompilation-after-warmup")
    assert found["title"].startswith("1 compilation(s) a clean run would not make (1 in epoch 1 beyond warm-up)")
    assert ("epoch 1, train step 1: 2 graph(s) where a clean run compiles 1" in found["evidence"]
            and "the step read a device value 1 time(s) (.item(), float(), bool())" in found["evidence"])
    assert ".item()" in found["fix"]
    # One read per training step (the loss's .item()); evaluation scores the loss on host copies.
    reads = re.match(r"(\d+) unplanned device read\(s\) in (\d+) training step\(s\) and [1-9]\d* evaluation step",
                     _finding(report, "host-sync-per-step")["title"])
    assert reads and reads[1] == reads[2]
    assert any(ln.startswith("  - 1 compilation(s) a clean run would not make") for ln in lines)


@pytest.mark.xla
def test_a_ragged_batch_is_named_with_the_step_it_compiled_at(tmp_path):
    report, _ = _fit(tmp_path, "ragged", "ragged")
    found = _finding(report, "recompilation-after-warmup")
    assert found["title"].startswith("1 compilation(s) a clean run would not make (1 in epoch 1 beyond warm-up)")
    assert re.search(r"epoch 1, train step 3: 1 graph\(s\), [\d.]+ s; new input shapes or dtypes: batch tensor 0 "
                     r"shape \[8, 3, 16, 16\] -> \[3, 3, 16, 16\] \(a ragged batch\)", found["evidence"])
    assert "Keep every batch one shape" in found["fix"]


def test_waiting_for_input_on_the_native_cpu_is_a_finding_and_its_share_is_of_training_time(tmp_path):
    # Training and validation both read slowly: each epoch is about half validation, which waits
    # for no training batch.
    slow, _ = _fit(tmp_path, "slow", "slow_val", accelerator="cpu")
    found = _finding(slow, "input-bound")
    assert re.match(r"\d+% of training time waited for input", found["title"]) and "num_workers" in found["fix"]
    assert slow["notes"] == [] and slow["compilations"] == []
    epochs = slow["epochs"]
    assert all(0 < e["input_wait_s"] <= e["train_s"] < 0.8 * e["wall_s"] for e in epochs), epochs
    waited, trained = sum(e["input_wait_s"] for e in epochs), sum(e["train_s"] for e in epochs)
    assert slow["input_bound_share"] == pytest.approx(waited / trained) and slow["input_bound_share"] > 0.6
    assert f"in {trained:.1f} s of training steps" in found["evidence"]

    # A clean report names what it looked at on this runtime, the share it measured, and what only
    # XLA counts.
    clean, lines = _fit(tmp_path, "clean", "clean", accelerator="cpu")
    assert clean["clean"] and clean["findings"] == [] and clean["notes"] == []
    share = 100 * clean["input_bound_share"]
    assert lines == [f"diagnostics: clean (input wait {share:.1f}% of training time; recompilations, device reads "
                     "and CPU fallbacks are counted on XLA only)"]


class _Runtime:
    """What the Runtime protocol promises diagnostics, and nothing else (no private fields)."""

    __slots__ = ("evidence", "platform", "planned_reads")

    def __init__(self, platform):
        self.evidence, self.platform, self.planned_reads = None, platform, 0


class _Strategy:
    __slots__ = ("num_processes",)

    def __init__(self):
        self.num_processes = 1


@pytest.mark.parametrize(("platform", "flagged"), [("tpu", True), ("cpu", False), ("cuda", False)])
def test_a_small_batch_is_judged_by_the_platform_the_runtime_reports(platform, flagged):
    diag = RunDiagnostics(_Runtime(platform), _Strategy(), per_device_batch=8, strict=False)
    diag.end_epoch(1)
    assert ("small-batch" in {f.code for f in diag.findings()}) is flagged


def test_the_native_runtime_reports_its_platform_and_planned_reads():
    import torch

    from xlatrain.backend.native import NativeRuntime

    be = NativeRuntime("cpu")
    assert be.platform == "cpu" and be.planned_reads == 0
    be.defer(lambda t: None, [torch.ones(2)])
    be.read([torch.ones(2)])
    be.read([])  # nothing read: not a read
    assert be.planned_reads == 2


def _paced_epoch(diag, wait_s, step_s, steps):
    """One training epoch through diagnostics' own timing: each batch arrives after ``wait_s``,
    each step takes ``step_s``."""
    import time

    def batches():
        for _ in range(steps):
            time.sleep(wait_s)
            yield None

    for _ in diag.timed(batches(), "train", 1):
        time.sleep(step_s)
    diag.end_epoch(1)


@pytest.mark.parametrize(("wait_s", "steps", "flagged"), [
    (0.04, 40, True),   # a third of the time waited, 1.6 s in all: a finding, below the old half
    (0.002, 40, False),  # a few percent
    (0.04, 5, False),   # a third, but 0.2 s in all: a toy run's collating, nothing to fix
])
def test_an_eager_run_that_waits_a_fifth_of_its_training_time_or_more_is_told(wait_s, steps, flagged):
    diag = RunDiagnostics(_Runtime("cpu"), _Strategy(), per_device_batch=8, strict=False)
    _paced_epoch(diag, wait_s, 0.08, steps)
    share = diag._input_share()[0]
    assert (share > INPUT_BOUND_SHARE) is (wait_s == 0.04)
    found = [f for f in diag.findings() if f.code == "input-bound"]
    assert bool(found) is flagged, (share, found)
    # A clean line that names a share above the bound says it was too short to judge.
    checked = "; ".join(diag._checked()[0])
    assert ("too short to judge" in checked) is (share > INPUT_BOUND_SHARE and not flagged), checked
    if flagged:
        assert found[0].title == f"{100 * share:.0f}% of training time waited for input"


@pytest.mark.parametrize(("workers", "said"), [
    ((1, 3), "raise num_workers (1 now; this host's CPUs give 3 beside the training process)"),
    ((3, 3), "num_workers is 3, as many as this host's CPUs give beside the training process: more would share"),
    ((5, 3), "num_workers is 5, more than the 3 this host's CPUs give beside the training process"),
])
def test_the_input_bound_fix_raises_num_workers_only_where_the_hosts_cpus_give_more(workers, said):
    # It said "raise num_workers" with the workers already at every CPU but the training process's.
    diag = RunDiagnostics(_Runtime("cpu"), _Strategy(), per_device_batch=8, strict=False, workers=workers)
    _paced_epoch(diag, 0.04, 0.08, 40)
    (found,) = [f for f in diag.findings() if f.code == "input-bound"]
    assert said in found.fix
    assert ("raise num_workers" in found.fix) is (workers[0] < workers[1])


def test_waiting_for_validation_input_is_a_finding_of_its_own():
    # 3.4 s of a 5.8 s run waited for validation batches, and the report said "clean".
    import time

    diag = RunDiagnostics(_Runtime("cpu"), _Strategy(), per_device_batch=8, strict=False, workers=(0, 1))
    for _ in diag.timed(iter([None] * 10), "train", 1):
        time.sleep(0.01)

    def slow():
        for _ in range(30):
            time.sleep(0.04)
            yield None

    for _ in diag.timed(slow(), "eval", 1):
        time.sleep(0.01)
    diag.end_epoch(1)
    (found,) = [f for f in diag.findings() if f.code.startswith("input-bound")]
    assert found.code == "input-bound-eval" and re.match(r"\d+% of validation time waited for input", found.title)
    # Validation's loader is sized from its own data: the training loader's count is not cited.
    assert "eval_collate_fn" in found.fix and "sized from its own data" in found.fix and "0 now" not in found.fix


def test_validation_workers_starting_each_pass_are_not_waiting_for_input():
    # Validation's DataLoader starts its workers for every pass (6.9 s of 7.1 s under forkserver):
    # each pass's first batch is left out of the share.
    import time

    diag = RunDiagnostics(_Runtime("cpu"), _Strategy(), per_device_batch=8, strict=False, workers=(1, 1))

    def starting():
        time.sleep(1.2)  # the workers' start
        yield from [None] * 10

    for _ in range(2):
        for _ in diag.timed(starting(), "eval", 1):
            time.sleep(0.01)
    diag.end_epoch(1)
    assert not [f for f in diag.findings() if f.code == "input-bound-eval"], diag.findings()


@pytest.mark.xla
def test_a_graph_that_changes_with_a_value_sized_op_is_blamed_on_that_op(tmp_path):
    report, _ = _fit(tmp_path, "masked", "masked")
    found = _finding(report, "recompilation-after-warmup")
    assert "The step ran aten::nonzero, whose output's size depends on the values" in found["fix"], found["fix"]
    assert "torch.where(mask, t, 0)" in found["fix"] and "the step ran aten::nonzero on the CPU" in found["evidence"]
    assert "aten::nonzero" in _finding(report, "cpu-fallback-ops")["evidence"]
    # Its reads are the fallback's, not an .item() of the user's: the fix says so.
    reads = _finding(report, "host-sync-per-step")
    assert "0 were .item()" in reads["evidence"] and reads["fix"].startswith("None of them was .item()")
    assert "(aten::nonzero) read their inputs" in reads["fix"]


def test_reads_beside_ops_that_ran_on_the_cpu_are_not_all_put_down_to_item():
    # torch's own backward of linalg_eig reads a scalar each step: counted as .item(), but the
    # user's code has none, so the fix names the fallback too.
    both = RunDiagnostics._reads_fix(16, 16, {"aten::linalg_eig": 20})
    assert both.startswith("Each read stops the device") and both.endswith(
        "Some of the reads may be the op(s) that ran on the CPU (aten::linalg_eig), which read their inputs at each call.")
    assert "ran on the CPU" not in RunDiagnostics._reads_fix(16, 16, {})
    # No .item(), but one fallback call against 16 reads: a print(t) of the user's may be the rest.
    few = RunDiagnostics._reads_fix(0, 16, {"aten::nonzero": 1})
    assert few.startswith("Each read stops the device") and "print(t)" in few
