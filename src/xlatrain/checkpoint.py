"""Files that must never be seen half-written: weights (safetensors) and JSON/CSV/text.

Everything is written to a temporary file in the destination directory, fsynced, then renamed
over the destination, so a reader sees the old file or the new one, never a torn one. Nothing is
ever unpickled on load.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from xlatrain.logs import get_logger
from xlatrain.storage import write_synced

log = get_logger(__name__)

_ALIASES_KEY = "xlatrain.aliases"


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's or a directory's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; on any failure the old file is untouched and no temp remains."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the file the mode a plain open() would (0666 minus umask).
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_path(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def distinct_weights(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's state, one entry per distinct tensor, plus {alias: kept name}.

    Tied weights (one Parameter reachable under two names) are stored once and re-tied on load.
    """
    kept: dict[int, str] = {}
    distinct: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        first = kept.setdefault(id(tensor), name)
        if first == name:
            distinct[name] = tensor.detach()
        else:
            aliases[name] = first
    return distinct, aliases


def weights_to_host(
    module: torch.nn.Module, read: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """:func:`distinct_weights` on the host; ``read`` is the backend's read (one planned sync)."""
    distinct, aliases = distinct_weights(module)
    host = read(list(distinct.values()))
    return {n: t.contiguous() for n, t in zip(distinct, host)}, aliases


def save_weights(
    module: torch.nn.Module,
    path: str | os.PathLike[str],
    read: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] = lambda ts: [t.cpu() for t in ts],
) -> Path:
    """Save ``module``'s weights to a safetensors file, atomically, keeping weight ties."""
    tensors, aliases = weights_to_host(module, read)
    return write_weights(path, tensors, aliases)


def write_weights(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> Path:
    """Host tensors (one per distinct weight) and ``{alias: kept name}`` as a weights file that
    ``xlatrain.load_weights`` reads, atomically."""
    data = st_save(tensors, metadata={_ALIASES_KEY: json.dumps(aliases)})
    return atomic_write_bytes(path, data)


def read_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The weights a file :func:`save_weights` wrote holds, by name, tied names included (each
    alias the same tensor as the name it is tied to): what ``xlatrain.load_weights`` loads."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {path}")
    raw = path.read_bytes()
    try:
        tensors = st_load(raw)
        with_meta = json.loads(_read_metadata(raw).get(_ALIASES_KEY, "{}"))
    except Exception as exc:  # safetensors raises its own error types for damaged headers
        raise ValueError(f"{path} is not a readable safetensors file ({exc}); it may be truncated") from exc
    for alias, kept in with_meta.items():
        tensors[alias] = tensors[kept]
    return tensors


def _read_metadata(raw: bytes) -> dict[str, str]:
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    return header.get("__metadata__", {}) or {}


# --- resumable checkpoints ------------------------------------------------------------------
#
# RUN_DIR/checkpoints/
#   step-00000123/          one directory per checkpoint, renamed into place when complete
#     state.safetensors     a whole state: every tensor (model, optimizer), written by one process
#     shards/               or a sharded state (FSDP): each process's part, through
#       __0.safetensors     torch.distributed.checkpoint (see xlatrain.storage.dcp), with
#       index.json          index.json naming every chunk and each file's sha256
#     meta.json             everything else, written last, with the sha256 of state.safetensors
#                           or of shards/index.json
#   .tmp-*                  a save in progress (or one killed mid-way; removed at the next start)
#
# The complete directories are the only record of what exists: a directory appears by one atomic
# rename, so the newest one that verifies is the latest checkpoint, and no pointer file can
# disagree with them after a crash. A sharded save is written by every process into one temporary
# directory; the main process writes meta.json and renames it only after all parts are complete.

STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
SHARDS_DIR = "shards"
SHARDS_INDEX = f"{SHARDS_DIR}/index.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or does not verify; the message names the path."""


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _step_of(name: str) -> tuple[int, int]:
    """Sort key of ``step-00000123`` / ``step-00000123.2`` (a second save at the same step)."""
    body = name[len("step-") :]
    step, _, again = body.partition(".")
    return int(step), int(again or 0)


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.startswith("step-"):
            try:
                found.append((_step_of(entry.name), entry))
            except ValueError:
                continue
    return [p for _, p in sorted(found)]


