"""The TPU runtime choice, from what each runtime found (passed in), and on this host for real."""

import subprocess
import sys

import pytest

from xlatrain import BackendUnavailableError, select_backend
from xlatrain.backend.runtimes import TpuRuntimes, choose

NOTHING = TpuRuntimes(tpu_chips=0, torch_tpu_version=None, torch_tpu_other=None, torch_tpu_devices=0, torch_tpu_autoload_off=False,
                      torch_xla_version=None, pjrt_device=None)


def _found(**kw):
    return TpuRuntimes(**{**NOTHING.__dict__, **kw})


@pytest.mark.parametrize(
    ("found", "requested", "chosen"),
    [
        (_found(tpu_chips=4, torch_tpu_version="0.2.0", torch_tpu_devices=4), "auto", "torch_tpu"),
        # Both installed on a TPU host (two environments side by side): TorchTPU, the successor, wins.
        (_found(tpu_chips=4, torch_tpu_version="0.2.0", torch_tpu_devices=4, torch_xla_version="2.9.0"), "auto", "torch_tpu"),
        (_found(tpu_chips=4, torch_tpu_version="0.2.0", torch_tpu_devices=4, torch_xla_version="2.9.0"), "torch_xla", "torch_xla"),
        (_found(tpu_chips=8, torch_xla_version="2.9.0"), "auto", "torch_xla"),
        (_found(torch_xla_version="2.9.0", pjrt_device="TPU"), "auto", "torch_xla"),
        (_found(torch_tpu_version="0.2.0"), "auto", None),  # installed, dormant: no TPU here
        (_found(torch_xla_version="2.9.0", pjrt_device="CPU"), "auto", None),
        (NOTHING, "auto", None),
    ],
)
def test_the_runtime_follows_what_each_one_found(found, requested, chosen):
    assert choose(found, requested) == chosen


def test_a_forced_runtime_that_cannot_run_names_what_each_found_and_how_to_install():
    found = _found(tpu_chips=4, torch_tpu_version="0.2.0", torch_tpu_autoload_off=True)
    with pytest.raises(BackendUnavailableError) as raised:
        choose(found, "torch_tpu")
    text = str(raised.value)
    assert "TorchTPU (torch_tpu 0.2.0): installed but not loaded (TORCH_DEVICE_BACKEND_AUTOLOAD=0" in text
    assert "torch_xla: not installed" in text and "TPU chips on the PCI bus: 4" in text
    assert "pip install 'xlatrain[tpu]'" in text and "pip install 'xlatrain[xla]'" in text
    with pytest.raises(BackendUnavailableError, match="the torch_xla runtime"):
        choose(_found(torch_tpu_version="0.2.0", torch_tpu_devices=4), "torch_xla")
    with pytest.raises(ValueError, match="tpu_runtime='jax' is not valid"):
        choose(NOTHING, "jax")


PROBE = """
import xlatrain
from xlatrain import BackendUnavailableError, select_backend
assert select_backend("auto").runtime.kind in ("cpu", "cuda")
try:
    select_backend("tpu")
except BackendUnavailableError as exc:
    print("FOUND " + str(exc))
"""


@pytest.mark.parametrize("autoload", ["1", "0"])
def test_on_this_host_auto_takes_the_cpu_and_tpu_names_both_runtimes(autoload):
    """Real probes: torch_tpu is installed here (in .venv) and dormant, no TPU on the bus; loaded
    by torch (autoload on) or kept out (off, as the environment's start-up hook sets it here)."""
    import importlib.util
    import subprocess
    import sys

    from conftest import script_env

    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env=script_env({"TORCH_DEVICE_BACKEND_AUTOLOAD": autoload}))
    text = [ln for ln in proc.stdout.splitlines() if ln.startswith("FOUND ")][0]
    if importlib.util.find_spec("torch_tpu") is not None:
        expected = "installed, no TPU device registered" if autoload == "1" else "installed but not loaded"
        assert f"TorchTPU (torch_tpu " in text and expected in text, text
    else:
        assert "TorchTPU: not installed" in text
    assert "torch_xla" in text and "TPU chips on the PCI bus: 0" in text


def test_the_cli_sets_torch_tpu_cache_variables_before_torch_is_imported(tmp_path):
    """The order matters: TorchTPU fixes its cache settings when it first reads them."""
    program = f"""
import os, sys
seen = {{}}
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "at_torch_import" not in seen:
            seen["at_torch_import"] = {{k: v for k, v in os.environ.items() if k.startswith("TORCH_TPU_")}}
        return None
sys.meta_path.insert(0, Watch())
from xlatrain.cli import main
try:
    main(["fit", "configs/digits.yaml", "--set", "recipe=none_such"])  # fails after torch is imported
except SystemExit:
    pass
print("SEEN", seen.get("at_torch_import"))
"""
    env = {"XLATRAIN_CACHE_DIR": str(tmp_path / "xla"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=env)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("SEEN ")]
    assert line, out.stdout + out.stderr
    assert f"'TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT': '{tmp_path / 'torch_tpu'}'" in line[0]
    assert "'TORCH_TPU_TIER2_COMPILATION_CACHE': 'xlatrain'" in line[0]


