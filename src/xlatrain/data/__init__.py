"""Data: shards and their reader, packing, decoding, sampling, splits, padding collates.

``xlatrain.data.PadCollate`` is imported on first use, so importing a module of this package
does not import the others.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "PadCollate":
        from xlatrain.data.padding import PadCollate

        return PadCollate
    raise AttributeError(f"module 'xlatrain.data' has no attribute {name!r}")
