"""Shards read from object storage: images/s through xlatrain's reader against its two limits.

A GCS API server runs on 127.0.0.1 (gcp-storage-emulator, through xlatrain.storage.emulator) and
holds a pack of a generated RSNA-shaped dataset; the same pack sits on local disk. Per round:

- ``reader``: ``ShardDataset("gs://...")`` training epochs, ``WORKERS`` worker processes, each
  fetching only its batches' records in ranged reads (``REQUESTS`` in flight) a batch ahead of
  its decode;
- ``fetch_limit``: the same records' bytes fetched with gcsfs alone (``cat_ranges``, the same
  ranges, concurrency and batches over the same number of processes), nothing decoded;
- ``decode_limit``: the same JPEG bytes decoded as the reader decodes them, by as many processes,
  nothing fetched;
- ``local``: the reader on the local copy of the pack;
- ``warm_cache``: the reader on ``gs://`` with a local shard cache (``cache_dir``) filled by the
  warm-up epoch: later epochs read the cached copies.

The target: reader >= 0.9 x min(fetch limit, decode limit) at the median and >= 0.85 in every
round; a warm-cache epoch >= 0.95 x the local reader's in every round. Sides run A B B A within a round, the order reversed every other round.

Where the time goes: each side's CPU seconds per image, of the whole machine (``/proc/stat``) and
of the server process alone, and the machine's busy share while the side ran. When fetching is
CPU work on the cores that also decode (the server and gcsfs's client on this machine; another
machine's work on Cloud Storage), fetch and decode cannot both run at their limits: the figure
``shared_cpu_limit`` = 1 / (1/fetch + 1/decode) is the rate of doing both one after the other on
the same cores, which a reader that overlaps them well reaches or passes.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.input_pipeline import BATCH, SIZE, DecodeLimit, OnDemand, _busy_seconds, _epoch
from xlatrain.data.pack import pack
from xlatrain.data.shards import ShardDataset, iter_records
from xlatrain.data.synthetic_rsna import LABEL_COLUMNS, PATH_COLUMNS, PATH_SUFFIX, generate
from xlatrain.storage.emulator import LocalGCS

NUM_STUDIES = 16  # about 1,200 slices
ROUNDS = 5
REQUESTS = 2  # the local server is serial with a listen queue of 5: 2 processes x 2 requests
BUCKET = "bench"


def _fetch_worker(url: str, tasks: list[tuple[list[str], list[int], list[int]]], requests: int, conn: Any) -> None:
    from xlatrain import storage

    fs = storage.filesystem(url)[0]
    while conn.recv() is not None:
        count = 0
        for paths, starts, ends in tasks:
            blobs = fs.cat_ranges(paths, starts, ends, batch_size=requests, on_error="raise")
            count += len(blobs)
        conn.send(count)


class FetchLimit(OnDemand):
    """``workers`` processes fetching their shares of an epoch's batches with gcsfs alone."""

    def __init__(self, url: str, batches: list[tuple[list[str], list[int], list[int]]], workers: int) -> None:
        # spawn: a fresh gcsfs client in each
        super().__init__(multiprocessing.get_context("spawn"), _fetch_worker,
                         [(url, batches[w::workers], REQUESTS) for w in range(workers)])


def _process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Accounted:
    """A side, with the CPU the machine and the server spent while it ran."""

    def __init__(self, side: Callable[[], tuple[int, float]], server_pid: int) -> None:
        self.side, self.server_pid = side, server_pid
        self.images = 0
        self.busy_s = self.server_s = self.wall_s = 0.0

    def __call__(self) -> tuple[int, float]:
        busy, server, started = _busy_seconds(), _process_cpu_seconds(self.server_pid), time.perf_counter()
        count, seconds = self.side()
        self.wall_s += time.perf_counter() - started
        self.busy_s += _busy_seconds() - busy
        self.server_s += _process_cpu_seconds(self.server_pid) - server
        self.images += count
        return count, seconds

    def figures(self) -> dict[str, float]:
        per_image = 1e6 / max(self.images, 1)
        return {"machine_cpu_us_per_image": round(self.busy_s * per_image, 1),
                "server_cpu_us_per_image": round(self.server_s * per_image, 1),
                "machine_busy_share": round(self.busy_s / (self.wall_s * (os.cpu_count() or 1)), 3)}


def run() -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="xlatrain-bench-") as tmp, LocalGCS(bucket=BUCKET) as gcs:
            return _measure(Path(tmp), gcs)
    finally:
        torch.set_num_threads(threads)


