"""How a TorchTPU job with several devices is launched, as the refusal of a wrong launch says it.
(tests/test_docs.py runs the launch the hint names, with a stub of TorchTPU's module.)"""

import pytest

from xlatrain import select_backend
from xlatrain.backend import TPU_LAUNCH_ENV, runtimes
from xlatrain.backend.runtimes import TpuRuntimes

# A TPU host with TorchTPU's 4 devices, as runtimes.probe() would find it.
TORCH_TPU_HOST = TpuRuntimes(tpu_chips=4, torch_tpu_version="0.2.0", torch_tpu_other=None, torch_tpu_devices=4,
                             torch_tpu_autoload_off=False, torch_xla_version=None, pjrt_device=None)


@pytest.fixture
def outside_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCH_TPU_TIER2_COMPILATION_CACHE", "disabled")  # select_backend sets it otherwise


def test_several_tpu_devices_outside_torchrun_name_torchtpus_launch_and_torchrun_in_one_subshell(monkeypatch, outside_torchrun):
    monkeypatch.setattr(runtimes, "probe", lambda: TORCH_TPU_HOST)
    with pytest.raises(ValueError) as refused:
        select_backend("tpu", devices=4)
    message = str(refused.value)
    # One command, in a subshell, so that none of the launch variables stay in the user's shell.
    assert f"launch it with `( {TPU_LAUNCH_ENV}; torchrun --nproc-per-node 4 " in message, message
    assert message.endswith(" )`"), message
    assert TPU_LAUNCH_ENV == 'set -a; eval "$(python -m torch.tpu.distributed)"; set +a'


def test_several_cpu_devices_outside_torchrun_name_torchrun_alone(outside_torchrun):
    with pytest.raises(ValueError, match=r"launch it with `torchrun --nproc-per-node 2 ") as refused:
        select_backend("cpu", devices=2)
    assert "torch.tpu.distributed" not in str(refused.value)
