"""Loader workers beside gloo's threads: on a Python whose fork can hang (CPython gh-112275), the
Trainer's header says so where workers fork in a gloo process group, and nowhere else."""

import platform

import pytest
import torch.distributed as dist

from xlatrain.data.workers import fork_fix_release, fork_hang_note


@pytest.mark.parametrize("version, fixed", [("3.11.7", "3.11.10"), ("3.11.9", "3.11.10"), ("3.10.14", "3.10.15"),
                                            ("3.11.0rc1", "3.11.10"), ("3.11.9rc1", "3.11.10"), ("3.11.10", None), ("3.10.15", None),
                                            ("3.12.0", None), ("3.13.1", None), ("garbage", None)])
def test_the_release_that_fixed_the_fork_hang_is_named_for_a_python_before_it(version, fixed):
    assert fork_fix_release(version) == fixed


def _no_group_left() -> None:
    """A single-process FSDP fit run earlier in this test process leaves its group of one until the
    process exits (by design); these tests say whether there is a group, so they start without."""
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def gloo_group():
    _no_group_left()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_note_names_the_python_and_its_fix_where_workers_fork_beside_gloo(gloo_group):
    note = fork_hang_note(2, "3.11.7")
    assert note.startswith("Python 3.11.7 can hang a loader worker as it forks after gloo collectives")
    assert "fixed in 3.11.10" in note and "its 2 worker(s)" in note and "num_workers=0" in note
    assert fork_hang_note(0, "3.11.7") is None and fork_hang_note(None, "3.11.7") is None
    assert fork_hang_note(2, "3.11.10") is None
    assert (fork_hang_note(2) is None) == (fork_fix_release(platform.python_version()) is None)


def test_no_note_without_a_process_group():
    _no_group_left()
    assert not dist.is_initialized()
    assert fork_hang_note(2, "3.11.7") is None
