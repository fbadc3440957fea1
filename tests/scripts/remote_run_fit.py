"""Train with run_dir on object storage; print HISTORY. Optionally die by SIGKILL mid-upload.

Usage: python remote_run_fit.py URL EPOCHS [KILL_AT_CHECKPOINT]
(with STORAGE_EMULATOR_HOST set). KILL_AT_CHECKPOINT=k: while the k-th checkpoint of this process
goes up, SIGKILL this process right after its first file, before its meta.json.
"""

import functools
import json
import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain
from xlatrain import storage


def main() -> None:
    url, epochs = sys.argv[1], int(sys.argv[2])
    kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    if kill_at is not None:
        real, seen = storage.upload, []

        def upload(local, target):
            real(local, target)
            if "/checkpoints/step-" in target:
                name = target.split("/checkpoints/")[1].split("/")[0]
                if name not in seen:
                    seen.append(name)
                if len(seen) == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # one file of this checkpoint is up, its meta.json not

        storage.upload = upload
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    trainer = xlatrain.Trainer(
        model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        config=xlatrain.TrainConfig(epochs=epochs, batch_size=8, run_dir=url, diagnostics=False), accelerator="cpu")
    history = trainer.fit(data)
    print("HISTORY " + json.dumps(history), flush=True)


if __name__ == "__main__":
    main()
