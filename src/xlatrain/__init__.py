"""xlatrain: train an existing PyTorch pipeline on TPU (torch_xla), CUDA or CPU with one call."""

from xlatrain.backend import Backend, BackendUnavailableError, select_backend, spawn
from xlatrain.checkpoint import load_weights, save_weights
from xlatrain.config import BackendConfig, CheckpointConfig, TrainConfig
from xlatrain.diagnostics.run import DiagnosticsError
from xlatrain.train.trainer import NonFiniteLossError, Trainer

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendUnavailableError",
    "CheckpointConfig",
    "DiagnosticsError",
    "NonFiniteLossError",
    "TrainConfig",
    "Trainer",
    "load_weights",
    "save_weights",
    "select_backend",
    "spawn",
]
