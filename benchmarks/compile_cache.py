"""torch_xla's persistent compilation cache as the Trainer uses it: the same small fit twice, in
two fresh processes sharing one fresh ``XLATRAIN_CACHE_DIR``.

``second_run_compile_ratio`` is run 2's compile seconds over run 1's (torch_xla's CompileTime
metric over ``fit``; a cache hit still counts a short CompileTime sample, the deserialisation).
A third process with an empty cache of its own, run right after, is the control
(``second_run_vs_empty_cache_ratio``): compile time on a shared machine drifts by tens of percent.
The target, at most 0.2, holds where torch_xla can load its cache entries back (TPU, GPU). On
XLA:CPU torch_xla 2.9 writes entries but fails to load them (counter
PersistentCacheDeserializeFailure), so run 2 compiles again and the ratio is about 1: the entry
reports that as measured, with the cache counters from the Trainer's history.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import xla_loop
from benchmarks.xla_loop import run_worker, xla_cpu_env

# Compile time is what is measured, so the fit is short: two epochs of nine steps.
OPTS: dict[str, Any] = {"samples": 300, "batch": 32, "epochs": 2, "width": 8, "image": 32, "lr": 1e-3, "seed": 0}


def check_environment() -> None:
    """Raise before any entry runs when the workers would have no torch_xla to run with."""
    xla_loop.check_environment()


def _entries(cache_dir: str) -> tuple[int, int]:
    files = [p for p in Path(cache_dir).rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="xlatrain-cache-bench-") as tmp:
        cache_dir = os.path.join(tmp, "cache")
        env = xla_cpu_env(cache_dir)
        first = run_worker("trainer", OPTS, env)
        entries_after_first = _entries(cache_dir)
        second = run_worker("trainer", OPTS, env)
        entries_after_second = _entries(cache_dir)
        # A control next to run 2 in time: the same fit with an empty cache of its own. Run 2
        # against it separates a saving from the cache from drift in machine load.
        control = run_worker("trainer", OPTS, xla_cpu_env(os.path.join(tmp, "control-cache")))
    first_s, second_s = first["total"]["compile_s"], second["total"]["compile_s"]
    control_s = control["total"]["compile_s"]
    cache = second["cache"]
    platform = "XLA:" + str(second.get("device_type") or "CPU")
    if cache.get("xla_cache_hits", 0) and not cache.get("xla_cache_load_failures", 0):
        note = "run 2 loaded its programs from the persistent cache"
    elif cache.get("xla_cache_load_failures", 0):
        note = (
            f"run 1 wrote {entries_after_first[0]} cache entries; run 2 failed to load "
            f"{cache['xla_cache_load_failures']} of them (PersistentCacheDeserializeFailure) and "
            "compiled again, so both ratios are compile-time noise around 1: torch_xla 2.9 writes "
            "the cache on XLA:CPU but cannot read it back; the <= 0.2 target applies on TPU/GPU"
        )
    else:
        note = "run 2 found nothing in the cache it could use and compiled again"
    return {
        "second_run_compile_ratio": round(second_s / first_s, 3) if first_s else None,
        "first_run_compile_s": round(first_s, 2),
        "second_run_compile_s": round(second_s, 2),
        "second_run_vs_empty_cache_ratio": round(second_s / control_s, 3) if control_s else None,
        "empty_cache_control_compile_s": round(control_s, 2),
        "first_run_compilations": first["total"]["compile_count"],
        "second_run_compilations": second["total"]["compile_count"],
        "cache_hits": cache.get("xla_cache_hits"),
        "cache_misses": cache.get("xla_cache_misses"),
        "cache_load_failures": cache.get("xla_cache_load_failures"),
        "first_run_cache": first["cache"],
        "cache_files_after_run_1": entries_after_first[0],
        "cache_bytes_after_run_1": entries_after_first[1],
        "cache_files_after_run_2": entries_after_second[0],
        "first_run_fit_s": round(first["fit_wall_s"], 2),
        "second_run_fit_s": round(second["fit_wall_s"], 2),
        "platform": platform,
        "target": "<= 0.2 on TPU/GPU",
        "note": note,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
