"""What the Trainer asks of hardware (a Runtime) and of distribution (a Strategy), and the pair.

Terms used throughout:

- *replica*: one data-parallel part of the job; ``world_size`` replicas see disjoint data. Under
  FSDP a replica holds a shard of the model, not all of it.
- *process*: an OS process feeding one or more replicas. Under SPMD one process feeds every local
  device (``devices_per_process`` > 1); under DDP, FSDP or one-process-per-chip it feeds one.

A **Runtime** is what a device is: where tensors live, how a step is launched and read back,
random generators, compilation, the input feed, counters and memory figures. A **Strategy** is how
the model and its state are spread over the devices: it prepares and unwraps the model, reduces
gradients, clips them, runs collectives and says how the training state is saved and loaded.
Precision lives in :mod:`xlatrain.backend.precision`. Nothing outside ``backend/`` branches on a
runtime's or strategy's name: it asks these objects.
"""

from __future__ import annotations

import base64
import contextlib
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from xlatrain.backend.precision import Precision


class Runtime(Protocol):
    kind: str  # "cpu", "cuda", "tpu" (TorchTPU) or "xla" (torch_xla): the accelerator it answers to
    device: torch.device
    # What the device physically is: "cpu", "cuda" or "tpu". XLA on the host's CPU says "cpu",
    # so a finding can hold for the hardware it ran on, not for the runtime.
    platform: str
    trace_kind: str  # the profiler that traces it: "torch" (torch.profiler) or "xla" (torch_xla's)
    autocast_device: str  # torch.autocast's device_type for this device
    # float16 autocast with torch.amp.GradScaler runs here (CUDA, CPU); TPUs compute in bfloat16.
    fp16: bool
    pin_memory: bool  # host batches pinned for asynchronous copies
    # step_memory measures (CUDA): the dry run then runs once, at the real batch, and is measured.
    measures_step_memory: bool
    planned_reads: int  # host reads made so far through defer/read (diagnostics count the others)
    # The runtime's compile/transfer counters for diagnostics (torch_xla's metrics), or None.
    evidence: Any

    def describe(self) -> str:
        """Runtime and device kind, for the run header."""
        ...

    def notes(self, compiled: bool) -> list[str]:
        """What the run header should say about this runtime's settings (TorchTPU: its eager
        mode and float32 matmul precision)."""
        ...

    def compile(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` under this device's ``torch.compile`` backend (a ValueError where it has none)."""
        ...

    def wrap_loader(self, loader: Iterable[Any], sharding: Any = None) -> Iterable[Any]:
        """Batches on the device, prefetched; ``sharding`` is the strategy's input sharding."""
        ...

    def step_begin(self, seed: int) -> None:
        """Start a training micro-step whose device randomness derives from ``seed`` alone.

        XLA keeps its generator state inside the compiled program, where a checkpoint cannot
        capture it mid-epoch; re-seeding it from (run seed, epoch, step) makes dropout masks a
        function of the position, so a resumed run draws exactly what an uninterrupted one did.
        Eager runtimes restore their generators from the checkpoint instead (no-op there).
        """
        ...

    def step_end(self) -> None:
        """Mark the end of one step (XLA: cut and launch the graph; no wait)."""
        ...

    def defer(self, fn: Callable[..., None], tensors: Sequence[torch.Tensor]) -> None:
        """Call ``fn(*host_tensors)`` once the values exist, without stalling the device now."""
        ...

    def read(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors`` now: a planned sync (epoch end, checkpoint)."""
        ...

    def planned_transfers(self) -> contextlib.AbstractContextManager[None]:
        """Count the device reads made inside as planned ones (a sharded checkpoint's reads)."""
        ...

    def runtime_stats(self) -> dict[str, float]:
        """The process's runtime counters worth a history column, as totals (XLA: compilations, host
        reads); each epoch's row gets what grew during it."""
        ...

    def seed_everything(self, seed: int) -> None:
        """Seed Python, NumPy, torch and the device generator."""
        ...

    def rng_state(self) -> dict[str, Any]:
        """This process's random generator states as JSON-able data (host and device)."""
        ...

    def set_rng_state(self, state: dict[str, Any]) -> None:
        ...

    def peak_flops(self, dtype: torch.dtype) -> tuple[float, str] | None:
        """One device's dense peak FLOP/s in ``dtype`` and where the figure comes from: a
        published one (:data:`~xlatrain.backend.hardware.DEVICE_SPECS`), else measured (a large
        matmul on this device, cached per machine), ``None`` for a device the table lacks."""
        ...

    def memory_capacity(self) -> tuple[int, str] | None:
        """Bytes one device can hold, and where the figure comes from (``None``: not reported)."""
        ...

    def memory_peak(self) -> tuple[int, str] | None:
        """The most memory this process has held on its device since :meth:`reset_memory_peak`
        (or since it started), and what that figure counts."""
        ...

    def reset_memory_peak(self) -> None:
        """Start :meth:`memory_peak` afresh (a fit's peak is the fit's, not the process's)."""
        ...

    def step_memory(self, step: Callable[[], None]) -> int | None:
        """The peak bytes allocated on the device while ``step`` runs (one forward and backward at
        the real batch), measured where the runtime can (CUDA); ``None`` elsewhere, or where the
        step does not fit (out of memory: the caller falls back to its estimate)."""
        ...


class Strategy(Protocol):
    name: str  # "single", "ddp", "fsdp", "spmd-data", "spmd-fsdp", "xla-processes"
    world_size: int  # data-parallel replicas in the whole job
    num_processes: int  # processes in the whole job, each with its own loader
    process_index: int  # this process, 0 .. num_processes-1
    # Processes whose running counts (of non-finite steps) are their own, to be added up: each
    # process's, but 1 under SPMD, where every process computes the global batch's loss.
    counting_processes: int
    devices_per_process: int  # replicas fed by one process (its loader batch = per-device * this)
    # True: each process holds part of the training state and writes its own part of a checkpoint
    # (torch.distributed.checkpoint); False: every process holds all of it and the main one
    # writes it whole.
    sharded_state: bool
    input_sharding: Any  # handed to Runtime.wrap_loader (SPMD: the batch's layout on the mesh)
    mesh: Any  # the device mesh the model is spread over, or None
    # The model's repeated blocks (backend/units.py), found by prepare_model: what FSDP shards one
    # at a time and activation checkpointing recomputes; the memory plan measures each.
    unit_modules: list[torch.nn.Module]
    activation_checkpointing: bool  # the units recompute their activations during backward
    # DDP over several processes waits each step for a gradient of every trainable parameter:
    # the dry run's backward then looks for those none reaches (allow_unused_parameters).
    checks_unused_parameters: bool

    @property
    def is_main(self) -> bool:
        """True in the one process that prints and writes files."""
        ...

    def describe(self) -> str:
        ...

    def prepare_model(
        self, model: torch.nn.Module, precision: Precision, init_weights: Callable[[torch.nn.Module], None] | None = None
    ) -> torch.nn.Module:
        """Place and spread the model (returns what the training step calls). A model built on the
        ``meta`` device gets storage on the device and ``init_weights(model)`` (default: each
        submodule's ``reset_parameters()``)."""
        ...

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside whatever prepare_model wrapped it in."""
        ...

    def allow_unused_parameters(self, model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
        """``model`` as it trains when the parameters ``names`` (every process's) get no gradient
        (DDP: wrapped anew to look for them each step); ``model`` itself elsewhere."""
        ...

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient reduction for a micro-batch that is not the last of an accumulation."""
        ...

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Reduce gradients where nothing else already does (one process per XLA chip)."""
        ...

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` the norm over every gradient of the model, however sharded; returns
        that norm as a plain tensor on the device."""
        ...

    def optimizer_step(self, optimizer: torch.optim.Optimizer, finite: torch.Tensor | None) -> bool:
        """``optimizer.step()``; with ``finite`` given, a step that leaves parameters and state as
        they were when it is false, decided on the device. Returns whether it dropped optimizer
        state that the step made (the next step makes it again; see ``guarded_step``)."""
        ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of ``tensor`` over processes (identity when one process holds the whole batch)."""
        ...

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean over replicas of a per-replica value (identity where it is already global)."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate ``tensor`` along dim 0 over processes, in process order."""
        ...

    def barrier(self) -> None:
        ...

    def gather_objects(self, obj: Any) -> list[Any]:
        """``obj`` from every process, in process order (small JSON-able values only)."""
        ...

    def any_process(self, flag: bool) -> bool:
        """True on every process if ``flag`` is true on any (host-side; no device sync)."""
        ...

    def host_max(self, values: list[int]) -> list[int]:
        """The largest of each of ``values`` over the processes whose tensors :meth:`all_gather`
        joins (host-side; no device sync): the sizes a batch's rows are padded to before that
        gather, where each process padded its sequences to its own longest. ``values`` as given
        where no host exchange without a device read exists (torch_xla's process per device)."""
        ...

    def model_shapes(self, model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
        """Every distinct weight's full (unsharded) shape, by name."""
        ...

    def whole_weights(
        self, model: torch.nn.Module, read: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """The model's full weights on the host in the main process (``None`` elsewhere), and
        ``{alias: kept name}`` for tied weights. Gathers a sharded model onto the main process."""
        ...

    def load_whole(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
        optim_state: dict[str, Any],
    ) -> None:
        """Load whole weights (by name) and an optimizer ``state_dict``, as a replicated run saved them."""
        ...

    def save_sharded(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Every process writes its part of the model and optimizer state into ``path`` (a
        collective); returns the state's JSON part. Only where ``sharded_state``."""
        ...

    def load_sharded(
        self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
    ) -> None:
        """Load a state that a sharded strategy saved, under any process layout (a collective)."""
        ...

    def state_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this device holds of ``parameters``, ``gradients`` and ``optimizer`` state."""
        ...

    def gathered_bytes(self, model: torch.nn.Module, precision: Precision) -> int:
        """Bytes of whole weights a device gathers for compute at once beyond its own part
        (FSDP: the root's weights and two units', the one computing and the next), else 0."""
        ...

    def planned_state_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """What :meth:`state_bytes` will say once a step has run, known before it: parameters as
        held, a gradient for each that trains, the optimizer's state as its first step makes it."""
        ...


@dataclass(frozen=True)
class Backend:
    """Where a run executes: its :class:`Runtime` and its :class:`Strategy`.

    Example:
        >>> backend = select_backend("cpu")
        >>> backend.runtime.device, backend.strategy.world_size
        (device(type='cpu'), 1)
    """

    runtime: Runtime
    strategy: Strategy
    # Memory one device holds as the user stated it, ``(bytes, what it was read as)``, to plan for
    # a device other than this one; ``None``: what the runtime reports.
    device_memory: tuple[int, str] | None = None

    # The facts a training script asks for most, read from the two parts.
    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def process_index(self) -> int:
        return self.strategy.process_index

    @property
    def is_main(self) -> bool:
        return self.strategy.is_main

    def describe(self) -> str:
        return f"{self.runtime.describe()}, {self.strategy.describe()}"


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


# The profiler span in which the Trainer turns its planned reads' host copies into numbers: the
# trace's ``.item()``-style reads inside it are the Trainer's, not the user's.
PLANNED_READ = "xlatrain: planned read"


def host_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch CPU generator states, as JSON-able data."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": _b64(torch.get_rng_state()),
    }


def set_host_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))


def seed_host(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
