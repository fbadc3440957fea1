"""The demo: a small CNN on handwritten digits, bundled beside this file (``digits.csv.gz``).

1,797 real 8x8 scans of digits 0-9, upsampled once to 32x32 so the network sees image-sized
inputs. Runs on whatever ``accelerator="auto"`` finds.

The data is the test set of the UCI "Optical Recognition of Handwritten Digits" dataset (E.
Alpaydin and C. Kaynak, 1998; CC BY 4.0), as scikit-learn ships it (``load_digits``): one row per
scan, 64 pixel counts in 0..16 then the digit. It is read here directly, not through scikit-learn,
whose import (with SciPy's) took longer than the demo's data and model together.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from xlatrain.config import BackendConfig, ModelConfig, OptimizerConfig, RunConfig, ScheduleConfig, TrainConfig
from xlatrain.logs import get_logger
from xlatrain.report import plot_loss_curve

log = get_logger(__name__)

IMAGE_SIZE = 32


DATA = Path(__file__).with_name("digits.csv.gz")


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)``: the 1,797 scans as a ``[1797, 8, 8]`` float tensor of pixel counts
    0..16, and their digits as a ``[1797]`` long tensor."""
    with gzip.open(DATA, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.int64)
    return torch.from_numpy(rows[:, :-1]).float().reshape(-1, 8, 8), torch.from_numpy(rows[:, -1])


def stratified_split(labels: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)`` indices: ``ceil(val_fraction * n)`` rows for validation, each class in
    proportion to its size (the remainders go to the classes with the largest fractional shares),
    each class's rows drawn at random with ``seed``.

    Example:
        >>> train, val = stratified_split(torch.tensor([0] * 6 + [1] * 4), 0.5, seed=0)
        >>> len(train), len(val), int((torch.tensor([0] * 6 + [1] * 4)[val] == 1).sum())
        (5, 5, 2)
    """
    g = torch.Generator().manual_seed(seed)
    classes, sizes = labels.unique(return_counts=True)
    num_val = math.ceil(val_fraction * len(labels))
    share = sizes.double() * num_val / len(labels)
    take = share.floor().long()
    take[torch.argsort(share - take, descending=True, stable=True)[:num_val - int(take.sum())]] += 1
    train, val = [], []
    for c, n in zip(classes.tolist(), take.tolist()):
        rows = (labels == c).nonzero().flatten()
        rows = rows[torch.randperm(len(rows), generator=g)]
        val.append(rows[:n])
        train.append(rows[n:])
    return torch.cat(train).sort().values, torch.cat(val).sort().values


def digits_datasets(image_size: int = IMAGE_SIZE, val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train / validation split (stratified, fixed seed) of the digits as float images in [0, 1]."""
    images, labels = load_digits()
    images = F.interpolate(images[:, None] / 16.0, size=(image_size, image_size), mode="bilinear", align_corners=False)
    train_idx, val_idx = stratified_split(labels, val_fraction, seed)
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[val_idx], labels[val_idx])


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    image_size: int = IMAGE_SIZE
    val_fraction: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        from xlatrain.config import check_fraction, check_int

        check_int("data.image_size", self.image_size, minimum=8)
        check_fraction("data.val_fraction", self.val_fraction)
        check_int("data.seed", self.seed, minimum=0)


def build(config: Any) -> Any:
    """The digits recipe for ``xlatrain fit`` (``model.name``: small_cnn or any classifier)."""
    from xlatrain.config import from_dict
    from xlatrain.recipes.run import RecipeParts, build_recipe_model

    data = from_dict(DataConfig, config.data, section="data")
    train_set, val_set = digits_datasets(data.image_size, data.val_fraction, data.seed)
    torch.manual_seed(config.trainer.seed)
    model = build_recipe_model(config, num_outputs=10, in_channels=1)
    return RecipeParts(model=model, loss_fn=nn.CrossEntropyLoss(), train_data=train_set, val_data=val_set)


def run_demo(
    run_dir: str = "runs/demo",
    epochs: int = 12,
    batch_size: int = 32,
    accelerator: str = "auto",
    devices: int | None = None,
    seed: int = 0,
    resume: bool | str = "auto",
) -> dict[str, Any]:
    """Train the digits CNN (the ``digits`` recipe); returns the last history row. ``resume`` is
    ``Trainer.fit``'s: a finished run in ``run_dir`` is left as it is unless it is ``False`` or
    ``"overwrite"``."""
    from xlatrain.recipes.run import run  # run builds Trainers for every recipe, this one included

    config = RunConfig(
        recipe="digits",
        data={"seed": seed},
        model=ModelConfig(name="small_cnn", width=32),
        optimizer=OptimizerConfig(name="adam", lr=2e-3),
        schedule=ScheduleConfig(name="step", step_size=5, gamma=0.5),
        trainer=TrainConfig(epochs=epochs, batch_size=batch_size, seed=seed, log_every=20, run_dir=run_dir),
        backend=BackendConfig(accelerator=accelerator, devices=devices),
    )
    trainer, history = run(config, resume=resume)
    if trainer.backend.is_main:
        # The run's own directory: under --fresh a new one beside run_dir, which keeps the old run.
        where = trainer.run_location
        plot_loss_curve(trainer.run_dir, history)
        trainer.publish("loss.png")  # a run on object storage gets it too
        plot = f"{where}/loss.png"
        best = max(history, key=lambda r: r["val_accuracy"])
        log.info(
            f"final validation accuracy {history[-1]['val_accuracy']:.4f} "
            f"(best {best['val_accuracy']:.4f} at epoch {best['epoch']}); "
            + (f"wrote {where}/history.csv, {where}/best.safetensors, {plot}" if trainer.epochs_trained else
               f"nothing trained, {where}'s files are as they were ({plot} drawn again)")
        )
    return history[-1]
