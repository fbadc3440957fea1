"""The test harness itself: a script that hangs fails its test with where each of its processes
was, and a test that stops leaves none of its script's processes running."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import pytest

from conftest import alive, run_command

CHILD = """
import threading, time
def waiting_in_a_child(depth):
    if depth:
        return waiting_in_a_child(depth - 1)
    time.sleep(600)
for _ in range(3):
    threading.Thread(target=waiting_in_a_child, args=(6,), daemon=True).start()
print(flush=True)
waiting_in_a_child(6)
"""
HANGS = f"""
import pathlib, subprocess, sys, threading, time
def waiting_in_a_thread():
    time.sleep(600)
threading.Thread(target=waiting_in_a_thread).start()
children = [subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE) for _ in range(3)]
for child in children:
    child.stdout.readline()  # it is running (a loaded machine takes seconds to start one)
print("started", flush=True)
pathlib.Path(sys.argv[1]).write_text(" ".join(str(child.pid) for child in children))
time.sleep(600)
"""
# What faulthandler prints, line by line; two processes dumping into one pipe at once would
# interleave their lines a character at a time (it writes them so), and break this.
DUMP_LINE = re.compile(r"Fatal Python error: Aborted|(Thread|Current thread) 0x[0-9a-f]+ \(most recent call first\):"
                       r'|  File ".+", line \d+ in [\w<>]+|')


def _gone(pid: str) -> bool:
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_script_that_outlives_its_time_fails_with_every_process_and_thread_stack(tmp_path):
    """Four processes, thirteen threads: each process's stacks come out whole, one after another."""
    with pytest.raises(AssertionError) as failed:
        run_command([sys.executable, "-c", HANGS, str(tmp_path / "children")], timeout=10, warm=False)
    said = str(failed.value)
    assert "did not finish in 10 s" in said and "processes (4)" in said
    assert "started" in said  # what it printed before
    dump = said.split("--- stderr ---\n", 1)[1]
    assert [line for line in dump.splitlines() if not DUMP_LINE.fullmatch(line)] == [], dump
    assert dump.count("Fatal Python error: Aborted") == 4, dump
    # faulthandler's stacks: the script's main thread and its other thread, and the four threads
    # of each process it started (7 frames of waiting_in_a_child each)
    assert dump.count(" in waiting_in_a_thread") == 1 and dump.count(" in <module>") == 1 + 3, dump
    assert dump.count(" in waiting_in_a_child") == 3 * 4 * 7, dump
    assert all(_gone(pid) for pid in (tmp_path / "children").read_text().split()), "a child of the script still runs"


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
            # write_text makes the file before it writes the pids: wait for them, not for the file.
            while not (child.exists() and child.read_text().strip()) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGUSR1)

        threading.Thread(target=stop_once_started, daemon=True).start()
        with pytest.raises(Stopped):
            run_command([sys.executable, "-c", HANGS, str(child)], timeout=120, warm=False)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert _gone(child.read_text()), "the script's child still runs"


WARM_CHILD = """
import os, sys, numpy
print(__name__, sys.argv[1:], os.getcwd(), os.environ.get("XLATRAIN_PROBE"), "torch" in sys.modules, flush=True)
print(numpy.random.randint(1 << 30), file=sys.stderr)
if sys.argv[1] == "wait":
    sys.stdin.read()  # /dev/null: returns at once
    import time; time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""


def test_a_warm_script_is_a_process_of_its_own_with_its_arguments_environment_and_exit(tmp_path):
    """tests/warm.py: the second command with one environment is forked from a server that has
    imported torch; each gets its own argv, cwd, environment, streams, signals and exit status."""
    import subprocess

    from conftest import script_env
    from warm import WarmProcess, popen

    script = tmp_path / "child.py"
    script.write_text(WARM_CHILD)
    env = script_env({"WARM_TEST_RUN": str(tmp_path)})  # an environment no other test has: a server of its own
    runs = []
    for code in ("0", "3", "5"):
        proc = popen([sys.executable, str(script), code], {**env, "XLATRAIN_PROBE": code}, cwd=tmp_path)
        out, err = proc.communicate(timeout=120)
        runs.append((type(proc), proc.returncode, out, err))
    assert [kind for kind, *_ in runs] == [subprocess.Popen, WarmProcess, WarmProcess]
    assert [code for _, code, *_ in runs] == [0, 3, 5]
    for (kind, _, out, _), code in zip(runs, ("0", "3", "5")):  # only the warm ones have torch already
        assert out == f"__main__ ['{code}'] {tmp_path} {code} {kind is WarmProcess}\n"
    assert len({err for *_, err in runs}) == 3  # numpy's global generator differs in each
    # A signal reaches the script, and its exit says so.
    proc = popen([sys.executable, str(script), "wait"], env, stderr=subprocess.STDOUT)
    assert isinstance(proc, WarmProcess) and proc.stdout.readline().startswith("__main__ ['wait']")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    # An uncaught exception: its traceback on stderr, exit status 1.
    proc = popen([sys.executable, "-c", "raise ValueError('named')"], env)
    out, err = proc.communicate(timeout=30)
    assert isinstance(proc, WarmProcess) and proc.returncode == 1 and "ValueError: named" in err
    # An environment that differs in what an import may read starts a fresh process.
    assert type(popen([sys.executable, "-c", "pass"], {**env, "OMP_NUM_THREADS": "7"})) is subprocess.Popen


WARM_WORKER = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
signal.signal(signal.SIGTERM, lambda *_: (print(f"rank {rank} got SIGTERM", flush=True), sys.exit(0)))
# One write: print() writes its text and its newline apart, and on an unbuffered stream the other
# worker's line can land between them, leaving this one's stand-in path run into the other's "rank".
sys.stdout.write(f"rank {rank} pid {os.getpid()} torch {'torch' in sys.modules} {os.environ.get('PYTHON_EXEC')}\\n")
sys.stdout.flush()
if sys.argv[1] == "exit" and rank == 1:
    sys.exit(3)
time.sleep(120)
"""


