"""The Backend protocol: everything the Trainer needs from hardware and distribution.

Terms used throughout:

- *replica*: one data-parallel copy of the model; ``world_size`` replicas see disjoint data.
- *process*: an OS process feeding one or more replicas. Under SPMD one process feeds every local
  device (``devices_per_process`` > 1); under DDP or one-process-per-chip it feeds one.
"""

from __future__ import annotations

import base64
import contextlib
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import torch


class Backend(Protocol):
    name: str  # "cpu", "cuda" or "xla"
    device: torch.device
    world_size: int  # data-parallel replicas in the whole job
    num_processes: int  # processes in the whole job, each with its own loader
    process_index: int  # this process, 0 .. num_processes-1
    devices_per_process: int  # replicas fed by one process (its loader batch = per-device * this)
    # What the device physically is: "cpu", "cuda" or "tpu". XLA on the host's CPU says "cpu",
    # so a finding can hold for the hardware it ran on, not for the runtime's name.
    platform: str
    planned_reads: int  # host reads made so far through defer/read (diagnostics count the others)

    @property
    def is_main(self) -> bool:
        """True in the one process that prints and writes files."""
        ...

    def describe(self) -> str:
        """One line for the console: runtime, device kind and count, distribution mode."""
        ...

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the model to the device and wrap it for data parallelism (returns the wrapper)."""
        ...

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside whatever prepare_model wrapped it in."""
        ...

    def wrap_loader(self, loader: Iterable[Any]) -> Iterable[Any]:
        """Batches on the device, prefetched, sharded over replicas where the runtime shards."""
        ...

    def autocast(self, precision: str) -> contextlib.AbstractContextManager[Any]:
        """Mixed-precision context for forward + loss (``"32"``: no-op)."""
        ...

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient all-reduce for a micro-batch that is not the last of an accumulation."""
        ...

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """All-reduce gradients where the runtime does not already do it (one process per chip)."""
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

    def step_begin(self, seed: int) -> None:
        """Start a training micro-step whose device randomness derives from ``seed`` alone.

        XLA keeps its generator state inside the compiled program, where a checkpoint cannot
        capture it mid-epoch; re-seeding it from (run seed, epoch, step) makes dropout masks a
        function of the position, so a resumed run draws exactly what an uninterrupted one did.
        Eager backends restore their generators from the checkpoint instead (no-op here).
        """
        ...

    def step_end(self) -> None:
        """Mark the end of one optimizer step (XLA: cut and launch the graph; no wait)."""
        ...

    def defer(self, fn: Callable[..., None], tensors: Sequence[torch.Tensor]) -> None:
        """Call ``fn(*host_tensors)`` once the values exist, without stalling the device now."""
        ...

    def read(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors`` now: a planned sync (epoch end, checkpoint)."""
        ...

    def barrier(self) -> None:
        """Wait for every process."""
        ...

    def runtime_stats(self) -> dict[str, float]:
        """Cumulative runtime counters worth a history column (XLA: compilations, host reads)."""
        ...

    def seed_everything(self, seed: int) -> None:
        """Seed Python, NumPy, torch and the device generator."""
        ...

    def rng_state(self) -> dict[str, Any]:
        """This process's random generator states as JSON-able data (host and device)."""
        ...

    def set_rng_state(self, state: dict[str, Any]) -> None:
        ...

    def gather_objects(self, obj: Any) -> list[Any]:
        """``obj`` from every process, in process order (small JSON-able values only)."""
        ...

    def any_process(self, flag: bool) -> bool:
        """True on every process if ``flag`` is true on any (host-side; no device sync)."""
        ...


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


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

