"""Batches on their way to the device: one epoch of this process's training batches at a time,
evaluation's padded batches, and the small batches the dry run and the memory plan use.

A map-style dataset goes through a ``DataLoader`` over the Trainer's sampler (or the user's); a
:class:`~xlatrain.data.source.BatchSource` (xlatrain's shard reader) batches its own records. Either
way the runtime wraps the host batches (device prefetch, input sharding).
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import pickle
import random
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from xlatrain.backend.hardware import cpu_share
from xlatrain.data.workers import auto_workers

from xlatrain.backend.base import Runtime, Strategy, host_rng_state, set_host_rng_state
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


# Making a batch in the training process that takes less than this costs it no more than taking
# one from a worker process would (0.6-0.95 ms a batch measured on this project's CPU, a DataLoader
# worker's queue already full), and saves starting the workers: on an H100 host the LM benchmark's
# start-up was 3.9-14.0 steps longer than a hand loop's with 8 workers for its byte windows, 2.2-7.8
# with none.
IN_PROCESS_BATCH_S = 1e-3


def decode_workers(
    requested: int | str, dataset: Any, batches: int, rows: int = 0, collate_fn: Callable[[list[Any]], Any] = collate,
) -> tuple[int, str]:
    """The processes that fetch and decode batches beside this training process, and why:
    ``"auto"`` is :func:`~xlatrain.data.workers.auto_workers`, and none for data already in memory
    and stacked by the default collate (nothing to decode) or whose batch of ``rows`` items is made
    here in under ``IN_PROCESS_BATCH_S`` (a collate_fn's work included: tokenising or padding a
    list of texts is work a worker can do); a number is used as given."""
    if requested != "auto":
        return int(requested), "as configured"
    if isinstance(dataset, (TensorDataset, list, tuple)) and collate_fn is collate:
        return 0, f"auto: a {type(dataset).__name__} is in memory, nothing to decode"
    spent = in_process_batch_s(dataset, rows, collate_fn, IN_PROCESS_BATCH_S) if rows else None
    if spent is not None:
        return 0, (f"auto: a batch of {min(rows, len(dataset))} took {1e3 * spent:.2f} ms to make here, less than "
                   "taking one from a worker would cost")
    # The start method in force, else the default (asking without allow_none would fix it for the user).
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    if method != "fork" and collate_fn is not collate:
        try:  # a worker started by spawn or forkserver gets the collate_fn pickled
            pickle.dumps(collate_fn)
        except Exception:  # noqa: BLE001 - any failure to pickle is the same answer
            return 0, (f"auto: collate_fn {collate_fn!r} cannot be pickled for a worker process (start method "
                       f"{method!r}), so batches are made here; a collate_fn defined at a module's top level can be")
    return auto_workers(batches)


def in_process_batch_s(
    dataset: Any, rows: int, collate_fn: Callable[[list[Any]], Any], limit_s: float = IN_PROCESS_BATCH_S,
) -> float | None:
    """Seconds to make a batch of ``rows`` of ``dataset``'s items here, or ``None`` where that
    takes longer than ``limit_s`` or an item fails (the dry run that follows says how).

    Two batches of different items are made: the first warms what a process's first items pay
    once (and is given 5 times the limit: slow data stops it at the item that passes it, which is
    all it waits for), the second is the one measured. The random state is left as it was found.
    """
    state = host_rng_state()
    try:
        n = min(rows, len(dataset))
        if _batch_s(dataset, range(n), collate_fn, 5 * limit_s) is None:
            return None
        return _batch_s(dataset, [(n + i) % len(dataset) for i in range(n)], collate_fn, limit_s)
    except Exception:  # noqa: BLE001 - not this measurement's to report
        return None
    finally:
        set_host_rng_state(state)


def _batch_s(dataset: Any, indices: Iterable[int], collate_fn: Callable[[list[Any]], Any], limit_s: float) -> float | None:
    started = time.perf_counter()
    items = []
    for i in indices:
        items.append(dataset[i])
        if time.perf_counter() - started > limit_s:
            return None
    collate_fn(items)
    spent = time.perf_counter() - started
    return spent if spent <= limit_s else None


def _quiet_worker(worker_id: int) -> None:
    """A worker leaves Ctrl-C and SIGTERM to the training process, which finishes its step, saves
    and then stops its workers. Both often reach every process of a job (Ctrl-C the terminal's
    process group, a scheduler's SIGTERM the job's or container's processes): a worker that died
    of one would fail the step the checkpoint waits for, and one that kept the training process's
    handler would print the stop notice again. A worker whose training process is gone exits by
    itself (the DataLoader's watchdog)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def data_loader(
    config: TrainConfig, runtime: Runtime, dataset: Any, sampler: Any, collate_fn: Callable[[list[Any]], Any] = collate,
    *, num_workers: int = 0, phase: str = "train", process_index: int = 0,
) -> DataLoader[Any]:
    """A DataLoader whose every batch draws its random numbers (augmentation in the dataset, a
    mixup collate) from a seed of ``(seed, epoch, step, process)``, in a worker or in this process
    alike: the batches do not depend on how many workers made them, nor on where a resumed run
    started."""
    items = dataset if isinstance(dataset, (Items, PaddedDataset)) else Items(dataset)
    return DataLoader(
        SeededBatches(items, collate_fn),
        batch_sampler=SeededSampler(sampler, config.seed, phase, process_index),
        collate_fn=_only,
        num_workers=num_workers,
        persistent_workers=num_workers > 0 and phase == "train",
        pin_memory=runtime.pin_memory,
        worker_init_fn=_quiet_worker if num_workers > 0 else None,
        generator=torch.Generator().manual_seed(config.seed),
    )


def batch_seed(seed: int, phase: str, epoch: int, step: int, process_index: int) -> int:
    """The seed of one batch's random draws."""
    key = f"{seed}:{phase}:{epoch}:{step}:{process_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % 2**63


class SeededSampler(Sampler[list[tuple[int, int]]]):
    """A sampler's indices in loader batches, each index paired with its batch's seed."""

    def __init__(self, sampler: Any, seed: int, phase: str, process_index: int) -> None:
        self.sampler, self.seed, self.phase, self.process_index = sampler, seed, phase, process_index
        self.loader_batch = sampler.loader_batch

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.loader_batch)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, step = getattr(self.sampler, "epoch", 0), getattr(self.sampler, "start_step", 0)
        indices = iter(self.sampler)
        while chunk := list(itertools.islice(indices, self.loader_batch)):
            step += 1
            seed = batch_seed(self.seed, self.phase, epoch, step, self.process_index)
            yield [(seed, index) for index in chunk]


