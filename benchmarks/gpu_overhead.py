"""The trainer_overhead comparison on CUDA: the Trainer's epoch time against a hand-written loop's
(same SmallCNN, data, Adam and seed), with an A/A control, in this process."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_common import cuda_missing, skipped
from benchmarks.trainer_overhead import _measure


def run(smoke: bool = False) -> dict[str, Any]:
    if smoke:
        out = _measure("cpu", rounds=1, pairs=1, steps=2)
        out.pop("target_met", None)  # a smoke run measures nothing
        return out
    missing = cuda_missing()
    if missing:
        return skipped(missing)
    out = _measure("cuda")
    out["target"] = "Trainer / plain loop epoch time: median <= 1.02, every round <= 1.05"
    out["target_met"] = out["ratio_min_median_max"][1] <= 1.02 and out["ratio_min_median_max"][2] <= 1.05
    return out
