"""The one-process-per-chip mode: xlatrain.spawn runs a fit in each process (one XLA:CPU device).

Usage: python spawn_fit.py RUN_DIR
"""

import functools
import json
import sys

import torch
from torch import nn

import xlatrain
from trajectory import data, model


def train(index: int, run_dir: str) -> None:
    trainer = xlatrain.Trainer(
        model(),
        nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        config=xlatrain.TrainConfig(epochs=2, batch_size=32, run_dir=run_dir, log_every=1000),
        backend=xlatrain.BackendConfig(accelerator="xla", xla_mode="multiprocess"),
    )
    history = trainer.fit(data(160, 1), data(50, 2))
    if trainer.backend.is_main:
        print("HISTORY " + json.dumps(history), flush=True)


if __name__ == "__main__":
    xlatrain.spawn(train, args=(sys.argv[1],), devices=1)
