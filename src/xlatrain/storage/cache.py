"""A local cache of whole shards fetched from object storage (``ShardOptions.cache_dir``)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path

from xlatrain import storage


class ShardCache:
    """Whole shards from object storage, kept in a local directory up to ``limit`` bytes.

    A shard is fetched whole the first time a process needs one of its records (so with the
    cache on, a process fetches whole shards, not only its records), written to a temporary file
    and renamed into place: processes that share the directory never see a part of a file, and
    two that fetch the same shard at once both rename a complete copy. Files are named by the
    pack's URL and the shard's name, which holds its SHA-256 prefix: a re-packed dataset never
    reads an old copy. When the directory holds more than ``limit`` bytes, the files used least
    recently (their modification time, renewed on each use) are removed; a process that has one
    open keeps reading it (the file goes when it is closed), and one that needs it again fetches it.
    A file used in the last ``IN_USE_S`` seconds is not removed (another process may be about to
    open it), so the directory can hold more than ``limit`` for that long. What is read, and in
    which order, does not depend on what is cached.
    """

    IN_USE_S = 30.0

    def __init__(self, root: str, directory: str, limit: int) -> None:
        self.root = root
        self.dir = Path(directory).expanduser() / hashlib.sha256(root.encode()).hexdigest()[:16]
        self.limit = limit

    def path(self, name: str, num_bytes: int) -> str:
        target = self.dir / name
        try:
            if target.stat().st_size == num_bytes:
                os.utime(target)  # used now: the last to be evicted
                return str(target)
        except FileNotFoundError:
            pass
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{name}.{os.getpid()}.part"
        try:
            url = storage.join(self.root, name)
            fs, object_path = storage.filesystem(url)
            storage.retrying("fetching into the cache", url, lambda: fs.get_file(object_path, str(tmp)))
            if tmp.stat().st_size != num_bytes:
                raise storage.StorageError(f"{url} has {tmp.stat().st_size} bytes, the manifest says {num_bytes}: "
                                           "the object was replaced or cut short. Re-run `xlatrain pack`")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        self._evict(keep=target)
        return str(target)

    def _evict(self, keep: Path) -> None:
        entries = []
        for entry in os.scandir(self.dir.parent):
            if entry.is_dir():
                for f in os.scandir(entry.path):
                    if f.is_file() and not f.name.startswith("."):
                        info = f.stat()
                        entries.append((info.st_mtime_ns, info.st_size, f.path))
        total = sum(size for _, size, _ in entries)
        recent = time.time_ns() - int(self.IN_USE_S * 1e9)
        for used, size, path in sorted(entries):
            if total <= self.limit or used >= recent:
                break  # oldest first: the rest were used more recently still
            if path != str(keep):
                with contextlib.suppress(FileNotFoundError):  # another process removed it first
                    os.unlink(path)
                total -= size
