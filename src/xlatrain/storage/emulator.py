"""A GCS API server on this machine, for rehearsing ``gs://`` runs without a cloud project.

:class:`LocalGCS` starts ``gcp-storage-emulator`` (``pip install gcp-storage-emulator``) on
127.0.0.1 in a child process and points gcsfs at it (``STORAGE_EMULATOR_HOST``), so that
``gs://BUCKET/...`` paths in xlatrain, and in any process started from this one, go to it. The
tests and the ``object_store`` benchmark use it; nothing leaves the machine.

    with LocalGCS(bucket="data") as gcs:
        pack("train.csv", "images/", "gs://data/shards")
        ds = ShardDataset("gs://data/shards", remote_requests=4)

The server is single-threaded with a short listen queue: keep ``remote_requests`` at 4 against it
(more requests in flight get connections refused and retried by the client, a second each).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# gcsfs reads this once, when it is imported: its experimental zonal-bucket support probes every
# new bucket over gRPC, which the emulator cannot answer (a 60 s wait per bucket).
ENV_AT_IMPORT = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forget_clients() -> None:
    """gcsfs keeps one client per set of arguments, bound to the server address it found when
    made: drop them, so the next one goes to the server now in the environment."""
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None:
        gcsfs.GCSFileSystem.clear_instance_cache()


class LocalGCS:
    """A local GCS API server holding ``bucket``.

    Args:
        bucket: created when the server starts.
        data_dir: where the server keeps objects (they survive a ``stop()`` and ``start()``); ``None`` keeps
            them in memory (lost when it stops).
        port: default a free port.
    """

    def __init__(self, bucket: str = "xlatrain", *, data_dir: str | os.PathLike[str] | None = None, port: int | None = None) -> None:
        self.bucket = bucket
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._saved: dict[str, str | None] = {}

    @property
    def pid(self) -> int:
        """The server process (while it runs)."""
        assert self._proc is not None, "the server is not running"
        return self._proc.pid

    @property
    def env(self) -> dict[str, str]:
        """What a process needs in its environment to reach this server through gcsfs."""
        return {"STORAGE_EMULATOR_HOST": self.url, **ENV_AT_IMPORT}

    def start(self) -> LocalGCS:
        args = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(self.port),
                "--default-bucket", self.bucket, "--quiet"]
        if self.data_dir is None:
            args.append("--in-memory")
        else:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(args, cwd=self.data_dir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the local GCS server exited at start (code {self._proc.returncode}): is "
                                   f"gcp-storage-emulator installed, and port {self.port} free?")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the local GCS server did not listen on port {self.port} within 30 s") from None
                time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> LocalGCS:
        """Start, and point this process at the server (import gcsfs only after: see ENV_AT_IMPORT)."""
        for key, value in self.env.items():
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value
        _forget_clients()
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        _forget_clients()
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
