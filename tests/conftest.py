"""Shared test helpers: run a script from tests/scripts in a fresh process and read its history."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def run_command(args: list[str], env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``args`` in a clean environment (no inherited PJRT/XLA settings); fail with its output."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "CPU_NUM_DEVICES", "XLA_"))}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = str(SCRIPTS)
    # XLA runs keep a persistent compilation cache; tests keep theirs out of the user's home.
    full_env.setdefault("XLATRAIN_CACHE_DIR", str(Path(tempfile.gettempdir()) / "xlatrain-test-cache"))
    proc = subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_script(args: list[str], env: dict[str, str] | None = None, timeout: int = 300) -> list[dict]:
    """Run ``args`` (a script path first, or a launcher like torchrun) and return its HISTORY json."""
    proc = run_command(args, env, timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("HISTORY ")]
    assert len(lines) == 1, f"expected one HISTORY line from the main process, got {len(lines)}:\n{proc.stdout}"
    return json.loads(lines[0][len("HISTORY ") :])


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def scripts() -> Path:
    return SCRIPTS
