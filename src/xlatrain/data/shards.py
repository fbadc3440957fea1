"""Packed image shards: the file format, and :class:`ShardDataset`, a reader that feeds the Trainer.

A shard directory (written by :func:`xlatrain.data.pack.pack`, ``xlatrain pack``) holds
``manifest.json`` and shard files ``shard-NNNNN-<sha256 prefix>.xshard``. A shard file is::

    b"XLSHARD1" | the records' encoded JPEG bytes, back to back | tables | meta JSON | trailer

where the tables are little-endian arrays (per record: start offsets, CRC32, height, width,
channels, float32 labels), the meta JSON names them and holds each record's group key and source
path, and the 24-byte trailer is ``<u64 meta offset, u64 meta length, b"XLSHEND1">``. The manifest
lists every shard with its record count, size and SHA-256. Nothing is unpickled.

:class:`ShardDataset` implements :class:`~xlatrain.data.source.BatchSource`: it splits records over
processes itself, decodes whole batches (in worker processes when ``num_workers > 0``)
and yields uint8 ``(B, C, H, W)`` images; convert them on the device with
:func:`normalize_on_device` or :class:`NormalizeInput`.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import mmap
import multiprocessing
import os
import pickle
import queue
import select
import signal
import struct
import threading
import traceback
import weakref
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import simplejpeg
import torch

from xlatrain import storage
from xlatrain.storage.cache import ShardCache
from xlatrain.data import webdataset
from xlatrain.data.index import RecordIndex, ShardError
from xlatrain.data.decode import as_size, dct_request, decode, rotate, to_tensor
from xlatrain.data.sampling import EvalSampler
from xlatrain.data.workers import auto_workers
from xlatrain.data.source import check_layout, train_steps_per_epoch
from xlatrain.logs import get_logger

log = get_logger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "xlatrain-shards"
FORMAT_VERSION = 1
SHARD_SUFFIX = ".xshard"
SHARD_MAGIC = b"XLSHARD1"
TRAILER_MAGIC = b"XLSHEND1"
_TRAILER = struct.Struct("<QQ8s")
_ON_ERROR = ("raise", "skip")
_TARGETS = ("float", "long")


# --------------------------------------------------------------------------------------------
# File format


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """One record as :func:`encode_shard` writes it and :func:`iter_records` reads it back."""

    data: bytes
    labels: tuple[float, ...]
    group: str
    path: str
    height: int
    width: int
    channels: int


def encode_shard(records: Sequence[ShardRecord], label_names: Sequence[str]) -> bytes:
    """The bytes of one shard file holding ``records`` (deterministic: same records, same bytes)."""
    num = len(records)
    parts: list[bytes] = [SHARD_MAGIC]
    pos = len(SHARD_MAGIC)
    starts = np.empty(num + 1, dtype="<i8")
    for i, rec in enumerate(records):
        starts[i] = pos
        parts.append(rec.data)
        pos += len(rec.data)
    starts[num] = pos
    columns = {
        "starts": starts,
        "crc32": np.array([zlib.crc32(r.data) for r in records], dtype="<u4"),
        "height": np.array([r.height for r in records], dtype="<i4"),
        "width": np.array([r.width for r in records], dtype="<i4"),
        "channels": np.array([r.channels for r in records], dtype="<i4"),
        "labels": np.array([r.labels for r in records], dtype="<f4").reshape(num, len(label_names)),
    }
    tables = {}
    for name, array in columns.items():
        pad = -pos % 8  # aligned tables can be viewed in place by numpy
        parts.append(b"\0" * pad)
        pos += pad
        tables[name] = [pos, array.dtype.str, list(array.shape)]
        parts.append(array.tobytes())
        pos += array.nbytes
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num_records": num,
        "label_names": list(label_names),
        "tables": tables,
        "groups": [r.group for r in records],
        "paths": [r.path for r in records],
    }
    meta_bytes = json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()
    parts.append(meta_bytes)
    parts.append(_TRAILER.pack(pos, len(meta_bytes), TRAILER_MAGIC))
    return b"".join(parts)


@dataclass(frozen=True, kw_only=True)
class ShardIndex:
    """The parsed index of one shard file."""

    name: str
    num_records: int
    starts: np.ndarray  # int64 [N + 1]: record i is bytes [starts[i], starts[i + 1])
    crc32: np.ndarray
    height: np.ndarray
    width: np.ndarray
    channels: np.ndarray
    labels: np.ndarray  # float32 [N, L]
    label_names: tuple[str, ...]
    groups: list[str] = field(repr=False)
    paths: list[str] = field(repr=False)


def _repair_hint(root: Path | str) -> str:
    return (
        f"Run `xlatrain pack --verify {root}` to check every shard; re-run `xlatrain pack` (or restore "
        "the file) to repair it, or pass on_error='skip' to read the rest"
    )


class _RemoteTail:
    """``pread`` on an object in storage: the object's last MiB (trailer, meta and, for shards of
    up to some 20k records, the tables) comes in one ranged read, anything else in its own."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.size = storage.size(url)
        self._tail_start = max(0, self.size - (1 << 20))
        self._tail = storage.read_bytes(url, self._tail_start, self.size)

    def __call__(self, length: int, offset: int) -> bytes:
        if offset >= self._tail_start:
            return self._tail[offset - self._tail_start: offset - self._tail_start + length]
        return storage.read_bytes(self.url, offset, min(offset + length, self.size))


def _shard_path(root: Path | str, name: str) -> Path | str:
    return storage.join(root, name) if isinstance(root, str) else root / name


def read_shard_index(path: str | os.PathLike[str], *, expected_bytes: int | None = None) -> ShardIndex:
    """Parse a shard file's index (not its images); ``ShardError`` names the shard on any defect.

    ``path`` is a local file or an object-storage URL (the index is read with ranged reads)."""
    if storage.is_url(path):
        url = str(path)
        name = url.rstrip("/").rsplit("/", 1)[-1]
        try:
            tail = _RemoteTail(url)
        except storage.StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise ShardError(f"shard {name} is missing ({url})") from None
            raise ShardError(f"shard {name} is unreadable: {exc}") from None
        return _parse_shard_index(name, tail.size, tail, expected_bytes)
    path = Path(path)
    name = path.name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ShardError(f"shard {name} is missing") from None
    except OSError as exc:
        raise ShardError(f"shard {name} is unreadable ({exc.strerror})") from None
    try:
        return _parse_shard_index(name, os.fstat(fd).st_size, lambda n, off: os.pread(fd, n, off), expected_bytes)
    finally:
        os.close(fd)


def _parse_shard_index(
    name: str, size: int, pread: Any, expected_bytes: int | None
) -> ShardIndex:
    """The index of a shard of ``size`` bytes whose bytes ``pread(length, offset)`` returns."""

    def bad(problem: str) -> ShardError:
        return ShardError(f"shard {name} is {problem}")

    if expected_bytes is not None and size != expected_bytes:
        what = "truncated" if size < expected_bytes else "longer than expected"
        raise bad(f"{what}: {size} bytes on disk, the manifest says {expected_bytes}")
    if size < len(SHARD_MAGIC) + _TRAILER.size or pread(len(SHARD_MAGIC), 0) != SHARD_MAGIC:
        raise bad("not an xlatrain shard (bad header)")
    meta_start, meta_len, magic = _TRAILER.unpack(pread(_TRAILER.size, size - _TRAILER.size))
    if magic != TRAILER_MAGIC or meta_start + meta_len != size - _TRAILER.size:
        raise bad("truncated or corrupt (no valid end marker)")
    try:
        meta = json.loads(pread(meta_len, meta_start))
        num = int(meta["num_records"])
        arrays = {}
        for key, (start, dtype, shape) in meta["tables"].items():
            dt = np.dtype(dtype)
            nbytes = dt.itemsize * math.prod(shape)
            if start < len(SHARD_MAGIC) or start + nbytes > meta_start:
                raise ValueError(f"table {key} lies outside the file")
            arrays[key] = np.frombuffer(pread(nbytes, start), dtype=dt).reshape(shape)
        starts = arrays["starts"].astype(np.int64)
        index = ShardIndex(
            name=name,
            num_records=num,
            starts=starts,
            crc32=arrays["crc32"].astype(np.uint32),
            height=arrays["height"].astype(np.int64),
            width=arrays["width"].astype(np.int64),
            channels=arrays["channels"].astype(np.int64),
            labels=arrays["labels"].astype(np.float32),
            label_names=tuple(meta["label_names"]),
            groups=list(meta["groups"]),
            paths=list(meta["paths"]),
        )
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise bad(f"corrupt (unreadable index: {exc})") from None
    sizes_ok = (
        len(starts) == num + 1
        and all(len(a) == num for a in (index.crc32, index.height, index.width, index.channels, index.labels))
        and len(index.groups) == len(index.paths) == num
        and index.labels.shape[1:] == (len(index.label_names),)
    )
    if not sizes_ok or (num and (starts[0] < len(SHARD_MAGIC) or np.any(np.diff(starts) < 0))):
        raise bad("corrupt (inconsistent index)")
    return index


