"""Command line: parse arguments, then call library code."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from xlatrain.config import ACCELERATORS

DEMO_RUN_DIR = "runs/demo"


def _first_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _demo(args: argparse.Namespace) -> int:
    from xlatrain.recipes.digits import run_demo
    from xlatrain.recipes.run import launch_note, launch_processes, run_dir_for_launch

    run_dir = args.run_dir
    if run_dir is None:  # the default directory is for the default devices; others get their own
        processes = launch_processes()
        run_dir = run_dir_for_launch(DEMO_RUN_DIR, accelerator=args.accelerator, devices=args.devices,
                                     processes=processes)
        if run_dir != DEMO_RUN_DIR and _first_process():
            print(launch_note(run_dir, DEMO_RUN_DIR, accelerator=args.accelerator, devices=args.devices,
                              processes=processes, how_to_name="--run-dir DIR"))
    last = run_demo(run_dir=run_dir, epochs=args.epochs, accelerator=args.accelerator, devices=args.devices,
                    resume=start_over(args))
    if last["val_accuracy"] >= args.min_accuracy:
        return 0
    if _first_process():
        print(f"xlatrain demo: final val_accuracy {last['val_accuracy']:.4f} is below --min-accuracy "
              f"{args.min_accuracy} (more --epochs reach it; --min-accuracy 0 accepts any): exit 1", file=sys.stderr)
    return 1


def _fit(args: argparse.Namespace) -> int:
    from xlatrain.backend.hardware import torch_tpu_cache_env
    from xlatrain.config import load_run_config

    config = load_run_config(args.config, args.set)
    # TorchTPU fixes its compilation-cache settings when it first reads them: set them from the
    # config before torch is imported.
    torch_tpu_cache_env(config.backend.compile_cache)
    from xlatrain.recipes.run import run, with_launch_run_dir

    config, note = with_launch_run_dir(config, args.config, args.set)
    if note and _first_process():
        print(note)

    trainer, history = run(config, resume=start_over(args))
    if trainer.backend.is_main and history:
        best = (trainer.run_dir / "best.safetensors").exists()  # none under save_best=False
        print(f"history: {trainer.run_location}/history.csv"
              + (f"  best weights: {trainer.run_location}/best.safetensors" if best else ""))
    return 0


def _report(args: argparse.Namespace) -> int:
    from xlatrain.report import write_comparison, write_report

    from xlatrain import storage

    # A run on object storage: its files (not its checkpoints) come down to its local copy, the
    # report is made there and, without --out, goes up beside the run (URL/report/).
    remote = {}
    for url in (d for d in args.run_dirs if storage.is_url(d)):
        from xlatrain.storage.remote_run import RemoteRun

        run = remote[url] = RemoteRun(url)
        if not run.pull(files_only=True):
            raise ValueError(f"{url} holds no run files (history.json): give xlatrain report a run directory")
    run_dirs = [str(remote[d].local) if d in remote else d for d in args.run_dirs]
    try:
        if len(run_dirs) == 1:
            out = write_report(run_dirs[0], args.out)
        else:
            out = write_comparison(run_dirs, args.out)
    except FileNotFoundError as exc:  # a path that is not a run directory: user input, not a crash
        raise ValueError(str(exc)) from None
    first = args.run_dirs[0]
    if args.out is None and first in remote:
        local, target = Path(out), f"{first.rstrip('/')}/{Path(out).relative_to(remote[first].local).as_posix()}"
        for f in sorted(p for p in ([local] if local.is_file() else local.rglob("*")) if p.is_file()):
            storage.upload(f, f"{target}/{f.relative_to(local).as_posix()}" if local.is_dir() else target)
        out = target
    print(f"wrote {out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from xlatrain import storage
    from xlatrain.checkpoint import CheckpointError, export_weights

    source, upload = args.source, None
    if storage.is_url(source):
        # A run on object storage: its newest complete checkpoint comes down to the run's local
        # copy, and without --out the weights go up beside the run.
        from xlatrain.storage.remote_run import RemoteRun

        run = RemoteRun(source)
        run.pull()
        if not run.complete_checkpoints():
            raise ValueError(f"{source} holds no complete checkpoint: give xlatrain export a run directory URL "
                             "(gs://BUCKET/RUN), or a local run directory or checkpoint")
        source, upload = str(run.local), None if args.out else f"{args.source.rstrip('/')}/model.safetensors"
    try:
        used, out = export_weights(source, args.out)
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None
    if upload is not None:
        storage.upload(out, upload)
        out = upload
    print(f"wrote {out} (the model's weights from {used}; load them with xlatrain.load_weights(model, path))")
    return 0


def add_start_over(parser: argparse.ArgumentParser) -> Any:
    """``--fresh`` and ``--overwrite``, either of them: a run directory whose run is done (or was
    made with other settings) is otherwise resumed; what ``start_over`` turns into ``resume``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--fresh", action="store_true", help="start over in a new run directory (this one is kept)")
    group.add_argument("--overwrite", action="store_true",
                       help="start over in this run directory, deleting the earlier run's files in it")
    return group


def start_over(args: argparse.Namespace) -> bool | str:
    """``Trainer.fit``'s ``resume`` for ``--fresh`` / ``--overwrite`` / ``--resume PATH`` / none of them."""
    return False if args.fresh else ("overwrite" if args.overwrite else (getattr(args, "resume", None) or "auto"))


