"""``make pe-demo``: train the PE recipe on generated data and compare it with the prior baseline.

    python -m xlatrain.recipes.pe_detection.demo [CONFIG.yaml] [--set key=value ...] [--fresh | --overwrite] [--debug]

It runs as ``xlatrain fit`` does (:func:`xlatrain.cli.run_command`): its progress (generating and
packing the data, then the epochs) on the console, and bad input as one ``xlatrain: error:`` line
with exit status 2 instead of a traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from xlatrain.cli import add_start_over, start_over
from xlatrain.config import load_run_config
from xlatrain.recipes.pe_detection.recipe import baseline
from xlatrain.recipes.run import run, with_launch_run_dir


def main(argv: list[str] | None = None) -> int:
    """The demo; bad input raises (``python -m`` says it in one line, as ``xlatrain`` does)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="configs/pe_detection.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    add_start_over(parser)
    args = parser.parse_args(argv)
    config, note = with_launch_run_dir(load_run_config(args.config, args.set), args.config, args.set)
    if note and os.environ.get("RANK", "0") == "0":
        print(note)
    trainer, history = run(config, resume=start_over(args))
    if not trainer.backend.is_main:
        return 0
    prior = baseline(config)
    # The epoch whose weights are in best.safetensors (the config monitors the weighted log loss).
    monitor = trainer.monitor
    pick = min if trainer.monitor_mode == "min" else max
    best = pick(history, key=lambda r: r[monitor])
    # A label whose validation rows are all of one class has no AUC: the mean is over the others.
    aucs = [v for k, v in best.items() if k.startswith("val_auc_")]
    defined = sum(not math.isnan(v) for v in aucs)
    over = f" (mean of the {defined} of {len(aucs)} labels with both classes in this fold)" if defined < len(aucs) else ""
    print(
        f"\nvalidation (fold {config.data.get('fold', 0)}), best epoch {best['epoch']}:\n"
        f"  mean AUC           model {best['val_mean_auc']:.4f}   prior baseline {prior['mean_auc']:.4f}{over}\n"
        f"  weighted log loss  model {best['val_weighted_log_loss']:.4f}   prior baseline {prior['weighted_log_loss']:.4f}"
    )
    beats = best["val_mean_auc"] > prior["mean_auc"] + 0.05 and best["val_weighted_log_loss"] < prior["weighted_log_loss"]
    print("  -> beats the prior baseline" if beats else "  -> does NOT beat the prior baseline")
    return 0 if beats else 1


if __name__ == "__main__":
    from xlatrain.cli import run_command

    sys.exit(run_command(main))
