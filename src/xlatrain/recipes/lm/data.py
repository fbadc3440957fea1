"""Real text every machine has: the Python standard library's own source files, as bytes.

Files are split into training and validation by a hash of their path (whole files on one side),
concatenated with a blank line between them, and cut into windows of ``context + 1`` bytes: the
model reads the first ``context`` and predicts the last ``context``. Byte tokens need no
tokenizer. Which files there are depends on the Python version; their split does not move when
files are added.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, in a fixed order (its tests and installed packages aside)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def split_bytes(val_percent: int, max_train_bytes: int, max_val_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` byte arrays: whole files, split by a CRC32 of their relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    limits = {"train": max_train_bytes, "val": max_val_bytes}
    for path in stdlib_files():
        side = "val" if zlib.crc32(str(path.relative_to(root)).encode()) % 100 < val_percent else "train"
        if sizes[side] >= limits[side]:
            continue
        data = path.read_bytes() + b"\n\n"
        parts[side].append(data)
        sizes[side] += len(data)
    return tuple(np.frombuffer(b"".join(parts[s])[: limits[s]], dtype=np.uint8) for s in ("train", "val"))  # type: ignore[return-value]


class ByteWindows(Dataset[Any]):
    """Non-overlapping windows of a byte array: item ``i`` is ``(bytes[i*T : i*T+T], bytes[i*T+1 : i*T+T+1])``
    as int64 tokens (inputs, next-byte targets)."""

    def __init__(self, data: np.ndarray, context: int) -> None:
        if len(data) < context + 1:
            raise ValueError(
                f"the text holds {len(data)} bytes, fewer than one window of data.context + 1 = {context + 1}: "
                "lower data.context or raise the data.max_*_bytes"
            )
        self.data = torch.from_numpy(data.copy())
        self.context = context

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} is out of range for {len(self)} windows")
        window = self.data[i * self.context: (i + 1) * self.context + 1].long()
        return window[:-1], window[1:]
