"""`make pe-demo` (python -m xlatrain.recipes.pe_detection.demo) runs as `xlatrain fit` does: bad
input is one `xlatrain: error:` line with exit status 2, and its progress reaches the console."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _demo(*args):
    return subprocess.run([sys.executable, "-m", "xlatrain.recipes.pe_detection.demo", "configs/pe_detection.yaml", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_bad_input_is_one_error_line_and_exit_status_2():
    proc = _demo("--set", "trainer.epoch=3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("xlatrain: error: unknown TrainConfig key(s) trainer.epoch: valid keys are ")
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert "Traceback" in _demo("--set", "trainer.epoch=3", "--debug").stderr  # --debug shows where


def test_the_demo_says_it_generates_and_packs_the_data(tmp_path):
    sets = ["data.num_studies=6", "data.slices_per_study=[4,5]", "data.stored_size=32", "data.image_size=32",
            "data.num_folds=2", "data.pack_workers=1", "model.name=small_cnn", "model.width=4", "trainer.batch_size=8",
            "trainer.epochs=1", "backend.accelerator=cpu", f"data.root={tmp_path / 'data'}", f"trainer.run_dir={tmp_path / 'run'}"]
    proc = _demo(*[a for item in sets for a in ("--set", item)])
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # 1: the tiny model does not beat the baseline
    out = proc.stdout
    assert f"generating a synthetic RSNA-shaped dataset in {tmp_path / 'data'}" in out
    assert f"packing {tmp_path / 'data'} into {tmp_path / 'data' / 'shards'}" in out
    assert out.index("packing") < out.index("epoch 1/1") < out.index("prior baseline")
