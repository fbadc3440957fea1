"""The ``xlatrain`` command starts light: ``--help`` and ``doctor`` import no heavy library."""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "torchvision", "torch_xla", "torch_tpu", "safetensors", "simplejpeg", "PIL", "numpy",
         "matplotlib", "yaml")

PROGRAM = """
import json, sys
from xlatrain.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
loaded = sorted({m.split('.')[0] for m in sys.modules} & set(json.loads(HEAVY)))
print("LOADED " + json.dumps(loaded), file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["doctor", "--json"], ["doctor", "--json", "--no-probe"], ["pack", "--help"]])
def test_command_imports_nothing_heavy(argv):
    source = PROGRAM.replace("json.loads(HEAVY)", repr(list(HEAVY)))
    proc = subprocess.run([sys.executable, "-c", source, *argv], capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("LOADED ")]
    assert line, proc.stderr[-2000:]
    assert json.loads(line[-1][len("LOADED "):]) == [], f"xlatrain {' '.join(argv)} imported heavy modules"


def test_import_xlatrain_is_light_until_a_name_is_used():
    source = (
        "import sys, xlatrain\n"
        "assert 'torch' not in sys.modules, 'import xlatrain imported torch'\n"
        "xlatrain.TrainConfig(epochs=1)\n"
        "assert 'torch' not in sys.modules, 'a config imported torch'\n"
        "xlatrain.Trainer\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", source], check=True, timeout=300)


def test_python_m_xlatrain_is_the_xlatrain_command():
    proc = subprocess.run([sys.executable, "-m", "xlatrain", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: xlatrain" in proc.stdout and "demo" in proc.stdout, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "xlatrain", "nope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr
