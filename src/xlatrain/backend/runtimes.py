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
    # Where the installed ``torch_tpu`` comes from (its distribution's name and home page), where
    # that is not Google's TorchTPU: another project (for Sophgo chips) installs a module of the
    # same name with a ``tpu`` device. None: Google's, or not installed.
    torch_tpu_other: str | None
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
        elif self.torch_tpu_other is not None:
            tpu = (f"a torch_tpu that is not Google's TorchTPU ({self.torch_tpu_other}): xlatrain does not run on it; "
                   "uninstall it, or use an environment of its own for it")
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
    other = torch_tpu_origin() if tpu_version is not None else None
    devices = 0
    if tpu_version is not None and other is None and torch._C._get_privateuse1_backend_name() == "tpu":
        devices = torch.accelerator.device_count()
    return TpuRuntimes(
        tpu_chips=len(find_tpu_chips()),
        torch_tpu_version=tpu_version,
        torch_tpu_other=other,
        torch_tpu_devices=devices,
        torch_tpu_autoload_off=os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1",
        torch_xla_version=_version("torch_xla") if importlib.util.find_spec("torch_xla") is not None else None,
        pjrt_device=os.environ.get("PJRT_DEVICE"),
    )


def torch_tpu_origin() -> str | None:
    """``None`` where the installed ``torch_tpu`` is Google's TorchTPU, else what it is instead
    (the distribution's name, version and home page), from its distribution metadata: the import
    name alone is shared with another project's package."""
    names = _distributions_providing("torch_tpu")
    seen = []
    for name in names:
        try:
            meta = md.metadata(name)
        except md.PackageNotFoundError:
            continue
        where = [*(meta.get_all("Home-page") or []), *(meta.get_all("Project-URL") or []),
                 *(meta.get_all("Author-email") or []), *(meta.get_all("Author") or [])]
        if any("google" in w.lower() for w in where):
            return None
        home = next(iter(meta.get_all("Home-page") or meta.get_all("Project-URL") or []), "no home page given")
        seen.append(f"distribution {meta.get('Name', name)} {meta.get('Version', '?')}, {home}")
    return "; ".join(seen) or "no distribution metadata found for the torch_tpu module"


def _distributions_providing(module: str) -> list[str]:
    """The installed distributions that provide the top-level ``module``: the one named after it
    where that one provides it (a look at one distribution's files), else every distribution's file
    list is read (``packages_distributions``: about 0.45 CPU-s of each run's start in an environment
    of torch, torchvision and their dependencies, measured)."""
    try:
        dist = md.distribution(module)
    except md.PackageNotFoundError:
        dist = None
    if dist is not None:
        top = set((dist.read_text("top_level.txt") or "").split())
        top |= {f.parts[0].removesuffix(".py") for f in dist.files or [] if f.parts}
        if module in top:
            return [dist.metadata["Name"] or module]
    return md.packages_distributions().get(module) or [module]


TORCH_TPU_MODES = {  # torch.tpu.EagerMode member -> what TorchTPU's documentation calls it
    "DEFER_NEVER": "Strict",
    "DEFER_AND_FUSE": "Fused",
    "DEFER_NEVER_AND_LAUNCH_BLOCKING": "Debug",
}


def torch_tpu_mode_from_env(environ: dict[str, str] | None = None) -> str:
    """The eager mode TorchTPU starts in, as its environment variables choose it."""
    env = os.environ if environ is None else environ

    def on(name: str) -> bool:
        return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")

    if on("TORCH_TPU_LAUNCH_BLOCKING"):
        return "DEFER_NEVER_AND_LAUNCH_BLOCKING"
    return "DEFER_AND_FUSE" if on("TORCH_TPU_DEFER_AND_FUSE") else "DEFER_NEVER"


