import argparse
import importlib.util
import io
import json
import os
import platform
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from xlatrain.backend.hardware import default_cache_dir, find_tpu_chips, vfio_group
from xlatrain.diagnostics import doctor
from xlatrain.diagnostics.cli import add_doctor_parser
from xlatrain.diagnostics.doctor import BUNDLED_LIBTPU, Probe, collect, render_json, render_text

# torch_xla's environment (.venv-xla) and TorchTPU's (.venv), as installed-package data.
MATCHED = {"torch": "2.9.0", "torchvision": "0.24.0", "torch_xla": "2.9.0", "torch_tpu": None, "libtpu": None,
           "libtpu-nightly": None, BUNDLED_LIBTPU: None}
CURRENT = {"torch": "2.14.1", "torchvision": "0.29.2", "torch_xla": None, "torch_tpu": "0.2.0", "libtpu": "0.0.52",
           "libtpu-nightly": None, BUNDLED_LIBTPU: None}
CLEAN_PROBE = Probe(
    stages={
        "torch": {"version": "2.9.0", "cuda_build": "12.8", "cuda_devices": []},
        "import": {"version": "2.9.0", "device_type": "CPU"},
        "runtime": {"device_type": "CPU", "devices": 1, "addressable": 1, "f32_check": 1.0010000467300415},
    },
    returncode=0,
    pjrt_device="CPU",
)
TCMALLOC_WARNING = (
    "<TorchTpu/Performance/TcMalloc/> tcmalloc is not loaded; TorchTPU host performance may be degraded due to "
    "glibc ptmalloc contention. Preload libtcmalloc before starting Python (e.g. "
    "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4), or set "
    'PYTHONWARNINGS="ignore:<TorchTpu/Performance/TcMalloc/" to suppress this warning.'
)


def torch_tpu_probe(privateuse1="privateuseone", count=0, warnings=(TCMALLOC_WARNING,), import_s=5.9, baseline_s=1.6):
    """What the probe child reports in the TorchTPU environment (torch_tpu autoloaded)."""
    stages = {
        "torch": {"version": "2.14.1", "cuda_build": "13.0", "cuda_devices": [], "import_s": import_s,
                  "torch_tpu_loaded": True, "import_warnings": list(warnings)},
        "accelerator": {"privateuse1": privateuse1, "accelerator": "tpu" if privateuse1 == "tpu" else "cuda",
                        "available": count > 0, "count": count},
    }
    if baseline_s is not None:
        stages["baseline"] = {"version": "2.14.1", "import_s": baseline_s, "torch_tpu_loaded": False}
    return Probe(stages=stages, returncode=0)


