"""Read torch_xla's process-wide metrics as plain numbers: compilations, executions, host transfers,
persistent-cache outcomes and ops that fell back to the CPU.

``snapshot()`` before and after a phase, then ``diff(before, after)`` tells what that phase cost.
Neither touches a device tensor: they read counters the runtime already keeps, so they are cheap
enough to take every epoch (each call copies at most the metric's sample ring, about a thousand
numbers per metric).

Example (on any PJRT device, ``PJRT_DEVICE=CPU`` included)::

    from xlatrain.diagnostics import xla_metrics
    before = xla_metrics.snapshot()
    run_one_epoch()
    cost = xla_metrics.diff(before, xla_metrics.snapshot())
    cost["compile_count"], cost["transfer_from_device_count"], cost["cpu_fallback_ops"]
"""

from __future__ import annotations

import os
from typing import Any

# torch_xla runs ``.item()`` / ``float(t)`` / ``bool(t)`` on a device tensor through the
# ``aten::_local_scalar_dense`` fallback, so it shows among the executed fallback ops. It is a
# host read (counted by TransferFromDeviceTime as well), not an op without an XLA lowering.
SCALAR_READ_OP = "aten::_local_scalar_dense"

# (key prefix, torch_xla metric name). Time metrics accumulate nanoseconds.
_TIMED = (
    ("compile", "CompileTime"),
    ("execute", "ExecuteTime"),
    # SPMD runs execute through ExecuteReplicated; both are one program launch each.
    ("execute_replicated", "ExecuteReplicatedTime"),
    ("transfer_to_device", "TransferToDeviceTime"),
    ("transfer_from_device", "TransferFromDeviceTime"),
)
_COUNTERS = (
    ("cached_compile", "CachedCompile"),
    ("uncached_compile", "UncachedCompile"),
    ("persistent_cache_hit", "PersistentCacheHit"),
    ("persistent_cache_miss", "PersistentCacheMiss"),
    ("persistent_cache_deserialize_failure", "PersistentCacheDeserializeFailure"),
)


def snapshot() -> dict[str, Any]:
    """The process's torch_xla metrics so far, as plain Python numbers.

    Keys: ``<name>_count`` and ``<name>_s`` (total seconds) for ``compile``, ``execute``,
    ``execute_replicated``, ``transfer_to_device`` and ``transfer_from_device`` (one sample per
    host read); counters ``cached_compile``, ``uncached_compile``, ``persistent_cache_hit``,
    ``persistent_cache_miss``, ``persistent_cache_deserialize_failure``; ``fallback_ops`` (every
    ``aten::*`` op that ran on the CPU, with its count), ``cpu_fallback_ops`` (the same without
    the scalar reads) and ``scalar_reads`` (``.item()``-style reads of a device scalar).

    Needs torch_xla; raises ``ImportError`` without it.
    """
    import torch_xla.debug.metrics as met

    snap: dict[str, Any] = {}
    for key, name in _TIMED:
        data = met.metric_data(name)  # None until the metric has its first sample
        count, total_ns = (int(data[0]), float(data[1])) if data else (0, 0.0)
        snap[f"{key}_count"] = count
        snap[f"{key}_s"] = total_ns / 1e9
    for key, name in _COUNTERS:
        snap[key] = int(met.counter_value(name) or 0)

    fallbacks = _fallbacks()
    snap["fallback_ops"] = fallbacks
    snap["cpu_fallback_ops"] = {n: c for n, c in fallbacks.items() if n != SCALAR_READ_OP}
    snap["scalar_reads"] = fallbacks.get(SCALAR_READ_OP, 0)
    return snap


# torch_xla copies a device tensor to the host for a CPU fallback op's inputs and for a scalar
# read through ``xla::_to_cpu``; ``print(t)``, ``t.cpu()``, ``.tolist()`` and ``.numpy()`` copy
# through ``xla::_to_copy`` instead (as does a cast on the device), and the Trainer's planned reads
# through neither. Measured on torch_xla 2.9, XLA:CPU.
CPU_COPY_OP = "xla::_to_cpu"


def step_counters() -> tuple[int, int, int]:
    """Graphs compiled, ``.item()``-style reads and copies to the CPU so far in this process:
    ``(compiled, reads, cpu_copies)``.

    Cheap enough to call at every step: three counter lookups (a fraction of a microsecond each),
    where reading a metric copies its sample ring (about 60 microseconds once it holds a thousand
    samples). ``compiled`` counts graphs the process had not compiled before (a persistent-cache
    load included); ``reads`` counts ``.item()``, ``float(t)``, ``bool(t)`` and ``int(t)`` on a
    device tensor; ``cpu_copies`` counts those reads and each call of an op that fell back to the
    CPU (its inputs copied to the host), so ``cpu_copies - reads`` is the fallback calls. Other
    host reads (``print(t)``, ``t.cpu()``) are counted by ``transfers_since``.
    """
    import torch_xla.debug.metrics as met

    return (int(met.counter_value("UncachedCompile") or 0), int(met.counter_value(SCALAR_READ_OP) or 0),
            int(met.counter_value(CPU_COPY_OP) or 0))


