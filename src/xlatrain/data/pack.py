"""``xlatrain pack``: an image folder plus a CSV -> a directory of shards and a manifest.

The encoded JPEG bytes are stored as they are (``max_side`` re-encodes once, offline, only images
larger than it), with each record's labels, group key and source path. Every image is decoded
once while packing, so an unreadable or corrupt file -- or a CSV row whose file is missing -- is
skipped, counted and listed (in the summary and in ``manifest.json``), never packed silently.

Shards are written atomically and named by their content (``shard-00003-<sha256 prefix>.xshard``);
the manifest is written last. Packing the same input again produces the same manifest and finds
every shard already in place, so nothing is rewritten. :func:`verify` re-checks every checksum and
decodes every record.
"""

from __future__ import annotations

import csv
import fnmatch
import glob
import hashlib
import itertools
import json
import os
import string
import sys
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import simplejpeg

from xlatrain import storage
from xlatrain.checkpoint import atomic_write_bytes, atomic_write_text
from xlatrain.data.decode import decode
from xlatrain.data.shards import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SHARD_SUFFIX,
    ShardError,
    ShardRecord,
    encode_shard,
    file_sha256,
    read_manifest,
    read_shard_index,
)
from xlatrain.logs import get_logger

log = get_logger(__name__)

_GLOB_CHARS = "*?["
_CHUNK = 64  # rows per task sent to a worker process: amortises the round trip


@dataclass(frozen=True, kw_only=True)
class PackOptions:
    """What :func:`pack` reads from the CSV and how it writes shards.

    Attributes:
        path_columns: columns joined with ``/`` (then ``suffix``) into each image's path under
            ``image_dir``, e.g. ``("StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID")``;
            one column holding a relative path also works.
        path_template: instead of ``path_columns``, a ``str.format`` template over the columns,
            e.g. ``"{StudyInstanceUID}/{SeriesInstanceUID}/*{SOPInstanceUID}.jpg"``; a ``*`` or ``?``
            in the file-name part is matched against the folder (listed once per folder, not
            globbed per row).
        suffix: appended to the joined ``path_columns`` (e.g. ``".jpg"``).
        labels: label columns, by name or ``fnmatch`` pattern (``"*_pe"``), kept in CSV order.
        group: column holding the group key (e.g. ``StudyInstanceUID``) for leakage-free splits.
        max_side: re-encode images whose longer side exceeds this, once, to this size.
        quality: JPEG quality of those re-encoded images.
        shard_bytes: target shard size; a shard closes when the next image would exceed it.
        workers: processes that read and check images.
        progress: print a progress line to stderr.
        replace: replace an earlier pack in ``out_dir`` made from other inputs (another CSV or
            its other content, another image folder, other labels, group or paths); without it
            that is an error naming what differs, and nothing is written. Another layout of the
            same records (shard size, re-encoding) updates the pack in place.
    """

    path_columns: tuple[str, ...] = ()
    path_template: str | None = None
    suffix: str = ""
    labels: tuple[str, ...] = ()
    group: str | None = None
    max_side: int | None = None
    quality: int = 95
    shard_bytes: int = 128 * 2**20
    workers: int = 1
    progress: bool = True
    replace: bool = False

    def __post_init__(self) -> None:
        for name in ("path_columns", "labels"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        if bool(self.path_columns) == (self.path_template is not None):
            raise ValueError(
                "give exactly one of path_columns (e.g. ['StudyInstanceUID', 'SeriesInstanceUID', "
                "'SOPInstanceUID'] with suffix='.jpg') and path_template (e.g. '{path}')"
            )
        if self.path_template is not None:
            fields = _template_fields(self.path_template)
            if not fields:
                raise ValueError(f"path_template={self.path_template!r} names no column: write columns as {{name}}")
            directory = self.path_template.rsplit("/", 1)[0] if "/" in self.path_template else ""
            if any(c in _literal(directory) for c in _GLOB_CHARS):
                raise ValueError(
                    f"path_template={self.path_template!r} has a wildcard in a folder name: only the file-name "
                    "part may hold * or ?"
                )
        if self.max_side is not None and (isinstance(self.max_side, bool) or self.max_side < 8):
            raise ValueError(f"max_side={self.max_side!r} is not valid: use a side of at least 8 pixels, or None")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"quality={self.quality!r} is not valid: use 1..100")
        if self.shard_bytes < 1:
            raise ValueError(f"shard_bytes={self.shard_bytes!r} is not valid: use a positive size, e.g. 128 * 2**20")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers={self.workers!r} is not valid: use 1 or more processes")

    @property
    def template(self) -> str:
        if self.path_template is not None:
            return self.path_template
        return "/".join("{" + c + "}" for c in self.path_columns) + self.suffix


