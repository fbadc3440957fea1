"""Shared test helpers: run a script from tests/scripts in a process of its own (forked from a warm
interpreter where it can, see warm.py) and read its history.

Two environments run the suite (see the Makefile): tests marked ``xla`` need torch_xla and run in
``.venv-xla``; the rest run in ``.venv`` on current torch. Each run says at the top and bottom
which environment it is and what it ran, and an ``xla`` test is never skipped quietly: where
torch_xla is absent it is deselected and counted in the summary as belonging to the other run.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import resident
from warm import popen as warm_popen

HAS_XLA = importlib.util.find_spec("torch_xla") is not None

# What xlatrain's command line does on a host without a TPU, done before this process imports
# torch: libtpu must not search the cloud metadata server (a first backward would stall for
# minutes), and scripts started by the tests skip loading the dormant torch_tpu (4 s each). In
# .venv the environment's start-up hook (xlatrain.site_hook) has done both already; tests that
# need torch_tpu loaded and dormant start a process with TORCH_DEVICE_BACKEND_AUTOLOAD=1.
from xlatrain.backend.hardware import settle_libtpu_without_tpu, skip_idle_torch_tpu_autoload  # noqa: E402

settle_libtpu_without_tpu()
# Under pytest-xdist (make test-current runs two workers, one per core) each worker and every
# process it starts computes on one thread: two workers of two threads each on two cores spin in
# OpenMP's barriers and run several times slower (a 512x512 matmul measured 87 GFLOP/s on one
# thread, 18 on two threads sharing a core). torchrun gives each of its processes one thread too.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Caches xlatrain keeps per machine (compiled programs, the measured matmul peak) stay out of the
# user's home, in this process and in every script a test starts.
os.environ.setdefault("XLATRAIN_CACHE_DIR", str(Path(tempfile.gettempdir()) / "xlatrain-test-cache"))
# gcsfs reads this when imported: the object_store tests' local GCS server cannot answer the
# zonal-bucket probe that the default makes (a 60 s wait per bucket). See xlatrain.storage.emulator.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
_SCRIPT_ENV: dict[str, str] = {}
skip_idle_torch_tpu_autoload(_SCRIPT_ENV)
# XLA:CPU compiles the scripts' programs with LLVM at optimization level 0. What the tests check
# (which graphs XLA builds, how many compile, where the step cuts, what reaches the host) is
# XLA's and torch_xla's work before code generation, the same at any level; losses differ only in
# float32's last digits (measured: 1.0305050 vs 1.0305052), inside the tests' tolerances. LLVM's
# own optimization was most of each compile (the depth-mask recipe's warm-up on 4 devices:
# 19.2 s at XLA's default, 7.1 s at 0, measured). A test that sets XLA_FLAGS replaces it.
_SCRIPT_ENV["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
# A script that outlives its time is sent SIGABRT (see run_bounded); with faulthandler on, each
# Python process prints every thread's stack before it dies, so a hang in CI says where it was.
_SCRIPT_ENV["PYTHONFAULTHANDLER"] = "1"
# ... and leaves no core file: an XLA process's would be gigabytes, in whatever directory it ran.
resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
_deselected_xla: list[str] = []


def _environment() -> str:
    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    parts = [f"{dist} {v}" for dist in ("torch", "torchvision", "torch_xla", "torch_tpu") if (v := version(dist))]
    return f"{Path(sys.prefix).name} ({', '.join(parts)})"


_resident: tuple[int, int, float] | None = None


def pytest_configure(config: pytest.Config) -> None:
    """In the main process, before any test module is collected (and before pytest-xdist starts its
    workers): the environment's bytecode read into memory and held there, and the tests' temporary
    directories put in memory where the machine has room (see resident.py)."""
    global _resident
    if resident.enabled() and not os.environ.get("PYTEST_XDIST_WORKER"):
        started = time.perf_counter()
        _resident = (*resident.hold(Path(__file__).resolve().parents[1]), time.perf_counter() - started)
        if "PYTEST_DEBUG_TEMPROOT" not in os.environ and (root := resident.memory_temp_root()):
            os.environ["PYTEST_DEBUG_TEMPROOT"] = str(root)  # read when the first tmp_path is made


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"environment: {_environment()}"]
    if _resident:
        files, size, took = _resident
        lines.append(f"held in memory for the run: {files} bytecode files, {size / 1e6:.0f} MB (read in {took:.1f} s)")
    if os.environ.get("PYTEST_DEBUG_TEMPROOT"):
        lines.append(f"tests' temporary directories under {os.environ['PYTEST_DEBUG_TEMPROOT']}")
    return lines


# The modules that take longest (measured in make test: the docs' commands in one directory
# 150-260 s) run first: under the Makefile's --dist loadscope --no-loadscope-reorder a module runs
# on one worker, in collection order, and the other worker works through the short ones meanwhile
# instead of waiting at the end while one long module runs.
LONGEST_FIRST = ["tests/test_docs_in_order.py", "tests/test_docs.py", "tests/train/test_fsdp.py",
                 "tests/train/test_resume.py", "tests/train/test_models_as_brought.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        module = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a module, and of the others, is kept
    if HAS_XLA:
        return
    keep = [item for item in items if "xla" not in item.keywords]
    _deselected_xla.extend(item.nodeid for item in items if "xla" in item.keywords)
    if _deselected_xla:
        config.hook.pytest_deselected(items=[item for item in items if "xla" in item.keywords])
        items[:] = keep


def pytest_sessionfinish(session: pytest.Session) -> None:
    # A pytest-xdist worker hands the tests it deselected to the main process, which reports them.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["deselected_xla"] = list(_deselected_xla)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    for nodeid in getattr(node, "workeroutput", {}).get("deselected_xla", []):
        if nodeid not in _deselected_xla:  # every worker collects, and deselects, all of them
            _deselected_xla.append(nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    stats = terminalreporter.stats
    ran = sum(len(stats.get(k, [])) for k in ("passed", "failed", "error", "xfailed", "xpassed"))
    marker = terminalreporter.config.getoption("markexpr") or "all tests"
    line = f"environment {_environment()} ran {ran} test(s) selected by: {marker}"
    if _deselected_xla:
        line += (f"; {len(_deselected_xla)} test(s) marked xla need torch_xla and run in .venv-xla "
                 "(make test-xla), not here")
    terminalreporter.write_line(line, bold=True)

SCRIPTS = Path(__file__).parent / "scripts"


def script_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a script started by a test: no inherited PJRT/XLA settings, ``env`` on top."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "CPU_NUM_DEVICES", "XLA_"))}
    full_env.update(_SCRIPT_ENV)
    full_env.update(env or {})
    # The scripts' directory, then this checkout's xlatrain (whatever checkout the environment's
    # editable install points at), then a PYTHONPATH given to pytest.
    full_env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), str(SCRIPTS.parents[1] / "src"),
                                              *filter(None, [os.environ.get("PYTHONPATH")])])
    # XLA runs keep a persistent compilation cache; tests keep theirs out of the user's home.
    full_env.setdefault("XLATRAIN_CACHE_DIR", str(Path(tempfile.gettempdir()) / "xlatrain-test-cache"))
    return full_env


def _descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and the ones they started (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.extend(kids := children.get(todo.pop(), []))
        todo.extend(kids)
    return found


def alive(pid: int | str) -> bool:
    """Whether process ``pid`` still runs (an exited one waiting to be reaped, a zombie, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _dump_one_at_a_time(tree: list[int], each_s: float = 10) -> None:
    """SIGABRT to every process of ``tree`` (listed parents before their children), one at a time,
    children first: each prints its threads' stacks (faulthandler) and dies before the next is let go, since
    processes that dump at once interleave their stacks in the one pipe a character at a time
    (faulthandler writes them so). The whole tree is stopped first (SIGSTOP), so that none reacts
    to another's death (a launcher ending its other workers) before its own stacks are out."""
    _signal_all(tree, signal.SIGSTOP)
    for pid in reversed(tree):
        _signal_all([pid], signal.SIGABRT)
        _signal_all([pid], signal.SIGCONT)
        deadline = time.monotonic() + each_s
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)