class SeededBatches(Dataset):  # type: ignore[type-arg]
    """Fetches and collates one whole batch under its own seed (``__getitems__``), leaving the
    random state of the process it runs in as it found it."""

    def __init__(self, items: Any, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.items, self.collate_fn = items, collate_fn
        # A plain TensorDataset under the default collate: its batches are gathered whole.
        whole = collate_fn is collate and type(items) is Items and type(items.dataset) is TensorDataset
        self._tensors: tuple[torch.Tensor, ...] | None = items.dataset.tensors if whole else None

    def __len__(self) -> int:
        return len(self.items)

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        if self._tensors is not None:
            # One index per tensor: the same tensors as stacking the items one by one, without a
            # Python call and a copy per item (on a GPU whose steps take milliseconds, that
            # showed). No user code runs: nothing draws a random number.
            at = torch.tensor([index for _, index in keys])
            return [tuple(t[at] for t in self._tensors)]
        # The generators' states as they are (no conversion: this runs once per batch, in the
        # training process itself where num_workers is 0).
        state = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            seed = keys[0][0]
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.default_generator.manual_seed(seed)  # the CPU generator only: a CUDA one is the model's
            batch = self.collate_fn([self.items[index] for _, index in keys])
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])
            torch.set_rng_state(state[2])
        if batch is None:
            raise ValueError(f"collate_fn {self.collate_fn!r} returned None: it must return the batch it makes of "
                             "the items it is given")
        return [batch]


def _only(batches: list[Any]) -> Any:
    return batches[0]


