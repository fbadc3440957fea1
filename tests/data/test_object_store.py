"""Shards on object storage, against a real GCS API server on 127.0.0.1 (gcp-storage-emulator).

Nothing here mocks the storage client: gcsfs talks HTTP to a local server that stores the objects.
"""

import functools
import json
import logging
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import image_folder
from torch import nn

from xlatrain import TrainConfig, Trainer, storage
from xlatrain.data import shards as shards_module
from xlatrain.data.pack import pack
from xlatrain.data.shards import NormalizeInput, ShardDataset, ShardError, iter_records
from xlatrain.storage.cache import ShardCache
from xlatrain.storage.emulator import LocalGCS

pytestmark = pytest.mark.object_store

NUM, SIZE, BUCKET = 90, 16, "xlt"
REQUESTS = 4  # the local server serves a few connections at once (see xlatrain.storage.emulator)


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    # Objects on disk, so a restarted server still has them.
    with LocalGCS(bucket=BUCKET, data_dir=tmp_path_factory.mktemp("gcs")) as server:
        yield server


def _pack(csv, images, out):
    return pack(csv, images, out, path_columns=["path"], labels=["rid", "cls"], group="grp", shard_bytes=2500,
                progress=False)


@pytest.fixture(scope="module")
def packed(gcs, tmp_path_factory):
    csv, images = image_folder(tmp_path_factory.mktemp("src"), NUM, SIZE)
    local = _pack(csv, images, csv.parent / "s")
    remote = _pack(csv, images, f"gs://{BUCKET}/shards")
    assert remote.num_records == local.num_records == NUM and remote.num_shards == local.num_shards > 5
    return csv.parent / "s", f"gs://{BUCKET}/shards", (csv, images)


def _fetched(monkeypatch):
    """The records each fetch from storage asked for (the real fetch runs; this only listens)."""
    seen = []
    real = shards_module._RemoteRecords._fetch

    def listen(self, gids, index):
        seen.append(gids.tolist())
        return real(self, gids, index)

    monkeypatch.setattr(shards_module._RemoteRecords, "_fetch", listen)
    return seen


def _batches(ds, processes=2, epoch=1, start_step=0):
    return [[(x.clone(), y.clone()) for x, y in ds.train_batches(loader_batch=8, num_processes=processes, process_index=p,
                                                               seed=3, epoch=epoch, start_step=start_step)]
            for p in range(processes)]


def _same(a, b):
    assert len(a) == len(b)
    for part_a, part_b in zip(a, b):
        assert len(part_a) == len(part_b)
        for (xa, ya), (xb, yb) in zip(part_a, part_b):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("workers", [0, 2])
def test_shards_on_object_storage_read_exactly_as_the_local_pack(packed, workers):
    local, url, _ = packed
    remote = ShardDataset(url, channels=1, num_workers=workers, remote_requests=REQUESTS)
    near = ShardDataset(local, channels=1)
    assert len(remote) == len(near) == NUM and remote.label_names == near.label_names
    _same(_batches(remote), _batches(near))
    evaluated = [list(ds.eval_batches(loader_batch=8, num_processes=1, process_index=0)) for ds in (remote, near)]
    for ((xa, ya), va), ((xb, yb), vb) in zip(*evaluated):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and torch.equal(va, vb)
    assert [r.data for r in iter_records(url)] == [r.data for r in iter_records(local)]
    remote.close()


