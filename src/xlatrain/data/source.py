"""Datasets that split themselves across processes (e.g. packed shards) instead of using a sampler.

A map-style ``Dataset`` is split by the Trainer's samplers (``data.sampling``). A source that
reads sequentially — shards, streams — implements :class:`BatchSource` and yields whole batches
for one process; it must honour the same layout rules so that the Trainer's guarantees hold:

- training: ``steps_per_epoch(...)`` full batches of ``loader_batch`` rows per epoch, each
  process a disjoint part of the epoch, reshuffled per epoch from ``seed``; resuming with
  ``start_step=k`` yields exactly what an uninterrupted epoch would have yielded from step k on;
- evaluation: every record exactly once over all processes, padded to full batches, each batch
  ``((inputs, targets), valid)`` with ``valid`` a bool tensor marking real rows, laid out like
  ``EvalSampler.indices(process_index)`` (record ``i`` of step ``k`` for process ``p`` is record
  ``k * global_batch + p * loader_batch + i``), which is how ``predict`` restores dataset order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable


def check_layout(*, loader_batch: int, num_processes: int, process_index: int) -> None:
    """Raise ``ValueError`` unless ``loader_batch >= 1`` and ``0 <= process_index < num_processes``."""
    if loader_batch < 1:
        raise ValueError(f"batch_size must be >= 1, got a loader batch of {loader_batch}")
    if not 0 <= process_index < num_processes:
        raise ValueError(f"process_index={process_index} is outside 0..{num_processes - 1}")


def train_steps_per_epoch(num_samples: int, loader_batch: int, num_processes: int, step_multiple: int = 1) -> int:
    """Full global batches per epoch, rounded down to whole gradient-accumulation groups.

    The tail that does not fill them is left out of that epoch (each epoch leaves out different
    samples), so every step has the same shape and an optimizer step never spans two epochs.
    """
    global_batch = loader_batch * num_processes
    steps = num_samples // global_batch // step_multiple * step_multiple
    if num_samples == 0:
        raise ValueError("the training set is empty (0 samples): check the dataset's path, filter or split; "
                         "no batch size trains on nothing")
    if steps == 0:
        raise ValueError(
            f"the training set has {num_samples} samples, fewer than one optimizer step needs: "
            f"{step_multiple} micro-batch(es) of {global_batch} ({loader_batch} per process x "
            f"{num_processes} processes). Lower batch_size (or grad_accum_steps), or use more data"
        )
    return steps


@runtime_checkable
class BatchSource(Protocol):
    def __len__(self) -> int:
        """Number of records."""
        ...

    def train_batches(
        self,
        *,
        loader_batch: int,
        num_processes: int,
        process_index: int,
        seed: int,
        epoch: int,
        start_step: int = 0,
        step_multiple: int = 1,
    ) -> Iterable[Any]:
        """This process's ``(inputs, targets)`` batches of one training epoch, from ``start_step``."""
        ...

    def eval_batches(self, *, loader_batch: int, num_processes: int, process_index: int) -> Iterable[Any]:
        """This process's ``((inputs, targets), valid)`` batches covering its part of every record."""
        ...
