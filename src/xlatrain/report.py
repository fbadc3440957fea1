"""What a run leaves behind for people: history.csv / history.json, PNG plots, and comparisons.

``write_report(RUN_DIR)`` writes one run's ``report/``; ``write_comparison([RUN_A, RUN_B, ...])``
overlays several runs' curves and tabulates their best metrics and times (``xlatrain report RUN_A
RUN_B``), naming each run by its directory and the config keys where the runs differ.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xlatrain.checkpoint import META_FILE, atomic_write_bytes, atomic_write_text, list_checkpoints
from xlatrain.config import monitor_mode_for
from xlatrain.tree import flatten_keys


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


def _check_out(out: Path) -> None:
    for parent in [out, *out.parents]:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{parent} is a file: give --out a directory for the report (it is created if missing)")
        if parent.exists():
            return


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "history.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no history at {path}: is {run_dir} a run directory? Give the run_dir of an `xlatrain fit` run"
        )
    try:
        rows = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}): it was edited or damaged. Restore it from history.csv or a backup, "
            "or delete it and rerun the run's last epoch (it is rewritten after every epoch)"
        ) from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path} does not hold a list of epoch rows: restore it, or delete it and rerun the run")
    return rows


def plot_loss_curve(run_dir: str | Path, rows: Sequence[dict[str, Any]]) -> Path:
    """``loss.png``: train and validation loss per epoch."""
    return atomic_write_bytes(Path(run_dir) / "loss.png", _figure_png(lambda ax: _draw_loss(ax, rows)))


def _draw_loss(ax: Any, rows: Sequence[dict[str, Any]]) -> None:
    epochs = [r["epoch"] for r in rows]
    ax.plot(epochs, [r["train_loss"] for r in rows], marker="o", label="train")
    if any("val_loss" in r for r in rows):
        ax.plot(epochs, [r.get("val_loss", math.nan) for r in rows], marker="o", label="validation")
    ax.set(xlabel="epoch", ylabel="loss", title="loss per epoch")


def _figure_png(draw: Any, size: tuple[float, float] = (8, 4)) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=size, dpi=100)
    draw(ax)
    if ax.get_xlabel() == "epoch":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no epoch 1.5
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside, not over, the lines
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _monitor(config: dict[str, Any], rows: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """The run's monitored column and its direction: from its config, else the first known column."""
    trainer = config.get("trainer") or {}
    if trainer.get("monitor"):
        mode = trainer.get("monitor_mode") or monitor_mode_for(trainer["monitor"])
        if mode:
            return trainer["monitor"], mode
    for name, mode in (("val_mean_auc", "max"), ("val_accuracy", "max"), ("val_loss", "min")):
        if any(name in r for r in rows):
            return name, mode
    return "train_loss", "min"


