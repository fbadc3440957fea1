"""Batches on their way to the device: one epoch of this process's training batches at a time,
evaluation's padded batches, and the small batches the dry run and the memory plan use.

A map-style dataset goes through a ``DataLoader`` over the Trainer's sampler (or the user's); a
:class:`~xlatrain.data.source.BatchSource` (xlatrain's shard reader) batches its own records. Either
way the runtime wraps the host batches (device prefetch, input sharding).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from xlatrain.backend.base import Runtime, Strategy
from xlatrain.config import TrainConfig
from xlatrain.data.sampling import EvalSampler, PaddedDataset, TrainSampler, UserSampler
from xlatrain.data.source import BatchSource, train_steps_per_epoch
from xlatrain.train.batch import collate


def loader_layout(strategy: Strategy, per_device: int) -> dict[str, int]:
    """How this process's share of a global batch is laid out: its loader batch (every device it
    drives), the process count and its index."""
    return {
        "loader_batch": per_device * strategy.devices_per_process,
        "num_processes": strategy.num_processes,
        "process_index": strategy.process_index,
    }


def data_loader(
    config: TrainConfig, runtime: Runtime, dataset: Any, sampler: Any, collate_fn: Callable[[list[Any]], Any] = collate
) -> DataLoader[Any]:
    return DataLoader(
        dataset if isinstance(dataset, (Items, PaddedDataset)) else Items(dataset),
        batch_size=sampler.loader_batch,
        sampler=sampler,
        collate_fn=collate_fn,
        num_workers=config.num_workers,
        persistent_workers=config.num_workers > 0,
        pin_memory=runtime.pin_memory,
        generator=torch.Generator().manual_seed(config.seed),
    )


class TrainFeed:
    """One epoch of this process's training batches at a time, on the device."""

    def __init__(
        self, config: TrainConfig, runtime: Runtime, strategy: Strategy, dataset: Any, *,
        sampler: Any = None, collate_fn: Callable[[list[Any]], Any] = collate,
    ) -> None:
        cfg, st = config, strategy
        self._runtime, self._sharding = runtime, st.input_sharding
        self._layout = loader_layout(st, cfg.batch_size)
        self._seed = cfg.seed
        self._step_multiple = cfg.grad_accum_steps
        self.dataset = dataset
        self.sampler: TrainSampler | UserSampler | None = None
        if isinstance(dataset, BatchSource):
            self.steps_per_epoch = train_steps_per_epoch(
                len(dataset), self._layout["loader_batch"], self._layout["num_processes"], cfg.grad_accum_steps
            )
            return
        if sampler is not None:
            self.sampler = UserSampler(
                sampler, dataset, seed=cfg.seed, step_multiple=cfg.grad_accum_steps,
                agree=lambda steps: min(st.gather_objects(steps)) if st.num_processes > 1 else steps, **self._layout,
            )
        else:
            self.sampler = TrainSampler(len(dataset), seed=cfg.seed, step_multiple=cfg.grad_accum_steps, **self._layout)
        # The first epoch's steps (a user's sampler may give another count in a later epoch: the
        # Trainer counts the steps each epoch runs).
        self.steps_per_epoch = self.sampler.steps_per_epoch
        # Built once, so DataLoader workers persist across epochs.
        self._loader = data_loader(cfg, runtime, dataset, self.sampler, collate_fn)

    def sample_indices(self, epoch: int, step: int) -> list[int] | None:
        """The dataset indices of this process's batch at ``step`` (from 1) of ``epoch``, where the
        Trainer's sampler chose them (None for a BatchSource, which reads records itself)."""
        if self.sampler is None or self.sampler.epoch != epoch:
            return None
        return self.sampler.step_indices(step)

    def batches(self, epoch: int, start_step: int = 0) -> Iterable[Any]:
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, start_step)
            host: Iterable[Any] = self._loader
        else:
            host = self.dataset.train_batches(
                epoch=epoch, start_step=start_step, seed=self._seed, step_multiple=self._step_multiple, **self._layout
            )
        return self._runtime.wrap_loader(host, self._sharding)


def eval_batches(
    config: TrainConfig, runtime: Runtime, strategy: Strategy, dataset: Any,
    collate_fn: Callable[[list[Any]], Any] = collate,
) -> tuple[Iterable[Any], EvalSampler]:
    """Device batches ``(batch, valid)`` of an evaluation pass and the layout they follow:
    ``collate_fn`` makes each batch of the dataset's items, padded up to whole global batches
    with copies of real items that ``valid`` flags false."""
    layout = loader_layout(strategy, config.eval_batch_size or config.batch_size)
    sampler = EvalSampler(len(dataset), **layout)
    if isinstance(dataset, BatchSource):
        host: Iterable[Any] = dataset.eval_batches(**layout)
    else:
        padded = PaddedDataset(Items(dataset), len(dataset))
        host = data_loader(config, runtime, padded, sampler, collate if collate_fn is collate else _Flagged(collate_fn))
    return runtime.wrap_loader(host, strategy.input_sharding), sampler


class _Flagged:
    """A user's collate over padded items ``(item, is_real)``: ``(collate_fn(items), valid)``."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, pairs: list[tuple[Any, bool]]) -> tuple[Any, torch.Tensor]:
        batch = self.collate_fn([item for item, _ in pairs])
        if batch is None:
            raise ValueError(f"eval_collate_fn {self.collate_fn!r} returned None: it must return the batch it makes")
        return batch, torch.tensor([real for _, real in pairs])


def first_batch(data: Any, rows: int = 2, collate_fn: Callable[[list[Any]], Any] = collate) -> Any:
    """A small batch of ``data`` for the dry run, collated as the loaders collate (training
    batches with the user's ``collate_fn``)."""
    if isinstance(data, BatchSource):
        batch, _valid = next(iter(data.eval_batches(loader_batch=rows, num_processes=1, process_index=0)))
        return batch
    if len(data) == 0:
        raise ValueError("the evaluation set is empty: give at least one sample")
    items = Items(data)
    return collate_fn([items[i] for i in range(min(rows, len(data)))])


class Items(Dataset):  # type: ignore[type-arg]
    """A user's dataset whose failing items say which one failed and in whose ``__getitem__``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            item = self.dataset[index]
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"xlatrain: raised by {type(self.dataset).__name__}.__getitem__({index})")
            raise
        if item is None:
            raise ValueError(
                f"{type(self.dataset).__name__}[{index}] returned None: __getitem__ must return an item, an "
                "(inputs, targets) pair by default (or a dict / dataclass read through the Trainer's inputs= and "
                "targets= names)"
            )
        return item
