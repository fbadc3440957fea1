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
from xlatrain.diagnostics.profile import (
    TRACE_FILE, StepTrace, _device_activity, check_profile_steps, host_paced_note, render_summary,
)

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
    assert "device" not in summary  # no GPU: no device work to measure
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


def _event(cat, name, ts, dur, correlation=None, stream=7):
    """One complete event as torch.profiler's Chrome trace writes it (host events on the process's
    thread, device work on its stream)."""
    host = cat in ("user_annotation", "cpu_op", "cuda_runtime", "cuda_driver")
    event = {"ph": "X", "cat": cat, "name": name, "pid": 4321 if host else 0, "tid": 1 if host else stream,
             "ts": ts, "dur": dur}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


# Two traced steps on the host (0-100 and 150-250 µs, a 50 µs wait for input between them), the
# kernels and the copy they launched, and an evaluation launched after them.
_GPU_TRACE = [
    _event("user_annotation", "ProfilerStep#1", 0, 100),
    _event("user_annotation", "ProfilerStep#2", 150, 100),
    _event("gpu_user_annotation", "ProfilerStep#2", 160, 600),  # the step's span as the GPU saw it: not a host step
    _event("cuda_runtime", "cudaLaunchKernel", 10, 5, 1),
    _event("cuda_runtime", "cudaLaunchKernel", 20, 5, 2),
    _event("cuda_runtime", "cudaLaunchKernel", 160, 5, 3),
    _event("cuda_runtime", "cudaMemcpyAsync", 170, 5, 4),
    _event("cuda_driver", "cuLaunchKernel", 400, 5, 99),  # after the steps: an evaluation
    _event("kernel", "gemm", 30, 40, 1, stream=7),
    _event("kernel", "gemm", 50, 40, 2, stream=8),  # 50-70 overlaps the first, on another stream
    _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 180, 10, 4),
    _event("kernel", "relu", 200, 100, 3),  # step 2's last kernel, still running after its host span
    _event("kernel", "eval_gemm", 410, 50, 99),
]


def test_gpu_busy_time_is_the_steps_device_work_counted_once_where_streams_overlap():
    got = _device_activity(_GPU_TRACE, input_wait_s=50e-6)
    # From the steps' first kernel (30) to step 2's last (300); the evaluation's kernel is not in it.
    assert got["window_s"] == pytest.approx(270e-6)
    assert got["busy_s"] == pytest.approx(170e-6)  # 30-90, 180-190, 200-300
    assert got["busy_share"] == pytest.approx(170 / 270, abs=1e-4)
    assert got["input_wait_share"] == pytest.approx(50 / 270, abs=1e-4)
    assert got["host_paced_share"] == pytest.approx(50 / 270, abs=1e-4)
    assert got["kernels_per_step"] == 1.5 and got["kernel_us_mean"] == pytest.approx(60.0)
    # Without the launches' correlation ids no work can be tied to a step: nothing is said.
    untied = [{k: v for k, v in e.items() if k != "args"} for e in _GPU_TRACE]
    assert _device_activity(untied, 0.0) is None
    instant = [e for e in _GPU_TRACE if e.get("args", {}).get("correlation") in (None, 1)]
    instant[-1] = {**instant[-1], "dur": 0}  # the steps' only kernel takes no measurable time
    assert [e["name"] for e in instant if e["cat"] == "kernel"] == ["gemm"] and _device_activity(instant, 0.0) is None


