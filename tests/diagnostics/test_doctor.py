import argparse
import io
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from xlatrain.diagnostics import doctor
from xlatrain.diagnostics.cli import add_doctor_parser
from xlatrain.backend.hardware import default_cache_dir, find_tpu_chips
from xlatrain.diagnostics.doctor import Probe, collect, render_json, render_text

MATCHED = {"torch": "2.9.0", "torchvision": "0.24.0", "torch_xla": "2.9.0", "torch_tpu": None, "libtpu": None,
           "libtpu-nightly": None}
CLEAN_PROBE = Probe(
    stages={
        "torch": {"version": "2.9.0", "cuda_build": "12.8", "cuda_devices": []},
        "import": {"version": "2.9.0", "device_type": "CPU"},
        "runtime": {"device_type": "CPU", "devices": 1, "addressable": 1, "f32_check": 1.0010000467300415},
    },
    returncode=0,
    pjrt_device="CPU",
)


@pytest.fixture
def base_env(tmp_path):
    """A clean environment: a home of its own and nothing XLA-related set."""
    return {"HOME": str(tmp_path / "home"), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


@pytest.fixture
def no_pci(tmp_path):
    root = tmp_path / "pci"
    root.mkdir()
    return root


def fake_pci(root: Path, devices: list[tuple[str, str, str]]) -> Path:
    for i, (vendor, device, subsystem) in enumerate(devices):
        d = root / f"0000:00:{i:02x}.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
        (d / "subsystem_device").write_text(subsystem + "\n")
    return root


def codes(report, severity=None):
    return [f.code for f in report.findings if severity is None or f.severity == severity]


def test_clean_environment_is_usable_with_exit_0(base_env, no_pci):
    report = collect(base_env, probe=CLEAN_PROBE, pci_root=no_pci, versions=MATCHED)
    assert report.usable and report.exit_code() == 0 and report.exit_code(strict=True) == 0
    assert codes(report) == []
    rows = {r.name: r for r in report.rows}
    for name in ("Python", "torch", "torch_xla", "torch_tpu", "libtpu", "TPU", "PJRT device", "CUDA",
                 "XLA devices", "Host memory", "CPU cores", "Compile cache"):
        assert name in rows, name
    assert rows["torch_xla"].value == "2.9.0 (matches torch 2.9.0)"
    assert rows["XLA devices"].value.startswith("1 x CPU")
    assert rows["PJRT device"].value.startswith("CPU (PJRT_DEVICE unset")
    assert str(default_cache_dir(base_env)) in rows["Compile cache"].value
    assert "Result: usable" in render_text(report)


def test_xla_use_bf16_and_xrt_tpu_config_are_each_named_with_their_fix(base_env, no_pci):
    env = dict(base_env, XLA_USE_BF16="1", XRT_TPU_CONFIG="localservice;0;localhost:51011")
    report = collect(env, probe=False, pci_root=no_pci, versions=MATCHED)
    found = {f.code: f for f in report.findings}
    bf16, xrt = found["env:XLA_USE_BF16"], found["env:XRT_TPU_CONFIG"]
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
    found = {f.code: f for f in report.findings}
    for name in names:
        finding = found[f"env:{name}"]
        assert finding.evidence.startswith(f"{name}='1': ") and finding.fix


def test_torch_xla_from_another_release_than_torch_is_not_usable(base_env, no_pci):
    versions = dict(MATCHED, torch="2.8.0")
    report = collect(base_env, probe=False, pci_root=no_pci, versions=versions)
    (finding,) = [f for f in report.findings if f.code == "version-mismatch:torch_xla"]
    assert finding.severity == "error" and "torch 2.9.x" in finding.evidence and "torch==2.9.*" in finding.fix
    assert report.exit_code() == 1
    assert "NOT usable" in render_text(report) and "does not run with torch 2.8.0" in render_text(report)


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


def test_a_tpu_without_torch_xla_or_libtpu_is_an_error(base_env, tmp_path):
    root = fake_pci(tmp_path / "pci", [("0x1ae0", "0x006f", "0x0000")] * 2)
    report = collect(base_env, probe=False, pci_root=root, versions=dict(MATCHED, torch_xla=None))
    assert "tpu-without-torch-xla" in codes(report, "error")
    rows = {r.name: r.value for r in report.rows}
    assert rows["TPU"].startswith("2 chip(s), v6e (2 XLA devices)")
    if doctor._bundled_libtpu() is None:  # a torch_xla wheel with libtpu inside would satisfy it
        report = collect(base_env, probe=False, pci_root=root, versions=MATCHED)
        assert "tpu-without-libtpu" in codes(report, "error")


def test_default_cache_dir_is_the_env_override_or_under_home():
    assert default_cache_dir({"HOME": "/home/ana"}) == Path("/home/ana/.cache/xlatrain/xla")
    assert default_cache_dir({"HOME": "/home/ana", "XLATRAIN_CACHE_DIR": "/scratch/xla"}) == Path("/scratch/xla")
    assert default_cache_dir({"HOME": "/home/ana", "XLATRAIN_CACHE_DIR": "  "}) == Path("/home/ana/.cache/xlatrain/xla")


def test_cache_row_counts_entries(base_env, no_pci):
    cache = default_cache_dir(base_env)
    cache.mkdir(parents=True)
    (cache / "a").write_bytes(b"x" * 2048)
    report = collect(base_env, probe=False, pci_root=no_pci, versions=MATCHED)
    row = next(r for r in report.rows if r.name == "Compile cache")
    assert "1 entries" in row.value


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_read_only_cache_is_a_warning(base_env, no_pci):
    cache = default_cache_dir(base_env)
    cache.mkdir(parents=True)
    cache.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        report = collect(base_env, probe=False, pci_root=no_pci, versions=MATCHED)
    finally:
        cache.chmod(stat.S_IRWXU)
    assert "cache-not-writable" in codes(report, "warning")


def test_probe_outcomes_are_judged(base_env, no_pci):
    def judged(probe, **env):
        return collect(dict(base_env, **env), probe=probe, pci_root=no_pci, versions=MATCHED)

    hung = Probe(stages={"torch": CLEAN_PROBE.stages["torch"]}, timed_out=True, timeout_s=5, pjrt_device="CPU")
    assert "probe-timeout" in codes(judged(hung), "error")
    no_runtime = Probe(stages={k: CLEAN_PROBE.stages[k] for k in ("torch", "import")}, returncode=1,
                       output_tail="RuntimeError: Unknown device", pjrt_device="CPU")
    report = judged(no_runtime)
    assert "runtime-failed" in codes(report, "error")
    assert "RuntimeError: Unknown device" in next(f.evidence for f in report.findings if f.code == "runtime-failed")
    no_import = Probe(stages={"torch": CLEAN_PROBE.stages["torch"]}, returncode=1, output_tail="ImportError: x")
    assert "xla-import-failed" in codes(judged(no_import), "error")
    zero = Probe(stages=dict(CLEAN_PROBE.stages, runtime={"device_type": "CPU", "devices": 0}), returncode=0)
    assert "no-device" in codes(judged(zero), "error")
    # a device that rounds float32 to bf16: the measurement joins the env finding that explains it
    bf16 = Probe(stages=dict(CLEAN_PROBE.stages, runtime=dict(CLEAN_PROBE.stages["runtime"], f32_check=1.0)))
    report = judged(bf16, XLA_USE_BF16="1")
    evidence = next(f.evidence for f in report.findings if f.code == "env:XLA_USE_BF16")
    assert "measured on this device: float32 1/3*3 + 0.001 gave 1.0" in evidence
    assert "float32-not-float32" in codes(judged(bf16), "warning")  # no env var to blame


def test_non_integer_pt_xla_debug_breaks_the_import(base_env, no_pci):
    report = collect(dict(base_env, PT_XLA_DEBUG="true"), probe=False, pci_root=no_pci, versions=MATCHED)
    assert "env:PT_XLA_DEBUG" in codes(report, "error")


def test_xla_flags_device_count_without_cpu_num_devices(base_env, no_pci):
    env = dict(base_env, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    report = collect(env, probe=False, pci_root=no_pci, versions=MATCHED)
    assert codes(report) == ["xla-flags-device-count"]


def test_render_json_parses(base_env, no_pci):
    report = collect(dict(base_env, XLA_USE_BF16="1"), probe=CLEAN_PROBE, pci_root=no_pci, versions=MATCHED)
    data = json.loads(render_json(report))
    assert data["usable"] is True and data["exit_code"] == 0
    assert {r["name"] for r in data["rows"]} >= {"torch", "torch_xla", "XLA devices"}
    (finding,) = data["findings"]
    assert set(finding) == {"code", "severity", "title", "evidence", "fix"}
    assert json.loads(render_json(report, strict=True))["exit_code"] == 1


def test_a_hung_probe_is_killed_at_the_timeout(tmp_path):
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\necho 'XLATRAIN_PROBE {\"stage\": \"torch\", \"cuda_devices\": []}'\nexec sleep 30\n")
    sleeper.chmod(0o755)
    probe = doctor.run_probe({"PATH": os.environ.get("PATH", "")}, timeout_s=1.0, python=str(sleeper))
    assert probe.timed_out and probe.seconds < 10
    assert list(probe.stages) == ["torch"]  # what was printed before the hang is kept


def _doctor_args(*argv):
    parser = argparse.ArgumentParser(prog="xlatrain")
    add_doctor_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["doctor", *argv])


def test_cli_json_without_probe_parses_and_exits_0(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith(("XLA_", "XRT_", "PJRT_", "TPU_", "PT_XLA", "GPU_NUM", "CPU_NUM", "XLATRAIN_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    out = io.StringIO()
    args = _doctor_args("--json", "--no-probe")
    code = args.func(args, out=out)
    data = json.loads(out.getvalue())
    assert code == data["exit_code"]
    if find_tpu_chips() == () and data["usable"]:
        assert code == 0


def test_cli_rejects_a_non_positive_timeout():
    args = _doctor_args("--timeout", "0")
    with pytest.raises(ValueError, match=r"--timeout 0 is not valid: give a positive number"):
        args.func(args, out=io.StringIO())


# ----------------------------------------------------------------- the real probe on XLA:CPU


def _clean_process_env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PJRT_", "XLA_", "XRT_", "TPU_", "CPU_NUM_DEVICES", "PT_XLA", "XLATRAIN_"))}
    env["HOME"] = str(tmp_path)
    return env


@pytest.mark.xla
def test_real_probe_in_a_clean_environment_is_usable(tmp_path):
    report = collect(_clean_process_env(tmp_path), probe_timeout_s=180)
    rows = {r.name: r.value for r in report.rows}
    assert rows["XLA devices"].startswith("1 x CPU"), render_text(report)
    assert report.exit_code() == 0, render_text(report)


@pytest.mark.xla
def test_real_probe_measures_what_xla_use_bf16_does(tmp_path):
    env = dict(_clean_process_env(tmp_path), XLA_USE_BF16="1", PJRT_DEVICE="CPU")
    report = collect(env, probe_timeout_s=180)
    finding = next(f for f in report.findings if f.code == "env:XLA_USE_BF16")
    assert "gave 1.0 " in finding.evidence, finding.evidence  # bf16 loses the 0.001; float32 keeps it
    assert sys.executable in next(r.value for r in report.rows if r.name == "Python")
