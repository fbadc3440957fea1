"""Numeric precision of a run, in one place: autocast for the forward pass and the loss, and the
dtypes a sharding strategy keeps its gathered parameters and reduces its gradients in.

``"32"``: float32 throughout. ``"fp16"``: autocast to float16 with a gradient scaler (the
loss scaled up before backward, gradients unscaled before clipping, a step with an overflow
skipped and the scale lowered), for GPUs without bfloat16 (T4, V100, P100); weights, gradients
and optimizer state stay float32. ``"bf16"``: the forward pass and the loss run under autocast to
bfloat16 (matmuls and convolutions in bfloat16, reductions and the loss in float32); weights,
gradients and optimizer state stay float32. Under FSDP the parameters are also gathered in
bfloat16 (half the traffic and the memory of the gathered copy) while gradients are reduced in
float32, as torch's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Precision:
    name: str  # "32", "bf16" or "fp16"
    autocast_device: str  # torch.autocast's device_type (the runtime's)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed-precision context for forward + loss (``"32"``: none)."""
        if self.name in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.name == "bf16" else torch.float16
            return torch.autocast(device_type=self.autocast_device, dtype=dtype)
        return contextlib.nullcontext()

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype a sharded parameter is gathered in for compute (``None``: its own)."""
        return torch.bfloat16 if self.name == "bf16" else None

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in (``None``: their own, float32 under ``"32"``):
        float32 under bf16, as a bfloat16 sum over many replicas loses bits."""
        return torch.float32 if self.name == "bf16" else None
