"""Dict items, a two-term loss with no per-sample form, and optionally OneCycleLR stepped per
optimizer step; prints the per-epoch history as JSON (run in a fresh process by tests).

Usage: python pipeline_trajectory.py ACCELERATOR DEVICES PER_DEVICE_BATCH EPOCHS RUN_DIR [onecycle]
"""

import functools
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import xlatrain


class DictItems(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.image = torch.rand(n, 1, 8, 8, generator=g)
        self.mask = (self.image > 0.5).float()
        self.depth = self.image * 0.5

    def __len__(self) -> int:
        return len(self.image)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.image[i], "mask": self.mask[i], "depth": self.depth[i]}


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Conv2d(1, 4, 3, padding=1)
        self.mask = nn.Conv2d(4, 1, 1)
        self.depth = nn.Conv2d(4, 1, 1)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(image))
        return self.mask(h), self.depth(h)


def mask_and_depth(outputs, targets):
    """Two terms, each a mean over the batch's pixels, and no per-sample form (no reduction=)."""
    (mask_logits, depth), (mask, depth_true) = outputs, targets
    bce = F.binary_cross_entropy_with_logits(mask_logits, mask)
    mse = F.mse_loss(depth, depth_true)
    return {"loss": bce + mse, "bce": bce, "mse": mse}


def main() -> None:
    accelerator, devices, batch, epochs, run_dir = sys.argv[1:6]
    onecycle = len(sys.argv) > 6 and sys.argv[6] == "onecycle"
    scheduler_fn = (
        (lambda opt, run: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=run.total_steps))
        if onecycle else None
    )
    trainer = xlatrain.Trainer(
        TwoHeads(), mask_and_depth, functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        scheduler_fn=scheduler_fn,
        config=xlatrain.TrainConfig(epochs=int(epochs), batch_size=int(batch), task="none", log_every=1000,
                                    run_dir=run_dir, scheduler_interval="step" if onecycle else "epoch"),
        inputs="image", targets=("mask", "depth"), accelerator=accelerator, devices=int(devices),
    )
    history = trainer.fit(DictItems(128, 1), DictItems(37, 2))
    if trainer.backend.is_main:
        used = trainer.optimizer.param_groups[0]["lr"]
        print("HISTORY " + json.dumps(history))
        print("LAST_LR " + json.dumps({"final_lr": float(used), "scheduler_steps": trainer.scheduler.last_epoch if trainer.scheduler else 0}))


if __name__ == "__main__":
    main()