def _source_unshuffled(source: Any) -> bool:
    """A batch source that says it does not shuffle (``ShardDataset(shuffle=False)``): each epoch
    reads it in the same order, so the records after its last full batch are never trained on."""
    return getattr(getattr(source, "options", None), "shuffle", True) is False


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
            decode = getattr(dataset, "decode_workers", None)  # a BatchSource of one's own may decode in this process
            self.num_workers, self.workers_reason = decode(self.steps_per_epoch) if decode else (None, "")
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
        self.num_workers, self.workers_reason = decode_workers(
            cfg.num_workers, dataset, self.steps_per_epoch, self._layout["loader_batch"], collate_fn
        )
        # Built once, so DataLoader workers persist across epochs.
        self._loader = data_loader(cfg, runtime, dataset, self.sampler, collate_fn, num_workers=self.num_workers,
                                   process_index=st.process_index)

    @property
    def worker_room(self) -> tuple[int, int] | None:
        """The decode workers feeding this fit and the most this host's CPUs give beside the
        training process (its share of them less one, ``num_workers="auto"``'s rule without its
        cap); ``None`` where the batches come from a source that says nothing of its workers."""
        cpus, local = cpu_share()
        return None if self.num_workers is None else (self.num_workers, max(cpus // local - 1, 0))

    def length_note(self) -> str | None:
        """A user's sampler whose length is not what it gives: the steps come from what it gives;
        samples the Trainer's own sampler leaves out of each epoch to keep every batch full."""
        sampler = self.sampler
        accum = self._step_multiple
        why = "so that every step has the same shape" + (
            f" and every optimizer step its {accum} micro-batches" if accum > 1 else "")
        if isinstance(sampler, TrainSampler) or isinstance(self.dataset, BatchSource):
            global_batch = self._layout["loader_batch"] * self._layout["num_processes"]
            num_samples = sampler.num_samples if sampler is not None else len(self.dataset)
            used = self.steps_per_epoch * global_batch
            left = num_samples - used
            if left <= 0:
                return None
            if sampler is not None and sampler.shuffle:
                fate = "its shuffled order, different ones each epoch, wait for another epoch"
            elif sampler is None and not _source_unshuffled(self.dataset):
                fate = (f"{type(self.dataset).__name__}'s order for the epoch (its own to shuffle) wait for "
                        "another epoch")
            else:  # the same order every epoch
                fate = "the order are never trained on"
            return (f"note: each epoch trains {self.steps_per_epoch} full batches of {global_batch}, {used} of the "
                    f"{num_samples} samples, {why}: the {left} at the end of {fate}")
        if not isinstance(sampler, UserSampler):
            return None
        says, gives = sampler.announced(), sampler.given()
        where = " on this process" if sampler.per_process else ""
        notes = [] if says is None or says == gives else [
            f"note: the sampler's len() is {says} but it gave {gives} indices in epoch 1{where}: the Trainer runs the "
            f"{self.steps_per_epoch} step(s) per epoch those make, and sizes the schedule by them"]
        per_step = self._layout["loader_batch"] * (1 if sampler.per_process else self._layout["num_processes"])
        left = gives - self.steps_per_epoch * per_step
        if left > 0:
            fewest = sampler.per_process and gives // per_step // accum * accum > self.steps_per_epoch
            notes.append(f"note: the sampler's {gives} indices in epoch 1{where} make {self.steps_per_epoch} full "
                         f"batches of {per_step}, {why}"
                         + (" and every process as many steps as the one with the fewest" if fewest else "")
                         + f": the {left} after them are not trained on in that epoch"
                         + (f" ({type(sampler.sampler).__name__} gives the same order every epoch: those {left} are "
                            "never trained on)" if _same_order(sampler.sampler) else ""))
        return "\n".join(notes) or None

    def steps_that_ran(self, epoch: int, step_done: int, extra: bool, *, user_sampler: bool) -> tuple[int, str | None]:
        """The steps this epoch ran, and a warning where they are not the announced count (the
        loss mean and the rates are over the steps that ran)."""
        announced = self.steps_per_epoch
        if step_done == announced and not extra:
            return announced, None
        source = "the sampler" if user_sampler else f"{type(self.dataset).__name__}.train_batches"
        if extra:  # a user's sampler lists its epoch first: how many it gave is known
            gave = f"{self.sampler.steps_per_epoch}" if isinstance(self.sampler, UserSampler) else f"more than {announced}"
            said = (f"epoch {epoch} ran the {announced} step(s) announced from the data's length, but {source} gave "
                    f"{gave} batches: the batches after step {announced} were not trained on. The epoch's train_loss "
                    f"is the mean over the {step_done} that ran")
        else:
            said = (f"epoch {epoch} ran {step_done} step(s), but {announced} were announced from the data's length: "
                    f"{source} gave fewer batches. The epoch's train_loss is the mean over the {step_done} that ran")
        return step_done, (f"warning: {said}; a schedule sized by run.total_steps assumed the announced count. Give "
                           "the data a length that matches what it yields")

    def close(self) -> None:
        """Stop the loader's persistent workers now, not at interpreter exit (where a worker that
        the exit handlers terminate first is reported by the loader as killed)."""
        iterator = getattr(getattr(self, "_loader", None), "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            self._loader._iterator = None

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
        return _loaded_for(self._runtime.wrap_loader(host, self._sharding), epoch, start_step + 1)


def _loaded_for(batches: Iterable[Any], epoch: int, first_step: int) -> Iterator[Any]:
    """``batches``, where one that fails to load says which epoch and step it was for (the
    dataset's own note names the sample and the ``__getitem__`` it came from)."""
    it, step = iter(batches), first_step
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"xlatrain: raised while loading the training batch of epoch {epoch} step {step}")
            raise
        yield batch
        step += 1


def follow_num_workers(num_workers: int | str, **datasets: Any) -> None:
    """Readers that decode in workers of their own (a ``ShardDataset``) take the Trainer's
    ``num_workers`` where theirs is ``"auto"``, as the DataLoader's workers do: every reader is
    checked before any takes it, and a refusal names the argument it came in."""
    readers = {name: data for name, data in datasets.items() if hasattr(data, "take_num_workers")}
    for name, data in readers.items():
        try:
            data.take_num_workers(num_workers, check=True)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    for data in readers.values():
        data.take_num_workers(num_workers)


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
        workers, _ = decode_workers(config.num_workers, dataset, sampler.steps, layout["loader_batch"], collate_fn)
        host = data_loader(config, runtime, padded, sampler, collate if collate_fn is collate else _Flagged(collate_fn),
                           num_workers=workers, phase="eval", process_index=strategy.process_index)
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


def first_batch(data: Any, rows: int = 2, collate_fn: Callable[[list[Any]], Any] = collate, *, pad: bool = False) -> Any:
    """A small batch of ``data`` for the dry run, collated as the loaders collate (training
    batches with the user's ``collate_fn``); ``pad``: a set of fewer than ``rows`` items is
    repeated up to ``rows``, as evaluation pads its last batch with copies of real items."""
    if isinstance(data, BatchSource):
        batch, _valid = next(iter(data.eval_batches(loader_batch=rows, num_processes=1, process_index=0)))
        return batch
    if len(data) == 0:
        raise ValueError("the evaluation set is empty: give at least one sample")
    items = Items(data)
    given = [items[i % len(data)] for i in range(rows if pad else min(rows, len(data)))]
    batch = collate_fn(given)
    if collate_fn is not collate and isinstance(batch, (list, tuple)) and len(batch) == len(given) > 1 \
            and all(b is g and isinstance(g, (tuple, list)) for b, g in zip(batch, given)):
        # Two (inputs, targets) items unstacked would pass for a pair and fail inside the model (a
        # list of bare tensors may be what a model takes: a detector's images).
        raise ValueError(
            f"collate_fn {collate_fn!r} returned the {len(given)} items it was given, one by one, not a batch: it must "
            "stack them, e.g. return torch.utils.data.default_collate(items) after its own changes (or leave "
            "collate_fn out)"
        )
    return batch


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


def channels_last_choice(asked: bool | str, model: torch.nn.Module, runtime: Any, precision: str) -> tuple[bool, str | None]:
    """Whether the model and its image batches go channels-last, and what the header says of it.

    ``"auto"`` turns it on where it was measured to pay: 2-D convolutions on CUDA under bf16/fp16
    autocast (tensor cores read NHWC; 1.7x for a ResNet-34 on an H100). TPU runtimes choose their
    own layouts, and on the CPU a float32 ResNet-18 step measured 2.4x slower channels-last.
    """
    convs = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    if asked != "auto":  # said where it changes something, or could
        return bool(asked), f"channels_last {'on' if asked else 'off'} (as configured)" if asked or convs else None
    if not convs:
        return False, None  # nothing it would change
    on = runtime.device.type == "cuda" and precision in ("bf16", "fp16")
    if on:
        return True, f"channels_last on (auto: 2-D convolutions under {precision} autocast on CUDA)"
    return False, (f"channels_last off (auto: on only for 2-D convolutions under bf16/fp16 autocast on CUDA; this run "
                   f"is {runtime.device.type}, precision {precision})")


def to_channels_last(t: Any) -> Any:
    """A 4-D floating tensor (images, N x C x H x W) in channels-last memory order; others as they are."""
    if isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point():
        return t.contiguous(memory_format=torch.channels_last)
    return t


def _same_order(sampler: Any) -> bool:
    """A sampler certain to give the same indices every epoch: torch's SequentialSampler, or a
    DistributedSampler without shuffling."""
    if isinstance(sampler, torch.utils.data.SequentialSampler):
        return True
    return isinstance(sampler, torch.utils.data.DistributedSampler) and not sampler.shuffle
