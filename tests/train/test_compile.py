"""TrainConfig(compile=True): the model under torch.compile trains as the eager one does.

Tolerance: losses agree to a relative 1e-5 over two epochs on the CPU (measured: 1.5e-7). Inductor
fuses and reorders float32 arithmetic, so bitwise equality is not expected. The model has no dropout:
inductor draws random numbers with its own kernels, so dropout masks differ from eager ones
(``torch._inductor.config.fallback_random = True`` makes them match, at a cost).
"""

import functools

import pytest
import torch
from torch import nn

from conftest import sign_images
from xlatrain import TrainConfig, Trainer


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 8 * 8, 2))


def _fit(tmp_path, compile):
    trainer = Trainer(_model(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.05),
                      config=TrainConfig(epochs=2, batch_size=16, compile=compile, run_dir=str(tmp_path / str(compile))),
                      accelerator="cpu")
    return trainer, trainer.fit(sign_images(96, 0), sign_images(40, 1))


def test_a_compiled_fit_matches_the_eager_fit(tmp_path):
    eager_trainer, eager = _fit(tmp_path, False)
    compiled_trainer, compiled = _fit(tmp_path, True)
    assert compiled_trainer._forward is not compiled_trainer.model  # really under torch.compile
    for a, b in zip(eager, compiled):
        for key in ("train_loss", "val_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
        assert b["val_accuracy"] == a["val_accuracy"]
    # Checkpoints and best weights hold the user's module names, not the compiled wrapper's.
    from xlatrain import load_weights

    load_weights(_model(), tmp_path / "True" / "best.safetensors")


