"""Run diagnostics on real XLA:CPU: a bad loop is explained, a good one gets a clean bill."""

import sys

import pytest

from conftest import SCRIPTS, run_command, run_script

ENV = {"PJRT_DEVICE": "CPU"}


@pytest.mark.xla
def test_a_bad_loop_names_each_cause_and_a_good_loop_is_clean(tmp_path):
    bad = run_script([sys.executable, str(SCRIPTS / "bad_loop.py"), str(tmp_path / "bad"), "bad"], env=ENV)
    by_code = {f["code"]: f for f in bad["findings"]}
    shape = by_code["input-shape-change"]["evidence"]
    assert "shape [16, 1, 8, 8] -> [16, 1, 12, 12]" in shape  # the image size that changed
    assert "[16] -> [3] (a ragged batch)" in shape  # the short last batch
    sync = by_code["host-sync-per-step"]
    assert sync["title"].startswith("1.0 unplanned device read(s) per step") and ".item()" in sync["evidence"]
    assert not bad["clean"]

    good = run_script([sys.executable, str(SCRIPTS / "bad_loop.py"), str(tmp_path / "good"), "good"], env=ENV)
    assert good["clean"] and good["findings"] == []
    assert all(e["compilations"] == 0 for e in good["epochs"][1:])
    assert all(e["host_reads"] == e["planned_reads"] for e in good["epochs"])


@pytest.mark.xla
def test_strict_raises_on_the_bad_loop_only(tmp_path):
    bad = run_command([sys.executable, str(SCRIPTS / "bad_loop.py"), str(tmp_path / "bad"), "bad", "strict"], env=ENV)
    assert "STRICT strict: epoch 2" in bad.stdout and "outside the planned reads" in bad.stdout
    good = run_command([sys.executable, str(SCRIPTS / "bad_loop.py"), str(tmp_path / "good"), "good", "strict"], env=ENV)
    assert "STRICT" not in good.stdout and "HISTORY" in good.stdout
