"""nan_policy='skip_step' with two processes: rank 1's loss is NaN at one training step while its
gradients stay finite (a NaN added to the loss, detached), so only rank 1 finds the step bad.
Each process writes its final weights and history row to RUN_DIR/skip-RANK.json.

Usage: torchrun --nproc-per-node 2 skip_agree.py RUN_DIR GRAD_ACCUM_STEPS [NAN_POLICY]
(under nan_policy='stop' each process writes the error's message instead.)
"""

import functools
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain


class NanOnRank1:
    """Cross-entropy, NaN on rank 1 at its third training step (with accumulation 2, the first
    micro-batch of the second group), with finite gradients. A callback too: training steps are
    the calls after on_fit_start (the dry run before it calls the loss as well)."""

    def __init__(self):
        self.calls, self.started = 0, False

    def on_fit_start(self, trainer):
        self.started = True

    def __call__(self, outputs, targets, reduction="mean"):
        loss = nn.functional.cross_entropy(outputs, targets, reduction=reduction)
        if not (self.started and torch.is_grad_enabled()):
            return loss
        self.calls += 1
        bad = os.environ["RANK"] == "1" and self.calls == 3
        return loss + torch.tensor(float("nan")).detach() if bad else loss


def main() -> None:
    run_dir, accum = sys.argv[1], int(sys.argv[2])
    policy = sys.argv[3] if len(sys.argv) > 3 else "skip_step"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    torch.manual_seed(0)
    loss_fn = NanOnRank1()
    trainer = xlatrain.Trainer(
        nn.Linear(6, 2), loss_fn, functools.partial(torch.optim.SGD, lr=0.1), callbacks=[loss_fn],
        config=xlatrain.TrainConfig(epochs=1, batch_size=4, run_dir=run_dir, log_every=100, nan_policy=policy,
                                    grad_accum_steps=accum, tensorboard=False),
        checkpoint=xlatrain.CheckpointConfig(enabled=False), accelerator="cpu", strategy="ddp",
    )
    if policy == "stop":
        try:
            trainer.fit(TensorDataset(x, (x[:, 0] > 0).long()))
        except xlatrain.NonFiniteLossError as exc:
            with open(f"{run_dir}/stop-{os.environ['RANK']}.txt", "w") as f:
                f.write(str(exc))
        return
    row = trainer.fit(TensorDataset(x, (x[:, 0] > 0).long()))[-1]
    weights = [p.detach().flatten().tolist() for p in trainer.model.parameters()]
    with open(f"{run_dir}/skip-{os.environ['RANK']}.json", "w") as f:
        json.dump({"weights": weights, "row": {k: row[k] for k in ("train_loss", "nonfinite_steps") if k in row}}, f)


if __name__ == "__main__":
    main()
