"""Which sample indices each process reads, per epoch.

Every step consumes one *global batch*: ``loader_batch`` rows from each of ``num_processes``
processes. Process ``p`` reads the ``p``-th contiguous block of each global batch, so the union
over processes of step ``k`` is the same set of samples whatever the process count — which is what
makes 1 process and N processes with the same global batch train alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from xlatrain.data.source import train_steps_per_epoch


def _check_layout(num_processes: int, process_index: int, loader_batch: int) -> None:
    if not 0 <= process_index < num_processes:
        raise ValueError(f"process_index={process_index} is outside 0..{num_processes - 1}")
    if loader_batch < 1:
        raise ValueError(f"batch_size must be >= 1, got a loader batch of {loader_batch}")


class TrainSampler(Sampler[int]):
    """A seeded permutation per epoch, cut to whole global batches, split over processes.

    Steps per epoch follow :func:`~xlatrain.data.source.train_steps_per_epoch` (full batches only).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        loader_batch: int,
        num_processes: int = 1,
        process_index: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        step_multiple: int = 1,
    ) -> None:
        _check_layout(num_processes, process_index, loader_batch)
        self.num_samples = num_samples
        self.loader_batch = loader_batch
        self.num_processes = num_processes
        self.process_index = process_index
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start_step = 0
        self.steps_per_epoch = train_steps_per_epoch(num_samples, loader_batch, num_processes, step_multiple)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Select the epoch's permutation; ``start_step`` skips the steps already trained."""
        if not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(f"start_step={start_step} is outside 0..{self.steps_per_epoch}")
        self.epoch = epoch
        self.start_step = start_step

    def epoch_order(self) -> torch.Tensor:
        """All sample indices of this epoch in global-batch order (every process computes it)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.loader_batch

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_order()
        gb = self.loader_batch * self.num_processes
        lo = self.process_index * self.loader_batch
        for step in range(self.start_step, self.steps_per_epoch):
            yield from order[step * gb + lo : step * gb + lo + self.loader_batch].tolist()


class EvalSampler(Sampler[int]):
    """Every sample exactly once, in order, padded up to whole global batches.

    Indices ``>= num_samples`` are padding: :class:`PaddedDataset` turns them into a copy of a
    real sample flagged invalid, so shapes stay static and the padding is masked out of metrics.
    """

    def __init__(self, num_samples: int, *, loader_batch: int, num_processes: int = 1, process_index: int = 0) -> None:
        _check_layout(num_processes, process_index, loader_batch)
        if num_samples < 1:
            raise ValueError("the evaluation set is empty: give at least one sample")
        self.num_samples = num_samples
        self.loader_batch = loader_batch
        self.num_processes = num_processes
        self.process_index = process_index
        global_batch = loader_batch * num_processes
        self.steps = -(-num_samples // global_batch)

    def indices(self, process_index: int) -> torch.Tensor:
        """The padded indices a process reads, in reading order."""
        gb = self.loader_batch * self.num_processes
        lo = process_index * self.loader_batch
        starts = torch.arange(self.steps) * gb + lo
        return (starts[:, None] + torch.arange(self.loader_batch)[None, :]).reshape(-1)

    def __len__(self) -> int:
        return self.steps * self.loader_batch

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(self.process_index).tolist())


class PaddedDataset(Dataset[Any]):
    """``dataset`` extended with padding indices; items become ``(item, is_real)``."""

    def __init__(self, dataset: Any, num_samples: int) -> None:
        self.dataset = dataset
        self.num_samples = num_samples

    def __getitem__(self, index: int) -> tuple[Any, bool]:
        real = index < self.num_samples
        return self.dataset[index if real else index % self.num_samples], real

    def __len__(self) -> int:
        return self.num_samples
