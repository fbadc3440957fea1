import functools
import gc
import json
import logging
import mmap
import os
import signal
import threading
import time

import numpy as np
import pytest
import simplejpeg
import torch
from torch import nn

from conftest import alive, image_folder

from xlatrain import TrainConfig, Trainer
from xlatrain.data.pack import pack
from xlatrain.data.sampling import EvalSampler
from xlatrain.data.shards import (
    MANIFEST_NAME,
    Augment,
    NormalizeInput,
    ShardDataset,
    ShardError,
    normalize_on_device,
    read_manifest,
    read_shard_index,
)
from xlatrain.data.source import BatchSource
from xlatrain.data.splits import group_kfold
from xlatrain.data.synthetic_rsna import PATH_COLUMNS, generate

NUM = 101  # divides by none of the global batches below


def _make(root, num=NUM, size=16, shard_bytes=2500):
    csv, images = image_folder(root, num, size)
    summary = pack(csv, images, root / "s", path_columns=["path"], labels=["rid", "cls"], group="grp",
                   shard_bytes=shard_bytes, progress=False)
    assert summary.num_records == num and summary.num_shards > num * 200 // shard_bytes
    return root / "s"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("ids"))


def _ids(targets):
    return targets[:, 0].long().tolist()


def _train(ds, b, num_processes, epoch=1, seed=0, start_step=0):
    return [
        list(ds.train_batches(loader_batch=b, num_processes=num_processes, process_index=p, seed=seed, epoch=epoch, start_step=start_step))
        for p in range(num_processes)
    ]


def test_is_a_batch_source_with_uint8_batches(shards):
    ds = ShardDataset(shards)
    assert isinstance(ds, BatchSource) and len(ds) == NUM and ds.label_names == ("rid", "cls")
    (x, y), = _train(ds, 8, 1)[0][:1]
    assert x.shape == (8, 3, 16, 16) and x.dtype == torch.uint8 and y.shape == (8, 2) and y.dtype == torch.float32
    image, target = ds[5]
    assert image.shape == (3, 16, 16) and target.tolist() == [5.0, 2.0]


@pytest.mark.parametrize("num_processes", [1, 2, 8])
def test_every_record_at_most_once_per_epoch_in_full_batches(shards, num_processes):
    ds = ShardDataset(shards, channels=1)
    b = 4
    steps = NUM // (b * num_processes)
    per_process = _train(ds, b, num_processes)
    seen = []
    for batches in per_process:
        assert len(batches) == steps and all(x.shape[0] == b for x, _ in batches)
        seen += [i for _, y in batches for i in _ids(y)]
    assert len(seen) == len(set(seen)) == steps * b * num_processes  # disjoint, the ragged tail left out
    # The left-out tail changes from epoch to epoch, so every record gets trained on.
    later = {i for batches in _train(ds, b, num_processes, epoch=2) for _, y in batches for i in _ids(y)}
    assert set(seen) != later


