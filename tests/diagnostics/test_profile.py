"""StepTrace: a profiler trace of chosen training steps that leaves the run's numbers unchanged."""

import gzip
import json
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import SCRIPTS, run_script
from xlatrain.diagnostics.profile import TRACE_FILE, StepTrace, check_profile_steps, render_summary

NUM_STEPS = 8


def _train(run_dir, steps=None, *, input_delay_s=0.0, between_s=0.0, is_main=True):
    """A Trainer-shaped loop (dropout, momentum) that reports each batch's wait as the Trainer does."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.3), nn.Linear(8 * 8 * 8, 3)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(NUM_STEPS)]

    def loader():
        for batch in data:
            time.sleep(input_delay_s)  # a slow input pipeline
            yield batch

    trace = StepTrace(run_dir, steps, trace_kind="torch", is_main=is_main) if steps else None
    losses = []
    fetched = time.perf_counter()
    for n, (x, y) in enumerate(loader(), start=1):
        waited = time.perf_counter() - fetched
        if trace is not None:
            trace.before_step(n)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if trace is not None:
            trace.after_step(n, input_wait_s=waited)
        time.sleep(between_s)  # what the Trainer does between steps: logging, checkpoints, evaluation
        fetched = time.perf_counter()
    summary = trace.close() if trace is not None else None
    return torch.stack(losses), model, summary


def test_a_traced_loop_writes_a_chrome_trace_of_its_steps_and_trains_exactly_as_an_untraced_one(tmp_path):
    plain, plain_model, _ = _train(tmp_path / "plain")
    traced, traced_model, summary = _train(tmp_path / "traced", (3, 5))

    assert torch.equal(traced, plain)  # dropout draws the same masks: tracing used no random numbers
    for a, b in zip(traced_model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)
    assert not (tmp_path / "plain" / "profile").exists()

    out = tmp_path / "traced" / "profile"
    trace = json.loads((out / TRACE_FILE).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"aten::convolution", "aten::addmm", "aten::convolution_backward"} <= names
    assert sorted(n for n in names if n and n.startswith("ProfilerStep#")) == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]

    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["steps"] == [3, 5] and summary["num_steps"] == 3 and summary["complete"]
    assert summary["ops_source"] == "CPU ops, self time" and summary["trace"] == TRACE_FILE
    top = [op["name"] for op in summary["top_ops"]]
    # Every op counted is a host op of the trace (aten kernels and, depending on the torch
    # version, autograd nodes such as "ReluBackward0"); the step markers are not ops.
    host_ops = {e.get("name") for e in trace["traceEvents"] if e.get("cat") == "cpu_op"}
    assert len(top) >= 5 and set(top) <= host_ops and not any(name.startswith("ProfilerStep#") for name in top)
    assert any(name.startswith("aten::") for name in top)
    assert any("conv" in name for name in top[:3])  # the convolution is this model's heaviest op
    # Self times: aten::conv2d only calls down to the convolution kernel, so its own time is a
    # sliver of its span; counting spans would count the convolution twice.
    spans = sum(e["dur"] for e in trace["traceEvents"] if e.get("name") == "aten::conv2d" and e.get("cat") == "cpu_op")
    own = next((op["total_ms"] for op in summary["top_ops"] if op["name"] == "aten::conv2d"), 0.0)
    assert own * 1000 < 0.5 * spans
    assert summary["transfers"]["to_device"] == 0 and summary["transfers"]["scalar_reads"] == 0
    md = (out / "summary.md").read_text()
    assert "Profile of training steps 3-5 (cpu)" in md and "| `aten::" in md and "waiting for input" in md


def test_the_summary_gives_the_share_of_traced_time_spent_waiting_for_input(tmp_path):
    _, _, slow = _train(tmp_path / "slow", (2, 5), input_delay_s=0.05)
    waits = slow["input_wait_s"]
    # Each of the 4 traced steps slept 0.05 s fetching its batch: at least that much was waited
    # (how much more depends on the machine's load, so no upper bound is asserted).
    assert waits >= 4 * 0.05
    assert slow["input_wait_share"] == pytest.approx(waits / slow["traced_s"], abs=1e-3)
    assert slow["traced_s"] == pytest.approx(slow["step_s"] + waits + slow["between_steps_s"], abs=1e-5)
    _, _, fast = _train(tmp_path / "fast", (2, 5))
    assert fast["input_wait_s"] < waits
    assert "(%.1f%%)" % (100 * slow["input_wait_share"]) in render_summary(slow)


def test_time_between_steps_is_told_apart_from_steps_and_input_wait(tmp_path):
    _, _, summary = _train(tmp_path / "run", (2, 5), between_s=0.2)
    assert summary["between_steps_s"] >= 3 * 0.2  # three gaps inside steps 2-5
    assert summary["input_wait_share"] < 0.1
    assert any("passed between steps" in note for note in summary["notes"])
    _, _, plain = _train(tmp_path / "plain", (2, 5))
    assert not any("passed between steps" in note for note in plain["notes"])


def test_a_window_the_run_leaves_early_is_written_up_to_its_last_step(tmp_path):
    _, _, summary = _train(tmp_path / "run", (6, 100))
    assert summary["steps"] == [6, NUM_STEPS] and summary["num_steps"] == 3 and not summary["complete"]
    assert any("stopped before step 100" in note for note in summary["notes"])
    events = json.loads((tmp_path / "run" / "profile" / TRACE_FILE).read_text())["traceEvents"]
    assert sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")) == [
        "ProfilerStep#6", "ProfilerStep#7", "ProfilerStep#8"
    ]


def test_a_window_past_the_end_of_training_and_other_processes_trace_nothing(tmp_path):
    assert _train(tmp_path / "late", (20, 30))[2] is None
    assert _train(tmp_path / "worker", (2, 3), is_main=False)[2] is None
    assert not (tmp_path / "late" / "profile").exists() and not (tmp_path / "worker" / "profile").exists()


@pytest.mark.parametrize("bad", [(5, 3), (0, 2), "20,30", (1.5, 2), (True, 2), (1, 2, 3)])
def test_profile_steps_must_be_a_first_and_last_step_from_1(bad):
    with pytest.raises(ValueError, match=r"profile_steps=.*e\.g\. profile_steps=\(20, 30\)"):
        check_profile_steps(bad)
    assert check_profile_steps([7, 7]) == (7, 7)


@pytest.mark.xla
def test_on_xla_cpu_torch_xla_writes_an_xplane_trace_and_the_losses_do_not_change(tmp_path):
    script = str(SCRIPTS / "profile_xla.py")
    env = {"PJRT_DEVICE": "CPU"}
    plain = run_script([sys.executable, script, str(tmp_path / "plain")], env)
    traced = run_script([sys.executable, script, str(tmp_path / "traced"), "3", "5"], env)
    assert traced["losses"] == plain["losses"]  # exact float32 values: dropout included
    assert plain["summary"] is None and not (tmp_path / "plain" / "profile").exists()

    out = tmp_path / "traced" / "profile"
    summary = traced["summary"]
    assert summary == json.loads((out / "summary.json").read_text())
    # torch_xla 2.9 on XLA:CPU writes plugins/profile/<time>/<host>.xplane.pb and .trace.json.gz.
    xplane = out / summary["trace"]
    assert xplane.name.endswith(".xplane.pb") and xplane.parent.parent == out / "plugins" / "profile"
    assert xplane.stat().st_size > 1000
    (json_trace,) = xplane.parent.glob("*.trace.json.gz")
    events = json.loads(gzip.decompress(json_trace.read_bytes()))["traceEvents"]
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train_step")
    assert steps == [3, 4, 5]
    assert not list(out.glob(".trace-*"))  # the temporary export directory is gone

    assert summary["steps"] == [3, 5] and summary["ops_source"] == "XLA HLO ops, by kind"
    top = [op["name"] for op in summary["top_ops"]]
    assert "convolution" in top and "dot" in top
    assert summary["transfers"]["compilations"] == 0  # steps 3-5 run the graph compiled at steps 1-2
    assert summary["transfers"]["from_device"] == 0 and summary["transfers"]["to_device"] >= 1
    assert "| `convolution` |" in (out / "summary.md").read_text()
