"""xlatrain.spawn (one process per XLA device) running a fit slow enough to stop with a signal.

Usage: python spawn_stoppable.py RUN_DIR
"""

import functools
import json
import sys
import time

import torch
from torch import nn

import xlatrain


class Slow:
    def on_interval(self, trainer, values):
        time.sleep(0.05)


def train(index: int, run_dir: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    trainer = xlatrain.Trainer(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(epochs=3, batch_size=8, run_dir=run_dir, log_every=1, tensorboard=False),
        backend=xlatrain.BackendConfig(accelerator="xla", xla_mode="multiprocess"), callbacks=[Slow()],
        checkpoint=xlatrain.CheckpointConfig(every_steps=2),
    )
    history = trainer.fit(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()))
    if trainer.backend.is_main:
        print("HISTORY " + json.dumps(history), flush=True)


if __name__ == "__main__":
    xlatrain.spawn(train, args=(sys.argv[1],), devices=1)
