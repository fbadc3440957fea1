"""Fast JPEG decoding to uint8 with libjpeg-turbo (simplejpeg), scaling in the DCT domain.

libjpeg-turbo can run the inverse DCT at 1/2, 1/4 or 1/8 of the stored size, so a 256 px slice
decoded for a 128 px model never exists at 256 px: that skips most of the IDCT and colour work.
Whatever is left to reach the exact target size (or a crop of it) is a small PIL resize of an
image that is already close to it.

Everything here returns uint8 ``(H, W, C)`` numpy arrays (or ``(C, H, W)`` tensors): conversion to
float and normalisation belong on the accelerator (see ``shards.normalize_on_device``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import simplejpeg
import torch
from PIL import Image

Size = tuple[int, int]


def as_size(size: int | Sequence[int], name: str = "size") -> Size:
    """``128`` or ``(128, 96)`` -> ``(height, width)``, checked."""
    if isinstance(size, bool):
        raise ValueError(f"{name}={size!r} is not valid: give an int or a (height, width) pair")
    if isinstance(size, int):
        size = (size, size)
    try:
        h, w = (int(v) for v in size)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={size!r} is not valid: give an int or a (height, width) pair") from None
    if h < 1 or w < 1:
        raise ValueError(f"{name}={size!r} is not valid: both sides must be >= 1 pixel")
    return h, w


def _colorspace(channels: int) -> str:
    if channels == 1:
        return "GRAY"
    if channels == 3:
        return "RGB"
    raise ValueError(f"channels={channels!r} is not valid: use 1 (grayscale) or 3 (RGB)")


def read_header(data: bytes | memoryview) -> tuple[int, int, int]:
    """``(height, width, channels)`` of a JPEG without decoding it; ``ValueError`` if not a JPEG."""
    h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    return h, w, 1 if colorspace == "Gray" else 3


def dct_request(stored: Sequence[int], crop: Sequence[int], size: Sequence[int]) -> tuple[dict[str, int], Size]:
    """How to ask libjpeg-turbo for the smallest DCT scale of a ``stored`` image whose ``crop``
    region (``(height, width)``) still covers ``size``: simplejpeg keyword arguments, and the
    ``(height, width)`` of the whole image they decode to.

    Returns ``({}, stored)`` when the output is more than half the crop in either direction:
    scales between 1/2 and 1 take libjpeg-turbo's slower path and save little.
    """
    stored_h, stored_w = int(stored[0]), int(stored[1])
    crop_h, crop_w = int(crop[0]), int(crop[1])
    out_h, out_w = int(size[0]), int(size[1])
    if 2 * out_h > crop_h or 2 * out_w > crop_w:
        return {}, (stored_h, stored_w)
    min_h = math.ceil(out_h * stored_h / crop_h)
    min_w = math.ceil(out_w * stored_w / crop_w)
    # simplejpeg takes the smallest of libjpeg-turbo's M/8 scales (M <= 4 with min_factor=2)
    # whose output, ceil(side * M / 8), still covers both minimums.
    for m in (1, 2, 3, 4):
        scaled = (-(-stored_h * m // 8), -(-stored_w * m // 8))
        if scaled[0] >= min_h and scaled[1] >= min_w:
            break
    return {"min_height": min_h, "min_width": min_w, "min_factor": 2}, scaled


def decode(
    data: bytes | memoryview,
    *,
    size: int | Sequence[int] | None = None,
    crop: Sequence[int] | None = None,
    channels: int = 3,
    shape: Sequence[int] | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode a JPEG to a uint8 ``(H, W, channels)`` array, optionally cropped and resized.

    Args:
        data: the encoded bytes.
        size: output ``(height, width)`` (an int for a square); ``None`` keeps the crop's size.
            When the output is at most half the crop in both directions the JPEG is decoded at
            a reduced scale in the DCT domain first.
        crop: ``(top, left, height, width)`` in stored pixels; ``None`` is the whole image.
        channels: 1 (grayscale; a colour JPEG keeps its luma) or 3 (RGB; a grayscale JPEG is
            replicated).
        shape: the stored ``(height, width)`` when already known (e.g. from a shard index),
            which saves parsing the header.
        out: a writable uint8 ``(H, W, channels)`` array to write the result into (e.g. a row
            of a batch); when the DCT-scaled image is already the output size and ``out`` is
            contiguous, libjpeg-turbo decodes straight into it.

    Returns:
        The image (``out`` itself when given).

    Raises:
        ValueError: the bytes are not a decodable JPEG, or ``out`` has the wrong shape.

    Example:
        >>> img = decode(open("slice.jpg", "rb").read(), size=128, channels=1)
        >>> img.shape, img.dtype
        ((128, 128, 1), dtype('uint8'))
    """
    colorspace = _colorspace(channels)
    if size is None and crop is None and out is None:
        return simplejpeg.decode_jpeg(data, colorspace=colorspace)
    if shape is None:
        stored_h, stored_w, _ = read_header(data)
    else:
        stored_h, stored_w = int(shape[0]), int(shape[1])
    top, left, crop_h, crop_w = (0, 0, stored_h, stored_w) if crop is None else (int(v) for v in crop)
    if crop_h < 1 or crop_w < 1 or top < 0 or left < 0 or top + crop_h > stored_h or left + crop_w > stored_w:
        raise ValueError(
            f"crop={tuple(crop or ())} does not fit a {stored_h}x{stored_w} image: give (top, left, height, "
            "width) inside it"
        )
    out_h, out_w = (crop_h, crop_w) if size is None else as_size(size)
    if out is not None and out.shape != (out_h, out_w, channels):
        raise ValueError(f"out has shape {out.shape}, the decoded image is {(out_h, out_w, channels)}")
    request, scaled = dct_request((stored_h, stored_w), (crop_h, crop_w), (out_h, out_w))
    direct = out is not None and crop is None and scaled == (out_h, out_w) and out.flags.c_contiguous
    image = simplejpeg.decode_jpeg(data, colorspace=colorspace, buffer=out if direct else None, **request)
    if direct:
        if image.shape[:2] == (out_h, out_w):
            return out
        image = image.copy()  # not the predicted scale: ``out`` only held the decoder's scratch
    scaled_h, scaled_w = image.shape[:2]
    if crop is not None:
        y0, y1 = round(top * scaled_h / stored_h), round((top + crop_h) * scaled_h / stored_h)
        x0, x1 = round(left * scaled_w / stored_w), round((left + crop_w) * scaled_w / stored_w)
        image = image[y0 : max(y1, y0 + 1), x0 : max(x1, x0 + 1)]
    if image.shape[:2] != (out_h, out_w):
        image = resize(image, (out_h, out_w))
    if out is None:
        return image
    out[...] = image
    return out