def _measure(tmp: Path, gcs: LocalGCS) -> dict[str, Any]:
    workers = len(os.sched_getaffinity(0))
    data = generate(tmp / "rsna", num_studies=NUM_STUDIES, workers=workers)
    options = {"path_columns": PATH_COLUMNS, "suffix": PATH_SUFFIX, "labels": list(LABEL_COLUMNS),
               "group": "StudyInstanceUID", "workers": workers, "progress": False}
    pack(data.csv_path, data.image_dir, tmp / "shards", **options)
    url = f"gs://{BUCKET}/shards"
    started = time.perf_counter()
    pack(data.csv_path, data.image_dir, url, **options)
    upload_s = time.perf_counter() - started

    reader = ShardDataset(url, image_size=SIZE, channels=1, num_workers=workers, remote_requests=REQUESTS)
    local = ShardDataset(tmp / "shards", image_size=SIZE, channels=1, num_workers=workers)
    cached = ShardDataset(url, image_size=SIZE, channels=1, num_workers=workers, cache_dir=str(tmp / "cache"))
    # The records of one epoch in the reader's order, batch by batch, as ranged reads.
    ix = reader._index
    order = reader.epoch_order(0, 1)
    steps = len(order) // BATCH
    paths = [f"{BUCKET}/shards/{name}" for name in ix.shard_names]
    batches = []
    for k in range(steps):
        gids = reader._ids[order[k * BATCH:(k + 1) * BATCH]]
        starts = ix.start[gids]
        batches.append(([paths[s] for s in ix.shard[gids]], starts.tolist(), (starts + ix.length[gids]).tolist()))
    encoded = [r.data for r in iter_records(tmp / "shards")]
    fetch = FetchLimit(url, batches, workers)
    decode = DecodeLimit(encoded, workers, {"colorspace": "GRAY", "min_height": SIZE, "min_width": SIZE, "min_factor": 2})
    epochs = iter(range(1, 10**6))

    def epoch_of(ds: ShardDataset) -> Callable[[], tuple[int, float]]:
        return lambda: _epoch(ds.train_batches(loader_batch=BATCH, num_processes=1, process_index=0, seed=0,
                                               epoch=next(epochs)))

    plain: dict[str, Callable[[], tuple[int, float]]] = {
        "reader": epoch_of(reader), "fetch_limit": fetch, "decode_limit": decode, "local": epoch_of(local),
        "warm_cache": epoch_of(cached)}
    for side in plain.values():
        side()  # warm-up: workers, connections, page cache
    sides = {name: _Accounted(side, gcs.pid) for name, side in plain.items()}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(ROUNDS):
        order_names = names if r % 2 == 0 else names[::-1]
        runs: dict[str, list[tuple[int, float]]] = {name: [] for name in sides}
        for name in order_names + order_names[::-1]:
            runs[name].append(sides[name]())
        for name, got in runs.items():
            rates[name].append(sum(c for c, _ in got) / sum(s for _, s in got))
    fetch.close()
    decode.close()
    for ds in (reader, local, cached):
        ds.close()

    def spread(values: list[float], digits: int = 3) -> dict[str, Any]:
        return {"min": round(min(values), digits), "median": round(statistics.median(values), digits),
                "max": round(max(values), digits), "rounds": [round(v, digits) for v in values]}

    bound = [min(f, d) for f, d in zip(rates["fetch_limit"], rates["decode_limit"])]
    shared = [1 / (1 / f + 1 / d) for f, d in zip(rates["fetch_limit"], rates["decode_limit"])]
    fraction = [a / b for a, b in zip(rates["reader"], bound)]
    warm = [a / b for a, b in zip(rates["warm_cache"], rates["local"])]
    binds = ["fetch" if f < d else "decode" for f, d in zip(rates["fetch_limit"], rates["decode_limit"])]
    return {
        "ratio": round(statistics.median(fraction), 3),
        "reader_over_binding_limit": spread(fraction),
        "binding_limit_per_round": binds,
        "reader_over_local": spread([a / b for a, b in zip(rates["reader"], rates["local"])]),
        "reader_over_shared_cpu_limit": spread([a / b for a, b in zip(rates["reader"], shared)]),
        "shared_cpu_limit_images_per_s_median": round(statistics.median(shared)),
        "cpu": {name: side.figures() for name, side in sides.items()},
        "warm_cache_over_local": spread(warm),
        "images_per_s_median": {name: round(statistics.median(v)) for name, v in rates.items()},
        "images_per_s": {name: spread(v, 0) for name, v in rates.items()},
        "num_images": len(encoded),
        "mean_jpeg_bytes": round(float(np.mean([len(e) for e in encoded]))),
        "shards": len(ix.shard_names),
        "upload_s": round(upload_s, 2),
        "processes": workers,
        "requests_in_flight_per_process": REQUESTS,
        "server": "gcp-storage-emulator on 127.0.0.1 (in memory, single-threaded, one request at a time), "
                  "sharing this machine's cores with every side",
        "rounds": ROUNDS,
        "target": "reader >= 0.9 x min(fetch limit, decode limit) at the median, >= 0.85 in every round; "
                  "warm-cache epoch >= 0.95 x local in every round",
        "target_met": {"reader": statistics.median(fraction) >= 0.9 and min(fraction) >= 0.85,
                       "warm_cache": min(warm) >= 0.95},
    }
