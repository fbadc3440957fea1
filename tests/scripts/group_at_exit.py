"""Fit under torchrun, then say at interpreter exit whether the default process group is still up.

Usage: torchrun --nproc-per-node 2 group_at_exit.py RUN_DIR [user_group]
The check is registered before anything else, so it runs after every exit handler the fit left
(atexit runs handlers last-registered first). With ``user_group`` the script makes the group
itself, as a user may, and destroys it once it has been looked at.
"""

import atexit
import functools
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import xlatrain
from trajectory import data, model


def at_exit(user_group: bool) -> None:
    # One write of one line: the two ranks share the launcher's output.
    os.write(1, f"GROUP AT EXIT rank {os.environ['RANK']} initialized={dist.is_initialized()}\n".encode())
    if user_group and dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    run_dir, user_group = sys.argv[1], sys.argv[2:] == ["user_group"]
    atexit.register(at_exit, user_group)
    if user_group:
        dist.init_process_group("gloo")
    trainer = xlatrain.Trainer(
        model(),
        nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(epochs=1, batch_size=8, run_dir=run_dir, log_every=1000),
        backend=xlatrain.BackendConfig(accelerator="cpu"),
    )
    trainer.fit(data(64, 1), data(16, 2))


if __name__ == "__main__":
    main()