def transfers_since(wall_time: float) -> int:
    """Device-to-host transfers posted after ``wall_time`` (``time.time()``), every kind of host
    read included; at most the metric's sample ring (about a thousand), so a lower bound past it.

    Reads the ring (tens of microseconds): for a step that compiled, not for every step.
    """
    import torch_xla.debug.metrics as met

    data = met.metric_data("TransferFromDeviceTime")
    return sum(1 for when, _ in data[2] if when > wall_time) if data else 0


def _fallbacks() -> dict[str, int]:
    """Every op that ran on the CPU so far, scalar reads included, with its count (by name)."""
    import torch_xla.debug.metrics as met

    # executed_fallback_ops() names the ops; the aten::* counters hold how often each ran.
    names = set(met.executed_fallback_ops()) | {n for n in met.counter_names() if n.startswith("aten::")}
    counts = {name: int(met.counter_value(name) or 0) for name in sorted(names)}
    return {name: count for name, count in counts.items() if count}


def fallback_counts() -> dict[str, int]:
    """How often each op that falls back to the CPU has run so far (scalar reads left out)."""
    return {name: count for name, count in _fallbacks().items() if name != SCALAR_READ_OP}


def compile_seconds() -> float:
    """Seconds spent compiling so far in this process."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return float(data[1]) / 1e9 if data else 0.0


def is_spmd() -> bool:
    """True when this process runs torch_xla's SPMD mode (its programs are partitioned by GSPMD)."""
    import torch_xla.runtime as xr

    return bool(xr.is_spmd())


def debug_file() -> str | None:
    """The file torch_xla writes a "Compilation Analysis" to at each compilation, if it does.

    torch_xla reads ``PT_XLA_DEBUG_LEVEL`` (1 or more: analyse each compilation) and
    ``PT_XLA_DEBUG_FILE`` (append there instead of stderr) once, when the process starts.
    """
    level = os.environ.get("PT_XLA_DEBUG_LEVEL", "0").strip()
    path = os.environ.get("PT_XLA_DEBUG_FILE")
    return path if level.isdigit() and int(level) >= 1 and path else None


_ANALYSIS = "Compilation Analysis: "  # "Post Compilation Analysis: " lines start with "Post"
_FIELDS = {"Graph Name": "graph_name", "Graph Hash": "graph_hash", "Number of Graph Inputs": "graph_inputs",
           "Number of Graph Outputs": "graph_outputs"}


def compilation_analyses(text: str) -> list[dict[str, Any]]:
    r"""torch_xla's "Compilation Analysis" blocks (``PT_XLA_DEBUG_LEVEL=1``), one per compilation.

    Each block becomes ``{"cause", "graph_hash", "graph_inputs", "graph_outputs", "frames"}``
    (``graph_name`` too when the program set one); ``frames`` are the Python frames that triggered
    the compilation, innermost first, as torch_xla wrote them (``"fn (path:line)"``).

    Example:
        >>> text = "\n".join("Compilation Analysis: " + line for line in (
        ...     "Compilation Cause", "  user torch_xla.sync", "Graph Info: ", "  Graph Hash: 3f",
        ...     "  Number of Graph Inputs: 12", "  Number of Graph Outputs: 13",
        ...     "Python Frame Triggered Execution: ", "  step_end (xla.py:210)", "-----"))
        >>> compilation_analyses(text)[0]["graph_inputs"]
        12
    """
    blocks: list[dict[str, Any]] = []
    block: dict[str, Any] | None = None
    expect_cause = in_frames = False
    for raw in text.splitlines():
        if not raw.startswith(_ANALYSIS):
            continue
        line = raw[len(_ANALYSIS):].strip()
        if line == "Compilation Cause":
            block = {"cause": "", "frames": []}
            blocks.append(block)
            expect_cause, in_frames = True, False
        elif block is None:
            continue
        elif expect_cause:
            block["cause"], expect_cause = line, False
        elif line.startswith("Python Frame Triggered Execution"):
            in_frames = True
        elif line.startswith(("---", "===", "....")):
            in_frames = False
        elif in_frames:
            block["frames"].append(line)
        else:
            name, _, value = line.partition(":")
            key = _FIELDS.get(name.strip())
            if key is not None:
                value = value.strip()
                block[key] = int(value) if key in ("graph_inputs", "graph_outputs") and value.isdigit() else value
    return blocks


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What happened between two snapshots: ``after - before`` key by key.

    Op-count maps keep only the ops whose count changed. A key missing from ``before`` counts
    from zero, so a snapshot from an older xlatrain still compares.

    Example:
        >>> diff({"compile_count": 2, "fallback_ops": {"aten::a": 1}},
        ...      {"compile_count": 5, "fallback_ops": {"aten::a": 1, "aten::b": 2}})
        {'compile_count': 3, 'fallback_ops': {'aten::b': 2}}
    """
    out: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, dict):
            old_map = old if isinstance(old, dict) else {}
            changed = {n: c - old_map.get(n, 0) for n, c in value.items()}
            out[key] = {n: c for n, c in changed.items() if c}
        elif isinstance(value, (int, float)):
            out[key] = value - (old if isinstance(old, (int, float)) else 0)
        else:
            raise ValueError(
                f"snapshot key {key!r} holds {type(value).__name__}, not a number or a map of op "
                "counts: pass two dicts returned by xlatrain.diagnostics.xla_metrics.snapshot()"
            )
    return out
