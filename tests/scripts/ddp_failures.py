"""Failures under torchrun DDP over two processes (tests/train/test_ddp_failures.py).

Usage: torchrun --nproc-per-node 2 ddp_failures.py CASE RUN_DIR [STRATEGY (default ddp)]
CASE: unused       a parameter the forward never uses (an auxiliary head): trains, as on one process
      unused_later a head the forward uses only on batches whose first sample is one of the set's
                   first eight (the dry run's batch is): DDP's reducer stops at a later step
      peer_fails   rank 1's dataset raises in epoch 2: rank 0 sees its connection close
"""

import functools
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import Dataset

import xlatrain

RANK = int(os.environ.get("RANK", "0"))


class Net(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case
        self.body = nn.Linear(6, 3)
        self.aux = nn.Linear(6, 3)

    def forward(self, x):
        out = self.body(x)
        if self.case == "unused_later" and bool(x[0, -1] > 50):
            out = out + self.aux(x)
        return out


class Data(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.x[:8, -1] = 100.0  # the first samples mark the batches that use the auxiliary head
        self.y = (self.x[:, :5].sum(1) > 0).long()
        self.armed = False

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.armed and RANK == 1:
            raise KeyError(f"bad sample {i} on rank 1")
        return self.x[i], self.y[i]


class Arm:
    def __init__(self, data):
        self.data = data

    def on_epoch_start(self, trainer, epoch):
        self.data.armed = epoch == 2


def main() -> None:
    case, run_dir = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    train = Data(64, 1)
    trainer = xlatrain.Trainer(
        Net(case), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(epochs=2, batch_size=8, run_dir=run_dir, log_every=1000, tensorboard=False),
        checkpoint=xlatrain.CheckpointConfig(enabled=False), accelerator="cpu",
        strategy=sys.argv[3] if len(sys.argv) > 3 else "ddp",
        callbacks=[Arm(train)] if case == "peer_fails" else None,
    )
    history = trainer.fit(train, Data(20, 2))
    if trainer.is_main:
        print("HISTORY " + json.dumps([{k: r[k] for k in ("epoch", "train_loss")} for r in history]))


if __name__ == "__main__":
    main()
