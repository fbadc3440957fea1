"""An environment's start-up hook that keeps a dormant TorchTPU quiet in every Python process.

With ``torch_tpu`` installed (``pip install 'xlatrain[tpu]'``), ``import torch`` loads it and
libtpu in every process, also on a machine without a TPU: libtpu prints its start-up lines, and
the first ``backward()`` waits for minutes on the cloud metadata server. The ``xlatrain`` command
and ``import xlatrain`` prevent both, but a plain PyTorch script in the same environment does not
import xlatrain. This hook runs at interpreter start (a ``.pth`` file in site-packages, as
site.py processes them) and, only when no TPU chip is on the PCI bus, sets
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (when torch_tpu is the only autoloaded backend) and
``TPU_SKIP_MDS_QUERY=1``; a value the user set is kept. On a TPU VM it changes nothing.
``XLATRAIN_SITE_HOOK=0`` turns it off for a process; ``XLATRAIN_SITE_HOOK_SET`` says what it set.

``python -m xlatrain.site_hook install|remove|status`` (``make`` installs it into ``.venv``). The hook
is a copy of ``xlatrain/backend/hardware.py`` (standard library only) beside the ``.pth`` file,
so it keeps working if xlatrain moves or is uninstalled; ``remove`` deletes both.
"""

from __future__ import annotations

import argparse
import importlib.util
import sysconfig
from pathlib import Path

PTH_FILE = "xlatrain-quiet-tpu.pth"
MODULE = "_xlatrain_quiet_tpu"
# site.py executes a .pth line that starts with "import"; a failing hook must never stop Python.
PTH_LINE = (
    f"import sys; exec('try:\\n import {MODULE}\\n {MODULE}.site_startup()\\nexcept Exception:\\n pass')\n"
)


def site_dir() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def install(target: Path | None = None) -> list[Path]:
    """Write the hook into ``target`` (this environment's site-packages); returns what was written."""
    target = target or site_dir()
    source = Path(__file__).parent / "backend" / "hardware.py"
    module = target / f"{MODULE}.py"
    pth = target / PTH_FILE
    module.write_text(f"# Written by `python -m xlatrain.site_hook install`: a copy of {source.name}.\n"
                      + source.read_text())
    pth.write_text(PTH_LINE)
    return [module, pth]


def remove(target: Path | None = None) -> list[Path]:
    target = target or site_dir()
    removed = []
    for path in (target / PTH_FILE, target / f"{MODULE}.py"):
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed


def wanted() -> bool:
    """True where a TorchTPU or libtpu is installed (elsewhere the hook would have nothing to do)."""
    return any(importlib.util.find_spec(name) is not None for name in ("torch_tpu", "libtpu"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlatrain.site_hook", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("install", "remove", "status"))
    parser.add_argument("--force", action="store_true", help="install even where no TorchTPU/libtpu is installed")
    args = parser.parse_args(argv)
    if args.action == "install":
        if not wanted() and not args.force:
            print(f"nothing to install: neither torch_tpu nor libtpu is installed in {site_dir()}")
            return 0
        for path in install():
            print(f"wrote {path}")
    elif args.action == "remove":
        for path in remove() or ["nothing installed"]:
            print(f"removed {path}" if isinstance(path, Path) else path)
    else:
        present = (site_dir() / PTH_FILE).exists()
        print(f"{'installed' if present else 'not installed'} in {site_dir()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
