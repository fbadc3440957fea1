"""One process per XLA device, started by :func:`xlatrain.spawn` (``xmp.spawn`` underneath): each
process feeds one device and holds the whole model; gradients are all-reduced with
``xm.reduce_gradients`` before the optimizer step. The classic torch_xla layout, kept for scripts
written for it; SPMD (``spmd.py``) is the default."""

from __future__ import annotations

from typing import Any

import torch

from xlatrain.backend.units import UnitPolicy
from xlatrain.backend.xla_strategy import XlaStrategy


class XlaProcesses(XlaStrategy):
    name = "xla-processes"

    def __init__(self, runtime: Any, *, units: UnitPolicy = None, activation_checkpointing: bool = False) -> None:
        import torch_xla.runtime as xr

        super().__init__(runtime, units=units, activation_checkpointing=activation_checkpointing)
        self.world_size = self.num_processes = self.counting_processes = xr.world_size()
        self.process_index = xr.global_ordinal()

    def describe(self) -> str:
        return "one process per device" + self._checkpointing_note()

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.reduce_gradients(optimizer)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch_xla.core.xla_model as xm

        return xm.all_reduce(xm.REDUCE_SUM, tensor)

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch_xla.core.xla_model as xm

        return xm.all_reduce(xm.REDUCE_SUM, tensor, scale=1.0 / self.world_size)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch_xla.core.xla_model as xm

        return xm.all_gather(tensor, dim=0)

