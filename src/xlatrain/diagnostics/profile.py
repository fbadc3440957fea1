"""A profiler trace of chosen training steps, and a short account of where their time went.

``StepTrace`` records the training steps ``start`` to ``stop`` (both included, counted from 1
over the whole run) with the profiler of the runtime that runs them, and writes
``RUN_DIR/profile/``:

- CPU / CUDA / TorchTPU: ``trace.pt.trace.json`` from ``torch.profiler``, in Chrome's trace
  format: it opens in https://ui.perfetto.dev, ``chrome://tracing`` and TensorBoard's PyTorch
  profiler plugin. Each traced step is a ``ProfilerStep#N`` span.
- XLA: what ``torch_xla.debug.profiler`` exports, ``plugins/profile/<time>/<host>.xplane.pb``
  (TensorBoard's profile plugin / xprof: ``tensorboard --logdir RUN_DIR/profile``) and, beside
  it, ``<host>.trace.json.gz`` (the same events in Chrome's format; Perfetto opens it). Each
  traced step is a ``train_step`` span with its ``step_num``.
- ``summary.md`` / ``summary.json``: the ops that took the most time, the share of the traced
  time spent waiting for input, and the host-device transfers (XLA: torch_xla's counters over
  the traced steps; CPU / CUDA: the trace's copy events). On CUDA also the share of the traced
  steps' time the GPU worked, and a note when it sat idle for want of work the host had not
  launched yet (a launch-bound step).

Tracing leaves the run's numbers as they are: it draws no random numbers, reads no device value
and cuts no XLA graph. Only the last traced step waits for its device work to finish (XLA,
CUDA), so that the trace holds all of it; that changes timing, never results. Only the main
process traces.

Example (what ``Trainer.fit`` does with ``TrainConfig(profile_steps=(20, 30))``)::

    trace = StepTrace(run_dir, (20, 30), trace_kind=runtime.trace_kind, is_main=strategy.is_main)
    for n, batch in enumerate(batches, start=1):  # n: the step's number in the whole run
        trace.before_step(n)
        ...  # forward, backward, optimizer step, runtime.step_end()
        trace.after_step(n, input_wait_s=seconds_spent_waiting_for_batch)
    summary = trace.close()  # None when no step of the window ran here
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from xlatrain.backend.base import PLANNED_READ
from xlatrain.logs import get_logger

log = get_logger(__name__)

TRACE_FILE = "trace.pt.trace.json"  # torch.profiler; TensorBoard's PyTorch plugin looks for *.pt.trace.json
TOP_OPS = 15  # ops listed in summary.json; summary.md shows the first 10
_TOP_SHOWN = 10
_STEP_SPAN = "train_step"  # XLA: the name xprof's step statistics expect from a step marker
# torch.profiler's Chrome trace categories: host ops, device kernels, device copies.
_CPU_OP, _KERNEL, _MEMCPY = "cpu_op", "kernel", "gpu_memcpy"
_DEVICE_WORK = (_KERNEL, _MEMCPY, "gpu_memset")  # what occupies a GPU
_HOST_CALLS = ("cuda_runtime", "cuda_driver")  # the host's launches, tied to their device work by "correlation"
_STEP_PREFIX = "ProfilerStep#"
# The share of the traced time a GPU may sit idle, not waiting for input, before the summary says
# the host set the pace: below it, the gaps are the ordinary ones between dependent kernels.
_HOST_PACED_SHARE = 0.25
_SCALAR_READ = "aten::_local_scalar_dense"  # .item(), float(t), bool(t): a device read on an accelerator
_HLO_SUFFIX = re.compile(r"(\.\d+|\.clone)+$")  # HLO instruction names: "convolution.1", "fusion.3.clone"


def check_profile_steps(steps: Any) -> tuple[int, int]:
    """``steps`` as ``(start, stop)``: the first and last training step to trace, both included.

    Steps count the training batches of the whole run from 1 (epoch 2 continues where epoch 1
    ended), so ``(20, 30)`` traces eleven steps.

    Raises:
        ValueError: not two integers with ``1 <= start <= stop``; the message says what to give.

    Example:
        >>> check_profile_steps([20, 30])
        (20, 30)
    """
    ok = (
        isinstance(steps, (list, tuple)) and len(steps) == 2
        and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
        and 1 <= steps[0] <= steps[1]
    )
    if not ok:
        raise ValueError(
            f"profile_steps={steps!r} is not valid: give the first and last training step to trace, "
            "counted from 1 over the whole run, e.g. profile_steps=(20, 30) (--set trainer.profile_steps=[20,30]); "
            "trace a few steps after the first ones, which compile or warm up"
        )
    return int(steps[0]), int(steps[1])


class StepTrace:
    """Traces training steps ``steps[0]`` to ``steps[1]`` and writes ``RUN_DIR/profile/``.

    Call ``before_step(n)`` when step ``n``'s batch is in hand, ``after_step(n, input_wait_s)``
    once the step has been launched (after ``backend.step_end()``), and ``close()`` when training
    stops, normally or not. Steps outside the window cost one comparison each. A window that
    the run leaves early (preemption, early stop, an error) is written up to its last step; a
    resumed run that starts inside the window traces the rest of it.

    Args:
        run_dir: the run's directory; the trace and summary go to its ``profile/``.
        steps: ``(start, stop)``, see :func:`check_profile_steps`.
        trace_kind: ``runtime.trace_kind``: ``"xla"`` traces with torch_xla's profiler,
            ``"torch"`` with ``torch.profiler``.
        is_main: ``strategy.is_main``; other processes trace nothing.
        platform: ``runtime.platform`` (``"cpu"``, ``"cuda"``, ``"tpu"``): which device
            activity torch.profiler records, and whether an input wait also holds compute (XLA
            on the host's CPU).
        compiled: the steps run under ``torch.compile`` (``TrainConfig.compile``), which
            changes what the summary suggests for a GPU the host left idle.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        steps: Sequence[int],
        *,
        trace_kind: str,
        is_main: bool,
        platform: str = "cpu",
        compiled: bool = False,
    ) -> None:
        self.start, self.stop = check_profile_steps(steps)
        self.out_dir = Path(run_dir) / "profile"
        self._xla = trace_kind == "xla"
        self._platform = platform
        self._compiled = compiled
        self._state = "waiting" if is_main else "done"  # waiting -> tracing -> done
        self._session: Any = None
        self._span: Any = None
        self._xla_before: dict[str, Any] | None = None
        self._tmp_dir: Path | None = None
        self._steps: list[int] = []
        self._waits: list[float] = []
        self._body_s = 0.0
        self._step_started: float | None = None
        self._window_started = 0.0
        self._window_s = 0.0
        self._summary: dict[str, Any] | None = None

    def before_step(self, step: int) -> None:
        """Step ``step``'s batch is in hand and its forward pass comes next."""
        if self._state == "done":
            return
        if self._state == "waiting":
            if not self.start <= step <= self.stop:
                return
            self._begin()
            if self._state != "tracing":
                return
        if self._step_started is not None:  # the previous step never reported its end
            self._close_span()
        self._open_span(step)
        self._step_started = time.perf_counter()

    def after_step(self, step: int, input_wait_s: float = 0.0) -> None:
        """Step ``step`` has been launched; ``input_wait_s`` is how long the loop waited for its batch."""
        if self._state != "tracing" or self._step_started is None:
            return
        self._body_s += time.perf_counter() - self._step_started
        self._step_started = None
        self._close_span()
        self._steps.append(step)
        self._waits.append(max(float(input_wait_s), 0.0))
        if step >= self.stop:
            self._end(complete=True)

    def close(self) -> dict[str, Any] | None:
        """End the trace if it is still open, and return the summary written (``None``: nothing traced)."""
        if self._state == "tracing":
            if self._step_started is not None:
                self._step_started = None
                self._close_span()
            self._end(complete=False)
        self._state = "done"
        return self._summary

    # --- the two profilers -----------------------------------------------------------------
    def _begin(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self._xla:
                self._begin_xla()
            else:
                self._begin_torch()
        except RuntimeError as exc:  # another profiler session is running in this process
            log.warning(f"profile_steps: the profiler could not start ({exc}); steps {self.start}-{self.stop} are not traced")
            self._state = "done"
            return
        self._state = "tracing"
        self._window_started = time.perf_counter()

    def _begin_torch(self) -> None:
        from torch.profiler import ProfilerActivity, profile, supported_activities

        if self._platform == "cpu":
            # The profiler's tracing library logs its start and stop and, in torch's CUDA build on a
            # machine without a GPU, "gpuGetDeviceCount failed" as an ERROR: nothing is wrong on a
            # CPU run. Read when the profiler first starts; a level the user set is kept.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")

        activities = [ProfilerActivity.CPU]
        if self._platform == "cuda":
            activities.append(ProfilerActivity.CUDA)
        elif self._platform == "tpu" and ProfilerActivity.PrivateUse1 in supported_activities():
            activities.append(ProfilerActivity.PrivateUse1)  # TorchTPU's device, where it reports one
        # No shapes, memory or stacks: each costs host time per op and would stretch the steps.
        self._session = profile(activities=activities)
        self._session.start()

    def _begin_xla(self) -> None:
        import torch_xla.debug.profiler as xp

        from xlatrain.diagnostics import xla_metrics

        # torch_xla writes the trace into a new directory of its own; it is moved into place
        # whole once complete, so profile/ never shows a half-written one.
        self._tmp_dir = Path(tempfile.mkdtemp(dir=self.out_dir, prefix=".trace-"))
        self._xla_before = xla_metrics.snapshot()
        try:
            xp.start_trace(str(self._tmp_dir))
        except BaseException:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            raise

    def _open_span(self, step: int) -> None:
        if self._xla:
            import torch_xla

            # The runtime's TraceMe, as torch_xla's StepTrace uses it, without the IR scope
            # StepTrace pushes: a scope left open across the step's sync is an error, and
            # StepTrace's own sync would cut a graph the step did not cut.
            self._span = torch_xla._XLAC.profiler.TraceMe(_STEP_SPAN, _r=1, step_num=step)
        else:
            from torch.profiler import record_function

            # The name TensorBoard's PyTorch plugin reads step boundaries from.
            self._span = record_function(f"ProfilerStep#{step}")
        self._span.__enter__()

    def _close_span(self) -> None:
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None

    def _end(self, *, complete: bool) -> None:
        self._window_s = time.perf_counter() - self._window_started
        self._state = "done"
        if self._xla:
            trace_path, events, transfers = self._end_xla()
        else:
            trace_path, events, transfers = self._end_torch()
        self._summary = self._summarize(trace_path, events, transfers, complete)
        self._write_summary(self._summary)
        log.info(
            f"profile: steps {self._summary['steps'][0]}-{self._summary['steps'][1]} traced to "
            f"{self.out_dir / self._summary['trace']}; summary in {self.out_dir / 'summary.md'}"
        )

    def _end_torch(self) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        from xlatrain.checkpoint import fsync_path

        session, self._session = self._session, None
        session.stop()  # waits for the device's outstanding work, so the last step is complete
        path = self.out_dir / TRACE_FILE
        tmp = self.out_dir / f".{TRACE_FILE}.{os.getpid()}.tmp"
        try:
            session.export_chrome_trace(str(tmp))
            fsync_path(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        events = _load_events(path)
        return TRACE_FILE, events, _torch_transfers(events, self._platform)

    def _end_xla(self) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.profiler as xp

        from xlatrain.diagnostics import xla_metrics

        assert self._tmp_dir is not None and self._xla_before is not None
        tmp, self._tmp_dir = self._tmp_dir, None
        try:
            # Launched programs still running belong to the traced steps: let them finish inside
            # the trace. A wait, not a sync: no graph is cut, nothing computed changes.
            xm.wait_device_ops()
            cost = xla_metrics.diff(self._xla_before, xla_metrics.snapshot())
            xp.stop_trace()
            trace_path = _move_xla_trace(tmp, self.out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        json_trace = next(iter(sorted((self.out_dir / trace_path).parent.glob("*.trace.json.gz"))), None)
        events = _load_events(json_trace) if json_trace is not None else []
        transfers = {
            "to_device": cost["transfer_to_device_count"],
            "from_device": cost["transfer_from_device_count"],
            "scalar_reads": cost["scalar_reads"],
            "compilations": cost["compile_count"],
            "compile_s": round(cost["compile_s"], 6),
            "source": "torch_xla metrics over the traced steps",
        }
        return trace_path, events, transfers

    # --- the summary ---------------------------------------------------------------------
    def _summarize(
        self, trace_path: str, events: list[dict[str, Any]], transfers: dict[str, Any], complete: bool
    ) -> dict[str, Any]:
        steps = self._steps
        wait = sum(self._waits)
        # The first step's wait came before the window opened; the others fall inside it.
        traced = self._window_s + (self._waits[0] if self._waits else 0.0)
        ops, source = _top_ops(events, xla=self._xla)
        # Waits inside the GPU's window: the first step's came before it opened.
        cuda = not self._xla and self._platform == "cuda"  # torch.profiler's kernels, not torch_xla's trace
        device = _device_activity(events, sum(self._waits[1:])) if cuda else None
        summary: dict[str, Any] = {
            "requested": [self.start, self.stop],
            "steps": [steps[0], steps[-1]] if steps else [self.start, self.start],
            "num_steps": len(steps),
            "complete": complete,
            "backend": "xla" if self._xla else self._platform,
            "platform": self._platform,
            "trace": trace_path,
            "traced_s": round(traced, 6),
            "step_s": round(self._body_s, 6),
            "input_wait_s": round(wait, 6),
            "input_wait_share": round(wait / traced, 4) if traced > 0 else 0.0,
            "between_steps_s": round(max(traced - self._body_s - wait, 0.0), 6),
            "ms_per_step": round(1000 * traced / len(steps), 3) if steps else None,
            "ops_source": source,
            "op_time_ms": round(sum(o["total_ms"] for o in ops), 3),
            "top_ops": ops[:TOP_OPS],
            "transfers": transfers,
        }
        if device is not None:
            summary["device"] = device
        summary["notes"] = self._notes(summary, complete)
        if self._xla:
            summary["top_instructions"] = _top_ops(events, xla=True, group=False)[0][:TOP_OPS]
        return summary

    def _notes(self, summary: dict[str, Any], complete: bool) -> list[str]:
        transfers = summary["transfers"]
        notes = []
        if not complete:
            notes.append(f"training stopped before step {self.stop}: the trace ends at the last step that ran")
        # And at least 50 ms a gap: an evaluation or a checkpoint takes that; a few milliseconds
        # between tiny steps is the host's scheduling, nothing to act on.
        gaps = max(summary["num_steps"] - 1, 1)
        between = summary["between_steps_s"] > 0.5 * summary["traced_s"] and summary["between_steps_s"] >= 0.05 * gaps
        if between:
            notes.append(
                "more than half the traced time passed between steps, not in them or waiting for input: "
                "an epoch's end (evaluation, checkpoint) or a checkpoint every few steps fell inside the "
                "window; trace steps within one epoch to see the steps alone"
            )
        device = summary.get("device")
        # Time between the steps (an evaluation, a checkpoint) that could be all of the GPU's idle
        # time leaves the steps' own pace unknown.
        paced = host_paced_note(device, transfers.get("scalar_reads", 0), compiled=self._compiled) if device is not None and not between \
            and summary["between_steps_s"] < device["host_paced_share"] * device["window_s"] else None
        if paced is not None:
            notes.append(paced)
        if self._xla:
            notes.append(
                "step time is host time (tracing and launching the graph); the device runs it "
                "asynchronously, and its ops and their times are the HLO ops in the trace"
            )
            if self._platform == "cpu":
                notes.append(
                    "on XLA:CPU the compiled step runs on the same CPU cores as the loader, so the "
                    "wait for a batch includes the step's own compute; judge input wait on a TPU"
                )
            if transfers.get("compilations"):
                notes.append(
                    f"{transfers['compilations']} graph(s) compiled during the traced steps "
                    f"({transfers['compile_s']:.2f} s): trace steps after warm-up to see steady-state time"
                )
        return notes

    def _write_summary(self, summary: dict[str, Any]) -> None:
        from xlatrain.checkpoint import atomic_write_text

        atomic_write_text(self.out_dir / "summary.json", json.dumps(summary, indent=1) + "\n")
        atomic_write_text(self.out_dir / "summary.md", render_summary(summary))


def render_summary(summary: dict[str, Any], *, heading: str = "#", top: int = _TOP_SHOWN, profile_dir: str = "") -> str:
    """Markdown for a profile summary (``StepTrace.close()``'s dict, or ``profile/summary.json``).

    Args:
        summary: the summary dict.
        heading: the heading level to write at (``"##"`` inside another report).
        top: how many ops to list.
        profile_dir: the ``profile/`` directory as seen from where the markdown is written
            (``"../profile/"`` from ``RUN_DIR/report/``); the trace is named relative to it.
    """
    first, last = summary["steps"]
    lines = [f"{heading} Profile of training steps {first}-{last} ({summary['backend']})", ""]
    trace = profile_dir + summary["trace"]
    if summary["backend"] == "xla":
        lines.append(
            f"- trace: `{trace}` (TensorBoard's profile plugin or xprof: `tensorboard --logdir RUN_DIR/profile`; "
            "the `.trace.json.gz` beside it opens in https://ui.perfetto.dev)"
        )
    else:
        lines.append(f"- trace: `{trace}` (open it in https://ui.perfetto.dev or TensorBoard's PyTorch profiler plugin)")
    traced = summary["traced_s"]
    lines.append(
        f"- traced: {summary['num_steps']} step(s) in {traced:.3f} s ({summary['ms_per_step'] or 0:.1f} ms per step): "
        f"steps {summary['step_s']:.3f} s, waiting for input {summary['input_wait_s']:.3f} s "
        f"({100 * summary['input_wait_share']:.1f}%), between steps {summary['between_steps_s']:.3f} s"
    )
    device = summary.get("device")
    if device is not None:
        lines.append(
            f"- GPU busy: {100 * device['busy_share']:.1f}% of the traced steps' time (kernels, copies and memsets "
            f"on any stream, overlaps counted once); {device['kernels_per_step']:.0f} kernels a step, "
            f"{device['kernel_us_mean']:.1f} µs each on average"
        )
    lines.append(f"- host-device transfers: {_describe_transfers(summary['transfers'], summary['backend'])}")
    lines += [f"- note: {n}" for n in summary.get("notes", [])]
    ops = summary["top_ops"][:top]
    if ops:
        lines += [
            "", f"{heading}# Top ops ({summary['ops_source']}, {summary['op_time_ms']:.1f} ms in all)", "",
            "| op | time (ms) | share | calls |", "|---|---:|---:|---:|",
        ]
        lines += [f"| `{o['name']}` | {o['total_ms']:.3f} | {100 * o['share']:.1f}% | {o['calls']} |" for o in ops]
    else:
        lines += ["", "No op events were found in the trace."]
    return "\n".join(lines) + "\n"


def _describe_transfers(t: dict[str, Any], backend: str) -> str:
    if backend == "xla":
        text = (f"{t['to_device']} to the device, {t['from_device']} from it "
                f"({t['scalar_reads']} of them .item()-style reads)")
        return text + (f"; {t['compilations']} compilation(s)" if t.get("compilations") else "")
    if backend == "cpu":
        return (f"none (the CPU is the device); {t['scalar_reads']} .item()-style read(s), which would each "
                "wait for the device on an accelerator")
    mb = lambda n: f"{n / 1e6:.1f} MB"  # noqa: E731
    return (f"{t['to_device']} copies to the device ({mb(t['to_device_bytes'])}), {t['from_device']} from it "
            f"({mb(t['from_device_bytes'])}), {t['device_to_device']} on it; {t['scalar_reads']} .item()-style read(s)")


# --- reading traces --------------------------------------------------------------------------
def _load_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def _top_ops(events: list[dict[str, Any]], *, xla: bool, group: bool = True) -> tuple[list[dict[str, Any]], str]:
    """Ops by total self time, largest first, and what kind of op they are."""
    if xla:
        # Device work: the events that name an HLO instruction. Grouped by kind ("dot.16" and
        # "dot" are both dot); the trace keeps each instruction's own name.
        chosen = [e for e in events if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})]
        source = "XLA HLO ops, by kind" if group else "XLA HLO instructions"

        def name(e: dict[str, Any]) -> str:
            return _HLO_SUFFIX.sub("", e["name"]) if group else e["name"]
    else:
        kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == _KERNEL]
        chosen = kernels or [e for e in events if e.get("ph") == "X" and e.get("cat") == _CPU_OP]
        source = "device kernels" if kernels else "CPU ops, self time"

        def name(e: dict[str, Any]) -> str:
            return e["name"]
    totals: dict[str, list[float]] = {}
    for event, self_us in _self_times(chosen):
        entry = totals.setdefault(name(event), [0.0, 0])
        entry[0] += self_us
        entry[1] += 1
    all_us = sum(t for t, _ in totals.values()) or 1.0
    ops = [
        {"name": n, "total_ms": round(us / 1000, 6), "calls": calls, "share": round(us / all_us, 4)}
        for n, (us, calls) in totals.items()
    ]
    ops.sort(key=lambda o: -o["total_ms"])
    return ops, source