def read_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a shard directory (local, or an object-storage URL), checked for format and version."""
    path: Path | str
    try:
        if storage.is_url(root):
            path = storage.join(str(root), MANIFEST_NAME)
            try:
                manifest = json.loads(storage.read_bytes(path))
            except storage.StorageError as exc:
                if isinstance(exc.__cause__, FileNotFoundError):
                    raise FileNotFoundError(path) from None
                raise
        else:
            path = Path(root) / MANIFEST_NAME
            manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: pack a dataset into {root} with `xlatrain pack` first") from None
    except NotADirectoryError:
        raise ValueError(f"{root} is a file, not a directory: give the pack's directory (the --out of `xlatrain pack`, "
                         f"holding {MANIFEST_NAME}), or a directory of WebDataset .tar files") from None
    except json.JSONDecodeError as exc:
        raise ShardError(f"{path} is corrupt ({exc}): re-run `xlatrain pack` to rewrite it") from None
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} is not an xlatrain shard manifest of version {FORMAT_VERSION} "
            f"(format={manifest.get('format')!r}, version={manifest.get('version')!r}): re-pack with this xlatrain"
        )
    return manifest


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    if storage.is_url(path):
        fs, object_path = storage.filesystem(str(path))
        opened = storage.retrying("reading", str(path), lambda: fs.open(object_path, "rb", block_size=8 << 20))
    else:
        opened = open(path, "rb")
    with opened as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def iter_records(root: str | os.PathLike[str]) -> Iterator[ShardRecord]:
    """Every record of a shard directory in manifest order, with its stored bytes.

    Raises ``ShardError`` for a missing or truncated shard; bytes are returned as stored (check
    them with :func:`xlatrain.data.pack.verify`).
    """
    root = str(root) if storage.is_url(root) else Path(root)
    manifest = read_manifest(root)
    for entry in manifest["shards"]:
        path = _shard_path(root, entry["name"])
        index = read_shard_index(path, expected_bytes=entry["num_bytes"])
        with contextlib.ExitStack() as stack:
            if isinstance(path, str):  # a remote shard is read whole, once
                blob = storage.read_bytes(path)

                def record(i: int) -> bytes:
                    return blob[int(index.starts[i]): int(index.starts[i + 1])]
            else:
                f = stack.enter_context(open(path, "rb"))

                def record(i: int) -> bytes:
                    f.seek(index.starts[i])
                    return f.read(int(index.starts[i + 1] - index.starts[i]))
            for i in range(index.num_records):
                yield ShardRecord(
                    data=record(i),
                    labels=tuple(float(v) for v in index.labels[i]),
                    group=index.groups[i],
                    path=index.paths[i],
                    height=int(index.height[i]),
                    width=int(index.width[i]),
                    channels=int(index.channels[i]),
                )


# --------------------------------------------------------------------------------------------
# Reader configuration


@dataclass(frozen=True, kw_only=True)
class Augment:
    """uint8 training augmentations, drawn per record from ``(seed, epoch, record)``.

    Attributes:
        crop_scale: ``(min, max)`` fraction of the image area for a random resized crop (as
            torchvision's ``RandomResizedCrop``); ``None`` disables cropping.
        crop_ratio: ``(min, max)`` aspect ratio of the crop.
        hflip: probability of a horizontal flip.
        vflip: probability of a vertical flip.
        rotate_degrees: rotate by an angle drawn uniformly from ``[-rotate_degrees, rotate_degrees]``.
    """

    crop_scale: tuple[float, float] | None = None
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.0
    vflip: float = 0.0
    rotate_degrees: float = 0.0

    def __post_init__(self) -> None:
        if self.crop_scale is not None:
            lo, hi = self.crop_scale
            if not 0 < lo <= hi <= 1:
                raise ValueError(f"crop_scale={self.crop_scale} is not valid: use (min, max) with 0 < min <= max <= 1")
            object.__setattr__(self, "crop_scale", (float(lo), float(hi)))
        lo, hi = self.crop_ratio
        if not 0 < lo <= hi:
            raise ValueError(f"crop_ratio={self.crop_ratio} is not valid: use (min, max) with 0 < min <= max")
        object.__setattr__(self, "crop_ratio", (float(lo), float(hi)))
        for name in ("hflip", "vflip"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is not valid: it is a probability in [0, 1]")
        if not 0 <= self.rotate_degrees <= 180:
            raise ValueError(f"rotate_degrees={self.rotate_degrees!r} is not valid: use an angle in [0, 180]")


@dataclass(frozen=True, kw_only=True)
class ShardOptions:
    """How :class:`ShardDataset` reads and decodes.

    Attributes:
        image_size: output ``(height, width)`` or an int for a square; ``None`` keeps the stored
            size (every record must then have the same one).
        channels: 1 (grayscale) or 3 (RGB).
        labels: label columns to return as targets, by name (default: all packed labels).
        target: ``"float"`` (a ``[B, L]`` float32 tensor, for multi-label / BCE) or ``"long"``
            (class ids ``[B]`` from a single integer label column, for cross-entropy).
        augment: training augmentations (:class:`Augment`); evaluation never augments.
        shuffle: shuffle training records each epoch.
        shuffle_window: records are read in a seeded random shard order and shuffled within a
            sliding window of about this many records (each moves at most this far), which keeps
            reads local to a few shards; ``None`` is a full uniform shuffle.
        num_workers: worker processes that decode batches (0 decodes in this one, when the
            batches are asked for). Workers decode straight into batch buffers in shared memory
            and send back only which buffer. ``"auto"``: the Trainer's ``num_workers`` where that
            is a number (a number here that differs from it is refused), else the CPUs this
            process may use, shared by the training processes on the host, less one
            (:func:`xlatrain.data.workers.auto_workers`).
        prefetch_batches: batches each worker decodes ahead.
        pin_memory: hand out page-locked batches, so that copies to a CUDA device run
            asynchronously (pass ``True`` when training on CUDA). A thread takes the batches
            off the workers and page-locks them ahead of the consumer, so the thread that
            launches the device's work spends no time on them; without CUDA it only runs ahead.
        on_error: ``"raise"`` (a ``ShardError`` naming the shard and record) or ``"skip"`` (a bad
            record is replaced in training by another record of its batch and masked out of
            evaluation; a shard whose index is unreadable is left out; all are counted in
            :attr:`ShardDataset.num_skipped`: of a WebDataset tar that cannot be read to its end,
            the records found before it breaks, or one where it breaks before its first sample).
        verify_checksums: hash every shard at open and compare with the manifest (reads all the
            data once). Records are always checked against their CRC32: by each process the
            first time it reads them, and again after their shard file changes (its size or
            modification time).
        remote_requests: when ``root`` is on object storage (``gs://...``), the ranged reads each
            process keeps in flight at once; each process fetches only its own records, the
            next ``prefetch_batches`` batches ahead of the one it decodes.
        cache_dir: with ``root`` on object storage, keep whole shards in this local directory
            (shared safely by the processes of a host), at most ``cache_bytes`` in all, the least
            recently used removed first; later epochs then read at local-disk speed. Each process
            then fetches the whole shards its records lie in, not only its records.
        cache_bytes: the cache's size limit.
    """

    image_size: int | tuple[int, int] | None = None
    channels: int = 3
    labels: tuple[str, ...] | None = None
    target: str = "float"
    augment: Augment | None = None
    shuffle: bool = True
    shuffle_window: int | None = 16384
    num_workers: int | str = "auto"
    prefetch_batches: int = 2
    pin_memory: bool = False
    on_error: str = "raise"
    verify_checksums: bool = False
    remote_requests: int = 16
    cache_dir: str | None = None
    cache_bytes: int = 64 << 30

    def __post_init__(self) -> None:
        if self.image_size is not None:
            object.__setattr__(self, "image_size", as_size(self.image_size, "image_size"))
        if self.channels not in (1, 3):
            raise ValueError(f"channels={self.channels!r} is not valid: use 1 (grayscale) or 3 (RGB)")
        if self.labels is not None:
            labels = (self.labels,) if isinstance(self.labels, str) else tuple(self.labels)
            object.__setattr__(self, "labels", labels)
        if self.target not in _TARGETS:
            raise ValueError(f"target={self.target!r} is not valid: use 'float' (multi-label) or 'long' (class ids)")
        if self.augment is not None and not isinstance(self.augment, Augment):
            raise ValueError(f"augment={self.augment!r} is not valid: pass an Augment(...) or None")
        if self.shuffle_window is not None and (isinstance(self.shuffle_window, bool) or self.shuffle_window < 1):
            raise ValueError(f"shuffle_window={self.shuffle_window!r} is not valid: use a record count >= 1, or None")
        for name, minimum in (("num_workers", 0), ("prefetch_batches", 1), ("remote_requests", 1), ("cache_bytes", 1)):
            value = getattr(self, name)
            if name == "num_workers" and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}={value!r} is not valid: it must be an integer >= {minimum}")
        if self.on_error not in _ON_ERROR:
            raise ValueError(f"on_error={self.on_error!r} is not valid: use 'raise' or 'skip'")


# --------------------------------------------------------------------------------------------
# Per-record randomness: a counter-based hash, so a record's augmentation depends only on
# (seed, epoch, record) -- not on which worker decodes it, nor on where a resumed run starts.

_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class _Uniforms:
    def __init__(self, *keys: int) -> None:
        state = 0x243F6A8885A308D3
        for key in keys:
            state = _mix64(state ^ (key & _MASK64))
        self._state = state

    def __call__(self, lo: float = 0.0, hi: float = 1.0) -> float:
        self._state = _mix64(self._state)
        return lo + (hi - lo) * (self._state >> 11) * 2.0**-53


def _crop_box(rand: _Uniforms, height: int, width: int, aug: Augment) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box: ``(top, left, h, w)``."""
    assert aug.crop_scale is not None
    area = height * width
    log_lo, log_hi = math.log(aug.crop_ratio[0]), math.log(aug.crop_ratio[1])
    for _ in range(10):
        target = area * rand(*aug.crop_scale)
        aspect = math.exp(rand(log_lo, log_hi))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rand() * (height - h + 1)), int(rand() * (width - w + 1)), h, w
    ratio = width / height
    if ratio < aug.crop_ratio[0]:
        w, h = width, round(width / aug.crop_ratio[0])
    elif ratio > aug.crop_ratio[1]:
        h, w = height, round(height * aug.crop_ratio[1])
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


# --------------------------------------------------------------------------------------------
# Batch decoding (in worker processes when num_workers > 0)


class _Task(NamedTuple):
    positions: np.ndarray  # dataset positions of the batch's rows
    valid: np.ndarray | None  # evaluation: which rows are real (None in training)
    epoch: int
    seed: int


class _BadRecord(Exception):
    pass


class _RemoteRecords:
    """Record bytes from object storage, for one process.

    A batch's records come in one fetch: a ranged read per record (records that lie back to back
    in a shard share one read), up to ``requests`` of them in flight at once. :meth:`start` runs
    a batch's fetch in a background thread ahead of its decode, so the next batches' bytes are on
    their way while this one decodes. Only the records of this process's batches are fetched,
    nothing is kept from one batch to the next, and a fetch that fails for a reason that can pass
    is retried (``storage.retrying``), each retry logged, then raised with the URL and the fix.
    """

    def __init__(self, root: str, paths: list[str], requests: int) -> None:
        self.root, self.paths, self.requests = root, paths, requests
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "paths": self.paths, "requests": self.requests, "_pid": None}

    def _own(self) -> None:
        if self._pid != os.getpid():  # first use, or a forked worker: a thread and a client of its own
            from concurrent.futures import ThreadPoolExecutor

            self._pid = os.getpid()
            self._fs = storage.filesystem(self.root)[0]
            self._object_paths = [storage.filesystem(p)[1] for p in self.paths]
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="xlatrain-fetch")
            self._pending: dict[bytes, Any] = {}
            self._bytes: dict[tuple[int, int], memoryview] = {}

    def close(self) -> None:
        """Drop the fetches not yet begun (one under way finishes, retries included)."""
        if self._pid == os.getpid():
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pid = None  # a later use starts a pool of its own again

    def start(self, gids: np.ndarray, index: RecordIndex) -> None:
        try:
            self._own()
        except storage.StorageError:
            return  # the batch's own fetch raises it, where the error is reported
        key = gids.tobytes()
        if key not in self._pending and len(self._pending) < 64:
            self._pending[key] = self._pool.submit(self._fetch, gids.copy(), index)

    def fetch_now(self, gids: np.ndarray, index: RecordIndex) -> None:
        """Make the bytes of ``gids`` ready for :meth:`take`: from a fetch :meth:`start` began, or now."""
        self._own()
        future = self._pending.pop(gids.tobytes(), None)
        self._bytes = future.result() if future is not None else self._fetch(gids, index)

    def take(self, shard: int, start: int) -> memoryview:
        return self._bytes[shard, start]

    def _fetch(self, gids: np.ndarray, index: RecordIndex) -> dict[tuple[int, int], memoryview]:
        keep = index.length[gids] >= 0  # records of a shard left out under on_error="skip" are not read
        records = sorted({(int(s), int(a), int(n)) for s, a, n in
                          zip(index.shard[gids][keep], index.start[gids][keep], index.length[gids][keep])})
        reads: list[list[Any]] = []  # [shard, start, end, [(start, length), ...]]
        for shard, start, length in records:
            if reads and reads[-1][0] == shard and reads[-1][2] == start:
                reads[-1][2] = start + length
                reads[-1][3].append((start, length))
            else:
                reads.append([shard, start, start + length, [(start, length)]])

        def get() -> list[bytes]:
            blobs = self._fs.cat_ranges([self._object_paths[r[0]] for r in reads], [r[1] for r in reads],
                                        [r[2] for r in reads], batch_size=self.requests, on_error="return")
            for blob, read in zip(blobs, reads):
                if isinstance(blob, BaseException):
                    blob.add_note(f"xlatrain: reading {self.paths[read[0]]} bytes {read[1]}..{read[2]}")
                    raise blob
            return blobs

        blobs = storage.retrying("reading records of", self.root, get)
        out: dict[tuple[int, int], memoryview] = {}
        for (shard, first, _, parts), blob in zip(reads, blobs):
            view = memoryview(blob)
            for start, length in parts:  # a short (truncated) object gives short records: reported by _read
                out[shard, start] = view[start - first: start - first + length]
        return out


