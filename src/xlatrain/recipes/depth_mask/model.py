"""The depth-and-mask recipe's model: a ResNet-UNet on single-channel 96x96 images.

The architecture itself is :class:`xlatrain.models.ResNetUNet` (core code, so that
``build_model("resnet_unet")`` works without the core importing a recipe); this module fixes the
recipe's choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from xlatrain.models import ResNetUNet, build_model

__all__ = ["ResNetUNet", "build_depth_mask_model"]


def build_depth_mask_model(
    *,
    width: int = 64,
    blocks: Sequence[int] = (3, 4, 6, 3),
    in_channels: int = 1,
    pretrained: bool | str | Path = False,
) -> ResNetUNet:
    """The recipe's ResNet-UNet: one input channel, one mask channel, one depth channel.

    ``width=64`` gives about 29.3M parameters; ``width=8, blocks=(1, 1, 1, 1)`` a model small
    enough to train for a few steps on the CPU or XLA:CPU in tests. ``pretrained`` is the path of
    a state dict saved from the same configuration (e.g. a run's ``best.safetensors``).

    Example:
        >>> import torch
        >>> model = build_depth_mask_model(width=8, blocks=(1, 1, 1, 1))
        >>> mask_logits, depth = model(torch.zeros(2, 1, 32, 32))
        >>> mask_logits.shape, depth.shape
        (torch.Size([2, 1, 32, 32]), torch.Size([2, 1, 32, 32]))
    """
    model = build_model(
        "resnet_unet", num_outputs=1, in_channels=in_channels, pretrained=pretrained, width=width, blocks=tuple(blocks)
    )
    assert isinstance(model, ResNetUNet)
    return model
