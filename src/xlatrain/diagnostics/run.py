"""What made this run slow, in words: evidence gathered while training, findings at the end.

Cheap enough to leave on: per batch it compares input shapes (host metadata, no device read),
times the wait for the next batch and, on XLA, looks up three runtime counters (graphs compiled,
``.item()``-style reads, copies to the CPU), which tells which step compiled without touching the
device (a step that did is told its host transfers and CPU ops too); per epoch it reads torch_xla's
metrics, and again before the next epoch's first step (what ran after the epoch's end). At the end
of ``fit`` it prints a short report (rank 0) and writes ``RUN_DIR/diagnostics.json``: each finding
with its evidence and a fix, notes on what needs no change or could not be judged on this
platform, or a clean bill.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from xlatrain.logs import get_logger

log = get_logger(__name__)

MAX_CAUSES = 10  # distinct shape changes listed per phase; more are counted, not listed
MAX_EVENTS = 500  # compilations kept with their step; more are counted, not kept
MAX_LISTED = 12  # groups of compilations spelled out in a finding; more are counted
# Share of training time (the steps and their batches' waits) spent waiting for input that is a
# finding: a fifth where the step runs before the next batch is asked for (eager CPU, CUDA,
# TorchTPU: feeding faster would make the run up to 1.25x faster), half on an XLA accelerator,
# whose wait also holds the loader's launch of the step. Only a second or more of waiting in all
# counts: a toy run's few milliseconds of collating are no pipeline to fix.
INPUT_BOUND_SHARE = 0.2
XLA_INPUT_BOUND_SHARE = 0.5
MIN_INPUT_WAIT_S = 1.0
SMALL_TPU_BATCH = 64  # per-core batch below which a TPU core is mostly idle (bf16 MXU tiles)
# What a clean fit compiles before it settles, counted in each phase's first pass. Measured on
# XLA:CPU (tests/scripts/diag_fit.py clean and accumulate, one and two devices, checkpoints on):
# one graph at each of the first two optimizer steps of training and the first two steps of
# evaluation (the first creates the optimizer state or the metric sums, the second takes them as
# graph inputs), and what the first epoch's epoch-end reads and metrics build between steps.
# Allowed besides, not measurable on XLA:CPU: one graph at the first step that makes a planned
# read, which builds its own graph where it gathers over processes (one process per chip).
# Everything else is a graph a clean run would not compile.
WARMUP_STEPS = {"train": 2, "eval": 2}
# Ops whose output's size depends on the values (t[mask] runs nonzero): on XLA each gives its step
# a graph of its own shapes, and torch_xla runs them on the CPU.
VALUE_SIZED_OPS = ("aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim",
                   "aten::unique_consecutive", "aten::repeat_interleave", "aten::bincount")
# torch_xla 2.9 reads it once, at start: then each compilation prints its cause, graph hash,
# number of graph inputs and the Python line that triggered it ("Compilation Analysis").
DEBUG_SETTING = "PT_XLA_DEBUG_LEVEL=1"
# The phase of what ran after an epoch's end and before the next epoch's first step (the epoch's
# bookkeeping, its checkpoint and EMA save, the on_epoch_end and on_epoch_start callbacks).
AFTER_EPOCH = "after_epoch"
GAP_READ_FIX = ("A device read after an epoch's end waits for the device (and compiles the graph that computes the "
                "value): take what a callback needs from the row on_epoch_end receives (losses and metrics, already "
                "on the host) instead of reading a device tensor, or read it once after fit().")


class DiagnosticsError(RuntimeError):
    """``strict=True`` and the run recompiled after warm-up or read the device every step."""


@dataclass
class Finding:
    code: str
    title: str
    evidence: str
    fix: str


@dataclass
class _Phase:
    signature: tuple[Any, ...] | None = None
    seen: set[tuple[Any, ...]] = field(default_factory=set)
    passes: int = 0
    batches: int = 0
    wait_s: float = 0.0
    first_wait_s: float = 0.0  # of wait_s, for each pass's first batch (a loader's workers start there)
    active_s: float = 0.0  # from each pass's first request for a batch to its end: steps and waits
    changes: list[dict[str, Any]] = field(default_factory=list)
    num_changes: int = 0
    opened: dict[tuple[Any, ...], None] = field(default_factory=dict)  # shapes that began a pass, in order


def _signature(batch: Any) -> tuple[Any, ...]:
    leaves, _ = tree_flatten(batch)
    return tuple((tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in leaves if isinstance(t, torch.Tensor))


def _describe_change(old: tuple[Any, ...], new: tuple[Any, ...]) -> str:
    parts = []
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b:
            what = "shape" if a[0] != b[0] else "dtype"
            was, now = (a[0], b[0]) if what == "shape" else (a[1], b[1])
            hint = " (a ragged batch)" if what == "shape" and a[0][1:] == b[0][1:] and a[0][:1] != b[0][:1] else ""
            parts.append(f"batch tensor {i} {what} {list(was) if what == 'shape' else was} -> "
                         f"{list(now) if what == 'shape' else now}{hint}")
    if len(old) != len(new):
        parts.append(f"number of batch tensors {len(old)} -> {len(new)}")
    return "; ".join(parts)


def _user_frame(frames: list[str]) -> str:
    """The innermost frame of torch_xla's list that is the user's code: not torch, torch_xla or xlatrain."""
    library = (os.sep + "torch" + os.sep, os.sep + "torch_xla" + os.sep, os.path.dirname(os.path.dirname(__file__)))
    for frame in frames:
        name, _, path = frame.rpartition(" (")
        if not any(part in path for part in library):
            return f"{name} ({os.path.basename(path)}"  # "item_loss (train.py:57)"
    return ""


def _steps(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


class RunDiagnostics:
    """Collects evidence during ``Trainer.fit``; ``finish`` turns it into findings and notes."""

    def __init__(
        self, runtime: Any, strategy: Any, *, per_device_batch: int, strict: bool, grad_accum_steps: int = 1,
        compile_watch: Any = None, workers: tuple[int, int] | None = None,
    ) -> None:
        self._runtime = runtime  # planned reads are counted by the runtime
        # The DataLoader's decode workers and the most this host's CPUs give (num_workers="auto"'s
        # rule), where the Trainer made the loader: what an input-bound fix can say of them.
        self._workers = workers
        self._compile = compile_watch  # a started diagnostics.compile.CompileWatch under torch.compile
        self._accum = grad_accum_steps
        # The runtime's compile/transfer counters (torch_xla's metrics), where it keeps any.
        self._evidence = runtime.evidence
        self._xla = self._evidence is not None
        self._platform = runtime.platform
        self._strict = strict
        self._per_device_batch = per_device_batch
        self._phases: dict[str, _Phase] = {}
        self._started = time.perf_counter()
        self._epoch_started = self._started
        self._train_steps = self._eval_steps = 0
        self._epochs: list[dict[str, Any]] = []
        self._snap = self._snapshot()
        self._first = self._snap
        self._planned = runtime.planned_reads
        self._wait_mark = 0.0
        self._active_mark = 0.0
        self._epoch = 0  # the epoch being trained (evaluation belongs to it)
        self._first_epoch: int | None = None  # the first epoch of this fit (later when resumed)
        self._events: list[dict[str, Any]] = []  # one per place that compiled: step or between steps
        self._dropped = {"events": 0, "graphs": 0, "unexpected": 0}
        self._counts = self._counters()
        # Each probe's wall time and planned-read count: a step that compiled is then told its host
        # transfers (torch_xla's transfer samples carry their time) beyond the planned ones, which
        # a closure deferred in the step before runs in this one (planned_reads moves when it is
        # deferred): ``(time, planned reads at the probe, planned reads deferred in the interval before)``.
        self._mark = (time.time(), runtime.planned_reads, 0)
        self._fallback_mark: dict[str, int] = self._fallback_counts()  # op counts at the last compiling probe
        self._gap_open = False  # an epoch has ended and the next epoch's training has not started
        self._planned_seen: set[str] = set()  # phases whose first planned read has happened
        self._remade = False  # the step being probed dropped optimizer state it made (state_remade)
        self._late_state = False  # the warm-up ran longer for it
        self._compile_s = self._compile_seconds()
        self._spmd = self._is_spmd()
        # torch_xla's own analysis of each compilation, when the run asked for it in a file that
        # only this process writes: (path, size before this fit, graphs compiled before this fit).
        self._debug: tuple[str, int, int] | None = None
        # Figures the Trainer measured, written with the findings (memory, throughput).
        self.sections: dict[str, Any] = {}
        path = self._debug_file()
        if path is not None and strategy.num_processes == 1:
            self._debug = (path, os.path.getsize(path) if os.path.exists(path) else 0, self._counts[0])

    # --- evidence ------------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any] | None:
        if not self._xla:
            return None
        return self._evidence.snapshot()

    def _counters(self) -> tuple[int, int, int]:
        if not self._xla:
            return 0, 0, 0
        return self._evidence.step_counters()

    def _fallback_counts(self) -> dict[str, int]:
        if not self._xla:
            return {}
        return self._evidence.fallback_counts()

    def _compile_seconds(self) -> float:
        if not self._xla:
            return 0.0
        return self._evidence.compile_seconds()

    def _is_spmd(self) -> bool:
        if not self._xla:
            return False
        return self._evidence.is_spmd()

    def _debug_file(self) -> str | None:
        if not self._xla:
            return None
        return self._evidence.debug_file()

    def _probe(self, epoch: int, phase: str | None, step: int | None, inputs: dict[str, Any] | None,
               allowed: float) -> None:
        """Charge the graphs compiled since the last probe to ``step`` of ``phase`` (None: between
        steps); ``allowed`` of them are what a clean run compiles there."""
        if not self._xla:
            return
        compiled, reads, copies = self._counters()
        graphs, step_reads, step_copies = compiled - self._counts[0], reads - self._counts[1], copies - self._counts[2]
        # Copies to the CPU that were not scalar reads: calls of ops that fell back to the CPU.
        fallback_calls = max(0, step_copies - step_reads)
        first_graph = self._counts[0] + 1
        self._counts = (compiled, reads, copies)
        since, planned_then, planned_before = self._mark
        planned = self._runtime.planned_reads
        self._mark = (time.time(), planned, planned - planned_then)
        if graphs <= 0:
            return
        # Every host transfer since the last probe, less the scalar reads and fallback copies (one
        # transfer each) and every planned read that can have run in it: what is left, if anything,
        # was a print(t), t.cpu(), .tolist() or .numpy() (a lower bound, never a guess).
        transfers = self._evidence.transfers_since(since)
        copied = max(0, transfers - max(step_copies, 0) - (planned - planned_then) - planned_before)
        if phase == AFTER_EPOCH and (step_reads or copied or fallback_calls):
            allowed = 0  # what compiled there with a read of the user's callbacks is theirs, not the warm-up
        now_ops = self._fallback_counts()
        fallback_ops = [n for n, c in now_ops.items() if c > self._fallback_mark.get(n, 0)] if fallback_calls else []
        self._fallback_mark = now_ops
        seconds = self._compile_seconds()
        spent, self._compile_s = seconds - self._compile_s, seconds
        expected = int(min(graphs, allowed))
        last = self._events[-1] if self._events else None
        if last is not None and (last["epoch"], last["phase"], last["step"]) == (epoch, phase, step):
            last["graphs"] += graphs
            last["expected"] += expected
            last["compile_s"] += spent
            last["reads"] += step_reads
            last["host_copies"] = last.get("host_copies", 0) + copied
            last["fallback_calls"] = last.get("fallback_calls", 0) + fallback_calls
            last["fallback_ops"] = sorted(set(last.get("fallback_ops", [])) | set(fallback_ops))
            return
        event = {
            "epoch": epoch, "phase": phase, "step": step, "graphs": graphs, "expected": expected,
            "compile_s": spent, "reads": step_reads, "inputs": (inputs or {}).get("kind", "between steps"),
            "input_change": (inputs or {}).get("change", ""), "first_graph": first_graph,
            "host_copies": copied, "fallback_calls": fallback_calls, "fallback_ops": fallback_ops,
        }
        if len(self._events) < MAX_EVENTS:
            self._events.append(event)
        else:
            self._dropped["events"] += 1
            self._dropped["graphs"] += graphs
            self._dropped["unexpected"] += graphs - expected

    def _compare(self, state: _Phase, phase: str, epoch: int, step: int, sig: tuple[Any, ...],
                 opening: bool = False) -> dict[str, Any]:
        """How this batch's shapes and dtypes relate to the phase's earlier batches; for a pass's
        first batch (``opening``), to the earlier passes' first batches too: that step's graph is
        not the later steps' (evaluation's first step creates its metric sums), so a shape seen
        only later in a pass is new to it."""
        if opening:
            began = list(state.opened)
            state.opened[sig] = None
            if began and sig not in began and sig in state.seen:
                if state.signature is not None and sig != state.signature:
                    self._compare(state, phase, epoch, step, sig)  # still a change from the batch before
                return {"kind": "new", "change": _describe_change(began[-1], sig)
                        + ": no earlier pass began with this shape, and a pass's first step can build a graph of "
                        "its own"}
        if state.signature is None:
            kind, change = "first", ""
        elif sig == state.signature:
            kind, change = "same", ""
        else:
            kind = "seen" if sig in state.seen else "new"
            change = _describe_change(state.signature, sig)
            state.num_changes += 1
            seen = next((c for c in state.changes if c["cause"] == change), None)
            if seen is not None:
                seen["times"] += 1  # the same change again (e.g. every epoch's last batch)
            elif len(state.changes) < MAX_CAUSES:
                state.changes.append({"phase": phase, "epoch": epoch, "step": step, "cause": change, "times": 1})
        state.seen.add(sig)
        state.signature = sig
        return {"kind": kind, "change": change}

    def timed(self, batches: Iterable[Any], phase: str, epoch: int, first_step: int = 1) -> Iterator[Any]:
        """Yield ``batches``, timing the wait for each and noting input changes and compilations.

        Args:
            batches: the phase's batches, on the device.
            phase: ``"train"`` or ``"eval"``: which compiled graph these steps run.
            epoch: the epoch being trained; 0 means the current one (evaluation inside ``fit``).
            first_step: the number of the first batch (later than 1 when a run resumes mid-epoch).
        """
        if phase == "train" and epoch and self._gap_open:
            error = self._close_gap()
            if error:
                raise DiagnosticsError(error)
        state = self._phases.setdefault(phase, _Phase())
        if phase == "train" and epoch:
            self._epoch = epoch
        epoch = epoch or self._epoch or 1
        if self._first_epoch is None:
            self._first_epoch = epoch
        state.passes += 1
        first_pass = state.passes == 1
        warm_steps = WARMUP_STEPS.get(phase, 1) * (self._accum if phase == "train" else 1)
        between = math.inf if epoch == self._first_epoch else 0
        # What compiled since the last probe ran between steps (epoch-end reads, metrics, a checkpoint).
        self._probe(epoch, None, None, None, between)
        it = iter(batches)
        step = first_step - 1
        inputs: dict[str, Any] | None = None

        planned = self._runtime.planned_reads
        warm_until = first_step + warm_steps
        # torch.compile's watch books each compilation to the phase and, in the fit's first training
        # pass, to its warm-up steps (the Trainer's first optimizer steps) or after them.
        warming = self._compile is not None and phase == "train" and first_pass and epoch == self._first_epoch

        def allowed() -> int:
            # A step whose batch has a shape of its own compiles for that reason, whatever else it does.
            nonlocal planned, warm_until
            usual = (inputs or {}).get("kind") in ("first", "same")
            warm = usual and first_pass and step < warm_until
            first_read = usual and self._runtime.planned_reads > planned and phase not in self._planned_seen
            if first_read:
                self._planned_seen.add(phase)
            if self._remade and phase == "train":
                # The next optimizer step makes the state again, reading the host as the first did,
                # and the one after compiles the steady step: the warm-up, a step later.
                self._remade = False
                self._planned_seen.discard(phase)
                if first_pass and step < warm_until:
                    warm_until, self._late_state = step + 1 + warm_steps, True
            planned = self._runtime.planned_reads
            return int(warm) + int(first_read)

        asked = None  # when the loop last asked for a batch: the time since was its step's
        while True:
            t0 = time.perf_counter()
            if asked is not None:
                state.active_s += t0 - asked
            asked = t0
            try:
                batch = next(it)
            except StopIteration:
                state.active_s += time.perf_counter() - t0
                if step >= first_step:
                    self._probe(epoch, phase, step, inputs, allowed())
                if self._compile is not None:
                    self._compile.at(None, False)  # between passes: past any warm-up steps
                return
            waited = time.perf_counter() - t0
            state.wait_s += waited
            if step < first_step:
                state.first_wait_s += waited
            # Graphs compiled since the last probe belong to the previous step: its body ran since,
            # and the loader's fetch only launches what that step left pending.
            if step >= first_step:
                self._probe(epoch, phase, step, inputs, allowed())
            else:
                self._probe(epoch, None, None, None, between)
            step += 1
            if self._compile is not None and (step == first_step or (warming and step <= warm_until)):
                self._compile.at(phase, warming and step < warm_until)  # reads dynamo only on a change
            state.batches += 1
            inputs = self._compare(state, phase, epoch, step, _signature(batch), opening=step == first_step)
            if phase == "train":
                self._train_steps += 1
            else:
                self._eval_steps += 1
            yield batch

    def state_remade(self) -> None:
        """skip_step dropped optimizer state that the training step just taken had made from
        non-finite gradients (``guarded_step``): the next step makes it again."""
        self._remade = True

    def end_epoch(self, epoch: int) -> dict[str, Any]:
        """Per-epoch evidence; in strict mode, raise on a recompilation or unplanned read after the
        warm-up: in the first epoch as its findings judge it, in later ones on any."""
        self._probe(epoch, None, None, None, math.inf if epoch == (self._first_epoch or epoch) else 0)
        now = time.perf_counter()
        snap = self._snapshot()
        planned = self._runtime.planned_reads
        train = self._phases.get("train")
        waited = (train.wait_s if train else 0.0) - self._wait_mark
        self._wait_mark += waited
        trained = (train.active_s if train else 0.0) - self._active_mark
        self._active_mark += trained
        wall = now - self._epoch_started
        row: dict[str, Any] = {
            "epoch": epoch, "wall_s": wall, "train_s": trained, "steps": self._train_steps,
            "eval_steps": self._eval_steps, "input_wait_s": waited,
            # Of the training pass's time (its steps, their batches' waits and what runs between them,
            # a mid-epoch checkpoint included), not the epoch's: validation waits for no training batch.
            "input_bound_share": min(1.0, waited / trained) if trained > 0 else 0.0,
        }
        if snap is not None and self._snap is not None:
            d = self._evidence.diff(self._snap, snap)
            row.update(
                compilations=d["compile_count"], compile_s=d["compile_s"],
                host_reads=d["transfer_from_device_count"], planned_reads=planned - self._planned,
                scalar_reads=d["scalar_reads"], cpu_fallback_ops=d["cpu_fallback_ops"],
            )
        if self._compile is not None:
            tc = self._compile.end_epoch(epoch)
            row.update(compilations=tc["compilations"], compile_s=tc["compile_s"],
                       recompilations=tc["recompilations"], graph_breaks=tc["graph_breaks"])
        self._epochs.append(row)
        self._snap, self._planned, self._epoch_started, self._train_steps, self._eval_steps = snap, planned, now, 0, 0
        self._gap_open = True
        if self._strict and self._compile is not None and (err := self._compile.strict_error()):
            self._compile.stop()
            raise DiagnosticsError(err)
        if self._strict and epoch > (self._first_epoch or 1) and snap is not None:
            unplanned = row["host_reads"] - row["planned_reads"]
            if row["compilations"] or unplanned > 0:
                raise DiagnosticsError(
                    f"strict: epoch {epoch} compiled {row['compilations']} new graph(s) and read the "
                    f"device {unplanned} time(s) outside the planned reads; "
                    + "; ".join(f.title + " -> " + f.fix for f in self.findings())
                )
        elif self._strict and snap is not None:  # the first epoch: judged step by step against its warm-up
            waste = [f for f in self.findings() if f.code in ("recompilation-after-warmup", "host-sync-per-step")]
            if waste:
                raise DiagnosticsError(f"strict: epoch {epoch}, after its warm-up: "
                                       + "; ".join(f.title + " -> " + f.fix for f in waste))
        return row

    def _close_gap(self) -> str | None:
        """Book what ran after the last epoch's end (its checkpoint and EMA save, the on_epoch_end
        and on_epoch_start callbacks) to that epoch, not to the next one's first step; returns
        strict mode's error for it, if any (judged as the epoch it follows)."""
        self._gap_open = False
        row = self._epochs[-1]
        epoch = row["epoch"]
        first = epoch == (self._first_epoch or epoch)
        self._probe(epoch, AFTER_EPOCH, None, None, math.inf if first else 0)
        snap, planned = self._snapshot(), self._runtime.planned_reads
        if snap is None or self._snap is None:
            return None
        d = self._evidence.diff(self._snap, snap)
        gap = {"compilations": d["compile_count"], "compile_s": d["compile_s"],
               "host_reads": d["transfer_from_device_count"], "planned_reads": planned - self._planned,
               "scalar_reads": d["scalar_reads"], "cpu_fallback_ops": d["cpu_fallback_ops"]}
        row["after_end"] = gap
        self._snap, self._planned = snap, planned
        unplanned = gap["host_reads"] - gap["planned_reads"]
        recompiled = self._compile_finding()
        if self._strict and first and recompiled is not None:
            # The first epoch's own waste raised at its end: what is found now compiled after it.
            return (f"strict: after epoch {epoch}'s end (its checkpoint and EMA save, the on_epoch_end and "
                    f"on_epoch_start callbacks): {recompiled.title} -> {recompiled.fix}")
        if not self._strict or first or not (gap["compilations"] or unplanned > 0):
            return None
        return (f"strict: after epoch {epoch}'s end (its checkpoint and EMA save, the on_epoch_end and on_epoch_start "
                f"callbacks) the run compiled {gap['compilations']} new graph(s) and read the device {unplanned} "
                f"time(s) outside the planned reads ({gap['scalar_reads']} .item()/float()/bool()); "
                + "; ".join(([recompiled.title + " -> " + recompiled.fix]
                             if recompiled is not None and gap["compilations"] else [])
                            + ([GAP_READ_FIX] if unplanned > 0 else [])))

    # --- findings ------------------------------------------------------------------------------
    def _attach_analyses(self) -> str | None:
        """Give each compilation torch_xla's analysis of it, read from PT_XLA_DEBUG_FILE.

        Returns why they could not be matched to steps, or None.
        """
        if self._debug is None:
            return None
        path, offset, base = self._debug
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                f.seek(offset)
                blocks = self._evidence.compilation_analyses(f.read())
        except OSError as exc:
            return f"could not read PT_XLA_DEBUG_FILE={path}: {exc}"
        counted = self._counts[0] - base
        if len(blocks) < counted:
            # One analysis per compilation is what torch_xla 2.9 writes; fewer means another writer
            # or another torch_xla, and a wrong match would name the wrong cause.
            return (f"PT_XLA_DEBUG_FILE={path} holds {len(blocks)} compilation analyses for the {counted} "
                    "compilations counted, so they are not matched to steps")
        for e in self._events:
            i = e["first_graph"] - base - 1
            e["analyses"] = [
                {**{k: b.get(k) for k in ("cause", "graph_hash", "graph_inputs")}, "at": _user_frame(b["frames"])}
                for b in blocks[i:i + e["graphs"]]
            ]
        return None

    def _previous_graph(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """torch_xla's analysis of the graph this step ran before it compiled a new one: the same
        step of an earlier pass, else the latest graph of an earlier step of the phase."""
        same, earlier = None, None
        for e in self._events:
            if e is event:
                break
            if e["phase"] != event["phase"] or e["step"] is None or not e.get("analyses"):
                continue
            if e["step"] == event["step"]:
                same = e
            elif e["step"] < event["step"] and (earlier is None or e["step"] >= earlier["step"]):
                earlier = e
        found = same or earlier
        return found["analyses"][-1] if found else None

    def _debug_hint(self) -> str:
        if self._debug is not None:
            return "torch_xla's analysis of it is missing from PT_XLA_DEBUG_FILE"
        if os.environ.get("PT_XLA_DEBUG_LEVEL", "0").strip() not in ("", "0"):
            return ("torch_xla printed its Compilation Analysis on stderr (PT_XLA_DEBUG_LEVEL is set; with "
                    "PT_XLA_DEBUG_FILE too, in a one-process run, this report reads it)")
        return f"torch_xla does not say what changed unless the run starts with {DEBUG_SETTING}"

    def _cause(self, event: dict[str, Any]) -> tuple[str, str]:
        """(kind, words) for why ``event`` compiled, as far as the evidence goes."""
        analyses = event.get("analyses") or []
        if event["inputs"] == "new":
            also = (f" (the step also read a device value {event['reads']} time(s), and each read ends a graph)"
                    if event["reads"] else "")
            return "inputs", f"new input shapes or dtypes: {event['input_change']}{also}"
        gap = event["phase"] == AFTER_EPOCH
        who = ("code run after the epoch's end (on_epoch_end and on_epoch_start callbacks)" if gap else
               "code run between steps" if event["step"] is None else "the step")
        pieces = ("which ends the graph there: each piece compiles on its own" if event["step"] is not None else
                  "which compiles the graph that computes the value")
        calls = event.get("fallback_calls", 0)
        if calls:
            ops = event.get("fallback_ops") or []
            named = (ops[0] if len(ops) == 1 else "one of " + ", ".join(ops)) if ops else "an op"
            also = (f"; it also read a device value {event['reads']} time(s) (.item(), float(), bool(), or the "
                    "op's own backward)" if event["reads"] else "")
            return "fallback", (
                f"{who} ran {named} on the CPU ({calls} call(s); torch_xla has no lowering for it): the graph "
                f"up to its inputs runs and they are copied to the host, {pieces}{also}"
            )
        if event["reads"]:
            at = next((a["at"] for a in analyses if a["at"] and "access tensor value" in (a["cause"] or "")), "")
            return "read" if not gap else "gap-read", (
                f"{who} read a device value {event['reads']} time(s) (.item(), float(), bool())"
                + (f" at {at}" if at else "") + f", {pieces}"
            )
        if event.get("host_copies", 0):
            return "copy" if not gap else "gap-read", (
                f"{who} copied a device tensor to the host {event['host_copies']} time(s) beyond the Trainer's "
                f"planned reads (print(t), t.cpu(), .tolist(), .numpy()), {pieces}"
            )
        if gap:
            return "between", f"{who}, the checkpoint or the EMA weights' save; {self._debug_hint()}"
        if event["step"] is None:
            return "between", f"between steps (epoch-end reads, metrics or a checkpoint); {self._debug_hint()}"
        same = "as the step before" if event["inputs"] == "same" else "as an earlier step that had compiled"
        before = self._previous_graph(event)
        now = analyses[-1] if analyses else None
        if now is not None and before is not None and None not in (now["graph_inputs"], before["graph_inputs"]):
            n, m = now["graph_inputs"], before["graph_inputs"]
            if n < m:
                what = f"{m - n} value(s) sent as graph inputs before are now constants in the graph"
            elif n > m:
                what = f"{n - m} value(s) that were constants in the graph now enter as graph inputs"
            else:
                what = (f"as many graph inputs, but another graph (hash {before['graph_hash']} -> "
                        f"{now['graph_hash']}): an operation, a constant or a shape inside the step changed")
            return "constant" if n != m else "graph", (
                f"same input shapes and dtypes {same}; torch_xla's analysis: {n} graph inputs where this "
                f"step's previous graph had {m}: {what}"
            )
        return "unknown", (
            f"same input shapes and dtypes {same}, so the graph changed inside the step; {self._debug_hint()}"
        )

    def _compile_finding(self) -> Finding | None:
        extra_events = [e for e in self._events if e["graphs"] > e["expected"]]
        extra = sum(e["graphs"] - e["expected"] for e in extra_events) + self._dropped["unexpected"]
        if not extra:
            return None
        first = self._first_epoch or 1
        in_first = sum(e["graphs"] - e["expected"] for e in extra_events if e["epoch"] == first)
        # One line per (epoch, graph, cause): ".item() every step" is one line, not one per step.
        groups: dict[tuple[Any, ...], dict[str, Any]] = {}
        kinds = set()
        for e in extra_events:
            kind, words = self._cause(e)
            kinds.add(kind)
            g = groups.setdefault((e["epoch"], e["phase"], words),
                                  {"event": e, "steps": [], "graphs": 0, "expected": 0, "s": 0.0})
            if e["step"] is not None:
                g["steps"].append(e["step"])
            g["graphs"] += e["graphs"]
            g["expected"] += e["expected"]
            g["s"] += e["compile_s"]
        lines = []
        for (epoch, phase, words), g in list(groups.items())[:MAX_LISTED]:
            steps = g["steps"]
            where = (f"epoch {epoch}, {phase} step{'s' if len(steps) > 1 else ''} {_steps(steps)}" if steps
                     else f"after epoch {epoch}'s end" if phase == AFTER_EPOCH else f"epoch {epoch}, between steps")
            clean = f" where a clean run compiles {g['expected']}" if g["expected"] else ""
            lines.append(f"{where}: {g['graphs']} graph(s){clean}, {g['s']:.2f} s; {words}")
        if len(groups) > MAX_LISTED:
            lines.append(f"and {len(groups) - MAX_LISTED} more place(s)")
        if self._dropped["unexpected"]:
            lines.append(f"and {self._dropped['unexpected']} graph(s) past the first {MAX_EVENTS} compilations")
        fixes = []
        if "inputs" in kinds:
            fixes.append("Keep every batch one shape: pad or resize inputs, keep batches full (the Trainer's "
                         "samplers do; a custom BatchSource must too), bucket variable lengths.")
        if "read" in kinds:
            fixes.append("Remove .item(), float(t), bool(t) and `if t ...` from the model and loss; the Trainer "
                         "already reads the loss every log_every steps without cutting the graph.")
        if "copy" in kinds:
            fixes.append("Remove print(t), t.cpu(), t.tolist() and t.numpy() of device tensors from the model and "
                         "loss (print shapes, not values); the Trainer already reads the loss every log_every steps "
                         "without cutting the graph.")
        named = sorted({op for e in extra_events for op in e.get("fallback_ops", [])})
        if "fallback" in kinds and (not named or any(op not in VALUE_SIZED_OPS for op in named)):
            ops = [op for op in named if op not in VALUE_SIZED_OPS]
            fixes.append(f"Replace {', '.join(ops) or 'the op that ran on the CPU'} with ops XLA lowers, or compute it "
                         "outside the step (once, on the host, before training).")
        if "gap-read" in kinds:
            fixes.append(GAP_READ_FIX)
        sized = [op for op in self._fallbacks() if op in VALUE_SIZED_OPS]
        if sized and kinds & {"unknown", "graph", "constant", "fallback"}:
            fixes.append(f"The step ran {', '.join(sized)}, whose output's size depends on the values (boolean-mask "
                         "indexing t[mask], nonzero, unique, masked_select): each step then has shapes of its own "
                         "inside the graph. Use fixed-shape forms: torch.where(mask, t, 0) or (t * mask).sum() for "
                         "t[mask].sum(), a mask over padded rows instead of selecting them.")
        if kinds & {"unknown", "between", "constant", "graph"}:
            fixes.append(("Otherwise, look" if sized else "Look") + " for a Python number or flag in the model, loss, "
                         "optimizer or scheduler that changes "
                         "during training: torch_xla bakes the numbers 0 and 1 into the graph as constants and "
                         "sends other numbers as graph inputs, so a value that reaches or leaves 0 or 1 (a "
                         "schedule's last step, a warm-up factor) compiles a new graph, and so does a Python "
                         "branch on such a value. Keep it fixed, or pass it as a device tensor.")
        if kinds & {"unknown", "between"} and self._debug is None:
            fixes.append(f"To see what changed, start the run with {DEBUG_SETTING}: torch_xla then analyses each "
                         "compilation (its cause, graph hash, number of graph inputs and the Python line that "
                         "triggered it); with PT_XLA_DEBUG_FILE=PATH as well, this report reads it.")
        later = extra - in_first
        split = ", ".join(part for part in (
            f"{in_first} in epoch {first} beyond warm-up" if in_first else "",
            f"{later} after epoch {first}" if later else "",
        ) if part)
        return Finding(
            "recompilation-after-warmup", f"{extra} compilation(s) a clean run would not make ({split})",
            "; ".join(lines), " ".join(fixes),
        )

    def findings(self) -> list[Finding]:
        """What to change, each with its evidence, judged for the platform the run is on."""
        out: list[Finding] = []
        changes = [c for p in self._phases.values() for c in p.changes]
        num_changes = sum(p.num_changes for p in self._phases.values())
        if changes and self._compiles_per_shape():
            out.append(Finding(
                "input-shape-change", f"inputs changed shape or dtype {num_changes} time(s)"
                + self._distinct_shapes(),
                "; ".join(
                    f"{c['phase']} from epoch {c['epoch']} step {c['step']} ({c['times']}x): {c['cause']}"
                    for c in changes
                ),
                f"Every new shape compiles a new graph on {'XLA' if self._xla else 'TorchTPU'}. Pad or resize "
                "inputs to one size, keep batches full (the Trainer's own samplers do; a custom BatchSource must "
                "too), and bucket variable lengths into a few fixed sizes (xlatrain.data.PadCollate("
                "pad_to_multiple_of=64) or buckets=(...), or pad_to_multiple_of in a Hugging Face collator).",
            ))
        recompiled = self._compile_finding()
        if recompiled is not None:
            out.append(recompiled)
        unplanned, steps = self._unplanned_reads()
        if self._epochs and "host_reads" in self._epochs[0]:
            scalar = sum(e["scalar_reads"] for e in self._epochs)
            fallbacks = self._fallbacks()
            if unplanned >= steps / 2:
                out.append(Finding(
                    "host-sync-per-step", self._reads_in_steps(unplanned, steps),
                    f"{unplanned} reads beyond the Trainer's planned ones; "
                    f"{scalar} were .item()/float()/bool() on a device tensor",
                    self._reads_fix(scalar, unplanned, fallbacks),
                ))
            if fallbacks:
                out.append(Finding(
                    "cpu-fallback-ops", f"{len(fallbacks)} op(s) ran on the CPU, not the device",
                    ", ".join(f"{n} x{c}" for n, c in sorted(fallbacks.items(), key=lambda kv: -kv[1])),
                    "These ops have no XLA lowering: each call copies its inputs to the host and back. "
                    "Replace them (e.g. with an equivalent supported op) or move them out of the step.",
                ))
        share, waited, trained = self._input_share()
        if self._input_wait_is_evidence() and self._over_bound(share) and waited >= MIN_INPUT_WAIT_S:
            out.append(Finding(
                "input-bound", f"{100 * share:.0f}% of training time waited for input",
                f"{waited:.1f} s waiting for the next batch in {trained:.1f} s of training steps",
                self._feed_fix(),
            ))
        eval_share, eval_waited, evaluated = self._input_share("eval")
        if self._input_wait_is_evidence() and self._over_bound(eval_share) and eval_waited >= MIN_INPUT_WAIT_S:
            out.append(Finding(
                "input-bound-eval", f"{100 * eval_share:.0f}% of validation time waited for input",
                f"{eval_waited:.1f} s waiting for the next validation batch in {evaluated:.1f} s of evaluation, "
                "each pass's first batch left out (its loader's workers start there)",
                self._feed_fix(counts=False) + " Validation's batches are made by eval_collate_fn (else collate_fn), in "
                "a loader of its own: under num_workers='auto' its workers are sized from its own data.",
            ))
        if self._compile is not None:
            out.extend(self._compile.findings())
        if self._platform == "tpu" and self._per_device_batch < SMALL_TPU_BATCH:
            out.append(Finding(
                "small-batch", f"batch_size={self._per_device_batch} per TPU core is small",
                f"a TPU core multiplies in {SMALL_TPU_BATCH}-row or larger tiles",
                f"Use batch_size >= {SMALL_TPU_BATCH} per core (scale_lr=True scales the learning rate).",
            ))
        return out

    @staticmethod
    def _reads_fix(scalar: int, unplanned: int, fallbacks: dict[str, int]) -> str:
        """What to change for unplanned reads: an op that ran on the CPU reads its inputs from the
        device at each call, which a count of reads cannot tell from the user's own reads; they are
        put down to it only where none was .item() and its calls are as many as the reads."""
        own = ("Each read stops the device until the step finishes. Remove .item(), float(t), print(t) and "
               "`if t ...` from the model and loss; the Trainer already sums the loss on the device and reads it "
               "every log_every steps.")
        if not fallbacks:
            return own
        ops = ", ".join(fallbacks)
        if not scalar and sum(fallbacks.values()) >= unplanned:
            return (f"None of them was .item(), float() or bool(), and the op(s) that ran on the CPU ({ops}) read "
                    "their inputs from the device at each call, as many times: replace them with ops XLA runs "
                    "(see that finding).")
        return own + (f" Some of the reads may be the op(s) that ran on the CPU ({ops}), which read their inputs at "
                      "each call.")

    def _fallbacks(self) -> dict[str, int]:
        """The ops that fell back to the CPU over the epochs, with their counts (XLA only)."""
        fallbacks: dict[str, int] = {}
        for e in self._epochs:
            for name, count in e.get("cpu_fallback_ops", {}).items():
                fallbacks[name] = fallbacks.get(name, 0) + count
        return fallbacks

    def _unplanned_reads(self) -> tuple[int, int]:
        """Device reads beyond the planned ones over the epochs (XLA's count; 0 elsewhere), and the
        steps they ran (at least 1)."""
        unplanned = sum(e.get("host_reads", 0) - e.get("planned_reads", 0) for e in self._epochs)
        return unplanned, sum(e["steps"] for e in self._epochs) or 1

    def _reads_in_steps(self, unplanned: int, steps: int) -> str:
        # Reads are counted per epoch, not per phase: the count is given over the steps of both,
        # without a per-step rate that would charge evaluation's reads to training.
        evaluated = sum(e.get("eval_steps", 0) for e in self._epochs)
        return (f"{unplanned} unplanned device read(s) in {steps} training step(s)"
                + (f" and {evaluated} evaluation step(s)" if evaluated else ""))

    def _input_share(self, phase: str = "train") -> tuple[float, float, float]:
        """The share of the epochs' training time (or evaluation's) spent waiting for a batch, the
        wait and that time."""
        if phase == "train":
            waited = sum(e["input_wait_s"] for e in self._epochs)
            spent = sum(e["train_s"] for e in self._epochs)
        else:  # after each pass's first batch: validation's loader starts its workers for every pass
            p = self._phases.get(phase)
            waited, spent = (p.wait_s - p.first_wait_s, p.active_s - p.first_wait_s) if p is not None else (0.0, 0.0)
        return (min(1.0, waited / spent) if spent > 0 else 0.0), waited, spent

    def _feed_fix(self, counts: bool = True) -> str:
        """How to feed faster; what it says of num_workers follows what the training loader had
        and what this host's CPUs give (more workers than CPUs only share them)."""
        fix = ("Feed faster: pack images into shards (`xlatrain pack`) and read them with ShardDataset, "
               "decode at the target size, send uint8 and normalise on the device")
        if self._workers is None or not counts:
            return fix + ", or give the reader more decode workers (num_workers)."
        n, most = self._workers
        if n < most:
            return f"{fix}, or raise num_workers ({n} now; this host's CPUs give {most} beside the training process)."
        return (f"{fix}. num_workers is {n}, " + ("as many as" if n == most else f"more than the {most}") +
                " this host's CPUs give beside the training process: more would share the same CPUs, so each batch "
                "has to cost less to make (the steps above), or the host needs more CPUs.")

    def _over_bound(self, share: float) -> bool:
        """Whether a share of training time spent waiting for input is more than this runtime's
        bound for a finding (an XLA accelerator's wait also holds the step's launch)."""
        return share > (XLA_INPUT_BOUND_SHARE if self._xla else INPUT_BOUND_SHARE)

    def _checked(self) -> tuple[list[str], list[str]]:
        """What a clean report can say was looked at on this runtime, and what it could not count."""
        checked, uncounted = [], []
        if self._xla or self._compile is not None:
            checked.append("no recompilation after warm-up" + ("" if self._xla else " (torch.compile)"))
        elif self._compiles_per_shape():
            checked.append("one input shape throughout (each new one would compile on TorchTPU)")
        else:
            uncounted.append("recompilations")
        if self._xla:
            # A finding takes one unplanned read per two steps; fewer are a note.
            unplanned, _ = self._unplanned_reads()
            checked += ["no unplanned device reads" if unplanned <= 0 and not self._gap_reads()[0] else
                        "unplanned device reads under one per two training steps (see the note)",
                        "no CPU fallbacks"]
        else:
            uncounted += ["device reads", "CPU fallbacks"]
        if self._input_wait_is_evidence():  # where it is not, a note says why
            share, waited, _ = self._input_share()
            short = f" ({waited:.2f} s in all: under the {MIN_INPUT_WAIT_S:g} s a finding needs, too short to judge)" \
                if self._over_bound(share) and waited < MIN_INPUT_WAIT_S else ""
            checked.append(f"input wait {100 * share:.1f}% of training time{short}")
        return checked, uncounted

    def _compiles_per_shape(self) -> bool:
        """Whether each new input shape compiles a new graph here: on XLA, and on TorchTPU (whose
        eager ops compile per shape too); torch.compile's recompiles are its watch's to report."""
        return self._xla or self._platform == "tpu"

    def _distinct_shapes(self) -> str:
        counts = [f"{len(p.seen)} distinct in {name}" for name, p in self._phases.items() if len(p.seen) > 1]
        return f" ({', '.join(counts)})" if counts else ""

    def _input_wait_is_evidence(self) -> bool:
        # Eager CPU/CUDA run the step before asking for the next batch, and an XLA accelerator
        # computes apart from the host, so waiting there means the loader was late. XLA:CPU runs
        # the compiled step on the same CPU cores as the loader, asynchronously, and the wait for a
        # batch absorbs the step's own compute: it says nothing about the loader.
        return not (self._xla and self._platform == "cpu")

    def _gap_reads(self) -> tuple[int, int, list[int]]:
        """Unplanned device reads after epochs' ends (XLA only): (reads, .item()-style ones, the epochs)."""
        gaps = [(e["epoch"], e["after_end"]) for e in self._epochs if "after_end" in e]
        found = [(epoch, g["host_reads"] - g["planned_reads"], g["scalar_reads"]) for epoch, g in gaps]
        found = [f for f in found if f[1] > 0]
        return sum(f[1] for f in found), sum(f[2] for f in found), [f[0] for f in found]

    def _read_notes(self) -> list[str]:
        """Unplanned device reads that are no finding: fewer than one per two training steps, and
        those after epochs' ends (once an epoch, outside the steps)."""
        if not (self._epochs and "host_reads" in self._epochs[0]):
            return []
        out = []
        unplanned, steps = self._unplanned_reads()
        if 0 < unplanned < steps / 2:
            scalar = sum(e["scalar_reads"] for e in self._epochs)
            out.append(f"device reads: {self._reads_in_steps(unplanned, steps)}, fewer than one per two training steps "
                       f"(a finding from there); {scalar} were .item()/float()/bool() on a device tensor. "
                       + self._reads_fix(scalar, unplanned, self._fallbacks()))
        gap, scalar, epochs = self._gap_reads()
        if gap:
            out.append(f"device reads after epochs' ends: {gap} unplanned read(s) after the end of epoch(s) "
                       f"{_steps(epochs)}, before the next epoch's first step ({scalar} .item()/float()/bool()), where "
                       "the on_epoch_end and on_epoch_start callbacks run, not in a step. " + GAP_READ_FIX)
        return out

    def notes(self) -> list[str]:
        """What the report says once, needing no change, or what it could not judge here."""
        out: list[str] = self._read_notes()
        warm = [e for e in self._events if e["expected"]]
        if warm:
            places = []
            for phase in ("train", "eval"):
                steps = sorted({e["step"] for e in warm if e["phase"] == phase})
                if steps:
                    places.append(f"{phase} step{'s' if len(steps) > 1 else ''} {_steps(steps)}")
            if any(e["step"] is None and e["phase"] != AFTER_EPOCH for e in warm):
                places.append("between steps")
            if any(e["phase"] == AFTER_EPOCH for e in warm):
                places.append("after the epoch's end")
            seconds = sum(e["compile_s"] * e["expected"] / e["graphs"] for e in warm)
            out.append(
                f"warm-up: {sum(e['expected'] for e in warm)} graph(s) compiled in {seconds:.1f} s "
                f"({', '.join(places)} of epoch {self._first_epoch}), as a clean run does"
                + (" but a step later: skip_step skipped a step whose gradients were not finite and dropped the "
                   "optimizer state that step had made, so the next step made it again" if self._late_state else "")
            )
        if self._snap is not None and self._first is not None:
            total = self._evidence.diff(self._first, self._snap)
            failed = total.get("persistent_cache_deserialize_failure", 0)
            if failed and self._platform == "cpu":
                out.append(
                    f"compile cache: {failed} entr{'y' if failed == 1 else 'ies'} could not be loaded on "
                    "XLA:CPU (torch_xla 2.9 cannot load the executables it saves there), so every run "
                    "recompiles there; on TPU the same cache skips recompiling"
                )
            elif failed:
                out.append(f"compile cache: {failed} entr{'y' if failed == 1 else 'ies'} could not be loaded "
                           "and were compiled again")
            if self._spmd and total.get("compile_count", 0):
                out.append(
                    "SPMD: XLA flags its GSPMD partitioner as deprecated in favour of Shardy at every "
                    f"compilation ({total['compile_count']} here); torch_xla 2.9 partitions with GSPMD "
                    "only, so there is nothing to change"
                )
        if self._compile is not None:
            out.extend(self._compile.notes())
        changes = [c for p in self._phases.values() for c in p.changes]
        if changes and not self._compiles_per_shape():
            train_shapes = len(self._phases["train"].seen) if "train" in self._phases else 0
            out.append(
                f"input shapes: batches changed shape {sum(p.num_changes for p in self._phases.values())} time(s)"
                f"{self._distinct_shapes()}, e.g. {changes[0]['phase']} epoch {changes[0]['epoch']} step "
                f"{changes[0]['step']}: {changes[0]['cause']}. "
                + ("Free on this runtime (eager)" if self._compile is None else
                   "Under torch.compile each new shape compiles again (its recompilations are listed)")
                + f"; on XLA and TorchTPU each new shape compiles a new graph"
                f"{f' ({train_shapes} in training here)' if train_shapes > 1 else ''}: pad or resize to a few shapes "
                "there (sequences: xlatrain.data.PadCollate(pad_to_multiple_of=...) or buckets=...)"
            )
        train = self._phases.get("train")
        if not self._input_wait_is_evidence() and train and train.batches:
            out.append(
                "input pipeline: not judged on XLA:CPU, where the compiled step runs on the same CPU "
                "cores as the loader and the wait for a batch includes the step's own compute; judge "
                "it on the TPU, or with accelerator='cpu'"
            )
        return out

    def finish(self, run_dir: Path, is_main: bool) -> dict[str, Any]:
        """Write ``run_dir/diagnostics.json`` and log the report (main process); returns the report."""
        # The last epoch's end: what its on_epoch_end callbacks did is counted too.
        error = self._close_gap() if self._gap_open and self._epochs else None
        unmatched = self._attach_analyses()
        if self._compile is not None:
            self._compile.stop()
        findings = self.findings()
        notes = self.notes() + ([unmatched] if unmatched else [])
        wall = sum(e["wall_s"] for e in self._epochs) or 1.0
        report = {
            "clean": not findings,
            "compile_share": sum(e.get("compile_s", 0.0) for e in self._epochs) / wall,
            "input_bound_share": self._input_share()[0],
            "input_wait_is_evidence": self._input_wait_is_evidence(),
            "findings": [asdict(f) for f in findings],
            "notes": notes,
            "compilations": self._events,
            "epochs": self._epochs,
            "input_wait_s": {name: p.wait_s for name, p in self._phases.items()},
        }
        if self._compile is not None:
            report["torch_compile"] = self._compile.summary()
        report.update(self.sections)
        if is_main:
            from xlatrain.checkpoint import atomic_write_text

            atomic_write_text(Path(run_dir) / "diagnostics.json", json.dumps(report, indent=1) + "\n")
            if findings:
                log.info("diagnostics (details in diagnostics.json):")
                for f in findings:
                    log.info(f"  - {f.title}: {f.evidence}\n    fix: {f.fix}")
            else:
                checked, uncounted = self._checked()
                # Two or three kinds, or none (XLA counts them all).
                counted_where = f"; {', '.join(uncounted[:-1])} and {uncounted[-1]} are counted on XLA only" \
                    if uncounted else ""
                log.info(f"diagnostics: clean ({', '.join(checked)}{counted_where})")
            for note in notes:
                log.info(f"  note: {note}")
        if error:
            raise DiagnosticsError(error)
        return report
