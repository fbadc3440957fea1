"""What made this run slow, in words: evidence gathered while training, findings at the end.

Cheap enough to leave on: per batch it compares input shapes (host metadata, no device read)
and times the wait for the next batch; per epoch it reads torch_xla's counters. At the end of
``fit`` it prints a short report (rank 0) and writes ``RUN_DIR/diagnostics.json``: each finding
with its evidence and a fix, or a clean bill.
"""

from __future__ import annotations

import json
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
INPUT_BOUND_SHARE = 0.5  # share of epoch time spent waiting for the next batch
SMALL_TPU_BATCH = 64  # per-core batch below which a TPU core is mostly idle (bf16 MXU tiles)


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
    batches: int = 0
    wait_s: float = 0.0
    changes: list[dict[str, Any]] = field(default_factory=list)
    num_changes: int = 0


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


class RunDiagnostics:
    """Collects evidence during ``Trainer.fit``; ``finish`` turns it into findings."""

    def __init__(self, backend: Any, *, per_device_batch: int, strict: bool) -> None:
        self._backend = backend
        self._xla = backend.name == "xla"
        self._strict = strict
        self._per_device_batch = per_device_batch
        self._phases: dict[str, _Phase] = {}
        self._started = time.perf_counter()
        self._epoch_started = self._started
        self._train_steps = 0
        self._epochs: list[dict[str, Any]] = []
        self._snap = self._snapshot()
        self._first = self._snap
        self._planned = getattr(backend, "planned_reads", 0)
        self._wait_mark = 0.0

    def _snapshot(self) -> dict[str, Any] | None:
        if not self._xla:
            return None
        from xlatrain.diagnostics import xla_metrics

        return xla_metrics.snapshot()

    def timed(self, batches: Iterable[Any], phase: str, epoch: int) -> Iterator[Any]:
        """Yield ``batches``, timing the wait for each and noting input shape changes."""
        state = self._phases.setdefault(phase, _Phase())
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            state.wait_s += time.perf_counter() - t0
            state.batches += 1
            sig = _signature(batch)
            if state.signature is not None and sig != state.signature:
                state.num_changes += 1
                cause = _describe_change(state.signature, sig)
                seen = next((c for c in state.changes if c["cause"] == cause), None)
                if seen is not None:
                    seen["times"] += 1  # the same change again (e.g. every epoch's last batch)
                elif len(state.changes) < MAX_CAUSES:
                    state.changes.append({"phase": phase, "epoch": epoch, "batch": state.batches, "cause": cause, "times": 1})
            state.signature = sig
            if phase == "train":
                self._train_steps += 1
            yield batch

    def end_epoch(self, epoch: int) -> dict[str, Any]:
        """Per-epoch evidence; in strict mode, raise on a recompilation or sync after epoch 1."""
        now = time.perf_counter()
        snap = self._snapshot()
        planned = getattr(self._backend, "planned_reads", 0)
        train = self._phases.get("train")
        waited = (train.wait_s if train else 0.0) - self._wait_mark
        self._wait_mark += waited
        wall = now - self._epoch_started
        row: dict[str, Any] = {
            "epoch": epoch, "wall_s": wall, "steps": self._train_steps, "input_wait_s": waited,
            "input_bound_share": min(1.0, waited / wall) if wall > 0 else 0.0,
        }
        if snap is not None and self._snap is not None:
            from xlatrain.diagnostics import xla_metrics

            d = xla_metrics.diff(self._snap, snap)
            row.update(
                compilations=d["compile_count"], compile_s=d["compile_s"],
                host_reads=d["transfer_from_device_count"], planned_reads=planned - self._planned,
                scalar_reads=d["scalar_reads"], cpu_fallback_ops=d["cpu_fallback_ops"],
            )
        self._epochs.append(row)
        self._snap, self._planned, self._epoch_started, self._train_steps = snap, planned, now, 0
        if self._strict and epoch > 1 and snap is not None:
            unplanned = row["host_reads"] - row["planned_reads"]
            if row["compilations"] or unplanned > 0:
                raise DiagnosticsError(
                    f"strict: epoch {epoch} compiled {row['compilations']} new graph(s) and read the "
                    f"device {unplanned} time(s) outside the planned reads; "
                    + "; ".join(f.title + " -> " + f.fix for f in self.findings())
                )
        return row

    def findings(self) -> list[Finding]:
        out: list[Finding] = []
        later = self._epochs[1:]
        changes = [c for p in self._phases.values() for c in p.changes]
        num_changes = sum(p.num_changes for p in self._phases.values())
        recompiles = sum(e.get("compilations", 0) for e in later)
        if changes:
            out.append(Finding(
                "input-shape-change", f"inputs changed shape or dtype {num_changes} time(s)",
                "; ".join(
                    f"{c['phase']} from epoch {c['epoch']} batch {c['batch']} ({c['times']}x): {c['cause']}" for c in changes
                ),
                "Every new shape compiles a new graph on XLA. Pad or resize inputs to one size, keep "
                "batches full (the Trainer's own samplers do; a custom BatchSource must too), and "
                "bucket variable lengths into a few fixed sizes.",
            ))
        if recompiles:
            out.append(Finding(
                "recompilation-after-warmup", f"{recompiles} compilation(s) after the first epoch",
                ", ".join(f"epoch {e['epoch']}: {e['compilations']}" for e in later if e.get("compilations")),
                "After warm-up every step should reuse compiled graphs: see the shape changes above, "
                "and avoid Python values that change per step inside the model (they become constants).",
            ))
        steps = sum(e["steps"] for e in self._epochs) or 1
        if self._epochs and "host_reads" in self._epochs[0]:
            unplanned = sum(e["host_reads"] - e["planned_reads"] for e in self._epochs)
            scalar = sum(e["scalar_reads"] for e in self._epochs)
            if unplanned >= steps / 2:
                out.append(Finding(
                    "host-sync-per-step", f"{unplanned / steps:.1f} unplanned device read(s) per step",
                    f"{unplanned} reads beyond the Trainer's planned ones over {steps} steps; "
                    f"{scalar} were .item()/float()/bool() on a device tensor",
                    "Each read stops the device until the step finishes. Remove .item(), float(t), "
                    "print(t) and `if t ...` from the model and loss; the Trainer already sums the "
                    "loss on the device and reads it every log_every steps.",
                ))
            fallbacks: dict[str, int] = {}
            for e in self._epochs:
                for name, count in e["cpu_fallback_ops"].items():
                    fallbacks[name] = fallbacks.get(name, 0) + count
            if fallbacks:
                out.append(Finding(
                    "cpu-fallback-ops", f"{len(fallbacks)} op(s) ran on the CPU, not the device",
                    ", ".join(f"{n} x{c}" for n, c in sorted(fallbacks.items(), key=lambda kv: -kv[1])),
                    "These ops have no XLA lowering: each call copies its inputs to the host and back. "
                    "Replace them (e.g. with an equivalent supported op) or move them out of the step.",
                ))
        train = self._phases.get("train")
        wall = sum(e["wall_s"] for e in self._epochs)
        # On XLA the wait includes the loader's step-boundary launch, so only a large share counts.
        if train and wall > 0 and train.wait_s / wall > INPUT_BOUND_SHARE:
            out.append(Finding(
                "input-bound", f"{100 * train.wait_s / wall:.0f}% of training time waited for input",
                f"{train.wait_s:.1f} s waiting for the next batch in {wall:.1f} s of epochs",
                "Feed faster: pack images into shards (`xlatrain pack`) and read them with ShardDataset, "
                "raise num_workers, decode at the target size, send uint8 and normalise on the device.",
            ))
        device_type = getattr(self._backend, "_device_type", "")
        if device_type == "TPU" and self._per_device_batch < SMALL_TPU_BATCH:
            out.append(Finding(
                "small-batch", f"batch_size={self._per_device_batch} per TPU core is small",
                f"a TPU core multiplies in {SMALL_TPU_BATCH}-row or larger tiles",
                f"Use batch_size >= {SMALL_TPU_BATCH} per core (scale_lr=True scales the learning rate).",
            ))
        return out

    def finish(self, run_dir: Path, is_main: bool) -> dict[str, Any]:
        findings = self.findings()
        wall = sum(e["wall_s"] for e in self._epochs) or 1.0
        report = {
            "clean": not findings,
            "compile_share": sum(e.get("compile_s", 0.0) for e in self._epochs) / wall,
            "input_bound_share": sum(e["input_wait_s"] for e in self._epochs) / wall,
            "findings": [asdict(f) for f in findings],
            "epochs": self._epochs,
            "input_wait_s": {name: p.wait_s for name, p in self._phases.items()},
        }
        if is_main:
            from xlatrain.checkpoint import atomic_write_text

            atomic_write_text(Path(run_dir) / "diagnostics.json", json.dumps(report, indent=1) + "\n")
            if findings:
                log.info("diagnostics (details in diagnostics.json):")
                for f in findings:
                    log.info(f"  - {f.title}: {f.evidence}\n    fix: {f.fix}")
            else:
                log.info("diagnostics: clean (no recompilation after warm-up, no unplanned device reads, "
                      "no CPU fallbacks, not input-bound)")
        return report