# --- TorchTPU told apart from another project's torch_tpu; its eager mode and matmul precision ---

def test_a_torch_tpu_that_is_not_googles_is_never_chosen_and_a_forced_one_is_refused_by_name():
    other = "distribution torch_tpu 1.0, https://github.com/sophgo/tpu-train"
    found = _found(tpu_chips=0, torch_tpu_version="1.0", torch_tpu_devices=1, torch_tpu_other=other)
    assert choose(found, "auto") is None
    with pytest.raises(BackendUnavailableError, match="is not Google's TorchTPU .*sophgo.*Uninstall it"):
        choose(found, "torch_tpu")


def test_the_installed_torch_tpu_is_recognised_as_googles_by_its_metadata_and_a_look_alike_is_not(tmp_path):
    from xlatrain.backend.runtimes import torch_tpu_origin

    assert torch_tpu_origin() is None  # the TorchTPU wheel in this environment
    # Another project's package under the same import name, first on the path.
    (tmp_path / "torch_tpu").mkdir()
    (tmp_path / "torch_tpu" / "__init__.py").write_text("")
    info = tmp_path / "torch_tpu-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_tpu\nVersion: 1.0\n"
                                   "Home-page: https://github.com/sophgo/tpu-train\nAuthor: sophgo\n")
    (info / "top_level.txt").write_text("torch_tpu\n")
    code = ("from xlatrain.backend.runtimes import probe\nfound = probe()\n"
            "print('OTHER', found.torch_tpu_other)\nprint('DESCRIBE', found.describe())")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "OTHER distribution torch_tpu 1.0, https://github.com/sophgo/tpu-train" in out.stdout, out.stderr[-2000:]
    assert "not Google's TorchTPU" in out.stdout


def test_torch_tpu_notes_name_the_eager_mode_and_the_matmul_precision_with_the_setting_to_change():
    from xlatrain.backend.runtimes import torch_tpu_mode_from_env, torch_tpu_notes

    assert torch_tpu_mode_from_env({}) == "DEFER_NEVER"
    assert torch_tpu_mode_from_env({"TORCH_TPU_DEFER_AND_FUSE": "1"}) == "DEFER_AND_FUSE"
    assert torch_tpu_mode_from_env({"TORCH_TPU_DEFER_AND_FUSE": "1", "TORCH_TPU_LAUNCH_BLOCKING": "1"}) == \
        "DEFER_NEVER_AND_LAUNCH_BLOCKING"
    strict, precision = torch_tpu_notes("DEFER_NEVER", "medium")
    assert "Strict" in strict and "torch.tpu.EagerMode.DEFER_AND_FUSE" in strict and "compile=True" in strict
    assert "bfloat16 precision" in precision and "set_float32_matmul_precision('highest')" in precision
    fused = torch_tpu_notes("DEFER_AND_FUSE", "highest")
    assert fused[0] == "TorchTPU eager mode Fused (DEFER_AND_FUSE)" and "bfloat16" not in fused[1]
    assert "unset TORCH_TPU_LAUNCH_BLOCKING" in torch_tpu_notes("DEFER_NEVER_AND_LAUNCH_BLOCKING", None)[0]
    assert len(torch_tpu_notes("DEFER_NEVER", None, compiled=True)) == 1  # compiled: no advice to fuse


def test_the_doctor_names_debug_mode_and_a_look_alike_package():
    from xlatrain.diagnostics.doctor import torch_tpu_findings

    assert torch_tpu_findings({}, installed=True) == []
    (debug,) = torch_tpu_findings({"TORCH_TPU_LAUNCH_BLOCKING": "1"}, installed=True)
    assert debug.severity == "warning" and "unset TORCH_TPU_LAUNCH_BLOCKING" in debug.fix
    (other,) = torch_tpu_findings({}, installed=True, origin="distribution torch_tpu 1.0, https://example.org")
    assert other.severity == "error" and "not Google's TorchTPU" in other.title
    assert torch_tpu_findings({}, installed=False) == []


def test_accelerator_tpu_without_a_chip_says_so_rather_than_to_install_what_is_installed():
    from xlatrain.backend.runtimes import TpuRuntimes, unavailable

    def host(chips, torch_tpu):
        return TpuRuntimes(tpu_chips=chips, torch_tpu_version=torch_tpu, torch_tpu_other=None, torch_tpu_devices=0,
                           torch_tpu_autoload_off=False, torch_xla_version=None, pjrt_device=None)

    said = str(unavailable(host(0, "0.2.0")))  # this machine: TorchTPU installed, no TPU
    assert "No TPU chip was found on this machine's PCI bus: run on a TPU VM" in said and "Install TorchTPU" not in said
    bare = str(unavailable(host(0, None)))
    assert "No TPU chip" in bare and "Install TorchTPU" in bare
    assert "No TPU chip" not in str(unavailable(host(4, None)))
