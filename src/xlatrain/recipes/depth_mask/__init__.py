"""Depth-and-mask recipe: a ResNet-UNet predicting a shape mask and a depth map from 96x96 images.

Pieces, each usable on its own:

- :class:`DepthMaskDataset`: synthetic ``(image, (mask, depth))`` items, deterministic per index;
- :func:`build_depth_mask_model`: the ResNet-UNet (``(mask_logits, depth)`` out, ~29.3M params);
- :class:`DepthMaskLoss`: weighted BCE-with-logits + MSE / smooth L1, per sample with
  ``reduction="none"``;
- :func:`depth_mask_metrics`: Dice, IoU and depth RMSE over a gathered validation set.
"""

from xlatrain.recipes.depth_mask.data import IMAGE_SIZE, DepthMaskDataset
from xlatrain.recipes.depth_mask.loss import DepthMaskLoss
from xlatrain.recipes.depth_mask.metrics import depth_mask_metrics, dice_iou, rmse
from xlatrain.recipes.depth_mask.model import ResNetUNet, build_depth_mask_model

__all__ = [
    "IMAGE_SIZE",
    "DepthMaskDataset",
    "DepthMaskLoss",
    "ResNetUNet",
    "build_depth_mask_model",
    "depth_mask_metrics",
    "dice_iou",
    "rmse",
]
