"""Write a lock file from an environment: ``python tools/freeze_lock.py PYTHON OUT``.

A lock holds ``name==version`` lines only, so it installs from any checkout path: the project
itself, editable installs and packages installed from a path or URL are never written. Anything
that is not a plain registry release is an error that names it, and OUT is left as it was.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+$")
PROJECT = "xlatrain"


def lock_lines(freeze_output: str) -> list[str]:
    """The ``name==version`` lines of ``pip freeze`` output, the project left out; raise on the rest."""
    keep, bad = [], []
    for line in freeze_output.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.lower().replace("_", "-").startswith(PROJECT + "=="):
            continue
        (keep if PIN.match(line) else bad).append(line)
    if bad:
        raise SystemExit(
            "cannot lock packages that are not registry releases (a path, URL or editable install): "
            + "; ".join(bad) + ". Install them from the package registry and run make lock again."
        )
    return sorted(keep, key=str.lower)


def main() -> None:
    python, out = sys.argv[1], Path(sys.argv[2])
    frozen = subprocess.run(
        [python, "-m", "pip", "freeze", "--all", "--exclude", "pip", "--exclude", PROJECT],
        check=True, capture_output=True, text=True,
    ).stdout
    lines = lock_lines(frozen)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)
    print(f"wrote {out}: {len(lines)} packages")


if __name__ == "__main__":
    main()
