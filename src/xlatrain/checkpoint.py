"""Files that must never be seen half-written: weights (safetensors) and JSON/CSV/text.

Everything is written to a temporary file in the destination directory, fsynced, then renamed
over the destination, so a reader sees the old file or the new one, never a torn one. Nothing is
ever unpickled on load.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from xlatrain.logs import get_logger

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
    data = st_save(tensors, metadata={_ALIASES_KEY: json.dumps(aliases)})
    return atomic_write_bytes(path, data)


def load_weights(module: torch.nn.Module, path: str | os.PathLike[str], strict: bool = True) -> None:
    """Load weights saved by :func:`save_weights` into ``module`` (in place, ties preserved)."""
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
    module.load_state_dict(tensors, strict=strict)


def _read_metadata(raw: bytes) -> dict[str, str]:
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    return header.get("__metadata__", {}) or {}


# --- resumable checkpoints ------------------------------------------------------------------
#
# RUN_DIR/checkpoints/
#   step-00000123/          one directory per checkpoint, renamed into place when complete
#     state.safetensors     every tensor (model, optimizer, training sums)
#     meta.json             everything else, and the sha256 of state.safetensors
#   .tmp-*                  a save in progress (or one killed mid-way; removed at the next start)
#
# The complete directories are the only record of what exists: a directory appears by one atomic
# rename, so the newest one that verifies is the latest checkpoint, and no pointer file can
# disagree with them after a crash.

STATE_FILE = "state.safetensors"
META_FILE = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or does not verify; the message names the path."""


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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


def write_checkpoint(root: str | os.PathLike[str], step: int, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write one checkpoint directory atomically (it appears complete, or not at all).

    On any failure (disk full, permission denied, a kill) the temporary directory is removed
    where possible, the previous checkpoint stays the latest, and the error says which path
    failed and why.
    """
    import shutil

    root = Path(root)
    name = f"step-{step:08d}"
    again = 1
    while (root / name).exists():
        name = f"step-{step:08d}.{again}"
        again += 1
    tmp = root / f".tmp-{name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        blob = st_save(tensors)
        _write_synced(tmp / STATE_FILE, blob)
        meta = dict(meta, name=name, files={STATE_FILE: _sha256(blob)})
        _write_synced(tmp / META_FILE, (json.dumps(meta, indent=1) + "\n").encode())
        fsync_path(tmp)
        os.rename(tmp, root / name)
        fsync_path(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        latest = latest_name(root)
        raise CheckpointError(
            f"could not save checkpoint {root / name}: {exc.strerror or exc} "
            f"({exc.filename or tmp}); temporary files removed; the latest checkpoint is still "
            f"{latest or 'none'}. Free disk space or fix permissions on {root}."
        ) from exc
    return root / name


def latest_name(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint's directory name under ``root`` (``None``: there is none)."""
    found = list_checkpoints(root)
    return found[-1].name if found else None


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Load and verify one checkpoint; :class:`CheckpointError` names what is wrong."""
    path = Path(path)
    try:
        meta = json.loads((path / META_FILE).read_text())
        blob = (path / STATE_FILE).read_bytes()
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete: {Path(exc.filename).name} is missing") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} has an unreadable {META_FILE}: {exc}") from exc
    expected = meta.get("files", {}).get(STATE_FILE)
    if expected != _sha256(blob):
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} does not match its checksum (damaged or truncated)")
    return st_load(blob), meta


def find_resumable(root: str | os.PathLike[str]) -> tuple[Path, dict[str, torch.Tensor], dict] | None:
    """The newest checkpoint under ``root`` that verifies; damaged ones are skipped with a warning."""
    for path in reversed(list_checkpoints(root)):
        try:
            tensors, meta = read_checkpoint(path)
        except CheckpointError as exc:
            log.warning(f"skipping {exc}; trying the previous checkpoint")
            continue
        return path, tensors, meta
    return None


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