@pytest.fixture
def base_env(tmp_path):
    """A clean environment: a home of its own and nothing XLA- or TPU-related set."""
    return {"HOME": str(tmp_path / "home"), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


@pytest.fixture
def no_pci(tmp_path):
    root = tmp_path / "pci"
    root.mkdir()
    return root


def fake_pci(root: Path, devices: list[tuple[str, str, str]], vfio_root: Path | None = None) -> Path:
    """A PCI device tree; with ``vfio_root``, each device gets an IOMMU group with a node there."""
    for i, (vendor, device, subsystem) in enumerate(devices):
        d = root / f"0000:00:{i:02x}.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
        (d / "subsystem_device").write_text(subsystem + "\n")
        if vfio_root is not None:
            group = root.parent / "iommu_groups" / str(10 + i)
            group.mkdir(parents=True)
            (d / "iommu_group").symlink_to(group)
            vfio_root.mkdir(exist_ok=True)
            (vfio_root / str(10 + i)).write_text("")
    return root


def tpu_host(tmp_path, device_id="0x006f", n=4, vfio=True):
    """(pci_root, vfio_root) of a host with ``n`` TPU chips."""
    vfio_root = tmp_path / "vfio"
    root = fake_pci(tmp_path / "pci", [("0x1ae0", device_id, "0x0000")] * n, vfio_root if vfio else None)
    vfio_root.mkdir(exist_ok=True)
    return root, vfio_root


def codes(report, severity=None):
    return [f.code for f in report.findings if severity is None or f.severity == severity]


def finding(report, code):
    (found,) = [f for f in report.findings if f.code == code]
    return found


def runtime(report, name):
    return next(r for r in report.runtimes if r.name == name)


def rows(report):
    return {r.name: r for r in report.rows}


# ----------------------------------------------------------------- torch_xla's environment


def test_clean_environment_is_usable_with_exit_0(base_env, no_pci):
    report = collect(base_env, probe=CLEAN_PROBE, pci_root=no_pci, versions=MATCHED)
    assert report.usable and report.exit_code() == 0 and report.exit_code(strict=True) == 0
    assert codes(report) == []
    found = rows(report)
    for name in ("Python", "torch", "torch_xla", "torch_tpu", "libtpu", "TPU", "PJRT device", "CUDA",
                 "XLA devices", "Host memory", "CPU cores", "Compile cache"):
        assert name in found, name
    assert found["torch_xla"].value == "2.9.0 (needs torch 2.9.0 exactly: found 2.9.0, fits)"
    assert found["XLA devices"].value.startswith("1 x CPU")
    assert found["PJRT device"].value.startswith("CPU (PJRT_DEVICE unset")
    assert str(default_cache_dir(base_env)) in found["Compile cache"].value
    assert re.fullmatch(r"[\d.]+ GB total, [\d.]+ GB available", found["Host memory"].value)  # the run header's units
    assert "Result: usable" in render_text(report)
    xla, tpu = runtime(report, "torch_xla"), runtime(report, "TorchTPU")
    assert (xla.runs_here, xla.installed) == (True, "torch_xla 2.9.0") and "1 x CPU" in xla.why
    assert (tpu.runs_here, tpu.why) == (False, "not installed")
    assert "here: torch 2.9.0 does not fit (older)" in tpu.needs  # TorchTPU needs an environment of its own


def test_xla_use_bf16_and_xrt_tpu_config_are_each_named_with_their_fix(base_env, no_pci):
    env = dict(base_env, XLA_USE_BF16="1", XRT_TPU_CONFIG="localservice;0;localhost:51011")
    report = collect(env, probe=False, pci_root=no_pci, versions=MATCHED)
    bf16, xrt = finding(report, "env:XLA_USE_BF16"), finding(report, "env:XRT_TPU_CONFIG")
    assert bf16.severity == "warning" and "tensor.dtype still reads torch.float32" in bf16.evidence
    assert 'precision="bf16"' in bf16.fix and "optimizer state" in bf16.fix
    assert xrt.severity == "warning" and "ignored" in xrt.evidence and "PJRT_DEVICE=TPU" in xrt.fix
    # Both are traps, not blockers: usable, but --strict fails on them.
    assert report.exit_code() == 0 and report.exit_code(strict=True) == 1
    text = render_text(report)
    assert "XLA_USE_BF16 is set" in text and "XRT_TPU_CONFIG is set" in text


def test_a_switch_set_to_0_is_no_trap_and_any_xrt_variable_is(base_env, no_pci):
    env = dict(base_env, XLA_USE_BF16="0", XRT_WORKERS="localservice:0;grpc://localhost:40934")
    report = collect(env, probe=False, pci_root=no_pci, versions=MATCHED)
    assert codes(report) == ["env:XRT_WORKERS"]


def test_removed_and_deprecated_variables_each_have_a_fix(base_env, no_pci):
    names = ["XLA_DOWNCAST_BF16", "TPU_IP_ADDRESS", "TPU_NUM_DEVICES", "GPU_NUM_DEVICES", "XLA_USE_SPMD",
             "XLA_USE_FP16", "XLA_USE_32BIT_LONG"]
    env = dict(base_env, **{n: "1" for n in names})
    report = collect(env, probe=False, pci_root=no_pci, versions=MATCHED)
    assert sorted(codes(report)) == sorted(f"env:{n}" for n in names)
    for name in names:
        found = finding(report, f"env:{name}")
        assert found.evidence.startswith(f"{name}='1': ") and found.fix


def test_torch_xla_from_another_release_than_torch_is_not_usable(base_env, no_pci):
    report = collect(base_env, probe=False, pci_root=no_pci, versions=dict(MATCHED, torch="2.8.0"))
    found = finding(report, "version-mismatch:torch_xla")
    assert found.severity == "error" and "needs torch 2.9.0 exactly" in found.evidence
    assert "'torch==2.9.0'" in found.fix
    assert report.exit_code() == 1 and runtime(report, "torch_xla").runs_here is False
    assert "NOT usable" in render_text(report) and "does not run with torch 2.8.0" in render_text(report)


def test_torch_xla_on_current_torch_points_to_torch_tpu(base_env, no_pci):
    report = collect(base_env, probe=False, pci_root=no_pci, versions=dict(MATCHED, torch="2.14.1"))
    assert "pip install 'xlatrain[tpu]'" in finding(report, "version-mismatch:torch_xla").fix


def test_another_patch_release_of_torch_is_a_warning_not_an_error(base_env, no_pci):
    # torch_xla 2.9.0 pins torch==2.9.0; whether it loads with 2.9.1 is not told by the versions.
    report = collect(base_env, probe=False, pci_root=no_pci, versions=dict(MATCHED, torch="2.9.1"))
    assert codes(report) == ["version-mismatch:torch_xla"]
    assert codes(report, "warning") == ["version-mismatch:torch_xla"] and report.exit_code() == 0


def test_pjrt_device_tpu_on_a_host_without_tpu_is_no_device(base_env, no_pci):
    report = collect(dict(base_env, PJRT_DEVICE="TPU"), probe=False, pci_root=no_pci, versions=MATCHED)
    assert "no-device" in codes(report, "error") and report.exit_code() == 1


def test_tpu_generation_from_pci_ids_and_a_gvnic_is_no_tpu(tmp_path):
    root = fake_pci(
        tmp_path / "pci",
        [("0x1ae0", "0x0063", "0x0000")] * 4 + [("0x1ae0", "0x0042", "0x0000"), ("0x8086", "0x1237", "0x0000")],
    )
    chips = find_tpu_chips(root)
    assert [c.generation for c in chips] == ["v5e"] * 4  # the 0x0042 gVNIC is not counted
    v3 = fake_pci(tmp_path / "v3", [("0x1ae0", "0x0027", "0x004f")])
    assert [c.generation for c in find_tpu_chips(v3)] == ["v3"]
    assert find_tpu_chips(tmp_path / "missing") == ()


def test_vfio_group_needs_the_iommu_link_and_the_dev_vfio_node(tmp_path):
    vfio_root = tmp_path / "vfio"
    root = fake_pci(tmp_path / "pci", [("0x1ae0", "0x006f", "0x0000")] * 2, vfio_root)
    first, second = sorted(os.listdir(root))
    assert vfio_group(first, root, vfio_root) == "10" and vfio_group(second, root, vfio_root) == "11"
    (vfio_root / "11").unlink()  # the group exists, its /dev/vfio node does not
    assert vfio_group(second, root, vfio_root) is None
    bare = fake_pci(tmp_path / "bare", [("0x1ae0", "0x006f", "0x0000")])  # no iommu_group link at all
    assert vfio_group(os.listdir(bare)[0], bare, vfio_root) is None


def test_a_tpu_without_any_runtime_is_an_error(base_env, tmp_path):
    root, vfio_root = tpu_host(tmp_path, n=2)
    versions = dict(MATCHED, torch_xla=None)
    report = collect(base_env, probe=False, pci_root=root, vfio_root=vfio_root, versions=versions)
    found = finding(report, "tpu-without-runtime")
    assert found.severity == "error" and "xlatrain[tpu]" in found.fix and "xlatrain[xla]" in found.fix
    assert rows(report)["TPU"].value.startswith("2 chip(s), v6e (2 XLA devices)")
    assert "2 of 2 with a /dev/vfio group" in rows(report)["TPU"].value


def test_a_tpu_with_torch_xla_needs_libtpu_unless_torch_xla_bundles_it(base_env, tmp_path):
    root, vfio_root = tpu_host(tmp_path, n=2)
    report = collect(base_env, probe=False, pci_root=root, vfio_root=vfio_root, versions=MATCHED)
    assert "tpu-without-libtpu" in codes(report, "error")
    bundled = dict(MATCHED, **{BUNDLED_LIBTPU: "/site-packages/torch_xla/lib/libtpu.so"})
    report = collect(base_env, probe=False, pci_root=root, vfio_root=vfio_root, versions=bundled)
    assert "tpu-without-libtpu" not in codes(report)
    assert rows(report)["libtpu"].value.startswith("bundled with torch_xla")


def test_default_cache_dir_is_the_env_override_or_under_home():
    assert default_cache_dir({"HOME": "/home/ana"}) == Path("/home/ana/.cache/xlatrain/xla")
    assert default_cache_dir({"HOME": "/home/ana", "XLATRAIN_CACHE_DIR": "/scratch/xla"}) == Path("/scratch/xla")
    assert default_cache_dir({"HOME": "/home/ana", "XLATRAIN_CACHE_DIR": "  "}) == Path("/home/ana/.cache/xlatrain/xla")


def test_cache_row_counts_entries(base_env, no_pci):
    cache = default_cache_dir(base_env)
    cache.mkdir(parents=True)
    (cache / "a").write_bytes(b"x" * 2048)
    (cache / "b").write_bytes(b"x" * 2048)
    report = collect(base_env, probe=False, pci_root=no_pci, versions=MATCHED)
    assert "(2 entries, 0.0 MiB)" in rows(report)["Compile cache"].value


def test_a_cache_path_no_user_can_create_is_a_warning(base_env, no_pci, tmp_path):
    # A directory cannot be created under a regular file, whoever asks: this holds for root too.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = dict(base_env, XLATRAIN_CACHE_DIR=str(blocker / "cache"))
    report = collect(env, probe=False, pci_root=no_pci, versions=MATCHED)
    assert codes(report) == ["cache-not-writable"] and codes(report, "warning") == ["cache-not-writable"]
    assert f"{blocker} is not a directory" in rows(report)["Compile cache"].value
    file_as_cache = collect(dict(base_env, XLATRAIN_CACHE_DIR=str(blocker)), probe=False, pci_root=no_pci,
                            versions=MATCHED)
    assert codes(file_as_cache) == ["cache-not-writable"]


@pytest.mark.skipif(os.geteuid() == 0, reason="needs a user that permissions apply to: root writes a 0500 directory")
def test_a_read_only_cache_directory_is_a_warning_for_a_non_root_user(base_env, no_pci):
    cache = default_cache_dir(base_env)
    cache.mkdir(parents=True)
    cache.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        report = collect(base_env, probe=False, pci_root=no_pci, versions=MATCHED)
    finally:
        cache.chmod(stat.S_IRWXU)
    assert codes(report, "warning") == ["cache-not-writable"]


def test_probe_outcomes_are_judged(base_env, no_pci):
    def judged(probe, **env):
        return collect(dict(base_env, **env), probe=probe, pci_root=no_pci, versions=MATCHED)

    hung = Probe(stages={"torch": CLEAN_PROBE.stages["torch"]}, timed_out=True, timeout_s=5, pjrt_device="CPU")
    assert codes(judged(hung)) == ["probe-timeout"]
    no_runtime = Probe(stages={k: CLEAN_PROBE.stages[k] for k in ("torch", "import")}, returncode=1,
                       output_tail="RuntimeError: Unknown device", pjrt_device="CPU")
    report = judged(no_runtime)
    assert codes(report) == ["runtime-failed"]
    assert "RuntimeError: Unknown device" in finding(report, "runtime-failed").evidence
    assert runtime(report, "torch_xla").runs_here is False and runtime(report, "CPU").runs_here is True
    no_import = Probe(stages={"torch": CLEAN_PROBE.stages["torch"]}, returncode=1, output_tail="ImportError: x")
    assert codes(judged(no_import)) == ["xla-import-failed"]
    zero = Probe(stages=dict(CLEAN_PROBE.stages, runtime={"device_type": "CPU", "devices": 0}), returncode=0)
    assert codes(judged(zero)) == ["no-device"]
    no_torch = Probe(stages={}, returncode=1, output_tail="ImportError: libtorch_cpu.so: cannot open")
    report = judged(no_torch)
    assert codes(report) == ["torch-import-failed"] and runtime(report, "CPU").runs_here is False
    # a device that rounds float32 to bf16: the measurement joins the env finding that explains it
    bf16 = Probe(stages=dict(CLEAN_PROBE.stages, runtime=dict(CLEAN_PROBE.stages["runtime"], f32_check=1.0)))
    evidence = finding(judged(bf16, XLA_USE_BF16="1"), "env:XLA_USE_BF16").evidence
    assert "measured on this device: float32 1/3*3 + 0.001 gave 1.0" in evidence
    assert codes(judged(bf16), "warning") == ["float32-not-float32"]  # no env var to blame


def test_non_integer_pt_xla_debug_breaks_the_import_only_where_torch_xla_is(base_env, no_pci):
    env = dict(base_env, PT_XLA_DEBUG="true")
    report = collect(env, probe=False, pci_root=no_pci, versions=MATCHED)
    assert codes(report, "error") == ["env:PT_XLA_DEBUG"]
    without_xla = collect(dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD="0"), probe=False, pci_root=no_pci,
                          versions=CURRENT)
    assert codes(without_xla, "info") == ["env:PT_XLA_DEBUG"] and without_xla.usable


