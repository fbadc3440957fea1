"""SPMD on torch_xla: one process per host drives every local device through a one-axis mesh.

- ``data``: parameters replicated, each batch sharded along dim 0 over the mesh; the XLA compiler
  inserts the gradient all-reduce. The loader yields the per-host batch (per-device batch x local
  devices).
- ``fsdp``: torch_xla's FSDPv2 algorithm over an ``fsdp`` axis: every parameter is sharded over
  the devices along its largest dimension (optimizer state follows it), the batch and the model's
  outputs along dim 0, and an optimization barrier after each unit's backward keeps the compiler
  from fusing all gradient reductions into one buffer. This is what
  ``SpmdFullyShardedDataParallel`` marks, done on the model itself, so parameter names (and
  checkpoint keys) stay those of the user's model. Checkpoints are sharded and reshard on load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xlatrain.backend import model_state
from xlatrain.backend.precision import Precision
from xlatrain.backend.units import UnitPolicy
from xlatrain.backend.xla import BatchSharding
from xlatrain.backend.xla_strategy import XlaStrategy, _prime_optimizer


class Spmd(XlaStrategy):
    def __init__(self, runtime: Any, *, axis: str, units: UnitPolicy = None, activation_checkpointing: bool = False) -> None:
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        super().__init__(runtime, units=units, activation_checkpointing=activation_checkpointing)
        self.axis = axis
        self.name = "spmd-fsdp" if axis == "fsdp" else "spmd-data"
        self.sharded_state = axis == "fsdp"
        self.world_size = runtime.num_devices
        self.num_processes = xr.process_count()  # each host's counts are the global ones (counting_processes 1)
        self.process_index = xr.process_index()
        self.devices_per_process = xr.addressable_runtime_device_count()
        self.mesh = xs.Mesh(np.arange(self.world_size), (self.world_size,), (axis,))
        self.input_sharding = BatchSharding(self.mesh, axis, minibatch=self.num_processes > 1)
        self._specs: dict[int, tuple[str | None, ...]] = {}  # fsdp: each parameter's partition spec
        self._placed: set[int] = set()  # parameters whose optimizer state is sharded like them
        self._unplaced_state = True
        if self.sharded_state and self.num_processes > 1:
            _host_process_group()  # sharded checkpoints coordinate their writers across hosts

    def describe(self) -> str:
        if self.axis == "data":
            how = "SPMD over a 'data' mesh"
        else:
            how = f"SPMD FSDP over an 'fsdp' mesh of {self.world_size} device(s)"
        return how + self._checkpointing_note()

    def prepare_model(
        self, model: torch.nn.Module, precision: Precision, init_weights: Callable[[torch.nn.Module], None] | None = None
    ) -> torch.nn.Module:
        units = self._place(model, init_weights)
        if self.axis != "fsdp":
            return model  # no sharding annotation: replicated
        import torch_xla.distributed.spmd as xs

        for param in {id(p): p for p in model.parameters()}.values():
            if param.dim() > 0:
                spec: list[str | None] = [None] * param.dim()
                spec[int(np.argmax(param.shape))] = "fsdp"
                xs.mark_sharding(param, self.mesh, tuple(spec))
                self._specs[id(param)] = tuple(spec)
        for module in units:  # the root's backward ends the step anyway
            xs.xla_sharding.apply_backward_optimization_barrier(module)
        model.register_forward_hook(self._shard_outputs)
        return model

    def optimizer_step(self, optimizer: torch.optim.Optimizer, finite: torch.Tensor | None) -> bool:
        dropped = super().optimizer_step(optimizer, finite)
        if self._specs and self._unplaced_state:
            self._place_state(optimizer)
        return dropped

    def _place_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Shard each parameter's optimizer state as the parameter, once it exists: left to the
        compiler, a state tensor can come out replicated (a tied weight's momentum, seen here)."""
        import torch_xla.distributed.spmd as xs

        for group in optimizer.param_groups:
            for param in group["params"]:
                spec = self._specs.get(id(param))
                state = optimizer.state.get(param)
                if spec is None or not state or id(param) in self._placed:
                    continue
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.device.type == "xla" and value.shape == param.shape:
                        xs.mark_sharding(value, self.mesh, spec)
                self._placed.add(id(param))
        self._unplaced_state = len(self._placed) < len(self._specs)

    def _shard_outputs(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The outputs sharded along the batch, as the inputs are: what makes the compiler gather
        parameters (FSDP) rather than keep activations split."""
        import torch_xla.distributed.spmd as xs
        from torch.utils._pytree import tree_leaves

        batch = next((a.shape[0] for a in tree_leaves(args) if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch and batch % self.world_size == 0:
                xs.mark_sharding(t, self.mesh, ("fsdp",) + (None,) * (t.dim() - 1))

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # one process holds the global value

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # a loss over the sharded global batch is already the global mean

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch_xla.distributed.spmd as xs

        # Replicate inside the step's graph: reading a batch-sharded tensor on the host would
        # otherwise compile a fresh gather program for every tensor read.
        # A fresh op (a clone would inherit the batch sharding annotation) marked replicated.
        whole = tensor + 0 if tensor.dtype != torch.bool else tensor.logical_not().logical_not()
        xs.mark_sharding(whole, self.mesh, (None,) * whole.dim())
        return whole

    def whole_weights(
        self, model: torch.nn.Module, read: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        # Reading a sharded tensor assembles it on the host from every device's shard.
        return model_state.whole_weights_read(model, read, self.is_main)

    def save_sharded(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        import torch_xla
        from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

        import torch_xla.core.xla_model as xm

        torch_xla.sync()  # the state saved is the state after the last step
        xm.wait_device_ops()  # its shards are read next: none may still be in flight
        return model_state.save_dcp(path, model, optimizer, no_dist=self.num_processes == 1, planner=SPMDSavePlanner())

    def load_sharded(
        self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
    ) -> None:
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        _prime_optimizer(model, optimizer)
        model_state.load_dcp(path, model, optimizer, extra, no_dist=self.num_processes == 1, planner=SPMDLoadPlanner())


def _host_process_group() -> None:
    """A CPU process group over the hosts of a multi-host SPMD job, which torch.distributed.checkpoint
    uses to agree on who writes what (torch_xla's ``xla://`` rendezvous finds the peers)."""
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the xla:// rendezvous)

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="xla://")
