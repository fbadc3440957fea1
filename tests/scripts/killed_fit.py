"""A fit killed with SIGKILL at a moment a test names: ``epoch-written`` (the first epoch's history
and best weights written, its checkpoint not yet: the window an epoch's end has) or ``fit-end``
(every epoch checkpointed, in an ``on_fit_end`` callback). ``none``: no kill. Prints HISTORY."""

import functools
import json
import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain

run_dir, when = sys.argv[1], sys.argv[2]


if when == "epoch-written":  # the kill lands as the epoch's checkpoint write begins
    from xlatrain.train import resumable

    save = resumable.save_checkpoint

    def killed_in_save(trainer, cursor, sums):
        if cursor.epoch == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return save(trainer, cursor, sums)

    resumable.save_checkpoint = killed_in_save


class Kill:
    def on_fit_end(self, trainer, history):
        if when == "fit-end":
            os.kill(os.getpid(), signal.SIGKILL)


g = torch.Generator().manual_seed(0)
x = torch.randn(32, 4, generator=g)
torch.manual_seed(0)
trainer = xlatrain.Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                           config=xlatrain.TrainConfig(epochs=2, batch_size=8, run_dir=run_dir, tensorboard=False),
                           backend="cpu", callbacks=[Kill()])
history = trainer.fit(TensorDataset(x, (x[:, 0] > 0).long()))
print("HISTORY " + json.dumps(history))