def test_each_process_fetches_only_its_records_and_a_resume_fetches_none_it_skips(packed, monkeypatch):
    _, url, _ = packed
    seen = _fetched(monkeypatch)
    ds = ShardDataset(url, channels=1, remote_requests=REQUESTS, num_workers=0)  # fetched here, where the test listens
    per_process = []
    for p in range(2):
        seen.clear()
        got = [y[:, 0].long().tolist() for _, y in ds.train_batches(loader_batch=8, num_processes=2, process_index=p,
                                                                      seed=3, epoch=1)]
        fetched = sorted(g for batch in seen for g in batch)
        assert fetched == sorted(r for batch in got for r in batch)  # what it fetched is what it trained on
        per_process.append(set(fetched))
    assert not per_process[0] & per_process[1]
    # 90 records, global batch 16: 5 steps use 80 of them, each in exactly one process.
    assert len(per_process[0] | per_process[1]) == 80
    # Resumed at step 3 of 5: the records of steps 1-3 are not fetched again.
    seen.clear()
    rest = [y[:, 0].long().tolist() for _, y in ds.train_batches(loader_batch=8, num_processes=2, process_index=0,
                                                                   seed=3, epoch=1, start_step=3)]
    assert len(rest) == 2 and sorted(g for batch in seen for g in batch) == sorted(r for b in rest for r in b)


def test_training_from_object_storage_matches_training_from_the_local_pack(packed, tmp_path):
    local, url, _ = packed

    def fit(root, name):
        torch.manual_seed(0)
        model = nn.Sequential(NormalizeInput(mean=[0.5], std=[0.25]), nn.Flatten(), nn.Linear(SIZE * SIZE, 3))
        ds = ShardDataset(root, channels=1, labels=["cls"], target="long", remote_requests=REQUESTS)
        trainer = Trainer(model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.01),
                          config=TrainConfig(epochs=2, batch_size=8, run_dir=str(tmp_path / name), diagnostics=False),
                          backend="cpu")
        return trainer.fit(ds)

    remote, near = fit(url, "remote"), fit(local, "local")
    assert [r["train_loss"] for r in remote] == [r["train_loss"] for r in near]


def test_packing_again_onto_object_storage_writes_nothing_new_and_other_inputs_are_refused(packed, tmp_path):
    _, url, (csv, images) = packed
    again = _pack(csv, images, url)
    assert again.num_shards_written == 0 and again.num_records == NUM
    other_csv = tmp_path / "other.csv"
    other_csv.write_text(csv.read_text().replace("g0\n", "g99\n", 1))
    with pytest.raises(ValueError, match=f"{url} holds an earlier pack of {NUM} records"):
        _pack(other_csv, images, url)


def test_a_missing_bucket_is_named_before_any_work(packed, tmp_path, capsys):
    from xlatrain import cli

    _, _, (csv, images) = packed
    with pytest.raises(storage.StorageError, match="the bucket no-such-bucket does not exist"):
        _pack(csv, images, "gs://no-such-bucket/shards")
    # From the command line: a name to change, so exit 2 (input), not 1 (a run that failed).
    code = cli.main(["pack", "--csv", str(csv), "--images", str(images), "--path-column", "path", "--labels", "rid",
                     "--out", "gs://no-such-bucket/shards", "--quiet"])
    assert code == 2 and "the bucket no-such-bucket does not exist" in capsys.readouterr().err
    assert isinstance(storage.explain("gs://b/x", FileNotFoundError("x"), "reading"), storage.StorageInputError)
    assert not isinstance(storage.explain("gs://b/x", ConnectionRefusedError(), "reading"), storage.StorageInputError)
    with pytest.raises(ValueError, match="gs://no-such-bucket/shards/manifest.json does not exist"):
        ShardDataset("gs://no-such-bucket/shards")


def _copy(url, to):
    fs, path = storage.filesystem(url)
    _, target = storage.filesystem(to)
    for name in fs.ls(path, detail=False):
        fs.copy(name, f"{target}/{name.rsplit('/', 1)[-1]}")
    manifest = json.loads(storage.read_bytes(f"{to}/manifest.json"))
    return fs, target, manifest["shards"]


