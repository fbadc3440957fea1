"""The depth-and-mask loss: BCE-with-logits on the mask plus a regression loss on depth.

Shape legend: B batch, M mask channels, H height, W width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

REDUCTIONS = ("mean", "none", "sum")
DEPTH_LOSSES = ("mse", "smooth_l1")


class DepthMaskLoss(nn.Module):
    """``mask_weight * BCE(mask) + depth_weight * MSE(depth)``, each averaged over pixels.

    Called as ``loss(outputs, targets)`` with ``outputs = (mask_logits_BMHW, depth_B1HW)`` (what
    :class:`~xlatrain.models.ResNetUNet` returns) and ``targets = (mask_BMHW, depth_B1HW)`` (what
    :class:`~xlatrain.recipes.depth_mask.DepthMaskDataset` yields, batched).

    Args:
        mask_weight: weight of the mask term.
        depth_weight: weight of the depth term.
        depth_loss: ``"mse"`` or ``"smooth_l1"`` (Huber with ``beta=smooth_l1_beta``).
        reduction: ``"mean"`` (over the batch; what training uses), ``"sum"``, or ``"none"``: one
            loss per sample, shape ``[B]``, which the Trainer's evaluation uses to mask padding.
        smooth_l1_beta: where smooth L1 turns from quadratic to linear, in depth units.

    Example:
        >>> loss_fn = DepthMaskLoss(mask_weight=1.0, depth_weight=2.0)
        >>> logits, depth = torch.zeros(4, 1, 32, 32), torch.zeros(4, 1, 32, 32)
        >>> loss_fn((logits, depth), (torch.ones(4, 1, 32, 32), depth)).shape
        torch.Size([])
    """

    def __init__(
        self,
        mask_weight: float = 1.0,
        depth_weight: float = 1.0,
        *,
        depth_loss: str = "mse",
        reduction: str = "mean",
        smooth_l1_beta: float = 0.1,
    ) -> None:
        super().__init__()
        for name, value in (("mask_weight", mask_weight), ("depth_weight", depth_weight)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name}={value!r} is not valid: use a non-negative number")
        if mask_weight == 0 and depth_weight == 0:
            raise ValueError("mask_weight and depth_weight are both 0: give at least one a positive weight")
        if depth_loss not in DEPTH_LOSSES:
            raise ValueError(f"depth_loss={depth_loss!r} is not valid: choose one of {', '.join(map(repr, DEPTH_LOSSES))}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction={reduction!r} is not valid: choose one of {', '.join(map(repr, REDUCTIONS))}")
        if not smooth_l1_beta > 0:
            raise ValueError(f"smooth_l1_beta={smooth_l1_beta!r} is not valid: use a positive number")
        self.mask_weight = float(mask_weight)
        self.depth_weight = float(depth_weight)
        self.depth_loss = depth_loss
        # A plain attribute, so xlatrain's evaluation can switch a copy to reduction="none".
        self.reduction = reduction
        self.smooth_l1_beta = float(smooth_l1_beta)

    def forward(self, outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r} is not valid: choose one of {', '.join(map(repr, REDUCTIONS))}")
        mask_logits_BMHW, depth_pred_B1HW = _pair("outputs", outputs)
        mask_BMHW, depth_B1HW = _pair("targets", targets)
        # Losses in float32 even under bf16 autocast: the mean over ~10^4 pixels needs the mantissa.
        bce_B = F.binary_cross_entropy_with_logits(
            mask_logits_BMHW.float(), mask_BMHW.float(), reduction="none"
        ).flatten(1).mean(dim=1)
        if self.depth_loss == "mse":
            dep = F.mse_loss(depth_pred_B1HW.float(), depth_B1HW.float(), reduction="none")
        else:
            dep = F.smooth_l1_loss(depth_pred_B1HW.float(), depth_B1HW.float(), reduction="none", beta=self.smooth_l1_beta)
        per_sample_B = self.mask_weight * bce_B + self.depth_weight * dep.flatten(1).mean(dim=1)
        if self.reduction == "none":
            return per_sample_B
        return per_sample_B.sum() if self.reduction == "sum" else per_sample_B.mean()

    def extra_repr(self) -> str:
        return (
            f"mask_weight={self.mask_weight}, depth_weight={self.depth_weight}, "
            f"depth_loss={self.depth_loss!r}, reduction={self.reduction!r}"
        )


def _pair(name: str, value: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(
            f"DepthMaskLoss {name} must be a (mask, depth) pair of tensors, got {type(value).__name__}: "
            "use ResNetUNet (it returns (mask_logits, depth)) and DepthMaskDataset targets (mask, depth)"
        )
    first, second = value
    if first.shape[0] != second.shape[0] or first.shape[-2:] != second.shape[-2:]:
        raise ValueError(
            f"DepthMaskLoss {name}: mask {tuple(first.shape)} and depth {tuple(second.shape)} disagree on "
            "batch size or image size: both must be [B, C, H, W] with the same B, H, W"
        )
    return first, second
