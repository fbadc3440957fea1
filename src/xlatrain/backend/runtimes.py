"""Which TPU runtime runs a job: TorchTPU (``torch_tpu``) or PyTorch/XLA (``torch_xla``).

The choice is a pure function of what :func:`probe` found (:class:`TpuRuntimes`), so it is tested
on any machine with the findings of another. Neither probe starts a device: TorchTPU is asked
through torch's own registry (its ``torch.tpu.*`` device functions refuse calls from outside torch
on torch >= 2.11), torch_xla only for whether it is installed.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
from dataclasses import dataclass

from xlatrain.backend.errors import BackendUnavailableError
from xlatrain.backend.hardware import find_tpu_chips
from xlatrain.config import TPU_RUNTIMES

INSTALL_TORCH_TPU = "pip install 'xlatrain[tpu]'  (TorchTPU on current torch 2.11-2.15)"
INSTALL_TORCH_XLA = (
    "pip install 'xlatrain[xla]' in an environment of its own (torch_xla 2.9.0 with torch 2.9.0; "
    "on a TPU also 'torch_xla[tpu]==2.9.0', which brings libtpu 0.0.21)"
)


@dataclass(frozen=True)
class TpuRuntimes:
    """What each TPU runtime found on this host."""

    tpu_chips: int  # TPU chips on the PCI bus
    torch_tpu_version: str | None  # None: not installed
    torch_tpu_devices: int  # TPU devices TorchTPU registered in this process (0: none)
    torch_tpu_autoload_off: bool  # TORCH_DEVICE_BACKEND_AUTOLOAD=0 kept torch_tpu from loading
    torch_xla_version: str | None
    pjrt_device: str | None  # PJRT_DEVICE, which torch_xla reads

    @property
    def xla_tpu_attached(self) -> bool:
        return self.torch_xla_version is not None and (self.tpu_chips > 0 or (self.pjrt_device or "").upper() == "TPU")

    def describe(self) -> str:
        if self.torch_tpu_version is None:
            tpu = "TorchTPU: not installed"
        elif self.torch_tpu_devices:
            tpu = f"TorchTPU (torch_tpu {self.torch_tpu_version}): {self.torch_tpu_devices} TPU device(s)"
        elif self.torch_tpu_autoload_off:
            tpu = (f"TorchTPU (torch_tpu {self.torch_tpu_version}): installed but not loaded "
                   "(TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns off its loading at import torch)")
        else:
            tpu = f"TorchTPU (torch_tpu {self.torch_tpu_version}): installed, no TPU device registered"
        if self.torch_xla_version is None:
            xla = "torch_xla: not installed"
        else:
            xla = (f"torch_xla {self.torch_xla_version}: installed, "
                   + ("a TPU is attached" if self.xla_tpu_attached else
                      f"no TPU attached (PJRT_DEVICE={self.pjrt_device or '<unset>'})"))
        return f"{tpu}; {xla}; TPU chips on the PCI bus: {self.tpu_chips}"


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def probe() -> TpuRuntimes:
    """Look at this process and host. Imports torch (TorchTPU registers itself at ``import torch``)."""
    import torch

    tpu_version = _version("torch_tpu") if importlib.util.find_spec("torch_tpu") is not None else None
    devices = 0
    if tpu_version is not None and torch._C._get_privateuse1_backend_name() == "tpu":
        devices = torch.accelerator.device_count()
    return TpuRuntimes(
        tpu_chips=len(find_tpu_chips()),
        torch_tpu_version=tpu_version,
        torch_tpu_devices=devices,
        torch_tpu_autoload_off=os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1",
        torch_xla_version=_version("torch_xla") if importlib.util.find_spec("torch_xla") is not None else None,
        pjrt_device=os.environ.get("PJRT_DEVICE"),
    )


def choose(found: TpuRuntimes, requested: str = "auto") -> str | None:
    """The runtime for a TPU job: ``"torch_tpu"``, ``"torch_xla"``, or ``None`` when ``auto`` finds no TPU.

    ``auto`` prefers TorchTPU, the runtime on current torch, then torch_xla with a TPU attached.
    A forced runtime that cannot run here raises :class:`BackendUnavailableError` saying what was
    found and how to install each runtime.
    """
    if requested not in TPU_RUNTIMES:
        raise ValueError(f"tpu_runtime={requested!r} is not valid: choose one of {', '.join(map(repr, TPU_RUNTIMES))}")
    if requested in ("auto", "torch_tpu") and found.torch_tpu_devices > 0:
        return "torch_tpu"
    if requested in ("auto", "torch_xla") and found.xla_tpu_attached:
        return "torch_xla"
    if requested == "auto":
        return None
    raise unavailable(found, requested)


def unavailable(found: TpuRuntimes, requested: str = "auto") -> BackendUnavailableError:
    wanted = "a TPU" if requested == "auto" else f"the {requested} runtime"
    return BackendUnavailableError(
        f"accelerator='tpu' asked for {wanted}, but none can run here. Found: {found.describe()}. "
        f"Install TorchTPU: {INSTALL_TORCH_TPU}; or torch_xla: {INSTALL_TORCH_XLA}. Without a TPU, "
        "accelerator='xla' with devices=N rehearses the run on N virtual XLA:CPU devices (torch_xla), "
        "and accelerator='auto' takes CUDA or the CPU."
    )
