import argparse
import csv
import json
import shutil

import numpy as np
import pytest
import simplejpeg

from xlatrain.data.pack import pack, verify
from xlatrain.data.pack_cli import add_pack_parser
from xlatrain.data.shards import MANIFEST_NAME, ShardError, iter_records, read_manifest
from xlatrain.data.synthetic_rsna import LABEL_COLUMNS, PATH_COLUMNS, generate

RSNA = dict(path_columns=PATH_COLUMNS, suffix=".jpg", labels=list(LABEL_COLUMNS), group="StudyInstanceUID", progress=False)


@pytest.fixture(scope="module")
def rsna(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("rsna"), num_studies=4, slices_per_study=(5, 8), image_size=32, seed=3)


def _rows(csv_path):
    with open(csv_path, newline="") as f:
        return list(csv.DictReader(f))


def _path(row):
    return "/".join(row[c] for c in PATH_COLUMNS) + ".jpg"


def test_round_trip_is_byte_exact_and_label_exact(rsna, tmp_path):
    summary = pack(rsna.csv_path, rsna.image_dir, tmp_path / "s", shard_bytes=3000, **RSNA)
    rows = _rows(rsna.csv_path)
    assert summary.num_records == len(rows) == rsna.num_images and summary.num_skipped == 0
    assert summary.num_shards > 2  # small shard_bytes: several shards, order kept across them
    records = list(iter_records(tmp_path / "s"))
    assert len(records) == len(rows)
    for rec, row in zip(records, rows):
        assert rec.path == _path(row)
        assert rec.data == (rsna.image_dir / rec.path).read_bytes()
        assert rec.labels == tuple(float(row[c]) for c in LABEL_COLUMNS)
        assert rec.group == row["StudyInstanceUID"]
        assert (rec.height, rec.width, rec.channels) == (32, 32, 1)
    manifest = read_manifest(tmp_path / "s")
    assert manifest["label_names"] == list(LABEL_COLUMNS)
    assert manifest["num_records"] == sum(s["num_records"] for s in manifest["shards"]) == len(rows)
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])
    assert verify(tmp_path / "s").ok


def test_repacking_the_same_input_is_idempotent_and_rewrites_nothing(rsna, tmp_path):
    out = tmp_path / "s"
    first = pack(rsna.csv_path, rsna.image_dir, out, shard_bytes=4000, **RSNA)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    manifest = (out / MANIFEST_NAME).read_bytes()
    second = pack(rsna.csv_path, rsna.image_dir, out, shard_bytes=4000, workers=2, **RSNA)
    assert first.num_shards_written == first.num_shards and second.num_shards_written == 0
    assert (out / MANIFEST_NAME).read_bytes() == manifest
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    # A different layout replaces the shards and leaves none of the old ones behind.
    third = pack(rsna.csv_path, rsna.image_dir, out, shard_bytes=10**9, **RSNA)
    assert third.num_shards == 1 and sorted(p.name for p in out.glob("shard-*")) == [read_manifest(out)["shards"][0]["name"]]


