"""Pick the hardware and the distribution: ``select_backend(accelerator, devices=..., strategy=...)``.

A :class:`~xlatrain.backend.base.Backend` is a Runtime (what the device is: ``native.py`` for
CPU, CUDA and TorchTPU, ``xla.py`` for torch_xla) and a Strategy (how the model is spread:
``single.py``, ``ddp.py``, ``fsdp.py`` on the native runtimes; ``spmd.py`` and
``xla_processes.py`` on torch_xla). Each is one file implementing its protocol in ``base.py``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

from xlatrain.backend.errors import BackendUnavailableError
from xlatrain.config import ACCELERATORS, STRATEGIES, XLA_MODES, BackendConfig

if TYPE_CHECKING:
    from xlatrain.backend.base import Backend
    from xlatrain.backend.units import UnitPolicy

__all__ = ["Backend", "BackendUnavailableError", "select_backend", "spawn"]


def _xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def select_backend(
    accelerator: str = "auto",
    devices: int | None = None,
    xla_mode: str = "spmd",
    compile_cache: bool = True,
    tpu_runtime: str = "auto",
    strategy: str = "auto",
    units: UnitPolicy = None,
    activation_checkpointing: bool = False,
) -> Backend:
    """Build the backend for ``accelerator`` spread by ``strategy``.

    ``auto`` takes a TPU when one can run (TorchTPU first, then torch_xla), else CUDA, else the
    CPU. ``tpu`` takes the runtime ``tpu_runtime`` names (``auto``: TorchTPU when it has a TPU
    device, else torch_xla with a TPU attached) or fails saying what each runtime found. ``xla``
    runs torch_xla on whatever PJRT device exists: on a host without a TPU that is XLA:CPU with
    ``devices`` virtual devices, to rehearse a TPU program.

    ``strategy``: ``auto`` (data parallel over whatever was launched: DDP under torchrun, SPMD
    over a ``data`` mesh on torch_xla, one device otherwise), ``single``, ``ddp`` or ``fsdp``
    (torch's ``fully_shard`` on CPU/CUDA/TorchTPU; torch_xla's FSDPv2 over an ``fsdp`` mesh).

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
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(map(repr, STRATEGIES))}")
    from xlatrain.backend import runtimes
    from xlatrain.backend.hardware import settle_libtpu_without_tpu, torch_tpu_cache_env

    if tpu_runtime not in runtimes.TPU_RUNTIMES:
        raise ValueError(
            f"tpu_runtime={tpu_runtime!r} is not valid: choose one of {', '.join(map(repr, runtimes.TPU_RUNTIMES))}"
        )
    settle_libtpu_without_tpu()  # before anything asks torch for its devices
    torch_tpu_cache_env(compile_cache)  # read by TorchTPU at its first compilation
    import torch

    runtime = None
    if accelerator in ("auto", "tpu"):
        found = runtimes.probe()
        runtime = runtimes.choose(found, tpu_runtime if accelerator == "tpu" else "auto")
        if accelerator == "tpu" and runtime is None:
            raise runtimes.unavailable(found)
    if accelerator == "auto" and runtime is None:
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if runtime == "torch_xla" or (runtime is None and accelerator == "xla"):
        if not _xla_installed():
            raise BackendUnavailableError(
                f"accelerator='xla' needs torch_xla, which is not installed: {runtimes.INSTALL_TORCH_XLA}"
            )
        return _xla_backend(devices, xla_mode, runtime == "torch_xla", compile_cache, strategy, units,
                            activation_checkpointing)
    return _native_backend("tpu" if runtime == "torch_tpu" else accelerator, devices, strategy, units,
                           activation_checkpointing)


# TorchTPU's launch variables for a shell launcher: the module prints plain NAME="value" lines, which
# set -a exports, so that torchrun's workers see them. The hint runs it and torchrun in a subshell,
# ( ... ), so that none of them stay in the user's shell (the module keeps a variable already set).
TPU_LAUNCH_ENV = 'set -a; eval "$(python -m torch.tpu.distributed)"; set +a'


