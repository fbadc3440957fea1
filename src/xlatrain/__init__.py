"""xlatrain: train an existing PyTorch pipeline on TPU (TorchTPU or torch_xla), CUDA or CPU with one call.

The public names below are imported on first use, so ``import xlatrain`` (and the ``xlatrain``
command's ``--help`` and ``doctor``) start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "Backend": "xlatrain.backend.base",
    "BackendUnavailableError": "xlatrain.backend.errors",
    "select_backend": "xlatrain.backend",
    "spawn": "xlatrain.backend",
    "load_weights": "xlatrain.train.state",
    "save_weights": "xlatrain.checkpoint",
    "BackendConfig": "xlatrain.config",
    "CheckpointConfig": "xlatrain.config",
    "TrainConfig": "xlatrain.config",
    "PadCollate": "xlatrain.data.padding",
    "collate": "xlatrain.train.batch",
    "DetectionMAP": "xlatrain.train.detection",
    "DiagnosticsError": "xlatrain.diagnostics.run",
    "DoesNotFitError": "xlatrain.train.trainer",
    "ModelParameters": "xlatrain.train.factories",
    "NonFiniteLossError": "xlatrain.train.trainer",
    "RunShape": "xlatrain.train.factories",
    "Trainer": "xlatrain.train.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'xlatrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from xlatrain.backend import select_backend, spawn
    from xlatrain.backend.base import Backend
    from xlatrain.backend.errors import BackendUnavailableError
    from xlatrain.checkpoint import save_weights
    from xlatrain.config import BackendConfig, CheckpointConfig, TrainConfig
    from xlatrain.data.padding import PadCollate
    from xlatrain.train.batch import collate
    from xlatrain.train.detection import DetectionMAP
    from xlatrain.train.state import load_weights
    from xlatrain.diagnostics.run import DiagnosticsError
    from xlatrain.train.factories import ModelParameters, RunShape
    from xlatrain.train.trainer import DoesNotFitError, NonFiniteLossError, Trainer