def test_a_missing_or_truncated_object_is_an_error_naming_the_shard_or_left_out_when_asked(packed):
    _, url, _ = packed
    fs, target, entries = _copy(url, f"gs://{BUCKET}/damaged")
    fs.rm_file(f"{target}/{entries[1]['name']}")
    blob = fs.cat_file(f"{target}/{entries[2]['name']}")
    fs.pipe_file(f"{target}/{entries[2]['name']}", blob[: len(blob) // 2])
    with pytest.raises(ShardError, match=f"shard {entries[1]['name']} is missing"):
        ShardDataset(f"gs://{BUCKET}/damaged")
    ds = ShardDataset(f"gs://{BUCKET}/damaged", on_error="skip", channels=1, remote_requests=REQUESTS)
    left_out = entries[1]["num_records"] + entries[2]["num_records"]
    assert len(ds) == NUM - left_out
    assert any("truncated" in reason for _, _, reason in ds._index.dropped)
    from xlatrain.data.pack import verify

    assert verify(url).ok
    report = verify(f"gs://{BUCKET}/damaged", workers=2)
    assert not report.ok and len(report.problems) == 2
    assert f"shard {entries[1]['name']} is missing" in report.problems[0] and "truncated" in report.problems[1]


def test_a_storage_server_that_goes_away_mid_epoch_and_comes_back_is_retried_and_reported(packed, gcs, caplog,
                                                                                            monkeypatch):
    local, url, _ = packed
    caplog.set_level(logging.WARNING, logger="xlatrain")
    # The retry warning is said at most every 10 s per process. A retry of a refused connection
    # in an earlier test (the local server's listen queue is short; a loaded machine overflows it)
    # would otherwise hold back this outage's warning: every retry is said here.
    monkeypatch.setattr(storage._SaidRetries, "EVERY_S", 0.0)
    # Fetched in this process (num_workers=0), whose log the test reads.
    ds = ShardDataset(url, channels=1, remote_requests=REQUESTS, prefetch_batches=1, num_workers=0)
    batches = ds.train_batches(loader_batch=8, num_processes=1, process_index=0, seed=5, epoch=2)
    got = [tuple(t.clone() for t in next(batches)) for _ in range(2)]
    gcs.stop()
    back = threading.Timer(2.0, gcs.start)
    back.start()
    try:
        got += [(x.clone(), y.clone()) for x, y in batches]
    finally:
        back.join()
    expected = ShardDataset(local, channels=1).train_batches(loader_batch=8, num_processes=1, process_index=0,
                                                             seed=5, epoch=2)
    _same([got], [list(expected)])
    assert "object storage: a request failed and gcsfs retries it" in caplog.text


def test_a_server_that_stays_away_fails_with_the_url_and_the_fix_after_bounded_retries(packed, gcs, monkeypatch):
    import asyncio
    import types

    import gcsfs.retry

    _, url, _ = packed
    # Only the storage library's own retries (gcsfs: 6 tries, about 35 s), none of xlatrain's on top.
    monkeypatch.setattr(storage, "RETRY_WAITS_S", ())
    # gcsfs's waits between its tries are counted as if slept, not slept: the test keeps its bound
    # on the time a user waits without spending those 35 s.
    waits = []

    async def backoff(seconds):
        waits.append(seconds)
        await asyncio.sleep(0)

    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=backoff))
    gcs.stop()
    try:
        started = time.monotonic()
        with pytest.raises(storage.StorageError, match=f"reading {url}/manifest.json: it could not be reached after 0 "
                                                       "retries.*Fix: check the network"):
            ShardDataset(url)
        assert waits, "gcsfs did not retry: the test no longer reaches its retries"
        assert time.monotonic() - started + sum(waits) < 90, waits
    finally:
        gcs.start()