def _self_times(events: Iterable[dict[str, Any]]) -> Iterable[tuple[dict[str, Any], float]]:
    """Each event with its duration less that of the events nested in it (same process and thread).

    Host ops nest (``aten::linear`` holds ``aten::addmm``); counting each op's own time only
    makes the totals add up to the time spent.
    """
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        if _timed(e):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        own = [float(e["dur"]) for e in thread]
        stack: list[int] = []
        for i, e in enumerate(thread):
            end = e["ts"] + e["dur"]
            while stack and thread[stack[-1]]["ts"] + thread[stack[-1]]["dur"] < end - 1e-3:
                stack.pop()  # ended before this one does: not its parent
            if stack:
                own[stack[-1]] -= e["dur"]
            stack.append(i)
        yield from ((e, max(t, 0.0)) for e, t in zip(thread, own))


def host_paced_note(device: dict[str, Any], reads: int, *, compiled: bool = False) -> str | None:
    """What the summary says of a GPU that sat idle, not waiting for input, for at least
    ``_HOST_PACED_SHARE`` of the traced time (``device``: a summary's ``"device"``; ``reads``: the
    device values the traced steps read on the host; ``compiled``: the steps ran under
    ``torch.compile``); ``None`` for one that was kept busy."""
    if device["host_paced_share"] < _HOST_PACED_SHARE:
        return None
    return (
        f"the GPU was busy {100 * device['busy_share']:.0f}% of the traced steps' time and they waited for "
        f"input {100 * device['input_wait_share']:.0f}%; for the other {100 * device['host_paced_share']:.0f}% "
        f"it had no work ready while the host ran Python, in the steps and between them, and launched "
        f"{device['kernels_per_step']:.0f} kernels a step ({device['kernel_us_mean']:.0f} µs of GPU time each on "
        "average)" + (f" and read {reads} value(s) from the GPU, each of which waits for its queue to empty" if reads else "")
        + ": the host set the pace (tracing adds host time to every op, so untraced steps are paced a little less). "
        + (
            # torch.compile fuses the model's ops; the loss, the backward's glue and the optimizer
            # step still launch their own kernels, and each kernel's size is the batch's.
            "The model is compiled already: a larger batch, where training allows one, gives each kernel "
            "more work" if compiled else
            "Fewer, larger kernels keep the GPU busy: compile=True fuses them, and a larger batch, where "
            "training allows one, gives each more work"
        )
    )


