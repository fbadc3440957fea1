"""WebDataset-style tar shards, read in place by :class:`~xlatrain.data.shards.ShardDataset`.

A directory (or object-storage prefix) of ``*.tar`` files and no ``manifest.json`` is read as
WebDataset shards: the members of a sample share a key (the file name up to its first dot) and
lie next to each other, e.g. ``000017.jpg``, ``000017.cls``, ``000017.json``. Each sample gives
one record: the JPEG member's bytes, read where they lie in the tar (a tar stores a member's
bytes whole, so a record is one byte range, as in an xlatrain shard), and as labels the integer
in ``.cls`` (column ``cls``) and every numeric top-level field of ``.json`` (columns by field name;
a ``group`` string field, if any, is the record's group for :func:`~xlatrain.data.splits.group_kfold`).

Opening indexes every tar in one sequential read of it (its member headers are spread through
it), so every process that opens the dataset reads each tar once; ``xlatrain pack`` converts tars
to xlatrain shards, which open from their index alone. A tar holds no checksums: records are not
checked against a CRC32, and a damaged JPEG shows as a decode error.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from xlatrain import storage
from xlatrain.data.index import RecordIndex, ShardError
from xlatrain.logs import get_logger

log = get_logger(__name__)

IMAGE_SUFFIXES = ("jpg", "jpeg")


class _Sample:
    __slots__ = ("key", "start", "length", "height", "width", "channels", "labels", "group")

    def __init__(self, key: str) -> None:
        self.key = key
        self.start = self.length = -1
        self.height = self.width = self.channels = 0
        self.labels: dict[str, float] = {}
        self.group: str | None = None


def list_tars(root: Path | str) -> list[tuple[str, int]]:
    """``(name, size)`` of the ``*.tar`` files directly under ``root``, sorted by name."""
    if isinstance(root, str):
        fs, path = storage.filesystem(root)
        entries = storage.retrying("listing", root, lambda: fs.ls(path, detail=True)) if storage.exists(root) else []
        found = [(e["name"].rstrip("/").rsplit("/", 1)[-1], int(e.get("size") or 0)) for e in entries
                 if e.get("type") != "directory"]
    else:
        found = [(p.name, p.stat().st_size) for p in root.iterdir() if p.is_file()] if root.is_dir() else []
    return sorted((name, size) for name, size in found if name.endswith(".tar"))


def _open(root: Path | str, name: str) -> Any:
    if isinstance(root, str):
        url = storage.join(root, name)
        fs, path = storage.filesystem(url)
        return storage.retrying("reading", url, lambda: fs.open(path, "rb", block_size=8 << 20))
    return open(root / name, "rb")


def _scan(root: Path | str, name: str, size: int, samples: list[_Sample]) -> None:
    """Append the samples of one tar to ``samples``, in stored order: where the tar breaks, those
    found before the break are there when the error is raised."""
    import simplejpeg

    by_key: dict[str, _Sample] = {}
    with _open(root, name) as f:
        try:
            tar = tarfile.open(fileobj=f, mode="r|")
            for member in tar:
                if not member.isfile():
                    continue
                base = member.name.rsplit("/", 1)[-1]
                key, _, suffix = base.partition(".")
                key = member.name[: len(member.name) - len(base)] + key
                sample = by_key.get(key)
                if sample is None:
                    sample = by_key[key] = _Sample(key)
                    samples.append(sample)
                suffix = suffix.lower()
                if suffix in IMAGE_SUFFIXES:
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    sample.start, sample.length = member.offset_data, member.size
                    try:
                        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
                    except ValueError:
                        height = width = 0  # decoding it says what is wrong
                        colorspace = "Gray"
                    sample.height, sample.width = height, width
                    sample.channels = 1 if colorspace == "Gray" else 3
                elif suffix == "cls":
                    text = tar.extractfile(member).read().decode().strip()  # type: ignore[union-attr]
                    try:
                        sample.labels["cls"] = float(int(text))
                    except ValueError:
                        raise ShardError(f"{name}: {member.name} holds {text!r}, not a class number") from None
                elif suffix == "json":
                    meta = json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
                    if isinstance(meta, dict):
                        for field, value in meta.items():
                            if isinstance(value, (int, float)) and not isinstance(value, bool):
                                sample.labels[field] = float(value)
                            elif field == "group" and isinstance(value, str):
                                sample.group = value
        except (tarfile.TarError, EOFError) as exc:
            raise ShardError(f"shard {name} is not a readable tar ({exc})") from None
    # A tar ends with two zero blocks; one cut at a member boundary reads as complete without them.
    if size < tar.offset + 2 * tarfile.BLOCKSIZE:
        raise ShardError(f"shard {name} is cut short ({size} bytes end without the tar's end-of-archive blocks)")


def open_tar_index(root: Path | str, tars: list[tuple[str, int]], options: Any) -> Any:
    """The ``RecordIndex`` of a directory of WebDataset tars (see the module docstring)."""

    per_tar: list[list[_Sample]] = []
    dropped: dict[str, tuple[int | None, str]] = {}  # tar -> (samples found before it breaks, or None: unknown)
    for name, size in tars:
        found: list[_Sample] = []
        try:
            _scan(root, name, size, found)
        except (ShardError, storage.StorageError) as exc:
            if options.on_error == "raise":
                raise
            if found:
                dropped[name] = (len(found), f"{exc}; the {len(found)} counted are those found before it breaks")
                log.warning(f"on_error='skip': leaving out the {len(found)} record(s) found in {name} before it "
                            f"breaks (any after the break are not known): {exc}")
            else:
                # Nothing tells how many records it held: one row stands for the tar, so that it is
                # counted (as one) and listed, never left out unseen.
                found = [_Sample("")]
                dropped[name] = (None, str(exc))
                log.warning(f"on_error='skip': leaving out {name}, an unknown number of records (it breaks before "
                            f"its first sample; counted as one): {exc}")
        per_tar.append(found)
    samples = [s for (name, _), found in zip(tars, per_tar) if name not in dropped for s in found]
    images = [s for s in samples if s.length >= 0]
    if not images and len(dropped) == len(tars):
        why = "; ".join(f"{name}: {reason}" for name, (_, reason) in list(dropped.items())[:3])
        raise ValueError(f"{root}: every tar was left out under on_error='skip' ({why}{'; ...' if len(dropped) > 3 else ''}): "
                         "nothing is left to read. Replace the damaged tars")
    if not images:
        raise ValueError(f"{root} holds tars with no .jpg member: WebDataset samples need an image member (.jpg)")
    names = sorted({k for s in images for k in s.labels})
    missing = [s.key for s in images if set(s.labels) != set(names)]
    if missing:
        raise ValueError(f"{root}: samples have different labels (e.g. {missing[0]} lacks some of {names}): give "
                         "every sample the same .cls / .json fields")
    total = sum(len(found) for found in per_tar)
    ix = RecordIndex(
        root=root, shard_names=[n for n, _ in tars], shard_bytes=[size for _, size in tars],
        shard=np.zeros(total, dtype=np.int64), local=np.zeros(total, dtype=np.int64),
        start=np.zeros(total, dtype=np.int64), length=np.full(total, -1, dtype=np.int64),
        crc32=np.zeros(total, dtype=np.uint32), height=np.zeros(total, dtype=np.int64),
        width=np.zeros(total, dtype=np.int64), channels=np.zeros(total, dtype=np.int64),
        labels=np.zeros((total, len(names)), dtype=np.float32), label_names=tuple(names),
        group_codes=np.full(total, -1, dtype=np.int64), group_names=[], dropped=[], crc_known=False, paths=[],
    )
    codes: dict[str, int] = {}
    row = 0
    for s_index, ((name, _), found) in enumerate(zip(tars, per_tar)):
        imageless = [s.key for s in found if s.length < 0] if name not in dropped else []
        if name in dropped:
            ix.dropped.append((name, *dropped[name]))
        elif imageless:  # left out and counted like a dropped tar's rows: listed too
            ix.dropped.append((name, len(imageless), f"{len(imageless)} sample(s) in it have no image member (.jpg), "
                                                     f"e.g. {imageless[0]}"))
        for local, sample in enumerate(found):
            ix.shard[row], ix.local[row] = s_index, local
            ix.paths.append(f"{name}/{sample.key}")
            # A dropped tar's rows keep length -1: left out, and counted in num_skipped.
            if name not in dropped:
                if sample.length >= 0:
                    ix.start[row], ix.length[row] = sample.start, sample.length
                    ix.height[row], ix.width[row], ix.channels[row] = sample.height, sample.width, sample.channels
                    ix.labels[row] = [sample.labels[n] for n in names]
                ix.group_codes[row] = codes.setdefault(sample.group or sample.key, len(codes))
            row += 1
    ix.group_names = list(codes)
    return ix
