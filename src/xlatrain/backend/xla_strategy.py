"""What the torch_xla strategies share (``spmd.py``: one process per host over a mesh;
``xla_processes.py``: one process per device): host-side agreement over torch_xla's rendezvous,
moving a model onto the device with its ties, and a whole state every device can read.

torch_xla is imported only inside functions, so ``import xlatrain`` works without it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from xlatrain.backend import model_state
from xlatrain.backend.precision import Precision
from xlatrain.backend.units import UnitPolicy, apply_activation_checkpointing, find_units


class XlaStrategy:
    name = "xla"
    sharded_state = False
    input_sharding = None
    mesh = None
    world_size = num_processes = devices_per_process = counting_processes = 1
    process_index = 0
    checks_unused_parameters = False  # only DDP waits for every parameter's gradient

    def __init__(self, runtime: Any, *, units: UnitPolicy = None, activation_checkpointing: bool = False) -> None:
        self._runtime = runtime
        self._units_policy = units
        self.activation_checkpointing = activation_checkpointing
        self.units: list[str] = []
        self.unit_modules: list[torch.nn.Module] = []

    @property
    def is_main(self) -> bool:
        return self.process_index == 0

    def _checkpointing_note(self) -> str:
        if not self.activation_checkpointing:
            return ""
        return f", activation checkpointing of {len(self.units)} unit(s) ({', '.join(sorted(set(self.units))) or 'none found'})"

    def _place(self, model: torch.nn.Module, init_weights: Callable[[torch.nn.Module], None] | None) -> list[torch.nn.Module]:
        """Move ``model`` onto the device (ties kept); returns its units, checkpointed if asked."""
        units = [m for _, m in find_units(model, self._units_policy)]
        self.units = [type(m).__name__ for m in units]
        self.unit_modules = units
        if self.activation_checkpointing:
            from torch_xla.utils.checkpoint import checkpoint

            apply_activation_checkpointing(units, checkpoint)
        if model_state.has_meta_tensors(model):
            model_state.materialize(model, self._runtime.device, init_weights)
        model_state.keep_ties(model, lambda m: m.to(self._runtime.device))
        return units

    def prepare_model(
        self, model: torch.nn.Module, precision: Precision, init_weights: Callable[[torch.nn.Module], None] | None = None
    ) -> torch.nn.Module:
        self._place(model, init_weights)
        return model

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # gradients are reduced explicitly or by the compiler

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    # Under SPMD the norm of sharded gradients is computed over whole tensors by the compiler;
    # one process per device clips after the gradients were all-reduced.
    clip_grad_norm = staticmethod(model_state.clip_grad_norm)
    optimizer_step = staticmethod(model_state.optimizer_step)

    def barrier(self) -> None:
        if self.num_processes > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous("xlatrain.barrier")

    def gather_objects(self, obj: Any) -> list[Any]:
        if self.num_processes == 1:
            return [obj]
        import torch_xla.core.xla_model as xm

        # JSON over torch_xla's rendezvous: nothing received from another process is unpickled.
        payloads = xm.rendezvous("xlatrain.gather", json.dumps(obj).encode())
        return [json.loads(p) for p in payloads]

    def allow_unused_parameters(self, model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
        return model

    def any_process(self, flag: bool) -> bool:
        return any(self.gather_objects(bool(flag)))

    def host_max(self, values: list[int]) -> list[int]:
        # One SPMD program has one shape. One process per device: torch_xla's rendezvous (the
        # only host exchange) syncs the device and reads it, which an evaluation batch must not;
        # there every process pads evaluation to one length (each new length compiles anyway).
        return values

    def model_shapes(self, model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
        return model_state.full_shapes(model)

    def whole_weights(
        self, model: torch.nn.Module, read: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        return model_state.whole_weights_read(model, read, self.is_main)

    def load_whole(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
        optim_state: dict[str, Any],
    ) -> None:
        model.load_state_dict(weights)  # copied into the device tensors, their sharding kept
        optimizer.load_state_dict(optim_state)

    def save_sharded(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        raise AssertionError(f"strategy {self.name!r} keeps the whole state on every device")

    def load_sharded(
        self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
    ) -> None:
        # Every process reads the whole state of a sharded checkpoint (it holds all of it).
        _prime_optimizer(model, optimizer)
        model_state.load_dcp(path, model, optimizer, extra, no_dist=True)

    def state_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        return device_state_bytes(model, optimizer)

    def gathered_bytes(self, model: torch.nn.Module, precision: Precision) -> int:
        return 0  # under SPMD the compiler schedules the gathers: no figure known before it compiles

    def planned_state_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return model_state.planned_state_bytes(model, optimizer, device_part, count_scalars=False)


def _prime_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (as DCP does before a load) and run it, so its tensors carry
    the sharding the compiler gives them: DCP's XLA planner needs it to place each chunk."""
    import torch_xla
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import torch_xla.core.xla_model as xm

    get_state_dict(model, optimizer)
    torch_xla.sync()
    # DCP then writes into these tensors: a tensor whose computation is still running cannot be
    # touched ("an async operation is in flight"), so wait for the launched work.
    xm.wait_device_ops()


def device_part(t: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    """Shape and dtype of the part of ``t`` the first device holds (all of a replicated tensor)."""
    if t.device.type != "xla":
        return t.shape, t.dtype
    import torch_xla

    if not torch_xla._XLAC._get_xla_sharding_spec(t):
        return t.shape, t.dtype  # not sharded (yet): every device holds all of it
    return torch_xla._XLAC._get_local_shards([t])[0][0][0].shape, t.dtype


def device_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes one device holds of parameters, gradients and optimizer state, read from each
    tensor's shard on the first device (a replicated tensor is whole there)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    # Reading a shard of a tensor whose step is still running fails ("an async operation is in
    # flight"): wait for the launched work first.
    xm.wait_device_ops()

    def shard_bytes(tensors: list[torch.Tensor]) -> int:
        tensors = [t for t in tensors if t.device.type == "xla"]
        if not tensors:
            return 0
        shards = torch_xla._XLAC._get_local_shards(tensors)
        return sum(per_device[0][0].numel() * t.element_size() for per_device, t in zip(shards, tensors))

    params = list({id(p): p for p in model.parameters()}.values())
    out = {
        "parameters": shard_bytes(params),
        "gradients": shard_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": 0,
    }
    if optimizer is not None:
        out["optimizer"] = shard_bytes([
            v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0
        ])
    return out
