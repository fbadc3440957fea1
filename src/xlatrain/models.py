"""Models by name: torchvision classifiers, the ResNet-UNet of the depth-and-mask recipe, a tiny CNN.

``build_model(name, num_outputs=..., in_channels=..., pretrained=...)`` never downloads anything:
torchvision builders are called with ``weights=None`` and ``pretrained`` is the path of a local
weights file (safetensors, or a ``torch.save``-d state dict). A file saved from the unmodified
ImageNet model loads into a model with another head or another number of input channels: the head
keeps its fresh initialisation and the first convolution is adapted by averaging (see
:func:`adapt_stem_weight`).

The ResNet-UNet lives here rather than in ``recipes/depth_mask`` because recipes import the core,
never the reverse, and ``build_model("resnet_unet")`` is core.

Shape legend for tensor names: B batch, C channels, H height, W width, O output channels,
I input channels, K kernel size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MODEL_NAMES",
    "ResNetUNet",
    "SmallCNN",
    "adapt_stem_weight",
    "build_model",
    "load_state_dict_file",
    "model_options",
]


@dataclass(frozen=True)
class _Spec:
    """Where a model keeps the layers that ``build_model`` adapts."""

    stem: str  # dotted path of the first Conv2d (adapted for in_channels)
    heads: tuple[str, ...]  # dotted paths of output layers (left freshly initialised on a shape change)
    torchvision: bool = True


_RESNET = _Spec(stem="conv1", heads=("fc",))
_EFFICIENTNET = _Spec(stem="features.0.0", heads=("classifier.1",))

# Classification models that make sense to fine-tune on images of 32 px and up; ViTs are left out
# because they fix the input size at construction.
_SPECS: dict[str, _Spec] = {
    "resnet18": _RESNET,
    "resnet34": _RESNET,
    "resnet50": _RESNET,
    "resnet101": _RESNET,
    "resnet152": _RESNET,
    "resnext50_32x4d": _RESNET,
    "wide_resnet50_2": _RESNET,
    "regnet_y_400mf": _Spec(stem="stem.0", heads=("fc",)),
    "efficientnet_b0": _EFFICIENTNET,
    "efficientnet_b1": _EFFICIENTNET,
    "efficientnet_b2": _EFFICIENTNET,
    "efficientnet_b3": _EFFICIENTNET,
    "efficientnet_v2_s": _EFFICIENTNET,
    "mobilenet_v2": _Spec(stem="features.0.0", heads=("classifier.1",)),
    "mobilenet_v3_small": _Spec(stem="features.0.0", heads=("classifier.3",)),
    "mobilenet_v3_large": _Spec(stem="features.0.0", heads=("classifier.3",)),
    "convnext_tiny": _Spec(stem="features.0.0", heads=("classifier.2",)),
    "densenet121": _Spec(stem="features.conv0", heads=("classifier",)),
    "resnet_unet": _Spec(stem="stem.0.0", heads=("mask_head",), torchvision=False),
    "small_cnn": _Spec(stem="features.0.0", heads=("head",), torchvision=False),
}

MODEL_NAMES: tuple[str, ...] = tuple(sorted(_SPECS))


def build_model(
    name: str,
    *,
    num_outputs: int,
    in_channels: int = 3,
    pretrained: bool | str | Path = False,
    pretrained_prefix: str | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Build a model by name, with ``num_outputs`` outputs and ``in_channels`` input channels.

    Args:
        name: one of :data:`MODEL_NAMES`: torchvision classifiers (``resnet18``, ``resnet34``,
            ``resnet50``, ``efficientnet_b0``, ``mobilenet_v3_small``, ...), ``resnet_unet`` (two
            heads: mask logits with ``num_outputs`` channels and a one-channel depth map; see
            :class:`ResNetUNet`) or ``small_cnn`` (a tiny CNN for tests on the CPU).
        num_outputs: classes / labels of the new head (mask channels for ``resnet_unet``).
        in_channels: channels of the input images; for a value other than 3, the first
            convolution of a pretrained model is adapted by averaging its weights.
        pretrained: ``False``, or the path of a local weights file: ``.safetensors``, or
            ``.pt`` / ``.pth`` / ``.bin`` holding a state dict (read with ``weights_only=True``).
            ``True`` is an error: nothing is downloaded at run time.
        pretrained_prefix: the name under which a model that wraps this one keeps it
            (``"backbone."``): a file whose every key starts with it, the wrapper's own saved
            weights (a recipe's ``best.safetensors``), is read without it.
        **kwargs: passed to the model's constructor (e.g. ``width=`` for ``resnet_unet``).

    Returns:
        The model on the CPU, in training mode.

    Example:
        >>> model = build_model("resnet34", num_outputs=10, in_channels=1)
        >>> model(torch.zeros(2, 1, 64, 64)).shape
        torch.Size([2, 10])
    """
    spec = _SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown model name {name!r}: valid names are {', '.join(MODEL_NAMES)}")
    if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or num_outputs < 1:
        raise ValueError(f"num_outputs={num_outputs!r} is not valid: give the number of outputs, an integer >= 1")
    if isinstance(in_channels, bool) or not isinstance(in_channels, int) or in_channels < 1:
        raise ValueError(f"in_channels={in_channels!r} is not valid: give the image channels, an integer >= 1")
    path = _pretrained_path(pretrained)
    if "weights" in kwargs:
        raise ValueError(
            f"weights={kwargs['weights']!r} would make torchvision download weights, and xlatrain never "
            "downloads at run time: pass pretrained='path/to/weights.safetensors' (or .pth) instead"
        )
    state = load_state_dict_file(path) if path is not None else None
    if state and pretrained_prefix and all(k.startswith(pretrained_prefix) for k in state):
        state = {k[len(pretrained_prefix):]: v for k, v in state.items()}

    if spec.torchvision:
        import torchvision

        builder = getattr(torchvision.models, name)
        try:
            model = builder(weights=None, num_classes=num_outputs, **kwargs)
        except TypeError as exc:
            raise ValueError(f"build_model({name!r}) got keyword arguments it does not take ({exc}): remove them") from None
        if in_channels != 3:
            _set_module(model, spec.stem, _conv_like(_get_module(model, spec.stem), in_channels))
    elif name == "resnet_unet":
        model = ResNetUNet(in_channels=in_channels, num_mask_channels=num_outputs, **kwargs)
    else:
        model = SmallCNN(in_channels=in_channels, num_outputs=num_outputs, **kwargs)

    if state is not None:
        _load_adapted(model, state, spec, source=str(path), prefix=pretrained_prefix)
    return model


