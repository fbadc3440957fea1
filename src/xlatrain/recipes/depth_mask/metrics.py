"""Validation metrics of the depth-and-mask recipe, computed on the host over the whole set.

Dice and IoU pool every pixel of the validation set (one intersection and one union, not a mean
of per-image scores), so images without any shape do not make 0/0 and the result does not depend
on how the set was batched or split over devices. Depth RMSE is the root of the mean squared error
over all pixels. Everything is computed in float64.

Shape legend: N samples, M mask channels, H height, W width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def _host(name: str, value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float64).numpy()
    array = np.asarray(value, dtype=np.float64)
    if array.dtype == object:
        raise ValueError(f"{name} must be a tensor or array, got {type(value).__name__}")
    return array


def dice_iou(pred_mask: Any, true_mask: Any) -> tuple[float, float]:
    """Dice ``2|P∩T| / (|P|+|T|)`` and IoU ``|P∩T| / |P∪T|`` of two 0/1 masks of the same shape.

    Both are 1.0 when the two masks are empty (the prediction agrees with the target).
    """
    pred, true = _host("pred_mask", pred_mask) > 0.5, _host("true_mask", true_mask) > 0.5
    if pred.shape != true.shape:
        raise ValueError(f"mask shapes differ: prediction {pred.shape} vs target {true.shape}")
    inter = float(np.logical_and(pred, true).sum())
    total = float(pred.sum() + true.sum())
    union = total - inter
    if total == 0:
        return 1.0, 1.0
    return 2.0 * inter / total, inter / union


def rmse(pred: Any, target: Any) -> float:
    """Root mean squared error over every element."""
    p, t = _host("pred", pred), _host("target", target)
    if p.shape != t.shape:
        raise ValueError(f"depth shapes differ: prediction {p.shape} vs target {t.shape}")
    return math.sqrt(float(np.mean((p - t) ** 2)))


def depth_mask_metrics(outputs: Sequence[Any], targets: Sequence[Any]) -> dict[str, float]:
    """Dice, IoU and depth RMSE of a whole validation set.

    Fits the Trainer's host-side ``metrics_fn(outputs, targets) -> dict`` hook: ``outputs`` is
    ``(mask_logits_NMHW, depth_N1HW)`` gathered over the set, ``targets`` is
    ``(mask_NMHW, depth_N1HW)``, as tensors or arrays. The mask prediction is ``logits > 0``
    (probability above one half).

    Returns:
        ``{"dice": ..., "iou": ..., "depth_rmse": ...}``.

    Example:
        >>> logits = torch.tensor([[[[2.0, -1.0]]]])  # predicts the first pixel only
        >>> depth = torch.tensor([[[[0.5, 0.25]]]])
        >>> depth_mask_metrics((logits, depth), (torch.tensor([[[[1.0, 1.0]]]]), depth + 0.5))
        {'dice': 0.6666666666666666, 'iou': 0.5, 'depth_rmse': 0.5}
    """
    for name, pair in (("outputs", outputs), ("targets", targets)):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{name} must be a (mask, depth) pair, got {type(pair).__name__}")
    mask_logits, depth_pred = outputs
    mask_true, depth_true = targets
    dice, iou = dice_iou(_host("mask logits", mask_logits) > 0, mask_true)
    return {"dice": dice, "iou": iou, "depth_rmse": rmse(depth_pred, depth_true)}
