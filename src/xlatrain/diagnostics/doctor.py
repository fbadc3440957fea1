"""``xlatrain doctor``: the training environment in one table, and every known trap in it.

``collect()`` gathers facts (package versions, PJRT device, TPU chips on the PCI bus, CUDA,
host memory, the compilation cache) and turns them into findings, each with its evidence and a
fix. torch and torch_xla are probed in a child process with a timeout, so a runtime that hangs or
crashes cannot take the doctor down with it. ``render_text`` / ``render_json`` print the report.

What each environment variable does today was read from torch_xla 2.9.0 itself: its Python
sources and the strings of its ``_XLAC`` runtime library (see ``ENV_TRAPS``).

Example:
    >>> from xlatrain.diagnostics.doctor import collect, render_text
    >>> report = collect({"XLA_USE_BF16": "1", "HOME": "/tmp"}, probe=False)
    >>> [f.code for f in report.findings if f.severity == "warning"]
    ['env:XLA_USE_BF16']
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
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

from xlatrain.backend.hardware import PCI_ROOT, TpuChip, default_cache_dir, find_tpu_chips

SEVERITIES = ("error", "warning", "info")
# PJRT clients built into torch_xla 2.9's runtime library ("Initializing PjRt CPU client",
# "TFRT TPU", "XPU", "NEURON"); any other name needs a registered PJRT plugin.
_BUILTIN_PJRT = ("CPU", "TPU", "XPU", "NEURON")

_FALSY = ("", "0", "false", "no", "off")


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
class Report:
    rows: tuple[Row, ...]
    findings: tuple[Finding, ...]

    @property
    def usable(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def exit_code(self, strict: bool = False) -> int:
        """0 when usable; 1 when an error makes the environment unusable (or, with ``strict``,
        when anything deserves a warning)."""
        bad = ("error", "warning") if strict else ("error",)
        return 1 if any(f.severity in bad for f in self.findings) else 0


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

# Runs in a child process: a torch_xla that hangs or aborts while starting the runtime must not
# take the doctor with it. Each stage prints one tagged JSON line as soon as it is done, so a crash
# in a later stage still leaves the earlier answers. The float32 check measures what precision
# the device really computes in: 1/3*3 + 1e-3 is 1.001 in float32 and 1.0 in bfloat16.
_PROBE_SOURCE = r"""
import json, sys, warnings
def emit(stage, **values):
    print("XLATRAIN_PROBE " + json.dumps(dict(stage=stage, **values)), flush=True)
import torch
names, error = [], None
try:
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
emit("torch", version=torch.__version__, cuda_build=torch.version.cuda, cuda_devices=names, cuda_error=error)
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
    """What the child process reported, stage by stage (``torch``, ``import``, ``runtime``)."""

    stages: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    returncode: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    output_tail: str = ""
    pjrt_device: str | None = None
    timeout_s: float = 0.0