def _template_fields(template: str) -> list[str]:
    try:
        return [f for _, f, _, _ in string.Formatter().parse(template) if f]
    except ValueError as exc:
        raise ValueError(f"path_template={template!r} is not a valid format string ({exc})") from None


def _literal(template: str) -> str:
    return "".join(text for text, _, _, _ in string.Formatter().parse(template))


@dataclass(frozen=True, kw_only=True)
class SkippedRow:
    """A CSV row that was not packed: ``line`` in the CSV file, image path, and why."""

    line: int
    path: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class PackSummary:
    """What :func:`pack` did."""

    out_dir: Path | str  # a local directory, or an object-storage URL
    num_rows: int
    num_records: int
    num_bytes: int
    num_shards: int
    num_shards_written: int
    label_names: tuple[str, ...]
    skipped: tuple[SkippedRow, ...]

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def describe(self, max_listed: int = 20) -> str:
        lines = [
            f"packed {self.num_records} of {self.num_rows} rows ({self.num_bytes / 2**20:.1f} MB of images) into "
            f"{self.num_shards} shard(s) in {self.out_dir} ({self.num_shards_written} written, "
            f"{self.num_shards - self.num_shards_written} already up to date); labels: "
            + (", ".join(self.label_names) or "none")
        ]
        if self.num_records == 0:
            # A pack of nothing is no success: say why, and the exit status is 1.
            lines.append(
                "error: nothing was packed: "
                + ("the CSV lists no rows (a header only, or empty)" if self.num_rows == 0 else
                   f"none of its {self.num_rows} row(s) gave an image (each skipped row is listed below)")
                + ". Check --csv, --images and the path columns (--path-columns / --path-template)"
            )
        if self.skipped:
            lines.append(f"skipped {self.num_skipped} row(s) (all listed in {self.out_dir}/{MANIFEST_NAME}):")
            lines += [f"  line {s.line}: {s.path}: {s.reason}" for s in self.skipped[:max_listed]]
            if self.num_skipped > max_listed:
                lines.append(f"  ... and {self.num_skipped - max_listed} more")
        return "\n".join(lines)