def test_a_global_batch_is_the_same_records_whatever_the_process_count(shards):
    ds = ShardDataset(shards, channels=1)
    one = _train(ds, 8, 1)[0]
    for num_processes in (2, 8):
        parts = _train(ds, 8 // num_processes, num_processes)
        for step in range(len(one)):
            joined = [i for p in range(num_processes) for i in _ids(parts[p][step][1])]
            assert joined == _ids(one[step][1])


@pytest.mark.parametrize("num_processes,b", [(1, 7), (2, 5), (8, 3)])
def test_evaluation_covers_every_record_exactly_once_in_eval_sampler_order(shards, num_processes, b):
    ds = ShardDataset(shards, channels=1)
    seen = []
    for p in range(num_processes):
        batches = list(ds.eval_batches(loader_batch=b, num_processes=num_processes, process_index=p))
        expected = EvalSampler(NUM, loader_batch=b, num_processes=num_processes).indices(p)
        rows = torch.cat([y for (_, y), _ in batches])[:, 0].long()
        valid = torch.cat([v for _, v in batches])
        assert all(x.shape[0] == b for (x, _), _ in batches) and valid.dtype == torch.bool
        assert torch.equal(valid, expected < NUM) and torch.equal(rows, expected % NUM)
        seen += rows[valid].tolist()
    assert sorted(seen) == list(range(NUM))


def test_same_seed_same_order_different_epochs_and_seeds_differ(shards):
    ds = ShardDataset(shards, channels=1)
    order = lambda **kw: [i for _, y in _train(ds, 4, 2, **kw)[1] for i in _ids(y)]  # noqa: E731
    assert order(epoch=3) == order(epoch=3) == [i for _, y in _train(ShardDataset(shards, channels=1), 4, 2, epoch=3)[1] for i in _ids(y)]
    assert order(epoch=3) != order(epoch=4)
    assert order(epoch=3, seed=1) != order(epoch=3)
    assert [i for _, y in _train(ShardDataset(shards, shuffle=False), 4, 1)[0] for i in _ids(y)] == list(range(100))


def test_shuffle_window_bounds_how_far_a_record_moves_from_its_shard_stream(shards):
    ds = ShardDataset(shards, shuffle_window=5)
    order = ds.epoch_order(seed=0, epoch=1)
    assert sorted(order.tolist()) == list(range(NUM))
    # Records of one shard stay together within the window: a shard spans few positions.
    shard_of = np.repeat(np.arange(len(read_manifest(shards)["shards"])), [s["num_records"] for s in read_manifest(shards)["shards"]])
    first_shard = shard_of[order[0]]
    where = np.flatnonzero(shard_of[order] == first_shard)
    assert where.max() - where.min() < (shard_of == first_shard).sum() + 2 * 5
    full = ShardDataset(shards, shuffle_window=None).epoch_order(seed=0, epoch=1)
    assert sorted(full.tolist()) == list(range(NUM)) and not np.array_equal(full, order)


AUG = Augment(crop_scale=(0.4, 1.0), hflip=0.5, vflip=0.5, rotate_degrees=15)


def test_resume_from_a_step_yields_exactly_the_rest_of_the_epoch(shards):
    ds = ShardDataset(shards, image_size=8, augment=AUG)
    full = _train(ds, 4, 2, epoch=5, seed=7)
    resumed = _train(ds, 4, 2, epoch=5, seed=7, start_step=6)
    for p in range(2):
        assert len(resumed[p]) == len(full[p]) - 6
        for (xa, ya), (xb, yb) in zip(full[p][6:], resumed[p]):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    with pytest.raises(ValueError, match="start_step=13 is outside 0..12"):
        ds.train_batches(loader_batch=4, num_processes=2, process_index=0, seed=7, epoch=5, start_step=13)


def test_worker_processes_give_the_same_batches_in_the_same_order(shards):
    plain = ShardDataset(shards, image_size=8, augment=AUG)
    with ShardDataset(shards, image_size=8, augment=AUG, num_workers=2) as workers:
        for epoch in (1, 2):  # the second pass reuses the persistent workers
            a = _train(plain, 8, 1, epoch=epoch)[0]
            b = _train(workers, 8, 1, epoch=epoch)[0]
            assert len(a) == len(b) and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
        ev = list(workers.eval_batches(loader_batch=8, num_processes=1, process_index=0))
        assert sum(int(v.sum()) for _, v in ev) == NUM


def test_a_newer_pass_invalidates_an_unfinished_older_one(shards):
    ds = ShardDataset(shards, num_workers=1)
    older = iter(ds.train_batches(loader_batch=4, num_processes=1, process_index=0, seed=0, epoch=1))
    next(older)
    newer = ds.eval_batches(loader_batch=4, num_processes=1, process_index=0)
    assert len(list(newer)) == 26
    with pytest.raises(RuntimeError, match="started another pass"):
        next(older)
    ds.close()


def test_augmentations_are_uint8_reproducible_and_vary_by_epoch(shards):
    ds = ShardDataset(shards, image_size=12, channels=1, augment=AUG)
    a1, a1b, a2 = (_train(ds, 8, 1, epoch=e)[0][0][0] for e in (1, 1, 2))
    assert a1.dtype == torch.uint8 and a1.shape == (8, 1, 12, 12) and torch.equal(a1, a1b)
    flips = ShardDataset(shards, shuffle=False, augment=Augment(hflip=1.0))
    x, _ = _train(flips, 4, 1)[0][0]
    assert torch.equal(x[2], ShardDataset(shards)[2][0].flip(-1))
    ids = _ids(_train(ds, 8, 1, epoch=2)[0][0][1])
    assert not torch.equal(a2, torch.stack([ShardDataset(shards, image_size=12, channels=1)[i][0] for i in ids]))


def _corrupt_record(shards, record=3):
    """Flip bytes inside one record's JPEG data (the file keeps its size)."""
    entry = read_manifest(shards)["shards"][0]
    path = shards / entry["name"]
    index = read_shard_index(path)
    data = bytearray(path.read_bytes())
    start, end = index.starts[record], index.starts[record + 1]
    for k in range(start + (end - start) // 2, end - 4):
        data[k] ^= 0x5A
    path.write_bytes(bytes(data))
    return entry["name"], index.paths[record]


def test_a_corrupt_record_raises_naming_the_shard_or_is_skipped_and_counted(tmp_path, caplog):
    root = _make(tmp_path)
    shard, source = _corrupt_record(root, record=3)
    ds = ShardDataset(root, shuffle=False)
    with pytest.raises(ShardError, match=f"record 3 of shard {shard} \\(source {source}\\): CRC32 checksum mismatch"):
        list(ds.train_batches(loader_batch=4, num_processes=1, process_index=0, seed=0, epoch=1))
    with ShardDataset(root, shuffle=False, num_workers=1) as in_workers:  # re-raised in this process
        with pytest.raises(ShardError, match=f"record 3 of shard {shard}"):
            list(in_workers.train_batches(loader_batch=4, num_processes=1, process_index=0, seed=0, epoch=1))
    skip = ShardDataset(root, shuffle=False, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="xlatrain"):
        batches = list(skip.train_batches(loader_batch=4, num_processes=1, process_index=0, seed=0, epoch=1))
    assert f"skipping record 3 of shard {shard}" in caplog.text
    assert all(x.shape[0] == 4 for x, _ in batches) and skip.num_skipped == 1
    assert _ids(batches[0][1]) == [0, 1, 2, 2]  # the bad row repeats a good row of its batch
    assert skip.skipped[0]["record"] == 3 and "CRC32" in skip.skipped[0]["reason"]
    ev = list(skip.eval_batches(loader_batch=8, num_processes=1, process_index=0))
    real = [i for (_, y), v in ev for i, ok in zip(_ids(y), v.tolist()) if ok]
    assert sorted(real) == [i for i in range(NUM) if i != 3] and skip.num_skipped == 1


def test_a_truncated_shard_is_named_at_open_or_left_out_under_skip(tmp_path, caplog):
    root = _make(tmp_path)
    entry = read_manifest(root)["shards"][1]
    path = root / entry["name"]
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(ShardError, match=f"shard {entry['name']} is truncated: .*xlatrain pack --verify"):
        ShardDataset(root)
    with caplog.at_level(logging.WARNING, logger="xlatrain"):
        ds = ShardDataset(root, on_error="skip")
    assert f"leaving out the {entry['num_records']} records of shard {entry['name']}" in caplog.text
    assert len(ds) == NUM - entry["num_records"] and ds.num_skipped == entry["num_records"]
    assert sum(int(v.sum()) for _, v in ds.eval_batches(loader_batch=8, num_processes=1, process_index=0)) == len(ds)


def test_a_checksum_mismatch_is_caught_when_asked_to_verify(tmp_path):
    root = _make(tmp_path)
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    manifest["shards"][2]["sha256"] = "f" * 64
    (root / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert len(ShardDataset(root)) == NUM  # hashing every shard is opt-in (records still carry a CRC)
    with pytest.raises(ShardError, match=f"shard {manifest['shards'][2]['name']} fails its checksum"):
        ShardDataset(root, verify_checksums=True)


def test_targets_options_and_errors(shards):
    ds = ShardDataset(shards, labels=["cls"], target="long")
    _, y = _train(ds, 4, 1)[0][0]
    assert y.dtype == torch.int64 and y.shape == (4,) and set(y.tolist()) <= {0, 1, 2}
    with pytest.raises(ValueError, match="target='long' needs exactly one label column"):
        ShardDataset(shards, target="long")
    with pytest.raises(ValueError, match=r"label\(s\) \['x'\] are not in"):
        ShardDataset(shards, labels=["x"])
    with pytest.raises(ValueError, match=r"unknown ShardDataset option\(s\) \['batch'\]"):
        ShardDataset(shards, batch=3)
    with pytest.raises(ValueError, match="on_error='ignore' is not valid"):
        ShardDataset(shards, on_error="ignore")
    with pytest.raises(ValueError, match="crop_scale"):
        Augment(crop_scale=(0.5, 2.0))
    with pytest.raises(ValueError, match="does not exist: pack a dataset"):
        ShardDataset(shards.parent / "nowhere")
    with pytest.raises(ValueError, match="fewer than one optimizer step needs"):
        ShardDataset(shards).train_batches(loader_batch=64, num_processes=2, process_index=0, seed=0, epoch=1)


def test_a_file_given_for_the_pack_directory_is_named_with_the_fix(shards):
    csv_path = shards.parent / "t.csv"  # the CSV the pack was made from
    assert csv_path.is_file()
    with pytest.raises(ValueError, match=f"{csv_path} is a file, not a directory: give the pack's directory"):
        ShardDataset(csv_path)


def test_subsets_follow_group_kfold_without_leakage(shards):
    full = ShardDataset(shards, image_size=8)
    train_ids, val_ids = group_kfold(full.groups, num_folds=4, fold=1)
    train, val = full.subset(train_ids, augment=AUG), full.subset(val_ids)
    assert len(train) + len(val) == NUM and not set(train.groups) & set(val.groups)
    assert sorted(val.record_ids.tolist()) == sorted(val_ids.tolist())
    assert train.options.augment == AUG and val.options.augment is None
    assert np.array_equal(val.labels[:, 0], val_ids.astype(np.float32))


def test_normalisation_happens_on_the_device_side():
    x = torch.tensor([[[[0, 255]], [[51, 102]]]], dtype=torch.uint8)
    out = normalize_on_device(x, mean=[0.5, 0.2], std=[0.5, 0.1])
    expected = (x.float() / 255 - torch.tensor([0.5, 0.2]).view(2, 1, 1)) / torch.tensor([0.5, 0.1]).view(2, 1, 1)
    assert out.dtype == torch.float32 and torch.allclose(out, expected, atol=1e-6)
    layer = NormalizeInput(mean=[0.5, 0.2], std=[0.5, 0.1])
    assert torch.allclose(layer(x), expected, atol=1e-6) and layer.state_dict() == {}
    grey = torch.full((2, 1, 4, 4), 128, dtype=torch.uint8)
    rgb = NormalizeInput(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])(grey)
    assert rgb.shape == (2, 3, 4, 4)  # a grey batch becomes the model's three channels on the device


class _TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            NormalizeInput(mean=[0.3], std=[0.3]),
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(16, 1),
        )

    def forward(self, x):
        return self.body(x)


def test_trainer_fits_shard_datasets_and_evaluates_every_record_once(tmp_path):
    data = generate(tmp_path / "rsna", num_studies=24, slices_per_study=(10, 14), image_size=32, seed=1)
    pack(data.csv_path, data.image_dir, tmp_path / "s", path_columns=PATH_COLUMNS, suffix=".jpg",
         labels=["pe_present_on_image"], group="StudyInstanceUID", shard_bytes=8000, progress=False)
    full = ShardDataset(tmp_path / "s", channels=1)
    train_ids, val_ids = group_kfold(full.groups, num_folds=4, fold=0)
    train = full.subset(train_ids, augment=Augment(hflip=0.5, rotate_degrees=5), num_workers=1)
    val = full.subset(val_ids)
    torch.manual_seed(0)
    trainer = Trainer(
        _TinyNet(), nn.BCEWithLogitsLoss(), functools.partial(torch.optim.Adam, lr=1e-2),
        config=TrainConfig(epochs=6, batch_size=16, eval_batch_size=10, run_dir=str(tmp_path / "run"), log_every=100),
        backend="cpu",
    )
    history = trainer.fit(train, val)
    losses = [row["train_loss"] for row in history]
    assert len(history) == 6 and losses[-1] < 0.8 * losses[0]
    assert history[-1]["val_mean_auc"] > 0.9  # the blob on PE-positive slices is learnt
    metrics = trainer.evaluate(val)
    assert metrics["num_samples"] == len(val)
    predictions = trainer.predict(val)
    assert predictions.shape == (len(val), 1)
    assert np.isfinite(predictions.numpy()).all()
    train.close()


def test_the_records_an_epoch_leaves_out_of_full_batches_are_said_for_a_shard_dataset(shards, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    ds = ShardDataset(shards, channels=1, labels=["cls"])
    trainer = Trainer(_TinyNet(), nn.MSELoss(), functools.partial(torch.optim.SGD, lr=1e-3),
                      config=TrainConfig(epochs=1, batch_size=16, run_dir=str(tmp_path / "run"), task="none",
                                         tensorboard=False), backend="cpu")
    trainer.fit(ds)
    assert "note: each epoch trains 6 full batches of 16, 96 of the 101 samples, so that every step has the same " \
           "shape: the 5 at the end of ShardDataset's order for the epoch (its own to shuffle) wait for another " \
           "epoch" in caplog.text


def test_without_shuffling_the_records_after_the_last_full_batch_are_said_never_to_train(shards, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    ds = ShardDataset(shards, channels=1, labels=["rid"], shuffle=False, num_workers=0)
    # What the note says: every epoch reads the same order and leaves out the same last 5.
    for epoch in (1, 2, 3):
        (batches,) = _train(ds, 16, 1, epoch=epoch)
        seen = {r for _, y in batches for r in _ids(y)}
        assert seen == set(range(96))
    trainer = Trainer(_TinyNet(), nn.MSELoss(), functools.partial(torch.optim.SGD, lr=1e-3),
                      config=TrainConfig(epochs=1, batch_size=16, run_dir=str(tmp_path / "run"), task="none",
                                         tensorboard=False), backend="cpu")
    trainer.fit(ds)
    assert "note: each epoch trains 6 full batches of 16, 96 of the 101 samples, so that every step has the same " \
           "shape: the 5 at the end of the order are never trained on" in caplog.text
    assert "wait for another epoch" not in caplog.text


def test_the_trainers_num_workers_decides_a_shard_readers_workers_unless_the_reader_says_another(shards, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")

    def trainer(num_workers, run):
        return Trainer(_TinyNet(), nn.MSELoss(), functools.partial(torch.optim.SGD, lr=1e-3),
                       config=TrainConfig(epochs=1, batch_size=16, run_dir=str(tmp_path / run), task="none",
                                          tensorboard=False, num_workers=num_workers), backend="cpu")

    train = ShardDataset(shards, channels=1, labels=["cls"])
    val = ShardDataset(shards, channels=1, labels=["cls"])
    trainer(0, "zero").fit(train, val)
    assert "input: 0 decode worker(s) (as configured)" in caplog.text
    assert train._workers is None and val._workers is None  # no worker process was started, evaluation's neither
    caplog.clear()
    # The same readers in the next run: the reader's own 'auto' stands, and the next Trainer's number decides.
    assert train.options.num_workers == "auto"
    trainer(1, "one").fit(train, val)
    assert "input: 1 decode worker(s) (as configured)" in caplog.text
    assert len(train._workers._conns) == 1
    trainer(2, "two").fit(train)
    trainer(1, "one-again").fit(train)  # a number given is kept: the two workers of the run before are not reused
    assert len(train._workers._conns) == 1
    caplog.clear()
    trainer(0, "eval").evaluate(val)  # before any fit: the dry run reads with the Trainer's 0 too
    assert val._workers is None
    train.close(), val.close()
    own = ShardDataset(shards, channels=1, labels=["cls"], num_workers=1)
    trainer("auto", "own").fit(own)
    assert "input: 1 decode worker(s) (as configured)" in caplog.text  # the reader's own number stands
    own.close()
    with pytest.raises(ValueError, match=r"^val_data: the Trainer's num_workers=2 and this ShardDataset's num_workers=1 differ"):
        trainer(2, "both").fit(train, own)
    assert not (tmp_path / "both").exists()  # refused before the run directory was made
    assert train._run_workers == 1  # as the run before left it: every reader is checked before any takes the 2


# --------------------------------------------------------------------------------------------
# Worker processes, shared batch slots, decoding straight into the batch


def _make_colour(root, num=24, size=16):
    images = root / "img"
    images.mkdir(parents=True)
    yy, xx = np.mgrid[:size, :size]
    lines = ["path,rid"]
    for i in range(num):
        rgb = np.stack([(xx * 9 + i) % 256, (yy * 11 + 3 * i) % 256, (xx * yy + i) % 256], axis=2).astype(np.uint8)
        (images / f"{i}.jpg").write_bytes(simplejpeg.encode_jpeg(rgb, quality=95, colorspace="RGB"))
        lines.append(f"{i}.jpg,{i}")
    (root / "t.csv").write_text("\n".join(lines) + "\n")
    pack(root / "t.csv", images, root / "s", path_columns=["path"], labels=["rid"], shard_bytes=3000, progress=False)
    return root / "s"


@pytest.fixture(scope="module")
def colour_shards(tmp_path_factory):
    return _make_colour(tmp_path_factory.mktemp("colour"))


def _all(ds, b=8, epoch=1, training=True):
    if training:
        return list(ds.train_batches(loader_batch=b, num_processes=1, process_index=0, seed=3, epoch=epoch))
    return list(ds.eval_batches(loader_batch=b, num_processes=1, process_index=0))


def _same(a, b):
    flat = lambda batches: [t for batch in batches for t in torch.utils._pytree.tree_leaves(batch)]  # noqa: E731
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(flat(a), flat(b)))


CASES = [
    # (fixture, options): every way a record reaches its row
    ("shards", dict(image_size=8, channels=1)),  # luma decoded by DCT scaling straight into the row
    ("shards", dict(image_size=8, channels=3)),  # ... and copied to the other two planes
    ("shards", dict(channels=1)),  # stored size: straight into the row, no scaling
    ("shards", dict(image_size=(12, 10), channels=1)),  # a resize after decoding
    ("shards", dict(image_size=8, channels=1, augment=Augment(hflip=0.5, vflip=0.5))),  # flips in place
    ("shards", dict(image_size=8, channels=3, augment=AUG)),  # crops and rotations
    ("colour_shards", dict(image_size=8, channels=3)),  # interleaved RGB, transposed into the planes
    ("colour_shards", dict(image_size=8, channels=1)),  # a colour record's luma
]


@pytest.mark.parametrize("fixture,options", CASES)
def test_worker_batches_are_the_in_process_batches(request, fixture, options):
    root = request.getfixturevalue(fixture)
    plain = ShardDataset(root, **options)
    with ShardDataset(root, num_workers=2, prefetch_batches=1, **options) as workers:
        for epoch in (1, 2):
            assert _same(_all(plain, epoch=epoch), _all(workers, epoch=epoch))
        assert _same(_all(plain, training=False), _all(workers, training=False))


@pytest.mark.parametrize("fixture,options", [c for c in CASES if "augment" not in c[1]])
def test_batch_rows_are_the_records_decoded_one_by_one(request, fixture, options):
    root = request.getfixturevalue(fixture)
    ds = ShardDataset(root, shuffle=False, **options)
    (x, y), = _all(ds, b=len(ds) // 2 * 2, epoch=1)[:1]
    one_by_one = torch.stack([ds[i][0] for i in y[:, 0].long().tolist()])
    assert x.dtype == torch.uint8 and torch.equal(x, one_by_one)


def test_batches_kept_by_the_consumer_are_never_overwritten(shards):
    # Far more batches than shared slots: the slots are lent until the batches are freed, and
    # once every slot is out the workers allocate batches of their own.
    plain = _all(ShardDataset(shards, image_size=8, channels=1), b=2)
    with ShardDataset(shards, image_size=8, channels=1, num_workers=2, prefetch_batches=1) as ds:
        kept = _all(ds, b=2)
        views = [x[:1] for x, _ in kept[:3]]  # a view keeps its batch's slot as well
        assert len(kept) > 2 * len(ds._workers.slots._free) and _same(plain, kept)
        second = _all(ds, b=2, epoch=2)
        assert _same(_all(ShardDataset(shards, image_size=8, channels=1), b=2, epoch=2), second)
        assert all(torch.equal(v, x[:1]) for v, (x, _) in zip(views, plain[:3]))
        slots = ds._workers.slots
        del kept, second, views
        free = len(slots._free)
        assert free == slots.buffer.numel() // slots.slot_bytes  # every slot back once the batches are gone


def test_an_abandoned_pass_leaves_the_workers_ready_for_the_next(shards):
    plain = ShardDataset(shards, image_size=8, channels=1)
    with ShardDataset(shards, image_size=8, channels=1, num_workers=2) as ds:
        unfinished = iter(ds.train_batches(loader_batch=4, num_processes=1, process_index=0, seed=3, epoch=1))
        first = next(unfinished)
        assert _same(_all(plain, b=4, training=False), _all(ds, b=4, training=False))
        assert _same(_all(plain, b=8, epoch=2), _all(ds, b=8, epoch=2))  # larger batches: new slots
        assert torch.equal(first[0], _all(plain, b=4)[0][0])


def _shm_entries():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_workers_stop_on_close_or_collection_and_leave_no_shared_memory(shards):
    before = _shm_entries()
    ds = ShardDataset(shards, image_size=8, num_workers=2)
    batches = _all(ds)
    pids = [p.pid for p in ds._workers._procs]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    ds.close()
    assert not any(alive(p) for p in pids)
    assert torch.equal(batches[0][0], _all(ShardDataset(shards, image_size=8))[0][0])  # still valid after close
    again = ShardDataset(shards, image_size=8, num_workers=2)
    _all(again)
    pids = [p.pid for p in again._workers._procs]
    del again
    gc.collect()
    assert not any(alive(p) for p in pids)
    del batches
    assert _shm_entries() <= before  # shared memory is unlinked as soon as it is mapped


def test_a_worker_that_dies_is_named_and_replaced(shards):
    with ShardDataset(shards, image_size=8, num_workers=2, prefetch_batches=1) as ds:
        passes = iter(ds.train_batches(loader_batch=4, num_processes=1, process_index=0, seed=0, epoch=1))
        next(passes)
        os.kill(ds._workers._procs[1].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"shard reader worker 1 \(pid \d+\) exited unexpectedly \(exit code -9"):
            list(passes)
        assert _same(_all(ShardDataset(shards, image_size=8), b=4), _all(ds, b=4))  # new workers for the next pass


def test_a_shard_truncated_while_mapped_is_reported_as_such(tmp_path):
    root = _make(tmp_path, shard_bytes=10**6)  # one shard of several memory pages
    with ShardDataset(root, shuffle=False, num_workers=1) as ds:
        _all(ds, b=4)  # the worker has mapped the shard
        os.truncate(root / read_manifest(root)["shards"][0]["name"], mmap.PAGESIZE)  # records past it: no page
        with pytest.raises(RuntimeError, match="SIGBUS: a shard file was truncated or overwritten in place"):
            _all(ds, b=4)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_shard_written_to_after_its_records_were_checked_is_checked_again(tmp_path, num_workers):
    root = _make(tmp_path)
    with ShardDataset(root, shuffle=False, num_workers=num_workers) as ds:
        assert len(_all(ds, b=4)) == NUM // 4  # every record read, and checked, once
        shard, _ = _corrupt_record(root, record=3)
        with pytest.raises(ShardError, match=f"record 3 of shard {shard} .*CRC32 checksum mismatch"):
            _all(ds, b=4)


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_pin_memory_gives_the_same_batches_pinned_for_cuda_and_as_they_are_without(shards, recwarn, num_workers):
    plain = _all(ShardDataset(shards, image_size=8)), _all(ShardDataset(shards, image_size=8), training=False)
    with ShardDataset(shards, image_size=8, num_workers=num_workers, pin_memory=True) as ds:
        pinned = _all(ds), _all(ds, training=False)
    assert _same(plain[0], pinned[0]) and _same(plain[1], pinned[1])
    assert all(x.is_pinned() == y.is_pinned() == torch.cuda.is_available() for x, y in pinned[0])
    assert not [w for w in recwarn if "pin" in str(w.message)]


def _pin_threads():
    return [t for t in threading.enumerate() if t.name == "xlatrain-pin"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_with_pin_memory_a_thread_readies_batches_ahead_of_the_consumer(shards, num_workers):
    with ShardDataset(shards, image_size=8, num_workers=num_workers, pin_memory=True) as ds:
        batches = ds.train_batches(loader_batch=4, num_processes=1, process_index=0, seed=3, epoch=1)
        next(batches)
        waiting = ds._pinning._queue
        deadline = time.monotonic() + 10
        while waiting.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waiting.qsize() == 2  # the next two are ready before they are asked for
        rest = list(batches)
        assert len(rest) == NUM // 4 - 1 and not _pin_threads()  # the pass's end ends its thread


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_bad_record_read_by_the_pinning_thread_is_raised_in_the_consumer_as_itself(tmp_path, num_workers):
    root = _make(tmp_path)
    shard, _ = _corrupt_record(root, record=3)
    with ShardDataset(root, image_size=8, shuffle=False, num_workers=num_workers, pin_memory=True) as ds:
        with pytest.raises(ShardError, match=f"record 3 of shard {shard}"):
            _all(ds, b=4)
    assert not _pin_threads()


def test_an_abandoned_pinned_pass_lets_go_of_the_workers_for_the_next_one(shards):
    with ShardDataset(shards, image_size=8, num_workers=2, pin_memory=True) as ds:
        old = ds.train_batches(loader_batch=4, num_processes=1, process_index=0, seed=3, epoch=1)
        next(old)  # abandoned with its thread running ahead, not closed
        assert _same(_all(ds, b=4, epoch=2), _all(ShardDataset(shards, image_size=8), b=4, epoch=2))
        assert _same(_all(ds, b=4, training=False), _all(ShardDataset(shards, image_size=8), b=4, training=False))
        with pytest.raises(RuntimeError, match="started another pass"):
            next(old)
        assert not _pin_threads()  # the new pass stopped the old one's thread; each pass's own ended with it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_batches_copy_to_cuda_asynchronously(shards):
    with ShardDataset(shards, image_size=8, num_workers=2, pin_memory=True) as ds:
        for x, y in ds.train_batches(loader_batch=8, num_processes=1, process_index=0, seed=0, epoch=1):
            assert x.is_pinned() and y.is_pinned()
            on_gpu = x.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(on_gpu.cpu(), x)
