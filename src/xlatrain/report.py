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
from xlatrain.config import monitor_mode_for


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
    return atomic_write_bytes(Path(run_dir) / "loss.png", _figure_png(lambda ax: _draw_loss(ax, rows)))


def _draw_loss(ax: Any, rows: Sequence[dict[str, Any]]) -> None:
    epochs = [r["epoch"] for r in rows]
    ax.plot(epochs, [r["train_loss"] for r in rows], marker="o", label="train")
    if any("val_loss" in r for r in rows):
        ax.plot(epochs, [r.get("val_loss", math.nan) for r in rows], marker="o", label="validation")
    ax.set(xlabel="epoch", ylabel="loss", title="loss per epoch")


def _figure_png(draw: Any) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    draw(ax)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside, not over, the lines
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _monitor(run_dir: Path, rows: Sequence[dict[str, Any]]) -> tuple[str, str]:
    config = run_dir / "config.yaml"
    if config.is_file():
        import yaml

        trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer", {})
        if trainer.get("monitor"):
            mode = trainer.get("monitor_mode") or monitor_mode_for(trainer["monitor"])
            if mode:
                return trainer["monitor"], mode
    for name, mode in (("val_mean_auc", "max"), ("val_accuracy", "max"), ("val_loss", "min")):
        if any(name in r for r in rows):
            return name, mode
    return "train_loss", "min"


def write_report(run_dir: str | Path) -> Path:
    """``RUN_DIR/report/``: loss, metric, learning-rate and timing PNGs plus ``summary.md``."""
    run_dir = Path(run_dir)
    rows = read_history(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/history.json has no epochs yet: train at least one epoch first")
    out = run_dir / "report"
    epochs = [r["epoch"] for r in rows]

    def series(key: str) -> list[float]:
        return [math.nan if r.get(key) is None else r.get(key, math.nan) for r in rows]

    metric_keys = [k for k in rows[-1] if k.startswith("val_") and k != "val_loss"]

    def metrics(ax: Any) -> None:
        for key in metric_keys:
            ax.plot(epochs, series(key), marker=".", label=key[len("val_") :])
        ax.set(xlabel="epoch", title="validation metrics")

    def lr(ax: Any) -> None:
        ax.plot(epochs, series("lr"), marker="o")
        ax.set(xlabel="epoch", ylabel="learning rate", title="learning rate")

    def timing(ax: Any) -> None:
        ax.plot(epochs, series("epoch_time_s"), marker="o", label="epoch time (s)")
        if any("input_bound_share" in r for r in rows):
            ax.plot(epochs, series("input_bound_share"), marker="o", label="input-bound share")
        ax.set(xlabel="epoch", title="time per epoch")

    plots = {"loss.png": lambda ax: _draw_loss(ax, rows), "lr.png": lr, "timing.png": timing}
    if metric_keys:
        plots["metrics.png"] = metrics
    for name, draw in plots.items():
        atomic_write_bytes(out / name, _figure_png(draw))

    monitor, mode = _monitor(run_dir, rows)
    scored = [r for r in rows if isinstance(r.get(monitor), (int, float)) and not math.isnan(r[monitor])]
    best = (max if mode == "max" else min)(scored, key=lambda r: r[monitor]) if scored else None
    lines = [f"# Run report: {run_dir}", ""]
    if best is not None:
        lines += [f"- best epoch: {best['epoch']} of {len(rows)} ({monitor} = {best[monitor]:.4f}, {mode})"]
    last = rows[-1]
    lines += ["- last epoch: " + ", ".join(f"{k} {v:.4f}" for k, v in last.items() if isinstance(v, float))]
    if "xla_compilations" in last:
        growth = last["xla_compilations"] - rows[0]["xla_compilations"]
        lines += [f"- XLA compilations: {rows[0]['xla_compilations']} in epoch 1, {growth} after it"]
    diagnostics = run_dir / "diagnostics.json"
    if diagnostics.is_file():
        findings = json.loads(diagnostics.read_text()).get("findings", [])
        lines += ["", "## Diagnostics", ""]
        lines += [f"- {f.get('title', f)}: {f.get('fix', '')}" for f in findings] or ["- no findings"]
    lines += ["", "## Plots", ""] + [f"![{n}]({n})" for n in sorted(plots)] + [""]
    atomic_write_text(out / "summary.md", "\n".join(lines))
    return out
