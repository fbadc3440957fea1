"""A run directory on object storage (``TrainConfig(run_dir="gs://bucket/runs/pe")``).

The run works in a local copy of its directory (``$XLATRAIN_CACHE_DIR/remote-runs/<hash of the
URL>``, local disk of the host running the main process), where it writes as it would into a
local run directory: the same lock, history, checkpoints (committed there by rename, as always),
events. What it writes goes up to the URL as it is written:

- **Checkpoints** go up once complete locally, file by file, their ``meta.json`` last. An object
  store has no rename, but it writes each object whole: a checkpoint is complete on the store when
  its ``meta.json`` is there, and a run killed part way through an upload leaves one without it,
  which a resume does not take (and the next upload of that step writes again). Checkpoints pruned
  locally are removed from the store.
- **History, best and EMA weights, diagnostics, TensorBoard events** go up after each checkpoint
  and when the run ends (they are rewritten whole each time: small files).
- **A resume on another machine** (a preempted TPU VM's replacement) brings down what it needs
  first: the run's files and its newest complete checkpoint, where the local copy lacks them.
- **One writer**: the main process creates ``URL/.xlatrain.lock`` only if absent (a
  create-if-absent precondition, ``ifGenerationMatch=0`` on Cloud Storage), names itself in it and
  renews it every ``RENEW_EVERY_S`` from a thread; a lock not renewed for ``STALE_AFTER_S``
  (``$XLATRAIN_RUN_LOCK_STALE_S``) is a run that died (a kill -9 or a lost VM cannot remove it)
  and is taken over, saying so. It is removed when the run ends, however it ends short of a kill
  (a preemption's SIGTERM included).

Several processes, several hosts (a pod slice, torchrun over nodes): each host has its own local
copy, and the store is what they share.

- **Saving**: the main process writes the run's files and whole checkpoints, as above. A sharded
  checkpoint's parts are each sent by the process that wrote it, under its final name, before the
  main process commits; the index and meta.json then go up from the main process, meta.json last.
  A part written on another host's disk is removed there once it is up.
- **Resuming**: the main process brings down the run's files (above); every process, before it
  reads a checkpoint, makes its host's copy hold that checkpoint whole, as the store has it
  (:meth:`RemoteRun.ensure_checkpoint`: one process per host downloads what the copy lacks, under
  a lock file beside it; a copy whose meta.json is not the store's, left by an earlier run, is
  replaced; a checkpoint that never reached the store is skipped by every process). Each host
  brings down the whole checkpoint, not only the parts its processes read.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from xlatrain import storage
from xlatrain.logs import get_logger

log = get_logger(__name__)

LOCK = ".xlatrain.lock"
META = "meta.json"
RENEW_EVERY_S = 60.0  # while a run holds the lock, a thread renews it this often
STALE_AFTER_S = 300.0  # a lock not renewed for this long belongs to a run that died (a kill -9, a lost VM)


def stale_after_s() -> float:
    """``$XLATRAIN_RUN_LOCK_STALE_S`` if set, else :data:`STALE_AFTER_S`."""
    return float(os.environ.get("XLATRAIN_RUN_LOCK_STALE_S", STALE_AFTER_S))


def _has(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def local_copy(url: str) -> Path:
    from xlatrain.backend.hardware import default_cache_dir

    return default_cache_dir() / "remote-runs" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


class RemoteRun:
    """The object-storage side of a run directory whose local copy is :attr:`local`."""

    def __init__(self, url: str, local: Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.local = local or local_copy(self.url)
        self.fs, self.path = storage.filesystem(self.url)
        self._locked = False
        self._stop = threading.Event()
        self._sent: dict[str, tuple[int, int]] = {}  # file -> (size, mtime) when it last went up
        self.lost_to: str | None = None  # the run that took this one's lock over, if one did

    # -- what is there --------------------------------------------------------------------------
    def _objects(self, under: str = "") -> dict[str, int]:
        """Relative path -> size of every object under the run (or under ``under`` in it)."""
        base = f"{self.path}/{under}".rstrip("/")
        if not storage.retrying("looking up", self.url, lambda: self.fs.exists(base)):
            return {}
        found = storage.retrying("listing", self.url, lambda: self.fs.find(base, detail=True))
        return {name[len(self.path) + 1:]: int(info.get("size") or 0) for name, info in found.items()}

    def holds_a_run(self) -> bool:
        return any(not name.startswith(LOCK) for name in self._objects())

    def complete_checkpoints(self) -> list[str]:
        """Names of the checkpoints on the store whose meta.json arrived (oldest first)."""
        from xlatrain.checkpoint import _step_of

        names = {rel.split("/")[1] for rel in self._objects("checkpoints") if rel.endswith("/" + META)
                 and rel.count("/") == 2}
        return sorted(names, key=_step_of)

    # -- the lock -------------------------------------------------------------------------------
    def _lock_record(self) -> bytes:
        now = time.time()
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": self._started,
                           "renewed": now, "command": " ".join(sys.argv)}).encode()

    def acquire(self) -> str | None:
        """Take the run's lock; a note when a stale one was taken over. Raises ``RunDirError``
        naming the holder when a live run holds it."""
        from xlatrain.storage.lock import RunDirError, _describe

        lock = f"{self.path}/{LOCK}"
        self._started = time.time()
        note = None
        holder = self._holder()
        if holder is not None:
            age = time.time() - float(holder.get("renewed", 0))
            if age < stale_after_s():
                raise RunDirError(
                    f"{self.url} is in use by another run ({_describe(holder)}; its lock was renewed {age:,.0f} s "
                    f"ago). Wait for it to finish, or give trainer.run_dir another URL. If that run is gone for "
                    f"certain, remove {self.url}/{LOCK} (gcloud storage rm) and start again")
            note = (f"took over the lock of {self.url} from {_describe(holder)}: it was last renewed {age:,.0f} s ago, "
                    f"longer than {stale_after_s():,.0f} s (a run that died)")
            storage.retrying("removing", self.url, lambda: self.fs.rm_file(lock))
        try:
            # Created only if absent: of two runs starting at once, one gets it.
            storage.retrying("locking", self.url, lambda: self.fs.pipe_file(lock, self._lock_record(), mode="create"))
        except storage.StorageError as exc:
            if isinstance(exc.__cause__, FileExistsError):
                raise RunDirError(f"{self.url} was locked by another run starting at the same time: "
                                  "give trainer.run_dir another URL, or wait for it") from None
            raise
        self._locked = True
        self._stop.clear()
        threading.Thread(target=self._renew_until_released, name="xlatrain-run-lock", daemon=True).start()
        return note

    def _renew_until_released(self) -> None:
        while not self._stop.wait(RENEW_EVERY_S):
            self.still_held()

    def still_held(self) -> bool:
        """Renew the lock now; False when another run took it over (:attr:`lost_to` names it). A
        renewal that fails is said and retried at the next one: a run is not stopped for it."""
        try:
            self.renew()
        except storage.StorageError as exc:
            log.warning(f"could not renew the lock of {self.url}: {exc}")
        return self.lost_to is None

    def _holder(self) -> dict | None:
        """Who the lock on the store names now (``None``: there is none; ``{}``: an unreadable record)."""
        lock = f"{self.path}/{LOCK}"
        try:
            return json.loads(storage.retrying("reading", self.url, lambda: self.fs.cat_file(lock)))
        except storage.StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise
        except ValueError:
            return {}

    def _mine(self, holder: dict | None) -> bool:
        return holder is not None and (holder.get("pid"), holder.get("host"), holder.get("started")) == (
            os.getpid(), socket.gethostname(), self._started)

    def renew(self) -> None:
        """Rewrite the lock with the time now, if it still names this run. A lock another run took
        over (this one was stalled or cut off for longer than ``STALE_AFTER_S``) is left to it:
        :attr:`lost_to` names that run, and this one writes nothing more to the store."""
        if not self._locked:
            return
        holder = self._holder()
        if not self._mine(holder):
            # Checked, then written: a takeover in between (milliseconds, against minutes of
            # staleness) is not seen; the store offers no conditional overwrite through fsspec.
            from xlatrain.storage.lock import _describe

            if holder is None:
                self.lost_to = "nobody (the lock was removed)"
            else:
                self.lost_to = _describe(holder) if holder else "a run whose lock record cannot be read"
            self._locked = False
            self._stop.set()
            log.error(f"the lock of {self.url} was taken over by {self.lost_to}: this run writes nothing more there")
            return
        storage.write_bytes(f"{self.url}/{LOCK}", self._lock_record())

    def release(self) -> None:
        """Remove the lock, if it still names this run."""
        if self._locked:
            self._locked = False
            self._stop.set()
            if self._mine(self._holder()):
                storage.retrying("unlocking", self.url, lambda: self.fs.rm_file(f"{self.path}/{LOCK}"))

    # -- down -----------------------------------------------------------------------------------
    def pull(self, *, files_only: bool = False) -> list[str]:
        """Bring down the run's files and its newest complete checkpoint where the local copy
        lacks them; returns what came down. ``files_only``: every file but the checkpoints, afresh
        (to read a run another machine is writing, as ``xlatrain report`` does)."""
        objects = self._objects()
        complete = [] if files_only else self.complete_checkpoints()
        newest = complete[-1] if complete else None
        got = []
        for rel in sorted(objects):
            parts = rel.split("/")
            if rel.startswith(LOCK) or (parts[0] == "checkpoints" and (len(parts) < 3 or parts[1] != newest)):
                continue
            # The local copy is the one this run writes first: what it has is as new as the store's.
            here = self.local / "checkpoints" / parts[1] / META if parts[0] == "checkpoints" else self.local / rel
            if files_only or not here.is_file():
                got.append(rel)
        if got:
            self._download(got)
        return got

    def _download(self, rels: list[str]) -> None:
        """Files of the run into the local copy; a checkpoint's into a temporary directory first,
        renamed into place once whole (the local rule: a checkpoint directory is complete)."""
        import shutil

        staged: dict[str, Path] = {}
        try:
            for rel in rels:
                parts = rel.split("/")
                if parts[0] == "checkpoints":
                    tmp = staged.setdefault(parts[1], self.local / "checkpoints" / f".tmp-{parts[1]}-{os.getpid()}")
                    target = tmp / "/".join(parts[2:])
                else:
                    target = self.local / rel
                self._get(rel, target)
        except BaseException:
            for tmp in staged.values():  # no part of a checkpoint is left behind
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        for name, tmp in staged.items():
            final = self.local / "checkpoints" / name
            if final.exists():
                shutil.rmtree(final)  # an incomplete local copy of it
            os.rename(tmp, final)

    def ensure_checkpoint(self, name: str) -> None:
        """Make this host's copy hold checkpoint ``name`` whole, as the store has it (every process
        of a run of several, before it reads the checkpoint); ``CheckpointError`` when the store
        holds no complete checkpoint of that name or the copy cannot be made.

        The processes of one host share its copy: one brings down what is missing, under a lock
        file beside the copy, and the others find it there. A copy whose meta.json is the store's
        gets the files it lacks (the parts other hosts wrote, beside the main process's own); any
        other copy of that name (left by an earlier run at this URL) is replaced whole.
        """
        import fcntl

        from xlatrain.checkpoint import CheckpointError

        rel = f"checkpoints/{name}/{META}"
        try:
            committed = storage.retrying("reading", f"{self.url}/{rel}", lambda: self.fs.cat_file(f"{self.path}/{rel}"))
        except storage.StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise CheckpointError(f"checkpoint {self.url}/checkpoints/{name} is not complete on the store "
                                      "(its meta.json never went up)") from None
            raise CheckpointError(str(exc)) from exc
        try:
            self.local.parent.mkdir(parents=True, exist_ok=True)
            with open(self.local.parent / f"{self.local.name}.pull-lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                stored = self._objects(f"checkpoints/{name}")
                here = self.local / rel
                if here.is_file() and here.read_bytes() == committed:
                    for part in sorted(r for r, size in stored.items() if not _has(self.local / r, size)):
                        self._get(part, self.local / part)
                else:
                    self._download(sorted(stored))
        except OSError as exc:  # a StorageError names the URL; a local one the path
            raise CheckpointError(f"could not bring checkpoint {self.url}/checkpoints/{name} into this host's copy "
                                  f"{self.local}: {exc}") from exc

    def _get(self, rel: str, target: Path) -> None:
        """One file of the run into ``target``, whole (a temporary name, then a rename)."""
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(target.name + f".part-{os.getpid()}")
        try:
            storage.retrying("downloading", f"{self.url}/{rel}", lambda: self.fs.get_file(f"{self.path}/{rel}", str(part)))
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)

    # -- up -------------------------------------------------------------------------------------
    def push_part(self, local: Path, rel: str) -> None:
        """Upload one file of a checkpoint that is not committed yet (``rel``: under checkpoints/)."""
        storage.upload(local, f"{self.url}/checkpoints/{rel}")

    def push_checkpoint(self, path: Path, already_up: tuple[str, ...] = ()) -> None:
        """Upload a checkpoint complete locally: its files (but ``already_up``, relative to it,
        which the processes that wrote them sent), then its meta.json (the commit)."""
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.relative_to(path).as_posix() not in already_up)
        for f in sorted(files, key=lambda p: p.name == META):
            rel = f"checkpoints/{path.name}/{f.relative_to(path).as_posix()}"
            storage.upload(f, f"{self.url}/{rel}")
        self.prune()

    def prune(self) -> None:
        """Remove from the store the checkpoints no longer kept locally (and parts of uploads
        that never completed)."""
        kept = {p.name for p in (self.local / "checkpoints").iterdir() if p.is_dir() and not p.name.startswith(".")} \
            if (self.local / "checkpoints").is_dir() else set()
        remote = {rel.split("/")[1] for rel in self._objects("checkpoints") if rel.count("/") >= 2}
        for name in sorted(remote - kept):
            storage.retrying("removing", self.url, lambda n=name: self.fs.rm(f"{self.path}/checkpoints/{n}", recursive=True))

    def push_files(self) -> None:
        """Upload the run's files other than checkpoints that changed since they last went up
        (each whole: they are small)."""
        for f in sorted(p for p in self.local.rglob("*") if p.is_file()):
            rel = f.relative_to(self.local).as_posix()
            if rel.split("/")[0] == "checkpoints" or f.name.startswith(".") or ".part-" in f.name:
                continue
            info = f.stat()
            if self._sent.get(rel) == (info.st_size, info.st_mtime_ns):
                continue  # unchanged since it last went up
            storage.upload(f, f"{self.url}/{rel}")
            self._sent[rel] = (info.st_size, info.st_mtime_ns)

    def clear(self) -> None:
        """``resume="overwrite"``: remove the earlier run's objects (the lock stays)."""
        for rel in self._objects():
            if not rel.startswith(LOCK):
                storage.retrying("removing", self.url, lambda r=rel: self.fs.rm_file(f"{self.path}/{r}"))