def test_torchruns_workers_run_warm_exit_as_they_did_get_its_signals_and_die_with_their_stand_ins(tmp_path):
    """tests/warm.py: torchrun starts its workers through a stand-in (PYTHON_EXEC) that has the
    warm server fork them; what torchrun sees of a worker is the stand-in."""
    import shutil
    import subprocess
    from pathlib import Path

    import psutil

    from conftest import script_env
    from warm import popen

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    script = tmp_path / "worker.py"
    script.write_text(WARM_WORKER)
    # torchrun sets OMP_NUM_THREADS=1 where it is unset: a worker environment that differs from the
    # server's in what an import reads, so set it here (as conftest does under pytest-xdist).
    env = script_env({"WARM_TEST_RUN": f"{tmp_path}-torchrun", "OMP_NUM_THREADS": "1"})

    def start(mode):
        proc = popen([torchrun, "--nproc-per-node", "2", "--standalone", str(script), mode], env,
                     stderr=subprocess.STDOUT)
        ranks, seen = {}, ""
        while len(ranks) < 2:
            line = proc.stdout.readline()
            assert line, f"torchrun ended before both workers started:\n{seen}{proc.communicate(timeout=30)[0]}"
            seen += line  # all of it: what torchrun printed is the failure's message
            # By pattern, over all lines read: the two workers write to one pipe.
            for rank, pid, preloaded, stand_in in re.findall(r"rank (\d+) pid (\d+) torch (True|False) (\S+)\n", seen):
                ranks[int(rank)] = (int(pid), preloaded == "True", stand_in)
        return proc, ranks, seen

    # Rank 1 exits 3: torchrun reports that status and stops rank 0 with SIGTERM (signalling its
    # stand-in's process group), which reaches the worker. Both were forked with torch imported.
    proc, ranks, seen = start("exit")
    out = seen + proc.communicate(timeout=120)[0]
    assert proc.returncode == 1 and "exitcode  : 3" in out and "rank      : 1" in out, out
    assert "rank 0 got SIGTERM" in out, out
    assert all(preloaded for _, preloaded, _ in ranks.values()), ranks
    # kill -9 of the stand-ins (torchrun's children): the workers end too.
    proc, ranks, _ = start("wait")
    for child in psutil.Process(proc.pid).children():
        child.kill()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid, _, _ in ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid, _, _ in ranks.values()), ranks
    proc.communicate(timeout=120)
    # A worker environment that differs in what an import reads: the stand-in runs the real interpreter.
    stand_in = ranks[0][2]
    fresh = subprocess.run([stand_in, "-u", str(script), "exit"], env={**env, "RANK": "1", "OMP_NUM_THREADS": "2"},
                           capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 3 and " torch False " in fresh.stdout, fresh


def test_the_bytecode_held_for_a_run_is_every_pyc_outside_other_environments_and_stays_mapped(tmp_path):
    """tests/resident.py: what the main pytest process reads into memory and keeps mapped."""
    from pathlib import Path

    import resident

    cached = tmp_path / "pkg" / "__pycache__"
    cached.mkdir(parents=True)
    (cached / "m.cpython-311.pyc").write_bytes(b"x" * 10000)
    (cached / "m.py").write_text("")
    (tmp_path / "site-packages").mkdir()  # under the standard library: another environment's
    (tmp_path / "site-packages" / "other.pyc").write_bytes(b"y")
    assert resident.bytecode([tmp_path]) == [str(cached / "m.cpython-311.pyc")]
    assert resident._map(str(cached / "m.cpython-311.pyc")) == 10000
    assert str(cached / "m.cpython-311.pyc") in Path("/proc/self/maps").read_text()  # still mapped
    assert resident._map(str(tmp_path / "missing.pyc")) == 0


def test_the_tests_temporary_directories_are_in_memory_where_the_machine_has_room(tmp_path):
    from pathlib import Path

    import resident

    root = resident.memory_temp_root()
    if root is None or not resident.enabled():
        pytest.skip("no /dev/shm with room for the tests' files here: they stay in the system's temporary directory")
    assert tmp_path.is_relative_to(root), (tmp_path, root)
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    fs = max((m for m in mounts if root.is_relative_to(m[1])), key=lambda m: len(m[1]))
    assert fs[2] == "tmpfs", fs