def test_a_local_cache_serves_later_epochs_without_the_server_and_stays_within_its_limit(packed, gcs, tmp_path,
                                                                                        monkeypatch):
    local, url, _ = packed
    near = _batches(ShardDataset(local, channels=1))
    cache = tmp_path / "cache"
    # Two readers with two workers each fill one cache at once: every file is whole.
    readers = [ShardDataset(url, channels=1, num_workers=2, cache_dir=str(cache)) for _ in range(2)]
    results = [None, None]

    def read(k):
        results[k] = _batches(readers[k])

    threads = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        _same(got, near)
    for ds in readers:
        ds.close()
    files = [f for f in cache.rglob("*") if f.is_file()]
    entries = json.loads(storage.read_bytes(f"{url}/manifest.json"))["shards"]
    assert sorted(f.name for f in files) == sorted(e["name"] for e in entries)
    # A new reader opens (manifest and indexes from the server), then reads with the server gone.
    again = ShardDataset(url, channels=1, cache_dir=str(cache))
    gcs.stop()
    try:
        _same(_batches(again), near)
    finally:
        gcs.start()
    # A cache smaller than the pack keeps to its limit and reads the same records (no grace for
    # files in use here: this one process reads them all within seconds).
    monkeypatch.setattr(ShardCache, "IN_USE_S", 0.0)
    limit = 2 * max(e["num_bytes"] for e in entries)
    small = ShardDataset(url, channels=1, cache_dir=str(tmp_path / "small"), cache_bytes=limit)
    _same(_batches(small), near)
    assert sum(f.stat().st_size for f in (tmp_path / "small").rglob("*") if f.is_file()) <= limit


def test_denied_access_is_told_with_the_role_to_grant():
    err = storage.explain("gs://b/shards/manifest.json", PermissionError("403 Forbidden"), "reading")
    assert "is not accessible with this machine's credentials" in str(err) and "Storage Object User" in str(err)
    assert not storage.transient(PermissionError()) and not storage.transient(FileNotFoundError())
    assert storage.transient(ConnectionRefusedError())


@pytest.mark.multiprocess
def test_two_processes_under_torchrun_fetch_disjoint_records_whose_union_is_the_epoch(packed, gcs, tmp_path):
    from conftest import SCRIPTS, run_command

    _, url, _ = packed
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    proc = run_command([torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
                        str(SCRIPTS / "object_store_fit.py"), url, str(tmp_path / "run")], env=gcs.env, timeout=300)
    reads = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("FETCHED ")]
    assert len(reads) == 2
    first, second = (set(r["epoch1"]) for r in sorted(reads, key=lambda r: r["rank"]))
    assert not first & second and len(first | second) == 80  # 5 steps x global batch 16 of 90 records
    assert all(r["history"] == reads[0]["history"] for r in reads)


def test_the_pe_recipe_packs_to_and_trains_from_object_storage_from_the_command_line(gcs, tmp_path):
    from conftest import run_command

    configs = Path(__file__).parents[2] / "configs"
    url = f"gs://{BUCKET}/pe-shards"
    args = [sys.executable, "-m", "xlatrain.cli", "fit", str(configs / "pe_detection.yaml")]
    for item in ["data.num_studies=6", "data.slices_per_study=[4,5]", "data.stored_size=48", "data.image_size=32",
                 "data.num_folds=2", "data.pack_workers=1", "model.name=small_cnn", "model.width=8", "trainer.batch_size=8",
                 "trainer.epochs=1", "backend.accelerator=cpu", f"trainer.run_dir={url}-run",
                 f"data.root={tmp_path / 'data'}", f"data.shards={url}", f"data.cache_dir={tmp_path / 'cache'}"]:
        args += ["--set", item]
    out = run_command(args, env={**gcs.env, "XLATRAIN_CACHE_DIR": str(tmp_path / "xc")}, timeout=600).stdout
    assert storage.exists(f"{url}/manifest.json")
    assert not (tmp_path / "data" / "shards").exists()  # packed straight to the bucket
    assert any((tmp_path / "cache").rglob("*.xshard"))  # and read through the cache
    # The run's files went to the bucket too: history, config, checkpoint.
    history = json.loads(storage.read_bytes(f"{url}-run/history.json"))
    assert len(history) == 1 and history[0]["val_weighted_log_loss"] == history[0]["val_weighted_log_loss"]
    assert storage.exists(f"{url}-run/config.yaml") and f"history: {url}-run/history.csv" in out


# --- WebDataset tar shards, read in place -----------------------------------------------------

