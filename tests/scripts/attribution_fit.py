"""A tiny fit on XLA:CPU (one device) with three one-off graph splits planted.

Usage: python attribution_fit.py RUN_DIR

- epoch 1, train step 5: the model prints a device tensor (a host copy);
- epoch 2, train step 3: the model runs torch.linalg.eigvals (aten::linalg_eig runs on the CPU);
- after each epoch's end: an on_epoch_end callback reads float(weight.norm()) (a device read).

Prints ``HISTORY`` followed by RUN_DIR/diagnostics.json.
"""

import io
import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain

SIZE, NUM_SAMPLES, BATCH, EPOCHS = 16, 32, 4, 3
STEPS = NUM_SAMPLES // BATCH


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)
        self.train_calls = 0  # host-side count of training steps' forwards

    def forward(self, x):
        h = torch.relu(self.conv(x)).mean(dim=(2, 3))
        if self.training and x.shape[0] == BATCH:  # steps only, not the checks before the first
            self.train_calls += 1
            if self.train_calls == 5:
                print("mean", h.mean(), file=io.StringIO())
            if self.train_calls == STEPS + 3:
                m = h[:2, :2].detach() + torch.eye(2, device=h.device)
                h = h + 0.0 * torch.linalg.eigvals(m).real.sum()
        return self.head(h)


class WeightNorm:
    def on_epoch_end(self, trainer, row):
        float(trainer.model.head.weight.detach().norm())


def main() -> None:
    run_dir = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    images = torch.randn(NUM_SAMPLES, 3, SIZE, SIZE, generator=g)
    labels = (images.mean(dim=(1, 2, 3)) > 0).long()
    data = TensorDataset(images, labels)
    torch.manual_seed(0)
    trainer = xlatrain.Trainer(
        Net(), nn.CrossEntropyLoss(), lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        callbacks=[WeightNorm()],
        config=xlatrain.TrainConfig(epochs=EPOCHS, batch_size=BATCH, log_every=100, run_dir=run_dir),
        backend=xlatrain.BackendConfig(accelerator="xla", devices=1),
    )
    trainer.fit(data, data)
    print("HISTORY " + json.dumps(json.load(open(f"{run_dir}/diagnostics.json"))))


if __name__ == "__main__":
    main()
