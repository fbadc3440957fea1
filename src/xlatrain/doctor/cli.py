"""``xlatrain doctor [SCRIPT ...] [--json]``: argument parsing and the handler.

Without a script: the environment report (exit 0 when usable, 1 with the reason when not): which
runtimes (TorchTPU, torch_xla, CUDA, CPU) are installed and can run here, and every known trap.
With scripts (or Jupyter notebooks): the static check of each (exit 0 when nothing worse than an
info was found, 1 otherwise). A file that cannot be checked (missing, a directory, not Python) gets
its error in its place in the report, and exit code 2; the command exits with the worst code of
all the files.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

_EPILOG = """\
exit codes: 0 usable / no problem found; 1 not usable / problems found; 2 bad input.
examples:
  xlatrain doctor                 the environment: runtimes, versions, devices, cache, traps
  xlatrain doctor --json          the same as JSON
  xlatrain doctor train.py        what in train.py breaks or slows down on torch_xla 2.9
  xlatrain doctor a.py nb.ipynb   the same for each file (a notebook's code cells, by cell and line)
"""


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``doctor`` on ``subparsers`` (from ``parser.add_subparsers()``) and return it.

    The handler is set as ``func``: ``args.func(args)`` returns the exit code.
    """
    doctor = subparsers.add_parser(
        "doctor",
        help="check the environment (TorchTPU, torch_xla, CUDA, CPU), or a training script",
        description="Report which runtimes are installed and can run here (TorchTPU, torch_xla, CUDA,\n"
        "CPU), judged against what each needs, the environment behind them (torch, torch_tpu and\n"
        "its autoload, libtpu, TPU chips and their VFIO groups, PJRT device, memory, compilation\n"
        "cache) and every known trap in it; or, given scripts, read them without running them and\n"
        "list removed APIs and slow patterns by line.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument(
        "scripts", nargs="*", metavar="SCRIPT", help="training scripts or .ipynb notebooks to check (read, never run)"
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor.add_argument(
        "--strict", action="store_true", help="environment: warnings also make the exit code non-zero"
    )
    doctor.add_argument(
        "--no-probe",
        action="store_true",
        help="environment: do not import torch / torch_xla in a child process (faster; no device count)",
    )
    doctor.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="environment: how long the torch / torch_xla probe may take before it counts as hung (default: 120)",
    )
    # The environment as the user's shell gave it, taken when the command line is built: xlatrain's
    # main() then turns off torch_tpu's autoload and libtpu's metadata query for its own process
    # (backend.hardware), and the doctor judges what the user's own scripts will see, not that.
    doctor.set_defaults(func=run_doctor, doctor_environ=dict(os.environ))
    return doctor


def run_doctor(
    args: argparse.Namespace,
    out: TextIO | None = None,
    *,
    pci_root: str | os.PathLike[str] | None = None,
    vfio_root: str | os.PathLike[str] | None = None,
    versions: Mapping[str, str | None] | None = None,
) -> int:
    """Handle ``xlatrain doctor``; print the report to ``out`` (stdout) and return the exit code.

    ``pci_root``, ``vfio_root`` and ``versions`` describe another host to ``doctor.collect``
    (default: this one).
    """
    stream = sys.stdout if out is None else out
    if args.scripts:
        from xlatrain.doctor import script_check

        # every file gets its report; one that cannot be checked gets its error in its place
        results: dict[str, tuple[script_check.ScriptFinding, ...] | str] = {}
        for path in args.scripts:
            try:
                results[path] = script_check.check_file(path)
            except ValueError as exc:
                results[path] = str(exc)
        if args.json:
            print(script_check.render_json(results), file=stream)
        else:
            print("\n\n".join(script_check.render_text(p, fs) for p, fs in results.items()), file=stream)
        return max((2 if isinstance(fs, str) else script_check.exit_code(fs) for fs in results.values()), default=0)

    if not args.timeout > 0:
        raise ValueError(f"--timeout {args.timeout:g} is not valid: give a positive number of seconds, e.g. --timeout 120")
    from xlatrain.doctor import environment as doctor

    host: dict[str, Any] = {k: v for k, v in (("pci_root", pci_root), ("vfio_root", vfio_root),
                                               ("versions", versions)) if v is not None}
    report = doctor.collect(
        getattr(args, "doctor_environ", None), probe=not args.no_probe, probe_timeout_s=args.timeout, **host
    )
    render = doctor.render_json if args.json else doctor.render_text
    print(render(report, strict=args.strict), file=stream)
    return report.exit_code(strict=args.strict)