def run_probe(
    environ: Mapping[str, str],
    *,
    with_xla: bool = True,
    timeout_s: float = 120.0,
    python: str = sys.executable,
    pjrt_device: str | None = None,
) -> Probe:
    """Import torch (and torch_xla, starting its runtime) in a child process with ``environ``."""
    env = dict(environ)
    if with_xla and pjrt_device and "PJRT_DEVICE" not in env:
        env["PJRT_DEVICE"] = pjrt_device  # what xlatrain would choose, so the probe tests that
    start = time.monotonic()
    try:
        # A session of its own, so a timeout can kill the child and anything it forked.
        proc = subprocess.Popen(
            [python, "-c", _PROBE_SOURCE, "xla" if with_xla else "torch"],
            env=env,
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
    return Probe(
        stages=stages,
        returncode=code,
        timed_out=timed_out,
        seconds=time.monotonic() - start,
        output_tail="\n".join(other[-15:]),
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
    return versions


def _torch_requirement(dist: str) -> str | None:
    """The ``torch`` requirement a distribution declares (``"torch>=2.11"``), if any."""
    try:
        requires = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return None
    for req in requires:
        if re.match(r"torch\s*([<>=!~;\[ ]|$)", req):
            return req.split(";")[0].strip()
    return None


def _major_minor(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _is_on(value: str) -> bool:
    return value.strip().lower() not in _FALSY


def _gib(kib: int) -> str:
    return f"{kib / 2**20:.1f} GiB"


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
    if not os.access(path, os.W_OK):
        return (
            f"{path} (read-only)",
            "warning",
            Finding(
                "cache-not-writable",
                "warning",
                "the compilation cache directory is read-only",
                f"{path} is not writable by this user: new programs cannot be cached",
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


def collect(
    environ: Mapping[str, str] | None = None,
    *,
    probe: bool | Probe = True,
    probe_timeout_s: float = 120.0,
    pci_root: str | os.PathLike[str] = PCI_ROOT,
    versions: Mapping[str, str | None] | None = None,
) -> Report:
    """Gather the environment report.

    Args:
        environ: the environment to judge (default: this process's). The probe runs in it.
        probe: run torch / torch_xla in a child process (``True``), skip that (``False``), or
            judge a ``Probe`` you already have.
        probe_timeout_s: how long the child may take before it counts as hung.
        pci_root: where PCI devices are listed (tests point it at a fake tree).
        versions: installed distribution versions by name (default: read from the installed
            packages; ``None`` for a package that is absent).
    """
    env: Mapping[str, str] = dict(os.environ) if environ is None else environ
    ver = dict(_installed_versions() if versions is None else versions)
    rows: list[Row] = []
    findings: list[Finding] = []

    torch_v, xla_v, vision_v = ver.get("torch"), ver.get("torch_xla"), ver.get("torchvision")
    chips = find_tpu_chips(pci_root)

    rows.append(Row("Python", f"{sys.version.split()[0]} ({sys.executable})"))
    if torch_v is None:
        rows.append(Row("torch", "not installed", "error"))
        findings.append(
            Finding(
                "torch-missing",
                "error",
                "torch is not installed",
                f"no 'torch' distribution in {sys.executable}'s environment",
                "pip install 'torch==2.9.0' (or pip install -e . in the xlatrain checkout)",
            )
        )
    else:
        rows.append(Row("torch", torch_v))
    if vision_v is not None:
        status = "ok"
        tv, vv = _major_minor(torch_v), _major_minor(vision_v)
        # torchvision 0.(N+15) is built for torch 2.N (0.24 <-> 2.9); another pair fails at import
        # of its C++ ops ("operator torchvision::nms does not exist").
        if tv and vv and tv[0] == 2 and vv != (0, tv[1] + 15):
            status = "warning"
            findings.append(
                Finding(
                    "version-mismatch:torchvision",
                    "warning",
                    f"torchvision {vision_v} is not the build for torch {torch_v}",
                    f"torch {tv[0]}.{tv[1]} pairs with torchvision 0.{tv[1] + 15}; found {vision_v}",
                    f"pip install 'torchvision==0.{tv[1] + 15}.*'",
                )
            )
        rows.append(Row("torchvision", vision_v, status))

    if xla_v is None:
        rows.append(Row("torch_xla", "not installed (runs on CUDA / CPU; pip install 'xlatrain[xla]' for TPU)", "info"))
    else:
        tv, xv = _major_minor(torch_v), _major_minor(xla_v)
        if torch_v is not None and tv and xv and tv != xv:
            rows.append(Row("torch_xla", f"{xla_v} (needs torch {xv[0]}.{xv[1]}.x, found {torch_v})", "error"))
            findings.append(
                Finding(
                    "version-mismatch:torch_xla",
                    "error",
                    f"torch_xla {xla_v} does not run with torch {torch_v}",
                    f"torch_xla is built against one torch release: {xla_v} needs torch "
                    f"{xv[0]}.{xv[1]}.x (its C++ extension fails to load against another)",
                    f"pip install 'torch=={xv[0]}.{xv[1]}.*' (or 'torch_xla=={tv[0]}.{tv[1]}.*' to "
                    "keep this torch)",
                )
            )
        else:
            rows.append(Row("torch_xla", f"{xla_v} (matches torch {torch_v})" if torch_v else xla_v))

    tpu_v = ver.get("torch_tpu")
    if tpu_v:
        # Google's native TPU device for eager PyTorch; it pins its own torch release.
        needs = _torch_requirement("torch_tpu")
        rows.append(Row("torch_tpu", f"{tpu_v} (requires {needs}; found torch {torch_v})" if needs else tpu_v))
    else:
        rows.append(Row("torch_tpu", "not installed", "info"))

    libtpu_v = ver.get("libtpu") or ver.get("libtpu-nightly")
    bundled = _bundled_libtpu()
    if libtpu_v:
        libtpu = f"{libtpu_v}"
    elif env.get("TPU_LIBRARY_PATH"):
        libtpu = f"TPU_LIBRARY_PATH={env['TPU_LIBRARY_PATH']}"
    elif bundled:
        libtpu = f"bundled with torch_xla ({bundled})"
    else:
        libtpu = "not installed"
    if libtpu != "not installed":
        rows.append(Row("libtpu", libtpu))
    else:
        rows.append(Row("libtpu", "not installed" + ("" if chips else " (needed on TPU hosts only)"), "error" if chips else "info"))

    if chips:
        gens = sorted({c.generation for c in chips})
        cores = sum(2 if c.generation in ("v2", "v3", "v2/v3") else 1 for c in chips)
        rows.append(Row("TPU", f"{len(chips)} chip(s), {', '.join(gens)} ({cores} XLA devices); PCI ids "
                        + ", ".join(sorted({c.device_id for c in chips}))))
    else:
        rows.append(Row("TPU", "none on the PCI bus", "info"))

    pjrt_raw = env.get("PJRT_DEVICE", "")
    pjrt_kind = pjrt_raw.strip().upper().split("_")[0]  # torch_xla reads 'TPU_C_API' etc. as TPU
    chosen = pjrt_kind or ("TPU" if chips else "CPU")  # mirrors xlatrain.backend.xla.configure_runtime
    if pjrt_raw:
        pjrt_row = f"{pjrt_raw} (from PJRT_DEVICE)"
    else:
        pjrt_row = f"{chosen} (PJRT_DEVICE unset: xlatrain picks {chosen}, " + (
            "a TPU is on the PCI bus)" if chips else "no TPU on the PCI bus)"
        )
    findings += _device_findings(env, pjrt_kind, chips, xla_v, libtpu)

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
    findings += _flag_findings(env)

    # ------------------------------------------------------------------ probe
    mismatch = any(f.code == "version-mismatch:torch_xla" for f in findings)
    probe_xla = xla_v is not None and not mismatch  # a mismatched pair only repeats the error
    probe_result: Probe | None
    if isinstance(probe, Probe):
        probe_result = probe
    elif probe and torch_v is not None:
        probe_result = run_probe(env, with_xla=probe_xla, timeout_s=probe_timeout_s, pjrt_device=chosen)
    else:
        probe_result = None
    rows.append(Row("PJRT device", pjrt_row if xla_v else f"{pjrt_row}; torch_xla not installed",
                    "ok" if xla_v else "info"))
    rows += _probe_rows(probe_result, xla_v, probe_xla)
    findings += _probe_findings(probe_result, probe_xla)
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

    mem = _meminfo()
    if "MemTotal" in mem:
        rows.append(Row("Host memory", f"{_gib(mem['MemTotal'])} total, {_gib(mem.get('MemAvailable', 0))} available"))
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable_cpus = os.cpu_count() or 0
    rows.append(Row("CPU cores", f"{usable_cpus} usable of {os.cpu_count()}"))

    cache = default_cache_dir(env)
    value, status, cache_finding = _cache_summary(cache)
    if env.get("XLA_PERSISTENT_CACHE_PATH"):
        value += f"; XLA_PERSISTENT_CACHE_PATH={env['XLA_PERSISTENT_CACHE_PATH']} overrides it for torch_xla"
    if chosen == "CPU":
        value += "; XLA:CPU writes entries but cannot load them back (a second run recompiles)"
    rows.append(Row("Compile cache", value, status))
    if cache_finding:
        findings.append(cache_finding)

    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: order.get(f.severity, len(order)))
    return Report(rows=tuple(rows), findings=tuple(findings))


def _bundled_libtpu() -> str | None:
    spec = importlib.util.find_spec("torch_xla")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "lib" / "libtpu.so"
        if candidate.is_file():
            return str(candidate)
    return None


def _device_findings(
    env: Mapping[str, str], pjrt_kind: str, chips: tuple[TpuChip, ...], xla_v: str | None, libtpu: str
) -> list[Finding]:
    out = []
    if chips and xla_v is None:
        out.append(
            Finding(
                "tpu-without-torch-xla",
                "error",
                "a TPU is attached but torch_xla is not installed",
                f"{len(chips)} TPU chip(s) on the PCI bus; no 'torch_xla' distribution",
                "pip install 'xlatrain[xla]' and 'torch_xla[tpu]==2.9.0' (brings libtpu)",
            )
        )
    elif chips and libtpu == "not installed":
        out.append(
            Finding(
                "tpu-without-libtpu",
                "error",
                "a TPU is attached but libtpu is missing",
                "no libtpu package, no TPU_LIBRARY_PATH, no libtpu.so bundled with torch_xla",
                "pip install 'torch_xla[tpu]==2.9.0' (installs the matching libtpu)",
            )
        )
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


def _flag_findings(env: Mapping[str, str]) -> list[Finding]:
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
            out.append(
                Finding(
                    "env:PT_XLA_DEBUG",
                    "error",
                    f"PT_XLA_DEBUG={debug!r} makes 'import torch_xla' fail",
                    "torch_xla 2.9 reads it with int(os.environ['PT_XLA_DEBUG']) at import: a "
                    "non-integer raises ValueError",
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
    if probe is None:
        return [Row("CUDA", "not probed", "info"), Row("XLA devices", "not probed", "info")]
    rows = []
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
    runtime = probe.stages.get("runtime")
    if not probe_xla:
        rows.append(Row("XLA devices", "not probed (torch_xla does not match torch)", "error"))
    elif runtime is None:
        rows.append(Row("XLA devices", "the runtime did not start (see findings)", "error"))
    else:
        n = runtime.get("devices", 0)
        rows.append(
            Row(
                "XLA devices",
                f"{n} x {runtime.get('device_type')} (import and runtime start took {probe.seconds:.1f} s)",
                "ok" if n else "error",
            )
        )
    return rows


def _probe_findings(probe: Probe | None, probe_xla: bool) -> list[Finding]:
    if probe is None:
        return []
    where = f"PJRT_DEVICE={probe.pjrt_device}" if probe.pjrt_device else "PJRT_DEVICE unset"
    tail = probe.output_tail.strip()
    last = tail.splitlines()[-1] if tail else "no output"
    if probe.timed_out:
        reached = ", ".join(probe.stages) or "none"
        return [
            Finding(
                "probe-timeout",
                "error",
                f"starting torch / torch_xla hung for {probe.timeout_s:.0f} s",
                f"the probe ({where}) finished stages [{reached}] and was killed; last output: {last}",
                "a runtime that never starts usually means the TPU is held by another process "
                "(find it with: lsof -w /dev/accel* /dev/vfio/*) or PJRT_DEVICE names hardware "
                "that is not there; rerun with a longer --timeout if the host is just slow",
            )
        ]
    if "torch" not in probe.stages:
        return [
            Finding(
                "torch-import-failed",
                "error",
                "import torch fails",
                f"exit code {probe.returncode}; last output: {last}",
                "reinstall torch for this Python (pip install --force-reinstall 'torch==2.9.0')",
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


def _precision_note(probe: Probe | None) -> str | None:
    """A sentence when the device computed the probe's float32 sum in lower precision."""
    runtime = probe.stages.get("runtime") if probe is not None else None
    check = runtime.get("f32_check") if runtime else None
    if not isinstance(check, (int, float)) or abs(check - 1.001) < 1e-4:
        return None
    return f"measured on this device: float32 1/3*3 + 0.001 gave {check!r} (float32 gives 1.0010000467)"


# --------------------------------------------------------------------------- render


_STATUS_MARK = {"ok": "ok", "info": "--", "warning": "WARN", "error": "FAIL"}


def render_text(report: Report, strict: bool = False) -> str:
    """The report as a table and a list of findings, for a terminal."""
    width = max(len(r.name) for r in report.rows) if report.rows else 10
    lines = ["xlatrain doctor: environment", ""]
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
    """The report as JSON: ``usable``, ``exit_code``, ``rows`` and ``findings``."""
    return json.dumps(
        {
            "usable": report.usable,
            "exit_code": report.exit_code(strict),
            "rows": [asdict(r) for r in report.rows],
            "findings": [asdict(f) for f in report.findings],
        },
        indent=2,
    )
