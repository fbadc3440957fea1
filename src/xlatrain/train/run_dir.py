"""The run directory's bookkeeping: which directory a fit writes, its lock, its copy on object
storage, and the refusals that keep an earlier run's results from being trained over unasked.

The main process decides and every process hears the verdict, so a refused run stops everywhere
at once and a run directory a refused fit created is gone again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
import torch

from xlatrain import storage
from xlatrain.backend.base import Strategy
from xlatrain.backend.model_state import checkpoint_bytes
from xlatrain.checkpoint import CheckpointError, latest_name, list_checkpoints
from xlatrain.storage import lock as run_lock
from xlatrain.storage.remote_run import RemoteRun

# What xlatrain writes into a run directory: what resume="overwrite" removes (nothing else is).
RUN_FILES = ("checkpoints", "history.json", "history.csv", "best.safetensors", "diagnostics.json", "tb", "profile",
             "report", "config.yaml", "model.safetensors", "loss.png", "status.json", "ema.safetensors")
STATUS_FILE = "status.json"  # how the last fit here ended, for a requeue script to read


class RunDirectory:
    """The directory one ``fit`` writes: ``config.run_dir``, a new sibling of it for
    ``resume=False``, or, for a ``run_dir`` on object storage, its local working copy."""

    def __init__(self, run_dir: str, strategy: Strategy, say: Callable[[str], None]) -> None:
        self.configured = run_dir
        self.path = Path(run_dir)
        self.remote: RemoteRun | None = None  # run_dir on object storage: path is then its local copy
        self._strategy = strategy
        self._say = say
        self._lock: run_lock.RunLock | None = None  # held by the main process while fit runs
        self._clear_pending = False  # resume="overwrite" clears the earlier run once the checks pass
        self.training = False  # this fit wrote "running": only then does it own status.json
        self.checkpoint: str | None = None  # the newest complete checkpoint this fit wrote, as status.json names it
        self._created = False  # this fit made the directory (removed again if it fails at once)

    @property
    def location(self) -> str:
        """Where the run is kept: its URL on object storage, else the local path."""
        return self.remote.url if self.remote is not None else str(self.path)

    def open(self, resume: bool | str) -> None:
        """Pick the run directory, make it and lock it for this run (the main process does; every
        process gets its verdict). ``resume=False`` never writes into an existing run: it picks
        ``run_dir-2``, ``-3``, ...; ``"overwrite"`` clears the earlier run's files once locked."""
        st = self._strategy
        base = Path(self.configured)
        self.remote = None
        self.resume = resume  # what a stop tells the user to run again
        if storage.is_url(self.configured):
            url = self.configured.rstrip("/")
            if resume is False and RemoteRun(url).holds_a_run():
                n = 2
                while RemoteRun(f"{url}-{n}").holds_a_run():
                    n += 1
                self._say(f"{url} holds an earlier run; this fresh run (resume=False, --fresh) starts in {url}-{n}")
                url = f"{url}-{n}"
            self.remote = RemoteRun(url)
            self.path = self.remote.local
        elif resume is False and holds_a_run(base):
            n = 2
            while holds_a_run(base.with_name(f"{base.name}-{n}")):
                n += 1
            self.path = base.with_name(f"{base.name}-{n}")
            self._say(f"{base} holds an earlier run; this fresh run (resume=False, --fresh) starts in {self.path}")
        else:
            self.path = base
        error, note, kind = None, None, "RunDirError"
        # Cleared once the dry run and the memory check passed: a run refused before its first
        # step leaves the earlier one as it was.
        self._clear_pending = resume == "overwrite"
        self._created = False
        if st.is_main:
            try:
                self._created = not self.path.exists()
                make_run_dir(self.path)
                self._lock = run_lock.acquire(self.path)
                _remove_temporaries(self.path)
                note = run_lock.stale_note(self._lock)
                if self.remote is not None:
                    note = self._remote_open(resume) or note
            except (run_lock.RunDirError, storage.StorageError) as exc:
                error, kind = str(exc), type(exc).__name__
                if self._lock is not None:  # refused on the store: the local copy is free again
                    self._lock.release()
                    self._lock = None
        # Every process learns the main process's verdict: a refused run stops everywhere, at once.
        error, note, kind = st.gather_objects((error, note, kind))[0] if st.num_processes > 1 else (error, note, kind)
        if error is not None:
            # The kind travels as a name: a storage outage stays one (exit 1 on the command line),
            # where a refusal of the directory, or a bucket to name again, is input (exit 2).
            raise {"StorageError": storage.StorageError, "StorageInputError": storage.StorageInputError}.get(
                kind, run_lock.RunDirError)(error)
        if note:
            self._say(note)

    def _remote_open(self, resume: bool | str) -> str | None:
        """The main process: lock the run on object storage, and bring down what a resume needs."""
        assert self.remote is not None
        note = self.remote.acquire()
        if not self.remote.holds_a_run() and holds_a_run(self.path):
            # The store is the run's record: a local copy of a run it no longer holds (removed
            # there, or made by another session) is not continued.
            removed = clear_run(self.path)
            self._say(f"{self.remote.url} holds no run: removed the stale working copy's {', '.join(removed)}")
        if resume not in (False, "overwrite"):
            pulled = self.remote.pull()
            if pulled:
                self._say(f"brought down {len(pulled)} file(s) of {self.remote.url} into its working copy {self.path}")
        return note

    def close(self, failed: bool) -> None:
        """The end of a fit however it ends: a directory a failed fit created and left empty goes;
        the run's last files go up to object storage and its locks are released."""
        try:
            if failed:
                self._remove_if_unused()
            if self.remote is not None and self._strategy.is_main:
                try:
                    if self.path.is_dir() and self.remote.lost_to is None:
                        self.remote.push_files()
                finally:
                    self.remote.release()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def write_status(self, state: str, **fields: Any) -> None:
        """``RUN_DIR/status.json`` (main process, atomic): ``running`` while a fit trains (still there
        after a kill -9 or a crash that could not write; with the epoch and step the fit started at,
        then, after each checkpoint, where a rerun continues from it), ``preempted`` once a stop
        signal's checkpoint is complete (with its name: a rerun resumes from it), ``stopped`` for a
        stop signal with checkpoints off (nothing to resume), ``finished``, or ``failed``
        (with the error, and the newest complete checkpoint this fit wrote or resumed from). A requeue script reads ``state``; the launcher's exit status alone does not
        tell (torchrun exits 1 after forwarding a SIGTERM its workers handled).

        A fit that ends before its first step (a finished run again, a refusal before training)
        leaves the file as the earlier run wrote it: ``finished`` and ``failed`` are only written
        by a fit that wrote ``running``."""
        if state == "running":
            self.training = True
            self.checkpoint = fields.get("checkpoint") or self.checkpoint
        if state == "failed" and self.checkpoint is not None:
            fields = {**fields, "checkpoint": self.checkpoint}  # a rerun resumes from it (a peer killed, say)
        if not self.training or not self._strategy.is_main or not self.path.is_dir():
            return
        from xlatrain.checkpoint import atomic_write_text

        record = {"state": state, "time": round(time.time(), 3), "pid": os.getpid(), **fields}
        atomic_write_text(self.path / STATUS_FILE, json.dumps(record, indent=1) + "\n")
        if self.remote is not None and self.remote.lost_to is None:
            storage.upload(self.path / STATUS_FILE, f"{self.remote.url}/{STATUS_FILE}")

    def publish(self, *names: str) -> None:
        """Files written into the run directory after ``fit`` go up to its object-storage URL too."""
        if self.remote is not None and self._strategy.is_main and self.remote.lost_to is None:
            for name in names:
                storage.upload(self.path / name, f"{self.remote.url}/{name}")

    def clear_earlier_run(self, why: str = "resume='overwrite'") -> None:
        """``resume="overwrite"``: remove the earlier run's files, now that this one can start."""
        if not self._clear_pending:
            return
        self._clear_pending = False
        if self._strategy.is_main:
            if self.remote is not None:
                self.remote.clear()
            removed = clear_run(self.path)
            if removed:
                self._say(f"{why}: removed the earlier run's {', '.join(removed)} from {self.path}")
        self._strategy.barrier()

    def settle_finished(self) -> None:
        """A rerun of a run whose every epoch is checkpointed: a ``running`` status.json left by a
        kill after the last checkpoint (in ``on_fit_end``, say), or a ``failed`` one naming that
        checkpoint (a failure after it), is this fit's to end as ``finished``, or a requeue on it
        would run it again for ever. Its writer is gone: this fit holds the lock."""
        if self._status().get("state") in ("running", "failed"):
            self.training = True  # the fit's end writes "finished", as after training

    def _status(self) -> dict[str, Any]:
        try:
            status = json.loads((self.path / STATUS_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return status if isinstance(status, dict) else {}

    def _remove_if_unused(self) -> None:
        """A run directory this fit created and that holds nothing but its lock goes again when the
        fit fails before writing anything (a refused run leaves no trace)."""
        if not (self._strategy.is_main and self._created and self._lock is not None):
            return
        with contextlib.suppress(OSError):
            if [p.name for p in self.path.iterdir()] == [run_lock.LOCK_FILE]:
                (self.path / run_lock.LOCK_FILE).unlink()
                self.path.rmdir()

    def check_disk_room(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        copy_key: str | None = None) -> None:
        """Refuse, before the first step, a run whose disk cannot hold two checkpoints (the newest
        and the one being written), estimated from the model's and optimizer's real tensors
        (``copy_key``: the EMA's, see :func:`checkpoint_bytes`)."""
        weights, optim = checkpoint_bytes(model, optimizer, copy_key)
        error = None
        if self._strategy.is_main:
            free = shutil.disk_usage(self.path).free
            need = 2 * (weights + optim)
            if free < need:
                error = (
                    f"the disk holding {self.path} has {mb(free)} free, and this run needs about {mb(need)} "
                    f"for two checkpoints (each about {mb(weights)} of weights and {mb(optim)} of optimizer "
                    "state; a run keeps the newest while it writes the next). Free at least "
                    f"{mb(need - free)}, or point trainer.run_dir at a larger disk"
                )
        error = self._strategy.gather_objects(error)[0] if self._strategy.num_processes > 1 else error
        if error is not None:
            raise run_lock.RunDirError(error)

    def refuse_to_retrain(self, damaged: list[str]) -> None:
        """An earlier run's results are never trained over unasked: when its checkpoints are all
        damaged, or it left results and no checkpoint, stop before anything is written."""
        ways = (
            "Nothing was changed. To go on: resume from a checkpoint you trust (--resume PATH; "
            "fit(resume=PATH)), start a new run directory (--fresh; resume=False), or start over here, "
            "deleting this run's files (--overwrite; resume='overwrite')."
        )
        if damaged:
            raise run_lock.RunDirError(
                f"{self.path} holds {len(damaged)} checkpoint(s) and none can be loaded: " + "; ".join(damaged) + ". "
                + ways
            )
        left = [name for name in ("history.json", "best.safetensors") if (self.path / name).exists()
                and not (name == "history.json" and _epochs_in(self.path / name) == 0)]
        # A run that was writing checkpoints and died before its first was complete (a kill -9
        # while the first epoch's end wrote it): its results are of epochs nothing can continue,
        # and the same command starts over, as it would have before they were written.
        # Only the epoch whose end was writing that first checkpoint can have results then (a run
        # that wrote several epochs with none checkpointed, every_steps past an epoch's end and
        # at_epoch_end=False, keeps them, refused as any other).
        status = self._status()
        died = bool(left) and status.get("state") == "running" and status.get("checkpoints") is True \
            and (_epochs_in(self.path / "history.json") or 0) <= 1
        if self._strategy.num_processes > 1:  # the main process's copy decides (another host's holds none of it)
            left, died = self._strategy.gather_objects((left, died) if self._strategy.is_main else None)[0]
        if died:
            self._clear_pending = True
            self.clear_earlier_run("the earlier run here stopped (status.json 'running': killed) before its first "
                                   "checkpoint was complete, so nothing can continue it; starting over")
            return
        if left:
            raise run_lock.RunDirError(
                f"{self.path} holds an earlier run's results ({', '.join(left)}) but no checkpoint to continue it from "
                "(checkpoints were off, or removed); training here would replace them. " + ways
            )


# The files a fit writes atomically into its run directory (through ``.NAME.XXXX.tmp``).
_FIT_FILES = ("status.json", "history.json", "history.csv", "best.safetensors", "ema.safetensors", "diagnostics.json")


def _remove_temporaries(path: Path) -> None:
    """The half-written files of a fit's write a kill cut short (an atomic write's
    ``.NAME.XXXX.tmp``): this fit holds the lock, so no fit is left to finish them."""
    for tmp in (t for name in _FIT_FILES for t in path.glob(f".{name}.*.tmp")):
        with contextlib.suppress(OSError):
            if tmp.is_file():
                tmp.unlink()


def _epochs_in(history: Path) -> int | None:
    """The epochs a run's history.json holds (0: none, a run stopped in its first with checkpoints
    off, so no results); ``None`` where it cannot be read as a list of rows."""
    try:
        rows = json.loads(history.read_text())
    except (OSError, ValueError):
        return None
    return len(rows) if isinstance(rows, list) else None


def make_run_dir(path: Path) -> None:
    """Create the run directory, with errors that name the path and the fix."""
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            what = "the run directory" if parent == path else f"{parent}, a parent of the run directory,"
            raise run_lock.RunDirError(
                f"{what} is a file, not a directory: give trainer.run_dir (TrainConfig(run_dir=...)) a directory path"
            )
        if parent.exists():
            break
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise run_lock.RunDirError(
            f"cannot create the run directory {path}: {exc.strerror or exc}. Give trainer.run_dir a path "
            "this process can write"
        ) from None
    for sub in ("checkpoints", "tb"):
        if (path / sub).exists() and not (path / sub).is_dir():
            raise run_lock.RunDirError(
                f"{path / sub} is a file, where xlatrain keeps a directory: move it away, or give this run another "
                "directory (--fresh, or trainer.run_dir)"
            )


def clear_run(path: Path) -> list[str]:
    removed = []
    for name in RUN_FILES:
        target = path / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        else:
            continue
        removed.append(name)
    return removed


def holds_a_run(path: Path) -> bool:
    return (path / "history.json").exists() or bool(list_checkpoints(path / "checkpoints"))


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """A failed write of a run's file (a full disk, lost permissions) as an error that names the
    file, the free space and how to go on; the file written before stays (writes are atomic)."""
    try:
        yield
    except OSError as exc:
        try:
            free = f"; the disk holding it has {mb(shutil.disk_usage(path.parent).free)} free"
        except OSError:
            free = ""
        latest = latest_name(path.parent / "checkpoints")
        raise CheckpointError(
            f"could not write {path}: {exc.strerror or exc}{free}. Its previous version is intact, and so is the "
            f"latest checkpoint ({latest or 'none yet'}): free disk space (or fix permissions) and run the same "
            "command again to continue from it"
        ) from exc


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"
