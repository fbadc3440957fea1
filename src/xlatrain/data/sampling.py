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

from xlatrain.data.source import check_layout, train_steps_per_epoch


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
        check_layout(loader_batch=loader_batch, num_processes=num_processes, process_index=process_index)
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

    def step_indices(self, step: int) -> list[int]:
        """This process's indices at ``step`` (from 1) of the current epoch."""
        start = ((step - 1) * self.num_processes + self.process_index) * self.loader_batch
        return self.epoch_order()[start : start + self.loader_batch].tolist()

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
        check_layout(loader_batch=loader_batch, num_processes=num_processes, process_index=process_index)
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

    def valid_counts(self, process_index: int) -> list[int]:
        """The real (not padding) rows of each of a process's batches, known without a device read."""
        real = self.indices(process_index).reshape(self.steps, self.loader_batch) < self.num_samples
        return real.sum(dim=1).tolist()

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


class UserSampler(Sampler[int]):
    """A user's sampler (``Trainer(sampler=...)``), cut to whole steps as :class:`TrainSampler` is.

    ``sampler`` is one of:

    - a sampler (anything iterable over dataset indices, ``torch.utils.data.Sampler`` or not): the
      order of the *whole* training set for an epoch, the same on every process. Its indices are
      split over processes as xlatrain's own order is (process ``p`` reads the ``p``-th block of
      each global batch), so 1 and N processes with one global batch train alike;
    - a factory ``sampler(dataset, num_replicas=N, rank=r)`` that builds *this process's* sampler,
      as ``DistributedSampler`` and repeated-augmentation samplers are built: each process reads
      its own indices, and every process runs as many steps as the one with the fewest.

    Each epoch the sampler gets ``set_epoch(epoch - 1)`` (0 for the first epoch, as torch loops
    count) where it has that method, and is iterated with torch's global random generator seeded
    from the run's seed and the epoch: a sampler that draws from it (``RandomSampler``,
    ``WeightedRandomSampler`` without a generator of their own) gives the same order on every
    process and again on resume. The epoch's indices are listed before its first step (indices
    only, no data is read), so the steps an epoch runs are known exactly, whatever ``len(sampler)``
    says: :attr:`steps_per_epoch` is the current epoch's count.
    """

    def __init__(
        self,
        sampler: Any,
        dataset: Any,
        *,
        loader_batch: int,
        num_processes: int = 1,
        process_index: int = 0,
        seed: int = 0,
        step_multiple: int = 1,
        agree: Any = None,
    ) -> None:
        check_layout(loader_batch=loader_batch, num_processes=num_processes, process_index=process_index)
        # A class or a function builds each process's own sampler; an instance is the shared order.
        self.per_process = isinstance(sampler, type) or (callable(sampler) and not hasattr(sampler, "__iter__"))
        replicas = getattr(sampler, "num_replicas", None)
        if not self.per_process and isinstance(replicas, int) and replicas > 1:
            # An instance built for one process of several (a tutorial's DistributedSampler): the
            # Trainer would split its share again, and train on a fraction of the data.
            total = len(dataset)
            raise ValueError(
                f"sampler={type(sampler).__name__}(num_replicas={replicas}, rank={getattr(sampler, 'rank', '?')}) "
                f"gives one process's share of the data, about {-(-total // replicas)} of {total} samples, and this "
                f"run has {num_processes} process(es): it would train on that share alone, split again. Pass the "
                f"class or a factory instead (sampler={type(sampler).__name__}, or functools.partial("
                f"{type(sampler).__name__}, shuffle=True)): the Trainer builds one per process with the run's count "
                "and rank"
            )
        self.sampler = sampler(dataset, num_replicas=num_processes, rank=process_index) if self.per_process else sampler
        if not hasattr(self.sampler, "__iter__"):
            raise TypeError(
                f"sampler={sampler!r} built {type(self.sampler).__name__}, which gives no indices to iterate: the "
                "factory must return a sampler (e.g. DistributedSampler(dataset, num_replicas=..., rank=...))"
            )
        self.num_samples = len(dataset)
        self.loader_batch = loader_batch
        self.num_processes = num_processes
        self.process_index = process_index
        self.seed = seed
        self.step_multiple = step_multiple
        # Per-process samplers: the fewest steps any process has (a host collective), so no
        # process waits in a step that another never runs.
        self._agree = agree or (lambda steps: steps)
        self.epoch, self.start_step = 0, 0
        self._order: list[int] = []
        self.steps_per_epoch = 0
        self.set_epoch(1)

    def given(self) -> int:
        """The indices the sampler gave for the current epoch (on this process, for a per-process one)."""
        return len(self._order)

    def announced(self) -> int | None:
        """The samples the sampler says it gives (``len(sampler)``), where it says."""
        try:
            return len(self.sampler)
        except TypeError:
            return None

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch - 1)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed * 1_000_003 + epoch)
                self._order = [int(i) for i in self.sampler]
            bad = next((i for i in self._order if not 0 <= i < self.num_samples), None)
            if bad is not None:
                raise ValueError(
                    f"the sampler gave index {bad} in epoch {epoch}, outside the training set's 0..{self.num_samples - 1}: "
                    "build it over the dataset the Trainer trains on"
                )
            per_step = self.loader_batch * (1 if self.per_process else self.num_processes)
            steps = len(self._order) // per_step // self.step_multiple * self.step_multiple
            self.steps_per_epoch = self._agree(steps) if self.per_process else steps
            if self.steps_per_epoch == 0:
                raise ValueError(
                    f"the sampler gave {len(self._order)} indices in epoch {epoch}"
                    + (" on this process" if self.per_process else "")
                    + f", fewer than one optimizer step needs ({self.step_multiple} micro-batch(es) of {per_step}). "
                    "Lower batch_size (or grad_accum_steps), or give the sampler more samples"
                )
        if not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(f"start_step={start_step} is outside 0..{self.steps_per_epoch}")
        self.start_step = start_step

    def step_indices(self, step: int) -> list[int]:
        """This process's indices at ``step`` (from 1) of the current epoch."""
        size = self.loader_batch
        stride, lo = (size, 0) if self.per_process else (size * self.num_processes, self.process_index * size)
        return self._order[(step - 1) * stride + lo : (step - 1) * stride + lo + size]

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.loader_batch

    def __iter__(self) -> Iterator[int]:
        for step in range(self.start_step + 1, self.steps_per_epoch + 1):
            yield from self.step_indices(step)