def _device_activity(events: list[dict[str, Any]], input_wait_s: float) -> dict[str, Any] | None:
    """How much of the traced steps' time the GPU worked, from a torch.profiler trace.

    The window runs from the start of the first device work the traced steps launched to the end
    of the last (a launch, on any host thread: the backward pass launches from autograd's own, is
    tied to its kernel or copy by the trace's ``correlation`` id). It does not open at the first
    step's host start: work queued by steps before the trace may still hold the GPU then, and the
    profiler records only what was launched while it ran. Busy is the time in the window that at
    least one kernel, copy or memset ran, on any stream.
    ``input_wait_s``: the loop's waits for batches inside the window. ``None`` when the trace holds
    no device work launched in a step (a CPU run, or a device whose trace says no more).
    """
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
             and str(e.get("name", "")).startswith(_STEP_PREFIX) and _timed(e)]
    if not spans:
        return None
    spans.sort()
    starts = [s for s, _ in spans]

    def in_step(ts: float) -> bool:
        i = bisect.bisect_right(starts, ts) - 1
        return i >= 0 and ts <= spans[i][1]

    launched = {_correlation(e) for e in events if e.get("cat") in _HOST_CALLS and _timed(e) and in_step(e["ts"])}
    launched.discard(None)
    work = [e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_WORK and _timed(e)]
    own = [e for e in work if _correlation(e) in launched]
    if not own:
        return None
    start = min(e["ts"] for e in own)
    end = max(e["ts"] + e["dur"] for e in own)
    busy, open_at, close_at = 0.0, start, start
    for s, e in sorted((max(e["ts"], start), min(e["ts"] + e["dur"], end)) for e in work):
        if e <= s:
            continue  # outside the window
        if s > close_at:
            busy += close_at - open_at
            open_at = s
        close_at = max(close_at, e)
    busy += close_at - open_at
    window = end - start
    if window <= 0:
        return None  # no measurable stretch of work: nothing to say of it
    kernels = [e["dur"] for e in own if e["cat"] == _KERNEL]
    busy_share = busy / window
    wait_share = min(input_wait_s * 1e6 / window, 1.0)
    return {
        "window_s": round(window / 1e6, 6),
        "busy_s": round(busy / 1e6, 6),
        "busy_share": round(busy_share, 4),
        "input_wait_share": round(wait_share, 4),
        # Idle and not waiting for input: the host had not yet launched the next work.
        "host_paced_share": round(max(1.0 - busy_share - wait_share, 0.0), 4),
        # Per traced step span: a step cut short by the run's end is traced, and counted, too.
        "kernels_per_step": round(len(kernels) / len(spans), 1),
        "kernel_us_mean": round(sum(kernels) / len(kernels), 2) if kernels else 0.0,
    }


