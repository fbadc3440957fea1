import pytest
import torch

from xlatrain.backend import BackendUnavailableError, select_backend


def test_unknown_accelerator_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"unknown accelerator 'gpu': choose one of 'auto', 'tpu', 'xla', 'cuda', 'cpu'"):
        select_backend("gpu")


def test_tpu_asked_for_without_one_says_what_was_found_and_what_to_do(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    with pytest.raises(BackendUnavailableError, match=r"none can run here.*TPU chips on the PCI bus: 0.*accelerator='xla' with devices=N"):
        select_backend("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_for_without_one_is_a_clear_error():
    with pytest.raises(BackendUnavailableError, match=r"no CUDA device .*'cpu'"):
        select_backend("cuda")


def test_auto_without_accelerators_is_the_cpu(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    be = select_backend("auto")
    assert be.runtime.kind == "cpu" and be.strategy.name == "single" and be.world_size == 1 and be.is_main
    assert be.describe() == "cpu (CPU), single process"


def test_several_cpu_devices_outside_torchrun_point_to_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"torchrun --nproc-per-node 2"):
        select_backend("cpu", devices=2)


def test_ddp_asked_for_in_one_process_says_it_runs_as_one_and_how_to_launch_more(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    be = select_backend("cpu", strategy="ddp")
    assert be.strategy.name == "ddp" and be.world_size == 1
    assert be.describe() == ("cpu (CPU), single process (strategy='ddp' in one process: launch with torchrun "
                             "--nproc-per-node N for DDP)")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun --nproc-per-node 1: it was launched
    assert be.describe() == "cpu (CPU), single process (strategy='ddp' over the one process torchrun launched)"


def test_unknown_xla_mode():
    with pytest.raises(ValueError, match="unknown xla_mode 'threads'"):
        select_backend("cpu", xla_mode="threads")
