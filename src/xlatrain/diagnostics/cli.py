"""``xlatrain doctor [SCRIPT ...] [--json]``: argument parsing and the handler.

Without a script: the environment report (exit 0 when usable, 1 with the reason when not).
With scripts: the static check of each (exit 0 when nothing worse than an info was found, 1
otherwise). An unreadable or unparsable script raises ``ValueError``, which ``xlatrain``'s
``main`` turns into exit code 2 with the message.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

_EPILOG = """\
exit codes: 0 usable / no problem found; 1 not usable / problems found; 2 bad input.
examples:
  xlatrain doctor                 the environment: versions, devices, cache, traps
  xlatrain doctor --json          the same as JSON
  xlatrain doctor train.py        what in train.py breaks or slows down on torch_xla 2.9
"""


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``doctor`` on ``subparsers`` (from ``parser.add_subparsers()``) and return it.

    The handler is set as ``func``: ``args.func(args)`` returns the exit code.
    """
    doctor = subparsers.add_parser(
        "doctor",
        help="check the environment, or a training script, for torch_xla traps",
        description="Report the training environment (Python, torch, torch_xla, PJRT device, TPU,\n"
        "CUDA, memory, compilation cache) and every known trap in it; or, given scripts, read\n"
        "them without running them and list removed APIs and slow patterns by line.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("scripts", nargs="*", metavar="SCRIPT", help="training scripts to check (read, never run)")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor.add_argument(
        "--strict", action="store_true", help="environment: warnings also make the exit code non-zero"
    )
    doctor.add_argument(
        "--no-probe",
        action="store_true",
        help="environment: do not start torch / torch_xla in a child process (faster; no device count)",
    )
    doctor.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="environment: how long the torch_xla probe may take before it counts as hung (default: 120)",
    )
    doctor.set_defaults(func=run_doctor)
    return doctor


def run_doctor(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Handle ``xlatrain doctor``; print the report to ``out`` (stdout) and return the exit code."""
    stream = sys.stdout if out is None else out
    if args.scripts:
        from xlatrain.diagnostics import script_check

        results = {path: script_check.check_file(path) for path in args.scripts}
        if args.json:
            print(script_check.render_json(results), file=stream)
        else:
            print("\n\n".join(script_check.render_text(p, fs) for p, fs in results.items()), file=stream)
        return max((script_check.exit_code(fs) for fs in results.values()), default=0)

    if not args.timeout > 0:
        raise ValueError(f"--timeout {args.timeout:g} is not valid: give a positive number of seconds, e.g. --timeout 120")
    from xlatrain.diagnostics import doctor

    report = doctor.collect(probe=not args.no_probe, probe_timeout_s=args.timeout)
    render = doctor.render_json if args.json else doctor.render_text
    print(render(report, strict=args.strict), file=stream)
    return report.exit_code(strict=args.strict)