def test_xla_flags_device_count_without_cpu_num_devices(base_env, no_pci):
    env = dict(base_env, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    report = collect(env, probe=False, pci_root=no_pci, versions=MATCHED)
    assert codes(report) == ["xla-flags-device-count"]


def test_render_json_parses(base_env, no_pci):
    report = collect(dict(base_env, XLA_USE_BF16="1"), probe=CLEAN_PROBE, pci_root=no_pci, versions=MATCHED)
    data = json.loads(render_json(report))
    assert data["usable"] is True and data["exit_code"] == 0
    assert {r["name"] for r in data["rows"]} >= {"torch", "torch_xla", "XLA devices"}
    (only,) = data["findings"]
    assert set(only) == {"code", "severity", "title", "evidence", "fix"}
    assert [(r["name"], r["runs_here"]) for r in data["runtimes"]] == [
        ("TorchTPU", False), ("torch_xla", True), ("CUDA", False), ("CPU", True)]
    assert "2.9.0 is its last release" in data["note"]
    assert json.loads(render_json(report, strict=True))["exit_code"] == 1


def test_the_text_says_torch_xla_is_frozen_and_how_to_install_each_runtime(base_env, no_pci):
    text = render_text(collect(base_env, probe=False, pci_root=no_pci, versions=MATCHED))
    assert "torch_xla is frozen: 2.9.0 is its last release" in text and "TorchTPU replaces it" in text
    assert "install TorchTPU: pip install 'xlatrain[tpu]'" in text
    assert "install torch_xla: pip install 'xlatrain[xla]' in an environment of its own" in text


def test_a_hung_probe_is_killed_at_the_timeout(tmp_path):
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\necho 'XLATRAIN_PROBE {\"stage\": \"torch\", \"cuda_devices\": []}'\nexec sleep 30\n")
    sleeper.chmod(0o755)
    probe = doctor.run_probe({"PATH": os.environ.get("PATH", "")}, timeout_s=1.0, python=str(sleeper))
    assert probe.timed_out and probe.seconds < 10
    assert list(probe.stages) == ["torch"]  # what was printed before the hang is kept


def test_the_probe_child_gets_tpu_skip_mds_query_only_where_asked(tmp_path):
    # A stand-in interpreter that reports the variable it was started with.
    echo = tmp_path / "python"
    echo.write_text('#!/bin/sh\necho "XLATRAIN_PROBE {\\"stage\\": \\"torch\\", \\"mds\\": \\"${TPU_SKIP_MDS_QUERY-unset}\\"}"\n')
    echo.chmod(0o755)
    env = {"PATH": os.environ.get("PATH", "")}
    asked = doctor.run_probe(env, with_xla=False, python=str(echo), skip_metadata_query=True)
    assert asked.stages["torch"]["mds"] == "1"
    assert doctor.run_probe(env, with_xla=False, python=str(echo)).stages["torch"]["mds"] == "unset"
    kept = doctor.run_probe(dict(env, TPU_SKIP_MDS_QUERY="0"), with_xla=False, python=str(echo),
                            skip_metadata_query=True)
    assert kept.stages["torch"]["mds"] == "0"  # a value the user set is theirs


# ----------------------------------------------------------------- TorchTPU's environment


def test_torch_tpu_on_a_tpu_host_with_vfio_is_usable(base_env, tmp_path):
    root, vfio_root = tpu_host(tmp_path, n=4)
    unprobed = collect(base_env, probe=False, pci_root=root, vfio_root=vfio_root, versions=CURRENT)
    assert unprobed.usable and codes(unprobed, "error") == []
    tpu = runtime(unprobed, "TorchTPU")
    assert tpu.runs_here is None and "4 TPU chip(s) it can see" in tpu.why  # not told without the probe
    registered = torch_tpu_probe(privateuse1="tpu", count=4, warnings=(), baseline_s=None)
    report = collect(base_env, probe=registered, pci_root=root, vfio_root=vfio_root, versions=CURRENT)
    assert codes(report) == [] and report.exit_code(strict=True) == 0
    # The eager mode TorchTPU starts in: Strict by default, with the settings for Fused.
    mode = rows(report)["TorchTPU eager mode"].value
    assert mode.startswith("Strict (DEFER_NEVER)") and "TORCH_TPU_DEFER_AND_FUSE=1" in mode and "'highest'" in mode
    fused = collect(dict(base_env, TORCH_TPU_DEFER_AND_FUSE="1"), probe=registered, pci_root=root,
                    vfio_root=vfio_root, versions=CURRENT)
    assert rows(fused)["TorchTPU eager mode"].value.startswith("Fused (DEFER_AND_FUSE)") and codes(fused) == []
    assert (runtime(report, "TorchTPU").runs_here, runtime(report, "TorchTPU").why) == (
        True, "4 TPU device(s) registered at import torch")
    assert rows(report)["TorchTPU device"].value == "tpu registered, 4 device(s) (torch.accelerator)"
    assert rows(report)["torch_tpu autoload"].status == "ok"


def test_a_tpu_torch_tpu_did_not_register_is_an_error(base_env, tmp_path):
    root, vfio_root = tpu_host(tmp_path, n=4)
    report = collect(base_env, probe=torch_tpu_probe(warnings=(), baseline_s=None), pci_root=root,
                     vfio_root=vfio_root, versions=CURRENT)
    assert codes(report, "error") == ["torch_tpu:not-registered"]
    assert "PrivateUse1 is still 'privateuseone'" in finding(report, "torch_tpu:not-registered").evidence
    assert runtime(report, "TorchTPU").runs_here is False


def test_tpu_chips_without_a_vfio_group_are_invisible_to_torch_tpu(base_env, tmp_path):
    root, vfio_root = tpu_host(tmp_path, n=4, vfio=False)
    report = collect(base_env, probe=False, pci_root=root, vfio_root=vfio_root, versions=CURRENT)
    assert codes(report, "error") == ["torch_tpu:no-vfio"]
    assert (runtime(report, "TorchTPU").runs_here, runtime(report, "TorchTPU").why) == (
        False, "its TPU chip(s) have no /dev/vfio group")
    assert "0 of 4 with a /dev/vfio group" in rows(report)["TPU"].value
    # One chip's node missing: torch_tpu runs on the other three, and says so.
    root, vfio_root = tpu_host(tmp_path / "partial", n=4)
    (vfio_root / "11").unlink()
    partial = collect(base_env, probe=False, pci_root=root, vfio_root=vfio_root, versions=CURRENT)
    assert codes(partial, "error") == [] and "torch_tpu:no-vfio" in codes(partial, "warning")
    assert "sees 3 of 4 TPU chips" in finding(partial, "torch_tpu:no-vfio").title


def test_a_tpu_generation_torch_tpu_does_not_drive(base_env, tmp_path):
    root, vfio_root = tpu_host(tmp_path, device_id="0x0027", n=4)  # v2/v3
    report = collect(base_env, probe=False, pci_root=root, vfio_root=vfio_root, versions=CURRENT)
    found = finding(report, "torch_tpu:chip-unsupported")
    assert found.severity == "error" and "xlatrain[xla]" in found.fix


def test_autoload_off_on_a_tpu_host_leaves_the_tpu_unregistered(base_env, tmp_path):
    root, vfio_root = tpu_host(tmp_path, n=4)
    env = dict(base_env, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    report = collect(env, probe=False, pci_root=root, vfio_root=vfio_root, versions=CURRENT)
    assert codes(report, "error") == ["torch_tpu:autoload-off"]
    assert rows(report)["torch_tpu autoload"].status == "error"


def test_a_tpu_host_without_libtpu_cannot_start_torch_tpu(base_env, tmp_path):
    root, vfio_root = tpu_host(tmp_path, n=1)
    report = collect(base_env, probe=False, pci_root=root, vfio_root=vfio_root, versions=dict(CURRENT, libtpu=None))
    assert codes(report, "error") == ["tpu-without-libtpu"]
    assert "libtpu>=0.0.50" in finding(report, "tpu-without-libtpu").fix
    assert runtime(report, "TorchTPU").why == "libtpu is not installed"


def test_torch_tpu_with_torch_2_9_breaks_import_torch_while_autoload_is_on(base_env, no_pci):
    versions = dict(MATCHED, torch_tpu="0.2.0")
    report = collect(base_env, probe=False, pci_root=no_pci, versions=versions)
    found = finding(report, "torch_tpu:torch-version")
    assert found.severity == "error" and found.title.startswith("import torch fails")
    assert "Failed to load the backend extension: torch_tpu" in found.evidence
    assert "pip uninstall torch_tpu" in found.fix and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in found.fix
    # torch reads the variable as `== "1"`: "0", and also "true", turn autoload off; import torch works.
    for off in ("0", "true"):
        report = collect(dict(base_env, TORCH_DEVICE_BACKEND_AUTOLOAD=off), probe=False, pci_root=no_pci,
                         versions=versions)
        assert codes(report, "warning") == ["torch_tpu:torch-version"] and report.usable, off
    # The probe confirms the prediction: one finding, with the probe's evidence.
    failed = Probe(stages={}, returncode=1, output_tail="RuntimeError: Failed to load the backend extension: torch_tpu.")
    report = collect(base_env, probe=failed, pci_root=no_pci, versions=versions)
    assert codes(report, "error") == ["torch_tpu:torch-version"]
    assert "the probe's import torch failed: RuntimeError" in finding(report, "torch_tpu:torch-version").evidence


def test_an_unexplained_backend_load_failure_points_at_autoload(base_env, no_pci):
    failed = Probe(stages={}, returncode=1,
                   output_tail="RuntimeError: Failed to load the backend extension: torch_tpu. You can disable ...")
    report = collect(base_env, probe=failed, pci_root=no_pci, versions=CURRENT)
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in finding(report, "torch-import-failed").fix


def test_torch_newer_than_torch_tpu_declares_is_a_warning(base_env, no_pci):
    env = dict(base_env, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    report = collect(env, probe=False, pci_root=no_pci, versions=dict(CURRENT, torch="2.16.0", torchvision="0.31.0"))
    assert codes(report) == ["torch_tpu:torch-version"] and report.usable
    assert "the one built for torch 2.15.0" in finding(report, "torch_tpu:torch-version").evidence


def test_an_old_libtpu_for_torch_tpu_is_a_warning(base_env, no_pci):
    env = dict(base_env, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    report = collect(env, probe=False, pci_root=no_pci, versions=dict(CURRENT, libtpu="0.0.21"))
    assert codes(report) == ["torch_tpu:libtpu-version"] and report.usable


def test_torch_tpu_autoloading_without_a_tpu_costs_every_import(base_env, no_pci):
    report = collect(base_env, probe=torch_tpu_probe(), pci_root=no_pci, versions=CURRENT)
    assert report.usable and codes(report, "error") == []
    assert sorted(codes(report, "warning")) == ["torch_tpu:autoload-without-tpu", "torch_tpu:metadata-query"]
    cost = finding(report, "torch_tpu:autoload-without-tpu")
    assert "measured here: import torch took 5.9 s with torch_tpu, 1.6 s with TORCH_DEVICE_BACKEND_AUTOLOAD=0" \
        in cost.evidence
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in cost.fix
    assert "export TPU_SKIP_MDS_QUERY=1" in finding(report, "torch_tpu:metadata-query").fix
    tpu = runtime(report, "TorchTPU")
    assert (tpu.runs_here, tpu.why) == (False, "no TPU on the PCI bus (torch_tpu has no CPU mode)")
    assert rows(report)["torch_tpu autoload"].status == "warning"
    # TPU_SKIP_MDS_QUERY=1 removes the stall, not the import cost.
    skipped = collect(dict(base_env, TPU_SKIP_MDS_QUERY="1"), probe=torch_tpu_probe(), pci_root=no_pci,
                      versions=CURRENT)
    assert "torch_tpu:metadata-query" not in codes(skipped) and "torch_tpu:autoload-without-tpu" in codes(skipped)
    # Autoload off: torch_tpu stays out of import torch, and none of its findings apply.
    off = collect(dict(base_env, TORCH_DEVICE_BACKEND_AUTOLOAD="0"), probe=False, pci_root=no_pci, versions=CURRENT)
    assert codes(off) == [] and rows(off)["torch_tpu autoload"].status == "ok"


def test_tcmalloc_not_loaded_under_torch_tpu_is_reported_with_the_host_fix(base_env, tmp_path, no_pci):
    skip = dict(base_env, TPU_SKIP_MDS_QUERY="1")
    report = collect(skip, probe=torch_tpu_probe(), pci_root=no_pci, versions=CURRENT)
    found = finding(report, "torch_tpu:tcmalloc")
    assert found.severity == "info"  # no TPU here: a warning at import, no TPU work slowed
    assert "tcmalloc is not loaded; TorchTPU host performance may be degraded" in found.evidence
    assert "LD_PRELOAD=" in found.fix and "libtcmalloc" in found.fix
    loaded = collect(skip, probe=torch_tpu_probe(warnings=()), pci_root=no_pci, versions=CURRENT)
    assert "torch_tpu:tcmalloc" not in codes(loaded)
    # On a TPU host where TorchTPU runs, the same finding is a warning.
    root, vfio_root = tpu_host(tmp_path, n=4)
    on_tpu = collect(base_env, probe=torch_tpu_probe(privateuse1="tpu", count=4, baseline_s=None), pci_root=root,
                     vfio_root=vfio_root, versions=CURRENT)
    assert codes(on_tpu) == ["torch_tpu:tcmalloc"] and codes(on_tpu, "warning") == ["torch_tpu:tcmalloc"]
    # Without a probe the doctor reads LD_PRELOAD, and says that it did not probe.
    static = collect(skip, probe=False, pci_root=no_pci, versions=CURRENT)
    assert "LD_PRELOAD is unset" in finding(static, "torch_tpu:tcmalloc").evidence
    preloaded = collect(dict(skip, LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), probe=False,
                        pci_root=no_pci, versions=CURRENT)
    assert "torch_tpu:tcmalloc" not in codes(preloaded)


# ----------------------------------------------------------------- the command line


def _doctor_args(*argv):
    parser = argparse.ArgumentParser(prog="xlatrain")
    add_doctor_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["doctor", *argv])


def _clean_process_env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PJRT_", "XLA_", "XRT_", "TPU_", "CPU_NUM_DEVICES", "PT_XLA", "XLATRAIN_",
                                "TORCH_DEVICE_BACKEND_AUTOLOAD", "LD_PRELOAD"))}
    env["HOME"] = str(tmp_path)
    # The shell of an environment without xlatrain's start-up hook (.venv has one, see site_hook).
    env["XLATRAIN_SITE_HOOK"] = "0"
    return env


