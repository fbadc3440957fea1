"""Train with a user's sampler, alone or under torchrun; the main process prints HISTORY and READ.

Usage: python sampler_fit.py RUN_DIR MODE PER_DEVICE_BATCH [xla]  (xla: 4 virtual XLA:CPU devices, SPMD)
MODE: shared (one order for every process, a reversed-stride permutation), factory
(DistributedSampler built per process), uneven (a per-process sampler that gives rank 1 fewer
indices than rank 0). READ: per process, the dataset indices its batches held, in order.
Several modes, comma-separated, fit one after another in the same processes (in RUN_DIR/MODE),
each after a line ``JOB MODE`` from the main process: one launch for several fits.
"""

import functools
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

import xlatrain

N, DIM = 64, 6


class Logged(Dataset):
    """Items carry their own index, so each process's reads can be shown."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, DIM, generator=g)
        self.y = (self.x[:, 0] > 0).long()
        self.read = []

    def __len__(self):
        return N

    def __getitem__(self, i):
        self.read.append(i)
        return self.x[i], self.y[i]


class Uneven(torch.utils.data.Sampler):
    def __init__(self, dataset, num_replicas, rank):
        self.indices = list(range(rank, N, num_replicas))[: 24 if rank == 0 else 16]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def main() -> None:
    run_dir, modes, batch = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    where = {"accelerator": "xla", "devices": 4} if sys.argv[4:] == ["xla"] else {"accelerator": "cpu"}
    if len(modes) == 1:
        fit(run_dir, modes[0], batch, where)
        return
    for mode in modes:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"JOB {mode}", flush=True)
        fit(f"{run_dir}/{mode}", mode, batch, where)


def fit(run_dir: str, mode: str, batch: int, where: dict) -> None:
    sampler = {
        "shared": [(37 * i) % N for i in range(N)][::-1],
        "factory": functools.partial(DistributedSampler, shuffle=False),
        "uneven": Uneven,
    }[mode]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 2))
    data = Logged()
    trainer = xlatrain.Trainer(
        model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
        # Items are read in this process (num_workers=0), where the dataset records them.
        config=xlatrain.TrainConfig(epochs=2, batch_size=batch, run_dir=run_dir, log_every=1000, diagnostics=False,
                                    tensorboard=False, num_workers=0),
        checkpoint=xlatrain.CheckpointConfig(enabled=False),
        sampler=sampler, **where,
    )
    data.read.clear()  # the dry run's and the memory plan's reads are not training batches
    history = trainer.fit(data)
    reads = trainer.strategy.gather_objects(data.read) if dist.is_initialized() else [data.read]
    if trainer.is_main:
        print("HISTORY " + json.dumps(history))
        print("READ " + json.dumps(reads))


if __name__ == "__main__":
    main()