class _BatchReader:
    """Decodes one batch per call into rows it is given; picklable (open files are per process)."""

    def __init__(self, index: RecordIndex, ids: np.ndarray, targets: np.ndarray, options: ShardOptions, size: tuple[int, int]) -> None:
        self.index = index
        self.ids = ids
        self.targets = targets
        self.options = options
        self.size = size
        # Worker processes map the shard files instead of reading records with pread: that
        # saves a copy and a system call per record (a few percent of a 128 px decode). A
        # shard truncated in place while mapped would kill the process with SIGBUS, so the
        # main process, which runs the training step, keeps to pread.
        self.map_files = False
        self._paths = [str(_shard_path(index.root, name)) for name in index.shard_names]
        self._sizes = index.shard_bytes
        # Object storage: a batch's records come in one concurrent ranged fetch, started ahead
        # of its decode (see _RemoteRecords); None for local shards.
        remote = storage.is_url(index.root)
        self._cache = ShardCache(str(index.root), options.cache_dir, options.cache_bytes) \
            if remote and options.cache_dir is not None else None
        self._remote = _RemoteRecords(str(index.root), self._paths, options.remote_requests) \
            if remote and self._cache is None else None
        self._fds: dict[int, int] = {}
        self._views: dict[int, memoryview] = {}
        self._pid = os.getpid()
        # Records whose bytes this process has checked against their CRC32, and each shard
        # file's (size, modification time) when they were: a record is checked again only if
        # its file changed since. A CRC32 costs as much per byte as a few percent of a decode.
        self._checked: np.ndarray | None = None
        self._stamps: dict[int, tuple[int, int]] = {}
        # (stored height, width, grey) -> simplejpeg arguments that decode straight to the output size
        self._requests: dict[tuple[int, int, bool], dict[str, Any]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fds"], state["_views"] = {}, {}
        return state

    def prefetch(self, positions: np.ndarray) -> None:
        """Start fetching the records at dataset ``positions`` from object storage (no-op for
        local shards), so that the bytes are here when :meth:`fill` decodes them."""
        if self._remote is not None:
            gids = self.ids[positions]
            self._remote.start(gids, self.index)

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for fd in getattr(self, "_fds", {}).values():
                os.close(fd)

    def _own_files(self) -> None:
        if self._pid != os.getpid():
            # A forked worker: pread never moves a shared offset, but the parent may close its
            # descriptors at any time, so the child opens its own (and checks records itself).
            self._fds, self._views, self._pid = {}, {}, os.getpid()
            self._checked, self._stamps = None, {}

    def _unchecked(self, gids: np.ndarray, shards: Iterable[int]) -> list[bool]:
        """Which records of ``gids`` (in ``shards``) this process has yet to check against their CRC32."""
        if self._checked is None:
            self._checked = np.zeros(len(self.index.length), dtype=bool)
        if not self.index.crc_known:
            return [False] * len(gids)  # nothing to check against
        if self._remote is not None:
            return [True] * len(gids)  # bytes off the network: every record is checked, every time
        for shard in shards:
            try:
                info = os.stat(self._local(shard))
            except OSError:
                continue  # reading the record says what is wrong
            # A file replaced by rename gets a new stamp too: its records are checked again
            # (those already mapped or open are still the old file's, and still pass).
            stamp = (info.st_size, info.st_mtime_ns)
            if self._stamps.get(shard) != stamp:
                if shard in self._stamps:  # written to since its records were checked
                    self._checked[self.index.shard == shard] = False
                self._stamps[shard] = stamp
        return (~self._checked[gids]).tolist()

    def _local(self, shard: int) -> str:
        """The local file of a shard: where it is, or its copy in the cache (fetched if missing)."""
        if self._cache is None:
            return self._paths[shard]
        try:
            return self._cache.path(self.index.shard_names[shard], int(self._sizes[shard]))
        except storage.StorageError as exc:
            raise _BadRecord(f"its shard could not be fetched into the cache ({exc})") from None

    def _open(self, shard: int) -> int:
        try:
            fd = self._fds[shard] = os.open(self._local(shard), os.O_RDONLY)
        except OSError as exc:
            raise _BadRecord(f"cannot open the shard ({exc.strerror})") from None
        return fd

    def _map(self, shard: int) -> memoryview:
        try:
            fd = os.open(self._local(shard), os.O_RDONLY)
        except OSError as exc:
            raise _BadRecord(f"cannot open the shard ({exc.strerror})") from None
        try:
            # The mapping holds a descriptor of its own: one per shard, as with pread.
            size = os.fstat(fd).st_size
            view = self._views[shard] = memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b"")
        finally:
            os.close(fd)
        return view

    def _read(self, shard: int, start: int, length: int, crc: int | None) -> bytes | memoryview:
        """A record's bytes, checked against ``crc`` unless it is ``None``."""
        if length < 0:
            raise _BadRecord("its shard could not be opened")
        if self._remote is not None:
            data = self._remote.take(shard, start)
        elif self.map_files:
            view = self._views.get(shard)
            data = (view if view is not None else self._map(shard))[start : start + length]
        else:
            data = os.pread(self._fds.get(shard) or self._open(shard), length, start)
        if len(data) != length:
            raise _BadRecord(f"the shard is truncated ({len(data)} of {length} bytes readable)")
        if crc is not None and zlib.crc32(data) != crc:
            raise _BadRecord("CRC32 checksum mismatch (the stored bytes changed)")
        return data

    def decode_one(self, gid: int) -> np.ndarray:
        """``(H, W, C)`` uint8 with C = 1 for a grayscale record even when 3 channels are wanted:
        the caller broadcasts it, which is cheaper than libjpeg's grey-to-RGB conversion."""
        ix = self.index
        self._own_files()
        if self._remote is not None:
            self._remote.fetch_now(np.array([gid]), ix)
        data = self._read(int(ix.shard[gid]), int(ix.start[gid]), int(ix.length[gid]),
                          int(ix.crc32[gid]) if ix.crc_known else None)
        channels = 1 if ix.channels[gid] == 1 else self.options.channels
        return self._decode(data, (int(ix.height[gid]), int(ix.width[gid])), channels, None, None)

    def _decode(self, data: bytes | memoryview, shape: tuple[int, int], channels: int, rand: _Uniforms | None, out: np.ndarray | None) -> np.ndarray:
        """``data`` decoded (cropped and rotated when ``rand`` is given) into ``out`` if given."""
        aug = self.options.augment if rand is not None else None
        try:
            if aug is not None and aug.crop_scale is not None:
                box = _crop_box(rand, shape[0], shape[1], aug)  # type: ignore[arg-type]
                image = decode(data, size=self.size, crop=box, channels=channels, shape=shape, out=out)
            else:
                image = decode(data, size=self.size, channels=channels, shape=shape, out=out)
        except ValueError as exc:
            raise _BadRecord(f"cannot decode the JPEG ({exc})") from None
        if aug is not None and aug.rotate_degrees:
            image = rotate(image, rand(-aug.rotate_degrees, aug.rotate_degrees))  # type: ignore[misc]
            if out is not None:
                out[...] = image
                image = out
        return image

    def _direct_request(self, height: int, width: int, grey: bool) -> dict[str, Any]:
        """simplejpeg arguments that decode a ``height x width`` record straight to the output
        size; empty when it needs a resize (or, in colour, a transpose) after decoding."""
        if not grey:
            return {}  # libjpeg writes colour interleaved (H, W, 3); rows are planar
        request, scaled = dct_request((height, width), (height, width), self.size)
        return {"colorspace": "GRAY", **request} if scaled == self.size else {}

    def describe(self, gid: int) -> str:
        ix = self.index
        shard = ix.shard_names[int(ix.shard[gid])]
        try:
            path = ix.paths[gid] if ix.paths is not None else \
                read_shard_index(_shard_path(ix.root, shard)).paths[int(ix.local[gid])]
        except ShardError:
            path = "unknown"
        return f"record {int(ix.local[gid])} of shard {shard} (source {path})"

    def batch_shape(self, num: int) -> tuple[int, int, int, int]:
        return (num, self.options.channels, *self.size)

    def __getitem__(self, task: _Task) -> tuple[torch.Tensor, np.ndarray, np.ndarray | None, tuple[tuple[int, str], ...]]:
        images = torch.empty(self.batch_shape(len(task.positions)), dtype=torch.uint8)
        bad_rows, skipped = self.fill(task.positions, images.numpy(), training=task.valid is None, epoch=task.epoch, seed=task.seed)
        return (images, *self.labels(task, bad_rows), skipped)

    def labels(self, task: _Task, bad_rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """The targets and evaluation mask of a batch that :meth:`fill` decoded."""
        targets = self.targets[task.positions]
        valid = None if task.valid is None else task.valid.copy()
        for row in bad_rows:
            if valid is None:
                targets[row] = targets[_stand_in(row, bad_rows)]
            else:
                valid[row] = False
        return targets, valid

    def fill(
        self, positions: np.ndarray, rows: np.ndarray, *, training: bool, epoch: int, seed: int
    ) -> tuple[tuple[int, ...], tuple[tuple[int, str], ...]]:
        """Decode the records at dataset ``positions`` into ``rows`` (uint8 ``(B, C, H, W)``).

        Returns the rows whose record failed under ``on_error="skip"`` (in training they repeat
        a good row of the batch, in evaluation they are zeros) and ``(record, reason)`` of each.
        """
        opts, ix = self.options, self.index
        aug = opts.augment if training else None
        # Crops and rotations resample the decoded image; flips are applied to the row in place.
        geometric = aug is not None and (aug.crop_scale is not None or aug.rotate_degrees != 0)
        gids = self.ids[positions]
        self._own_files()
        if self._remote is not None:
            self._remote.fetch_now(gids, ix)
        # Per batch, not per record: indexing numpy arrays one scalar at a time costs more
        # than reading the record.
        shards = ix.shard[gids].tolist()
        columns = zip(
            gids.tolist(), shards, ix.start[gids].tolist(), ix.length[gids].tolist(), ix.crc32[gids].tolist(),
            self._unchecked(gids, set(shards)), ix.height[gids].tolist(), ix.width[gids].tolist(), ix.channels[gids].tolist(),
        )
        grey_out = opts.channels == 1
        out_hw = self.size
        planes = rows[:, 0]
        requests = self._requests
        checked = self._checked
        decode_jpeg = simplejpeg.decode_jpeg
        bad_rows, skipped = [], []
        for row, (gid, shard, start, length, crc, unchecked, height, width, channels) in enumerate(columns):
            rand = _Uniforms(seed, epoch, gid) if aug is not None else None
            grey = grey_out or channels == 1
            try:
                if unchecked:
                    data = self._read(shard, start, length, crc)
                    checked[gid] = True  # type: ignore[index]
                else:
                    data = self._read(shard, start, length, None)
                request = None if geometric else requests.get((height, width, grey))
                if request is None and not geometric:
                    request = requests[height, width, grey] = self._direct_request(height, width, grey)
                try:
                    # libjpeg-turbo writes the DCT-scaled luma straight into the batch.
                    image = decode_jpeg(data, buffer=planes[row], **request) if request else None
                except ValueError:
                    image = None  # the general path says whether the JPEG itself is bad
                if image is None or image.shape[:2] != out_hw:
                    if grey:
                        self._decode(data, (height, width), 1, rand, planes[row][:, :, None])
                    else:
                        rows[row] = self._decode(data, (height, width), 3, rand, None).transpose(2, 0, 1)
            except _BadRecord as exc:
                if opts.on_error == "raise":
                    raise ShardError(f"{self.describe(gid)}: {exc}. {_repair_hint(ix.root)}") from None
                bad_rows.append(row)
                skipped.append((gid, str(exc)))
                continue
            if grey and not grey_out:
                # A grey record asked for in RGB: copying the plane is cheaper than libjpeg's
                # grey-to-RGB conversion.
                rows[row, 1:] = planes[row]
            if aug is not None:
                out = rows[row]
                # numpy copies through a buffer when source and destination overlap.
                if aug.hflip and rand() < aug.hflip:  # type: ignore[operator]
                    out[...] = out[:, :, ::-1]
                if aug.vflip and rand() < aug.vflip:  # type: ignore[operator]
                    out[...] = out[:, ::-1]
        if bad_rows:
            if not training:
                rows[bad_rows] = 0
            elif len(bad_rows) == len(rows):
                raise ShardError(
                    f"every record of a training batch failed (first: {self.describe(int(gids[0]))}: "
                    f"{skipped[0][1]}). {_repair_hint(ix.root)}"
                )
            else:
                # Keep the batch full (static shapes): a bad row repeats a good row of the batch.
                for row in bad_rows:
                    rows[row] = rows[_stand_in(row, bad_rows)]
        return tuple(bad_rows), tuple(skipped)


def _read_ahead(reader: _BatchReader, tasks: list[_Task], depth: int) -> Iterator[Any]:
    """``reader[task]`` of each task, the next ``depth`` tasks' records fetched meanwhile (object storage)."""
    for k, task in enumerate(tasks):
        for ahead in tasks[k + 1: k + 1 + depth]:
            reader.prefetch(ahead.positions)
        yield reader[task]


def _stand_in(row: int, bad_rows: Sequence[int]) -> int:
    """The good row that stands in for bad ``row`` of a training batch: the last good row
    before it, else the first good row."""
    for source in range(row - 1, -1, -1):
        if source not in bad_rows:
            return source
    return next(source for source in range(row + 1, row + len(bad_rows) + 1) if source not in bad_rows)


class _Slots:
    """Batch buffers in shared memory that workers decode into and the consumer borrows.

    A worker writes a batch straight into a slot and sends back only which rows failed (no
    per-batch allocation, page faults or file-descriptor hand-off). The consumer gets a tensor
    viewing the slot, which goes back on the free list when the last tensor using that memory
    is freed, so a consumer may keep batches as long as it likes: when every slot is out, a
    task is sent without one and its worker allocates a batch of its own.
    """

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        # torch unlinks the shared-memory file as soon as it is mapped: nothing is left behind
        # in /dev/shm, however the processes end.
        self.buffer = torch.empty(num_slots * slot_bytes, dtype=torch.uint8).share_memory_()
        self.slot_bytes = slot_bytes
        self._rows = self.buffer.numpy()
        self._views: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
        # Last in, first out: the slot freed last is still in the CPU caches.
        self._free = list(range(num_slots - 1, -1, -1))

    def take(self) -> int | None:
        try:
            return self._free.pop()
        except IndexError:
            return None

    def release(self, slot: int) -> None:
        self._free.append(slot)  # list.append is atomic: a batch may be freed in any thread

    def lend(self, slot: int, shape: tuple[int, ...]) -> torch.Tensor:
        view = self._views.get((slot, shape))
        if view is None:
            start = slot * self.slot_bytes
            view = self._views[slot, shape] = self._rows[start : start + math.prod(shape)].reshape(shape)
        rows = view.view(_Lent)
        rows.lease = (self, slot)
        return torch.from_numpy(rows)


class _Lent(np.ndarray):
    """A slot lent out; the slot is released when this array is freed.

    ``torch.from_numpy`` keeps the array for as long as any tensor uses its memory (views and
    slices of the batch included); numpy views of this array keep it too.
    """

    lease: tuple[_Slots, int] | None = None

    def __del__(self) -> None:
        if self.lease is not None:
            slots, slot = self.lease
            slots.release(slot)


def _worker_main(reader: _BatchReader, buffer: torch.Tensor, slot_bytes: int, conn: Connection, parent: int) -> None:
    """A worker: decode each batch received into its slot (or a batch of its own)."""
    # One decode at a time per process: torch's thread pool would only oversubscribe the cores.
    torch.set_num_threads(1)
    # Ctrl-C reaches the whole process group, and a scheduler's SIGTERM often does too (a job's
    # processes, a container's): the main process handles them, finishes its step, saves, and
    # stops the workers, which must live until then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    reader.map_files = True
    rows = buffer.numpy()
    # One poll object for the life of the worker: Connection.poll builds a selector per call.
    incoming = select.poll()
    incoming.register(conn.fileno(), select.POLLIN)
    # Tasks received and not yet decoded: the main process sends up to prefetch_batches ahead,
    # and from object storage their records are fetched while the first one decodes.
    queued: collections.deque[Any] = collections.deque()
    while True:
        while not queued and not incoming.poll(1000):
            if os.getppid() != parent:
                return  # the main process is gone (this one was re-parented)
        while incoming.poll(0):
            try:
                # A task from the main process over this worker's own pipe (what Connection.recv
                # unpickles too); nothing read from disk is ever unpickled.
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            if message is None:
                return
            queued.append(message)
            reader.prefetch(np.frombuffer(message[0], dtype=np.int64))
        message = queued.popleft()
        positions_bytes, training, epoch, seed, slot = message
        positions = np.frombuffer(positions_bytes, dtype=np.int64)
        shape = reader.batch_shape(len(positions))
        images = None
        try:
            if slot is None:
                # Every slot is lent out (the consumer keeps batches): this batch gets shared
                # memory of its own, sent as a file descriptor.
                images = torch.empty(shape, dtype=torch.uint8).share_memory_()
                batch = images.numpy()
            else:
                batch = rows[slot * slot_bytes : slot * slot_bytes + math.prod(shape)].reshape(shape)
            reply: tuple[bool, Any] = (True, (images, *reader.fill(positions, batch, training=training, epoch=epoch, seed=seed)))
        except (ShardError, storage.StorageError) as exc:
            reply = (False, exc)
        except Exception:
            reply = (False, RuntimeError(f"a shard reader worker failed:\n{traceback.format_exc()}"))
        if images is None:
            conn.send_bytes(pickle.dumps(reply, pickle.HIGHEST_PROTOCOL))
        else:
            conn.send(reply)  # multiprocessing's pickler: torch sends the tensor's shared memory


class _Workers:
    """Worker processes that decode batches into shared slots, one pipe each.

    Task ``k`` of a pass goes to worker ``k % num_workers``, so each pipe delivers its results
    in order and the batches come back in task order without reordering. Up to
    ``prefetch_batches`` tasks per worker are in flight. Messages are small: a task is its
    positions, a result the rows that failed; targets are looked up in this process.
    """

    def __init__(self, reader: _BatchReader, num_workers: int, prefetch_batches: int, slot_bytes: int) -> None:
        self.reader = reader
        # Enough for the tasks in flight, the batch being received and a few the consumer
        # holds; past that a worker allocates its batch (see _Slots).
        self.slots = _Slots(num_workers * prefetch_batches + 4, slot_bytes)
        self.prefetch_batches = prefetch_batches
        self.broken = False  # a worker died: start new ones for the next pass
        self._pending: collections.deque[tuple[int, int | None]] = collections.deque()  # (worker, slot) in task order
        context = multiprocessing.get_context()
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        # Stops the workers when this object is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        for w in range(num_workers):
            ours, theirs = context.Pipe(duplex=True)
            proc = context.Process(
                target=_worker_main, args=(reader, self.slots.buffer, slot_bytes, theirs, os.getpid()),
                name=f"xlatrain-shards-{w}", daemon=True,
            )
            proc.start()
            # Only the worker holds its end now, so the pipe reports end-of-file if it dies.
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)

    def run(self, tasks: list[_Task]) -> Iterator[tuple[torch.Tensor, np.ndarray, np.ndarray | None, tuple[tuple[int, str], ...]]]:
        """``(images, targets, valid, skipped)`` of each task, in order."""
        self._drain()
        num_workers = len(self._conns)
        depth = num_workers * self.prefetch_batches
        for k in range(min(depth, len(tasks))):
            self._send(k % num_workers, tasks[k])
        pending, slots, labels = self._pending, self.slots, self.reader.labels
        shape = self.reader.batch_shape(len(tasks[0].positions)) if tasks else ()
        for k, task in enumerate(tasks):
            worker, slot = pending.popleft()
            ok, result = self._receive(worker, slot)
            if k + depth < len(tasks):
                self._send(worker, tasks[k + depth])  # the same worker: (k + depth) % num_workers
            if not ok:
                raise result
            images, bad_rows, skipped = result
            if images is None:
                images = slots.lend(slot, shape)  # type: ignore[arg-type]
            yield (images, *labels(task, bad_rows), skipped)

    def _send(self, worker: int, task: _Task) -> None:
        slot = self.slots.take()
        self._pending.append((worker, slot))
        message = (task.positions.tobytes(), task.valid is None, task.epoch, task.seed, slot)
        self._conns[worker].send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def _receive(self, worker: int, slot: int | None) -> tuple[bool, Any]:
        try:
            ok, result = self._conns[worker].recv()
        except (EOFError, OSError):
            ok, result = False, None
        if not ok and slot is not None:
            self.slots.release(slot)
        if result is None:
            self.broken = True
            proc = self._procs[worker]
            proc.join(timeout=1)
            if proc.exitcode == -signal.SIGBUS:
                why = "SIGBUS: a shard file was truncated or overwritten in place while it was being read"
            else:
                why = f"exit code {proc.exitcode}, a negative code is the signal that ended it: check memory"
            raise RuntimeError(f"shard reader worker {worker} (pid {proc.pid}) exited unexpectedly ({why})")
        return ok, result

    def _drain(self) -> None:
        """Receive and drop what an abandoned pass still has in flight."""
        while self._pending:
            worker, slot = self._pending.popleft()
            ok, _ = self._receive(worker, slot)
            if ok and slot is not None:
                self.slots.release(slot)

    def close(self) -> None:
        self._finalizer()


