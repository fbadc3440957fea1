"""Facts about this host's hardware and runtime caches, read without importing any runtime.

The one table of TPU PCI ids, and where compiled programs are cached. Imports nothing beyond the
standard library, so ``xlatrain doctor`` can use it on a host whose torch is broken.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PCI_ROOT = "/sys/bus/pci/devices"
GOOGLE_PCI_VENDOR = "0x1ae0"

# PCI device id -> TPU generation. The ids are the ones torch_xla 2.9 counts as TPU chips
# (torch_xla/_internal/tpu.py); the names follow Google's tpu-info. Google's vendor id alone is
# not enough: a GCE VM's gVNIC network card is 0x1ae0 too.
TPU_DEVICE_IDS = {
    "0x0027": "v2/v3",  # told apart by the subsystem id below
    "0x005e": "v4",
    "0x0062": "v5p",
    "0x0063": "v5e",
    "0x006f": "v6e",
    "0x0076": "7x",
    "0x0056": "unnamed (0x0056)",
}
_V2_V3_SUBSYSTEMS = {"0x004e": "v2", "0x004f": "v3"}


@dataclass(frozen=True)
class TpuChip:
    address: str
    device_id: str
    generation: str


def find_tpu_chips(pci_root: str | os.PathLike[str] = PCI_ROOT) -> tuple[TpuChip, ...]:
    """TPU chips on the PCI bus, found without starting any runtime (as torch_xla does)."""
    root = Path(pci_root)
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return ()
    chips = []
    for entry in entries:
        if _read(root / entry / "vendor") != GOOGLE_PCI_VENDOR:
            continue
        device_id = _read(root / entry / "device") or ""
        generation = TPU_DEVICE_IDS.get(device_id)
        if generation is None:
            continue  # a Google device that is no TPU (gVNIC network card, ...)
        if device_id == "0x0027":
            generation = _V2_V3_SUBSYSTEMS.get(_read(root / entry / "subsystem_device") or "", "v2/v3")
        chips.append(TpuChip(address=entry, device_id=device_id, generation=generation))
    return tuple(chips)


VFIO_ROOT = "/dev/vfio"

# The PCI device ids torch_tpu 0.2 counts as TPUs (torch_tpu/_internal/utils/hardware.py
# _TOPOLOGY_BY_TPU_PCI_DEVICE_ID: v4, v5p, v5e, v6e, v7); v2/v3 (0x0027) and 0x0056 are not among them.
TORCH_TPU_DEVICE_IDS = frozenset({"0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})


def vfio_group(
    address: str, pci_root: str | os.PathLike[str] = PCI_ROOT, vfio_root: str | os.PathLike[str] = VFIO_ROOT
) -> str | None:
    """The VFIO group a PCI device is reached through, or None when it has none.

    torch_tpu 0.2 counts a TPU chip only when the IOMMU group its ``iommu_group`` link names has a
    node ``/dev/vfio/<group>`` (``_scan_pci_tpus``); without one it registers no ``tpu`` device at
    ``import torch``. Read the same way here, without starting anything.

    Example:
        >>> vfio_group("0000:00:04.0", pci_root="/nonexistent") is None
        True
    """
    try:
        group = os.path.basename(os.readlink(Path(pci_root) / address / "iommu_group"))
        os.stat(Path(vfio_root) / group)
    except OSError:
        return None
    return group


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where xlatrain keeps torch_xla's persistent compilation cache.

    ``$XLATRAIN_CACHE_DIR`` when set, else ``~/.cache/xlatrain/xla``.

    Example:
        >>> str(default_cache_dir({"HOME": "/home/ana"}))
        '/home/ana/.cache/xlatrain/xla'
    """
    env = os.environ if environ is None else environ
    chosen = env.get("XLATRAIN_CACHE_DIR", "").strip()
    if chosen:
        return Path(os.path.expanduser(chosen))
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".cache" / "xlatrain" / "xla"


def tpu_runtime_packages_installed() -> bool:
    """torch_tpu or libtpu is installed (found without importing either)."""
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("torch_tpu", "libtpu"))


