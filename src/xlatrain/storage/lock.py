"""One writer per run directory: ``RUN_DIR/.xlatrain.lock``.

The lock is an OS lock (``flock``) on that file, held for as long as ``fit`` runs, and the file
says who holds it (pid, host, start time, command). The OS drops the lock when its process ends,
however it ends (a kill -9 included), so a lock file whose lock can be taken is stale for certain
when it names this host, and is taken over, saying so. One naming another host is a run on a
shared filesystem whose lock this host cannot see: whether it is still running cannot be told
here, so the message says so and how to release it. The file is emptied, never deleted, when a run
ends: deleting it could let two later runs lock two different files.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCK_FILE = ".xlatrain.lock"


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked; the message names the path and the fix."""


def _describe(holder: dict[str, Any]) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return (f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"
            + (f": {holder['command']}" if holder.get("command") else ""))


@dataclass
class RunLock:
    """A held lock; :meth:`release` (or leaving the ``with`` block) lets the next run in."""

    path: Path
    fd: int
    took_over: dict[str, Any] | None  # the stale holder whose lock was taken, if any

    def release(self) -> None:
        if self.fd < 0:
            return
        import fcntl

        try:
            os.ftruncate(self.fd, 0)  # empty: nobody holds it
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 65536).decode("utf-8", "replace").strip()
    if not text:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {"command": f"(unreadable lock file: {text[:80]!r})"}
    return holder if isinstance(holder, dict) else {}


def acquire(run_dir: str | os.PathLike[str]) -> RunLock:
    """Lock ``run_dir`` (created if missing) for this process, or raise :class:`RunDirError`."""
    import fcntl

    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunDirError(
            f"cannot write to the run directory {run_dir}: {exc.strerror or exc} ({exc.filename or path}). "
            "Give run_dir a directory this process can write (trainer.run_dir / TrainConfig(run_dir=...))."
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise RunDirError(
            f"{run_dir} is in use by another run ({_describe(holder)}); two runs writing one directory would "
            "overwrite each other's checkpoints and best weights. Wait for it to finish, stop it, or give this "
            "run another directory: --fresh (a new sibling directory) or --set trainer.run_dir=... on the "
            "command line; resume=False or TrainConfig(run_dir=...) in Python."
        ) from None
    holder = _read(fd)
    if holder and holder.get("host") not in (None, socket.gethostname()):
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        raise RunDirError(
            f"{run_dir} is locked by {_describe(holder)}, another host sharing this directory; whether that run "
            f"is still going cannot be told from here. If it has ended, delete {path} and start again; "
            "otherwise give this run another directory (--fresh, or trainer.run_dir)."
        )
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "command": " ".join(sys.argv)[:500]}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(mine) + "\n").encode())
    os.fsync(fd)
    return RunLock(path=path, fd=fd, took_over=holder or None)


def stale_note(lock: RunLock) -> str | None:
    """What to say when a stale lock was taken over (its holder ended without releasing it)."""
    if lock.took_over is None:
        return None
    return (f"{lock.path.parent} was locked by {_describe(lock.took_over)}, which is no longer running "
            "(killed, or its machine restarted); this run takes it over")