def torch_tpu_notes(eager_mode: str, matmul_precision: str | None, compiled: bool = False) -> list[str]:
    """What a TorchTPU run should know about its eager mode and float32 matmul precision.

    ``eager_mode``: a ``torch.tpu.EagerMode`` member's name; ``matmul_precision``: what
    ``torch.get_float32_matmul_precision()`` says under TorchTPU (``None``: not known here).
    """
    notes = []
    mode = TORCH_TPU_MODES.get(eager_mode, eager_mode)
    if eager_mode == "DEFER_NEVER" and not compiled:
        notes.append(
            f"TorchTPU eager mode {mode} ({eager_mode}, the default): each op is dispatched alone. Fused mode "
            "defers and fuses them, reported 50-100% faster: set torch.tpu.eager_mode = "
            "torch.tpu.EagerMode.DEFER_AND_FUSE before training, or TORCH_TPU_DEFER_AND_FUSE=1, or train with "
            "compile=True"
        )
    elif eager_mode == "DEFER_NEVER_AND_LAUNCH_BLOCKING":
        notes.append(
            f"TorchTPU eager mode {mode} ({eager_mode}): every op waits for the device, for debugging only; unset "
            "TORCH_TPU_LAUNCH_BLOCKING to train at speed"
        )
    else:
        notes.append(f"TorchTPU eager mode {mode} ({eager_mode})")
    if matmul_precision == "medium":
        notes.append(
            "float32 matmuls and convolutions run at bfloat16 precision on the TPU "
            "(torch.get_float32_matmul_precision() is 'medium', TorchTPU's default), as XLA_USE_BF16 did: "
            "torch.set_float32_matmul_precision('highest') computes them in float32, more slowly"
        )
    elif matmul_precision is not None:
        notes.append(f"float32 matmul precision {matmul_precision!r} (torch.set_float32_matmul_precision)")
    return notes


def choose(found: TpuRuntimes, requested: str = "auto") -> str | None:
    """The runtime for a TPU job: ``"torch_tpu"``, ``"torch_xla"``, or ``None`` when ``auto`` finds no TPU.

    ``auto`` prefers TorchTPU, the runtime on current torch, then torch_xla with a TPU attached.
    A forced runtime that cannot run here raises :class:`BackendUnavailableError` saying what was
    found and how to install each runtime.
    """
    if requested not in TPU_RUNTIMES:
        raise ValueError(f"tpu_runtime={requested!r} is not valid: choose one of {', '.join(map(repr, TPU_RUNTIMES))}")
    if requested in ("auto", "torch_tpu") and found.torch_tpu_devices > 0 and found.torch_tpu_other is None:
        return "torch_tpu"
    if requested in ("auto", "torch_xla") and found.xla_tpu_attached:
        return "torch_xla"
    if requested == "auto":
        return None
    raise unavailable(found, requested)


def unavailable(found: TpuRuntimes, requested: str = "auto") -> BackendUnavailableError:
    wanted = "a TPU" if requested == "auto" else f"the {requested} runtime"
    if found.torch_tpu_other is not None and requested in ("auto", "torch_tpu"):
        return BackendUnavailableError(
            f"accelerator='tpu' asked for {wanted}, but the torch_tpu installed here is not Google's TorchTPU "
            f"({found.torch_tpu_other}): another project's package of the same name. Uninstall it (pip uninstall "
            f"it by that distribution's name) or give it an environment of its own, then install TorchTPU: "
            f"{INSTALL_TORCH_TPU}. Found: {found.describe()}"
        )
    # Installing a runtime is the fix where none is installed; with one installed and no chip found,
    # it is the machine.
    installed = found.torch_tpu_version is not None or found.torch_xla_version is not None
    install = "" if installed else f"Install TorchTPU: {INSTALL_TORCH_TPU}; or torch_xla: {INSTALL_TORCH_XLA}. "
    if not found.tpu_chips:
        install = "No TPU chip was found on this machine's PCI bus: run on a TPU VM. " + install
    elif installed:
        install = f"Install TorchTPU: {INSTALL_TORCH_TPU}; or torch_xla: {INSTALL_TORCH_XLA}. "
    return BackendUnavailableError(
        f"accelerator='tpu' asked for {wanted}, but none can run here. Found: {found.describe()}. "
        f"{install}Without a TPU, "
        "accelerator='xla' with devices=N rehearses the run on N virtual XLA:CPU devices (torch_xla), "
        "and accelerator='auto' takes CUDA or the CPU."
    )
