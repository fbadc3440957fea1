import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from xlatrain.data.decode import as_size, dct_request, decode, decode_tensor, read_header, resize, rotate


def _jpeg(h=64, w=48, channels=1, quality=95):
    yy, xx = np.mgrid[:h, :w]
    plane = ((xx * 3 + yy * 2) % 256).astype(np.uint8)
    if channels == 1:
        return simplejpeg.encode_jpeg(plane[:, :, None], quality=quality, colorspace="GRAY", colorsubsampling="Gray")
    rgb = np.stack([plane, 255 - plane, (plane // 2 + 60).astype(np.uint8)], axis=2)
    return simplejpeg.encode_jpeg(rgb, quality=quality, colorspace="RGB")


def test_header_and_full_decode_keep_the_stored_size():
    data = _jpeg(64, 48, channels=1)
    assert read_header(data) == (64, 48, 1)
    assert read_header(_jpeg(32, 40, channels=3)) == (32, 40, 3)
    gray = decode(data, channels=1)
    assert gray.shape == (64, 48, 1) and gray.dtype == np.uint8
    rgb = decode(data, channels=3)  # a grayscale JPEG replicated to RGB
    assert rgb.shape == (64, 48, 3) and np.array_equal(rgb[:, :, 0], rgb[:, :, 2])


@pytest.mark.parametrize("size", [32, (16, 12), (40, 30)])
def test_resized_output_has_the_target_shape_and_tracks_a_plain_resize(size):
    data = _jpeg(64, 48, channels=3)
    out = decode(data, size=size, channels=3)
    h, w = as_size(size)
    assert out.shape == (h, w, 3) and out.dtype == np.uint8
    full = simplejpeg.decode_jpeg(data, colorspace="RGB")
    reference = np.asarray(Image.fromarray(full).resize((w, h), Image.Resampling.BILINEAR))
    # DCT-domain downscaling differs from a pixel-domain resize only by filtering detail.
    assert np.abs(out.astype(int) - reference.astype(int)).mean() < 6


def test_half_size_or_less_decodes_in_the_dct_domain_exactly_at_the_scaled_size():
    data = _jpeg(64, 64, channels=1)
    half = decode(data, size=32, channels=1)
    direct = simplejpeg.decode_jpeg(data, colorspace="GRAY", min_height=32, min_width=32, min_factor=2)
    assert direct.shape[:2] == (32, 32) and np.array_equal(half, direct)


def test_crop_then_resize():
    data = _jpeg(64, 64, channels=1)
    full = decode(data, channels=1)
    crop = decode(data, crop=(8, 16, 32, 24), channels=1)
    assert np.array_equal(crop, full[8:40, 16:40])
    small = decode(data, crop=(0, 0, 64, 32), size=(16, 8), channels=1, shape=(64, 64))
    assert small.shape == (16, 8, 1)
    with pytest.raises(ValueError, match="does not fit"):
        decode(data, crop=(40, 0, 32, 32), channels=1)


def test_tensor_output_is_chw_uint8_and_rotate_keeps_the_shape():
    data = _jpeg(32, 32, channels=3)
    t = decode_tensor(data, size=16, channels=3)
    assert t.shape == (3, 16, 16) and t.dtype == torch.uint8
    image = decode(data, channels=1)
    assert rotate(image, 10).shape == image.shape and rotate(image, 0) is image
    assert resize(image, (8, 4)).shape == (8, 4, 1)


def test_corrupt_bytes_and_bad_arguments_raise_value_error():
    data = _jpeg(32, 32)
    with pytest.raises(ValueError):
        decode(data[: len(data) // 2] + b"\0" * 10, channels=1)
    with pytest.raises(ValueError):
        read_header(b"not a jpeg")
    with pytest.raises(ValueError, match="channels=2"):
        decode(data, channels=2)
    with pytest.raises(ValueError, match="size"):
        decode(data, size=(0, 4))


@pytest.mark.parametrize("stored", [(64, 64), (61, 47), (200, 130), (33, 90)])
def test_dct_request_predicts_the_size_libjpeg_decodes_to(stored):
    data = _jpeg(*stored)
    for out in [(8, 8), (16, 12), (23, 17), (stored[0] // 2, stored[1] // 2), (stored[0] // 2 + 1, 4)]:
        request, scaled = dct_request(stored, stored, out)
        decoded = simplejpeg.decode_jpeg(data, colorspace="GRAY", **request)
        assert decoded.shape[:2] == scaled
        assert scaled[0] >= out[0] and scaled[1] >= out[1] if request else scaled == stored


@pytest.mark.parametrize("kwargs", [dict(size=32), dict(size=(20, 30)), dict(crop=(8, 4, 40, 40), size=16), dict()])
def test_decoding_into_an_array_gives_what_decoding_returns(kwargs):
    data = _jpeg(64, 64, channels=1)
    expected = decode(data, channels=1, **kwargs)
    out = np.full(expected.shape, 7, dtype=np.uint8)
    assert decode(data, channels=1, out=out, **kwargs) is out and np.array_equal(out, expected)
    strided = np.zeros((2, *expected.shape), dtype=np.uint8)[:, ::-1][1]  # not contiguous: no decode into it
    assert np.array_equal(decode(data, channels=1, out=strided, **kwargs), expected)
    with pytest.raises(ValueError, match="out has shape"):
        decode(data, channels=3, out=out, **kwargs)
