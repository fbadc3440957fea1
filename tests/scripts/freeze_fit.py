"""A run whose callback freezes the first layer from epoch 2 on, in on_epoch_start: a change a
callback makes for an epoch, which a resumed run must make again. Usage: freeze_fit.py RUN_DIR
[SLEEP_S]. Prints HISTORY and writes RUN_DIR/final.safetensors."""

import functools
import json
import sys
import time

import torch
from torch import nn

import xlatrain


class FreezeFromEpoch2:
    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def on_epoch_start(self, trainer, epoch):
        trainer.model[0].requires_grad_(epoch < 2)

    def on_epoch_end(self, trainer, row):
        if row["epoch"] == 1:
            trainer.save_weights(f"{trainer.run_dir}/epoch1.safetensors")

    def on_interval(self, trainer, values):
        time.sleep(self.sleep_s)  # time for a kill to land mid-epoch


def main() -> None:
    run_dir = sys.argv[1]
    sleep_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    trainer = xlatrain.Trainer(
        model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        config=xlatrain.TrainConfig(epochs=3, batch_size=4, log_every=1, run_dir=run_dir, tensorboard=False),
        checkpoint=xlatrain.CheckpointConfig(every_steps=2), accelerator="cpu",
        callbacks=[FreezeFromEpoch2(sleep_s)],
    )
    history = trainer.fit(data)
    trainer.save_weights(f"{run_dir}/final.safetensors")
    print("HISTORY " + json.dumps(history), flush=True)


if __name__ == "__main__":
    main()