def _fraction(text: str) -> float:
    """An accuracy to reach, 0 to 1: refused before training, not after it, where no run could reach it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: give an accuracy from 0 to 1, e.g. 0.95") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not an accuracy from 0 to 1 (0.95 is 95%)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xlatrain", description=__doc__,
        epilog="--debug (anywhere on the line), or XLATRAIN_DEBUG=1, shows the traceback behind an error message.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small CNN on the bundled digits data")
    demo.add_argument(
        "--run-dir", default=None,
        help=f"output directory (default: {DEMO_RUN_DIR} on the default devices; with --accelerator or --devices, "
        f"or under torchrun, {DEMO_RUN_DIR}-ACCELERATOR[-DEVICES], e.g. {DEMO_RUN_DIR}-xla-4)",
    )
    demo.add_argument("--epochs", type=int, default=12)
    demo.add_argument("--accelerator", default="auto", choices=ACCELERATORS)
    demo.add_argument("--devices", type=int, default=None)
    demo.add_argument(
        "--min-accuracy", type=_fraction, default=0.95, help="exit non-zero below this final val accuracy (0 to 1)"
    )
    add_start_over(demo)
    demo.set_defaults(func=_demo)

    fit = sub.add_parser(
        "fit",
        help="train a recipe from a YAML config",
        description="Train from CONFIG.yaml: sections recipe, data, model, optimizer, schedule, trainer, "
        "backend, checkpoint (see configs/). The resolved config is written to RUN_DIR/config.yaml. "
        "RUN_DIR is the config's trainer.run_dir; where --set changes backend.accelerator or backend.devices, "
        "or torchrun starts several processes, it is RUN_DIR-ACCELERATOR[-DEVICES] (e.g. runs/lm-xla-4), "
        "unless --set trainer.run_dir names one.",
    )
    fit.add_argument("config", help="YAML file, e.g. configs/pe_detection.yaml")
    fit.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one key, e.g. --set trainer.epochs=3 --set backend.accelerator=xla (repeatable)",
    )
    group = add_start_over(fit)
    group.add_argument("--resume", metavar="PATH", help="continue from this checkpoint, or from a run directory's newest")
    fit.set_defaults(func=_fit)

    from xlatrain.data.pack_cli import add_pack_parser
    from xlatrain.doctor.cli import add_doctor_parser

    add_doctor_parser(sub)
    add_pack_parser(sub)

    report = sub.add_parser(
        "report",
        help="plots and a markdown summary of a run directory, or of several side by side",
        description="One RUN_DIR: its loss, metric, learning-rate and timing plots and summary.md in "
        "RUN_DIR/report/. Several: their curves overlaid on shared axes, each run named by its "
        "directory and the config keys where the runs differ, with a table of best metrics and "
        "times, in FIRST_RUN_DIR/report/compare/ (or --out).",
    )
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each holds history.json)")
    report.add_argument(
        "--out", metavar="DIR", default=None,
        help="write here instead (default: RUN_DIR/report/, or FIRST_RUN_DIR/report/compare/ for several runs)",
    )
    report.set_defaults(func=_report)

    export = sub.add_parser(
        "export",
        help="the model's whole weights from a run's checkpoint (sharded or not), for inference",
        description="Write the weights of RUN_DIR's newest checkpoint that verifies (or of the checkpoint "
        "directory given) to one safetensors file: the parts of a sharded (FSDP) checkpoint are put together "
        "on this host. xlatrain.load_weights(model, FILE) loads it.",
    )
    export.add_argument("source", metavar="RUN_DIR", help="a run directory, or RUN_DIR/checkpoints/step-NNNNNNNN")
    export.add_argument("--out", metavar="FILE", default=None, help="default: RUN_DIR/model.safetensors")
    export.set_defaults(func=_export)
    return parser


# Errors that say what went wrong and how to fix it: printed as a message, without a traceback
# (--debug, or XLATRAIN_DEBUG=1, shows it). Exit status 2: the input must change; 1: the run failed.
USER_ERRORS = {
    "ValueError": 2, "RunDirError": 2, "BackendUnavailableError": 2, "CheckpointError": 1,
    "NonFiniteLossError": 1, "DiagnosticsError": 1, "StorageError": 1, "StorageInputError": 2,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    return run_command(lambda _: args.func(args), argv)


def run_command(command: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> int:
    """``command(argv)`` (``argv`` without ``--debug``) run as ``xlatrain``'s commands run: its
    messages on the console, and an error that says what to fix (:data:`USER_ERRORS`) printed as
    one ``xlatrain: error:`` line and returned as the exit status, without a traceback (``--debug``,
    or XLATRAIN_DEBUG=1, shows it). ``python -m xlatrain.recipes.pe_detection.demo`` runs so too."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("XLATRAIN_DEBUG", "") not in ("", "0")
    from xlatrain.backend.hardware import settle_libtpu_without_tpu, skip_idle_torch_tpu_autoload
    from xlatrain.logs import install_console_handler

    # Before torch is imported: both are read when torch / libtpu start.
    skip_idle_torch_tpu_autoload()
    settle_libtpu_without_tpu()
    install_console_handler()
    try:
        return int(command([a for a in argv if a != "--debug"]))
    except Exception as exc:
        code = next((c for cls in type(exc).__mro__ for name, c in USER_ERRORS.items() if cls.__name__ == name), None)
        if code is None or debug:
            raise
        print(f"xlatrain: error: {exc}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
