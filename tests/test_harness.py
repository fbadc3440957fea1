"""The test harness itself: a script that hangs fails its test with where each of its processes
was, and a test that stops leaves none of its script's processes running."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from conftest import alive, run_command

HANGS = """
import pathlib, subprocess, sys, threading, time
def waiting_in_a_thread():
    time.sleep(600)
threading.Thread(target=waiting_in_a_thread).start()
child = subprocess.Popen([sys.executable, "-c", "import time\\ndef waiting_in_a_child():\\n    print(flush=True)\\n"
                          "    time.sleep(600)\\nwaiting_in_a_child()"], stdout=subprocess.PIPE)
child.stdout.readline()  # the child is in waiting_in_a_child (a loaded machine takes seconds to start it)
print("started", child.pid, flush=True)
pathlib.Path(sys.argv[1]).write_text(f"{child.pid}")
time.sleep(600)
"""


def _gone(pid: str) -> bool:
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_script_that_outlives_its_time_fails_with_every_process_and_thread_stack(tmp_path):
    with pytest.raises(AssertionError) as failed:
        run_command([sys.executable, "-c", HANGS, str(tmp_path / "child")], timeout=10)
    said = str(failed.value)
    assert "did not finish in 10 s" in said and "processes (2)" in said
    assert "started" in said  # what it printed before
    # faulthandler's stacks: the main thread, its other thread, and the process it started
    assert "in waiting_in_a_thread" in said and "in waiting_in_a_child" in said and "in <module>" in said
    assert _gone((tmp_path / "child").read_text()), "the script's child still runs"


class Stopped(Exception):
    pass


def test_a_test_stopped_while_its_script_runs_leaves_none_of_its_processes(tmp_path):
    """pytest-timeout or Ctrl-C interrupts the wait: the script and what it started are killed."""
    def stop(signum, frame):
        raise Stopped

    child = tmp_path / "child"
    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        def stop_once_started():
            deadline = time.monotonic() + 60
            while not child.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGUSR1)

        threading.Thread(target=stop_once_started, daemon=True).start()
        with pytest.raises(Stopped):
            run_command([sys.executable, "-c", HANGS, str(child)], timeout=120)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert _gone(child.read_text()), "the script's child still runs"
