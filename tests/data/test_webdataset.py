import io
import json
import logging
import tarfile

import numpy as np
import pytest
import simplejpeg

from xlatrain.data.shards import ShardDataset, ShardError

PER_TAR = 7


def _write_tars(root, num_tars=3):
    root.mkdir()
    for t in range(num_tars):
        with tarfile.open(root / f"shard-{t:02d}.tar", "w") as tar:
            for k in range(t * PER_TAR, (t + 1) * PER_TAR):
                image = simplejpeg.encode_jpeg(np.full((16, 16, 1), k * 7 % 256, np.uint8), colorspace="GRAY",
                                               colorsubsampling="Gray")
                for name, data in [(f"{k:06d}.jpg", image), (f"{k:06d}.cls", str(k % 4).encode()),
                                   (f"{k:06d}.json", json.dumps({"rid": k}).encode())]:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return root


def _rids(ds):
    return sorted(int(r) for (_, y), v in ds.eval_batches(loader_batch=4, num_processes=1, process_index=0)
                  for r, ok in zip(y[:, 0].tolist(), v.tolist()) if ok)


def test_a_tar_cut_short_is_counted_listed_and_said_under_skip(tmp_path, caplog):
    root = _write_tars(tmp_path / "wds")
    cut = root / "shard-01.tar"
    with tarfile.open(cut) as tar:
        fourth_image = tar.getmember(f"{PER_TAR + 3:06d}.jpg")
    cut.write_bytes(cut.read_bytes()[: fourth_image.offset_data + 10])  # inside the 4th sample's image
    with pytest.raises(ShardError, match="shard shard-01.tar is not a readable tar"):
        ShardDataset(root)
    with caplog.at_level(logging.WARNING, logger="xlatrain"):
        ds = ShardDataset(root, channels=1, labels=["rid"], on_error="skip", num_workers=0)
    assert _rids(ds) == [*range(PER_TAR), *range(2 * PER_TAR, 3 * PER_TAR)]
    assert ds.num_skipped == 4  # the samples found before the break, the broken one included
    assert ds.skipped == [{"record": None, "what": "shard shard-01.tar (4 records)",
                           "reason": "shard shard-01.tar is not a readable tar (unexpected end of data); the 4 counted "
                                     "are those found before it breaks"}]
    assert "leaving out the 4 record(s) found in shard-01.tar before it breaks" in caplog.text


def test_a_tar_that_breaks_before_its_first_sample_is_counted_as_one_of_unknown_records(tmp_path, caplog):
    root = _write_tars(tmp_path / "wds")
    cut = root / "shard-02.tar"
    cut.write_bytes(cut.read_bytes()[:100])  # not even the first member's header
    with caplog.at_level(logging.WARNING, logger="xlatrain"):
        ds = ShardDataset(root, channels=1, labels=["rid"], on_error="skip", num_workers=0)
    assert _rids(ds) == list(range(2 * PER_TAR))
    assert ds.num_skipped == 1
    [entry] = ds.skipped
    assert entry["what"] == "shard shard-02.tar (records unknown)"
    assert "shard-02.tar is not a readable tar" in entry["reason"]
    assert "leaving out shard-02.tar, an unknown number of records (it breaks before its first sample; counted as " \
           "one)" in caplog.text


def test_every_tar_left_out_is_said_as_such_not_as_tars_without_images(tmp_path):
    """Each tar unreadable under on_error='skip': the error said the tars held no .jpg member."""
    root = _write_tars(tmp_path / "wds")
    for tar in root.glob("*.tar"):
        tar.write_bytes(tar.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"every tar was left out under on_error='skip' \(shard-00.tar: .*Replace the damaged tars"):
        ShardDataset(root, channels=1, labels=["rid"], on_error="skip", num_workers=0)


def test_a_sample_with_no_image_is_listed_where_it_is_counted(tmp_path):
    """Left out and counted in num_skipped, it was missing from skipped."""
    root = tmp_path / "wds"
    root.mkdir()
    image = simplejpeg.encode_jpeg(np.zeros((16, 16, 1), np.uint8), colorspace="GRAY", colorsubsampling="Gray")
    with tarfile.open(root / "a.tar", "w") as tar:
        for name, data in [("000000.jpg", image), ("000000.cls", b"1"), ("000001.cls", b"0")]:  # 000001: no image
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ds = ShardDataset(root, channels=1, num_workers=0)
    assert ds.num_skipped == 1
    assert ds.skipped == [{"record": None, "what": "shard a.tar (1 records)",
                           "reason": "1 sample(s) in it have no image member (.jpg), e.g. 000001"}]
