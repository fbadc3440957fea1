"""Pick the hardware: ``select_backend("auto"|"tpu"|"xla"|"cuda"|"cpu", devices=..., tpu_runtime=...)``."""

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
    accelerator: str = "auto",
    devices: int | None = None,
    xla_mode: str = "spmd",
    compile_cache: bool = True,
    tpu_runtime: str = "auto",
) -> Backend:
    """Build the backend for ``accelerator``.

    ``auto`` takes a TPU when one can run (TorchTPU first, then torch_xla), else CUDA, else the
    CPU. ``tpu`` takes the runtime ``tpu_runtime`` names (``auto``: TorchTPU when it has a TPU
    device, else torch_xla with a TPU attached) or fails saying what each runtime found. ``xla``
    runs torch_xla on whatever PJRT device exists: on a host without a TPU that is XLA:CPU with
    ``devices`` virtual devices, to rehearse a TPU program.

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
    from xlatrain.backend import runtimes
    from xlatrain.backend.hardware import settle_libtpu_without_tpu, torch_tpu_cache_env

    if tpu_runtime not in runtimes.TPU_RUNTIMES:
        raise ValueError(
            f"tpu_runtime={tpu_runtime!r} is not valid: choose one of {', '.join(map(repr, runtimes.TPU_RUNTIMES))}"
        )
    settle_libtpu_without_tpu()  # before anything asks torch for its devices
    torch_tpu_cache_env(compile_cache)  # read by TorchTPU at its first compilation
    import torch

    from xlatrain.backend.native import NativeBackend

    runtime = None
    if accelerator in ("auto", "tpu"):
        found = runtimes.probe()
        runtime = runtimes.choose(found, tpu_runtime if accelerator == "tpu" else "auto")
        if accelerator == "tpu" and runtime is None:
            raise runtimes.unavailable(found)
    if accelerator == "auto" and runtime is None:
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if runtime == "torch_tpu":
        return NativeBackend("tpu", devices=devices)
    if runtime == "torch_xla" or accelerator == "xla":
        if not _xla_installed():
            raise BackendUnavailableError(
                f"accelerator='xla' needs torch_xla, which is not installed: {runtimes.INSTALL_TORCH_XLA}"
            )
        from xlatrain.backend.xla import XlaBackend

        return XlaBackend(
            devices=devices, mode=xla_mode, require_tpu=runtime == "torch_xla", compile_cache=compile_cache
        )
    return NativeBackend(accelerator, devices=devices)


def from_config(config: BackendConfig) -> Backend:
    return select_backend(
        config.accelerator, devices=config.devices, xla_mode=config.xla_mode, compile_cache=config.compile_cache,
        tpu_runtime=config.tpu_runtime,
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
