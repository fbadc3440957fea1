"""``xlatrain doctor SCRIPT.py``: read a training script (never run it) and list, line by line,
what will break or slow it down on torch_xla 2.9, with the fix, and what each torch_xla call
becomes on TorchTPU and under xlatrain.

Severities are promises:

- ``error``: the script will certainly fail, or certainly compute something other than what it
  says, on torch_xla 2.9 (a removed API, ``xmp.spawn(nprocs=8)``, iterating a ``ParallelLoader``).
- ``warning``: the script certainly runs slower than it has to (a host read every step, a ragged
  training batch that compiles its own graphs).
- ``info``: everything else, including what the check could not tell. Infos never change the
  exit code; the porting notes (codes ``port:*``) are infos too.

What a name holds is read from the code: the assignment that reaches the use in its scope
(``para_loader = pl.ParallelLoader(...)``), or, for a function parameter, the arguments at every
call site of that function in the file. Import aliases are resolved the same way (``import
torch_xla.core.xla_model as xm`` makes ``xm.get_ordinal`` the removed
``torch_xla.core.xla_model.get_ordinal``). When the code does not say (a parameter of a function
called from another file, a value read from the command line), the check says nothing or writes
an info that names what it could not tell; what a name merely suggests (``train_loader``,
``num_cores``) only ever picks between infos.

Which calls are removed and which only deprecated was read from torch_xla 2.9.0 itself
(``core/xla_model.py``: ``xrt_world_size`` and ``get_ordinal`` are gone, ``xla_device`` and
``mark_step`` carry ``@deprecated``; ``_internal/pjrt.py``: ``spawn`` raises for ``nprocs`` other
than 1 or None, and refuses to start once the parent process has started the runtime). The
TorchTPU names in the porting notes were read from the torch_tpu 0.2.0 wheel.

Example:
    >>> from xlatrain.doctor.script_check import check_source
    >>> src = "import torch_xla.core.xla_model as xm\\nn = xm.xrt_world_size()\\n"
    >>> [(f.line, f.code, f.severity) for f in check_source(src) if not f.code.startswith("port:")]
    [(2, 'removed-api', 'error')]
"""

from __future__ import annotations

import ast
from pathlib import Path

from xlatrain.doctor.script_check.api import ApiRules
from xlatrain.doctor.script_check.classes import ClassRules
from xlatrain.doctor.script_check.common import (
    PORT_PREFIX,
    SEVERITIES,
    ScriptFinding,
    exit_code,
    is_port_note,
    render_json,
    render_text,
)
from xlatrain.doctor.script_check.engine import Engine
from xlatrain.doctor.script_check.env import EnvRules
from xlatrain.doctor.script_check.loaders import LoaderRules
from xlatrain.doctor.script_check.lr_scaling import LrScalingRules
from xlatrain.doctor.script_check.ordering import OrderRules
from xlatrain.doctor.script_check.ranks import RankRules
from xlatrain.doctor.script_check.step_loops import StepLoopRules

__all__ = ["PORT_PREFIX", "SEVERITIES", "ScriptFinding", "check_file", "check_source", "exit_code", "is_port_note",
           "render_json", "render_text"]


class _Checker(Engine, ApiRules, LoaderRules, EnvRules, StepLoopRules, OrderRules, ClassRules, LrScalingRules,
               RankRules):
    """The engine with every rule family; ``Engine.run`` calls the families' checks in order. A new
    rule family is a module with a mixin class, added here and to ``run``."""


def check_source(source: str, path: str = "<script>") -> tuple[ScriptFinding, ...]:
    """Findings for a script's source text, sorted by line (porting notes included).

    Raises:
        ValueError: the text is not valid Python (the message names the line).
    """
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise ValueError(
            f"{path}:{exc.lineno}: not valid Python ({exc.msg}): the script check reads Python "
            "source only; export a notebook with 'jupyter nbconvert --to script' first"
        ) from exc
    return _Checker(tree).run()


def check_file(path: str | Path) -> tuple[ScriptFinding, ...]:
    """Findings for the script at ``path`` (read, never run)."""
    p = Path(path)
    try:
        source = p.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ValueError(f"{p}: no such file: pass the path of a Python training script") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: cannot be read as UTF-8 text ({exc}): pass a Python source file") from exc
    return check_source(source, str(p))
