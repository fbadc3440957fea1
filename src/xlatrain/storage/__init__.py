"""Object storage where a local path goes: ``gs://`` (and any other fsspec URL) through fsspec.

A path with a scheme (``gs://bucket/shards``, ``s3://...``, ``memory://...``) is read through
fsspec's filesystem for that scheme (gcsfs for ``gs://``, installed with ``xlatrain[gcs]``); a plain
path stays on the local filesystem and never goes through here. Errors name the URL and what to
do; a read that fails for a reason that can pass (the server unreachable, a 5xx answer, a timeout)
is retried a bounded number of times, each retry logged, and then raised.

Credentials are the library's own: gcsfs finds Application Default Credentials, the TPU VM's
service account, or ``STORAGE_EMULATOR_HOST`` (a local GCS API server, as the tests use).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from xlatrain.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

# Waits between xlatrain's own retries of a read that failed transiently. The storage library
# retries first (gcsfs: up to 6 tries over about 35 s), so with gcsfs an outage of up to about
# 3 minutes is ridden out: 4 attempts of about 35 s, 1 + 4 + 16 s apart.
RETRY_WAITS_S = (1.0, 4.0, 16.0)


class StorageError(OSError):
    """A read or write on object storage that failed for good: the message names the URL and the fix."""


class StorageInputError(StorageError):
    """A storage failure that only a change of input mends: a bucket or object that does not exist,
    credentials without access, a scheme whose package is not installed. The command line exits 2
    for it (input to change), where an outage that outlasted the retries exits 1."""


def is_url(path: Any) -> bool:
    """Whether ``path`` names object storage (a scheme other than ``file://``)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


class _SaidRetries:
    """Stands in for gcsfs's retry logger (``gcsfs.retry.logger``). gcsfs retries a failed request
    itself (up to 6 tries with backoff, about 35 s in all) and says so only at debug level; this
    says each retry as a warning of xlatrain's, at most every ``EVERY_S`` (requests fail together
    when a server goes away), and hands every call on to gcsfs's logger unchanged. No logging
    level is changed anywhere."""

    EVERY_S = 10.0

    def __init__(self, original: logging.Logger) -> None:
        self._original = original
        self._said = -math.inf

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        if "retrying after exception" in str(msg) and time.monotonic() - self._said >= self.EVERY_S:
            self._said = time.monotonic()
            log.warning(f"object storage: a request failed and gcsfs retries it (up to 6 tries, about 35 s in all; "
                        f"said at most every {self.EVERY_S:g} s): {msg}")
        self._original.debug(msg, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


_reporting = threading.Lock()


def _report_library_retries(scheme: str) -> None:
    if scheme not in ("gs", "gcs"):
        return
    try:
        import gcsfs.retry
    except ImportError:
        return
    with _reporting:
        if isinstance(getattr(gcsfs.retry, "logger", None), logging.Logger):
            gcsfs.retry.logger = _SaidRetries(gcsfs.retry.logger)


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path within it)`` for ``url``, with the install hint when the scheme's
    package is missing."""
    import fsspec

    try:
        found = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        scheme = url.split("://", 1)[0]
        package = {"gs": "gcsfs (pip install 'xlatrain[gcs]')", "gcs": "gcsfs (pip install 'xlatrain[gcs]')",
                   "s3": "s3fs", "az": "adlfs", "abfs": "adlfs"}.get(scheme, f"the fsspec package for {scheme}://")
        raise StorageInputError(f"{url}: reading {scheme}:// needs {package}; it is not installed ({exc})") from None
    except ValueError as exc:
        raise StorageInputError(f"{url} is not a storage URL fsspec knows ({exc})") from None
    scheme = url.split("://", 1)[0]
    _report_library_retries(scheme)  # after the library's modules (and loggers) exist
    if scheme in ("gs", "gcs"):
        _resolvable(_gcs_endpoint(), url)
    return found


def _gcs_endpoint() -> str:
    """The host a gs:// request goes to: the emulator's (``STORAGE_EMULATOR_HOST``) or Google's."""
    from urllib.parse import urlparse

    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        return urlparse(emulator if "://" in emulator else f"http://{emulator}").hostname or emulator
    return "storage.googleapis.com"


@functools.lru_cache(maxsize=8)
def _resolved(host: str) -> str | None:
    """None where ``host`` resolves, else the resolver's answer (asked once per process)."""
    import socket

    try:
        socket.getaddrinfo(host, 443)
    except OSError as exc:
        return str(exc)
    return None


def _resolvable(host: str, url: str) -> None:
    """Refuse at once a URL whose server cannot be found: the storage library would retry it for
    minutes. Both likely causes are named, the credentials' state with them."""
    failure = _resolved(host)
    if failure is None:
        return
    creds = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    adc = Path.home() / ".config" / "gcloud" / "application_default_credentials.json"
    if creds:
        have = f"credentials from GOOGLE_APPLICATION_CREDENTIALS={creds}"
    elif adc.is_file():
        have = f"gcloud's application-default credentials ({adc})"
    else:
        have = ("no credentials file either (GOOGLE_APPLICATION_CREDENTIALS unset, no gcloud application-default "
                "credentials): on a Cloud VM its service account serves instead; elsewhere run gcloud auth "
                "application-default login")
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    raise StorageError(
        f"{url}: the storage server {host} cannot be found ({failure}): no network or no DNS on this machine"
        + (f", or a wrong STORAGE_EMULATOR_HOST={emulator}" if emulator else "")
        + f". This machine has {have}. Nothing was read or written; run the command again once {host} resolves"
    )


def _status(exc: BaseException) -> int | None:
    code = getattr(exc, "code", None) or getattr(exc, "status", None)
    return code if isinstance(code, int) else None


def transient(exc: BaseException) -> bool:
    """Whether a failure can pass by itself: the server unreachable or overloaded, a timeout."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    status = _status(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    return isinstance(exc, (OSError, TimeoutError, ConnectionError)) or type(exc).__name__ in (
        "ClientError", "ServerDisconnectedError", "ClientPayloadError", "ServerTimeoutError")


def explain(url: str, exc: BaseException, doing: str, retries: int = 0) -> StorageError:
    """A :class:`StorageError` that names the URL, what failed and the fix."""
    status = _status(exc)
    kind = StorageInputError  # the names or the access must change
    if isinstance(exc, FileNotFoundError) or status == 404:
        fix = "check the bucket and object names (and that the bucket exists)"
        what = "does not exist"
    elif isinstance(exc, PermissionError) or status in (401, 403):
        fix = ("give this machine's credentials read (and for writes, create) access to the bucket, e.g. the "
               "Storage Object User role for the TPU VM's service account, or run gcloud auth application-default login")
        what = "is not accessible with this machine's credentials"
    elif transient(exc):
        kind = StorageError
        fix = ("check the network and the storage service, then run the same command again (a run continues "
               "from its last complete checkpoint)")
        what = f"could not be reached after {retries} retries"
    else:
        kind = StorageError
        fix = "see the cause above"
        what = "failed"
    return kind(f"{doing} {url}: it {what} ({type(exc).__name__}: {exc}). Fix: {fix}")


def retrying(doing: str, url: str, fn: Callable[[], T], waits: Sequence[float] | None = None) -> T:
    """``fn()``, retried after each wait in ``waits`` (default :data:`RETRY_WAITS_S`) while it
    fails transiently, each retry logged; a permanent failure, or the last transient one, raises
    :func:`explain`'s error."""
    waits = RETRY_WAITS_S if waits is None else waits
    for attempt in range(len(waits) + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below; nothing is swallowed
            if isinstance(exc, StorageError):
                raise
            if not transient(exc) or attempt == len(waits):
                raise explain(url, exc, doing, retries=len(waits)) from exc
            log.warning(f"{doing} {url} failed ({type(exc).__name__}: {exc}); retry {attempt + 1} of {len(waits)} "
                        f"in {waits[attempt]:g} s")
            time.sleep(waits[attempt])
    raise AssertionError("unreachable")


def read_bytes(url: str, start: int | None = None, end: int | None = None) -> bytes:
    fs, path = filesystem(url)
    return retrying("reading", url, lambda: fs.cat_file(path, start=start, end=end))


def size(url: str) -> int:
    fs, path = filesystem(url)
    return int(retrying("looking up", url, lambda: fs.info(path))["size"])


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return bool(retrying("looking up", url, lambda: fs.exists(path)))


def upload(local: str | os.PathLike[str], url: str) -> None:
    """Copy one local file to ``url`` (an object store writes an object whole: a reader sees the
    old object or the new one, never a part)."""
    fs, path = filesystem(url)
    retrying("writing", url, lambda: fs.put_file(os.fspath(local), path))


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to the local file ``path`` and fsync it (no rename: the caller makes the
    directory that holds it visible atomically)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_bytes(url: str, data: bytes) -> None:
    fs, path = filesystem(url)
    retrying("writing", url, lambda: fs.pipe_file(path, data))