def test_corrupt_missing_and_non_jpeg_images_are_skipped_counted_and_listed(rsna, tmp_path):
    images = tmp_path / "images"
    shutil.copytree(rsna.image_dir, images)
    rows = _rows(rsna.csv_path)
    corrupt, missing, not_jpeg = _path(rows[1]), _path(rows[4]), _path(rows[6])
    data = (images / corrupt).read_bytes()
    (images / corrupt).write_bytes(data[: len(data) // 2])  # truncated mid-scan
    (images / missing).unlink()
    (images / not_jpeg).write_bytes(b"\x89PNG\r\n\x1a\n not really")
    summary = pack(rsna.csv_path, images, tmp_path / "s", **RSNA)
    assert summary.num_records == len(rows) - 3 and summary.num_skipped == 3
    reasons = {s.path: s.reason for s in summary.skipped}
    assert reasons[missing] == "missing file"
    assert "not a JPEG" in reasons[not_jpeg] or "corrupt" in reasons[not_jpeg]
    assert "JPEG" in reasons[corrupt]
    assert [s.line for s in summary.skipped] == [3, 6, 8]  # CSV lines (header is line 1)
    manifest = read_manifest(tmp_path / "s")
    assert manifest["num_skipped"] == 3 and {s["path"] for s in manifest["skipped"]} == set(reasons)
    assert "skipped 3 row(s)" in summary.describe() and missing in summary.describe()
    assert {r.path for r in iter_records(tmp_path / "s")}.isdisjoint(reasons)


def test_workers_give_the_same_shards_as_one_process(rsna, tmp_path):
    pack(rsna.csv_path, rsna.image_dir, tmp_path / "one", shard_bytes=5000, **RSNA)
    pack(rsna.csv_path, rsna.image_dir, tmp_path / "two", shard_bytes=5000, workers=2, **RSNA)
    assert (tmp_path / "one" / MANIFEST_NAME).read_text() == (tmp_path / "two" / MANIFEST_NAME).read_text()


def test_label_patterns_and_input_errors(rsna, tmp_path):
    opts = {**RSNA, "labels": ["pe_present_on_image", "*_pe", "rv_lv*"]}
    summary = pack(rsna.csv_path, rsna.image_dir, tmp_path / "s", **opts)
    assert summary.label_names == (
        "pe_present_on_image", "negative_exam_for_pe", "rv_lv_ratio_gte_1", "rv_lv_ratio_lt_1", "leftsided_pe",
        "chronic_pe", "true_filling_defect_not_pe", "rightsided_pe", "acute_and_chronic_pe", "central_pe",
    )  # CSV order, each once
    with pytest.raises(ValueError, match="label 'nope' matches no CSV column: the columns are"):
        pack(rsna.csv_path, rsna.image_dir, tmp_path / "x", **{**RSNA, "labels": ["nope"]})
    with pytest.raises(ValueError, match=r"column\(s\) \['Series'\] are not in"):
        pack(rsna.csv_path, rsna.image_dir, tmp_path / "x", **{**RSNA, "path_columns": ["Series"]})
    with pytest.raises(ValueError, match="holds '[0-9a-f]+', not a number"):
        pack(rsna.csv_path, rsna.image_dir, tmp_path / "x", **{**RSNA, "labels": ["SOPInstanceUID"]})
    with pytest.raises(ValueError, match="exactly one of path_columns"):
        pack(rsna.csv_path, rsna.image_dir, tmp_path / "x", labels=[], progress=False)
    with pytest.raises(ValueError, match="only the file-name part"):
        pack(rsna.csv_path, rsna.image_dir, tmp_path / "x", path_template="*/{SOPInstanceUID}.jpg", progress=False)


def test_a_bad_label_or_short_row_in_the_last_line_fails_before_any_image_is_read(tmp_path, monkeypatch):
    from conftest import image_folder

    from xlatrain.data import pack as pack_module

    csv_path, images = image_folder(tmp_path, 70)  # more rows than one chunk of image checks
    decoded = []
    check_chunk = pack_module._check_chunk
    monkeypatch.setattr(pack_module, "_check_chunk", lambda paths, *a: decoded.extend(paths) or check_chunk(paths, *a))
    lines = csv_path.read_text().splitlines()
    for last, message in [("69.jpg,n/a,0,g17", "line 71 of .*t.csv: label column 'rid' holds 'n/a', not a number. "
                                               "Choose numeric label columns"),
                          ("69.jpg", r"line 71 of .*t.csv has fewer fields than its header: no value for column\(s\) "
                                     r"\['grp'\]. Fix the row")]:
        csv_path.write_text("\n".join([*lines[:-1], last]) + "\n")
        with pytest.raises(ValueError, match=message):
            pack(csv_path, images, tmp_path / "s", path_columns=["path"], labels=["rid"], group="grp", workers=1,
                 progress=False)
        assert decoded == [] and not (tmp_path / "s").exists()


def test_path_column_and_wildcard_template(tmp_path):
    images = tmp_path / "img"
    (images / "a").mkdir(parents=True)
    lines = ["path,uid,label"]
    for i in range(4):
        data = simplejpeg.encode_jpeg(np.full((16, 16, 1), 40 * i, np.uint8), colorspace="GRAY", colorsubsampling="Gray")
        # The Kaggle JPEG layout prefixes file names with the slice number: 0003_<uid>.jpg.
        (images / "a" / f"{i:04d}_uid{i}.jpg").write_bytes(data)
        lines.append(f"a/{i:04d}_uid{i}.jpg,uid{i},{i % 2}")
    lines.append("a/none.jpg,uid9,0")
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    by_column = pack(tmp_path / "t.csv", images, tmp_path / "s1", path_columns=["path"], labels=["label"], progress=False)
    by_glob = pack(tmp_path / "t.csv", images, tmp_path / "s2", path_template="a/*_{uid}.jpg", labels=["label"], progress=False)
    assert by_column.num_records == by_glob.num_records == 4
    assert [r.path for r in iter_records(tmp_path / "s2")] == [f"a/{i:04d}_uid{i}.jpg" for i in range(4)]
    assert by_glob.skipped[0].reason == "no file matches" and by_column.skipped[0].reason == "missing file"
    for flags in (["--path-column", "path"], ["--path-template", "a/*_{uid}.jpg"]):
        out = tmp_path / flags[0]
        code = _cli(["pack", "--csv", str(tmp_path / "t.csv"), "--images", str(images), "--out", str(out), *flags,
                     "--labels", "label", "--workers", "1", "--quiet"])
        assert code == 0 and read_manifest(out)["num_records"] == 4


def test_max_side_reencodes_large_images_once(rsna, tmp_path):
    summary = pack(rsna.csv_path, rsna.image_dir, tmp_path / "s", max_side=16, **RSNA)
    assert summary.num_records == rsna.num_images
    rec = next(iter_records(tmp_path / "s"))
    assert (rec.height, rec.width) == (16, 16) and simplejpeg.decode_jpeg_header(rec.data)[:2] == (16, 16)
    assert read_manifest(tmp_path / "s")["max_side"] == 16


def _flip_a_record_byte(shard_path, offset_from_start=200):
    data = bytearray(shard_path.read_bytes())
    data[offset_from_start] ^= 0xFF
    shard_path.write_bytes(bytes(data))


def test_verify_reports_checksum_mismatch_truncation_and_missing_shards(rsna, tmp_path):
    out = tmp_path / "s"
    pack(rsna.csv_path, rsna.image_dir, out, shard_bytes=4000, **RSNA)
    shards = [out / s["name"] for s in read_manifest(out)["shards"]]
    _flip_a_record_byte(shards[0])
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) - 100])
    shards[2].unlink()
    report = verify(out, workers=2)
    assert not report.ok
    text = "\n".join(report.problems)
    assert f"shard {shards[0].name} fails its checksum" in text
    assert f"shard {shards[0].name} record 0" in text and "CRC32 checksum mismatch" in text
    assert f"shard {shards[1].name} is truncated" in text
    assert f"shard {shards[2].name} is missing" in text
    assert "Re-run `xlatrain pack`" in report.describe()


