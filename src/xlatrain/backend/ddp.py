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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unused_parameters: list[str] = []  # trainable parameters the dry run's backward left without a gradient

    @property
    def checks_unused_parameters(self) -> bool:
        """DDP's reducer waits for every trainable parameter's gradient each step: a parameter the
        forward never uses stops the second step, so the dry run's backward looks for them."""
        return self.world_size > 1

    def describe(self) -> str:
        if self.world_size > 1:
            what = f"DDP over {self.world_size} processes"
            if self.unused_parameters:
                names = self.unused_parameters
                shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                what += (
                    f" (find_unused_parameters=True: {len(names)} trainable parameter(s) got no gradient in the dry "
                    f"run: {shown}; DDP searches the autograd graph for unused ones each step, which "
                    "requires_grad_(False) on parameters never meant to train avoids)"
                )
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
        return model if self.world_size == 1 else self._wrapped(model)

    def _wrapped(self, module: torch.nn.Module, find_unused_parameters: bool = False) -> torch.nn.Module:
        ids = [self._device.index] if self._device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused_parameters)

    def allow_unused_parameters(self, model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
        """``model`` wrapped anew with ``find_unused_parameters=True``, on every process at once (the
        names are every process's together): DDP's reducer then marks the gradients no backward
        reaches as ready instead of waiting for them. The old wrapper's reducer goes with it; the
        parameters, and so the optimizer, stay the same."""
        self.unused_parameters = sorted(set(names))
        inner = getattr(model, "_orig_mod", model)
        if not isinstance(inner, torch.nn.parallel.DistributedDataParallel) or inner.find_unused_parameters:
            return model
        # The old wrapper's reducer removes its gradient hooks when the caller lets go of it; until
        # then they do nothing (they act only in a backward after the wrapper's own forward).
        return self._wrapped(inner.module, find_unused_parameters=True)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        model = super().unwrap(model)
        return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        inner = getattr(model, "_orig_mod", model)
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            return inner.no_sync()
        return contextlib.nullcontext()
