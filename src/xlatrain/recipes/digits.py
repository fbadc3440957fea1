"""The demo: a small CNN on scikit-learn's handwritten digits (bundled with scikit-learn).

1,797 real 8x8 scans of digits 0-9, upsampled once to 32x32 so the network sees image-sized
inputs. Runs on whatever ``accelerator="auto"`` finds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from xlatrain.config import BackendConfig, ModelConfig, OptimizerConfig, RunConfig, ScheduleConfig, TrainConfig
from xlatrain.logs import get_logger
from xlatrain.report import plot_loss_curve

log = get_logger(__name__)

IMAGE_SIZE = 32


def digits_datasets(image_size: int = IMAGE_SIZE, val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train / validation split (stratified, fixed seed) of the digits as float images in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, val_idx = train_test_split(
        range(len(labels)), test_size=val_fraction, random_state=seed, stratify=digits.target
    )
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
) -> dict[str, Any]:
    """Train the digits CNN (the ``digits`` recipe); returns the last history row."""
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
    trainer, history = run(config)
    if trainer.backend.is_main:
        plot = plot_loss_curve(run_dir, history)
        best = max(history, key=lambda r: r["val_accuracy"])
        log.info(
            f"final validation accuracy {history[-1]['val_accuracy']:.4f} "
            f"(best {best['val_accuracy']:.4f} at epoch {best['epoch']}); "
            f"wrote {run_dir}/history.csv, {run_dir}/best.safetensors, {plot}"
        )
    return history[-1]
