"""Fully sharded data parallel (torch's ``fully_shard``, FSDP2) over the processes of an eager job.

Each process holds 1/N of every parameter, gradient and optimizer state (DTensors sharded on dim
0). A unit's parameters are gathered just before its forward and backward and freed after, and its
gradients are reduce-scattered, so a model N times larger than one device's share fits. Units are
the model's repeated blocks (transformer layers, ResNet blocks), found by class unless the user
names them; the root module holds the rest. Checkpoints are sharded: each process writes its own
part through ``torch.distributed.checkpoint`` and a later run reshards on load.

On CPU the group is gloo, on CUDA NCCL, on TorchTPU its ``tpu_dist`` group: the all-gather and
reduce-scatter FSDP needs are among its collectives, and no gradient divide factor is set here, so
FSDP averages with ``ReduceOp.AVG`` (TorchTPU refuses the ``PREMUL_SUM`` a custom factor would
use). A single process shards over a group of one, so the same run and its checkpoints work with
any process count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from xlatrain.backend import model_state
from xlatrain.backend.eager import EagerStrategy
from xlatrain.backend.precision import Precision
from xlatrain.backend.processes import Processes
from xlatrain.backend.units import UnitPolicy


class FSDP(EagerStrategy):
    name = "fsdp"
    sharded_state = True

    def __init__(
        self, device: torch.device, processes: Processes, *, units: UnitPolicy = None,
        activation_checkpointing: bool = False,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(device, processes, units=units, activation_checkpointing=activation_checkpointing)
        self.mesh = init_device_mesh(device.type, (self.world_size,), mesh_dim_names=("fsdp",))

    def describe(self) -> str:
        kinds = ", ".join(sorted(set(self.units)))
        what = f"{len(self.units)} unit(s) ({kinds})" if self.units else "the whole model as one unit"
        ac = ", activation checkpointing" if self.activation_checkpointing else ""
        return f"FSDP over {self.world_size} process(es), {what}{ac}"

    def prepare_model(
        self, model: torch.nn.Module, precision: Precision, init_weights: Callable[[torch.nn.Module], None] | None = None
    ) -> torch.nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        units = self._units(model)
        policy = MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)
        on_meta = model_state.has_meta_tensors(model)
        if not on_meta:
            model = model.to(self._device)
        if precision.param_dtype is not None:
            # Batch norm keeps float32 running statistics, which its bfloat16-gathered weight
            # cannot be used with: each one is a group of its own that stays float32 (its input
            # is cast to float32 on the way in), as FSDP1's mixed precision did for batch norm.
            full = MixedPrecisionPolicy(reduce_dtype=precision.reduce_dtype)
            for norm in [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]:
                fully_shard(norm, mesh=self.mesh, mp_policy=full)
        for unit in units:  # find_units returns no unit inside another
            fully_shard(unit, mesh=self.mesh, mp_policy=policy)
        fully_shard(model, mesh=self.mesh, mp_policy=policy)
        # Run as FSDP runs its own hooks under torch.compile: eagerly, outside the compiled graph.
        model.register_forward_hook(torch._dynamo.disable(_reshard_without_backward))
        if on_meta:
            # Each process gives storage to, and initialises, only its own shards.
            model_state.materialize(model, self._device, init_weights)
        return model

    def gathered_bytes(self, model: torch.nn.Module, precision: Precision) -> int:
        # The root keeps its own weights gathered for the whole training step (fully_shard does not
        # reshard the root after a forward that a backward follows); a unit's are gathered for its
        # forward and its backward, the next one's prefetched meanwhile. Gathered in the
        # precision's parameter dtype.
        module, dtype = self.unwrap(model), precision.param_dtype
        per_unit = [model_state.weight_bytes(u, dtype) for u in self.unit_modules]
        return model_state.weight_bytes(module, dtype) - sum(per_unit) + 2 * max(per_unit, default=0)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        return _no_gradient_sync(self.unwrap(model))

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        # clip_grad_norm_ over DTensor gradients sums every shard's squares over the group: the
        # norm of the whole gradient, replicated on every process.
        norm = torch.nn.utils.clip_grad_norm_(self.unwrap(model).parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def whole_weights(
        self, model: torch.nn.Module, read: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from xlatrain.checkpoint import distinct_weights

        module = self.unwrap(model)
        _, aliases = distinct_weights(module)
        # Gathered unit by unit into the main process's host memory (the others get nothing).
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return None
        return {k: v.contiguous() for k, v in full.items() if k not in aliases}, aliases

    def load_whole(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
        optim_state: dict[str, Any],
    ) -> None:
        # A checkpoint of a replicated run (single, DDP): every process reads it whole and keeps
        # its own shards.
        model_state.load_whole_sharded(self.unwrap(model), optimizer, weights, optim_state)

    def save_sharded(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return model_state.save_dcp(path, self.unwrap(model), optimizer, no_dist=False)

    def load_sharded(
        self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
    ) -> None:
        model_state.load_dcp(path, self.unwrap(model), optimizer, extra, no_dist=False)


def _reshard_without_backward(model: torch.nn.Module, args: Any, output: Any) -> None:
    """Free the root's gathered weights after a forward that no backward follows.

    fully_shard keeps the root's weights gathered after its forward, for the backward that uses
    them next, and the backward frees them. A forward without gradients (evaluation, prediction,
    ema_bn_batches' statistics) has no backward: they stayed gathered, and the next forward used
    that copy, not the parameters as written since (the EMA swapped in or out, weights loaded,
    the user's own in-place edits). Resharded here, each such forward gathers the root again, as
    it does every unit (the units reshard after each forward anyway).
    """
    if not torch.is_grad_enabled():
        model.reshard()  # type: ignore[operator]


@contextlib.contextmanager
def _no_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """Micro-batches before the last of an accumulation keep their gradients unsharded and
    unreduced: one reduce-scatter per optimizer step instead of one per micro-batch."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]
