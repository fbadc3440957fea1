"""What the strategies over eager processes (CPU, CUDA, TorchTPU) share: the job's processes and
their collectives, the optimizer step, and a model state every process holds whole.

``single.py``, ``ddp.py`` and ``fsdp.py`` subclass :class:`EagerStrategy` and change how the
model is spread; the rest stays here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from xlatrain.backend import model_state
from xlatrain.backend.precision import Precision
from xlatrain.backend.processes import Processes
from xlatrain.backend.units import UnitPolicy, apply_activation_checkpointing, find_units


class EagerStrategy:
    name = "single"
    sharded_state = False
    input_sharding = None
    mesh = None
    devices_per_process = 1
    checks_unused_parameters = False  # only DDP waits for every parameter's gradient

    def __init__(
        self, device: torch.device, processes: Processes, *, units: UnitPolicy = None,
        activation_checkpointing: bool = False,
    ) -> None:
        self._device = device
        self._procs = processes
        self._units_policy = units
        self.activation_checkpointing = activation_checkpointing
        self.world_size = self.num_processes = self.counting_processes = processes.world_size
        self.process_index = processes.rank
        self.units: list[str] = []  # class names of the units found by prepare_model (before fully_shard renames them)
        self.unit_modules: list[torch.nn.Module] = []

    @property
    def is_main(self) -> bool:
        return self.process_index == 0

    def describe(self) -> str:
        return "single process" + self._checkpointing_note()

    def _checkpointing_note(self) -> str:
        if not self.activation_checkpointing:
            return ""
        kinds = ", ".join(sorted(set(self.units))) or "no repeated block found"
        return f", activation checkpointing of {len(self.units)} unit(s) ({kinds})"

    def _units(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The model's units, checkpointed if asked."""
        self.unit_modules = [m for _, m in find_units(model, self._units_policy)]
        self.units = [type(m).__name__ for m in self.unit_modules]
        if self.activation_checkpointing:
            apply_activation_checkpointing(self.unit_modules)
        return self.unit_modules

    def prepare_model(
        self, model: torch.nn.Module, precision: Precision, init_weights: Callable[[torch.nn.Module], None] | None = None
    ) -> torch.nn.Module:
        self._units(model)
        if model_state.has_meta_tensors(model):
            model_state.materialize(model, self._device, init_weights)
        return model.to(self._device)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "_orig_mod", model)  # torch.compile's wrapper

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # reduced in backward, or one process

    # Every process holds the same reduced gradients: the local norm is the global one.
    clip_grad_norm = staticmethod(model_state.clip_grad_norm)
    optimizer_step = staticmethod(model_state.optimizer_step)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._procs.all_reduce_sum(tensor)

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._procs.all_reduce_sum(tensor) / self.world_size if self.world_size > 1 else tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._procs.all_gather(tensor)

    def barrier(self) -> None:
        self._procs.barrier()

    def gather_objects(self, obj: Any) -> list[Any]:
        return self._procs.gather_objects(obj)

    def allow_unused_parameters(self, model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
        return model

    def any_process(self, flag: bool) -> bool:
        return self._procs.any_process(flag)

    def host_max(self, values: list[int]) -> list[int]:
        return self._procs.host_max(values)

    def model_shapes(self, model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
        return model_state.full_shapes(self.unwrap(model))

    def whole_weights(
        self, model: torch.nn.Module, read: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        return model_state.whole_weights_read(self.unwrap(model), read, self.is_main)

    def load_whole(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
        optim_state: dict[str, Any],
    ) -> None:
        self.unwrap(model).load_state_dict(weights)
        optimizer.load_state_dict(optim_state)

    def save_sharded(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        raise AssertionError(f"strategy {self.name!r} keeps the whole state on every process")

    def load_sharded(
        self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
    ) -> None:
        # A checkpoint written sharded (FSDP) comes back whole: each process reads every chunk.
        model_state.load_dcp(path, self.unwrap(model), optimizer, extra, no_dist=True)

    def state_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        return model_state.state_bytes(self.unwrap(model), optimizer)

    def gathered_bytes(self, model: torch.nn.Module, precision: Precision) -> int:
        return 0  # every process holds its whole model: nothing to gather

    def planned_state_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        def local_part(t: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
            part = model_state.local(t)
            return part.shape, part.dtype

        return model_state.planned_state_bytes(self.unwrap(model), optimizer, local_part)
