"""A metric object of the user's own (update/compute, no torch.distributed in it), monitored with
early stopping, on two processes: each process writes its last history row and the metric computed
by hand over the whole validation set with the final weights to RUN_DIR/streaming-RANK.json.

Usage: torchrun --nproc-per-node 2 streaming_agree.py RUN_DIR STRATEGY
"""

import functools
import json
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import xlatrain


class MeanCE:
    """The running-mean meter users write."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.total, self.n = 0.0, 0

    def update(self, preds, targets):
        self.total += float(F.cross_entropy(preds, targets, reduction="sum"))
        self.n += len(targets)

    def compute(self):
        # "counts" is no history column: left out, and said once, not once per process
        return {"ce": self.total / self.n, "rows": float(self.n), "counts": torch.zeros(2, 2, dtype=torch.int64)}


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long() + (x[:, 0] > 1).long())


def main() -> None:
    run_dir, strategy = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    val = data(37, 2)  # 37 rows: the last batches of each process are part padding
    trainer = xlatrain.Trainer(
        nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.8, momentum=0.9), metrics_fn=MeanCE(),
        config=xlatrain.TrainConfig(epochs=4, batch_size=8, run_dir=run_dir, tensorboard=False, monitor="val_ce",
                                    monitor_mode="min", early_stop_patience=1),
        checkpoint=xlatrain.CheckpointConfig(enabled=False), accelerator="cpu", strategy=strategy,
    )
    history = trainer.fit(data(96, 1), val)
    model = trainer.strategy.unwrap(trainer.model)
    model.eval()
    with torch.no_grad():
        # Under FSDP every process takes part in the forward.
        hand = float(F.cross_entropy(model(val.tensors[0]), val.tensors[1]))
    with open(f"{run_dir}/streaming-{os.environ['RANK']}.json", "w") as f:
        json.dump({"epochs": len(history), "ce": history[-1]["val_ce"], "rows": history[-1]["val_rows"],
                   "hand": hand}, f)


if __name__ == "__main__":
    main()
