"""The environment's Python bytecode held in memory for a test run.

On the machine the suite is measured on (a virtual machine with a virtual disk), file pages that no
process maps and that nobody has read for about a minute are paged out of the file cache (the
kernel's DAMON ``pageout`` scheme, restricted to unmapped file pages). An import then waits on the
disk one small ``.pyc`` at a time: during a clean-clone run the disk served 2-8 MB/s at 55-95% I/O
pressure while the CPUs idled, for minutes at the start of each environment's tests and in spells
later. pytest's collection of the ``.venv`` suite took 45 s with the environment's files out of
the cache and 11.7 s with them in (the CPU time was the same, 10-11 s).

:func:`hold` reads every ``.pyc`` of this interpreter's standard library, its environment's
packages and the checkout, 32 files at a time (for ``.venv`` about 21,300 files and 490 MB, read
in 2-3 s, 3.0 s from a cold cache), and keeps each one mapped (``mmap`` with ``MAP_POPULATE``)
until the test run ends: mapped pages stay in the cache, and the processes the tests start read
them from memory. At most half of the kernel's limit on one process's mappings are made (the
rest stays free for the process's own memory).
Nothing is written or locked; the pages are the file cache's own, shared with every process.

The tests' own files (``tmp_path``: run directories, checkpoints, packed shards, about 3 GB over
a run) are the other half of the disk's load: 4.4 GB were written during one clean-clone run, and
the reads queued behind them. :func:`memory_temp_root` puts pytest's temporary directories in
``/dev/shm`` (memory) where it has room; a test's directory is removed when it passes. What the
tests check does not change on a tmpfs (``fsync``, ``rename``, ``flock``, ``mmap`` and ``kill -9``
behave alike; no test cuts the power). ``XLATRAIN_TEST_RESIDENT=0`` turns both off.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def enabled() -> bool:
    return os.environ.get("XLATRAIN_TEST_RESIDENT", "1") != "0"


def bytecode(roots: list[Path]) -> list[str]:
    """Every ``.pyc`` under ``roots`` (a root's own ``site-packages`` left out: another environment's)."""
    found = []
    for root in roots:
        for folder, subfolders, files in os.walk(root):
            if folder == str(root):
                subfolders[:] = [d for d in subfolders if d != "site-packages"]
            found += [os.path.join(folder, f) for f in files if f.endswith(".pyc")]
    return found


def _map(path: str) -> int:
    """Map ``path`` read-only, its pages read in (MAP_POPULATE); returns the bytes mapped. libc's
    mmap, not Python's: a Python ``mmap`` keeps a file descriptor open per file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # gone meanwhile, or not readable
        return 0
    try:
        size = os.fstat(fd).st_size
        if not size:
            return 0
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED | mmap.MAP_POPULATE, fd, 0)
        return 0 if address in (None, _MAP_FAILED) else size
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value


def hold(checkout: Path) -> tuple[int, int]:
    """Read and keep mapped (until this process ends) the bytecode of this interpreter, its
    environment and ``checkout``. Returns (files, bytes) held."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"]), Path(paths["purelib"]), checkout / "src", checkout / "tests"]
    try:
        most = int(Path("/proc/sys/vm/max_map_count").read_text()) // 2
    except (OSError, ValueError):
        most = 30000
    with ThreadPoolExecutor(32) as pool:
        sizes = [size for size in pool.map(_map, bytecode(roots)[:most], chunksize=64) if size]
    return len(sizes), sum(sizes)


# Room asked of /dev/shm: one run's temporary directories with every test's kept measured 3.0 GB;
# here each is removed as its test passes (pyproject's tmp_path_retention_policy).
MEMORY_TEMP_NEEDS = 8 << 30


def memory_temp_root() -> Path | None:
    """A directory in memory (``/dev/shm``, a tmpfs) for the tests' temporary directories, where
    it has ``MEMORY_TEMP_NEEDS`` free; else None (the default, the system's temporary directory)."""
    shm = Path("/dev/shm")
    try:
        stat = os.statvfs(shm)
    except OSError:
        return None
    if stat.f_bavail * stat.f_frsize < MEMORY_TEMP_NEEDS or not os.access(shm, os.W_OK):
        return None
    root = shm / f"xlatrain-tests-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    return root
