"""The TPU runtime choice, from what each runtime found (passed in), and on this host for real."""

import subprocess
import sys

import pytest

from xlatrain import BackendUnavailableError, select_backend
from xlatrain.backend.runtimes import TpuRuntimes, choose

NOTHING = TpuRuntimes(tpu_chips=0, torch_tpu_version=None, torch_tpu_devices=0, torch_tpu_autoload_off=False,
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