def resize(image: np.ndarray, size: int | Sequence[int]) -> np.ndarray:
    """Resize a uint8 ``(H, W, C)`` array with PIL's antialiased bilinear filter."""
    out_h, out_w = as_size(size)
    pil = to_pil(image)
    return from_pil(pil.resize((out_w, out_h), Image.Resampling.BILINEAR), image.shape[2])


def rotate(image: np.ndarray, degrees: float) -> np.ndarray:
    """Rotate a uint8 ``(H, W, C)`` array about its centre, same size, corners filled with 0."""
    if degrees == 0:
        return image
    pil = to_pil(image)
    return from_pil(pil.rotate(degrees, resample=Image.Resampling.BILINEAR, fillcolor=0), image.shape[2])


def to_pil(image: np.ndarray) -> Image.Image:
    """uint8 ``(H, W, 1|3)`` array -> PIL image (mode L or RGB)."""
    if image.shape[2] == 1:
        return Image.fromarray(np.ascontiguousarray(image[:, :, 0]))
    return Image.fromarray(np.ascontiguousarray(image))


def from_pil(image: Image.Image, channels: int) -> np.ndarray:
    array = np.asarray(image)
    return array[:, :, None] if channels == 1 else array


def to_tensor(image: np.ndarray) -> torch.Tensor:
    """uint8 ``(H, W, C)`` array -> uint8 ``(C, H, W)`` tensor (a view when the array allows it)."""
    image = np.ascontiguousarray(image)
    if not image.flags.writeable:  # e.g. a view of a PIL image; torch wants writable memory
        image = image.copy()
    return torch.from_numpy(image).permute(2, 0, 1)


def decode_tensor(data: bytes | memoryview, **kwargs: object) -> torch.Tensor:
    """:func:`decode` returning a uint8 ``(C, H, W)`` tensor."""
    return to_tensor(decode(data, **kwargs))  # type: ignore[arg-type]
