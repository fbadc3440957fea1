"""A plain PyTorch script in the project's environment, without xlatrain, on a machine without a TPU:
no stall at the first backward and no TorchTPU/libtpu output (the environment's start-up hook)."""

import importlib.util
import os
import subprocess
import sys
import time

import pytest

from xlatrain import site_hook
from xlatrain.backend.hardware import quiet_dormant_tpu

PLAIN = """
import sys, torch
x = torch.randn(3, requires_grad=True)
(x * 2).sum().backward()
print("DONE", "torch_tpu" in sys.modules, x.grad.tolist())
"""


def _clean_env():
    """This process's environment without anything xlatrain or the tests set for TPUs."""
    drop = ("TORCH_DEVICE_BACKEND_AUTOLOAD", "TPU_SKIP_MDS_QUERY", "PJRT_DEVICE")
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.mark.skipif(importlib.util.find_spec("torch_tpu") is None, reason="no torch_tpu in this environment")
def test_a_plain_torch_script_in_this_environment_neither_stalls_nor_prints_tpu_lines():
    assert (site_hook.site_dir() / site_hook.PTH_FILE).is_file(), "make installs the hook into .venv"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", PLAIN], capture_output=True, text=True, timeout=120,
                          env=_clean_env(), stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DONE False [2.0, 2.0, 2.0]" in proc.stdout  # torch_tpu never loaded
    # Without the hook: libtpu's lines on stderr and a first backward still waiting after 60 s.
    assert not [ln for ln in proc.stderr.splitlines() if "tpu" in ln.lower()], proc.stderr[-2000:]
    assert took < 30, took


def test_the_hook_acts_only_where_no_tpu_chip_is_on_the_bus(tmp_path):
    tpu = tmp_path / "pci" / "0000:00:05.0"
    tpu.mkdir(parents=True)
    (tpu / "vendor").write_text("0x1ae0\n")
    (tpu / "device").write_text("0x0063\n")  # v5e
    env: dict[str, str] = {}
    quiet_dormant_tpu(env, pci_root=tmp_path / "pci")
    assert env == {}  # a TPU VM: TorchTPU loads as before
    if importlib.util.find_spec("torch_tpu") is not None:
        quiet_dormant_tpu(env, pci_root=tmp_path / "none")
        assert env == {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TPU_SKIP_MDS_QUERY": "1"}
        kept = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}
        quiet_dormant_tpu(kept, pci_root=tmp_path / "none")
        assert kept["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "1"  # what the user set is kept


def test_install_writes_a_hook_that_runs_at_interpreter_start_and_remove_deletes_it(tmp_path):
    written = site_hook.install(tmp_path)
    assert sorted(p.name for p in written) == sorted([site_hook.PTH_FILE, f"{site_hook.MODULE}.py"])
    program = ("import site, os, sys; site.addsitedir(sys.argv[1]); "
               "print('AUTOLOAD', os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD'), "
               f"'{site_hook.MODULE}' in sys.modules)")
    proc = subprocess.run([sys.executable, "-S", "-c", program, str(tmp_path)], capture_output=True, text=True,
                          env=_clean_env(), timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split()[-1] == "True", proc.stdout  # the hook module ran at start-up
    # A hook whose module is gone must not stop Python.
    (tmp_path / f"{site_hook.MODULE}.py").unlink()
    proc = subprocess.run([sys.executable, "-S", "-c", program, str(tmp_path)], capture_output=True, text=True,
                          env=_clean_env(), timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    site_hook.install(tmp_path)
    assert {p.name for p in site_hook.remove(tmp_path)} == {site_hook.PTH_FILE, f"{site_hook.MODULE}.py"}
    assert list(tmp_path.iterdir()) == []
