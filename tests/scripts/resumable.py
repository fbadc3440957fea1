"""A small run that checkpoints often, for preemption and kill tests.

Usage: python resumable.py RUN_DIR EPOCHS EVERY_STEPS STEP_SLEEP_S [accelerator] [devices] [strategy]
Prints HISTORY json at the end and saves the final weights to RUN_DIR/final.safetensors.
While the file named by $XLATRAIN_TEST_GATE exists, reading a training item waits: a test holds
the run inside a step for as long as it needs. $XLATRAIN_TEST_VAL_SLEEP: seconds per validation
item (a validation long enough to be stopped in), each read printed as VALIDATION ITEM.
"""

import functools
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import xlatrain


class Slow(Dataset):
    """Random features with a learnable label; sleeps per item so a run lasts long enough to kill."""

    def __init__(self, n: int, seed: int, sleep_s: float, announce: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x[:, :4].sum(dim=1) > 0).long()
        self.sleep_s, self.announce = sleep_s, announce

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if self.announce:
            print("VALIDATION ITEM", flush=True)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        gate = os.environ.get("XLATRAIN_TEST_GATE")
        while gate and os.path.exists(gate):
            time.sleep(0.005)
        return self.x[i], self.y[i]


def main() -> None:
    run_dir, epochs, every, sleep_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    accelerator = sys.argv[5] if len(sys.argv) > 5 else "cpu"
    devices = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] != "-" else None
    strategy = sys.argv[7] if len(sys.argv) > 7 else "auto"
    torch.manual_seed(0)
    # Dropout makes the result depend on the restored RNG state; width makes saves take a while.
    model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Dropout(0.2), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 2))
    trainer = xlatrain.Trainer(
        model,
        nn.CrossEntropyLoss(),
        functools.partial(torch.optim.Adam, lr=1e-3),
        scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.7),
        config=xlatrain.TrainConfig(epochs=epochs, batch_size=8, log_every=1, run_dir=run_dir),
        checkpoint=xlatrain.CheckpointConfig(every_steps=every, keep_last=2),
        backend=xlatrain.BackendConfig(accelerator=accelerator, devices=devices, strategy=strategy),
    )
    val_sleep = float(os.environ.get("XLATRAIN_TEST_VAL_SLEEP", "0"))
    history = trainer.fit(Slow(96, 1, sleep_s), Slow(20, 2, val_sleep, announce=val_sleep > 0))
    trainer.save_weights(f"{run_dir}/final.safetensors")  # every process: a sharded model is gathered
    if trainer.backend.is_main:
        print("HISTORY " + json.dumps(history), flush=True)


if __name__ == "__main__":
    main()
