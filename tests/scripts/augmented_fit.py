"""A run whose batches draw random numbers in the dataset (noise, a flip chosen by Python's and
NumPy's generators) and in a mixup-style collate, with dropout in the model, checkpointing every 2
steps. Usage: augmented_fit.py RUN_DIR NUM_WORKERS [SLEEP_S] [accelerator] [strategy]. Prints
HISTORY json and writes RUN_DIR/final.safetensors (main process)."""

import functools
import json
import random
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

import xlatrain

CLASSES = 3


class Augmented(Dataset):
    def __init__(self, n: int, seed: int, sleep_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 12, generator=g)
        self.y = (self.x[:, :3].sum(dim=1) > 0).long() + (self.x[:, 3] > 1).long()
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        x = self.x[i] + 0.1 * torch.randn(12)  # torch's generator
        if random.random() < 0.5:  # Python's
            x = x.flip(0)
        x = x * float(np.random.uniform(0.9, 1.1))  # NumPy's
        return x, self.y[i]


def mixup(items):
    x = torch.stack([item[0] for item in items])
    y = nn.functional.one_hot(torch.stack([item[1] for item in items]), CLASSES).float()
    lam = float(torch.rand(()))
    perm = torch.randperm(len(items))
    return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]


def main() -> None:
    run_dir, workers = sys.argv[1], sys.argv[2]
    sleep_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    accelerator = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    strategy = sys.argv[5] if len(sys.argv) > 5 else "auto"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, CLASSES))
    trainer = xlatrain.Trainer(
        model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        collate_fn=mixup, eval_collate_fn=xlatrain.collate,
        config=xlatrain.TrainConfig(epochs=3, batch_size=8, log_every=1, run_dir=run_dir, tensorboard=False,
                                    num_workers=workers if workers == "auto" else int(workers)),
        checkpoint=xlatrain.CheckpointConfig(every_steps=2, keep_last=2),
        accelerator=accelerator, strategy=strategy,
    )
    history = trainer.fit(Augmented(64, 1, sleep_s), Augmented(20, 2))
    trainer.save_weights(f"{run_dir}/final.safetensors")
    if trainer.is_main:
        print("HISTORY " + json.dumps(history), flush=True)


if __name__ == "__main__":
    main()