def model_options(name: str) -> set[str]:
    """Which of the config's shape options (``width``, ``blocks``) the model ``name`` takes."""
    if name not in _SPECS:
        raise ValueError(f"unknown model name {name!r}: valid names are {', '.join(MODEL_NAMES)}")
    return {"resnet_unet": {"width", "blocks"}, "small_cnn": {"width"}}.get(name, set())


# --- pretrained weights --------------------------------------------------------------------------
def _pretrained_path(pretrained: bool | str | Path) -> Path | None:
    if pretrained is False or pretrained is None:
        return None
    if pretrained is True:
        raise ValueError(
            "pretrained=True would download weights, and xlatrain never downloads at run time: pass the "
            "path of a local weights file instead, e.g. pretrained='weights/resnet34.safetensors' or "
            "'weights/resnet34.pth', saved on a machine with network access with "
            "torch.save(torchvision.models.resnet34(weights='DEFAULT').state_dict(), 'resnet34.pth') "
            "or safetensors.torch.save_file(model.state_dict(), 'resnet34.safetensors')"
        )
    if not isinstance(pretrained, (str, Path)) or not str(pretrained):
        raise ValueError(f"pretrained={pretrained!r} is not valid: use False or the path of a local weights file")
    return Path(pretrained)


class WeightsFileMissing(FileNotFoundError, ValueError):
    """A weights path that names no file: bad input (the command line says so without a traceback)."""


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict from ``.safetensors`` or a ``torch.save``-d ``.pt`` / ``.pth`` / ``.bin``.

    A dict that wraps the weights under ``state_dict`` or ``model`` (a common checkpoint layout) is
    unwrapped, and the ``module.`` prefix that DistributedDataParallel adds is removed.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsFileMissing(
            f"pretrained weights file {str(path)!r} does not exist: give the path of a local "
            ".safetensors / .pt / .pth file (xlatrain never downloads weights)"
        )
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        from xlatrain.checkpoint import read_weights

        obj: Any = read_weights(path)  # tied weights (saved once by xlatrain) under each of their names
    elif suffix in (".pt", ".pth", ".bin"):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # the unpickler's errors have many types; all mean "not plain tensors"
            raise ValueError(
                f"{path} could not be read as a state dict with torch.load(weights_only=True) ({exc}): save "
                "it with torch.save(model.state_dict(), path) or as .safetensors"
            ) from None
    else:
        raise ValueError(
            f"{path}: unknown weights file type {suffix or '(none)'!r}: use .safetensors, .pt or .pth"
        )
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} does not hold a state dict (a mapping of names to tensors): save model.state_dict()")
    state = dict(obj)
    for prefix in ("module.", "_orig_mod."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def adapt_stem_weight(weight_OIKK: torch.Tensor, in_channels: int) -> torch.Tensor:
    """First-convolution weights for ``in_channels`` inputs from weights trained on another count.

    Every new input channel gets the mean over the old input channels, scaled by
    ``old / new`` channels, so an image whose channels are all equal (a grey image repeated into
    RGB) produces the same response as before.
    """
    old = weight_OIKK.shape[1]
    mean_O1KK = weight_OIKK.float().mean(dim=1, keepdim=True) * (old / in_channels)
    return mean_O1KK.repeat(1, in_channels, 1, 1).to(weight_OIKK.dtype)


def _load_adapted(model: nn.Module, state: Mapping[str, torch.Tensor], spec: _Spec, source: str,
                  prefix: str | None = None) -> None:
    target = model.state_dict()
    stem_key = f"{spec.stem}.weight"
    head_prefixes = tuple(f"{h}." for h in spec.heads)
    merged: dict[str, torch.Tensor] = {}
    missing, mismatched = [], []
    for key, want in target.items():
        have = state.get(key)
        if have is None:
            if key.startswith(head_prefixes):
                continue  # a head absent from the file keeps its fresh initialisation
            missing.append(key)
        elif have.shape == want.shape:
            merged[key] = have
        elif key == stem_key and have.dim() == 4 and have.shape[0] == want.shape[0] and have.shape[2:] == want.shape[2:]:
            merged[key] = adapt_stem_weight(have, want.shape[1])
        elif key.startswith(head_prefixes):
            continue  # another number of outputs: the new head is trained from scratch
        else:
            mismatched.append(f"{key} {tuple(have.shape)} in the file vs {tuple(want.shape)} in the model")
    unexpected = sorted(k for k in state if k not in target and not k.startswith(head_prefixes))
    if missing or mismatched or unexpected:
        parts = []
        for label, keys in (("missing", missing), ("of another shape", mismatched), ("unexpected", unexpected)):
            if keys:
                shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
                parts.append(f"{len(keys)} key(s) {label}: {shown}")
        wrapped = (f", or the weights of the model that holds it as {prefix!r} (every key starting with it: the "
                   "recipe's own best.safetensors)" if prefix else "")
        raise ValueError(
            f"{source} does not hold weights for this model ({'; '.join(parts)}): pass a file saved "
            f"from the same architecture (the model name, and kwargs such as width, must match){wrapped}"
        )
    for key, want in target.items():
        merged.setdefault(key, want)
    model.load_state_dict(merged, strict=True)


def _get_module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _conv_like(conv: nn.Module, in_channels: int) -> nn.Conv2d:
    if not isinstance(conv, nn.Conv2d) or conv.groups != 1:
        raise TypeError(f"expected the stem to be a plain Conv2d, found {conv!r}")  # a wrong _SPECS entry
    new = nn.Conv2d(
        in_channels,
        conv.out_channels,
        conv.kernel_size,  # type: ignore[arg-type]
        stride=conv.stride,  # type: ignore[arg-type]
        padding=conv.padding,  # type: ignore[arg-type]
        dilation=conv.dilation,  # type: ignore[arg-type]
        bias=conv.bias is not None,
        padding_mode=conv.padding_mode,
    )
    # torchvision initialises its convolutions this way; nn.Conv2d's own default is narrower.
    nn.init.kaiming_normal_(new.weight, mode="fan_out", nonlinearity="relu")
    if new.bias is not None:
        nn.init.zeros_(new.bias)
    return new


# --- a tiny CNN for tests ------------------------------------------------------------------------
class SmallCNN(nn.Module):
    """Three conv-BN-ReLU-pool blocks and a linear head: fast enough for CPU and XLA:CPU tests."""

    def __init__(self, in_channels: int = 3, num_outputs: int = 10, width: int = 16) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))

        self.features = nn.Sequential(block(in_channels, width), block(width, 2 * width), block(2 * width, 2 * width))
        self.head = nn.Linear(2 * width, num_outputs)

    def forward(self, image_BCHW: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(image_BCHW).mean(dim=(2, 3)))


