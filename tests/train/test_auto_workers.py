"""``num_workers="auto"`` for a map-style dataset: worker processes where making a batch takes time,
none where the training process makes one faster than it could take one from a worker (and every
worker's start is saved). The batches are the same either way (see test_resume_with_workers)."""

from __future__ import annotations

import functools
import random
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import xlatrain
from xlatrain.data.workers import auto_workers
from xlatrain.train.batch import collate
from xlatrain.train import feed
from xlatrain.train.feed import decode_workers, in_process_batch_s


class Noisy(Dataset):
    """Items that draw from torch's, NumPy's and Python's generators, optionally slowly."""

    def __init__(self, n: int = 64, sleep_s: float = 0.0, fail_at: int | None = None) -> None:
        self.n, self.sleep_s, self.fail_at = n, sleep_s, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise OSError(f"item {i} is unreadable")
        if self.sleep_s:
            time.sleep(self.sleep_s)
        x = torch.randn(4) * float(np.random.uniform(0.9, 1.1)) + random.random()
        return x, torch.tensor(i % 2)


@pytest.fixture
def unhurried(monkeypatch):
    """A limit no preempted process misses (the machine may be busy): what is decided, not how fast."""
    monkeypatch.setattr(feed, "IN_PROCESS_BATCH_S", 1.0)


def test_a_batch_made_faster_here_than_a_worker_could_hand_it_over_gets_no_workers(unhurried):
    workers, why = decode_workers("auto", Noisy(), batches=8, rows=8)
    assert workers == 0
    assert why.startswith("auto: a batch of 8 took ") and "ms to make here, less than taking one from a worker" in why


def test_a_batch_that_takes_time_to_make_gets_the_machines_workers():
    # 2 ms an item: a batch of 8 passes the warm-up limit (5 ms) at its third item, which is all it waits for.
    started = time.perf_counter()
    assert decode_workers("auto", Noisy(sleep_s=0.002), batches=8, rows=8) == auto_workers(8)
    assert time.perf_counter() - started < 0.5
    assert in_process_batch_s(Noisy(sleep_s=0.002), 8, collate) is None


def test_data_in_memory_with_a_collate_that_takes_time_gets_the_machines_workers():
    # A list of texts tokenised or padded by a collate_fn: the work is the collate's, which a worker
    # does as well; "a list is in memory, nothing to decode" kept it in the training process.
    items = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]

    def slow_collate(batch):
        time.sleep(0.01)
        return collate(batch)

    assert decode_workers("auto", items, batches=8, rows=8, collate_fn=slow_collate) == auto_workers(8)
    assert decode_workers("auto", torch.utils.data.TensorDataset(torch.randn(64, 4)), batches=8, rows=8,
                          collate_fn=slow_collate) == auto_workers(8)
    # Stacked by the default collate, nothing is made: no workers, and no measurement.
    assert decode_workers("auto", items, batches=8, rows=8) == (0, "auto: a list is in memory, nothing to decode")


def test_a_collate_fn_that_cannot_be_pickled_gets_no_workers_where_workers_are_not_forked(monkeypatch):
    # A lambda collate over a list in memory was given workers, which spawn and forkserver (Linux's
    # default from Python 3.14, macOS's spawn) cannot start: "Can't pickle local object".
    items = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
    slow = lambda batch: (time.sleep(0.01), collate(batch))[1]  # noqa: E731
    monkeypatch.setattr(feed.multiprocessing, "get_start_method", lambda allow_none=False: "forkserver")
    workers, why = decode_workers("auto", items, batches=8, rows=8, collate_fn=slow)
    assert workers == 0 and "cannot be pickled for a worker process (start method 'forkserver')" in why
    monkeypatch.setattr(feed.multiprocessing, "get_start_method", lambda allow_none=False: "fork")  # a forked worker inherits it
    assert decode_workers("auto", items, batches=8, rows=8, collate_fn=slow) == auto_workers(8)


def test_a_number_is_used_as_given_whatever_the_data_costs():
    assert decode_workers(3, Noisy(), batches=8, rows=8) == (3, "as configured")
    assert decode_workers(0, Noisy(sleep_s=0.002), batches=8, rows=8) == (0, "as configured")


def test_measuring_leaves_every_random_state_as_it_found_it():
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    assert in_process_batch_s(Noisy(), 8, collate, 1.0) is not None
    assert torch.equal(torch.get_rng_state(), before[0])
    assert (np.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]


def test_an_item_that_fails_is_left_to_the_dry_run_to_report(tmp_path):
    assert in_process_batch_s(Noisy(fail_at=3), 8, collate, 1.0) is None
    trainer = xlatrain.Trainer(
        nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path), tensorboard=False),
    )
    try:
        trainer.fit(Noisy(fail_at=1))
    except OSError as exc:
        assert "item 1 is unreadable" in str(exc)
        assert any("dry run" in note for note in getattr(exc, "__notes__", []))
    else:
        raise AssertionError("the failing item was not reported")


def test_the_header_says_the_batch_was_made_in_the_training_process(tmp_path, caplog, unhurried):
    trainer = xlatrain.Trainer(
        nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path), tensorboard=False),
    )
    with caplog.at_level("INFO", logger="xlatrain"):
        trainer.fit(Noisy(), Noisy(16))
    assert "input: 0 decode worker(s) (auto: a batch of 8 took " in caplog.text
    assert trainer._feed.num_workers == 0
