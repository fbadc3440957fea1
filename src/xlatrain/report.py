"""What a run leaves behind for people: history.csv / history.json and PNG plots."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xlatrain.checkpoint import atomic_write_bytes, atomic_write_text


def _json_value(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else v


def write_history(run_dir: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    """Rewrite ``history.csv`` (header + one row per epoch) and ``history.json``, atomically."""
    run_dir = Path(run_dir)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k, "") for k in columns})
    atomic_write_text(run_dir / "history.csv", buf.getvalue())
    clean = [{k: _json_value(v) for k, v in row.items()} for row in rows]
    atomic_write_text(run_dir / "history.json", json.dumps(clean, indent=2) + "\n")


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "history.json"
    if not path.is_file():
        raise FileNotFoundError(f"no history at {path}: is {run_dir} a run directory?")
    return json.loads(path.read_text())


def plot_loss_curve(run_dir: str | Path, rows: Sequence[dict[str, Any]]) -> Path:
    """``loss.png``: train and validation loss per epoch."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers or CI
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(epochs, [r["train_loss"] for r in rows], marker="o", label="train")
    if any("val_loss" in r for r in rows):
        ax.plot(epochs, [r.get("val_loss", math.nan) for r in rows], marker="o", label="validation")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.set_title("loss per epoch")
    ax.grid(alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return atomic_write_bytes(Path(run_dir) / "loss.png", buf.getvalue())