@pytest.fixture
def clean_os_environ(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name not in _clean_process_env(tmp_path):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))


def test_cli_exit_codes_for_usable_and_not_usable(clean_os_environ, monkeypatch, no_pci):
    def run(*argv):
        out = io.StringIO()
        args = _doctor_args("--json", "--no-probe", *argv)  # the parser takes the environment as it is now
        code = args.func(args, out=out, pci_root=no_pci, versions=MATCHED)
        return code, json.loads(out.getvalue())

    code, data = run()
    assert (code, data["usable"], data["exit_code"]) == (0, True, 0)
    monkeypatch.setenv("XLA_USE_BF16", "1")  # a warning: usable, but --strict fails
    assert run()[0] == 0 and run("--strict")[0] == 1
    monkeypatch.setenv("PJRT_DEVICE", "TPU")  # no TPU on this host: an error
    code, data = run()
    assert (code, data["usable"], data["exit_code"]) == (1, False, 1)
    assert "no-device" in [f["code"] for f in data["findings"] if f["severity"] == "error"]


def test_cli_rejects_a_non_positive_timeout():
    args = _doctor_args("--timeout", "0")
    with pytest.raises(ValueError, match=r"--timeout 0 is not valid: give a positive number"):
        args.func(args, out=io.StringIO())


