"""Synthetic depth-and-mask data: single-channel images of shapes lying over a sloping floor.

Each sample is drawn from its own random generator seeded by ``(seed, index)``, so item ``i`` is
the same whatever the worker, process, epoch or access order: every replica can build the dataset
independently and the samplers decide who reads what.

The scene: a background plane whose depth varies linearly across the image, and one to
``max_shapes`` ellipses or rotated rectangles standing in front of it at their own (nearer) depth,
nearer shapes hiding farther ones. Brightness is ``albedo * (0.35 + 0.65 * depth)`` plus noise, so
both the mask (shape albedo and edges) and the depth (brightness) can be learned from the image.
Depth is in ``[0, 1]``, larger meaning nearer.

Shape legend: H height, W width.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

IMAGE_SIZE = 96


class DepthMaskDataset(Dataset[Any]):
    """``num_samples`` synthetic ``(image, (mask, depth))`` items, deterministic from seed and index.

    Args:
        num_samples: dataset length.
        image_size: side of the square images (96 for the recipe; 32 keeps tests fast). The
            ResNet-UNet needs a multiple of 16.
        seed: use different seeds for the training and validation sets.
        max_shapes: each image holds between 1 and this many shapes.
        noise_std: standard deviation of the Gaussian pixel noise.

    Items are float32 tensors: image ``[1, H, W]`` in ``[0, 1]``; mask ``[1, H, W]`` of 0/1;
    depth ``[1, H, W]`` in ``[0, 1]``.

    Example:
        >>> image, (mask, depth) = DepthMaskDataset(10, image_size=32)[3]
        >>> image.shape, mask.shape, depth.shape
        (torch.Size([1, 32, 32]), torch.Size([1, 32, 32]), torch.Size([1, 32, 32]))
    """

    def __init__(
        self,
        num_samples: int,
        *,
        image_size: int = IMAGE_SIZE,
        seed: int = 0,
        max_shapes: int = 3,
        noise_std: float = 0.02,
    ) -> None:
        for name, value, minimum in (("num_samples", num_samples, 1), ("image_size", image_size, 8), ("max_shapes", max_shapes, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}={value!r} is not valid: it must be an integer >= {minimum}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} is not valid: use a non-negative integer")
        if not noise_std >= 0:
            raise ValueError(f"noise_std={noise_std!r} is not valid: use a non-negative number (0 for clean images)")
        self.num_samples = num_samples
        self.image_size = image_size
        self.seed = seed
        self.max_shapes = max_shapes
        self.noise_std = float(noise_std)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} is out of range for a DepthMaskDataset of {self.num_samples} samples")
        image_HW, mask_HW, depth_HW = render_scene(
            np.random.default_rng((self.seed, index)), self.image_size, self.max_shapes, self.noise_std
        )
        return (
            torch.from_numpy(image_HW)[None],
            (torch.from_numpy(mask_HW)[None], torch.from_numpy(depth_HW)[None]),
        )


def render_scene(
    rng: np.random.Generator, size: int, max_shapes: int, noise_std: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One scene as float32 arrays ``(image_HW, mask_HW, depth_HW)``, drawn from ``rng``."""
    yy_HW, xx_HW = np.mgrid[0:size, 0:size].astype(np.float64) / (size - 1)
    # Background: a plane receding across the image, like a floor seen at an angle.
    base, slope_x, slope_y = rng.uniform(0.2, 0.4), rng.uniform(-0.15, 0.15), rng.uniform(-0.15, 0.15)
    depth_HW = base + slope_x * (xx_HW - 0.5) + slope_y * (yy_HW - 0.5)
    # A faint stripe texture, so the background is not one flat grey the model could threshold.
    angle, freq = rng.uniform(0, np.pi), rng.uniform(3, 8)
    albedo_HW = 0.5 + 0.05 * np.sin(2 * np.pi * freq * (xx_HW * np.cos(angle) + yy_HW * np.sin(angle)))
    mask_HW = np.zeros((size, size), dtype=bool)

    num_shapes = int(rng.integers(1, max_shapes + 1))
    shape_depths = np.sort(rng.uniform(0.55, 0.95, size=num_shapes))  # farthest first: nearer ones paint over
    for shape_depth in shape_depths:
        cx, cy = rng.uniform(0.2, 0.8, size=2)
        rx, ry = rng.uniform(0.08, 0.25, size=2)
        theta = rng.uniform(0, np.pi)
        u_HW = (xx_HW - cx) * np.cos(theta) + (yy_HW - cy) * np.sin(theta)
        v_HW = -(xx_HW - cx) * np.sin(theta) + (yy_HW - cy) * np.cos(theta)
        if rng.integers(2):
            inside_HW = (u_HW / rx) ** 2 + (v_HW / ry) ** 2 <= 1.0
        else:
            inside_HW = (np.abs(u_HW) <= rx) & (np.abs(v_HW) <= ry)
        # A slight tilt of each shape's own surface, so depth is not piecewise constant.
        tilt = rng.uniform(-0.05, 0.05)
        depth_HW = np.where(inside_HW, shape_depth + tilt * u_HW / max(rx, ry), depth_HW)
        albedo_HW = np.where(inside_HW, rng.uniform(0.85, 1.0), albedo_HW)
        mask_HW |= inside_HW

    depth_HW = np.clip(depth_HW, 0.0, 1.0)
    image_HW = albedo_HW * (0.35 + 0.65 * depth_HW)
    if noise_std > 0:
        image_HW = image_HW + rng.normal(0.0, noise_std, size=image_HW.shape)
    image_HW = np.clip(image_HW, 0.0, 1.0)
    return image_HW.astype(np.float32), mask_HW.astype(np.float32), depth_HW.astype(np.float32)
