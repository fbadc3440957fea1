"""Weights written into a model between forwards, under a strategy that may shard it: the EMA
swapped in to be scored, batch norm recomputed for it (ema_bn_batches), and xlatrain.load_weights.

Usage: python fsdp_weights.py RUN_DIR PER_DEVICE_BATCH STRATEGY [STRATEGY ...]
One job per strategy, in the same processes, each from the same seed; before each the main process
prints ``JOB <strategy>``. A job fits two models with an EMA monitored by ``val_ema_loss``:
``blocks`` (two repeated blocks, FSDP's units, between layers the root holds) and ``bn`` (batch
norm, ``ema_bn_batches=2``); then it loads the blocks model's best.safetensors (the EMA weights of
its best epoch) into that model with xlatrain.load_weights and evaluates, and loads a file that
lacks a weight. The main process prints ``RESULT {...}``.
"""

import functools
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def data(n: int, seed: int, scale: float = 1.0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g) * scale + (scale - 1)
    return TensorDataset(x, (x.sum(1) > 6 * (scale - 1)).long() + (x[:, 0] > 1 + (scale - 1)).long())


def fit(model: nn.Module, run_dir: Path, strategy: str, batch: int, scale: float, **cfg) -> tuple[xlatrain.Trainer, list]:
    trainer = xlatrain.Trainer(
        model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), strategy=strategy,
        config=xlatrain.TrainConfig(epochs=3, batch_size=batch, run_dir=str(run_dir), log_every=1000, ema_decay=0.9,
                                    monitor="val_ema_loss", monitor_mode="min", **cfg))
    history = trainer.fit(data(96, 1, scale), data(37, 2, scale))
    return trainer, [[row["val_loss"], row["val_ema_loss"]] for row in history]


def job(root: Path, batch: int, strategy: str) -> None:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = Blocks()
    trainer, blocks = fit(model, root / "blocks", strategy, batch, 1.0)
    result = {"blocks": blocks}
    best = root / "blocks" / "best.safetensors"
    try:
        xlatrain.load_weights(model, best)
        result["loaded"] = trainer.evaluate(data(37, 2))["loss"]
    except Exception as exc:  # the test says what went wrong
        result["loaded"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    partial = root / "blocks" / "partial.safetensors"
    if trainer.backend.is_main:
        save_file({k: v for k, v in load_file(best).items() if k != "head.bias"}, str(partial))
    trainer.strategy.barrier()
    try:
        xlatrain.load_weights(model, partial)
        result["partial"] = "loaded"
    except Exception as exc:
        result["partial"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    torch.manual_seed(0)
    norm = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    _, result["bn"] = fit(norm, root / "bn", strategy, batch, 3.0, ema_bn_batches=2)
    if trainer.backend.is_main:
        print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    root, batch, strategies = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    for strategy in strategies:
        if os.environ.get("RANK", "0") == "0":
            print(f"JOB {strategy}", flush=True)
        job(root / strategy, batch, strategy)


if __name__ == "__main__":
    main()
