"""A deliberately bad training setup on XLA:CPU, for the run diagnostics.

Usage: python bad_loop.py RUN_DIR good|bad [strict]
bad: the loss calls .item() every step, and a custom BatchSource yields a ragged last batch and
a batch of another image size each epoch. good: the same model on a plain static dataset.
"""

import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain


class Ragged:
    """A BatchSource breaking the rules: varying image sizes and a short last batch."""

    def __len__(self):
        return 64

    def _batch(self, k, size, rows):
        g = torch.Generator().manual_seed(k)
        return torch.randn(rows, 1, size, size, generator=g), torch.randint(0, 2, (rows,), generator=g)

    def train_batches(self, *, loader_batch, epoch, **_):
        for k in range(4):
            size = 12 if k == 2 else 8  # one batch of another image size
            rows = 3 if k == 3 else loader_batch  # a ragged tail
            yield self._batch(k, size, rows)

    def eval_batches(self, *, loader_batch, **_):
        x, y = self._batch(99, 8, loader_batch)
        yield (x, y), torch.ones(loader_batch, dtype=torch.bool)


def item_loss(outputs, targets, reduction="mean"):
    loss = nn.functional.cross_entropy(outputs, targets, reduction=reduction)
    if reduction == "mean":
        print(f"loss {loss.item():.4f}")  # the tutorial habit: one device read per step
    return loss


def main():
    run_dir, kind = sys.argv[1], sys.argv[2]
    strict = len(sys.argv) > 3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    if kind == "bad":
        data, loss = Ragged(), item_loss
    else:
        g = torch.Generator().manual_seed(0)
        data, loss = TensorDataset(torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 2, (64,), generator=g)), nn.CrossEntropyLoss()
    trainer = xlatrain.Trainer(
        model, loss, lambda p: torch.optim.SGD(p, lr=0.1),
        config=xlatrain.TrainConfig(epochs=3, batch_size=4, log_every=1000, run_dir=run_dir, strict=strict),
        backend=xlatrain.BackendConfig(accelerator="xla", devices=4),
    )
    try:
        trainer.fit(data, data)
    except xlatrain.DiagnosticsError as exc:
        print("STRICT " + str(exc))
        return
    print("HISTORY " + json.dumps(json.load(open(f"{run_dir}/diagnostics.json"))))


if __name__ == "__main__":
    main()
