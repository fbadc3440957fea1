"""Run the benchmarks and record them: ``python -m benchmarks.run [--only NAME ...]``.

Each entry is a ratio measured side by side in one run. Results merge into
``benchmarks/results.json`` (entry name -> figures) and a markdown table beside it. This runs in
the current-torch environment; entries on torch_xla (``xla_loop``, ``compile_cache``) start their
workers under ``$XLATRAIN_XLA_PYTHON``, which ``make bench`` points at ``.venv-xla``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import time
from pathlib import Path

from xlatrain.backend.hardware import settle_libtpu_without_tpu, skip_idle_torch_tpu_autoload

# As xlatrain's command line does, before torch is imported: on a host without a TPU, a dormant
# torch_tpu is not autoloaded, and libtpu does not wait minutes on a cloud metadata server.
skip_idle_torch_tpu_autoload()
settle_libtpu_without_tpu()

from xlatrain.checkpoint import atomic_write_text  # noqa: E402

ENTRIES = ["trainer_overhead", "compiled_step", "input_pipeline", "object_store", "xla_loop", "compile_cache", "fsdp", "lm",
           "startup", "gpu_pipeline", "gpu_lm", "gpu_memory", "gpu_overhead"]


def _markdown(results: dict) -> str:
    lines = ["# Benchmarks", "", "Written by `make bench`; every ratio is measured side by side in one run.", ""]
    lines += ["| entry | ratio / key figure | details |", "|---|---|---|"]
    for name, figures in results.items():
        if name.startswith("_"):
            continue
        key = figures.get("ratio", figures.get("speedup_vs_tutorial", ""))
        details = ", ".join(f"{k}={v}" for k, v in figures.items() if k not in ("ratio",))
        lines.append(f"| {name} | {key} | {details} |")
    meta = results.get("_machine", {})
    lines += ["", f"Machine: {meta}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results.json")
    parser.add_argument("--only", nargs="*", choices=ENTRIES, default=ENTRIES)
    args = parser.parse_args()
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    modules = {name: importlib.import_module(f"benchmarks.{name}") for name in args.only}
    # An entry whose workers need another environment (the XLA ones: torch_xla) says so now,
    # before the others have run for minutes.
    for module in modules.values():
        if hasattr(module, "check_environment"):
            module.check_environment()
    for name, module in modules.items():
        started = time.perf_counter()
        figures = module.run()
        if "skipped" in figures:
            # A CUDA entry on a machine without a GPU: said, and its figures from a GPU run kept.
            print(f"{name}: skipped: {figures['skipped']}", flush=True)
            continue
        figures["seconds"] = round(time.perf_counter() - started, 1)
        results[name] = figures
        print(f"{name}: {json.dumps(figures)}", flush=True)
    import torch

    results["_machine"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": __import__("os").cpu_count(),
        "platform": platform.platform(),
    }
    atomic_write_text(out, json.dumps(results, indent=2) + "\n")
    atomic_write_text(out.with_suffix(".md"), _markdown(results))


if __name__ == "__main__":
    main()
