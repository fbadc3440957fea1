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

_ALIASES_KEY = "xlatrain.aliases"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def weights_to_host(
    module: torch.nn.Module, read: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's state on the host, one entry per distinct tensor, plus {alias: kept name}.

    Tied weights (one Parameter reachable under two names) are stored once and re-tied on load;
    ``read`` is the backend's host read, so all tensors come over in one planned sync.
    """
    state = module.state_dict(keep_vars=True)
    kept: dict[int, str] = {}
    aliases: dict[str, str] = {}
    names: list[str] = []
    for name, tensor in state.items():
        first = kept.setdefault(id(tensor), name)
        if first == name:
            names.append(name)
        else:
            aliases[name] = first
    host = read([state[n].detach() for n in names])
    return {n: t.contiguous() for n, t in zip(names, host)}, aliases


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
