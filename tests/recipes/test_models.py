"""build_model: names, errors with their fix, local pretrained weights, stem and head adaptation."""

from __future__ import annotations

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from xlatrain.models import MODEL_NAMES, ResNetUNet, adapt_stem_weight, build_model, load_state_dict_file


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        build_model("resnet35", num_outputs=2)
    message = str(err.value)
    assert "resnet35" in message
    for name in ("resnet18", "resnet34", "efficientnet_b0", "mobilenet_v3_small", "resnet_unet", "small_cnn"):
        assert name in message


def test_pretrained_true_fails_with_the_fix():
    with pytest.raises(ValueError, match="never downloads") as err:
        build_model("resnet18", num_outputs=2, pretrained=True)
    assert "path" in str(err.value) and "torch.save" in str(err.value) and "safetensors" in str(err.value)


def test_weights_kwarg_is_refused():
    with pytest.raises(ValueError, match="pretrained="):
        build_model("resnet18", num_outputs=2, weights="DEFAULT")


def test_missing_weights_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.pth"
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        build_model("resnet18", num_outputs=2, pretrained=str(missing))


def test_unknown_weights_suffix(tmp_path):
    path = tmp_path / "weights.npz"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match=".safetensors, .pt or .pth"):
        build_model("small_cnn", num_outputs=2, pretrained=path)


def test_bad_counts():
    with pytest.raises(ValueError, match="num_outputs"):
        build_model("small_cnn", num_outputs=0)
    with pytest.raises(ValueError, match="in_channels"):
        build_model("small_cnn", num_outputs=2, in_channels=0)
    with pytest.raises(ValueError, match="keyword"):
        build_model("resnet18", num_outputs=2, no_such_option=1)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "efficientnet_b0", "small_cnn"])
@pytest.mark.parametrize("in_channels", [1, 3])
def test_output_shapes(name, in_channels):
    model = build_model(name, num_outputs=7, in_channels=in_channels).eval()
    with torch.no_grad():
        out = model(torch.randn(2, in_channels, 32, 32))
    assert out.shape == (2, 7)


def test_pretrained_imagenet_layout_loads_into_a_one_channel_model(tmp_path):
    """A file saved from the unmodified torchvision model: stem averaged, head left fresh."""
    torch.manual_seed(0)
    source = torchvision.models.resnet18(weights=None)
    path = tmp_path / "resnet18.pth"
    torch.save(source.state_dict(), path)

    model = build_model("resnet18", num_outputs=3, in_channels=1, pretrained=str(path))
    expected_stem = source.conv1.weight.mean(dim=1, keepdim=True) * 3
    torch.testing.assert_close(model.conv1.weight, expected_stem)
    torch.testing.assert_close(model.layer3[1].conv2.weight, source.layer3[1].conv2.weight)
    assert model.fc.weight.shape == (3, 512)

    # A grey image repeated into RGB gives the source model's stem response.
    grey = torch.randn(1, 1, 16, 16)
    torch.testing.assert_close(model.conv1(grey), source.conv1(grey.repeat(1, 3, 1, 1)), rtol=1e-4, atol=1e-5)


def test_pretrained_safetensors_same_architecture_round_trip(tmp_path):
    torch.manual_seed(0)
    first = build_model("small_cnn", num_outputs=4, in_channels=1)
    path = tmp_path / "best.safetensors"
    save_file(first.state_dict(), str(path))
    second = build_model("small_cnn", num_outputs=4, in_channels=1, pretrained=path)
    for key, value in first.state_dict().items():
        torch.testing.assert_close(second.state_dict()[key], value)


def test_pretrained_wrapped_and_ddp_prefixed_state_dict(tmp_path):
    first = build_model("small_cnn", num_outputs=2)
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in first.state_dict().items()}, "epoch": 3}, path)
    assert set(load_state_dict_file(path)) == set(first.state_dict())
    build_model("small_cnn", num_outputs=2, pretrained=path)


def test_pretrained_of_another_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "resnet18.safetensors"
    save_file(build_model("resnet18", num_outputs=2).state_dict(), str(path))
    with pytest.raises(ValueError, match="same architecture") as err:
        build_model("resnet34", num_outputs=2, pretrained=path)
    assert "missing" in str(err.value)


def test_adapt_stem_weight_preserves_response_to_equal_channels():
    weight = torch.randn(8, 3, 3, 3)
    adapted = adapt_stem_weight(weight, 5)
    assert adapted.shape == (8, 5, 3, 3)
    torch.testing.assert_close(adapted.sum(dim=1), weight.sum(dim=1))


def test_resnet_unet_shapes_and_default_size():
    tiny = build_model("resnet_unet", num_outputs=2, in_channels=1, width=8, blocks=(1, 1, 1, 1)).eval()
    with torch.no_grad():
        mask_logits, depth = tiny(torch.randn(3, 1, 32, 32))
    assert mask_logits.shape == (3, 2, 32, 32) and depth.shape == (3, 1, 32, 32)
    # The "~30M parameters" model at the default width.
    num_params = sum(p.numel() for p in ResNetUNet().parameters())
    assert 28_000_000 <= num_params <= 32_000_000, num_params


def test_resnet_unet_rejects_sizes_not_divisible_by_16():
    model = ResNetUNet(width=4, blocks=(1, 1, 1, 1))
    with pytest.raises(ValueError, match="divisible by 16"):
        model(torch.zeros(1, 1, 40, 40))
    with pytest.raises(ValueError, match="width"):
        ResNetUNet(width=1)
    with pytest.raises(ValueError, match="blocks"):
        ResNetUNet(blocks=(1, 1, 1))


def test_a_runs_best_safetensors_loads_as_pretrained(tmp_path):
    from xlatrain import save_weights

    torch.manual_seed(0)
    model = build_model("resnet_unet", num_outputs=1, in_channels=1, width=4, blocks=(1, 1, 1, 1))
    path = save_weights(model, tmp_path / "best.safetensors")
    again = build_model("resnet_unet", num_outputs=1, in_channels=1, width=4, blocks=(1, 1, 1, 1), pretrained=path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], value)