def read_run_config(run_dir: str | Path) -> tuple[dict[str, Any], str]:
    """The run's config as nested sections, and where it was read from.

    ``RUN_DIR/config.yaml`` (what ``xlatrain fit`` resolved) over the config recorded in the
    newest checkpoint's ``meta.json`` (what every Trainer run keeps: ``trainer``, ``checkpoint``,
    ``run`` and any ``run_config`` sections). Either may be missing; neither is an empty dict.
    """
    run_dir = Path(run_dir)
    config: dict[str, Any] = {}
    sources = []
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    if checkpoints:
        try:
            recorded = json.loads((checkpoints[-1] / META_FILE).read_text()).get("config") or {}
        except (OSError, ValueError):
            recorded = {}
        recorded.pop("defaults", None)  # the recipe's defaults, kept for comparing a resume with an older checkpoint
        if recorded:
            config = recorded if "trainer" in recorded else {"trainer": recorded}
            sources.append(f"checkpoints/{checkpoints[-1].name}/{META_FILE}")
    path = run_dir / "config.yaml"
    if path.is_file():
        import yaml

        for section, values in (yaml.safe_load(path.read_text()) or {}).items():
            if isinstance(values, dict) and isinstance(config.get(section), dict):
                config[section] = {**config[section], **values}
            else:
                config[section] = values
        sources.append("config.yaml")
    return config, " + ".join(sources) or "none"


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Loss, metric, learning-rate and timing PNGs plus ``summary.md`` for one run.

    Args:
        run_dir: the run's directory (it holds ``history.json``).
        out_dir: where to write; default ``RUN_DIR/report/``.

    Returns:
        The directory written.
    """
    run_dir = Path(run_dir)
    rows = _history(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    _check_out(out)
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
        ax.set(xlabel="epoch", ylabel="learning rate", title="learning rate at the start of each epoch")

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

    monitor, mode = _monitor(read_run_config(run_dir)[0], rows)
    best = _best(rows, monitor, mode)
    lines = [f"# Run report: {run_dir}", ""]
    if best is not None:
        lines += [f"- best epoch: {best['epoch']} of {len(rows)} ({monitor} = {best[monitor]:.4f}, {mode})"]
    last = rows[-1]
    # The learning rate is the epoch's first step's (a schedule moves it within the epoch); it can
    # be far under 1e-4, so it keeps its significant digits.
    lines += ["- last epoch: " + ", ".join(f"lr at the epoch's start {v:.3g}" if k == "lr" else f"{k} {v:.4f}"
                                           for k, v in last.items() if isinstance(v, float))]
    if "xla_compilations" in last:  # each epoch's own count (a resumed run's first epoch compiles again)
        lines += [_compilations_line(rows)]
    diagnostics = run_dir / "diagnostics.json"
    if diagnostics.is_file():
        report = json.loads(diagnostics.read_text())
        findings = report.get("findings", [])
        lines += ["", "## Diagnostics", ""]
        lines += [f"- {f.get('title', f)}: {f.get('fix', '')}" for f in findings] or ["- no findings"]
        lines += _memory_and_throughput(report, last)
    profile = run_dir / "profile" / "summary.json"
    if profile.is_file():
        from xlatrain.diagnostics.profile import render_summary

        text = render_summary(json.loads(profile.read_text()), heading="##", top=5, profile_dir="../profile/")
        lines += ["", text.rstrip("\n"), "", "All of it: [profile/summary.md](../profile/summary.md)"]
    lines += ["", "## Plots", ""] + [f"![{n}]({n})" for n in sorted(plots)] + [""]
    atomic_write_text(out / "summary.md", "\n".join(lines))
    return out


def _compilations_line(rows: list[dict[str, Any]]) -> str:
    """Each epoch's XLA compilations, those of the epochs where a fit started told apart: a fresh
    process compiles its graphs again there (a resumed run's first epoch). A row with ``warmup_s``
    is a fit's first epoch (its first steps were timed apart); the history's first row is one too."""
    counts = [int(row.get("xla_compilations", 0)) for row in rows]
    starts = [i for i, row in enumerate(rows) if i == 0 or "warmup_s" in row]
    began = " and ".join(f"{counts[i]} in epoch {rows[i]['epoch']}" for i in starts)
    where = "where the fit started" if len(starts) == 1 else "where a fit started (the first, or a resumed one)"
    rest = sum(c for i, c in enumerate(counts) if i not in starts)
    others = f"; {rest} in the other epochs" if len(rows) > len(starts) else ""
    return (f"- XLA compilations per epoch: {', '.join(map(str, counts[:20]))}{' ...' if len(counts) > 20 else ''}"
            f" ({began}, {where} and compiled its graphs{others})")


def _memory_and_throughput(report: dict[str, Any], last: dict[str, Any]) -> list[str]:
    """The memory plan, the measured peak and the last epoch's throughput, as diagnostics.json has them."""
    from xlatrain.train.perf import human_bytes, human_flops

    memory, speed = report.get("memory"), report.get("throughput")
    if not memory and not speed:
        return []
    lines = ["", "## Memory and throughput", ""]
    if memory:
        if memory.get("measured_step") is not None:  # the plan the header gave: a measured step, the state beside it
            lines.append(f"- memory per device, planned before the first step: {human_bytes(memory['plan'])} (one "
                         f"forward and backward at batch {memory['batch_per_device']} measured "
                         f"{human_bytes(memory['measured_step'])}, optimizer state {human_bytes(memory['optimizer'])})")
        line = (f"- memory per device, estimated before the first step: {human_bytes(memory['estimate'])} (parameters "
                f"{human_bytes(memory['parameters'])}, gradients {human_bytes(memory['gradients'])}, optimizer state "
                f"{human_bytes(memory['optimizer'])}, activations {human_bytes(memory['activations'])} at batch "
                f"{memory['batch_per_device']}" + (f", gathered weights {human_bytes(memory['gathered'])}" if memory["gathered"] else "")
                + ")")
        if memory.get("capacity"):
            line += f" of {human_bytes(memory['capacity'])} ({memory['capacity_source']})"
        lines.append(line)
        if "measured_peak" in memory:
            lines.append(f"- measured peak: {human_bytes(memory['measured_peak'])} ({memory['measured_peak_source']})")
    if speed and speed.get("flops_per_sample"):
        line = f"- model FLOPs: {human_flops(speed['flops_per_sample'])} per sample ({speed['flops_source']})"
        if speed.get("peak_per_device"):
            line += (f"; device peak {human_flops(speed['peak_per_device'])}/s {speed['dtype']} "
                     f"({speed['peak_source']})")
        lines.append(line)
    rates = [f"{last[k]:,.0f} {unit}" for k, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")) if k in last]
    if "mfu" in last:
        rates.append(f"MFU {100 * last['mfu']:.1f}%")
    if rates:
        lines.append("- last epoch: " + ", ".join(rates))
    return lines


def _history(run_dir: Path) -> list[dict[str, Any]]:
    rows = read_history(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/history.json has no epochs yet: train at least one epoch first")
    return rows


def _best(rows: Sequence[dict[str, Any]], column: str, mode: str) -> dict[str, Any] | None:
    scored = [r for r in rows if isinstance(r.get(column), (int, float)) and not math.isnan(r[column])]
    return (max if mode == "max" else min)(scored, key=lambda r: r[column]) if scored else None


# --- several runs side by side -------------------------------------------------------------

# Keys that differ between any two runs without saying how they differ: the legend names the
# directory already.
_SAME_BY_NATURE = {"trainer.run_dir"}
_MAX_LABEL_KEYS = 3  # differing keys spelled out in a legend entry; the table lists them all
_COMPARE_SIZE = (10, 4.5)  # a little wider than one run's plots: the legend names runs and keys


_MISSING = object()  # a key one run's config lacks: unlike any value, None included


def _show(value: Any) -> str:
    if value is _MISSING:
        return "not recorded"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple, dict)) or value is None:
        return json.dumps(value)
    return str(value)


def _same(a: Any, b: Any) -> bool:
    # YAML turns tuples into lists; a tuple in one record and a list in the other are one value.
    norm = lambda v: json.dumps(v, sort_keys=True, default=str) if v is not _MISSING else v  # noqa: E731
    return norm(a) == norm(b)


def _short_names(run_dirs: Sequence[Path]) -> list[str]:
    """The fewest trailing path parts that tell the runs apart (``lr-0.1``, or ``a/run``, ``b/run``)."""
    parts = [p.resolve().parts for p in run_dirs]
    for n in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-n:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in run_dirs]


