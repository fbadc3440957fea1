"""A device's peak FLOP/s where no published figure applies (this CPU, XLA:CPU): measured.

The rate of a large square matmul in the run's dtype on the run's device, best of repeated
timings, measured once and cached per machine, device, thread count, dtype and torch version in
``peak_flops.json`` beside xlatrain's compile caches (``$XLATRAIN_CACHE_DIR``'s parent, default
``~/.cache/xlatrain``). It is what a matmul-bound model could reach here, the yardstick MFU is
measured against.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from xlatrain.backend.hardware import default_cache_dir

MEASURE_S = 0.6  # time spent timing, after warm-up
# Part of each cached figure's key: figures cached under an older way of measuring are not read.
# v2: XLA:CPU waits for the matmul to finish (v1 timed its dispatch only, ~1,500x too fast).
KEY_VERSION = "v2"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path() -> Path:
    return default_cache_dir().parent / "peak_flops.json"


def measured_peak(device: torch.device, dtype: torch.dtype, sync: Callable[[torch.Tensor], None], label: str,
                  size: int = 2048, cache: bool = True) -> tuple[float, str]:
    """``(FLOP/s, how it was found)`` of ``size`` x ``size`` matmuls on ``device`` in ``dtype``
    (``cache=False``: measured now, the cached figure neither read nor written). ``sync(t)`` returns
    once ``t`` is computed, and computes nothing else (a lazy device's other pending work stays
    pending)."""
    name = str(dtype).removeprefix("torch.")
    key = f"{label}|{_cpu_model()}|threads={torch.get_num_threads()}|{name}|torch {torch.__version__}|{KEY_VERSION}"
    source = f"measured {size}x{size} {name} matmul on {label}"
    path = cache_path()
    try:
        cached = json.loads(path.read_text()) if cache else {}
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return float(cached[key]), source
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    for _ in range(2):  # warm-up: kernels, allocation, an XLA compile
        sync(a @ b)
    best, spent = 0.0, 0.0
    while spent < MEASURE_S:
        start = time.perf_counter()
        c = a @ b
        sync(c)
        del c
        took = time.perf_counter() - start
        spent += took
        best = max(best, 2 * size**3 / took)
    if not cache:
        return best, source
    cached[key] = best
    try:
        from xlatrain.checkpoint import atomic_write_text

        atomic_write_text(path, json.dumps(cached, indent=1) + "\n")
    except OSError:
        pass  # an unwritable cache only means measuring again next time
    return best, source