def _next_name(root: Path, step: int) -> str:
    name = f"step-{step:08d}"
    again = 1
    while (root / name).exists():
        name = f"step-{step:08d}.{again}"
        again += 1
    return name


def _save_failed(root: Path, name: str, exc: OSError, where: Path, size: int | None = None) -> CheckpointError:
    import shutil

    latest = latest_name(root)
    try:
        free = shutil.disk_usage(root if root.exists() else root.parent).free
        room = f" The disk holding it has {free / 1e6:,.1f} MB free" + (
            f"; this checkpoint takes {size / 1e6:,.1f} MB." if size else ".")
    except OSError:
        room = ""
    return CheckpointError(
        f"could not save checkpoint {root / name}: {exc.strerror or exc} "
        f"({exc.filename or where}); temporary files removed; the latest checkpoint is still "
        f"{latest or 'none'}.{room} Free disk space or fix permissions on {root}, then run the same command "
        "again to continue from the latest checkpoint."
    )


def _commit(tmp: Path, root: Path, name: str, meta: dict) -> None:
    """Write meta.json last, then make the directory visible under its final name in one rename."""
    write_synced(tmp / META_FILE, (json.dumps(meta, indent=1) + "\n").encode())
    fsync_path(tmp)
    os.rename(tmp, root / name)
    fsync_path(root)