def write_comparison(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None) -> Path:
    """Overlay several runs' curves and tabulate their best metrics and times.

    Each run is named in legends and tables by its directory and the config keys where the runs
    differ (its ``config.yaml`` and/or the config recorded in its newest checkpoint, see
    :func:`read_run_config`). Writes ``loss.png`` (train solid, validation dashed), ``metric.png``
    (the first run's monitored metric, when it is not a loss), ``lr.png``, ``epoch_time.png``,
    ``summary.md`` (a table of best metrics and times, and one of the differing keys) and
    ``comparison.json``.

    Args:
        run_dirs: two or more run directories, each holding ``history.json``.
        out_dir: where to write; default ``report/compare/`` inside the first run's directory
            (a later comparison from the same first run replaces it: give ``out_dir`` to keep both).

    Returns:
        The directory written.

    Example:
        >>> write_comparison(["runs/lr-0.1", "runs/lr-0.01"])  # doctest: +SKIP
        PosixPath('runs/lr-0.1/report/compare')
    """
    dirs = [Path(d) for d in run_dirs]
    if len(dirs) < 2:
        raise ValueError(f"a comparison needs two or more run directories, got {len(dirs)}: use write_report for one")
    seen: dict[Path, Path] = {}
    for d in dirs:
        if d.resolve() in seen:
            raise ValueError(f"{d} is given twice (as {seen[d.resolve()]} too): name each run once")
        seen[d.resolve()] = d
    runs = []
    for d, name in zip(dirs, _short_names(dirs)):
        rows = _history(d)
        config, source = read_run_config(d)
        monitor, mode = _monitor(config, rows)
        # Every section opened: an empty one (a recipe's defaults, nothing set) records no key.
        runs.append({"dir": d, "name": name, "rows": rows, "config": flatten_keys(config), "source": source,
                     "monitor": monitor, "mode": mode, "scores": _scores(rows, monitor, mode)})
    keys = sorted({k for r in runs for k in r["config"]} - _SAME_BY_NATURE)
    # A key some runs' configs lack: those ran with whatever default their recipe or code had,
    # which the files do not say, so whether the runs differ in it is not known.
    partly = [k for k in keys if any(k not in r["config"] for r in runs)]
    differing = [k for k in keys if k not in partly and any(not _same(r["config"][k], runs[0]["config"][k])
                                                            for r in runs[1:])]
    for r in runs:
        shown = ", ".join(f"{k}={_show(r['config'].get(k, _MISSING))}" for k in differing[:_MAX_LABEL_KEYS])
        more = "…" if len(differing) > _MAX_LABEL_KEYS else ""
        r["label"] = f"{r['name']} ({shown}{more})" if shown else r["name"]

    out = Path(out_dir) if out_dir is not None else dirs[0] / "report" / "compare"
    _check_out(out)
    plots = _comparison_plots(runs)
    for name, draw in plots.items():
        atomic_write_bytes(out / name, _figure_png(draw, _COMPARE_SIZE))
    table = _comparison_table(runs)
    lines = [f"# Comparison of {len(runs)} runs", ""]
    lines += [f"- {r['name']}: `{r['dir']}` (config from {r['source']})" for r in runs]
    if differing:
        lines += ["", "The runs differ in: " + ", ".join(f"`{k}`" for k in differing) + "."]
    elif not any(r["config"] for r in runs):
        lines += ["", "No run recorded its config (config.yaml or a checkpoint): the runs are named by directory only."]
    else:
        lines += ["", "The keys every run recorded are the same in all (apart from run_dir)."]
    if partly:  # keys come from the recorded configs: none recorded, none here
        lines += ["", "Recorded by only some runs (the others took a default their files do not name, so whether "
                  "they differ is not known): " + ", ".join(f"`{k}`" for k in partly) + "."]
    lines += ["", "## Best metrics and times", "", *table]
    for title, shown in (("Config keys that differ", differing), ("Config keys only some runs recorded", partly)):
        if shown:
            lines += ["", f"## {title}", "", "| key | " + " | ".join(r["name"] for r in runs) + " |",
                      "|---|" + "---|" * len(runs)]
            lines += [f"| `{k}` | " + " | ".join(_show(r["config"].get(k, _MISSING)) for r in runs) + " |" for k in shown]
    lines += ["", "## Plots", ""] + [f"![{n}]({n})" for n in plots] + [""]
    atomic_write_text(out / "summary.md", "\n".join(lines))
    record = {
        "runs": [
            {"dir": str(r["dir"]), "name": r["name"], "label": r["label"], "config_source": r["source"],
             "epochs": len(r["rows"]), "monitor": r["monitor"], "mode": r["mode"], **r["scores"]}
            for r in runs
        ],
        "differing": {k: [r["config"][k] for r in runs] for k in differing},
        # None: the run's config does not record the key
        "recorded_by_some": {k: [None if (v := r["config"].get(k, _MISSING)) is _MISSING else v for r in runs]
                             for k in partly},
        "plots": list(plots),
    }
    atomic_write_text(out / "comparison.json", json.dumps(record, indent=1, default=str) + "\n")
    return out