def _timed(e: dict[str, Any]) -> bool:
    return isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))


def _correlation(e: dict[str, Any]) -> Any:
    return (e.get("args") or {}).get("correlation")


def _torch_transfers(events: list[dict[str, Any]], platform: str) -> dict[str, Any]:
    counts = {"to_device": 0, "to_device_bytes": 0, "from_device": 0, "from_device_bytes": 0, "device_to_device": 0}
    for e in events:
        if e.get("cat") != _MEMCPY:
            continue
        size = int((e.get("args") or {}).get("bytes", 0) or 0)
        if "HtoD" in e["name"]:
            counts["to_device"] += 1
            counts["to_device_bytes"] += size
        elif "DtoH" in e["name"]:
            counts["from_device"] += 1
            counts["from_device_bytes"] += size
        else:
            counts["device_to_device"] += 1
    # The Trainer's own planned reads (on host copies, in the runtime's PLANNED_READ span) are not
    # the user's: a clean run with log_every=1 was said to make one .item()-style read a step.
    planned = [(e.get("tid"), e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("name") == PLANNED_READ and _timed(e)]
    counts["scalar_reads"] = sum(
        1 for e in events if e.get("cat") == _CPU_OP and e.get("name") == _SCALAR_READ
        and not (_timed(e) and any(tid == e.get("tid") and lo <= e["ts"] <= hi for tid, lo, hi in planned)))
    counts["source"] = "none: the CPU is the device" if platform == "cpu" else "the trace's memcpy events"
    return counts


def _move_xla_trace(tmp: Path, out_dir: Path) -> str:
    """Move ``tmp/plugins/profile/<time>/`` to ``out_dir/plugins/profile/<time>/`` whole; return the
    xplane file's path relative to ``out_dir``."""
    from xlatrain.checkpoint import fsync_path

    runs = sorted(p for p in (tmp / "plugins" / "profile").glob("*") if p.is_dir())
    if not runs:
        raise RuntimeError(f"torch_xla's profiler wrote no trace under {tmp}")
    src = runs[-1]
    for f in src.iterdir():
        fsync_path(f)
    dest_root = out_dir / "plugins" / "profile"
    dest_root.mkdir(parents=True, exist_ok=True)
    dest, n = dest_root / src.name, 1
    while dest.exists():  # two traces in one second (a second fit in the same run directory)
        n += 1
        dest = dest_root / f"{src.name}_{n}"
    os.replace(src, dest)
    xplane = next(iter(sorted(dest.glob("*.xplane.pb"))), None)
    return str((xplane or dest).relative_to(out_dir))

