"""What the CUDA benchmarks share: whether they can run here, the sizes of a smoke run (tiny, on the
CPU, for the tests that keep these programs working where no GPU is), and the spread of rounds."""

from __future__ import annotations

import statistics
from typing import Any

import torch


def cuda_missing() -> str | None:
    """Why the CUDA entries cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device on this machine: the gpu_* entries run where torch.cuda.is_available()"
    return None


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke run: sizes too small to mean anything)"


def spread(values: list[float], digits: int = 4) -> list[float]:
    return [round(min(values), digits), round(statistics.median(values), digits), round(max(values), digits)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def skipped(reason: str) -> dict[str, Any]:
    return {"skipped": reason}
