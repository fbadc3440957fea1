"""The test harness itself: a script that hangs fails its test with where each of its processes was."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from conftest import run_command

HANGS = """
import subprocess, sys, threading, time
def waiting_in_a_thread():
    time.sleep(600)
threading.Thread(target=waiting_in_a_thread).start()
child = subprocess.Popen([sys.executable, "-c", "import time\\ndef waiting_in_a_child():\\n    time.sleep(600)\\nwaiting_in_a_child()"])
print("started", child.pid, flush=True)
time.sleep(600)
"""


def _running(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def test_a_script_that_outlives_its_time_fails_with_every_process_and_thread_stack():
    with pytest.raises(AssertionError) as failed:
        run_command([sys.executable, "-c", HANGS], timeout=3)
    said = str(failed.value)
    assert "did not finish in 3 s" in said and "processes (2)" in said
    assert "started" in said  # what it printed before
    # faulthandler's stacks: the main thread, its other thread, and the process it started
    assert "in waiting_in_a_thread" in said and "in waiting_in_a_child" in said and "in <module>" in said
    child = said.split("started ", 1)[1].split()[0]
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child), "the script's child still runs"