def write_checkpoint(root: str | os.PathLike[str], step: int, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write one checkpoint directory atomically (it appears complete, or not at all).

    On any failure (disk full, permission denied, a kill) the temporary directory is removed
    where possible, the previous checkpoint stays the latest, and the error says which path
    failed and why.
    """
    import shutil

    root = Path(root)
    name = _next_name(root, step)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    blob = b""
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        blob = st_save(tensors)
        write_synced(tmp / STATE_FILE, blob)
        _commit(tmp, root, name, dict(meta, name=name, files={STATE_FILE: _sha256(blob)}))
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _save_failed(root, name, exc, tmp, size=len(blob) or None) from exc
    return root / name


class ProcessGroup(Protocol):
    """What a sharded save or a collective resume needs of the job's processes (a Strategy)."""

    process_index: int
    num_processes: int

    @property
    def is_main(self) -> bool: ...

    def barrier(self) -> None: ...

    def gather_objects(self, obj: Any) -> list[Any]: ...

    def any_process(self, flag: bool) -> bool: ...


def write_sharded_checkpoint(
    root: str | os.PathLike[str], step: int, meta: dict, save_state: Callable[[Path], dict], group: ProcessGroup,
    upload_part: Callable[[Path, str], None] | None = None,
) -> Path:
    """Every process writes its part of one checkpoint; it appears complete, or not at all.

    ``save_state(directory)`` is the strategy's collective save; it returns the state's JSON part
    (optimizer hyper-parameters), kept in meta.json. The main process names the checkpoint and
    makes the temporary directory; all write into it; the main process then writes meta.json with
    the sha256 of the shards' index and renames the directory into place. A failure on any
    process fails the save on every process, with the previous checkpoint still the latest.

    ``upload_part(file, name)`` (a run directory on object storage): each process sends the part
    it wrote itself, as ``name`` (``step-.../shards/__<process>.safetensors``), before the main
    process commits, so the parts of processes on other hosts, whose local disks the main process
    cannot read, reach the store, and the checkpoint's meta.json can go up after all of them. A
    process whose temporary directory lacks the index (the main process wrote it on another host's
    disk) removes its own part once it is up, and the directory once every process is past that
    point (the processes of one host share it).
    """
    import shutil

    root = Path(root)
    plan: tuple[str, str, str | None] | None = None
    if group.is_main:
        name = _next_name(root, step)
        tmp = root / f".tmp-{name}-{os.getpid()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            plan = (name, tmp.name, None)
        except OSError as exc:
            plan = (name, tmp.name, str(_save_failed(root, name, exc, tmp)))
    # Names, not paths: each process writes under its own ``root`` (the same directory on one
    # host or a shared filesystem; each host's own working copy of a run on object storage).
    name, tmp_name, error = group.gather_objects(plan)[0]
    tmp = root / tmp_name
    if error is not None:
        raise CheckpointError(error)
    failure: str | None = None
    try:
        extra = save_state(tmp / SHARDS_DIR)
    except Exception as exc:  # DCP reports every process's failure on every process
        failure = f"could not save checkpoint {root / name}: {exc}"

    def failed() -> CheckpointError:
        if group.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        latest = latest_name(root)
        return CheckpointError(
            (failure or f"could not save checkpoint {root / name}: another process failed")
            + ("" if "the latest checkpoint is still" in (failure or "") else
               f"; the latest checkpoint is still {latest or 'none'}")
        )

    if upload_part is not None:
        from xlatrain.storage.dcp import shard_file

        part = f"{SHARDS_DIR}/{shard_file(group.process_index)}"
        if failure is None:
            try:
                if not (tmp / part).is_file():
                    raise FileNotFoundError(f"this process's part {tmp / part} is not where it was written")
                upload_part(tmp / part, f"{name}/{part}")
            except OSError as exc:  # a StorageError names the URL and the fix
                failure = f"could not save checkpoint {root / name}: {exc}"
        elsewhere = not group.is_main and not (tmp / SHARDS_INDEX).exists()  # another host's disk
        if elsewhere:
            (tmp / part).unlink(missing_ok=True)  # up (or failed): not needed on this host either way
        failed_anywhere = group.any_process(failure is not None)
        if elsewhere:  # every process of this host has removed its part: the directories are empty
            for empty in (tmp / SHARDS_DIR, tmp):
                with contextlib.suppress(OSError):
                    empty.rmdir()
        if failed_anywhere:
            raise failed()
    if failure is None and group.is_main:
        try:
            index = (tmp / SHARDS_INDEX).read_bytes()
            _commit(tmp, root, name, dict(meta, name=name, sharded=extra, files={SHARDS_INDEX: _sha256(index)}))
        except OSError as exc:
            failure = str(_save_failed(root, name, exc, tmp))
    if group.any_process(failure is not None):
        raise failed()
    return root / name


def latest_name(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint's directory name under ``root`` (``None``: there is none)."""
    found = list_checkpoints(root)
    return found[-1].name if found else None


def read_checkpoint(path: str | os.PathLike[str], verify_shards: bool = True) -> tuple[dict[str, torch.Tensor] | None, dict]:
    """Load and verify one checkpoint; :class:`CheckpointError` names what is wrong.

    Returns ``(tensors, meta)`` for a whole state, ``(None, meta)`` for a sharded one (its parts
    are loaded by the strategy; ``verify_shards`` checks every part's sha256 here).
    """
    path = Path(path)
    try:
        meta = json.loads((path / META_FILE).read_text())
        if SHARDS_INDEX in meta.get("files", {}):
            expected, name = meta["files"][SHARDS_INDEX], SHARDS_INDEX
            blob = (path / SHARDS_INDEX).read_bytes()
        else:
            expected, name = meta.get("files", {}).get(STATE_FILE), STATE_FILE
            blob = (path / STATE_FILE).read_bytes()
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete: {Path(exc.filename).name} is missing") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} has an unreadable {META_FILE}: {exc}") from exc
    if expected != _sha256(blob):
        raise CheckpointError(f"checkpoint {path}: {name} does not match its checksum (damaged or truncated)")
    if name == STATE_FILE:
        return st_load(blob), meta
    if verify_shards:
        check_shards(path, json.loads(blob))
    return None, meta


def check_shards(path: Path, index: dict, which: slice = slice(None)) -> None:
    """Every shard file ``which`` selects (of the sorted list) matches its sha256, or CheckpointError."""
    from xlatrain.storage.dcp import verify_files

    bad = verify_files(path / SHARDS_DIR, index, sorted(index["files"])[which])
    if bad:
        raise CheckpointError(
            f"checkpoint {path}: {', '.join(f'{SHARDS_DIR}/{b}' for b in bad)} missing or not matching "
            "its checksum (damaged or truncated)"
        )


def find_resumable(
    root: str | os.PathLike[str], group: ProcessGroup | None = None, failures: list[str] | None = None,
    fetch: Callable[[str], None] | None = None,
) -> tuple[Path, dict[str, torch.Tensor] | None, dict] | None:
    """The newest checkpoint under ``root`` that verifies; damaged ones are skipped with a warning
    (and their errors appended to ``failures``).

    With ``group`` (the job's processes) every process takes the same decision: the main process
    lists the checkpoints, the shards of a sharded one are verified part by part across the
    processes, and one that fails anywhere is skipped everywhere. ``fetch(name)``, where given,
    runs on this process before it reads checkpoint ``name``: it makes the local copy hold it (a
    run directory on object storage, on a host other than the main process's), or raises
    :class:`CheckpointError`.
    """
    many = group is not None and group.num_processes > 1
    root = Path(root)
    candidates = [p.name for p in reversed(list_checkpoints(root))]
    if many:  # the main process's list, each process reading under its own root (see above)
        candidates = group.gather_objects(candidates if group.is_main else None)[0]
    for candidate in candidates:
        path = root / candidate
        found: tuple[dict[str, torch.Tensor] | None, dict] | None = None
        error: str | None = None
        try:
            if fetch is not None:
                fetch(candidate)
            found = read_checkpoint(path, verify_shards=not many)
            if many and found[0] is None:
                index = json.loads((path / SHARDS_INDEX).read_text())
                check_shards(path, index, slice(group.process_index, None, group.num_processes))
        except CheckpointError as exc:
            error = str(exc)
        if many:
            errors = [e for e in group.gather_objects(error) if e is not None]
            error = errors[0] if errors else None
        if error is not None:
            if not many or group.is_main:  # every process knows it: said once
                log.warning(f"skipping {error}; trying the previous checkpoint")
            if failures is not None:
                failures.append(error)
            continue
        assert found is not None
        return path, found[0], found[1]
    return None


def export_weights(source: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> tuple[Path, Path]:
    """Whole model weights for inference, from a run directory or one checkpoint, as a safetensors
    file that ``xlatrain.load_weights`` reads: a sharded checkpoint's parts are put together on the host.

    ``source``: a checkpoint directory, or a run directory (its newest checkpoint that verifies).
    ``out``: default ``RUN_DIR/model.safetensors``. Returns ``(checkpoint used, file written)``.
    """
    source = Path(source)
    if (source / META_FILE).is_file():
        path = source
        tensors, meta = read_checkpoint(path)
        run_dir = path.parent.parent
    else:
        if not (source / "checkpoints").is_dir():
            raise ValueError(
                f"{source} is neither a run directory (no checkpoints/ in it) nor a checkpoint (no {META_FILE}): "
                "give RUN_DIR or RUN_DIR/checkpoints/step-NNNNNNNN"
            )
        found = find_resumable(source / "checkpoints")
        if found is None:
            raise ValueError(f"{source}/checkpoints holds no checkpoint that verifies: nothing to export")
        path, tensors, meta = found
        run_dir = source
    aliases = meta.get("model_aliases", {})
    if tensors is None:
        from xlatrain.storage.dcp import consolidate

        weights = consolidate(path / SHARDS_DIR, prefix="model.")
    else:
        weights = {k[len("model."):]: t for k, t in tensors.items() if k.startswith("model.")}
    weights = {k: t.contiguous() for k, t in weights.items() if k not in aliases}
    target = Path(out) if out is not None else run_dir / "model.safetensors"
    return path, write_weights(target, weights, aliases)


def prune_checkpoints(root: str | os.PathLike[str], keep_last: int, keep: set[str]) -> None:
    """Delete all but the newest ``keep_last`` checkpoints and those named in ``keep``; clear stale temps."""
    import shutil

    root = Path(root)
    complete = list_checkpoints(root)
    for path in complete[: max(0, len(complete) - keep_last)]:
        if path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)
    for entry in root.glob(".tmp-*"):
        if not entry.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(entry, ignore_errors=True)