class _Progress:
    """One status line on stderr, redrawn in place on a terminal, every few seconds otherwise."""

    def __init__(self, enabled: bool, total: int, what: str) -> None:
        self.enabled, self.total, self.what = enabled, total, what
        self.tty = enabled and sys.stderr.isatty()
        self.started = self.last = time.perf_counter()

    def update(self, done: int, extra: str = "", final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self.last < (0.5 if self.tty else 5.0):
            return
        self.last = now
        rate = done / max(now - self.started, 1e-9)
        line = f"{self.what}: {done:,}/{self.total:,}  {rate:,.0f}/s" + (f"  {extra}" if extra else "")
        if self.tty:  # a status line redrawn in place: terminal output, not a log message
            sys.stderr.write("\r" + line.ljust(79) + ("\n" if final else ""))
            sys.stderr.flush()
        else:
            log.info(line)


def _resolve_labels(patterns: Sequence[str], columns: Sequence[str], reserved: set[str]) -> tuple[str, ...]:
    chosen: list[str] = []
    for pattern in patterns:
        if pattern in columns:
            matches = [pattern]
        else:
            # Patterns never pick the path or group columns; name them explicitly to use them.
            matches = [c for c in columns if fnmatch.fnmatchcase(c, pattern) and c not in reserved]
        if not matches:
            raise ValueError(f"label {pattern!r} matches no CSV column: the columns are {list(columns)}")
        chosen += [m for m in matches if m not in chosen]
    return tuple(c for c in columns if c in chosen)


class _Folders:
    """Folder listings for wildcard templates, cached because CSV rows cluster by folder."""

    def __init__(self, root: Path, keep: int = 256) -> None:
        self.root, self.keep = root, keep
        self.cache: OrderedDict[str, list[str] | None] = OrderedDict()

    def match(self, folder: str, pattern: str) -> tuple[str | None, str]:
        """The one file in ``folder`` matching ``pattern``, or ``None`` and why not."""
        names = self.cache.get(folder)
        if folder in self.cache:
            self.cache.move_to_end(folder)
        else:
            try:
                names = sorted(os.listdir(self.root / folder))
            except OSError:
                names = None
            self.cache[folder] = names
            if len(self.cache) > self.keep:
                self.cache.popitem(last=False)
        if names is None:
            return None, f"missing folder {folder or '.'}"
        found = fnmatch.filter(names, pattern)
        if len(found) != 1:
            return None, ("no file matches" if not found else f"ambiguous: {len(found)} files match")
        return (f"{folder}/{found[0]}" if folder else found[0]), ""


def _check_image(path: str, max_side: int | None, quality: int) -> tuple[Any, ...]:
    """Read and fully decode one image: ``("ok", bytes, h, w, channels)`` or ``("skip", reason)``."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return ("skip", "missing file")
    except OSError as exc:
        return ("skip", f"unreadable ({exc.strerror or exc})")
    if not simplejpeg.is_jpeg(data):
        return ("skip", "not a JPEG (or truncated): pack stores JPEG bytes; convert the image first")
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        channels = 1 if colorspace == "Gray" else 3
        # strict: libjpeg's recoverable warnings (premature end, corrupt entropy data) are errors.
        simplejpeg.decode_jpeg(data, colorspace="GRAY" if channels == 1 else "RGB", strict=True)
    except ValueError as exc:
        return ("skip", f"corrupt JPEG ({exc})")
    if max_side is not None and max(height, width) > max_side:
        scale = max_side / max(height, width)
        size = (max(1, round(height * scale)), max(1, round(width * scale)))
        image = decode(data, size=size, channels=channels, shape=(height, width))
        data = simplejpeg.encode_jpeg(
            image,
            quality=quality,
            colorspace="GRAY" if channels == 1 else "RGB",
            colorsubsampling="Gray" if channels == 1 else "420",
        )
        height, width = size
    return ("ok", data, height, width, channels)


def _check_chunk(paths: list[str], max_side: int | None, quality: int) -> list[tuple[Any, ...]]:
    return [_check_image(p, max_side, quality) for p in paths]


class _Row(NamedTuple):
    line: int  # in the CSV file (the header is line 1)
    path: str  # relative to the image folder, as recorded
    file: str | None  # absolute path to read; None when the template matched no single file
    why: str  # why ``file`` is None
    labels: tuple[float, ...]
    group: str


def _checked(rows: Iterator[_Row], opts: PackOptions) -> Iterator[tuple[_Row, tuple[Any, ...]]]:
    """Each row with its image check, in CSV order; rows are read lazily, a few chunks ahead."""
    chunks = iter(lambda: list(itertools.islice(rows, _CHUNK)), [])

    def submit(pool: ProcessPoolExecutor | None, chunk: list[_Row]) -> Any:
        paths = [r.file for r in chunk if r.file is not None]
        if pool is None:
            return _check_chunk(paths, opts.max_side, opts.quality)
        return pool.submit(_check_chunk, paths, opts.max_side, opts.quality)

    def merge(chunk: list[_Row], results: list[tuple[Any, ...]]) -> Iterator[tuple[_Row, tuple[Any, ...]]]:
        it = iter(results)
        for row in chunk:
            yield row, (("skip", row.why) if row.file is None else next(it))

    if opts.workers == 1:
        for chunk in chunks:
            yield from merge(chunk, submit(None, chunk))
        return
    with ProcessPoolExecutor(opts.workers) as pool:
        pending: deque[tuple[list[_Row], Future[list[tuple[Any, ...]]]]] = deque()
        for chunk in chunks:
            pending.append((chunk, submit(pool, chunk)))
            # Bounded: results hold image bytes, and the writer may be slower than the readers.
            while len(pending) > 4 * opts.workers:
                done, future = pending.popleft()
                yield from merge(done, future.result())
        while pending:
            done, future = pending.popleft()
            yield from merge(done, future.result())


def _read_rows(
    reader: csv.DictReader, image_dir: Path, template: str, label_names: Sequence[str], group: str | None
) -> Iterator[_Row]:
    wildcard = any(c in _literal(template) for c in _GLOB_CHARS)
    folders = _Folders(image_dir)
    for row in reader:
        line = reader.line_num
        values = {k: (v or "") for k, v in row.items() if k is not None}
        rel, why = template.format(**values), ""
        found: str | None = rel
        if wildcard:
            pattern = template.format(**{k: glob.escape(v) for k, v in values.items()}).rpartition("/")[2]
            found, why = folders.match(rel.rpartition("/")[0], pattern)
            rel = found or rel
        labels = tuple(float(values[name]) for name in label_names)  # checked by _check_rows
        yield _Row(line, rel, None if found is None else str(image_dir / rel), why, labels, values[group] if group else "")


def _check_rows(csv_path: Path, label_names: Sequence[str], needed: Sequence[str]) -> int:
    """The CSV's row count, once every row has a number in each label column and a value in each
    column of the image path and group: one pass before any image is read, so a bad last row
    fails the pack at once rather than after every image before it was decoded."""
    with open(csv_path, newline="", encoding="utf-8-sig") as csv_file:
        reader = csv.DictReader(csv_file)
        num_rows = 0
        for row in reader:
            num_rows += 1
            short = [name for name in needed if row.get(name) is None]
            if short:
                raise ValueError(f"line {reader.line_num} of {csv_path} has fewer fields than its header: no value for "
                                 f"column(s) {short}. Fix the row")
            bad = next((name for name in label_names if not _is_number(row[name] or "")), None)
            if bad is not None:
                raise ValueError(
                    f"line {reader.line_num} of {csv_path}: label column {bad!r} holds {row[bad] or ''!r}, not a "
                    "number. Choose numeric label columns (labels=...), or fix the row"
                )
    return num_rows


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class _LocalOut:
    """Where a pack writes: a local directory. Each file is written atomically (temp + rename)."""

    def __init__(self, out_dir: Path) -> None:
        self.root = out_dir

    def check(self) -> None:
        _check_out_dir(self.root)

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def read_text(self, name: str) -> str | None:
        path = self.root / name
        return path.read_text() if path.is_file() else None

    def holds(self, name: str, num_bytes: int, digest: str) -> bool:
        # Named by content: a file of that name and size is this shard unless it rotted on disk.
        path = self.root / name
        return path.is_file() and path.stat().st_size == num_bytes and file_sha256(path) == digest

    def write(self, name: str, blob: bytes) -> None:
        atomic_write_bytes(self.root / name, blob)

    def write_text(self, name: str, text: str) -> None:
        atomic_write_text(self.root / name, text)

    def remove_shards_except(self, keep: set[str]) -> None:
        for stale in self.root.glob(f"shard-*{SHARD_SUFFIX}"):
            if stale.name not in keep:
                stale.unlink()


class _StorageOut:
    """Where a pack writes: object storage (``gs://bucket/shards``).

    An object store has no rename; each object is written whole, so a reader sees an object
    complete or not at all. The manifest is the commit: it is written after every shard it names,
    so a reader finds either the earlier pack whole (its shards are removed only after the new
    manifest is in place) or the new one whole, and a pack killed part way leaves the earlier
    manifest in force and the shards it wrote, which the next pack finds and keeps.
    """

    def __init__(self, url: str) -> None:
        self.root = url.rstrip("/")
        self.fs, self.path = storage.filesystem(self.root)

    def check(self) -> None:
        """The bucket exists and answers, before any image is read."""
        bucket = self.path.split("/", 1)[0]
        if not storage.retrying("looking up", self.root, lambda: self.fs.exists(bucket)):
            raise storage.StorageInputError(
                f"--out {self.root}: the bucket {bucket} does not exist (or is not visible to this machine's "
                "credentials). Create it first (gcloud storage buckets create gs://BUCKET), or fix the name")

    def prepare(self) -> None:
        pass  # objects need no directory

    def read_text(self, name: str) -> str | None:
        url = storage.join(self.root, name)
        return storage.read_bytes(url).decode() if storage.exists(url) else None

    def holds(self, name: str, num_bytes: int, digest: str) -> bool:
        # Named by the content's SHA-256 prefix and written whole: the name and size are the shard.
        url = storage.join(self.root, name)
        return storage.exists(url) and storage.size(url) == num_bytes

    def write(self, name: str, blob: bytes) -> None:
        storage.write_bytes(storage.join(self.root, name), blob)

    def write_text(self, name: str, text: str) -> None:
        storage.write_bytes(storage.join(self.root, name), text.encode())

    def remove_shards_except(self, keep: set[str]) -> None:
        names = storage.retrying("listing", self.root, lambda: self.fs.ls(self.path, detail=False)) \
            if storage.exists(self.root) else []
        for full in names:
            name = full.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("shard-") and name.endswith(SHARD_SUFFIX) and name not in keep:
                storage.retrying("removing", storage.join(self.root, name), lambda p=full: self.fs.rm_file(p))


class _ShardWriter:
    """Records into content-named shards of about ``shard_bytes`` in ``out``; the manifest last
    (the commit), then the shards of an earlier pack that it no longer names removed."""

    def __init__(self, out: _LocalOut | _StorageOut, label_names: Sequence[str], shard_bytes: int) -> None:
        self.out, self.label_names, self.shard_bytes = out, tuple(label_names), shard_bytes
        self.shards: list[dict[str, Any]] = []
        self._current: list[ShardRecord] = []
        self._current_bytes = 0
        self.written = 0  # shards written (the others were already there, unchanged)
        self.num_bytes = 0  # image bytes

    def add(self, record: ShardRecord) -> None:
        if self._current and self._current_bytes + len(record.data) > self.shard_bytes:
            self._flush()
        self._current.append(record)
        self._current_bytes += len(record.data)
        self.num_bytes += len(record.data)

    def _flush(self) -> None:
        blob = encode_shard(self._current, self.label_names)
        digest = hashlib.sha256(blob).hexdigest()
        name = f"shard-{len(self.shards):05d}-{digest[:12]}{SHARD_SUFFIX}"
        if not self.out.holds(name, len(blob), digest):
            self.out.write(name, blob)
            self.written += 1
        self.shards.append({"name": name, "num_records": len(self._current), "num_bytes": len(blob), "sha256": digest})
        self._current, self._current_bytes = [], 0

    def commit(self, before_shards: dict[str, Any], after_shards: dict[str, Any]) -> dict[str, Any]:
        if self._current:
            self._flush()
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "num_records": sum(s["num_records"] for s in self.shards),
            "num_image_bytes": self.num_bytes,
            "label_names": list(self.label_names),
            **before_shards,
            "shards": self.shards,
            **after_shards,
        }
        text = json.dumps(manifest, indent=1) + "\n"
        if self.out.read_text(MANIFEST_NAME) != text:
            self.out.write_text(MANIFEST_NAME, text)
        # Only after the new manifest is in place: shards of an earlier pack that it no longer names.
        self.out.remove_shards_except({s["name"] for s in self.shards})
        return manifest


def pack(
    csv_path: str | os.PathLike[str], image_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], **options: Any
) -> PackSummary:
    """Pack the images listed in ``csv_path`` (paths under ``image_dir``) into shards in ``out_dir``.

    Args:
        csv_path: one row per image.
        image_dir: the folder image paths are relative to.
        out_dir: the shard directory (created; an earlier pack of the same inputs there is updated
            in place, one of other inputs replaced only with ``replace=True``).
        **options: fields of :class:`PackOptions`.

    Returns:
        a :class:`PackSummary` (records, bytes, shards, skipped rows with reasons).

    Example:
        >>> pack("train.csv", "train/", "shards/",
        ...      path_columns=["StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID"], suffix=".jpg",
        ...      labels=["pe_present_on_image", "*_pe"], group="StudyInstanceUID", workers=4)
    """
    opts = PackOptions(**options)
    csv_path, image_dir = Path(csv_path), Path(image_dir)
    remote = storage.is_url(out_dir)
    out: _LocalOut | _StorageOut = _StorageOut(str(out_dir)) if remote else _LocalOut(Path(out_dir))
    if not csv_path.is_file():
        raise ValueError(f"CSV file {csv_path} does not exist: give --csv the CSV with one row per image")
    if not image_dir.is_dir():
        raise ValueError(
            f"image folder {image_dir} does not exist: give --images the folder the CSV's image paths are relative to"
        )
    out.check()
    template = opts.template

    def where(path: Path) -> str:
        # Paths relative to a local pack: the record stays true when the whole tree moves. A pack
        # on object storage records where it was packed from on this machine.
        return str(path.resolve()) if remote else os.path.relpath(path.resolve(), Path(out_dir).resolve())

    source = {
        "csv": where(csv_path), "csv_sha256": file_sha256(csv_path),
        "images": where(image_dir),
        "labels": list(opts.labels), "group": opts.group, "path_template": template, "max_side": opts.max_side,
        "quality": opts.quality if opts.max_side is not None else None, "shard_bytes": opts.shard_bytes,
    }
    if not opts.replace:
        _refuse_other_inputs(out, source)
    # utf-8-sig: spreadsheets write a byte-order mark before the header.
    with open(csv_path, newline="", encoding="utf-8-sig") as csv_file:
        reader = csv.DictReader(csv_file)
        columns = list(reader.fieldnames or [])
        needed = _template_fields(template) + ([opts.group] if opts.group else [])
        unknown = [c for c in needed if c not in columns]
        if unknown:
            raise ValueError(f"column(s) {unknown} are not in {csv_path}: its columns are {columns}")
        label_names = _resolve_labels(opts.labels, columns, set(needed))
        num_csv_rows = _check_rows(csv_path, label_names, needed)
        rows = _read_rows(reader, image_dir, template, label_names, opts.group)

        out.prepare()
        progress = _Progress(opts.progress, num_csv_rows, "pack")
        writer = _ShardWriter(out, label_names, opts.shard_bytes)
        skipped: list[SkippedRow] = []
        num_rows = 0
        for row, result in _checked(rows, opts):
            num_rows += 1
            if result[0] != "ok":
                skipped.append(SkippedRow(line=row.line, path=row.path, reason=result[1]))
            else:
                _, data, height, width, channels = result
                writer.add(
                    ShardRecord(data=data, labels=row.labels, group=row.group, path=row.path, height=height, width=width, channels=channels)
                )
            progress.update(num_rows, f"{writer.num_bytes / 2**20:,.1f} MB  {len(skipped)} skipped")
    progress.update(num_rows, f"{writer.num_bytes / 2**20:,.1f} MB  {len(skipped)} skipped", final=True)
    manifest = writer.commit(
        {"group_column": opts.group, "path_template": template, "max_side": opts.max_side,
         "quality": opts.quality if opts.max_side is not None else None, "shard_bytes": opts.shard_bytes},
        {"source": source,  # what it was packed from: a pack onto it from other inputs is refused
         "num_skipped": len(skipped), "skipped": [{"line": s.line, "path": s.path, "reason": s.reason} for s in skipped]},
    )
    return PackSummary(
        out_dir=out.root,
        num_rows=num_rows,
        num_records=manifest["num_records"],
        num_bytes=writer.num_bytes,
        num_shards=len(writer.shards),
        num_shards_written=writer.written,
        label_names=label_names,
        skipped=tuple(skipped),
    )


def pack_webdataset(
    source: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, shard_bytes: int = 128 << 20,
    replace: bool = False,
) -> PackSummary:
    """Convert WebDataset tar shards (a directory or object-storage prefix of ``*.tar``; see
    :mod:`xlatrain.data.webdataset`) into xlatrain shards in ``out_dir`` (local or ``gs://``).

    The records keep the tars' order, labels (``cls`` and numeric ``json`` fields) and groups;
    each tar is read once. A sample without a JPEG member is skipped and listed in the manifest.
    ``ShardDataset`` reads the tars in place too; a converted pack opens from its index alone and
    has checksums.
    """
    from types import SimpleNamespace

    from xlatrain.data import webdataset

    src: Path | str = str(source).rstrip("/") if storage.is_url(source) else Path(source)
    remote = storage.is_url(out_dir)
    out: _LocalOut | _StorageOut = _StorageOut(str(out_dir)) if remote else _LocalOut(Path(out_dir))
    out.check()
    tars = webdataset.list_tars(src)
    if not tars:
        raise ValueError(f"{source} holds no .tar files: give --webdataset the directory (or gs:// prefix) of the tar shards")
    described = {"webdataset": str(src), "tars": [[name, size] for name, size in tars], "shard_bytes": shard_bytes}
    if not replace:
        _refuse_other_inputs(out, described)
    ix = webdataset.open_tar_index(src, tars, SimpleNamespace(on_error="raise"))
    assert ix.paths is not None
    out.prepare()
    writer = _ShardWriter(out, ix.label_names, shard_bytes)
    skipped: list[SkippedRow] = []
    for s, (name, _) in enumerate(tars):
        blob = storage.read_bytes(storage.join(str(src), name)) if isinstance(src, str) else (src / name).read_bytes()
        for row in np.flatnonzero(ix.shard == s).tolist():
            if ix.length[row] < 0:
                skipped.append(SkippedRow(line=0, path=ix.paths[row], reason="the sample has no .jpg member"))
                continue
            start, length = int(ix.start[row]), int(ix.length[row])
            writer.add(ShardRecord(
                data=blob[start:start + length], labels=tuple(float(v) for v in ix.labels[row]),
                group=ix.group_names[int(ix.group_codes[row])], path=ix.paths[row], height=int(ix.height[row]),
                width=int(ix.width[row]), channels=int(ix.channels[row]),
            ))
    manifest = writer.commit(
        {"group_column": None, "path_template": None, "max_side": None, "quality": None, "shard_bytes": shard_bytes},
        {"source": described, "num_skipped": len(skipped),
         "skipped": [{"line": s.line, "path": s.path, "reason": s.reason} for s in skipped]},
    )
    return PackSummary(
        out_dir=out.root, num_rows=len(ix.length), num_records=manifest["num_records"], num_bytes=writer.num_bytes,
        num_shards=len(writer.shards), num_shards_written=writer.written, label_names=ix.label_names,
        skipped=tuple(skipped),
    )


def _check_out_dir(out_dir: Path) -> None:
    for parent in [out_dir, *out_dir.parents]:
        if parent.exists() and not parent.is_dir():
            what = f"--out {out_dir}" if parent == out_dir else f"{parent}, a parent of --out {out_dir},"
            raise ValueError(f"{what} is a file: give --out a directory (it is created if missing)")
        if parent.exists():
            return


def _refuse_other_inputs(out: _LocalOut | _StorageOut, source: dict[str, Any]) -> None:
    """An earlier pack in ``out`` is updated only when made from the same inputs."""
    text = out.read_text(MANIFEST_NAME)
    if text is None:
        return
    try:
        earlier = json.loads(text)
    except ValueError:
        earlier = {}
    before = earlier.get("source")
    what = f"{out.root} holds an earlier pack of {earlier.get('num_records', '?')} records"
    fix = "Pass --replace (pack(..., replace=True)) to replace it, or give --out another directory"
    if before is None:
        raise ValueError(f"{what} whose inputs are not recorded, so this pack may not be of the same data. {fix}")
    names = {"csv": "the CSV", "csv_sha256": "the CSV's content", "images": "the image folder",
             "labels": "--labels", "group": "--group", "path_template": "the image paths",
             "max_side": "--max-side", "quality": "--quality", "shard_bytes": "--shard-mb"}
    # The data's identity, not its layout: another shard size or re-encoding of the same records
    # updates the pack in place.
    layout = ("max_side", "quality", "shard_bytes")
    differs = [f"{names.get(k, k)}: {before.get(k)!r} -> {v!r}" if k != "csv_sha256" else f"{names[k]} changed"
               for k, v in source.items() if k not in layout and before.get(k) != v]
    if differs:
        raise ValueError(f"{what} made from other inputs ({'; '.join(differs)}); packing would replace it. {fix}")


# --------------------------------------------------------------------------------------------
# Verification


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """What :func:`verify` found; ``ok`` when ``problems`` is empty."""

    root: Path | str
    num_shards: int
    num_records: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self, max_listed: int = 50) -> str:
        head = f"{self.root}: {self.num_shards} shard(s), {self.num_records} records checked"
        if self.ok:
            return head + ": every checksum matches and every record decodes"
        lines = [head + f": {len(self.problems)} problem(s)"] + [f"  {p}" for p in self.problems[:max_listed]]
        if len(self.problems) > max_listed:
            lines.append(f"  ... and {len(self.problems) - max_listed} more")
        lines.append("Re-run `xlatrain pack` on the source data (or restore the shards) to repair them.")
        return "\n".join(lines)


def _verify_shard(root: str, entry: dict[str, Any]) -> tuple[int, list[str]]:
    remote = storage.is_url(root)
    path = storage.join(root, entry["name"]) if remote else Path(root) / entry["name"]
    try:
        index = read_shard_index(path, expected_bytes=int(entry["num_bytes"]))
        # The whole shard, once: hashed, then its records checked (a remote one is fetched once).
        blob = storage.read_bytes(str(path)) if remote else Path(path).read_bytes()
    except (ShardError, storage.StorageError) as exc:
        return 0, [str(exc)]
    problems = []
    digest = hashlib.sha256(blob).hexdigest()
    if digest != entry["sha256"]:
        problems.append(f"shard {entry['name']} fails its checksum (SHA-256 {digest[:16]}..., the manifest says {entry['sha256'][:16]}...)")
    if index.num_records != int(entry["num_records"]):
        problems.append(f"shard {entry['name']} holds {index.num_records} records, the manifest says {entry['num_records']}")
    for i in range(index.num_records):
        data = blob[int(index.starts[i]): int(index.starts[i + 1])]
        where = f"shard {entry['name']} record {i} (source {index.paths[i]})"
        if zlib.crc32(data) != int(index.crc32[i]):
            problems.append(f"{where}: CRC32 checksum mismatch")
            continue
        try:
            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
            simplejpeg.decode_jpeg(data, colorspace="GRAY" if index.channels[i] == 1 else "RGB", strict=True)
        except ValueError as exc:
            problems.append(f"{where}: cannot decode ({exc})")
            continue
        if (h, w) != (index.height[i], index.width[i]):
            problems.append(f"{where}: decodes to {h}x{w}, the index says {index.height[i]}x{index.width[i]}")
    return index.num_records, problems


def verify(root: str | os.PathLike[str], *, workers: int = 1, progress: bool = False) -> VerifyReport:
    """Re-check every shard's size and SHA-256 and every record's CRC32, and decode every record.

    Example:
        >>> report = verify("shards/")
        >>> print(report.describe()); assert report.ok
    """
    if workers < 1:
        raise ValueError(f"workers={workers!r} is not valid: use 1 or more processes")
    root = str(root).rstrip("/") if storage.is_url(root) else Path(root)
    manifest = read_manifest(root)
    entries = manifest["shards"]
    bar = _Progress(progress, len(entries), "verify (shards)")
    problems: list[str] = []
    num_records = 0
    if workers == 1:
        results: Iterator[tuple[int, list[str]]] = (_verify_shard(str(root), e) for e in entries)
        pool = None
    else:
        pool = ProcessPoolExecutor(workers)
        results = pool.map(_verify_shard, [str(root)] * len(entries), entries)
    try:
        for done, (count, found) in enumerate(results, start=1):
            num_records += count
            problems += found
            bar.update(done, f"{len(problems)} problem(s)")
    finally:
        if pool is not None:
            pool.shutdown()
    bar.update(len(entries), f"{len(problems)} problem(s)", final=True)
    if not problems and num_records != manifest["num_records"]:
        problems.append(f"the shards hold {num_records} records, the manifest says {manifest['num_records']}")
    return VerifyReport(root=root, num_shards=len(entries), num_records=num_records, problems=tuple(problems))
