"""The language-model recipe: ``xlatrain fit configs/lm.yaml``.

A byte-level decoder-only transformer (:class:`~xlatrain.recipes.lm.model.ByteGPT`) trained on
the Python standard library's source, validated on files it never saw; the history holds the
loss in nats per byte and in bits per byte (``train_bpb``, ``val_bpb``). Sized by the ``model``
section from a CPU-sized model to billions of parameters (``width``, ``layers``, ``heads``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from xlatrain.config import check_int
from xlatrain.recipes.lm.data import ByteWindows, split_bytes
from xlatrain.recipes.lm.model import ByteGPT

LN2 = math.log(2.0)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    context: int = 256  # tokens (bytes) per sample
    val_percent: int = 5  # of the files, by a hash of their path
    max_train_bytes: int = 4_000_000
    max_val_bytes: int = 250_000

    def __post_init__(self) -> None:
        check_int("data.context", self.context, minimum=2)
        check_int("data.val_percent", self.val_percent)
        if self.val_percent >= 100:
            raise ValueError(f"data.val_percent={self.val_percent} is not valid: give a percentage below 100")
        check_int("data.max_train_bytes", self.max_train_bytes)
        check_int("data.max_val_bytes", self.max_val_bytes)


def byte_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, reduction: str = "mean") -> dict[str, torch.Tensor]:
    """Next-byte cross-entropy in nats per byte, and the same in bits per byte (``bpb``).

    ``reduction="none"`` gives one value per sample (its mean over positions), which evaluation
    sums on the device.
    """
    if reduction == "none":
        ce_B = F.cross_entropy(logits_BTV.transpose(1, 2), targets_BT, reduction="none").mean(dim=1)
        return {"loss": ce_B, "bpb": ce_B / LN2}
    ce = F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())
    return {"loss": ce, "bpb": ce / LN2}


MODEL_KEYS = ("width", "layers", "heads", "positions")


def build_model(config: Any, context: int) -> ByteGPT:
    """The ``model`` section's ByteGPT; ``model.pretrained`` (the path of an lm run's
    ``best.safetensors``, or of ``xlatrain export``'s file) is loaded into it whole."""
    cfg = config.model
    if cfg.name != "byte_gpt":
        raise ValueError(f"model.name={cfg.name!r}: the lm recipe builds byte_gpt")
    if cfg.blocks is not None:
        raise ValueError(f"model.blocks is set but byte_gpt has no such option: it takes "
                         f"{', '.join('model.' + k for k in MODEL_KEYS)}; remove the key")
    options = {k: getattr(cfg, k) for k in MODEL_KEYS if getattr(cfg, k) is not None}
    model = ByteGPT(context=context, **options)
    if cfg.pretrained not in (None, False):
        load_pretrained(model, cfg.pretrained)
    return model


def load_pretrained(model: ByteGPT, path: Any) -> None:
    """Every weight of ``model`` from the file at ``path``, or an error naming the keys that differ:
    a language model has no head to start afresh, so nothing is left out or adapted."""
    from xlatrain.models import load_state_dict_file

    if path is True:
        raise ValueError("model.pretrained=true would download weights, and xlatrain never downloads: give the path "
                         "of a weights file, e.g. RUN_DIR/best.safetensors of an earlier lm run")
    state = load_state_dict_file(path)
    target = model.state_dict()
    missing = [k for k in target if k not in state]
    unexpected = [k for k in state if k not in target]
    shapes = [f"{k} {tuple(state[k].shape)} in the file vs {tuple(v.shape)} in the model"
              for k, v in target.items() if k in state and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = [f"{len(keys)} key(s) {label}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
                 for label, keys in (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)) if keys]
        raise ValueError(
            f"model.pretrained={str(path)!r} does not hold this byte_gpt's weights ({'; '.join(parts)}): give the "
            "best.safetensors (or xlatrain export file) of an lm run with the same model.width, model.layers, "
            "model.heads and model.positions (and data.context, under learned positions)"
        )
    model.load_state_dict(state, strict=True)


def build(config: Any) -> Any:
    from xlatrain.config import from_dict
    from xlatrain.recipes.run import RecipeParts

    data = from_dict(DataConfig, config.data, section="data")
    train_bytes, val_bytes = split_bytes(data.val_percent, data.max_train_bytes, data.max_val_bytes)
    torch.manual_seed(config.trainer.seed)
    return RecipeParts(
        model=build_model(config, data.context),
        loss_fn=byte_loss,
        train_data=ByteWindows(train_bytes, data.context),
        val_data=ByteWindows(val_bytes, data.context),
    )