def settle_libtpu_without_tpu(
    environ: dict[str, str] | None = None, pci_root: str | os.PathLike[str] = PCI_ROOT
) -> bool:
    """On a host without TPU chips, stop libtpu from searching for one on the cloud metadata server.

    With torch_tpu installed, torch's autograd engine asks every registered device for its count
    at the first ``backward()``; torch_tpu answers by starting libtpu, which first asks the GCE
    metadata server for its TPU settings and, off Google Cloud, retries for minutes while the
    process sits idle (seen here: a CPU backward stalled for over 10 minutes). With no chip on the
    PCI bus there is nothing for it to find, so ``TPU_SKIP_MDS_QUERY=1`` lets it fail at once and
    training goes on. A value the user set is kept. Returns whether it set the variable.
    """
    env = os.environ if environ is None else environ
    if "TPU_SKIP_MDS_QUERY" in env or not tpu_runtime_packages_installed() or find_tpu_chips(pci_root):
        return False
    env["TPU_SKIP_MDS_QUERY"] = "1"
    return True


def torch_backend_loaders() -> set[str]:
    """The values of the ``torch.backends`` entry points installed on ``sys.path`` (what torch
    autoloads at ``import torch``), read from each distribution's ``entry_points.txt`` as
    importlib.metadata reads them, without its import cost (this also runs at interpreter start,
    see :func:`quiet_dormant_tpu`)."""
    import sys

    found: set[str] = set()
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            try:
                text = (Path(entry or ".") / name / "entry_points.txt").read_text()
            except OSError:
                continue
            section = None
            for line in text.splitlines():
                line = line.strip()
                if line.startswith("["):
                    section = line.strip("[]").strip()
                elif section == "torch.backends" and "=" in line:
                    found.add(line.split("=", 1)[1].strip())
    return found


def skip_idle_torch_tpu_autoload(
    environ: dict[str, str] | None = None, pci_root: str | os.PathLike[str] = PCI_ROOT
) -> bool:
    """Before torch is imported: turn off torch's device-backend autoload when it would only load
    a dormant torch_tpu.

    torch_tpu registers itself to load at every ``import torch`` (about 4 s here: libtpu and
    torch._dynamo), also on hosts without a TPU, where it registers nothing usable and prints
    libtpu's start-up lines. When no TPU chip is on the PCI bus and torch_tpu is the only
    autoloaded backend, this sets ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``; a value the user set is
    kept, and another backend that relies on autoload keeps it on. Returns whether it set the
    variable.
    """
    env = os.environ if environ is None else environ
    if "TORCH_DEVICE_BACKEND_AUTOLOAD" in env or find_tpu_chips(pci_root):
        return False
    loaders = torch_backend_loaders()
    if not loaders or any(not value.startswith("torch_tpu") for value in loaders):
        return False
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return True


def quiet_dormant_tpu(environ: dict[str, str] | None = None, pci_root: str | os.PathLike[str] = PCI_ROOT) -> list[str]:
    """On a host without a TPU, keep an installed TorchTPU/libtpu from loading or waiting: what the
    ``xlatrain`` command does before torch starts, and what the start-up hook of an environment
    (``python -m xlatrain.site_hook install``) does for every Python process in it, xlatrain or not.
    On a host with a TPU chip on the PCI bus it changes nothing. Returns the variables it set."""
    done = []
    if skip_idle_torch_tpu_autoload(environ, pci_root):
        done.append("TORCH_DEVICE_BACKEND_AUTOLOAD=0")
    if settle_libtpu_without_tpu(environ, pci_root):
        done.append("TPU_SKIP_MDS_QUERY=1")
    return done


SITE_HOOK_OFF = "XLATRAIN_SITE_HOOK"  # =0 turns the start-up hook off for a process
SITE_HOOK_SET = "XLATRAIN_SITE_HOOK_SET"  # what the hook set, for `xlatrain doctor` to say


def site_startup() -> None:
    """What the environment's start-up hook runs at interpreter start (see xlatrain.site_hook)."""
    if os.environ.get(SITE_HOOK_OFF) == "0":
        return
    done = quiet_dormant_tpu()
    if done:
        os.environ[SITE_HOOK_SET] = ",".join(done)


