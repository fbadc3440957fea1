"""A small image classifier fitted on XLA:CPU (or the CPU) with one recompilation cause planted.

Usage: python diag_fit.py RUN_DIR CAUSE [ACCELERATOR [DEVICES]]

CAUSE is one of
  clean   full batches of one shape, nothing read mid-step: what a healthy run compiles
  scalar  the model multiplies by a Python float that is 0.5 until train step GAIN_STEP of
          epoch 2 and 1.0 from then on; torch_xla sends 0.5 to the device as a graph input but
          bakes 1.0 into the graph as a constant, so that step compiles a graph with one input fewer
  item    the loss calls .item() on a device tensor every training step
  ragged  a BatchSource whose last training batch of each epoch is short
  slow    an in-memory dataset that sleeps in __getitem__ (a loader slower than the step)
  slow_val  slow, and its validation set as slow (an epoch's time is half validation)
  masked  the model sums its activations above their mean by boolean-mask indexing, an op
          whose output size depends on the values
  accumulate  clean, with gradients accumulated over two micro-batches per optimizer step
          (its warm-up spans the first four micro-batches)
  ema     clean, with an EMA of the weights (scored each epoch, written to ema.safetensors) under
          strict
  nan_first  clean but for a NaN loss at the first training step, under nan_policy='skip_step'
          and strict: the step is skipped and SGD's momentum it made is dropped, made again at
          the next step

Prints ``REPORT`` lines (what the run printed as its diagnostics) and ``HISTORY`` followed by
RUN_DIR/diagnostics.json.
"""

import json
import logging
import sys
import time

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import xlatrain
from xlatrain.logs import install_console_handler

SIZE = 16  # image side, pixels
NUM_SAMPLES = 64
BATCH = 4  # per device
GAIN_STEP = 3  # train step of epoch 2 at which the planted Python float becomes 1.0
CHECKPOINT_EVERY = 5  # optimizer steps; checkpoints at epoch end too, as by default
LOG_EVERY = 3  # steps between progress lines (each a planned device read)


class Net(nn.Module):
    def __init__(self, planted_gain: bool, steps_per_epoch: int, step_batch: int, masked: bool = False) -> None:
        super().__init__()
        self.masked = masked
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)
        self.planted_gain = planted_gain
        self.switch_at = steps_per_epoch + GAIN_STEP  # the 1-based training forward that switches
        self.step_batch = step_batch  # rows a training step's forward sees
        self.train_calls = 0  # host-side count of training forwards

    def forward(self, x):
        x = torch.relu(self.conv(x)).mean(dim=(2, 3))
        if self.planted_gain:
            # Training steps only: the memory plan's forwards before the first step (a few
            # samples) are not steps.
            if self.training and x.shape[0] == self.step_batch:
                self.train_calls += 1
            x = x * (1.0 if self.train_calls >= self.switch_at else 0.5)
        if self.masked:
            x = x + 0.0 * x[x > x.mean()].sum()  # a size that depends on the values: a graph per size
        return self.head(x)


class NanFirst:
    """Cross-entropy, NaN at the first training step (a callback too: the checks before it are
    not steps)."""

    def __init__(self):
        self.training_calls = None

    def on_fit_start(self, trainer):
        self.training_calls = 0

    def __call__(self, outputs, targets, reduction="mean"):
        loss = nn.functional.cross_entropy(outputs, targets, reduction=reduction)
        if self.training_calls is None or not torch.is_grad_enabled():
            return loss
        self.training_calls += 1
        return loss * float("nan") if self.training_calls == 1 else loss


def item_loss(outputs, targets, reduction="mean"):
    loss = nn.functional.cross_entropy(outputs, targets, reduction=reduction)
    if reduction == "mean":
        loss.item()  # the tutorial habit: read the loss on the host every step
    return loss


class RaggedSource:
    """A BatchSource breaking the full-batch rule: each epoch's last training batch is short."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.images)

    def train_batches(self, *, loader_batch, epoch, **_):
        for k in range(3):
            rows = slice(k * loader_batch, k * loader_batch + (3 if k == 2 else loader_batch))
            yield self.images[rows], self.labels[rows]

    def eval_batches(self, *, loader_batch, **_):
        yield (self.images[:loader_batch], self.labels[:loader_batch]), torch.ones(loader_batch, dtype=torch.bool)


class SlowImages(Dataset):
    """Images already in memory, handed out slowly: a loader that cannot keep up."""

    def __init__(self, images, labels, delay_s):
        self.images, self.labels, self.delay_s = images, labels, delay_s

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return self.images[i], self.labels[i]


def main() -> None:
    run_dir, cause = sys.argv[1], sys.argv[2]
    accelerator = sys.argv[3] if len(sys.argv) > 3 else "xla"
    devices = int(sys.argv[4]) if len(sys.argv) > 4 else (2 if accelerator == "xla" else None)
    install_console_handler()
    records: list[str] = []
    capture = logging.Handler()
    capture.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("xlatrain").addHandler(capture)

    g = torch.Generator().manual_seed(0)
    images = torch.randn(NUM_SAMPLES, 3, SIZE, SIZE, generator=g)
    labels = (images.mean(dim=(1, 2, 3)) > 0).long()
    data = TensorDataset(images, labels)
    train, val = data, data
    if cause == "ragged":
        train = RaggedSource(images, labels)
    elif cause in ("slow", "slow_val"):
        train = SlowImages(images, labels, delay_s=0.03)
        if cause == "slow_val":
            val = SlowImages(images, labels, delay_s=0.03)
    per_step = BATCH * (devices or 1)
    torch.manual_seed(0)
    model = Net(planted_gain=cause == "scalar", steps_per_epoch=NUM_SAMPLES // per_step, step_batch=per_step,
                masked=cause == "masked")
    loss = {"item": item_loss, "nan_first": NanFirst()}.get(cause, nn.CrossEntropyLoss())
    trainer = xlatrain.Trainer(
        model, loss, lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        callbacks=[loss] if cause == "nan_first" else None,
        config=xlatrain.TrainConfig(epochs=3, batch_size=BATCH, log_every=LOG_EVERY, run_dir=run_dir,
                                    grad_accum_steps=2 if cause == "accumulate" else 1,
                                    **({"nan_policy": "skip_step", "strict": True} if cause == "nan_first" else {}),
                                    **({"ema_decay": 0.9, "strict": True} if cause == "ema" else {})),
        checkpoint=xlatrain.CheckpointConfig(every_steps=CHECKPOINT_EVERY),
        backend=xlatrain.BackendConfig(accelerator=accelerator, devices=devices),
    )
    history = trainer.fit(train, val)
    print("NONFINITE " + json.dumps([row.get("nonfinite_steps") for row in history]))
    start = next(i for i, line in enumerate(records) if line.startswith("diagnostics"))
    for line in records[start:]:
        for part in line.splitlines():
            print("REPORT " + part)
    print("HISTORY " + json.dumps(json.load(open(f"{run_dir}/diagnostics.json"))))


if __name__ == "__main__":
    main()
