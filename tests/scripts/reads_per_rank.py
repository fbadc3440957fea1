"""Every host read the Trainer plans, on every process: under torchrun each process writes READS
(its runtime's planned reads, in order: the caller's file and line of each) to
RUN_DIR/reads-RANK.json. A read that one
process makes and another skips would deadlock a TorchTPU mesh.

Usage: torchrun --nproc-per-node 2 reads_per_rank.py RUN_DIR STRATEGY
"""

import functools
import json
import os
import sys
import traceback

import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain


class Interval:
    def on_interval(self, trainer, values):
        pass


def main() -> None:
    run_dir, strategy = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    torch.manual_seed(0)
    trainer = xlatrain.Trainer(
        nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)), nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(epochs=2, batch_size=8, run_dir=run_dir, log_every=2, top_k=(2,), ema_decay=0.9,
                                    nan_policy="skip_step", clip_grad_norm=1.0),
        checkpoint=xlatrain.CheckpointConfig(every_steps=2),
        accelerator="cpu", strategy=strategy, callbacks=[Interval()],
    )
    rt = trainer.runtime
    where = []
    for name in ("read", "defer"):
        original = getattr(rt, name)

        def record(*args, _original=original, _name=name, **kwargs):
            frame = traceback.extract_stack(limit=3)[0]
            where.append(f"{_name} {os.path.basename(frame.filename)}:{frame.lineno}")
            return _original(*args, **kwargs)

        setattr(rt, name, record)
    trainer.fit(data, data)
    trainer.evaluate(data)
    trainer.predict(data)
    trainer.save_weights(f"{run_dir}/final.safetensors")
    with open(f"{run_dir}/reads-{os.environ['RANK']}.json", "w") as f:
        json.dump(where, f)


if __name__ == "__main__":
    main()
