"""A 3-epoch fit on XLA:CPU with ragged dataset sizes and a per-epoch LR schedule.

Usage: python compile_count.py RUN_DIR [multilabel]

Prints the history (with each epoch's xla_compilations column) as JSON.
"""

import functools
import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain


def main() -> None:
    run_dir = sys.argv[1]
    multilabel = len(sys.argv) > 2 and sys.argv[2] == "multilabel"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(150, 6, generator=g)  # 150 % 16 != 0: a ragged tail in train and validation
    y = (x.sum(dim=1) > 0).long()
    if multilabel:  # the AUC path: outputs gathered to the host at every evaluation
        y = torch.stack([y, (x[:, 0] > 0).long()], dim=1).float()
    torch.manual_seed(0)
    trainer = xlatrain.Trainer(
        nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)),
        nn.BCEWithLogitsLoss() if multilabel else nn.CrossEntropyLoss(),
        functools.partial(torch.optim.Adam, lr=1e-2),
        scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
        config=xlatrain.TrainConfig(epochs=3, batch_size=4, log_every=3, run_dir=run_dir),
        backend=xlatrain.BackendConfig(accelerator="xla", devices=4),
    )
    history = trainer.fit(TensorDataset(x[:110], y[:110]), TensorDataset(x[110:], y[110:]))
    print("HISTORY " + json.dumps(history))


if __name__ == "__main__":
    main()