def _xlatrain(argv, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "xlatrain.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_command_exits_2_on_bad_input(tmp_path):
    proc = _xlatrain(["doctor", "--timeout", "0"], _clean_process_env(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "xlatrain: error: --timeout 0 is not valid" in proc.stderr


def test_command_exits_1_when_import_torch_fails(tmp_path):
    # A package named torch ahead of the real one on PYTHONPATH: the probe child imports it and fails.
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    env = dict(_clean_process_env(tmp_path), PYTHONPATH=str(shadow.parent))
    proc = _xlatrain(["doctor", "--json", "--timeout", "60"], env)
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["usable"] is False and data["exit_code"] == 1
    failed = next(f for f in data["findings"] if f["code"] == "torch-import-failed")
    assert "this torch is broken on purpose" in failed["evidence"]
    # What torch_tpu would do at import torch is not guessed once import torch is known to fail.
    assert not [f["code"] for f in data["findings"] if f["code"].startswith("torch_tpu:")]
    assert next(r for r in data["runtimes"] if r["name"] == "CPU")["runs_here"] is False


@pytest.mark.skipif(importlib.util.find_spec("torch_tpu") is None, reason="needs torch_tpu installed (.venv)")
@pytest.mark.skipif(find_tpu_chips() != (), reason="needs a host without a TPU")
def test_command_judges_the_shell_environment_not_its_own(tmp_path):
    # xlatrain's main() turns torch_tpu's autoload off for its own process on a host without a TPU;
    # the doctor must still report that the user's shell has it on.
    proc = _xlatrain(["doctor", "--json", "--no-probe"], _clean_process_env(tmp_path))
    data = json.loads(proc.stdout)
    found = [f["code"] for f in data["findings"]]
    assert "torch_tpu:autoload-without-tpu" in found and "torch_tpu:metadata-query" in found, found
    assert proc.returncode == 0, proc.stderr  # warnings only


# ----------------------------------------------------------------- the real probe


@pytest.mark.skipif(importlib.util.find_spec("torch_tpu") is None, reason="needs torch_tpu installed (.venv)")
@pytest.mark.skipif(find_tpu_chips() != (), reason="needs a host without a TPU")
def test_real_probe_with_torch_tpu_installed_and_no_tpu(tmp_path):
    report = collect(_clean_process_env(tmp_path), probe_timeout_s=240)
    text = render_text(report)
    assert rows(report)["TorchTPU device"].value.startswith("none registered (PrivateUse1 is 'privateuseone'"), text
    assert runtime(report, "TorchTPU").runs_here is False and runtime(report, "CPU").runs_here is True, text
    cost = finding(report, "torch_tpu:autoload-without-tpu").evidence
    assert "measured here: import torch took" in cost and "with TORCH_DEVICE_BACKEND_AUTOLOAD=0" in cost, text
    # LD_PRELOAD is cleared above and this Python does not link tcmalloc: torch_tpu warned.
    assert "the probe's import torch printed torch_tpu's warning" in finding(report, "torch_tpu:tcmalloc").evidence
    assert report.usable, text


@pytest.mark.xla
def test_real_probe_in_a_clean_environment_is_usable(tmp_path):
    report = collect(_clean_process_env(tmp_path), probe_timeout_s=180)
    assert rows(report)["XLA devices"].value.startswith("1 x CPU"), render_text(report)
    assert runtime(report, "torch_xla").runs_here is True, render_text(report)
    assert report.exit_code() == 0, render_text(report)


@pytest.mark.xla
def test_real_probe_measures_what_xla_use_bf16_does(tmp_path):
    env = dict(_clean_process_env(tmp_path), XLA_USE_BF16="1", PJRT_DEVICE="CPU")
    report = collect(env, probe_timeout_s=180)
    found = finding(report, "env:XLA_USE_BF16")
    assert "gave 1.0 " in found.evidence, found.evidence  # bf16 loses the 0.001; float32 keeps it
    assert sys.executable in rows(report)["Python"].value


@pytest.mark.parametrize("python, warned", [("3.11.7", True), ("3.11.9", True), ("3.10.14", True),
                                            ("3.11.10", False), ("3.10.15", False), ("3.12.0", False),
                                            ("3.13.1", False)])
def test_a_python_whose_fork_can_hang_a_loader_worker_is_named_with_the_release_that_fixed_it(
        base_env, no_pci, python, warned):
    report = collect(base_env, probe=False, pci_root=no_pci, versions=dict(MATCHED, python=python))
    assert codes(report) == (["python:fork-hang"] if warned else [])
    assert rows(report)["Python"].status == ("warning" if warned else "ok")
    if warned:
        found = finding(report, "python:fork-hang")
        fixed = "3.11.10" if python.startswith("3.11") else "3.10.15"
        assert f"Python {python} is older than {fixed}" in found.evidence and "gh-112275" in found.evidence
        assert f"use Python {fixed} or newer" in found.fix and report.exit_code() == 0  # a warning


def test_the_doctor_judges_the_python_it_runs_in():
    from xlatrain.doctor.environment import _installed_versions

    assert _installed_versions()["python"] == platform.python_version()