def test_manifest_checksum_mismatch_is_reported(rsna, tmp_path):
    out = tmp_path / "s"
    pack(rsna.csv_path, rsna.image_dir, out, **RSNA)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["shards"][0]["sha256"] = "0" * 64
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    report = verify(out)
    assert report.problems == (f"shard {manifest['shards'][0]['name']} fails its checksum (SHA-256 "
                               f"{report.problems[0].split('SHA-256 ')[1].split('...')[0]}..., the manifest says 0000000000000000...)",)


def _cli(argv):
    parser = argparse.ArgumentParser(prog="xlatrain")
    add_pack_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_command_line_pack_and_verify(rsna, tmp_path, capsys):
    out = tmp_path / "s"
    code = _cli([
        "pack", "--csv", str(rsna.csv_path), "--images", str(rsna.image_dir), "--out", str(out),
        "--path-columns", *PATH_COLUMNS, "--suffix", ".jpg", "--labels", "pe_present_on_image,*_pe",
        "--group", "StudyInstanceUID", "--workers", "2", "--shard-mb", "0.005", "--quiet",
    ])
    assert code == 0
    err = capsys.readouterr().err
    assert f"packed {rsna.num_images} of {rsna.num_images} rows" in err
    assert read_manifest(out)["label_names"][0] == "pe_present_on_image"
    assert _cli(["pack", "--verify", str(out), "--quiet"]) == 0
    assert "every checksum matches" in capsys.readouterr().err
    _flip_a_record_byte(out / read_manifest(out)["shards"][0]["name"])
    assert _cli(["pack", "--verify", str(out), "--quiet"]) == 1
    with pytest.raises(ValueError, match="needs --csv"):
        _cli(["pack", "--out", str(out)])


def test_iter_records_names_a_truncated_shard(rsna, tmp_path):
    out = tmp_path / "s"
    pack(rsna.csv_path, rsna.image_dir, out, **RSNA)
    shard = out / read_manifest(out)["shards"][0]["name"]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ShardError, match=f"shard {shard.name} is truncated"):
        list(iter_records(out))


def test_packing_nothing_is_an_error_that_says_why(tmp_path):
    import subprocess
    import sys

    from conftest import script_env

    (tmp_path / "img").mkdir()
    (tmp_path / "empty.csv").write_text("path,cls\n")
    proc = subprocess.run([sys.executable, "-m", "xlatrain.cli", "pack", "--csv", str(tmp_path / "empty.csv"), "--images",
                           str(tmp_path / "img"), "--out", str(tmp_path / "shards"), "--path-columns", "path", "--labels",
                           "cls", "--quiet"], capture_output=True, text=True, env=script_env(), timeout=120)
    assert proc.returncode == 1
    assert "error: nothing was packed: the CSV lists no rows" in proc.stderr
