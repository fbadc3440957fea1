"""At exit, xlatrain waits for gloo's worker threads to let go of their last work (backend/processes.py).

A worker that drops a collective's tensors once the interpreter is finalizing aborts the process
after training succeeded; the wait is what keeps that from happening, so it must see the threads
(torch names them) and must tell a sleeping thread from one that still runs.
"""

import ctypes
import re
import subprocess
import sys
import threading
import time

import pytest

from xlatrain.backend import processes

PR_SET_NAME = 15


def _named_thread(name, body):
    """A thread whose native name (what /proc shows) is ``name``, running ``body``."""
    def run():
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode(), 0, 0, 0)
        body()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads are read from /proc")
def test_the_wait_ends_once_the_threads_sleep_and_not_while_one_runs():
    stop = threading.Event()
    _named_thread("xl_sleeper", lambda: stop.wait(30))

    def spin():  # keeps running: takes and drops the GIL, like a worker releasing tensors
        while not stop.is_set():
            sum(range(1000))
            time.sleep(0)

    _named_thread("xl_spinner", spin)
    time.sleep(0.05)
    try:
        assert len(processes._native_thread_activity("xl_sleeper")) == 1
        start = time.monotonic()
        assert processes._wait_for_idle_threads("xl_sleeper", timeout_s=5)
        assert time.monotonic() - start < 1
        assert not processes._wait_for_idle_threads("xl_spinner", timeout_s=0.3)
        assert processes._wait_for_idle_threads("no-such-thread", timeout_s=0)
    finally:
        stop.set()


GLOO_AFTER_DDP = """
import gc, torch, torch.distributed as dist
from torch import nn
from xlatrain.backend import processes
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
del model
processes._destroy_process_group()
print("WORKERS", len(processes._native_thread_activity(processes._GLOO_WORKER)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads are read from /proc")
def test_gloo_workers_outlive_a_ddp_group_destroyed_and_are_found_by_name():
    # If torch stopped keeping them (the group freed at destroy), the wait would be unneeded;
    # if it renamed them, the wait would find nothing and the exit abort would come back.
    out = subprocess.run([sys.executable, "-c", GLOO_AFTER_DDP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    workers = re.search(r"WORKERS (\d+)", out.stdout)
    assert workers and int(workers[1]) >= 1, out.stdout + out.stderr[-3000:]


USER_GROUP = """
import atexit, torch.distributed as dist
from xlatrain.backend import processes
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
before = atexit._ncallbacks()
processes.Processes("cpu"), processes.Processes("cpu")  # two trainers in one script
print("ADDED", atexit._ncallbacks() - before, processes._waiting_at_exit)
dist.destroy_process_group()
"""


def test_a_group_the_user_made_still_gets_the_wait_once_and_is_not_destroyed_by_xlatrain():
    out = subprocess.run([sys.executable, "-c", USER_GROUP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ADDED 1 True" in out.stdout, out.stdout + out.stderr[-3000:]