def _write_tars(images, out, per_tar=30):
    import io
    import tarfile

    out.mkdir(parents=True, exist_ok=True)
    for t in range(0, NUM, per_tar):
        with tarfile.open(out / f"train-{t // per_tar:04d}.tar", "w") as tar:
            for i in range(t, min(t + per_tar, NUM)):
                members = {f"s{i:05d}.jpg": (images / f"{i}.jpg").read_bytes(), f"s{i:05d}.cls": str(i % 3).encode(),
                           f"s{i:05d}.json": json.dumps({"rid": i, "group": f"g{i // 4}"}).encode()}
                for name, data in members.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return out


@pytest.mark.parametrize("where", ["local", "gs"])
def test_webdataset_tars_read_in_place_as_the_packed_records(packed, tmp_path, where):
    local, _, (_, images) = packed
    tars = _write_tars(images, tmp_path / "wds")
    root = str(tars)
    if where == "gs":
        root = f"gs://{BUCKET}/wds-{tmp_path.name}"
        fs, path = storage.filesystem(root)
        for f in sorted(tars.iterdir()):
            fs.put_file(str(f), f"{path}/{f.name}")
    options = {"channels": 1, "labels": ["rid", "cls"], "shuffle": False, "remote_requests": REQUESTS}
    wds, near = ShardDataset(root, **options), ShardDataset(local, **options)
    assert len(wds) == NUM and wds.label_names == ("rid", "cls")
    _same(_batches(wds), _batches(near))
    # Groups come from the json's "group": four records each, as packed.
    assert len(set(wds.groups.tolist())) == len(set(near.groups.tolist())) == (NUM + 3) // 4
    shuffled = ShardDataset(root, channels=1, labels=["rid"], num_workers=2, remote_requests=REQUESTS)
    seen = sorted(int(r) for part in _batches(shuffled) for _, y in part for r in y[:, 0].tolist())
    assert len(seen) == len(set(seen)) == 80  # 5 steps x 16 of 90, each once
    shuffled.close()


def test_a_tar_sample_without_an_image_or_a_cut_short_tar_is_told(packed, tmp_path):
    _, _, (_, images) = packed
    tars = _write_tars(images, tmp_path / "wds")
    broken = tars / "train-0001.tar"
    broken.write_bytes(broken.read_bytes()[:5000])
    with pytest.raises(ShardError, match="shard train-0001.tar is not a readable tar"):
        ShardDataset(tars)
    ds = ShardDataset(tars, on_error="skip", channels=1)
    assert len(ds) == NUM - 30
    # Cut where a member ends: every header reads, the end-of-archive blocks are missing.
    import tarfile

    with tarfile.open(tars / "train-0002.tar") as tar:
        end = tar.getmembers()[5].offset_data + 512
    cut = tars / "train-0002.tar"
    cut.write_bytes(cut.read_bytes()[:end])
    broken.unlink()
    with pytest.raises(ShardError, match="shard train-0002.tar is cut short"):
        ShardDataset(tars)


def test_xlatrain_pack_converts_webdataset_tars_into_shards_on_object_storage(packed, gcs, tmp_path):
    from conftest import run_command

    local, _, (_, images) = packed
    tars = _write_tars(images, tmp_path / "wds")
    url = f"gs://{BUCKET}/converted-{tmp_path.name}"
    args = [sys.executable, "-m", "xlatrain.cli", "pack", "--webdataset", str(tars), "--out", url, "--shard-mb", "0.01"]
    out = run_command(args, env=gcs.env).stderr
    assert f"packed {NUM} of {NUM} rows" in out
    options = {"channels": 1, "labels": ["rid", "cls"], "shuffle": False, "remote_requests": REQUESTS}
    converted = ShardDataset(url, **options)
    _same(_batches(converted), _batches(ShardDataset(local, **options)))
    assert len(converted._index.shard_names) > 1  # 0.01 MB shards
    # Again: nothing new to write.
    assert "0 written" in run_command(args, env=gcs.env).stderr
