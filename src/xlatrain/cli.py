"""Command line: parse arguments, then call library code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from xlatrain.config import ACCELERATORS


def _demo(args: argparse.Namespace) -> int:
    from xlatrain.recipes.digits import run_demo

    last = run_demo(
        run_dir=args.run_dir, epochs=args.epochs, accelerator=args.accelerator, devices=args.devices
    )
    return 0 if last["val_accuracy"] >= args.min_accuracy else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlatrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small CNN on the bundled digits data")
    demo.add_argument("--run-dir", default="runs/demo", help="output directory (default: runs/demo)")
    demo.add_argument("--epochs", type=int, default=12)
    demo.add_argument("--accelerator", default="auto", choices=ACCELERATORS)
    demo.add_argument("--devices", type=int, default=None)
    demo.add_argument(
        "--min-accuracy", type=float, default=0.95, help="exit non-zero below this final val accuracy"
    )
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:  # bad user input: the message already says what to change
        print(f"xlatrain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
