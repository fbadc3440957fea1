"""Train from shards on object storage under torchrun; each process prints what it fetched.

Usage: torchrun --nproc-per-node 2 object_store_fit.py URL RUN_DIR (with STORAGE_EMULATOR_HOST set).
Prints ``FETCHED {"rank", "epoch1", "history"}``: the records the process fetched from storage in
epoch 1, and the run's history.
"""

import functools
import json
import sys

import torch
from torch import nn

import xlatrain
from xlatrain.data import shards


def main() -> None:
    url, run_dir = sys.argv[1], sys.argv[2]
    fetched = []
    real = shards._RemoteRecords._fetch

    def listen(self, gids, index):  # the real fetch runs; this only listens
        fetched.append(gids.tolist())
        return real(self, gids, index)

    shards._RemoteRecords._fetch = listen
    ds = shards.ShardDataset(url, channels=1, labels=["cls"], target="long", remote_requests=4)
    torch.manual_seed(0)
    model = nn.Sequential(shards.NormalizeInput(mean=[0.5], std=[0.25]), nn.Flatten(), nn.Linear(16 * 16, 3))
    class EpochReads:
        def on_epoch_start(self, trainer, epoch):
            fetched.clear()  # the dry run's reads came before: the epoch's start here

    trainer = xlatrain.Trainer(model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.01),
                               config=xlatrain.TrainConfig(epochs=1, batch_size=8, run_dir=run_dir, diagnostics=False),
                               accelerator="cpu", callbacks=[EpochReads()])
    history = trainer.fit(ds)
    epoch = [g for batch in fetched for g in batch]
    # One write of the whole line: both processes share the pipe, and print() writes the text and
    # its newline apart, which unbuffered (PYTHONUNBUFFERED) lets another process's line land between.
    line = "FETCHED " + json.dumps({"rank": trainer.strategy.process_index, "epoch1": epoch,
                                    "history": [r["train_loss"] for r in history]}) + "\n"
    sys.stdout.write(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