def torch_tpu_cache_env(enabled: bool, environ: dict[str, str] | None = None) -> dict[str, str]:
    """TorchTPU's compilation caches, set in ``environ`` unless the user set them.

    TorchTPU reads ``TORCH_TPU_TIER2_COMPILATION_CACHE`` (a host cache in /dev/shm, named) and
    ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`` (a persistent directory, which needs tier 2) once,
    at its first compilation; xlatrain's command line sets them before torch is imported. With the
    cache on, tier 3 lives beside torch_xla's cache (``$XLATRAIN_CACHE_DIR``'s sibling
    ``torch_tpu``), so a second identical run skips compiling; off, both tiers are disabled.
    Returns what it set.
    """
    env = os.environ if environ is None else environ
    if any(key in env for key in ("TORCH_TPU_TIER2_COMPILATION_CACHE", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT")):
        return {}
    wanted = (
        {"TORCH_TPU_TIER2_COMPILATION_CACHE": "xlatrain",
         "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": str(default_cache_dir(env).parent / "torch_tpu")}
        if enabled else {"TORCH_TPU_TIER2_COMPILATION_CACHE": "disabled"}
    )
    env.update(wanted)
    return wanted


# --- what devices can hold and compute ---------------------------------------------------------

GB, GIB = 10**9, 2**30


@dataclass(frozen=True)
class DeviceSpec:
    """One device's memory and dense peak FLOP/s, from its maker's published figures."""

    name: str
    memory: int  # bytes per device
    peak_bf16: float  # FLOP/s, dense (no sparsity); fp16 where the device has no bf16
    peak_fp32: float | None  # FLOP/s of float32 matmuls as torch runs them by default; None: not published
    source: str


# TPUs: per chip, from cloud.google.com/tpu/docs (system architecture pages of each version);
# TPU v7 (Ironwood) counts as 2 devices per chip under TorchTPU, so its entry is per device.
# float32 matmuls on a TPU run as bfloat16 passes by default: their peak is the bf16 one.
# GPUs: dense tensor-core figures from NVIDIA's datasheets (H100/H200 SXM, A100, L4, A10G, T4,
# V100, P100); float32 is the CUDA-core rate (torch leaves TF32 off for matmuls by default).
DEVICE_SPECS: dict[str, DeviceSpec] = {
    spec.name: spec for spec in (
        DeviceSpec("tpu-v4", 32 * GIB, 275e12, 275e12, "Google Cloud TPU v4: 275 TFLOP/s bf16, 32 GiB HBM per chip"),
        DeviceSpec("tpu-v5e", 16 * GIB, 197e12, 197e12, "Google Cloud TPU v5e: 197 TFLOP/s bf16, 16 GiB HBM per chip"),
        DeviceSpec("tpu-v5p", 95 * GIB, 459e12, 459e12, "Google Cloud TPU v5p: 459 TFLOP/s bf16, 95 GiB HBM per chip"),
        DeviceSpec("tpu-v6e", 32 * GIB, 918e12, 918e12, "Google Cloud TPU v6e (Trillium): 918 TFLOP/s bf16, 32 GiB HBM per chip"),
        DeviceSpec("tpu-v7x", 96 * GIB, 1153.5e12, 1153.5e12,
                   "Google Cloud TPU v7 (Ironwood): 2307 TFLOP/s bf16, 192 GiB HBM per chip = 2 devices"),
        DeviceSpec("h200", 141 * GB, 989e12, 66.9e12, "NVIDIA H200 SXM: 989 TFLOP/s bf16 dense, 67 fp32, 141 GB"),
        DeviceSpec("h100", 80 * GB, 989e12, 66.9e12, "NVIDIA H100 SXM: 989 TFLOP/s bf16 dense, 67 fp32, 80 GB"),
        DeviceSpec("h100-pcie", 80 * GB, 756e12, 51.2e12, "NVIDIA H100 PCIe: 756 TFLOP/s bf16 dense, 51 fp32, 80 GB"),
        DeviceSpec("a100-80gb", 80 * GB, 312e12, 19.5e12, "NVIDIA A100 80GB: 312 TFLOP/s bf16 dense, 19.5 fp32"),
        DeviceSpec("a100", 40 * GB, 312e12, 19.5e12, "NVIDIA A100 40GB: 312 TFLOP/s bf16 dense, 19.5 fp32"),
        DeviceSpec("l4", 24 * GB, 121e12, 30.3e12, "NVIDIA L4: 121 TFLOP/s bf16 dense, 30.3 fp32, 24 GB"),
        DeviceSpec("a10g", 24 * GB, 125e12, 31.2e12, "NVIDIA A10G (A10): 125 TFLOP/s bf16 dense, 31.2 fp32, 24 GB"),
        DeviceSpec("t4", 16 * GB, 65e12, 8.1e12, "NVIDIA T4: 65 TFLOP/s fp16 (no bf16), 8.1 fp32, 16 GB"),
        DeviceSpec("v100", 16 * GB, 125e12, 15.7e12, "NVIDIA V100 16GB: 125 TFLOP/s fp16 (no bf16), 15.7 fp32"),
        DeviceSpec("v100-32gb", 32 * GB, 125e12, 15.7e12, "NVIDIA V100 32GB: 125 TFLOP/s fp16 (no bf16), 15.7 fp32"),
        DeviceSpec("p100", 16 * GB, 18.7e12, 9.3e12, "NVIDIA P100: 18.7 TFLOP/s fp16, 9.3 fp32, 16 GB"),
    )
}
# PCI generation (find_tpu_chips) -> the table's entry.
TPU_GENERATIONS = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e", "7x": "tpu-v7x"}


def spec_for_name(device_name: str) -> DeviceSpec | None:
    """The table entry for a device's own name (``torch.cuda.get_device_name``), if any."""
    name = device_name.lower()
    for key, needle in (("h200", "h200"), ("h100-pcie", "h100 pcie"), ("h100", "h100"), ("a100-80gb", "a100 80gb"),
                        ("a100-80gb", "a100-sxm4-80gb"), ("a100", "a100"), ("l4", " l4"), ("a10g", "a10g"),
                        ("t4", " t4"), ("v100-32gb", "v100-sxm2-32gb"), ("v100-32gb", "v100-pcie-32gb"),
                        ("v100", "v100"), ("p100", "p100")):
        if needle in f" {name}":
            return DEVICE_SPECS[key]
    return None


def tpu_spec() -> DeviceSpec | None:
    """The spec of this host's TPU chips (from the PCI bus), if the table has their generation."""
    chips = find_tpu_chips()
    return DEVICE_SPECS.get(TPU_GENERATIONS.get(chips[0].generation, "")) if chips else None


def parse_memory(value: str | int | float) -> tuple[int, str]:
    """A stated device memory: bytes (``17179869184``, ``"16GB"``, ``"16GiB"``) or a device of the
    table (``"v5e"``, ``"tpu-v5e"``, ``"h100"``). Returns ``(bytes, what it was read as)``.

    Example:
        >>> parse_memory("v5e")[0] == 16 * 2**30, parse_memory("24GB")[0]
        (True, 24000000000)
    """
    import re

    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1:  # whole bytes
        return int(value), f"{int(value):,} bytes as stated"
    text = str(value).strip().lower()
    key = text if text in DEVICE_SPECS else f"tpu-{text}" if f"tpu-{text}" in DEVICE_SPECS else None
    if key is not None:
        spec = DEVICE_SPECS[key]
        return spec.memory, f"{spec.name} ({spec.source})"
    found = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(gib|gb|mib|mb|tib|tb)", text)
    if found:
        unit = {"gib": GIB, "gb": GB, "mib": 2**20, "mb": 10**6, "tib": 2**40, "tb": 10**12}[found.group(2)]
        size = int(float(found.group(1)) * unit)
        if size > 0:
            return size, f"{value} as stated"
    raise ValueError(
        f"device_memory={value!r} is not valid: give bytes (more than 0), a size such as '16GB' or '80GiB', or a device: "
        f"{', '.join(sorted(DEVICE_SPECS))}"
    )


def host_memory_available() -> int | None:
    """Bytes the kernel says can be allocated now without swapping (``MemAvailable``)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_share(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(CPUs this process may run on, training processes on this host): the CPUs from the
    process's affinity mask (a container's or a scheduler's limit included), the processes from
    ``LOCAL_WORLD_SIZE`` (torchrun, TorchTPU's launcher), one where it is unset."""
    environ = os.environ if environ is None else environ
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        local = max(int(environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    except ValueError:
        local = 1
    return cpus, local
