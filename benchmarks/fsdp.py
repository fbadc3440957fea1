"""FSDP in the Trainer against a hand-written ``fully_shard`` loop, and what FSDP saves in memory.

Runs ``benchmarks/_fsdp_worker.py`` under torchrun with 2 CPU processes (one compute thread each):
the Trainer with ``strategy="fsdp"``, the hand-written FSDP2 loop and a second copy of it (A/A
control), epoch by epoch in rotating order, ``PAIRS`` repetitions per round; a round's ratio is
the median of its repetitions'. ``memory_ratio``: the bytes of parameters, gradients and AdamW
state one process holds under FSDP over what it holds under DDP, same model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("_fsdp_worker.py")


def run() -> dict[str, Any]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--standalone", str(WORKER)],
        capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL,
        env={**__import__("os").environ, "PYTHONPATH": str(WORKER.parent.parent)},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the fsdp benchmark failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    figures = json.loads(lines[0][len("RESULT "):])
    rounds = figures["ratio_per_round"]
    figures.update({
        "device": "cpu (gloo), 2 processes x 1 thread",
        "target": "memory_ratio <= 0.55; ratio (Trainer-FSDP / hand-written fully_shard step time) "
                  "<= 1.05 median and <= 1.10 in every round",
        "target_met": figures["memory_ratio"] <= 0.55 and figures["ratio"] <= 1.05 and max(rounds) <= 1.10,
    })
    return figures
