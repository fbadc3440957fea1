"""Data parallel over the processes torchrun started: every process holds the whole model and
``DistributedDataParallel`` all-reduces gradients during backward."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

from xlatrain.backend.eager import EagerStrategy
from xlatrain.backend.precision import Precision


class DDP(EagerStrategy):
    name = "ddp"

    def describe(self) -> str:
        if self.world_size > 1:
            what = f"DDP over {self.world_size} processes"
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            what = "single process (strategy='ddp' over the one process torchrun launched)"
        else:
            what = "single process (strategy='ddp' in one process: launch with torchrun --nproc-per-node N for DDP)"
        return what + self._checkpointing_note()

    def prepare_model(
        self, model: torch.nn.Module, precision: Precision, init_weights: Callable[[torch.nn.Module], None] | None = None
    ) -> torch.nn.Module:
        # A model built on the meta device is initialised by every process; DDP then broadcasts
        # process 0's weights, so all start alike.
        model = super().prepare_model(model, precision, init_weights)
        if self.world_size == 1:
            return model
        ids = [self._device.index] if self._device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        model = super().unwrap(model)
        return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        inner = getattr(model, "_orig_mod", model)
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            return inner.no_sync()
        return contextlib.nullcontext()