def torchrun_command(processes: int, argv: list[str] | None = None) -> str:
    """The command that runs this one as ``processes`` torchrun processes: ``xlatrain``'s own
    command line as its module (torchrun runs a module or a script, not a console entry point)."""
    import shlex
    import sys

    argv = list(sys.argv if argv is None else argv)
    program = argv[0] if argv else "your_script.py"
    name = os.path.basename(program)
    if name in ("xlatrain", "cli.py", "__main__.py") or program.endswith(("xlatrain/cli.py", "xlatrain/__main__.py")):
        target = ["-m", "xlatrain.cli"]
    elif program in ("-c", ""):
        target = ["your_script.py"]
    else:
        target = [program]
    return " ".join(["torchrun", "--nproc-per-node", str(processes), *target, *map(shlex.quote, argv[1:])])


def _native_backend(
    device_type: str, devices: int | None, strategy: str, units: UnitPolicy, activation_checkpointing: bool
) -> Backend:
    from xlatrain.backend.base import Backend
    from xlatrain.backend.native import NativeRuntime
    from xlatrain.backend.processes import Processes, launched_world_size

    world = launched_world_size()
    if devices is not None and devices != world:
        if devices <= 1:
            hint = "leave devices unset under torchrun"
        elif device_type == "tpu":
            hint = f"launch it with `( {TPU_LAUNCH_ENV}; {torchrun_command(devices)} )`"
        else:
            hint = f"launch it with `{torchrun_command(devices)}`"
        raise ValueError(
            f"devices={devices} with accelerator={device_type!r} means {devices} processes, one per "
            f"device, but this job has {world}: {hint}"
        )
    if strategy == "single" and world > 1:
        raise ValueError(
            f"strategy='single' trains in one process, but this job has {world} processes: use strategy='ddp' "
            "or 'fsdp' to spread the run over them, or start one process without torchrun"
        )
    runtime = NativeRuntime(device_type)
    kind = "ddp" if strategy == "auto" and world > 1 else ("single" if strategy == "auto" else strategy)
    processes = Processes(device_type, need_group=kind == "fsdp")
    options = {"units": units, "activation_checkpointing": activation_checkpointing}
    if kind == "single":
        from xlatrain.backend.single import SingleDevice

        return Backend(runtime, SingleDevice(runtime.device, processes, **options))
    if kind == "ddp":
        from xlatrain.backend.ddp import DDP

        return Backend(runtime, DDP(runtime.device, processes, **options))
    from xlatrain.backend.fsdp import FSDP

    return Backend(runtime, FSDP(runtime.device, processes, **options))


def _xla_backend(
    devices: int | None, xla_mode: str, require_tpu: bool, compile_cache: bool, strategy: str, units: UnitPolicy,
    activation_checkpointing: bool,
) -> Backend:
    from xlatrain.backend.base import Backend
    from xlatrain.backend.xla import XlaRuntime

    if xla_mode == "multiprocess" and strategy == "fsdp":
        raise ValueError(
            "strategy='fsdp' on torch_xla shards over an SPMD mesh, in one process per host: use "
            "xla_mode='spmd' (the default), or strategy='ddp' with xla_mode='multiprocess'"
        )
    if strategy == "single" and devices not in (None, 1):
        raise ValueError(f"strategy='single' trains on one device, but devices={devices}: use devices=1, or strategy='ddp'")
    runtime = XlaRuntime(devices=1 if strategy == "single" else devices, spmd=xla_mode == "spmd",
                         require_tpu=require_tpu, compile_cache=compile_cache)
    if xla_mode == "multiprocess":
        from xlatrain.backend.xla_processes import XlaProcesses

        return Backend(runtime, XlaProcesses(runtime, activation_checkpointing=activation_checkpointing, units=units))
    from xlatrain.backend.spmd import Spmd

    return Backend(runtime, Spmd(runtime, axis="fsdp" if strategy == "fsdp" else "data", units=units,
                                 activation_checkpointing=activation_checkpointing))


def from_config(config: BackendConfig) -> Backend:
    backend = select_backend(
        config.accelerator, devices=config.devices, xla_mode=config.xla_mode, compile_cache=config.compile_cache,
        tpu_runtime=config.tpu_runtime, strategy=config.strategy, units=config.units,
        activation_checkpointing=config.activation_checkpointing,
    )
    if config.device_memory is None:
        return backend
    import dataclasses

    from xlatrain.backend.hardware import parse_memory

    return dataclasses.replace(backend, device_memory=parse_memory(config.device_memory))


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
