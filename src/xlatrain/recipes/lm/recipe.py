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
    cfg = config.model
    if cfg.name != "byte_gpt":
        raise ValueError(f"model.name={cfg.name!r}: the lm recipe builds byte_gpt")
    for key in ("blocks", "pretrained"):
        if getattr(cfg, key) not in (None, False):
            raise ValueError(f"model.{key} is set but byte_gpt has no such option: it takes "
                             f"{', '.join('model.' + k for k in MODEL_KEYS)}; remove the key")
    options = {k: getattr(cfg, k) for k in MODEL_KEYS if getattr(cfg, k) is not None}
    return ByteGPT(context=context, **options)


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
