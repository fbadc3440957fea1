"""A tiny Trainer for tests that must run in a child process (resource limits, signals)."""

import functools

import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain


def tiny(run_dir: str):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    trainer = xlatrain.Trainer(
        nn.Linear(4, 2),
        nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(batch_size=4, log_every=2, run_dir=run_dir),
        checkpoint=xlatrain.CheckpointConfig(every_steps=1),
        backend="cpu",
    )
    return trainer, TensorDataset(x, (x[:, 0] > 0).long())
