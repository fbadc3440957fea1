"""Pick the hardware: ``select_backend("auto"|"tpu"|"xla"|"cuda"|"cpu", devices=...)``."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from xlatrain.backend.errors import BackendUnavailableError
from xlatrain.config import ACCELERATORS, XLA_MODES, BackendConfig

if TYPE_CHECKING:
    from xlatrain.backend.base import Backend

__all__ = ["Backend", "BackendUnavailableError", "select_backend", "spawn"]


def _xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def select_backend(
    accelerator: str = "auto", devices: int | None = None, xla_mode: str = "spmd", compile_cache: bool = True
) -> Backend:
    """Build the backend for ``accelerator``.

    ``auto`` takes a TPU through torch_xla when one is attached, else CUDA, else the CPU.
    ``xla`` runs torch_xla on whatever PJRT device exists: on a host without a TPU that is XLA:CPU
    with ``devices`` virtual devices, to rehearse a TPU program.

    Example:
        >>> select_backend("cpu").describe()
        'cpu (CPU), single process'
    """
    if accelerator not in ACCELERATORS:
        raise ValueError(
            f"unknown accelerator {accelerator!r}: choose one of {', '.join(map(repr, ACCELERATORS))}"
        )
    if xla_mode not in XLA_MODES:
        raise ValueError(f"unknown xla_mode {xla_mode!r}: choose one of {', '.join(map(repr, XLA_MODES))}")
    from xlatrain.backend.hardware import settle_libtpu_without_tpu

    settle_libtpu_without_tpu()  # before anything asks torch for its devices
    import torch

    from xlatrain.backend.native import NativeBackend
    from xlatrain.backend.xla import tpu_present

    if accelerator == "auto":
        if _xla_installed() and tpu_present():
            accelerator = "tpu"
        elif torch.cuda.is_available():
            accelerator = "cuda"
        else:
            accelerator = "cpu"
    if accelerator in ("tpu", "xla"):
        if not _xla_installed():
            raise BackendUnavailableError(
                f"accelerator={accelerator!r} needs torch_xla, which is not installed: "
                "pip install 'xlatrain[xla]' (torch_xla 2.9.0 for torch 2.9.0)"
            )
        from xlatrain.backend.xla import XlaBackend

        return XlaBackend(
            devices=devices, mode=xla_mode, require_tpu=accelerator == "tpu", compile_cache=compile_cache
        )
    return NativeBackend(accelerator, devices=devices)


def from_config(config: BackendConfig) -> Backend:
    return select_backend(
        config.accelerator, devices=config.devices, xla_mode=config.xla_mode, compile_cache=config.compile_cache
    )


def __getattr__(name: str) -> Any:
    # The protocol module imports torch; load it only when someone asks for it.
    if name == "Backend":
        from xlatrain.backend.base import Backend

        return Backend
    raise AttributeError(f"module 'xlatrain.backend' has no attribute {name!r}")


def spawn(fn, args=(), devices=None):  # type: ignore[no-untyped-def]
    """One process per XLA device (see :func:`xlatrain.backend.xla.spawn`)."""
    from xlatrain.backend.xla import spawn as xla_spawn

    xla_spawn(fn, args=args, devices=devices)