def _comparison_plots(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def series(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
        return [math.nan if r.get(key) is None else r.get(key, math.nan) for r in rows]

    def curves(ax: Any, key: str, *, style: str = "-", suffix: str = "", only: int | None = None) -> None:
        for i, r in enumerate(runs):
            if (only is None or i == only) and any(key in row for row in r["rows"]):
                ax.plot([row["epoch"] for row in r["rows"]], series(r["rows"], key), style, marker="o",
                        color=f"C{i % 10}", label=r["label"] + suffix)

    def loss(ax: Any) -> None:
        for i, r in enumerate(runs):  # a run's two curves side by side in the legend
            curves(ax, "train_loss", suffix=" · train", only=i)
            curves(ax, "val_loss", style="--", suffix=" · validation", only=i)
        ax.set(xlabel="epoch", ylabel="loss", title="loss per epoch (train solid, validation dashed)")

    plots: dict[str, Any] = {"loss.png": loss}
    monitor, mode = runs[0]["monitor"], runs[0]["mode"]
    if not monitor.endswith("loss"):
        def metric(ax: Any) -> None:
            curves(ax, monitor)
            ax.set(xlabel="epoch", ylabel=monitor, title=f"{monitor} per epoch (monitored, {mode})")

        plots["metric.png"] = metric

    def lr(ax: Any) -> None:
        curves(ax, "lr")
        ax.set(xlabel="epoch", ylabel="learning rate", title="learning rate at the start of each epoch")

    def epoch_time(ax: Any) -> None:
        curves(ax, "epoch_time_s")
        ax.set(xlabel="epoch", ylabel="seconds", title="time per epoch (training and validation)")

    plots["lr.png"] = lr
    plots["epoch_time.png"] = epoch_time
    return plots


def _scores(rows: Sequence[dict[str, Any]], monitor: str, mode: str) -> dict[str, Any]:
    """A run's best monitored value and epoch, best validation loss, last train loss and times."""
    best = _best(rows, monitor, mode)
    best_val = _best(rows, "val_loss", "min")
    times = [(row["epoch"], t) for row in rows if isinstance(t := row.get("epoch_time_s"), (int, float))]
    total = sum(t for _, t in times)
    last_train = rows[-1].get("train_loss")
    return {
        "best_epoch": best["epoch"] if best else None,
        "best": best[monitor] if best else None,
        "best_val_loss": best_val["val_loss"] if best_val else None,
        "best_val_loss_epoch": best_val["epoch"] if best_val else None,
        "last_train_loss": last_train if isinstance(last_train, (int, float)) else None,
        "time_to_best_s": round(sum(t for e, t in times if e <= best["epoch"]), 3) if best else None,
        "total_time_s": round(total, 3),
        "mean_epoch_s": round(total / len(times), 3) if times else None,
    }


def _comparison_table(runs: list[dict[str, Any]]) -> list[str]:
    """Markdown rows: per run, its best monitored value, best validation loss, last train loss, times."""
    same_monitor = len({(r["monitor"], r["mode"]) for r in runs}) == 1
    header = f"best {runs[0]['monitor']} ({runs[0]['mode']})" if same_monitor else "best monitored"
    show_val_loss = any(r["scores"]["best_val_loss"] is not None for r in runs) and not (
        same_monitor and runs[0]["monitor"] == "val_loss")
    cols = ["run", "epochs", header, *(["best val_loss"] if show_val_loss else []), "last train_loss",
            "time to best (s)", "total time (s)", "mean epoch (s)"]
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for r in runs:
        sc = r["scores"]
        best = "-" if sc["best"] is None else f"{sc['best']:.4f} (epoch {sc['best_epoch']})"
        if not same_monitor and sc["best"] is not None:
            best = f"{r['monitor']} {best}"
        cells = [r["label"], str(len(r["rows"])), best]
        if show_val_loss:
            cells.append("-" if sc["best_val_loss"] is None
                         else f"{sc['best_val_loss']:.4f} (epoch {sc['best_val_loss_epoch']})")
        cells += [num(sc["last_train_loss"], ".4f"), num(sc["time_to_best_s"], ".1f"), num(sc["total_time_s"], ".1f"),
                  num(sc["mean_epoch_s"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