# --- ResNet-UNet ---------------------------------------------------------------------------------
def _conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


class _BasicBlock(nn.Module):
    """ResNet's two-convolution residual block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        y_BCHW = F.relu(self.bn1(self.conv1(x_BCHW)), inplace=True)
        y_BCHW = self.bn2(self.conv2(y_BCHW))
        return F.relu(y_BCHW + self.shortcut(x_BCHW), inplace=True)


class _UpBlock(nn.Module):
    """Double the resolution, concatenate the encoder's skip connection, two convolutions."""

    def __init__(self, cin: int, skip: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(_conv_bn_relu(cin + skip, cout), _conv_bn_relu(cout, cout))

    def forward(self, x_BCHW: torch.Tensor, skip_BCHW: torch.Tensor) -> torch.Tensor:
        # 2x nearest upsampling written as expand + reshape: torch_xla 2.9 has no lowering for
        # upsample_{bilinear,nearest}2d_backward, so F.interpolate sent every backward through
        # the CPU (4 host round trips per step, found by the run diagnostics).
        B, C, H, W = x_BCHW.shape
        up_BCHW = x_BCHW[:, :, :, None, :, None].expand(B, C, H, 2, W, 2).reshape(B, C, 2 * H, 2 * W)
        return self.conv(torch.cat([up_BCHW, skip_BCHW], dim=1))


class ResNetUNet(nn.Module):
    """A UNet whose encoder is a ResNet, with a mask head and a depth head.

    The encoder keeps a full-resolution stem (small images: 96x96 has no pixels to spare) and four
    ResNet stages that each halve the resolution and double the channels (``width`` to
    ``8 * width``); the decoder upsamples back with a skip connection from every encoder level.
    At the defaults (``width=64``, ``blocks=(3, 4, 6, 3)``, ResNet-34's depth) it has about 29.3M
    parameters. Height and width must be multiples of 16.

    Args:
        in_channels: input image channels (1 for the depth-and-mask recipe).
        num_mask_channels: mask logit channels (1 for a binary mask).
        width: channels of the first level; everything scales with it (``width=8`` for tests).
        blocks: residual blocks per encoder stage.

    Returns (from ``forward``):
        ``(mask_logits_BMHW, depth_B1HW)``: raw mask logits (threshold at 0 / apply a sigmoid) and
        an unbounded depth regression, both at the input resolution.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_mask_channels: int = 1,
        width: int = 64,
        blocks: Sequence[int] = (3, 4, 6, 3),
    ) -> None:
        super().__init__()
        if isinstance(width, bool) or not isinstance(width, int) or width < 2:
            raise ValueError(f"width={width!r} is not valid: use an integer >= 2 (64 for the full model, 8 for tests)")
        if len(blocks) != 4 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in blocks):
            raise ValueError(f"blocks={tuple(blocks)!r} is not valid: give 4 integers >= 1, e.g. (3, 4, 6, 3)")
        chans = [width, 2 * width, 4 * width, 8 * width]
        self.stem = nn.Sequential(_conv_bn_relu(in_channels, width), _conv_bn_relu(width, width))
        stages, cin = [], width
        for cout, num in zip(chans, blocks):
            stages.append(nn.Sequential(_BasicBlock(cin, cout, stride=2), *[_BasicBlock(cout, cout, 1) for _ in range(num - 1)]))
            cin = cout
        self.encoder = nn.ModuleList(stages)
        self.center = nn.Sequential(_conv_bn_relu(chans[3], chans[3]), _conv_bn_relu(chans[3], chans[3]))
        self.decoder = nn.ModuleList(
            [
                _UpBlock(chans[3], chans[2], chans[2]),
                _UpBlock(chans[2], chans[1], chans[1]),
                _UpBlock(chans[1], chans[0], chans[0]),
                _UpBlock(chans[0], width, width),
            ]
        )
        self.mask_head = nn.Conv2d(width, num_mask_channels, 1)
        self.depth_head = nn.Sequential(_conv_bn_relu(width, max(width // 2, 1)), nn.Conv2d(max(width // 2, 1), 1, 1))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, image_BCHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        height, width = image_BCHW.shape[-2:]
        if height % 16 or width % 16:  # static shapes: a host-side check, no device read
            raise ValueError(
                f"ResNetUNet needs height and width divisible by 16 (four halvings), got {height}x{width}: "
                f"resize or pad the images, e.g. to {math.ceil(height / 16) * 16}x{math.ceil(width / 16) * 16}"
            )
        x_BCHW = self.stem(image_BCHW)
        skips = [x_BCHW]
        for stage in self.encoder:
            x_BCHW = stage(x_BCHW)
            skips.append(x_BCHW)
        x_BCHW = self.center(skips.pop())
        for up in self.decoder:
            x_BCHW = up(x_BCHW, skips.pop())
        return self.mask_head(x_BCHW), self.depth_head(x_BCHW)

