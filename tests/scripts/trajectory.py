"""Train a tiny model and print its per-epoch history as JSON (run in a fresh process by tests).

Usage: python trajectory.py ACCELERATOR DEVICES PER_DEVICE_BATCH EPOCHS RUN_DIR [XLA_MODE] [scale_lr]
The global batch is PER_DEVICE_BATCH x devices; tests pick values that keep it equal.
"""

import functools
import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    return TensorDataset(x, y)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 3))


def main() -> None:
    accelerator, devices, batch, epochs, run_dir = sys.argv[1:6]
    xla_mode = sys.argv[6] if len(sys.argv) > 6 else "spmd"
    scale_lr = len(sys.argv) > 7 and sys.argv[7] == "scale_lr"
    trainer = xlatrain.Trainer(
        model(),
        nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        config=xlatrain.TrainConfig(epochs=int(epochs), batch_size=int(batch), run_dir=run_dir, log_every=1000,
                                    scale_lr=scale_lr),
        backend=xlatrain.BackendConfig(accelerator=accelerator, devices=int(devices), xla_mode=xla_mode),
    )
    history = trainer.fit(data(160, 1), data(50, 2))
    if trainer.backend.is_main:
        print("HISTORY " + json.dumps(history))


if __name__ == "__main__":
    main()
