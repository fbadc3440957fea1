"""``xlatrain pack`` on the command line: argument parsing and the handler.

Kept apart from :mod:`xlatrain.data.pack` so that building the ``xlatrain`` parser imports
nothing heavy; the handler imports the packer when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

_DESCRIPTION = ("``xlatrain pack``: an image folder plus a CSV (or WebDataset tar shards) -> a directory of shards "
                "and a manifest, local or on object storage (gs://).")


def _shard_mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value * 2**20 >= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not a shard size: give megabytes, at least one byte's "
                                         "worth (0.000001), e.g. 128")
    return value


def add_pack_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``xlatrain pack`` on an ``argparse`` subparsers object; its handler returns an exit code."""
    parser = subparsers.add_parser(
        "pack",
        help="pack an image folder + CSV into shards (or --verify a shard directory)",
        description=_DESCRIPTION,
        epilog=(
            "example: xlatrain pack --csv train.csv --images train --out shards "
            "--path-columns StudyInstanceUID SeriesInstanceUID SOPInstanceUID --suffix .jpg "
            "--labels pe_present_on_image '*_pe' --group StudyInstanceUID --workers 4"
        ),
    )
    parser.add_argument("--csv", help="CSV file with one row per image")
    parser.add_argument("--images", help="folder the CSV's image paths are relative to")
    parser.add_argument("--out", help="shard directory to write (an earlier pack of the same inputs there is updated)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--path-columns", nargs="+", metavar="COLUMN", help="columns joined with / into each image path")
    where.add_argument("--path-column", metavar="COLUMN", help="one column holding each image's relative path")
    where.add_argument(
        "--path-template",
        metavar="TEMPLATE",
        help="e.g. '{StudyInstanceUID}/{SeriesInstanceUID}/*{SOPInstanceUID}.jpg' (* or ? allowed in the file name)",
    )
    parser.add_argument("--suffix", default="", help="appended to --path-columns / --path-column, e.g. .jpg")
    parser.add_argument("--labels", nargs="+", default=[], metavar="NAME", help="label columns: names or patterns ('*_pe')")
    parser.add_argument("--group", metavar="COLUMN", help="group key column for leakage-free splits, e.g. StudyInstanceUID")
    parser.add_argument("--max-side", type=int, help="re-encode images larger than this (longer side, pixels)")
    parser.add_argument("--quality", type=int, default=95, help="JPEG quality when re-encoding (default 95)")
    parser.add_argument("--shard-mb", type=_shard_mb, default=128.0, help="target shard size in MB (default 128)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: all cores)")
    parser.add_argument("--webdataset", metavar="SRC",
                        help="convert WebDataset tar shards (a directory or gs:// prefix of .tar files) instead of a CSV")
    parser.add_argument("--verify", metavar="DIR", help="check every checksum and decode every record of DIR, then exit")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument("--replace", action="store_true",
                        help="replace an earlier pack in --out made from other inputs (refused without it)")
    parser.set_defaults(func=run_pack_command)
    return parser


def run_pack_command(args: argparse.Namespace) -> int:
    """The ``xlatrain pack`` handler: 0 on success, 1 when nothing was packed or verify found problems."""
    from xlatrain.data.pack import pack, verify

    if args.verify:
        if "://" not in args.verify and not os.path.isdir(args.verify):
            raise ValueError(f"--verify {args.verify}: no such directory; give the shard directory `xlatrain pack --out` wrote")
        report = verify(args.verify, workers=args.workers, progress=not args.quiet)
        print(report.describe(), file=sys.stderr)
        return 0 if report.ok else 1
    if args.webdataset:
        from xlatrain.data.pack import pack_webdataset

        if not args.out:
            raise ValueError("xlatrain pack --webdataset SRC needs --out (the shard directory or gs:// prefix to write)")
        if args.csv or args.images:
            raise ValueError("--webdataset converts tar shards: leave out --csv and --images (they are for an image folder)")
        summary = pack_webdataset(args.webdataset, args.out, shard_bytes=int(args.shard_mb * 2**20), replace=args.replace)
        print(summary.describe(), file=sys.stderr)
        return 0 if summary.num_records > 0 else 1
    missing = [flag for flag, value in (("--csv", args.csv), ("--images", args.images), ("--out", args.out)) if not value]
    if missing:
        raise ValueError(f"xlatrain pack needs {' '.join(missing)} (or --verify DIR to check a shard directory)")
    if args.path_template:
        where: dict[str, Any] = {"path_template": args.path_template}
    elif args.path_column:
        where = {"path_columns": [args.path_column], "suffix": args.suffix}
    elif args.path_columns:
        where = {"path_columns": args.path_columns, "suffix": args.suffix}
    else:
        raise ValueError("say where each image is: --path-columns A B C (--suffix .jpg), --path-column COL or --path-template")
    labels = [part for item in args.labels for part in item.split(",") if part]
    summary = pack(
        args.csv,
        args.images,
        args.out,
        **where,
        labels=labels,
        group=args.group,
        max_side=args.max_side,
        quality=args.quality,
        shard_bytes=int(args.shard_mb * 2**20),
        workers=args.workers,
        progress=not args.quiet,
        replace=args.replace,
    )
    print(summary.describe(), file=sys.stderr)
    return 0 if summary.num_records > 0 else 1