def test_a_gpu_left_idle_by_the_host_gets_a_note_and_a_busy_one_none():
    idle = _device_activity(_GPU_TRACE, input_wait_s=20e-6)  # 100 of the 270 µs idle, 20 of them waiting
    note = host_paced_note(idle, reads=0)
    assert note.startswith("the GPU was busy 63% of the traced steps' time and they waited for input 7%; "
                           "for the other 30% it had no work ready")
    assert "the host set the pace" in note and "compile=True" in note and "value(s)" not in note
    assert "read 3 value(s) from the GPU" in host_paced_note(idle, reads=3)
    # A compiled step is not told to compile: the batch is what is left to suggest.
    compiled = host_paced_note(idle, reads=0, compiled=True)
    assert "compile=True" not in compiled and "compiled already: a larger batch" in compiled
    # A quarter of the window left to the host is the line: 32.5 µs of waiting leaves 67.5 of 270.
    assert host_paced_note(_device_activity(_GPU_TRACE, input_wait_s=30e-6), reads=0) is not None
    assert host_paced_note(_device_activity(_GPU_TRACE, input_wait_s=35e-6), reads=0) is None
    md = render_summary({"steps": [1, 2], "backend": "cuda", "trace": TRACE_FILE, "traced_s": 0.0003, "num_steps": 2,
                         "ms_per_step": 0.15, "step_s": 0.0002, "input_wait_s": 5e-5, "input_wait_share": 0.1667,
                         "between_steps_s": 0.0, "transfers": {"to_device": 1, "to_device_bytes": 4096, "from_device": 0,
                                                               "from_device_bytes": 0, "device_to_device": 0,
                                                               "scalar_reads": 0},
                         "device": idle, "notes": [note], "top_ops": [], "ops_source": "device kernels", "op_time_ms": 0.18})
    assert "- GPU busy: 63.0% of the traced steps' time" in md and "2 kernels a step, 60.0 µs each" in md


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_tiny_kernels_are_told_the_host_set_the_pace_and_large_matmuls_are_not(tmp_path):
    small = torch.ones(16, device="cuda")
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def tiny():
        x = small
        for _ in range(300):  # 600 kernels of a few µs, each launched from Python
            x = x * 1.0001 + 0.0001

    def heavy():
        for _ in range(4):  # about a TFLOP each: milliseconds on the GPU, microseconds to launch
            big @ big

    def traced(name, work, compiled=False):
        trace = StepTrace(tmp_path / name, (3, 6), trace_kind="torch", is_main=True, platform="cuda", compiled=compiled)
        for n in range(1, 8):
            trace.before_step(n)
            work()
            trace.after_step(n)
        torch.cuda.synchronize()
        return trace.close()

    paced, busy = traced("tiny", tiny, compiled=True), traced("heavy", heavy)
    # Counts within a kernel record or so: CUPTI may lose the first record of a profiling session.
    assert paced["device"]["kernels_per_step"] == pytest.approx(600, abs=1) and paced["device"]["busy_share"] < 0.5
    assert any("the host set the pace" in n and "compiled already" in n for n in paced["notes"])
    assert "- GPU busy: " in (tmp_path / "tiny" / "profile" / "summary.md").read_text()
    # Steps 1-2 left matmuls queued when the trace began at step 3: the window opens at the traced
    # steps' own first kernel, so that backlog does not read as idle time.
    assert 3.5 <= busy["device"]["kernels_per_step"] <= 4 and busy["device"]["busy_share"] > 0.9
    assert not any("set the pace" in n for n in busy["notes"])

    # The backward pass launches its kernels from autograd's own thread: they are the step's too.
    layer, x = torch.nn.Linear(256, 256).cuda(), torch.randn(64, 256, device="cuda")

    def forward():
        with torch.no_grad():
            layer(x).sum()

    def forward_backward():
        layer(x).sum().backward()

    alone, both = traced("forward", forward), traced("backward", forward_backward)
    assert both["device"]["kernels_per_step"] > alone["device"]["kernels_per_step"] + 1


@pytest.mark.parametrize(("reads_per_step", "in_callback"), [(0, False), (1, False), (1, True)])
def test_the_trainers_own_planned_reads_are_not_counted_as_the_users(tmp_path, reads_per_step, in_callback):
    # A clean fit with log_every=1 was said to make one .item()-style read a step: the Trainer's
    # float() of its loss sums, on host copies (PLANNED_READ spans), which wait for no device. A
    # user's read in an on_interval callback is the user's.
    import functools

    from xlatrain import TrainConfig, Trainer

    class ReadsWeights:
        def on_interval(self, trainer, values):
            trainer.model.weight.norm().item()

    def loss_fn(out, y):
        loss = F.cross_entropy(out, y)
        for _ in range(reads_per_step if not in_callback else 0):
            loss.item()  # the user's own read
        return loss

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    trainer = Trainer(nn.Linear(6, 3), loss_fn, functools.partial(torch.optim.SGD, lr=0.1),
                      config=TrainConfig(epochs=1, batch_size=8, log_every=1, profile_steps=(3, 5), tensorboard=False,
                                         run_dir=str(tmp_path / "run")), accelerator="cpu",
                      callbacks=[ReadsWeights()] if in_callback else [])
    trainer.fit(data)
    summary = json.loads((tmp_path / "run" / "profile" / "summary.json").read_text())
    # A step's interval is read after the step's end, where the trace of steps 3-5 stops: the
    # callback's reads in it are those of steps 3 and 4.
    assert summary["transfers"]["scalar_reads"] == (2 if in_callback else 3 * reads_per_step), summary["transfers"]