def _stop_workers(procs: list[multiprocessing.process.BaseProcess], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass  # already gone
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()  # it ignores SIGTERM (see _worker_main)
            proc.join()
    for conn in conns:
        conn.close()


def _host_batch(images: torch.Tensor, targets: np.ndarray, *, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as the consumer gets it: targets as a tensor; both page-locked when ``pin``."""
    targets_t = torch.from_numpy(targets)
    if pin:
        # The copy into page-locked memory also hands the shared slot straight back.
        return images.pin_memory(), targets_t.pin_memory()
    return images, targets_t


class _PinThread:
    """A pass's batches received and page-locked in a thread, ``depth`` ahead of the consumer.

    On CUDA an eager step is often bound by the Python thread that launches its kernels (a
    resnet34 step at batch 64 on an H100 launched in 20.2 ms and ran in 20.3 ms): every
    millisecond that thread spends taking a batch off the workers and copying it into pinned
    memory (1.6-3.7 ms a batch there on average, with 5-6 ms spikes) is one the device waits. Here
    the consumer only takes a ready batch off a queue; the copy runs with the GIL released. The
    pinned memory comes from torch's caching host allocator, which keeps each block until the
    copies that read it are done, so a batch may be freed as soon as its copy is queued.
    Without CUDA the thread still runs, and only converts (pinning is a no-op there).
    """

    _END = object()

    def __init__(self, source: Iterator[Any], depth: int = 2) -> None:
        self._source = source
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        pin = torch.cuda.is_available()
        # The thread's CUDA calls go to this process's device, not device 0 (as the DataLoader's
        # pin-memory thread does): under torchrun every process would otherwise touch GPU 0.
        device = torch.cuda.current_device() if pin else None
        self._thread = threading.Thread(target=self._run, args=(pin, device), name="xlatrain-pin", daemon=True)
        self._thread.start()

    def _run(self, pin: bool, device: int | None) -> None:
        if device is not None:
            torch.cuda.set_device(device)
        try:
            for images, targets, valid, skipped in self._source:
                item: Any = (*_host_batch(images, targets, pin=pin), valid, skipped)
                del images  # a shared slot goes back to the workers now, not when the consumer is done
                if not self._put(item):
                    return
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer, which sees it as its own
            self._put(exc)
            return
        self._put(self._END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> _PinThread:
        return self

    def __next__(self) -> Any:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the shard reader's pinning thread stopped without a word") from None
        if item is self._END:
            self._queue.put(item)  # later calls stop too
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the thread and wait for it: afterwards nothing else touches the pass's source."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


# --------------------------------------------------------------------------------------------
# The dataset


def _open_index(root: Path | str, options: ShardOptions) -> RecordIndex:
    has_manifest = storage.exists(storage.join(root, MANIFEST_NAME)) if isinstance(root, str) \
        else (root / MANIFEST_NAME).is_file()
    if not has_manifest:
        tars = webdataset.list_tars(root)
        if tars:
            return webdataset.open_tar_index(root, tars, options)
    manifest = read_manifest(root)
    label_names = tuple(manifest["label_names"])
    entries = manifest["shards"]
    total = sum(int(e["num_records"]) for e in entries)
    num_labels = len(label_names)
    ix = RecordIndex(
        root=root,
        shard_names=[e["name"] for e in entries],
        shard_bytes=[int(e["num_bytes"]) for e in entries],
        shard=np.zeros(total, dtype=np.int64),
        local=np.zeros(total, dtype=np.int64),
        start=np.zeros(total, dtype=np.int64),
        length=np.full(total, -1, dtype=np.int64),
        crc32=np.zeros(total, dtype=np.uint32),
        height=np.zeros(total, dtype=np.int64),
        width=np.zeros(total, dtype=np.int64),
        channels=np.zeros(total, dtype=np.int64),
        labels=np.zeros((total, num_labels), dtype=np.float32),
        label_names=label_names,
        group_codes=np.full(total, -1, dtype=np.int64),
        group_names=[],
        dropped=[],
    )
    codes: dict[str, int] = {}
    lo = 0
    for s, entry in enumerate(entries):
        n = int(entry["num_records"])
        try:
            path = _shard_path(root, entry["name"])
            if options.verify_checksums and (storage.exists(str(path)) if isinstance(path, str) else path.exists()):
                digest = file_sha256(path)
                if digest != entry["sha256"]:
                    raise ShardError(
                        f"shard {entry['name']} fails its checksum (SHA-256 {digest[:16]}..., the manifest says "
                        f"{entry['sha256'][:16]}...)"
                    )
            shard = read_shard_index(path, expected_bytes=int(entry["num_bytes"]))
            if shard.num_records != n or shard.label_names != label_names:
                raise ShardError(f"shard {entry['name']} does not match the manifest (records or label names differ)")
        except ShardError as exc:
            if options.on_error == "raise":
                raise ShardError(f"{exc}. {_repair_hint(root)}") from None
            ix.dropped.append((entry["name"], n, str(exc)))
            log.warning(f"on_error='skip': leaving out the {n} records of {exc}")
            lo += n
            continue
        rows = slice(lo, lo + n)
        ix.shard[rows] = s
        ix.local[rows] = np.arange(n)
        ix.start[rows] = shard.starts[:-1]
        ix.length[rows] = np.diff(shard.starts)
        ix.crc32[rows] = shard.crc32
        ix.height[rows] = shard.height
        ix.width[rows] = shard.width
        ix.channels[rows] = shard.channels
        ix.labels[rows] = shard.labels
        ix.group_codes[rows] = [codes.setdefault(g, len(codes)) for g in shard.groups]
        lo += n
    ix.group_names = list(codes)
    return ix


class ShardDataset:
    """Packed shards as a :class:`~xlatrain.data.source.BatchSource`: uint8 image batches + targets.

    Each process reads its own part of every global batch (disjoint, complete per epoch; the
    records that do not fill a whole global batch are left out of that epoch, as with the
    Trainer's sampler); the epoch order is a function of ``(seed, epoch)`` alone, so two runs
    agree and a run resumed at ``start_step`` yields exactly what it would have. Evaluation
    covers every record once, padded to full batches with a ``valid`` mask.

    Args:
        root: a directory written by ``xlatrain pack``.
        indices: manifest record numbers to use, in this dataset's order (e.g. one fold from
            :func:`xlatrain.data.splits.group_kfold`); default all.
        **options: fields of :class:`ShardOptions` (``image_size``, ``channels``, ``labels``,
            ``target``, ``augment``, ``num_workers``, ``pin_memory``, ``on_error``, ...). A
            recipe passes the Trainer's loader settings through: ``num_workers`` as configured,
            ``pin_memory=True`` when training on CUDA.

    Example:
        >>> full = ShardDataset("shards/", image_size=128, channels=1, num_workers=2)
        >>> train_ids, val_ids = group_kfold(full.groups, num_folds=5, fold=0)
        >>> train = full.subset(train_ids, augment=Augment(hflip=0.5, rotate_degrees=10))
        >>> val = full.subset(val_ids)
        >>> model = torch.nn.Sequential(NormalizeInput(mean=[0.5], std=[0.25]), backbone)
        >>> Trainer(model, nn.BCEWithLogitsLoss(), opt_fn, config=cfg).fit(train, val)
    """

    def __init__(
        self, root: str | os.PathLike[str], *, indices: Sequence[int] | np.ndarray | None = None, **options: Any
    ) -> None:
        _check_option_names(options)
        opts = ShardOptions(**options)
        root = str(root).rstrip("/") if storage.is_url(root) else Path(root)
        index = _open_index(root, opts)
        ids = np.arange(len(index.length), dtype=np.int64) if indices is None else self._check_ids(indices, len(index.length), "indices")
        self._setup(root, index, ids, opts)

    # -- construction ------------------------------------------------------------------------
    @staticmethod
    def _check_ids(indices: Sequence[int] | np.ndarray, limit: int, name: str) -> np.ndarray:
        ids = np.asarray(indices)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"{name} must be a 1-D sequence of integers")
        ids = ids.astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= limit):
            raise ValueError(f"{name} holds values outside 0..{limit - 1}: pass positions of this dataset's records")
        return ids

    def _setup(self, root: Path | str, index: RecordIndex, ids: np.ndarray, options: ShardOptions) -> None:
        self.root, self.options, self._index = root, options, index
        present = index.length[ids] >= 0
        self._dropped_ids = ids[~present]
        self._ids = ids[present]
        if len(self._ids) == 0:
            raise ValueError(f"{root} has no readable records for this dataset: check the shards with `xlatrain pack --verify {root}`")
        names = index.label_names
        wanted = options.labels if options.labels is not None else names
        missing = [n for n in wanted if n not in names]
        if missing:
            raise ValueError(f"label(s) {missing} are not in {root}: packed labels are {list(names)}. Pack them "
                             "in (xlatrain pack ... --labels with these names too, and --replace over this pack), or ask "
                             "for packed ones only")
        self.label_names = tuple(wanted)
        columns = [names.index(n) for n in wanted]
        labels = index.labels[self._ids][:, columns]
        if options.target == "long":
            if len(columns) != 1 or not np.all(labels == np.round(labels)) or np.any(labels < 0):
                raise ValueError(
                    f"target='long' needs exactly one label column of non-negative integers; got {list(wanted)}. "
                    "Pick one class-id column with labels=[...], or use target='float' for multi-label"
                )
            targets = labels[:, 0].astype(np.int64)
        else:
            targets = np.ascontiguousarray(labels)
        self._targets = torch.from_numpy(targets)
        if options.image_size is not None:
            size = options.image_size
        else:
            heights, widths = index.height[self._ids], index.width[self._ids]
            if np.any(heights != heights[0]) or np.any(widths != widths[0]):
                raise ValueError(
                    f"records in {root} have different sizes (e.g. {heights[0]}x{widths[0]} and "
                    f"{heights.max()}x{widths.max()}): set image_size=... so batches have one shape"
                )
            size = (int(heights[0]), int(widths[0]))
        self.image_size: tuple[int, int] = size  # type: ignore[assignment]
        self._reader = _BatchReader(index, self._ids, targets, options, self.image_size)
        self._workers: _Workers | None = None
        self._run_workers: int | None = None  # the Trainer's num_workers, where this reader's own is "auto"
        self._pinning: _PinThread | None = None
        self._generation = 0
        self._skipped: dict[int, str] = {}

    def subset(self, indices: Sequence[int] | np.ndarray, **options: Any) -> ShardDataset:
        """A dataset over ``indices`` (positions in this one), sharing the parsed index.

        ``options`` override this dataset's :class:`ShardOptions` (e.g. ``augment=`` for training).
        """
        positions = self._check_ids(indices, len(self), "indices")
        _check_option_names(options)
        other = ShardDataset.__new__(ShardDataset)
        other._setup(self.root, self._index, self._ids[positions], replace(self.options, **options))
        return other

    # -- BatchSource ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ids)

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """Dataset positions in this epoch's reading order (identical in every process)."""
        n = len(self._ids)
        if not self.options.shuffle:
            return np.arange(n, dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed % 2**63, epoch % 2**63, 0x5A4D])))
        if self.options.shuffle_window is None:
            return rng.permutation(n).astype(np.int64)
        shard_rank = rng.permutation(len(self._index.shard_names))
        # The stream a shard reader would see: shards in a random order, records in stored order.
        stream = np.lexsort((self._ids, shard_rank[self._index.shard[self._ids]]))
        keys = np.arange(n) + rng.random(n) * self.options.shuffle_window
        return stream[np.argsort(keys, kind="stable")].astype(np.int64)

    def train_batches(
        self,
        *,
        loader_batch: int,
        num_processes: int,
        process_index: int,
        seed: int,
        epoch: int,
        start_step: int = 0,
        step_multiple: int = 1,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This process's ``(images_BCHW_uint8, targets)`` batches of one epoch, from ``start_step``."""
        check_layout(loader_batch=loader_batch, num_processes=num_processes, process_index=process_index)
        steps = train_steps_per_epoch(len(self), loader_batch, num_processes, step_multiple)
        if not 0 <= start_step <= steps:
            raise ValueError(f"start_step={start_step} is outside 0..{steps} (steps in this epoch)")
        order = self.epoch_order(seed, epoch)
        global_batch = loader_batch * num_processes
        lo = process_index * loader_batch
        tasks = [
            _Task(order[k * global_batch + lo : k * global_batch + lo + loader_batch], None, epoch, seed)
            for k in range(start_step, steps)
        ]
        return self._run(tasks, training=True)

    def eval_batches(
        self, *, loader_batch: int, num_processes: int, process_index: int
    ) -> Iterator[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """This process's ``((images, targets), valid)`` batches, laid out as ``EvalSampler``."""
        check_layout(loader_batch=loader_batch, num_processes=num_processes, process_index=process_index)
        n = len(self)
        positions = EvalSampler(n, loader_batch=loader_batch, num_processes=num_processes).indices(process_index).numpy()
        valid = positions < n
        positions = positions % n  # padding rows repeat real records and are masked out
        tasks = [
            _Task(positions[k : k + loader_batch], valid[k : k + loader_batch], 0, 0)
            for k in range(0, len(positions), loader_batch)
        ]
        return self._run(tasks, training=False)

    def _run(self, tasks: list[_Task], *, training: bool) -> Iterator[Any]:
        self._generation += 1
        return self._iterate(tasks, training, self._generation)

    def _iterate(self, tasks: list[_Task], training: bool, generation: int) -> Iterator[Any]:
        it: Iterator[Any] | None = None
        try:
            while True:
                # Checked before every fetch: the workers serve one pass at a time, and a newer
                # pass has taken them over, so an older pass must not read the newer one's batches.
                if self._generation != generation:
                    raise RuntimeError(
                        "this ShardDataset started another pass (train_batches / eval_batches) before this one "
                        "finished: iterate one pass at a time, or use a second ShardDataset"
                    )
                if it is None:
                    self._stop_pinning()  # an abandoned pass's thread lets go of the workers first
                    it = self._source(tasks)
                    if self.options.pin_memory:
                        it = self._pinning = _PinThread(it)
                try:
                    images, targets, valid, skipped = next(it)
                except StopIteration:
                    return
                if not isinstance(it, _PinThread):
                    images, targets = _host_batch(images, targets, pin=False)
                if skipped:
                    self._note_skipped(skipped)
                yield (images, targets) if training else ((images, targets), torch.from_numpy(valid))
        finally:
            if isinstance(it, _PinThread):
                it.close()

    def _stop_pinning(self) -> None:
        pinning, self._pinning = self._pinning, None
        if pinning is not None:
            pinning.close()

    def decode_workers(self, batches: int | None = None) -> tuple[int, str]:
        """The worker processes a pass of ``batches`` batches decodes with, and why (under
        ``"auto"``, workers already started for a longer pass serve a shorter one)."""
        if self.options.num_workers != "auto":
            return int(self.options.num_workers), "as configured"
        if self._run_workers is not None:
            return self._run_workers, "as configured"
        return auto_workers(batches if batches is not None else max(len(self) // 2, 1))

    def take_num_workers(self, num_workers: int | str, *, check: bool = False) -> None:
        """The Trainer's ``num_workers`` for the passes of one ``fit``, ``evaluate`` or ``predict``:
        decoding follows it where this reader's own is ``"auto"`` (one setting for the run's
        decoding processes; the reader's own setting is kept for the next Trainer). A number of
        the reader's own that differs is refused; ``check`` only refuses."""
        own = self.options.num_workers
        if num_workers != "auto" and own not in ("auto", num_workers):
            raise ValueError(
                f"the Trainer's num_workers={num_workers} and this ShardDataset's num_workers={own} differ: both "
                "say how many processes decode its batches. Give the number in one place (TrainConfig's serves "
                "every ShardDataset of the run whose own is 'auto')")
        if not check:
            self._run_workers = int(num_workers) if num_workers != "auto" and own == "auto" else None

    def _source(self, tasks: list[_Task]) -> Iterator[Any]:
        opts = self.options
        num_workers = self.decode_workers(len(tasks))[0]
        if num_workers == 0:
            self.close()  # workers an earlier pass started: none is asked for now
            return _read_ahead(self._reader, tasks, opts.prefetch_batches)
        slot_bytes = math.prod(self._reader.batch_shape(max(len(t.positions) for t in tasks)))
        workers = self._workers
        # An 'auto' pass is served by as many workers as a longer one started; a number given is kept.
        given = self.options.num_workers != "auto" or self._run_workers is not None
        other = workers is None or len(workers._conns) < num_workers or (given and len(workers._conns) != num_workers)
        if workers is None or workers.broken or workers.slots.slot_bytes < slot_bytes or other:
            # First pass, a dead worker, larger batches than the slots hold, another count: start afresh.
            self.close()
            workers = self._workers = _Workers(self._reader, num_workers, opts.prefetch_batches, slot_bytes)
        return workers.run(tasks)

    def _note_skipped(self, skipped: Iterable[tuple[int, str]]) -> None:
        for gid, reason in skipped:
            if gid not in self._skipped:
                self._skipped[gid] = reason
                log.warning(f"on_error='skip': skipping {self._reader.describe(gid)}: {reason}")

    # -- inspection --------------------------------------------------------------------------
    def __getitem__(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One record as ``(image_CHW_uint8, target)``, without augmentation."""
        if not -len(self) <= position < len(self):
            raise IndexError(f"position {position} is outside a dataset of {len(self)} records")
        position %= len(self)
        gid = int(self._ids[position])
        try:
            image = self._reader.decode_one(gid)
        except _BadRecord as exc:
            raise ShardError(f"{self._reader.describe(gid)}: {exc}. {_repair_hint(self.root)}") from None
        return to_tensor(image).expand(self.options.channels, -1, -1).contiguous(), self._targets[position]

    @property
    def record_ids(self) -> np.ndarray:
        """Manifest record number of each position."""
        return self._ids.copy()

    @property
    def groups(self) -> np.ndarray:
        """Group key (e.g. StudyInstanceUID) of each position, for :func:`~xlatrain.data.splits.group_kfold`."""
        names = np.asarray(self._index.group_names + [""], dtype=object)
        return names[self._index.group_codes[self._ids]]

    @property
    def labels(self) -> np.ndarray:
        """float32 ``[N, L]`` labels of each position, columns as :attr:`label_names`."""
        columns = [self._index.label_names.index(n) for n in self.label_names]
        return self._index.labels[self._ids][:, columns]

    @property
    def num_skipped(self) -> int:
        """Records left out so far under ``on_error="skip"``: unreadable shards and bad records (a
        WebDataset tar that breaks before its first sample, its records unknown, counts as one)."""
        return len(self._dropped_ids) + len(self._skipped)

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """What :attr:`num_skipped` counts: ``{"record", "what", "reason"}`` per record or shard."""
        dropped = self._index.dropped if len(self._dropped_ids) else []
        out = [{"record": None, "what": f"shard {name} ({'records unknown' if n is None else f'{n} records'})",
                "reason": reason} for name, n, reason in dropped]
        out += [{"record": gid, "what": self._reader.describe(gid), "reason": r} for gid, r in self._skipped.items()]
        return out

    def close(self) -> None:
        """Stop the worker processes (they also stop when the dataset is garbage collected).

        Batches already handed out stay valid: their shared memory lives as long as they do.
        """
        self._stop_pinning()
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()
        if self._reader._remote is not None:  # prefetches of object-storage records still queued
            self._reader._remote.close()

    def __enter__(self) -> ShardDataset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_workers"] = None  # worker processes and their shared buffers do not travel
        state["_pinning"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"ShardDataset({str(self.root)!r}, records={len(self)}, image_size={self.image_size}, "
            f"channels={self.options.channels}, labels={len(self.label_names)}, workers={self.options.num_workers})"
        )


def _check_option_names(options: dict[str, Any]) -> None:
    valid = sorted(f.name for f in ShardOptions.__dataclass_fields__.values())
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown ShardDataset option(s) {unknown}: valid ones are {valid}")


# --------------------------------------------------------------------------------------------
# On the device


def normalize_on_device(
    images: torch.Tensor, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """uint8 ``[..., C, H, W]`` -> float32 ``(x / 255 - mean) / std`` per channel, where ``images`` lives.

    Call it at the start of the model's ``forward`` (or use :class:`NormalizeInput`) so the host
    sends uint8 -- a quarter of the bytes of float32 -- and the accelerator does the arithmetic.
    """
    mean_t = torch.as_tensor(mean, dtype=torch.float32, device=images.device).reshape(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32, device=images.device).reshape(-1, 1, 1)
    return (images.float() * (1.0 / 255.0) - mean_t) / std_t


class NormalizeInput(torch.nn.Module):
    """A first layer that turns uint8 images into normalised float32 on the device.

    With three means and stds, a one-channel (grey) batch broadcasts to three channels here, on
    the device: read grey slices with ``channels=1`` and the host decodes and sends a third.

    Example:
        >>> model = torch.nn.Sequential(NormalizeInput(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]), resnet)
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        if len(mean) != len(std) or any(s <= 0 for s in std):
            raise ValueError(f"mean={list(mean)} and std={list(std)} need one value per channel and std > 0")
        # Constants, not weights: kept out of state_dict so checkpoints hold only trained values.
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).reshape(-1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).reshape(-1, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return (images.float() * (1.0 / 255.0) - self.mean) / self.std
