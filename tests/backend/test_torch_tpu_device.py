"""On a TPU with TorchTPU: the same fit as on the CPU, eager and compiled.

Marked ``tpu`` and skipped where no TPU can run TorchTPU (this project's CI and development
machines have none: TorchTPU has no CPU or fake device). Everything around the device — the
runtime choice, the environment order, the DDP + compile path with the CPU device — is tested for
real in test_runtimes.py, test_compile.py and test_distributed.py.

Tolerance: the TPU's float32 matmuls and convolutions run at bfloat16-pass precision by default,
so losses agree with the CPU's to a relative 2e-2 over two epochs, not bitwise.
"""

import functools
import importlib.util

import pytest
import torch
from torch import nn

from conftest import sign_images
from xlatrain import TrainConfig, Trainer
from xlatrain.backend.hardware import find_tpu_chips

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(
        importlib.util.find_spec("torch_tpu") is None or not find_tpu_chips(),
        reason="needs a TPU and torch_tpu (none here: TorchTPU has no CPU device)",
    ),
]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 2))


def _fit(tmp_path, accelerator, **cfg):
    trainer = Trainer(
        _model(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.05),
        config=TrainConfig(epochs=2, batch_size=16, run_dir=str(tmp_path / "-".join([accelerator, *(f"{k}={v}" for k, v in cfg.items())])), **cfg),
        accelerator=accelerator, devices=1,
    )
    return trainer, trainer.fit(sign_images(96, 0), sign_images(40, 1))


def test_an_eager_fit_on_torch_tpu_follows_the_cpu_fit(tmp_path):
    tpu_trainer, on_tpu = _fit(tmp_path, "tpu")
    assert tpu_trainer.runtime.kind == "tpu"
    assert tpu_trainer.runtime.device.type == "tpu"
    _, on_cpu = _fit(tmp_path, "cpu")
    for a, b in zip(on_cpu, on_tpu):
        for key in ("train_loss", "val_loss"):
            assert b[key] == pytest.approx(a[key], rel=2e-2), key


def test_a_compiled_fit_on_torch_tpu_follows_the_eager_one(tmp_path):
    _, eager = _fit(tmp_path, "tpu")
    compiled_trainer, compiled = _fit(tmp_path, "tpu", compile=True)
    assert compiled_trainer._forward is not compiled_trainer.model  # really under torch.compile
    for a, b in zip(eager, compiled):
        for key in ("train_loss", "val_loss"):
            assert b[key] == pytest.approx(a[key], rel=2e-2), key


def test_bf16_on_torch_tpu_autocasts_the_forward(tmp_path):
    _, bf16 = _fit(tmp_path, "tpu", precision="bf16")
    _, fp32 = _fit(tmp_path, "tpu")
    assert bf16[-1]["train_loss"] == pytest.approx(fp32[-1]["train_loss"], rel=5e-2)