def run_bounded(args: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None,
                warm: bool = False) -> subprocess.CompletedProcess:
    """Run ``args`` with its output captured. One still running after ``timeout`` seconds fails the
    test with what it printed and where it was: every process of its tree gets SIGABRT, on which a
    Python process with faulthandler on (``script_env`` sets PYTHONFAULTHANDLER) prints the stack
    of each of its threads to stderr (one process at a time, at most 10 s each, see
    ``_dump_one_at_a_time``); whatever still runs 30 s after the last one's turn is killed.
    ``warm``: a Python script may run forked from a warm interpreter (tests/warm.py)."""
    if warm:
        proc = warm_popen(args, env, cwd=cwd)
    else:
        proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [proc.pid, *_descendants(proc.pid)]
        # This thread meanwhile reads what they print: a full pipe would hold a dump up.
        threading.Thread(target=_dump_one_at_a_time, args=(tree,), daemon=True).start()
        for wait_s in (10 * len(tree) + 30, 30):
            try:
                out, err = proc.communicate(timeout=wait_s)
                break
            except subprocess.TimeoutExpired as exc:  # what was read so far, as bytes
                out, err = (b.decode(errors="replace") if b else "" for b in (exc.stdout, exc.stderr))
                _signal_all(tree, signal.SIGKILL)
        raise AssertionError(f"{' '.join(map(str, args))} did not finish in {timeout} s; its processes ({len(tree)}) were "
                             f"sent SIGABRT, and each Python one printed its threads' stacks to stderr:\n"
                             f"--- stdout (a pipe, so what was flushed) ---\n{out[-3000:]}\n--- stderr ---\n{err[-12000:]}") from None
    except BaseException:  # the test stopped (pytest-timeout, Ctrl-C): so do its processes
        _signal_all([proc.pid, *_descendants(proc.pid)], signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def run_command(args: list[str], env: dict[str, str] | None = None, timeout: int = 300,
                warm: bool = True) -> subprocess.CompletedProcess:
    """Run ``args`` in a clean environment (see :func:`script_env`); fail with its output.
    A Python script runs forked from a warm interpreter where it can (tests/warm.py); ``warm=False``
    starts a fresh one."""
    proc = run_bounded(args, script_env(env), timeout, warm=warm)
    # No exit code is excused: a process that aborts at exit after training ("terminate called
    # without an active exception", gloo's threads at interpreter shutdown) fails here. The group
    # xlatrain makes is torn down, and collected, at exit (backend/processes.py).
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_script(args: list[str], env: dict[str, str] | None = None, timeout: int = 300) -> list[dict]:
    """Run ``args`` (a script path first, or a launcher like torchrun) and return its HISTORY json.
    A Python script runs forked from a warm interpreter where it can (tests/warm.py)."""
    proc = run_command(args, env, timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("HISTORY ")]
    assert len(lines) == 1, f"expected one HISTORY line from the main process, got {len(lines)}:\n{proc.stdout}"
    return json.loads(lines[0][len("HISTORY ") :])


def job_outputs(stdout: str, names: list[str]) -> list[str]:
    """A batch script's output split per job: the lines after each ``JOB NAME`` line the script's
    main process prints before a job, up to the next. The jobs must be ``names``, in order."""
    parts: list[tuple[str, list[str]]] = []
    for line in stdout.splitlines():
        if line.startswith("JOB "):
            parts.append((line[len("JOB "):], []))
        elif parts:
            parts[-1][1].append(line)
    assert [name for name, _ in parts] == names, f"expected jobs {names}:\n{stdout[-3000:]}"
    return ["\n".join(lines) for _, lines in parts]


def image_folder(root: Path, num: int, size: int = 16) -> tuple[Path, Path]:
    """``num`` grey ``size`` px JPEGs ``root/img/{i}.jpg`` and ``root/t.csv`` listing them
    (columns path, rid = i, cls = i % 3, grp = g{i // 4}): what the pack and shard tests pack."""
    import numpy as np
    import simplejpeg

    images = root / "img"
    images.mkdir(parents=True)
    yy, xx = np.mgrid[:size, :size]
    lines = ["path,rid,cls,grp"]
    for i in range(num):
        plane = ((xx * 7 + yy * 3 + i * 5) % 256).astype(np.uint8)[:, :, None]
        (images / f"{i}.jpg").write_bytes(simplejpeg.encode_jpeg(plane, quality=95, colorspace="GRAY", colorsubsampling="Gray"))
        lines.append(f"{i}.jpg,{i},{i % 3},g{i // 4}")
    (root / "t.csv").write_text("\n".join(lines) + "\n")
    return root / "t.csv", images


def sign_images(n: int, seed: int):
    """``n`` random 1x8x8 images labelled by the sign of their mean: a task a small CNN learns in
    a few epochs (torch imported here: this module settles libtpu before torch is imported)."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    return TensorDataset(x, (x.mean(dim=(1, 2, 3)) > 0).long())


@pytest.fixture(autouse=True)
def _restore_xlatrain_logging():
    """A test that ran the CLI in this process leaves its console handler; take it away."""
    yield
    from xlatrain.logs import remove_console_handler

    remove_console_handler()


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def scripts() -> Path:
    return SCRIPTS
