"""The depth-and-mask recipe for ``xlatrain fit`` (config: ``configs/depth_mask.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from xlatrain.config import from_dict
from xlatrain.recipes.depth_mask.data import IMAGE_SIZE, DepthMaskDataset
from xlatrain.recipes.depth_mask.loss import DepthMaskLoss
from xlatrain.recipes.depth_mask.metrics import depth_mask_metrics


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    num_train: int = 512
    num_val: int = 128
    image_size: int = IMAGE_SIZE
    seed: int = 0
    mask_weight: float = 1.0
    depth_weight: float = 1.0

    def __post_init__(self) -> None:
        from xlatrain.config import check_int, check_nonnegative

        check_int("data.num_train", self.num_train)
        check_int("data.num_val", self.num_val)
        check_int("data.image_size", self.image_size, minimum=32)
        check_int("data.seed", self.seed, minimum=0)
        check_nonnegative("data.mask_weight", self.mask_weight)
        check_nonnegative("data.depth_weight", self.depth_weight)


def build(config: Any) -> Any:
    from xlatrain.recipes.run import RecipeParts, build_recipe_model

    data = from_dict(DataConfig, config.data, section="data")
    torch.manual_seed(config.trainer.seed)
    # One input channel; one mask channel plus the depth map (ResNetUNet's defaults: width 64,
    # blocks 3-4-6-3, when the config leaves them out).
    model = build_recipe_model(config, num_outputs=1, in_channels=1, names=("resnet_unet",))
    return RecipeParts(
        model=model,
        loss_fn=DepthMaskLoss(mask_weight=data.mask_weight, depth_weight=data.depth_weight),
        train_data=DepthMaskDataset(data.num_train, image_size=data.image_size, seed=data.seed),
        val_data=DepthMaskDataset(data.num_val, image_size=data.image_size, seed=data.seed + 1),
        metrics_fn=depth_mask_metrics,
    )
