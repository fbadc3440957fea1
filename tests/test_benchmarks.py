"""The CUDA benchmarks say why they skip where no GPU is, and their programs run: each in a smoke
run on the CPU at sizes too small to measure anything (the figures are not checked, the code is).
On a machine with a GPU, ``make bench`` runs them for real."""

from __future__ import annotations

import importlib

import pytest
import torch

GPU_ENTRIES = ["gpu_pipeline", "gpu_lm", "gpu_memory", "gpu_overhead"]


@pytest.mark.parametrize("name", GPU_ENTRIES)
def test_a_cuda_entry_skips_with_its_reason_without_a_gpu_and_runs_its_program_on_the_cpu(name, tmp_path, monkeypatch):
    module = importlib.import_module(f"benchmarks.{name}")
    if not torch.cuda.is_available():
        assert "no CUDA device" in module.run()["skipped"]
    monkeypatch.chdir(tmp_path)
    figures = module.run(smoke=True)
    assert "skipped" not in figures
    assert not figures.get("target_met")  # a smoke run on the CPU claims no GPU target


def test_make_bench_lists_the_cuda_entries_and_the_startup_entry():
    from benchmarks.run import ENTRIES

    assert {"startup", *GPU_ENTRIES} <= set(ENTRIES)
