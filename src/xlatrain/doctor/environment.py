"""``xlatrain doctor``: which PyTorch runtimes can run here, and every known trap in the environment.

TPUs have two PyTorch runtimes, and they cannot share an environment: TorchTPU (``torch_tpu``, an
eager ``tpu`` device on current torch) and PyTorch/XLA (``torch_xla`` 2.9.0, its last release, on
torch 2.9.0 only). ``collect()`` gathers facts (package versions, TPU chips on the PCI bus and
their VFIO groups, torch_tpu's autoload, the PJRT device, CUDA, host memory, the compilation
cache), judges them against what each runtime needs (``COMPATIBILITY``) and turns them into
findings, each with its evidence and a fix. This process imports no torch: torch (and with it
torch_tpu, which torch loads at import) and torch_xla are probed in a child process with a
timeout, so a runtime that hangs or crashes cannot take the doctor down with it.
``render_text`` / ``render_json`` print the report.

What each environment variable does today was read from torch_xla 2.9.0 itself: its Python
sources and the strings of its ``_XLAC`` runtime library (see ``ENV_TRAPS``); what torch_tpu does,
from its 0.2.0 wheel.

Example:
    >>> from xlatrain.doctor.environment import collect, render_text
    >>> versions = {"torch": "2.9.0", "torchvision": "0.24.0", "torch_xla": "2.9.0"}
    >>> report = collect({"XLA_USE_BF16": "1", "HOME": "/tmp"}, probe=False, versions=versions,
    ...                  pci_root="/nonexistent")
    >>> [f.code for f in report.findings if f.severity == "warning"]
    ['env:XLA_USE_BF16']
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from xlatrain.backend.hardware import (
    PCI_ROOT,
    TORCH_TPU_DEVICE_IDS,
    VFIO_ROOT,
    TpuChip,
    default_cache_dir,
    find_tpu_chips,
    vfio_group,
)
from xlatrain.backend.runtimes import INSTALL_TORCH_TPU, INSTALL_TORCH_XLA
from xlatrain.data.workers import fork_fix_release

SEVERITIES = ("error", "warning", "info")
# PJRT clients built into torch_xla 2.9's runtime library ("Initializing PjRt CPU client",
# "TFRT TPU", "XPU", "NEURON"); any other name needs a registered PJRT plugin.
_BUILTIN_PJRT = ("CPU", "TPU", "XPU", "NEURON")

_FALSY = ("", "0", "false", "no", "off")

# ``versions`` key for a libtpu.so shipped inside the torch_xla package (a path, or None).
BUNDLED_LIBTPU = "torch_xla/lib/libtpu.so"


@dataclass(frozen=True)
class Row:
    """One line of the environment table. ``status``: ok, info, warning or error."""

    name: str
    value: str
    status: str = "ok"


@dataclass(frozen=True)
class Finding:
    """A trap found in the environment: what it is, how we know, what to change."""

    code: str
    severity: str
    title: str
    evidence: str
    fix: str


@dataclass(frozen=True)
class Runtime:
    """One way to run PyTorch on this host, and whether it can run here.

    ``runs_here`` is None where the doctor could not tell (the probe did not run); ``why`` says
    what decided it. ``needs`` is the runtime's requirements judged against what is installed.
    """

    name: str
    installed: str | None
    runs_here: bool | None
    why: str
    needs: str = ""
    install: str = ""


@dataclass(frozen=True)
class Report:
    rows: tuple[Row, ...]
    findings: tuple[Finding, ...]
    runtimes: tuple[Runtime, ...] = ()

    @property
    def usable(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def exit_code(self, strict: bool = False) -> int:
        """0 when usable; 1 when an error makes the environment unusable (or, with ``strict``,
        when anything deserves a warning)."""
        bad = ("error", "warning") if strict else ("error",)
        return 1 if any(f.severity in bad for f in self.findings) else 0


# --------------------------------------------------------------------------- what runs with what


@dataclass(frozen=True)
class RuntimeNeeds:
    """What one release series of a TPU runtime runs with (read from its wheel's metadata)."""

    runtime: str
    dist: str
    series: tuple[int, int]
    torch_lowest: str  # inclusive
    torch_highest: str  # inclusive
    libtpu: str  # ">=X" or "==X"
    python_lowest: str | None
    install: str

    @property
    def torch_text(self) -> str:
        if self.torch_lowest == self.torch_highest:
            return f"torch {self.torch_lowest} exactly"
        return f"torch {self.torch_lowest}-{self.torch_highest}"


COMPATIBILITY: tuple[RuntimeNeeds, ...] = (
    # torch_tpu 0.2.0's METADATA: Requires-Dist torch>=2.11.0,<=2.15.0, libtpu>=0.0.50;
    # Requires-Python >=3.11. It ships C++ glue for torch 2.11.0 to 2.15.0 only.
    RuntimeNeeds("TorchTPU", "torch_tpu", (0, 2), "2.11.0", "2.15.0", ">=0.0.50", "3.11", INSTALL_TORCH_TPU),
    # torch_xla 2.9.0 is built against torch 2.9.0; its [tpu] extra pins libtpu==0.0.21.
    RuntimeNeeds("torch_xla", "torch_xla", (2, 9), "2.9.0", "2.9.0", "==0.0.21", None, INSTALL_TORCH_XLA),
)

FROZEN_NOTE = (
    "torch_xla is frozen: 2.9.0 is its last release (torch 2.9.0 only), and TorchTPU replaces it on "
    "current torch. The two cannot share an environment."
)


def runtime_needs(dist: str, version: str | None) -> RuntimeNeeds | None:
    """The ``COMPATIBILITY`` entry for an installed runtime's release series, or None."""
    series = _major_minor(version)
    return next((n for n in COMPATIBILITY if n.dist == dist and n.series == series), None)


def _release(version: str | None) -> tuple[int, ...] | None:
    """``"2.14.1+cu130"`` -> ``(2, 14, 1)``."""
    match = re.match(r"\d+(?:\.\d+)*", version or "")
    return tuple(int(p) for p in match.group(0).split(".")) if match else None


def _compare(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return (a > b) - (a < b)


def _torch_fit(needs: RuntimeNeeds, torch_v: str | None) -> str | None:
    """``"ok"``, ``"older"`` or ``"newer"`` than the torch range ``needs`` names; None if unknown."""
    found = _release(torch_v)
    if found is None:
        return None
    if _compare(found, _release(needs.torch_lowest) or ()) < 0:
        return "older"
    if _compare(found, _release(needs.torch_highest) or ()) > 0:
        return "newer"
    return "ok"


def _spec_ok(version: str | None, spec: str) -> bool | None:
    """Whether ``version`` satisfies ``>=X`` or ``==X``; None when either cannot be read."""
    found, wanted = _release(version), _release(spec[2:])
    if found is None or wanted is None:
        return None
    order = _compare(found, wanted)
    return order >= 0 if spec.startswith(">=") else order == 0


def torch_autoload_on(env: Mapping[str, str]) -> bool:
    """Whether ``import torch`` loads device backends such as torch_tpu: torch 2.14 reads
    ``os.getenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"``, so any other value turns it off."""
    return env.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"

@dataclass(frozen=True)
class EnvTrap:
    """An environment variable that tutorials set and torch_xla 2.9 treats differently now.

    ``flag``: torch_xla reads it as a switch, so ``0`` / empty means off and is no trap.
    """

    name: str
    severity: str
    today: str
    fix: str
    flag: bool = False


_BF16_FIX = (
    'unset it and train with precision="bf16" (TrainConfig(precision="bf16")): autocast runs '
    "matmuls and convolutions in bf16 while weights, optimizer state and metric sums stay float32"
)
_NODE_FIX = (
    "unset it: PJRT talks to local chips only, so run on a TPU VM (the chips are on its PCI bus) "
    "with PJRT_DEVICE=TPU, or leave PJRT_DEVICE unset and let xlatrain pick the TPU"
)

ENV_TRAPS: tuple[EnvTrap, ...] = (
    EnvTrap(
        "XLA_USE_BF16",
        "warning",
        "still honoured by torch_xla 2.9's runtime behind a one-line notice ('XLA_USE_BF16 will be "
        "deprecated after the 2.6 release'): every float32 tensor is stored and computed as "
        "bfloat16 on the device (weights, optimizer state and loss sums included) while "
        "tensor.dtype still reads torch.float32, so nothing shows the precision you trained in",
        _BF16_FIX,
        flag=True,
    ),
    EnvTrap(
        "XLA_DOWNCAST_BF16",
        "warning",
        "still honoured by torch_xla 2.9's runtime behind a deprecation notice: float32 tensors "
        "are stored as bfloat16 on the device (float64 as float32) while tensor.dtype still reads "
        "the original type",
        _BF16_FIX,
        flag=True,
    ),
    EnvTrap(
        "XLA_USE_FP16",
        "warning",
        "does nothing in torch_xla 2.9: import only warns that it is deprecated; the runtime no "
        "longer reads it, so the run is float32",
        'unset it; for reduced precision use precision="bf16" (TPUs compute in bf16, not fp16)',
        flag=True,
    ),
    EnvTrap(
        "XLA_DOWNCAST_FP16",
        "warning",
        "does nothing in torch_xla 2.9: import only warns that it is deprecated; the runtime no "
        "longer reads it, so the run is float32",
        'unset it; for reduced precision use precision="bf16" (TPUs compute in bf16, not fp16)',
        flag=True,
    ),
    EnvTrap(
        "XLA_USE_32BIT_LONG",
        "info",
        "still honoured by torch_xla 2.9's runtime behind a deprecation notice: int64 tensors are "
        "stored as int32 on the device while tensor.dtype still reads torch.int64",
        "unset it and make index tensors int32 explicitly where their range allows",
        flag=True,
    ),
    EnvTrap(
        "XRT_TPU_CONFIG",
        "warning",
        "ignored: torch_xla 2.x has no XRT runtime (PJRT only) and nothing in torch_xla 2.9 reads it",
        "unset it; on a TPU VM set PJRT_DEVICE=TPU, or leave PJRT_DEVICE unset and xlatrain picks "
        "the TPU when a chip is on the PCI bus",
    ),
    EnvTrap(
        "XRT_*",
        "warning",
        "ignored: the XRT runtime these configured is gone from torch_xla 2.x; nothing in torch_xla "
        "2.9 reads XRT_* variables",
        "unset it; PJRT needs no device map or worker list: start one process per host (torchrun, "
        "or xlatrain's spawn) and PJRT finds the local chips",
    ),
    EnvTrap(
        "TPU_IP_ADDRESS",
        "warning",
        "ignored: it addressed a TPU Node (a TPU behind a separate VM, reached over gRPC), which "
        "torch_xla 2.x does not support; nothing in torch_xla 2.9 reads it",
        _NODE_FIX,
    ),
    EnvTrap(
        "COLAB_TPU_ADDR",
        "warning",
        "ignored: the legacy Colab TPU Node address; nothing in torch_xla 2.9 reads it",
        _NODE_FIX,
    ),
    EnvTrap(
        "TPU_NUM_DEVICES",
        "info",
        "torch_xla 2.9 declares the name (core/xla_env_vars.py) but neither its Python code nor its "
        "runtime library reads it; every chip on the host is used",
        "to use fewer chips set TPU_VISIBLE_CHIPS with TPU_CHIPS_PER_PROCESS_BOUNDS and "
        "TPU_PROCESS_BOUNDS (what torch_xla itself sets for one process per chip)",
    ),
    EnvTrap(
        "GPU_NUM_DEVICES",
        "warning",
        "ignored: torch_xla 2.9 does not read it, and its runtime has no built-in CUDA client "
        "(built-in PJRT clients: CPU, TPU, XPU, NEURON)",
        'for NVIDIA GPUs use native PyTorch: accelerator="cuda" (DDP under torchrun); unset it',
    ),
    EnvTrap(
        "XLA_USE_SPMD",
        "info",
        "still honoured, but torch_xla 2.9 warns 'XLA_USE_SPMD is being deprecated. Use "
        "torch_xla.runtime.use_spmd()'",
        "unset it: xlatrain calls torch_xla.runtime.use_spmd() itself in its default "
        'xla_mode="spmd"',
        flag=True,
    ),
    EnvTrap(
        "XLA_USE_EAGER_DEBUG_MODE",
        "warning",
        "turns on torch_xla's eager mode at import: every op is compiled and run on its own, "
        "which is for debugging and far slower than one compiled step",
        "unset it for training and timing runs",
        flag=True,
    ),
    EnvTrap(
        "XLA_IR_DEBUG",
        "info",
        "records the Python frame of every traced op: slower tracing, and torch_xla warns that "
        "with the persistent cache 'changes to the HLO metadata will not be reflected in loaded "
        "executables'",
        "unset it unless you are reading IR dumps",
        flag=True,
    ),
    EnvTrap(
        "XLA_HLO_DEBUG",
        "info",
        "adds Python frames to the HLO metadata: slower tracing, and torch_xla warns against it "
        "with the persistent compilation cache",
        "unset it unless you are reading HLO dumps",
        flag=True,
    ),
    EnvTrap(
        "XLA_SAVE_TENSORS_FILE",
        "info",
        "dumps the IR/HLO of every executed graph to that file: slow, and the file grows each step",
        "unset it outside a debugging session",
    ),
    EnvTrap(
        "XLA_METRICS_FILE",
        "info",
        "writes torch_xla's metrics report to that file at every step",
        "unset it; xlatrain reads the same metrics once per phase in its run report",
    ),
    EnvTrap(
        "PT_XLA_DEBUG_LEVEL",
        "info",
        "turns on torch_xla's debug analysis of every compilation and execution (extra work per step)",
        "unset it for timing runs; xlatrain's run report names recompilations and host syncs",
        flag=True,
    ),
)


def env_trap(name: str) -> EnvTrap | None:
    """The trap entry for an environment variable name, or None (``XRT_*`` matches by prefix)."""
    for trap in ENV_TRAPS:
        if trap.name == name:
            return trap
    if name.startswith("XRT_"):
        return next(t for t in ENV_TRAPS if t.name == "XRT_*")
    return None



# --------------------------------------------------------------------------- probe (child process)

_PROBE_TAG = "XLATRAIN_PROBE "
_TCMALLOC_TAG = "<TorchTpu/Performance/TcMalloc/>"

# Runs in a child process: a torch_xla that hangs or aborts while starting the runtime must not
# take the doctor with it. Each stage prints one tagged JSON line as soon as it is done, so a crash
# in a later stage still leaves the earlier answers. ``import torch`` also loads torch_tpu when it
# is installed and autoload is on; its import-time warnings (tcmalloc) are recorded. What torch
# registered is asked through torch.accelerator: torch_tpu's own torch.tpu.* device functions
# refuse callers outside torch on torch >= 2.11, and none of these calls starts a device. The
# float32 check measures what precision the XLA device really computes in: 1/3*3 + 1e-3 is 1.001
# in float32 and 1.0 in bfloat16.
_PROBE_SOURCE = r"""
import json, sys, time, warnings
def emit(stage, **values):
    print("XLATRAIN_PROBE " + json.dumps(dict(stage=stage, **values)), flush=True)
start = time.monotonic()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
import_s = time.monotonic() - start
names, error = [], None
try:
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
emit("torch", version=torch.__version__, cuda_build=torch.version.cuda, cuda_devices=names, cuda_error=error,
     import_s=round(import_s, 2), torch_tpu_loaded="torch_tpu" in sys.modules,
     import_warnings=sorted({str(w.message) for w in caught}))
if sys.argv[1] == "torch-only":
    sys.exit(0)
try:
    current = torch.accelerator.current_accelerator()
    emit("accelerator", privateuse1=torch._C._get_privateuse1_backend_name(),
         accelerator=None if current is None else current.type,
         available=bool(torch.accelerator.is_available()), count=int(torch.accelerator.device_count()))
except Exception as exc:
    emit("accelerator", error=f"{type(exc).__name__}: {exc}")
if sys.argv[1] != "xla":
    sys.exit(0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_xla
    import torch_xla.runtime as xr
    emit("import", version=getattr(torch_xla, "__version__", "?"), device_type=xr.device_type(),
         warnings=sorted({str(w.message) for w in caught}))
    device = torch_xla.device()
    x = torch.full((), 1.0 / 3.0, dtype=torch.float32, device=device) * 3 + 1e-3
    emit("runtime", device_type=xr.device_type(), devices=xr.global_runtime_device_count(),
         addressable=xr.addressable_runtime_device_count(), f32_check=x.cpu().tolist(),
         warnings=sorted({str(w.message) for w in caught}))
"""


@dataclass(frozen=True)
class Probe:
    """What the child process reported, stage by stage.

    Stages: ``torch`` (versions, CUDA devices, import time and warnings), ``accelerator`` (what
    torch registered: PrivateUse1's name, torch.accelerator's answers), ``import`` and ``runtime``
    (torch_xla), and ``baseline`` (``import torch`` timed with device-backend autoload off).
    """

    stages: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    returncode: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    output_tail: str = ""
    pjrt_device: str | None = None
    timeout_s: float = 0.0


def _run_child(python: str, mode: str, env: Mapping[str, str], timeout_s: float):
    start = time.monotonic()
    try:
        # A session of its own, so a timeout can kill the child and anything it forked.
        proc = subprocess.Popen(
            [python, "-c", _PROBE_SOURCE, mode],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as exc:
        out, err, code, timed_out = "", f"could not start {python}: {exc}", None, False
    else:
        try:
            out, err = proc.communicate(timeout=timeout_s)
            code, timed_out = proc.returncode, False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            code, timed_out = None, True
    stages: dict[str, dict[str, Any]] = {}
    for line in out.splitlines():
        if line.startswith(_PROBE_TAG):
            try:
                data = json.loads(line[len(_PROBE_TAG) :])
            except json.JSONDecodeError:
                continue
            stages[str(data.pop("stage"))] = data
    other = [ln for ln in (out + "\n" + err).splitlines() if ln.strip() and not ln.startswith(_PROBE_TAG)]
    return stages, code, timed_out, time.monotonic() - start, "\n".join(other[-15:])


def run_probe(
    environ: Mapping[str, str],
    *,
    with_xla: bool = True,
    timeout_s: float = 120.0,
    python: str = sys.executable,
    pjrt_device: str | None = None,
    skip_metadata_query: bool = False,
    baseline: bool = False,
) -> Probe:
    """Import torch (and torch_xla, starting its runtime) in a child process with ``environ``.

    ``skip_metadata_query``: set ``TPU_SKIP_MDS_QUERY=1`` for the child unless ``environ`` sets
    it (for a host without a TPU, where libtpu would otherwise wait for the cloud metadata
    server). ``baseline``: first time ``import torch`` in a child with device-backend autoload
    off, so the cost torch_tpu adds to every import is measured (stage ``baseline``).
    """
    env = dict(environ)
    if with_xla and pjrt_device and "PJRT_DEVICE" not in env:
        env["PJRT_DEVICE"] = pjrt_device  # what xlatrain would choose, so the probe tests that
    if skip_metadata_query:
        env.setdefault("TPU_SKIP_MDS_QUERY", "1")
    stages: dict[str, Mapping[str, Any]] = {}
    if baseline:
        # First: on a cold page cache this child pays for reading torch, so the difference
        # measured below understates torch_tpu's share rather than overstating it.
        quiet, _, _, _, _ = _run_child(python, "torch-only", dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD="0"), timeout_s)
        if "torch" in quiet:
            stages["baseline"] = quiet["torch"]
    found, code, timed_out, seconds, tail = _run_child(python, "xla" if with_xla else "torch", env, timeout_s)
    stages.update(found)
    return Probe(
        stages=stages,
        returncode=code,
        timed_out=timed_out,
        seconds=seconds,
        output_tail=tail,
        pjrt_device=env.get("PJRT_DEVICE"),
        timeout_s=timeout_s,
    )


# --------------------------------------------------------------------------- collect


def _installed_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in ("torch", "torchvision", "torch_xla", "torch_tpu", "libtpu", "libtpu-nightly"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions[BUNDLED_LIBTPU] = _bundled_libtpu()
    versions["python"] = platform.python_version()
    return versions


def _python_findings(version: str | None) -> list[Finding]:
    fixed = fork_fix_release(version) if version else None
    if fixed is None:
        return []
    series = fixed.rsplit(".", 1)[0]
    return [
        Finding(
            "python:fork-hang",
            "warning",
            "this Python can hang a forked data-loader worker as it starts",
            f"Python {version} is older than {fixed}, the first {series} release with the fix "
            "for CPython gh-112275: a process forked while a C++ thread of its parent is entering Python "
            "(torch.distributed's gloo threads do, around collectives) can wait forever inside os.fork(). "
            "Under DDP or FSDP with num_workers > 0 that is a loader worker that never starts, and the run "
            "stops making progress without an error",
            f"use Python {fixed} or newer (or 3.12+); until then, a multi-process run that stalls as an "
            "epoch or an evaluation starts its loader workers may be this, and num_workers=0 avoids the fork",
        )
    ]


def _bundled_libtpu() -> str | None:
    spec = importlib.util.find_spec("torch_xla")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "lib" / "libtpu.so"
        if candidate.is_file():
            return str(candidate)
    return None


def _declared_requirements(dist: str) -> str | None:
    """What an installed distribution declares about torch and libtpu, e.g. ``"torch>=2.12; libtpu>=0.0.60"``."""
    try:
        requires = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return None
    wanted = [r.split(";")[0].strip() for r in requires if re.match(r"(torch|libtpu)\s*([<>=!~(\[ ]|$)", r)]
    return "; ".join(wanted) or None


def _major_minor(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _is_on(value: str) -> bool:
    return value.strip().lower() not in _FALSY


def _gb(kib: int) -> str:
    # Decimal, as the run header and the memory plan give memory.
    return f"{kib * 1024 / 1e9:.1f} GB"


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cache_summary(path: Path) -> tuple[str, str, Finding | None]:
    """(value, status, finding) for the compilation-cache row."""
    if not path.exists():
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            # Nobody, root included, can create a directory under a regular file.
            return (
                f"{path} (cannot be created: {parent} is not a directory)",
                "warning",
                Finding(
                    "cache-not-writable",
                    "warning",
                    "the compilation cache directory cannot be created",
                    f"{parent} is a file, not a directory, so {path} cannot exist",
                    "set XLATRAIN_CACHE_DIR to a writable directory",
                ),
            )
        if parent is not None and not os.access(parent, os.W_OK):
            return (
                f"{path} (cannot be created: {parent} is not writable)",
                "warning",
                Finding(
                    "cache-not-writable",
                    "warning",
                    "the compilation cache directory cannot be created",
                    f"{parent} is not writable by this user",
                    "set XLATRAIN_CACHE_DIR to a writable directory",
                ),
            )
        return f"{path} (not created yet: the first XLA run creates it)", "ok", None
    if not path.is_dir() or not os.access(path, os.W_OK):
        what = "read-only" if path.is_dir() else "not a directory"
        return (
            f"{path} ({what})",
            "warning",
            Finding(
                "cache-not-writable",
                "warning",
                f"the compilation cache directory is {what}",
                f"{path} is {'not writable by this user' if path.is_dir() else 'a file'}: new programs cannot be cached",
                "set XLATRAIN_CACHE_DIR to a writable directory, or fix its permissions",
            ),
        )
    count, size = 0, 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                size += os.stat(os.path.join(dirpath, name)).st_size
                count += 1
            except OSError:
                continue
        if count > 100_000:  # a summary, not an audit: stop walking a huge cache
            break
    return f"{path} ({count} entries, {size / 2**20:.1f} MiB)", "ok", None


_TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def _tcmalloc_on_host() -> str | None:
    """Where this host has tcmalloc (the library torch_tpu wants preloaded), or None."""
    dirs = [f"/usr/lib/{platform.machine()}-linux-gnu", f"/lib/{platform.machine()}-linux-gnu", "/usr/lib64",
            "/usr/lib", "/usr/local/lib"]
    for name in _TCMALLOC_NAMES:
        for d in dirs:
            if os.path.isfile(os.path.join(d, name)):
                return os.path.join(d, name)
    return None


@dataclass(frozen=True)
class _Facts:
    """What the static part of the doctor knows, before any probe."""

    env: Mapping[str, str]
    torch: str | None
    torchvision: str | None
    torch_tpu: str | None
    torch_xla: str | None
    libtpu: str | None  # the libtpu (or libtpu-nightly) distribution's version
    bundled_libtpu: str | None
    chips: tuple[TpuChip, ...]
    vfio: Mapping[str, str | None]  # chip address -> its VFIO group
    autoload: bool

    @property
    def torch_tpu_chips(self) -> tuple[TpuChip, ...]:
        """Chips of a generation torch_tpu drives."""
        return tuple(c for c in self.chips if c.device_id in TORCH_TPU_DEVICE_IDS)

    @property
    def torch_tpu_visible(self) -> tuple[TpuChip, ...]:
        """Chips torch_tpu will count at ``import torch``: its generation, with a VFIO group."""
        return tuple(c for c in self.torch_tpu_chips if self.vfio.get(c.address))

    @property
    def torch_tpu_loads(self) -> bool:
        """``import torch`` loads torch_tpu here (it may still find no TPU)."""
        fit = _torch_fit(COMPATIBILITY[0], self.torch)
        return self.torch_tpu is not None and self.autoload and fit != "older"

    @property
    def xla_fit(self) -> str | None:
        """How torch fits torch_xla: "ok", "patch" (same minor, other patch), "minor", or None."""
        if self.torch_xla is None:
            return None
        needs = runtime_needs("torch_xla", self.torch_xla)
        tv, xv = _major_minor(self.torch), _major_minor(self.torch_xla)
        if needs is None:  # a series this table does not know: the minor release must match
            return "minor" if self.torch and tv and xv and tv != xv else "ok"
        fit = _torch_fit(needs, self.torch)
        if fit in (None, "ok"):
            return "ok"
        return "patch" if tv == _major_minor(needs.torch_lowest) else "minor"


def _autoload_text(env: Mapping[str, str]) -> str:
    value = env.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
    return "TORCH_DEVICE_BACKEND_AUTOLOAD is unset" if value is None else f"TORCH_DEVICE_BACKEND_AUTOLOAD={value!r}"


def collect(
    environ: Mapping[str, str] | None = None,
    *,
    probe: bool | Probe = True,
    probe_timeout_s: float = 120.0,
    pci_root: str | os.PathLike[str] = PCI_ROOT,
    vfio_root: str | os.PathLike[str] = VFIO_ROOT,
    versions: Mapping[str, str | None] | None = None,
) -> Report:
    """Gather the environment report.

    Args:
        environ: the environment to judge (default: this process's). The probe runs in it.
        probe: run torch / torch_xla in a child process (``True``), skip that (``False``), or
            judge a ``Probe`` you already have.
        probe_timeout_s: how long the child may take before it counts as hung.
        pci_root: where PCI devices are listed (tests point it at a fake tree).
        vfio_root: where VFIO group nodes are (``/dev/vfio``).
        versions: installed distribution versions by name (default: read from the installed
            packages; ``None`` or absent for a package that is not installed), under
            ``BUNDLED_LIBTPU`` the path of a libtpu.so inside torch_xla, if any, and under
            ``"python"`` this Python's version (absent: not judged).
    """
    env: Mapping[str, str] = dict(os.environ) if environ is None else environ
    ver = dict(_installed_versions() if versions is None else versions)
    chips = find_tpu_chips(pci_root)
    facts = _Facts(
        env=env,
        torch=ver.get("torch"),
        torchvision=ver.get("torchvision"),
        torch_tpu=ver.get("torch_tpu"),
        torch_xla=ver.get("torch_xla"),
        libtpu=ver.get("libtpu") or ver.get("libtpu-nightly"),
        bundled_libtpu=ver.get(BUNDLED_LIBTPU),
        chips=chips,
        vfio={c.address: vfio_group(c.address, pci_root, vfio_root) for c in chips},
        autoload=torch_autoload_on(env),
    )
    findings: list[Finding] = []

    # ------------------------------------------------------------------ static facts
    torch_row = _torch_rows(facts, findings)
    xla_ok = facts.torch_xla is not None and facts.xla_fit != "minor"
    tpu_value, tpu_status, tpu_blocker = _torch_tpu_static(facts, findings, xla_ok=xla_ok)
    xla_value, xla_status = _torch_xla_static(facts, findings)
    libtpu_value, libtpu_status = _libtpu_static(facts, findings, xla_ok=xla_ok, tpu_blocker=tpu_blocker)
    if chips and facts.torch_tpu is None and facts.torch_xla is None:
        findings.append(
            Finding(
                "tpu-without-runtime",
                "error",
                "a TPU is attached but no TPU runtime is installed",
                f"{len(chips)} TPU chip(s) on the PCI bus; neither 'torch_tpu' nor 'torch_xla' is installed",
                f"TorchTPU: {INSTALL_TORCH_TPU}; or torch_xla: {INSTALL_TORCH_XLA}",
            )
        )

    pjrt_raw = env.get("PJRT_DEVICE", "")
    pjrt_kind = pjrt_raw.strip().upper().split("_")[0]  # torch_xla reads 'TPU_C_API' etc. as TPU
    chosen = pjrt_kind or ("TPU" if chips else "CPU")  # mirrors xlatrain.backend.xla.configure_runtime
    if not facts.torch_xla:
        pjrt_row = Row("PJRT device", "not used (torch_xla not installed)", "info")
    elif pjrt_raw:
        pjrt_row = Row("PJRT device", f"{pjrt_raw} (from PJRT_DEVICE)")
    else:
        pjrt_row = Row("PJRT device", f"{chosen} (PJRT_DEVICE unset: xlatrain picks {chosen}, "
                       + ("a TPU is on the PCI bus)" if chips else "no TPU on the PCI bus)"))
    findings += _device_findings(env, pjrt_kind, chips, facts.torch_xla)

    for name in sorted(env):
        trap = env_trap(name)
        if trap is None or (trap.flag and not _is_on(env[name])):
            continue
        findings.append(
            Finding(
                f"env:{name}",
                trap.severity,
                f"{name} is set",
                f"{name}={env[name]!r}: {trap.today}",
                trap.fix,
            )
        )
    findings += _flag_findings(env, xla_installed=facts.torch_xla is not None)
    python_findings = _python_findings(ver.get("python"))
    findings += python_findings
    findings += torch_tpu_findings(env, installed=facts.torch_tpu is not None)

    # ------------------------------------------------------------------ probe
    probe_xla = xla_ok  # a torch_xla built for another torch release only repeats the error
    probe_result: Probe | None
    if isinstance(probe, Probe):
        probe_result = probe
    elif probe and facts.torch is not None:
        probe_result = run_probe(
            env,
            with_xla=probe_xla,
            timeout_s=probe_timeout_s,
            pjrt_device=chosen,
            skip_metadata_query=not chips,
            baseline=facts.torch_tpu_loads and not chips,
        )
    else:
        probe_result = None
    findings += _probe_findings(probe_result, probe_xla, facts, findings)
    findings += _torch_tpu_runtime_findings(facts, probe_result, xla_ok=xla_ok, blocker=tpu_blocker)
    note = _precision_note(probe_result)
    if note is not None:
        # Attach the measurement to the env finding that explains it, when there is one.
        for i, f in enumerate(findings):
            if f.code in ("env:XLA_USE_BF16", "env:XLA_DOWNCAST_BF16"):
                findings[i] = Finding(f.code, f.severity, f.title, f"{f.evidence}; {note}", f.fix)
                break
        else:
            findings.append(
                Finding(
                    "float32-not-float32",
                    "warning",
                    "float32 tensors are not computed in float32 on this device",
                    note,
                    "unset XLA_USE_BF16 / XLA_DOWNCAST_BF16 wherever they are set (shell profile, "
                    "notebook, launcher) and use precision='bf16' for mixed precision",
                )
            )

    # ------------------------------------------------------------------ rows
    rows: list[Row] = [Row("Python", f"{sys.version.split()[0]} ({sys.executable})",
                           "warning" if python_findings else "ok")]
    rows += torch_row
    rows.append(Row("torch_tpu", tpu_value, tpu_status))
    if facts.torch_tpu is not None:
        rows.append(_autoload_row(facts))
        rows.append(_torch_tpu_device_row(facts, probe_result))
        rows.append(torch_tpu_mode_row(env))
    rows.append(Row("torch_xla", xla_value, xla_status))
    rows.append(Row("libtpu", libtpu_value, libtpu_status))
    rows.append(_tpu_row(facts))
    rows.append(pjrt_row)
    rows += _probe_rows(probe_result, facts.torch_xla, probe_xla)

    mem = _meminfo()
    if "MemTotal" in mem:
        rows.append(Row("Host memory", f"{_gb(mem['MemTotal'])} total, {_gb(mem.get('MemAvailable', 0))} available"))
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable_cpus = os.cpu_count() or 0
    rows.append(Row("CPU cores", f"{usable_cpus} usable of {os.cpu_count()}"))

    cache = default_cache_dir(env)
    value, status, cache_finding = _cache_summary(cache)
    if env.get("XLA_PERSISTENT_CACHE_PATH"):
        value += f"; XLA_PERSISTENT_CACHE_PATH={env['XLA_PERSISTENT_CACHE_PATH']} overrides it for torch_xla"
    if facts.torch_xla and chosen == "CPU":
        value += "; XLA:CPU writes entries but cannot load them back (a second run recompiles)"
    rows.append(Row("Compile cache", value, status))
    if cache_finding:
        findings.append(cache_finding)

    runtimes = (
        _torch_tpu_runtime(facts, probe_result, tpu_blocker),
        _torch_xla_runtime(facts, probe_result, probe_xla),
        _cuda_runtime(probe_result),
        _cpu_runtime(facts, probe_result),
    )
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: order.get(f.severity, len(order)))
    return Report(rows=tuple(rows), findings=tuple(findings), runtimes=runtimes)


def _torch_rows(facts: _Facts, findings: list[Finding]) -> list[Row]:
    rows = []
    if facts.torch is None:
        rows.append(Row("torch", "not installed", "error"))
        findings.append(
            Finding(
                "torch-missing",
                "error",
                "torch is not installed",
                f"no 'torch' distribution in {sys.executable}'s environment",
                f"TorchTPU, CUDA or CPU on current torch: {INSTALL_TORCH_TPU}; torch_xla 2.9: {INSTALL_TORCH_XLA}",
            )
        )
    else:
        rows.append(Row("torch", facts.torch))
    if facts.torchvision is not None:
        status = "ok"
        tv, vv = _major_minor(facts.torch), _major_minor(facts.torchvision)
        # torchvision 0.(N+15) is built for torch 2.N (0.24 <-> 2.9); another pair fails at import
        # of its C++ ops ("operator torchvision::nms does not exist").
        if tv and vv and tv[0] == 2 and vv != (0, tv[1] + 15):
            status = "warning"
            findings.append(
                Finding(
                    "version-mismatch:torchvision",
                    "warning",
                    f"torchvision {facts.torchvision} is not the build for torch {facts.torch}",
                    f"torch {tv[0]}.{tv[1]} pairs with torchvision 0.{tv[1] + 15}; found {facts.torchvision}",
                    f"pip install 'torchvision==0.{tv[1] + 15}.*'",
                )
            )
        rows.append(Row("torchvision", facts.torchvision, status))
    return rows


def _tpu_severity(xla_ok: bool) -> str:
    """A TorchTPU blocker on a TPU host is an error unless torch_xla can take the TPU instead."""
    return "warning" if xla_ok else "error"


def _torch_tpu_static(facts: _Facts, findings: list[Finding], *, xla_ok: bool) -> tuple[str, str, str | None]:
    """(row value, row status, why TorchTPU cannot run here or None) from installed facts alone."""
    v = facts.torch_tpu
    chips, tt_chips, visible = facts.chips, facts.torch_tpu_chips, facts.torch_tpu_visible
    if v is None:
        return "not installed", "info", "not installed"
    needs = runtime_needs("torch_tpu", v)
    fit = _torch_fit(needs, facts.torch) if needs else None
    status = "ok"
    if needs is None:
        declared = _declared_requirements("torch_tpu")
        value = f"{v} (this xlatrain knows torch_tpu 0.2; " + (
            f"it declares {declared})" if declared else "its requirements were not checked)"
        )
    elif fit == "older":
        evidence = (
            f"torch_tpu {v} ships extensions for {needs.torch_text} and raises ImportError ('torch_tpu has "
            f"no extension module compatible with PyTorch') on torch {facts.torch}"
        )
        fix = (
            f"in this torch {facts.torch} environment: pip uninstall torch_tpu (TorchTPU and torch_xla 2.9 "
            f"each need an environment of their own); for TorchTPU, another environment: {INSTALL_TORCH_TPU}"
        )
        value = f"{v} (needs {needs.torch_text}: found {facts.torch}, older"
        if facts.autoload:
            findings.append(
                Finding(
                    "torch_tpu:torch-version",
                    "error",
                    f"import torch fails: torch_tpu {v} cannot load with torch {facts.torch}",
                    f"{evidence}; torch loads torch_tpu at every import ({_autoload_text(facts.env)}) and "
                    "turns that into 'RuntimeError: Failed to load the backend extension: torch_tpu'",
                    fix + "; meanwhile TORCH_DEVICE_BACKEND_AUTOLOAD=0 lets torch import",
                )
            )
            return value + ": import torch fails)", "error", (
                f"torch {facts.torch} is older than torch_tpu {v} supports ({needs.torch_text})"
            )
        findings.append(
            Finding(
                "torch_tpu:torch-version",
                "warning",
                f"torch_tpu {v} cannot load with torch {facts.torch}",
                f"{evidence}; import torch works only because {_autoload_text(facts.env)} keeps torch "
                "from loading it",
                fix,
            )
        )
        return value + ": torch_tpu cannot load)", "warning", (
            f"torch {facts.torch} is older than torch_tpu {v} supports ({needs.torch_text})"
        )
    elif fit == "newer":
        status = "warning"
        value = f"{v} (needs {needs.torch_text}: found {facts.torch}, newer than it declares)"
        tv = _major_minor(facts.torch) or (0, 0)
        findings.append(
            Finding(
                "torch_tpu:torch-version",
                "warning",
                f"torch {facts.torch} is newer than torch_tpu {v} declares ({needs.torch_text})",
                f"torch_tpu loads the newest extension it ships that is not newer than torch, here the one "
                f"built for torch {needs.torch_highest}; whether it works with torch {facts.torch} was not checked",
                f"pip install 'torch>={needs.torch_lowest},<={needs.torch_highest}' (or a torch_tpu release "
                f"built for torch {tv[0]}.{tv[1]})",
            )
        )
    else:
        value = f"{v} (needs {needs.torch_text}: found {facts.torch}" + (", fits)" if fit == "ok" else ")")

    if not chips:
        return value, status, "no TPU on the PCI bus (torch_tpu has no CPU mode)"
    severity = _tpu_severity(xla_ok)
    if not tt_chips:
        gens = ", ".join(sorted({c.generation for c in chips}))
        findings.append(
            Finding(
                "torch_tpu:chip-unsupported",
                severity,
                f"torch_tpu {v} does not drive this TPU ({gens})",
                f"torch_tpu counts PCI device ids {', '.join(sorted(TORCH_TPU_DEVICE_IDS))} (v4, v5p, v5e, v6e, v7); "
                f"this host's chips are {', '.join(sorted({c.device_id for c in chips}))}",
                f"run this TPU with torch_xla 2.9: {INSTALL_TORCH_XLA}",
            )
        )
        return value, status, f"torch_tpu does not drive TPU {gens}"
    if not visible:
        findings.append(
            Finding(
                "torch_tpu:no-vfio",
                severity,
                "torch_tpu cannot see the TPU: no /dev/vfio group for its chip(s)",
                f"{len(tt_chips)} TPU chip(s) on the PCI bus ({', '.join(c.address for c in tt_chips)}); "
                "torch_tpu counts a chip only when the IOMMU group its iommu_group link names has a node "
                "/dev/vfio/<group>, and none of them has one",
                "TorchTPU reaches chips through VFIO: check ls -l /sys/bus/pci/devices/<address>/iommu_group "
                "/dev/vfio; in a container, give it the host's /dev/vfio devices (e.g. docker run --privileged)",
            )
        )
        return value, status, "its TPU chip(s) have no /dev/vfio group"
    if len(visible) < len(tt_chips):
        missing = [c.address for c in tt_chips if not facts.vfio.get(c.address)]
        findings.append(
            Finding(
                "torch_tpu:no-vfio",
                "warning",
                f"torch_tpu sees {len(visible)} of {len(tt_chips)} TPU chips: the others have no /dev/vfio group",
                f"no /dev/vfio/<group> node for {', '.join(missing)}",
                "check ls -l /sys/bus/pci/devices/<address>/iommu_group /dev/vfio for those chips",
            )
        )
    if not facts.autoload:
        findings.append(
            Finding(
                "torch_tpu:autoload-off",
                severity,
                "import torch does not register the TPU: torch_tpu's autoload is off",
                f"{_autoload_text(facts.env)}: torch loads device backends only when it is unset or '1', and "
                "torch_tpu registers the tpu device from that load (an explicit import torch_tpu does not)",
                "unset TORCH_DEVICE_BACKEND_AUTOLOAD (or set it to 1)",
            )
        )
        return value, status, f"{_autoload_text(facts.env)} keeps torch_tpu from loading at import torch"
    return value, status, None


def _torch_xla_static(facts: _Facts, findings: list[Finding]) -> tuple[str, str]:
    v = facts.torch_xla
    if v is None:
        return "not installed", "info"
    needs = runtime_needs("torch_xla", v)
    want = needs.torch_text if needs else f"torch {'.'.join(map(str, _major_minor(v) or ()))}.x"
    fit = facts.xla_fit
    if fit == "minor":
        xv = _major_minor(v) or (0, 0)
        pin = needs.torch_lowest if needs else f"{xv[0]}.{xv[1]}.*"
        elsewhere = (
            f"; torch {facts.torch} itself is TorchTPU's: {INSTALL_TORCH_TPU}"
            if _torch_fit(COMPATIBILITY[0], facts.torch) == "ok" else ""
        )
        findings.append(
            Finding(
                "version-mismatch:torch_xla",
                "error",
                f"torch_xla {v} does not run with torch {facts.torch}",
                f"torch_xla is built against one torch release: {v} needs {want}, and its C++ extension "
                f"fails to load against torch {facts.torch}",
                f"pip install 'torch=={pin}' in this environment (torch_xla {v} is its last release; it "
                f"needs an environment of its own){elsewhere}",
            )
        )
        return f"{v} (needs {want}, found {facts.torch})", "error"
    if fit == "patch":
        findings.append(
            Finding(
                "version-mismatch:torch_xla",
                "warning",
                f"torch_xla {v} was built for {needs.torch_text}, found torch {facts.torch}",
                f"torch_xla {v} pins torch=={needs.torch_lowest}; whether its C++ extension loads against "
                f"torch {facts.torch} is not told by the versions (the probe's XLA devices row shows it)",
                f"pip install 'torch=={needs.torch_lowest}'",
            )
        )
        return f"{v} (needs {want}, found {facts.torch})", "warning"
    return (f"{v} (needs {want}: found {facts.torch}, fits)" if facts.torch else v), "ok"


def _libtpu_static(facts: _Facts, findings: list[Finding], *, xla_ok: bool, tpu_blocker: str | None) -> tuple[str, str]:
    chips = facts.chips
    tt = runtime_needs("torch_tpu", facts.torch_tpu) if facts.torch_tpu else None
    xla = runtime_needs("torch_xla", facts.torch_xla) if facts.torch_xla else None
    parts = []
    if tt:
        parts.append(f"torch_tpu {'.'.join(map(str, tt.series))} needs {tt.libtpu}")
    if xla:
        parts.append(f"torch_xla {'.'.join(map(str, xla.series))} uses {xla.libtpu[2:]} on a TPU")
    needs_text = f" ({'; '.join(parts)})" if parts else ""

    def absent(why: str) -> str:
        return f"not installed ({'; '.join([why, *parts])})" if why else f"not installed{needs_text}"

    if facts.libtpu:
        value, status = f"{facts.libtpu}{needs_text}", "ok"
        if tt and _spec_ok(facts.libtpu, tt.libtpu) is False:
            status = "warning"
            findings.append(
                Finding(
                    "torch_tpu:libtpu-version",
                    "warning",
                    f"libtpu {facts.libtpu} is older than torch_tpu {facts.torch_tpu} requires ({tt.libtpu})",
                    f"torch_tpu {facts.torch_tpu} declares libtpu{tt.libtpu}; whether it starts the TPU with "
                    f"{facts.libtpu} was not checked",
                    f"pip install 'libtpu{tt.libtpu}'",
                )
            )
        elif xla and chips and xla_ok and _spec_ok(facts.libtpu, xla.libtpu) is False:
            status = "warning"
            findings.append(
                Finding(
                    "torch_xla:libtpu-version",
                    "warning",
                    f"libtpu {facts.libtpu} is not the one torch_xla {facts.torch_xla} was released with",
                    f"torch_xla {facts.torch_xla}'s [tpu] extra pins libtpu{xla.libtpu}; whether it starts this "
                    f"TPU with {facts.libtpu} is what the probe shows (not checked without it)",
                    f"pip install 'torch_xla[tpu]=={facts.torch_xla}' (installs libtpu {xla.libtpu[2:]})",
                )
            )
        return value, status
    if facts.env.get("TPU_LIBRARY_PATH"):
        return f"TPU_LIBRARY_PATH={facts.env['TPU_LIBRARY_PATH']}{needs_text}", "ok"
    if facts.bundled_libtpu:
        return f"bundled with torch_xla ({facts.bundled_libtpu}){needs_text}", "ok"
    if not chips:
        return absent("needed on TPU hosts only"), "info"
    # A TPU is attached and no libtpu: each installed runtime that would drive it cannot start it.
    if facts.torch_tpu and tt and facts.torch_tpu_visible and tpu_blocker is None:
        findings.append(
            Finding(
                "tpu-without-libtpu",
                _tpu_severity(xla_ok),
                "a TPU is attached but libtpu, which torch_tpu starts it with, is missing",
                "no libtpu package and no TPU_LIBRARY_PATH (torch_tpu prints 'libtpu not found.' at import)",
                f"pip install 'libtpu{tt.libtpu}' ({INSTALL_TORCH_TPU} brings it)",
            )
        )
    elif facts.torch_xla and xla_ok:
        findings.append(
            Finding(
                "tpu-without-libtpu",
                "error",
                "a TPU is attached but libtpu is missing",
                "no libtpu package, no TPU_LIBRARY_PATH, no libtpu.so bundled with torch_xla",
                f"pip install 'torch_xla[tpu]=={facts.torch_xla}' (installs the matching libtpu)",
            )
        )
    return absent(""), "error"


def _autoload_row(facts: _Facts) -> Row:
    state = "on: every import torch loads torch_tpu" if facts.autoload else "off: import torch does not load torch_tpu"
    value = f"{state} ({_autoload_text(facts.env)})"
    if facts.autoload and not facts.chips:
        return Row("torch_tpu autoload", value + "; no TPU here for it to drive", "warning")
    if not facts.autoload and facts.torch_tpu_visible:
        return Row("torch_tpu autoload", value + "; a TPU is attached", "error")
    return Row("torch_tpu autoload", value, "ok" if facts.autoload == bool(facts.torch_tpu_visible) else "info")


def _torch_tpu_device_row(facts: _Facts, probe: Probe | None) -> Row:
    stage = probe.stages.get("accelerator") if probe is not None else None
    if probe is None:
        return Row("TorchTPU device", "not probed", "info")
    if stage is None:
        return Row("TorchTPU device", "unknown: torch did not import in the probe", "error")
    if "error" in stage:
        return Row("TorchTPU device", f"unknown: torch.accelerator raised {stage['error']}", "warning")
    if stage.get("privateuse1") == "tpu":
        return Row("TorchTPU device", f"tpu registered, {stage.get('count')} device(s) (torch.accelerator)")
    return Row(
        "TorchTPU device",
        f"none registered (PrivateUse1 is {stage.get('privateuse1')!r}; torch.accelerator: "
        f"{stage.get('accelerator')}, {stage.get('count')} device(s))",
        "error" if facts.torch_tpu_visible and facts.autoload else "info",
    )


def _tpu_row(facts: _Facts) -> Row:
    chips = facts.chips
    if not chips:
        return Row("TPU", "none on the PCI bus", "info")
    gens = sorted({c.generation for c in chips})
    cores = sum(2 if c.generation in ("v2", "v3", "v2/v3") else 1 for c in chips)
    with_vfio = sum(1 for c in chips if facts.vfio.get(c.address))
    return Row(
        "TPU",
        f"{len(chips)} chip(s), {', '.join(gens)} ({cores} XLA devices); PCI ids "
        + ", ".join(sorted({c.device_id for c in chips}))
        + f"; {with_vfio} of {len(chips)} with a /dev/vfio group",
    )


def _device_findings(
    env: Mapping[str, str], pjrt_kind: str, chips: tuple[TpuChip, ...], xla_v: str | None
) -> list[Finding]:
    """What PJRT_DEVICE asks of torch_xla, against what is here."""
    out: list[Finding] = []
    if xla_v is None:
        return out
    if pjrt_kind == "TPU" and not chips:
        out.append(
            Finding(
                "no-device",
                "error",
                "PJRT_DEVICE=TPU but this host has no TPU",
                f"PJRT_DEVICE={env.get('PJRT_DEVICE')!r}; no TPU chip on the PCI bus",
                "run on a TPU VM, or set PJRT_DEVICE=CPU to rehearse on XLA:CPU "
                "(accelerator='xla'), or use accelerator='cpu' / 'cuda'",
            )
        )
    elif pjrt_kind == "CPU" and chips:
        out.append(
            Finding(
                "tpu-unused",
                "warning",
                "a TPU is attached but PJRT_DEVICE=CPU",
                f"{len(chips)} TPU chip(s) on the PCI bus; PJRT_DEVICE={env.get('PJRT_DEVICE')!r} runs XLA on the host CPU",
                "unset PJRT_DEVICE (xlatrain picks the TPU) or set PJRT_DEVICE=TPU",
            )
        )
    elif pjrt_kind in ("GPU", "CUDA") and importlib.util.find_spec("torch_xla_cuda_plugin") is None:
        out.append(
            Finding(
                "pjrt-gpu",
                "error",
                f"PJRT_DEVICE={env.get('PJRT_DEVICE')} has no client in torch_xla 2.9",
                "the runtime's built-in PJRT clients are CPU, TPU, XPU and NEURON; no CUDA PJRT "
                "plugin is installed, so starting the runtime fails ('No PjRtPlugin registered')",
                "for NVIDIA GPUs use native PyTorch: accelerator='cuda' and unset PJRT_DEVICE",
            )
        )
    elif pjrt_kind and pjrt_kind not in _BUILTIN_PJRT + ("GPU", "CUDA"):
        out.append(
            Finding(
                "pjrt-unknown",
                "error",
                f"PJRT_DEVICE={env.get('PJRT_DEVICE')} names no known device",
                f"torch_xla 2.9 builds clients for {', '.join(_BUILTIN_PJRT)} or a registered plugin",
                "set PJRT_DEVICE=TPU on a TPU VM or PJRT_DEVICE=CPU to rehearse on the host, or unset it",
            )
        )
    return out


def torch_tpu_findings(env: Mapping[str, str], *, installed: bool, origin: str | None = None) -> list[Finding]:
    """TorchTPU's traps that show without running it: another project's ``torch_tpu`` under the
    same name, and Debug eager mode left on (every op waits)."""
    from xlatrain.backend.runtimes import torch_tpu_mode_from_env, torch_tpu_notes, torch_tpu_origin

    if not installed:
        return []
    other = origin if origin is not None else torch_tpu_origin()
    if other is not None:
        return [Finding(
            "torch_tpu:not-google", "error", "the torch_tpu installed here is not Google's TorchTPU",
            f"its distribution metadata names no Google project ({other}): another project's package also "
            "installs a module named torch_tpu with a 'tpu' device; xlatrain does not run on it",
            f"uninstall it or give it an environment of its own; for TorchTPU: {INSTALL_TORCH_TPU}",
        )]
    mode = torch_tpu_mode_from_env(dict(env))
    if mode == "DEFER_NEVER_AND_LAUNCH_BLOCKING":
        return [Finding("torch_tpu:debug-mode", "warning", "TorchTPU will run in eager mode Debug: every op waits",
                        f"TORCH_TPU_LAUNCH_BLOCKING={env.get('TORCH_TPU_LAUNCH_BLOCKING')!r}",
                        torch_tpu_notes(mode, None)[0])]
    return []


def torch_tpu_mode_row(env: Mapping[str, str]) -> Row:
    """The eager mode TorchTPU starts in, and on a TPU the float32 matmul precision to expect."""
    from xlatrain.backend.runtimes import TORCH_TPU_MODES, torch_tpu_mode_from_env

    mode = torch_tpu_mode_from_env(dict(env))
    value = f"{TORCH_TPU_MODES[mode]} ({mode})"
    if mode == "DEFER_NEVER":
        value += ("; Fused mode is reported 50-100% faster: TORCH_TPU_DEFER_AND_FUSE=1, torch.tpu.eager_mode = "
                  "torch.tpu.EagerMode.DEFER_AND_FUSE, or compile=True")
    value += ("; float32 matmuls run at bfloat16 precision on a TPU unless "
              "torch.set_float32_matmul_precision('highest')")
    return Row("TorchTPU eager mode", value, "warning" if mode == "DEFER_NEVER_AND_LAUNCH_BLOCKING" else "info")


def _flag_findings(env: Mapping[str, str], *, xla_installed: bool) -> list[Finding]:
    out = []
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags and "CPU_NUM_DEVICES" not in env:
        out.append(
            Finding(
                "xla-flags-device-count",
                "info",
                "XLA_FLAGS asks for several host devices but CPU_NUM_DEVICES is unset",
                "measured with torch_xla 2.9: --xla_force_host_platform_device_count alone still "
                "gives one XLA:CPU device",
                "set CPU_NUM_DEVICES=N (or pass devices=N to xlatrain, which sets it)",
            )
        )
    debug = env.get("PT_XLA_DEBUG")
    if debug is not None:
        try:
            on = int(debug) != 0
        except ValueError:
            # Certain to break only where there is a torch_xla to import.
            out.append(
                Finding(
                    "env:PT_XLA_DEBUG",
                    "error" if xla_installed else "info",
                    f"PT_XLA_DEBUG={debug!r} makes 'import torch_xla' fail",
                    "torch_xla 2.9 reads it with int(os.environ['PT_XLA_DEBUG']) at import: a "
                    "non-integer raises ValueError" + ("" if xla_installed else " (torch_xla is not installed here)"),
                    "unset PT_XLA_DEBUG, or set it to 0 or 1",
                )
            )
        else:
            if on:
                out.append(
                    Finding(
                        "env:PT_XLA_DEBUG",
                        "info",
                        "PT_XLA_DEBUG is set",
                        f"PT_XLA_DEBUG={debug!r}: torch_xla analyses every compilation and "
                        "execution and writes a summary at exit (extra work per step)",
                        "unset it for timing runs; xlatrain's run report names recompilations and host syncs",
                    )
                )
    return out


def _probe_rows(probe: Probe | None, xla_v: str | None, probe_xla: bool) -> list[Row]:
    rows = []
    if probe is None:
        rows.append(Row("CUDA", "not probed", "info"))
    else:
        torch_stage = probe.stages.get("torch")
        if torch_stage is None:
            rows.append(Row("CUDA", "unknown: torch did not import in the probe", "error"))
        else:
            names = torch_stage.get("cuda_devices") or []
            build = torch_stage.get("cuda_build")
            if names:
                counts: dict[str, int] = {}
                for n in names:
                    counts[n] = counts.get(n, 0) + 1
                rows.append(Row("CUDA", ", ".join(f"{c} x {n}" for n, c in counts.items())))
            else:
                what = f"torch built for CUDA {build}" if build else "CPU build of torch"
                rows.append(Row("CUDA", f"no device ({what})", "info"))
    if xla_v is None:
        return rows
    if probe is None:
        rows.insert(0, Row("XLA devices", "not probed", "info"))
        return rows
    runtime = probe.stages.get("runtime")
    if not probe_xla:
        row = Row("XLA devices", "not probed (torch_xla does not match torch)", "error")
    elif runtime is None:
        row = Row("XLA devices", "the runtime did not start (see findings)", "error")
    else:
        n = runtime.get("devices", 0)
        row = Row(
            "XLA devices",
            f"{n} x {runtime.get('device_type')} (import and runtime start took {probe.seconds:.1f} s)",
            "ok" if n else "error",
        )
    return [row, *rows]


def _last_line(probe: Probe) -> str:
    tail = probe.output_tail.strip()
    return tail.splitlines()[-1] if tail else "no output"


def _probe_findings(probe: Probe | None, probe_xla: bool, facts: _Facts, findings: list[Finding]) -> list[Finding]:
    """Findings from what the probe saw. ``findings`` (the static ones) may gain the probe's evidence."""
    if probe is None:
        return []
    where = f"PJRT_DEVICE={probe.pjrt_device}" if probe.pjrt_device else "PJRT_DEVICE unset"
    last = _last_line(probe)
    if probe.timed_out:
        reached = ", ".join(s for s in probe.stages if s != "baseline") or "none"
        return [
            Finding(
                "probe-timeout",
                "error",
                f"starting torch{' / torch_xla' if probe_xla else ''} hung for {probe.timeout_s:.0f} s",
                f"the probe ({where}) finished stages [{reached}] and was killed; last output: {last}",
                "a runtime that never starts usually means the TPU is held by another process "
                "(find it with: lsof -w /dev/accel* /dev/vfio/*) or PJRT_DEVICE names hardware "
                "that is not there; rerun with a longer --timeout if the host is just slow",
            )
        ]
    if "torch" not in probe.stages:
        for i, f in enumerate(findings):
            if f.code == "torch_tpu:torch-version" and f.severity == "error":
                # The static judgement predicted this failure: the probe confirms it.
                findings[i] = Finding(f.code, f.severity, f.title,
                                      f"{f.evidence}; the probe's import torch failed: {last}", f.fix)
                return []
        if "backend extension" in probe.output_tail:
            fix = ("a device backend that torch autoloads fails to load: fix or uninstall it (pip uninstall "
                   "torch_tpu if it is torch_tpu), or set TORCH_DEVICE_BACKEND_AUTOLOAD=0")
        else:
            fix = f"reinstall torch for this Python (pip install --force-reinstall 'torch=={facts.torch}')"
        return [
            Finding(
                "torch-import-failed",
                "error",
                "import torch fails",
                f"exit code {probe.returncode}; last output: {last}",
                fix,
            )
        ]
    if not probe_xla:
        return []
    if "import" not in probe.stages:
        return [
            Finding(
                "xla-import-failed",
                "error",
                "import torch_xla fails",
                f"exit code {probe.returncode}; last output: {last}",
                "fix the error above; a torch / torch_xla pair from different releases or a "
                "non-integer PT_XLA_DEBUG are the usual causes",
            )
        ]
    runtime = probe.stages.get("runtime")
    if runtime is None:
        return [
            Finding(
                "runtime-failed",
                "error",
                f"torch_xla imports but its runtime does not start ({where})",
                f"exit code {probe.returncode}; last output: {last}",
                "on a TPU VM check that no other process holds the chips (lsof -w /dev/accel* "
                "/dev/vfio/*); elsewhere set PJRT_DEVICE=CPU to rehearse on XLA:CPU",
            )
        ]
    if not runtime.get("devices"):
        return [
            Finding(
                "no-device",
                "error",
                "torch_xla started but sees no device",
                f"{where}: global_runtime_device_count() = {runtime.get('devices')}",
                "set PJRT_DEVICE to the hardware present (TPU on a TPU VM, CPU elsewhere)",
            )
        ]
    return []


def _torch_tpu_runtime_findings(
    facts: _Facts, probe: Probe | None, *, xla_ok: bool, blocker: str | None
) -> list[Finding]:
    """What torch_tpu does at ``import torch`` on this host: registration, tcmalloc, autoload cost."""
    if not facts.torch_tpu_loads:
        return []
    out = []
    torch_stage = probe.stages.get("torch") if probe is not None else None
    accel = probe.stages.get("accelerator") if probe is not None else None
    if probe is not None and (torch_stage is None or not torch_stage.get("torch_tpu_loaded")):
        # import torch failed (its own finding says so), or the probe saw torch import without
        # torch_tpu: none of the below happened.
        return out
    env = facts.env

    if blocker is None and facts.torch_tpu_visible and accel is not None and "error" not in accel \
            and accel.get("privateuse1") != "tpu":
        out.append(
            Finding(
                "torch_tpu:not-registered",
                _tpu_severity(xla_ok),
                "torch_tpu did not register the TPU at import torch",
                f"{len(facts.torch_tpu_visible)} TPU chip(s) with a /dev/vfio group and autoload on, yet "
                f"PrivateUse1 is still {accel.get('privateuse1')!r} (torch.accelerator: {accel.get('accelerator')}, "
                f"{accel.get('count')} device(s)); last probe output: {_last_line(probe)}",
                "run python -c 'import torch' and read torch_tpu's messages; check that no other process "
                "holds the chips (lsof -w /dev/vfio/*)",
            )
        )

    # tcmalloc: torch_tpu looks for it in the process (symbols, /proc/self/maps) and warns when absent.
    preload = env.get("LD_PRELOAD", "")
    if torch_stage is not None:
        warned = [w for w in torch_stage.get("import_warnings") or [] if _TCMALLOC_TAG in w]
        # Its first sentence; the rest is torch_tpu's own advice, which the fix below makes concrete.
        evidence = (f"the probe's import torch printed torch_tpu's warning "
                    f"'{warned[0].split('. Preload')[0]}'" if warned else None)
    else:
        evidence = None if "tcmalloc" in preload else (
            f"LD_PRELOAD {'is unset' if not preload else '=' + repr(preload)}: it names no tcmalloc, so unless "
            "this Python links tcmalloc itself, torch_tpu warns at import that tcmalloc is not loaded (not probed)"
        )
    if evidence is not None:
        found = _tcmalloc_on_host()
        machine = platform.machine()
        if found:
            evidence += f"; this host has {found}"
            fix = f'export LD_PRELOAD="{found}${{LD_PRELOAD:+:$LD_PRELOAD}}" before starting Python'
        else:
            evidence += f"; this host has no {' or '.join(_TCMALLOC_NAMES)}"
            fix = ("install it (Debian/Ubuntu: apt-get install libtcmalloc-minimal4), then export "
                   f"LD_PRELOAD=/usr/lib/{machine}-linux-gnu/libtcmalloc_minimal.so.4 before starting Python")
        if not facts.torch_tpu_visible:
            fix += ("; with no TPU here, TORCH_DEVICE_BACKEND_AUTOLOAD=0 (keeps torch_tpu out of import torch) "
                    "removes the warning as well")
        out.append(
            Finding(
                "torch_tpu:tcmalloc",
                "warning" if facts.torch_tpu_visible else "info",
                "tcmalloc is not loaded under TorchTPU: its host threads allocate through glibc malloc",
                evidence,
                fix,
            )
        )

    if not facts.chips:
        if torch_stage is not None and torch_stage.get("import_s") is not None:
            measured = f"measured here: import torch took {torch_stage['import_s']:.1f} s with torch_tpu"
            base = probe.stages.get("baseline") if probe is not None else None
            if base and base.get("import_s") is not None:
                measured += f", {base['import_s']:.1f} s with TORCH_DEVICE_BACKEND_AUTOLOAD=0"
        else:
            measured = "not measured (no probe)"
        out.append(
            Finding(
                "torch_tpu:autoload-without-tpu",
                "warning",
                "every import torch here loads torch_tpu, and there is no TPU for it",
                f"{_autoload_text(env)} and torch_tpu {facts.torch_tpu} is installed, so torch loads it (with "
                f"libtpu and torch._dynamo) at every import; no TPU is on the PCI bus, so it registers no "
                f"device; {measured}",
                "python -m xlatrain.site_hook install: this environment's Python processes then set it (and "
                "TPU_SKIP_MDS_QUERY=1) at start-up on a host without a TPU, and leave a TPU VM as it is (xlatrain's "
                "own .venv is built so); or export TORCH_DEVICE_BACKEND_AUTOLOAD=0 in this host's shell profile, "
                "or pip uninstall torch_tpu where this environment never runs on a TPU",
            )
        )
        if not _is_on(env.get("TPU_SKIP_MDS_QUERY", "")):
            value = env.get("TPU_SKIP_MDS_QUERY")
            out.append(
                Finding(
                    "torch_tpu:metadata-query",
                    "warning",
                    "the first backward() of a script here can wait minutes for the cloud metadata server",
                    f"{'TPU_SKIP_MDS_QUERY is unset' if value is None else f'TPU_SKIP_MDS_QUERY={value!r}'}, "
                    "torch_tpu loads at import torch and no TPU is on the PCI bus: at the first backward() "
                    "torch asks torch_tpu for its device count, which starts libtpu, and libtpu asks the GCE "
                    "metadata server for its TPU settings, retrying each (30 tries per setting) before it "
                    "gives up. xlatrain's Trainer sets TPU_SKIP_MDS_QUERY=1 in its own process; other "
                    "scripts here do not",
                    "export TPU_SKIP_MDS_QUERY=1 (libtpu then fails at once; there is no TPU to find), or "
                    "TORCH_DEVICE_BACKEND_AUTOLOAD=0, which keeps torch_tpu out of import torch altogether",
                )
            )
    return out


def _precision_note(probe: Probe | None) -> str | None:
    """A sentence when the device computed the probe's float32 sum in lower precision."""
    runtime = probe.stages.get("runtime") if probe is not None else None
    check = runtime.get("f32_check") if runtime else None
    if not isinstance(check, (int, float)) or abs(check - 1.001) < 1e-4:
        return None
    return f"measured on this device: float32 1/3*3 + 0.001 gave {check!r} (float32 gives 1.0010000467)"


# --------------------------------------------------------------------------- runtimes


def _needs_text(needs: RuntimeNeeds, facts: _Facts) -> str:
    """``needs`` with this environment's versions judged against it."""
    fit = _torch_fit(needs, facts.torch)
    torch_here = ("no torch" if facts.torch is None else
                  f"torch {facts.torch} " + ("fits" if fit == "ok" else f"does not fit ({fit})" if fit else "unreadable"))
    libtpu_ok = _spec_ok(facts.libtpu, needs.libtpu) if facts.libtpu else None
    libtpu_here = ("no libtpu" if facts.libtpu is None else f"libtpu {facts.libtpu} "
                   + ("fits" if libtpu_ok else "does not fit" if libtpu_ok is False else "unreadable"))
    wants = [needs.torch_text, f"libtpu {needs.libtpu}" + (" on a TPU" if needs.python_lowest is None else "")]
    here = [torch_here, libtpu_here]
    if needs.python_lowest:
        wants.append(f"Python >= {needs.python_lowest}")
        py_ok = sys.version_info[:2] >= tuple(int(p) for p in needs.python_lowest.split("."))
        here.append(f"Python {platform.python_version()} " + ("fits" if py_ok else "is older"))
    return f"needs {', '.join(wants)}; here: {', '.join(here)}"


def _torch_tpu_runtime(facts: _Facts, probe: Probe | None, blocker: str | None) -> Runtime:
    needs = runtime_needs("torch_tpu", facts.torch_tpu) or COMPATIBILITY[0]
    v = facts.torch_tpu

    def runtime(runs: bool | None, why: str) -> Runtime:
        return Runtime("TorchTPU", f"torch_tpu {v}" if v else None, runs, why, _needs_text(needs, facts), needs.install)

    if v is None:
        return runtime(False, "not installed")
    if blocker is not None:
        return runtime(False, blocker)
    if facts.libtpu is None and not facts.env.get("TPU_LIBRARY_PATH"):
        return runtime(False, "libtpu is not installed")
    if probe is None:
        return runtime(None, f"not checked (no probe): {len(facts.torch_tpu_visible)} TPU chip(s) it can see")
    accel = probe.stages.get("accelerator")
    if accel is None:
        return runtime(False, "import torch failed in the probe")
    if accel.get("privateuse1") == "tpu":
        return runtime(True, f"{accel.get('count')} TPU device(s) registered at import torch")
    return runtime(False, "torch_tpu did not register the TPU at import torch")


def _torch_xla_runtime(facts: _Facts, probe: Probe | None, probe_xla: bool) -> Runtime:
    needs = runtime_needs("torch_xla", facts.torch_xla) or COMPATIBILITY[1]
    v = facts.torch_xla

    def runtime(runs: bool | None, why: str) -> Runtime:
        return Runtime("torch_xla", f"torch_xla {v}" if v else None, runs, why, _needs_text(needs, facts), needs.install)

    if v is None:
        return runtime(False, "not installed")
    if not probe_xla:
        return runtime(False, f"built for another torch release than {facts.torch}")
    if probe is None:
        return runtime(None, "not checked (no probe)")
    rt = probe.stages.get("runtime")
    if rt and rt.get("devices"):
        kind = rt.get("device_type")
        extra = " (XLA:CPU rehearses a TPU program on the host)" if kind == "CPU" else ""
        return runtime(True, f"{rt.get('devices')} x {kind} device(s){extra}")
    if probe.timed_out:
        return runtime(False, f"its runtime did not start within {probe.timeout_s:.0f} s")
    if "import" not in probe.stages:
        return runtime(False, "import torch_xla failed in the probe")
    return runtime(False, "its runtime started no device" if rt else "its runtime did not start")


def _cuda_runtime(probe: Probe | None) -> Runtime:
    stage = probe.stages.get("torch") if probe is not None else None
    if probe is None:
        return Runtime("CUDA", None, None, "not checked (no probe)")
    if stage is None:
        return Runtime("CUDA", None, False, "import torch failed in the probe")
    build = stage.get("cuda_build")
    installed = f"torch built for CUDA {build}" if build else None
    names = stage.get("cuda_devices") or []
    if names:
        return Runtime("CUDA", installed, True, f"{len(names)} device(s): {', '.join(sorted(set(names)))}")
    return Runtime("CUDA", installed, False, "no CUDA device" if build else "CPU build of torch")


def _cpu_runtime(facts: _Facts, probe: Probe | None) -> Runtime:
    installed = f"torch {facts.torch}" if facts.torch else None
    if facts.torch is None:
        return Runtime("CPU", None, False, "torch is not installed")
    if probe is None:
        return Runtime("CPU", installed, None, "import torch not checked (no probe)")
    stage = probe.stages.get("torch")
    if stage is None:
        return Runtime("CPU", installed, False, "import torch failed in the probe")
    took = stage.get("import_s")
    return Runtime("CPU", installed, True, f"import torch takes {took:.1f} s here" if took is not None else "import torch works")


# --------------------------------------------------------------------------- render


_STATUS_MARK = {"ok": "ok", "info": "--", "warning": "WARN", "error": "FAIL"}
_RUNS_MARK = {True: "yes", False: "no", None: "?"}


def render_text(report: Report, strict: bool = False) -> str:
    """The report as a table and a list of findings, for a terminal."""
    lines = ["xlatrain doctor", ""]
    if report.runtimes:
        lines.append("Runtimes (runs here?)")
        for rt in report.runtimes:
            what = f"{rt.installed}: {rt.why}" if rt.installed else rt.why
            lines.append(f"  {_RUNS_MARK[rt.runs_here]:<4} {rt.name:<10} {what}")
            if rt.needs:
                lines.append(textwrap.fill(rt.needs, width=100, initial_indent=" " * 18,
                                           subsequent_indent=" " * 18, break_on_hyphens=False))
        lines.append("")
        lines.append(textwrap.fill(FROZEN_NOTE, width=100, initial_indent="  ", subsequent_indent="  "))
        for rt in report.runtimes:
            if rt.install:
                lines.append(textwrap.fill(f"install {rt.name}: {rt.install}", width=100, initial_indent="  ",
                                           subsequent_indent="    ", break_on_hyphens=False))
        lines.append("")
    width = max(len(r.name) for r in report.rows) if report.rows else 10
    lines.append("Environment")
    for row in report.rows:
        lines.append(f"  {_STATUS_MARK.get(row.status, row.status):<4}  {row.name:<{width}}  {row.value}")
    lines.append("")
    if report.findings:
        lines.append("Findings")
        for f in report.findings:
            lines.append(f"  [{f.severity}] {f.title}")
            for label, text in (("evidence: ", f.evidence), ("fix:      ", f.fix)):
                lines.append(textwrap.fill(text, width=100, initial_indent="      " + label,
                                           subsequent_indent=" " * 16, break_on_hyphens=False))
        lines.append("")
    counts = {s: sum(f.severity == s for f in report.findings) for s in SEVERITIES}
    tally = f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} note(s)"
    if not report.usable:
        reasons = [f.title for f in report.findings if f.severity == "error"]
        lines.append(f"Result: NOT usable ({tally}): " + "; ".join(reasons))
    elif report.exit_code(strict):
        reasons = [f.title for f in report.findings if f.severity == "warning"]
        lines.append(f"Result: usable, but --strict fails on the warnings ({tally}): " + "; ".join(reasons))
    else:
        lines.append(f"Result: usable ({tally})")
    return "\n".join(lines)


def render_json(report: Report, strict: bool = False) -> str:
    """The report as JSON: ``usable``, ``exit_code``, ``runtimes``, ``note``, ``rows`` and ``findings``."""
    return json.dumps(
        {
            "usable": report.usable,
            "exit_code": report.exit_code(strict),
            "runtimes": [asdict(r) for r in report.runtimes],
            "note": FROZEN_NOTE,
            "rows": [asdict(r) for r in report.rows],
            "findings": [asdict(f) for f in report.findings],
        },
        indent=2,
    )
