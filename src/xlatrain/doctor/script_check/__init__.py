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
import dataclasses
import io
import json
import re
import tokenize
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

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

__all__ = ["PORT_PREFIX", "SEVERITIES", "ScriptFinding", "check_file", "check_notebook", "check_source", "exit_code",
           "is_port_note", "render_json", "render_text"]


class _Checker(Engine, ApiRules, LoaderRules, EnvRules, StepLoopRules, OrderRules, ClassRules, LrScalingRules,
               RankRules):
    """The engine with every rule family; ``Engine.run`` calls the families' checks in order. A new
    rule family is a module with a mixin class, added here and to ``run``."""


def check_source(source: str, path: str = "<script>") -> tuple[ScriptFinding, ...]:
    """Findings for a script's source text, sorted by line (porting notes included).

    Raises:
        ValueError: the text is not valid Python (the message names the line and the fix).
    """
    return _Checker(_parse(source, path, lambda line: f"{path}:{line}")).run()


def check_notebook(notebook: Mapping[str, Any], path: str = "<notebook>") -> tuple[ScriptFinding, ...]:
    """Findings for a Jupyter notebook's code cells (its JSON, read), each with its ``cell``
    (counting every cell from 1, markdown too) and its ``line`` in that cell. IPython magics
    (``%...``, ``!...``) are not Python and are skipped, as are cells run by a shell magic
    (``%%bash``).

    Raises:
        ValueError: a code cell is not valid Python (the message names the cell and line).
    """
    cells = notebook.get("cells")
    if cells is None:  # nbformat 3 keeps its cells in worksheets
        cells = [c for ws in notebook.get("worksheets", []) for c in ws.get("cells", [])]
    lines: list[str] = []
    where: list[tuple[int, int]] = []  # (cell, line in the cell) of each line of the joined source
    for number, cell in enumerate(cells, 1):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        text = cell.get("source", cell.get("input", ""))
        text = "".join(text) if isinstance(text, list) else str(text)
        first = text.lstrip().split(None, 1)[0] if text.strip() else ""
        if first.startswith("%%") and first not in _PYTHON_CELL_MAGICS:
            continue  # the cell is another language's (%%bash, %%writefile ...)
        for k, line in enumerate(text.splitlines(), 1):
            body = line.lstrip()
            # a magic is not Python: `pass` keeps the lines (and any block around it) in place
            lines.append(line[: len(line) - len(body)] + "pass" if body.startswith(("%", "!")) else line)
            where.append((number, k))

    def label(line: int) -> str:  # line 12 of the joined cells -> "cell 3, line 2"
        return f"cell {where[line - 1][0]}, line {where[line - 1][1]}" if 1 <= line <= len(where) else f"line {line}"

    def relabel(text: str) -> str:  # the lines a message names, too
        return re.sub(r"\bline (\d+)\b", lambda m: label(int(m.group(1))), text)

    findings = _Checker(_parse("\n".join(lines) + "\n", path, lambda line: f"{path}: {label(line)}")).run()
    return tuple(
        dataclasses.replace(f, line=where[f.line - 1][1], cell=where[f.line - 1][0], message=relabel(f.message),
                            fix=relabel(f.fix))
        if 1 <= f.line <= len(where) else f
        for f in findings
    )


def check_file(path: str | Path) -> tuple[ScriptFinding, ...]:
    """Findings for the script or Jupyter notebook at ``path`` (read, never run).

    Raises:
        ValueError: the file cannot be read or is not Python (the message names the fix).
    """
    p = Path(path)
    if p.is_dir():
        scripts = list(p.glob("*.py"))
        hint = f" ({len(scripts)} in it: xlatrain doctor {p / '*.py'})" if scripts else ""
        raise ValueError(f"{p}: is a directory: pass the training script's file{hint}")
    try:
        data = p.read_bytes()
    except FileNotFoundError as exc:
        raise ValueError(f"{p}: no such file: pass the path of a Python training script") from exc
    except OSError as exc:
        raise ValueError(f"{p}: cannot be read ({exc.strerror or exc}): pass a Python script you can read") from exc
    if p.suffix == ".ipynb" or data.lstrip()[:1] == b"{":
        try:
            notebook = json.loads(data)
        except ValueError as exc:
            if p.suffix == ".ipynb":
                raise ValueError(
                    f"{p}: not a Jupyter notebook (not valid JSON: {exc}): pass the notebook as Jupyter saved "
                    "it, or export its code with 'jupyter nbconvert --to script' and pass that"
                ) from exc
        else:
            if isinstance(notebook, dict) and ("cells" in notebook or "worksheets" in notebook):
                return check_notebook(notebook, str(p))
    return check_source(_decode(data, str(p)), str(p))


def _decode(data: bytes, path: str) -> str:
    """The text of a Python file, decoded as Python decodes it: UTF-8, a byte-order mark, or the
    encoding its ``# -*- coding: ... -*-`` line declares."""
    if b"\0" in data:
        raise ValueError(_NUL.format(path=path))
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError) as exc:  # SyntaxError: an unknown encoding declared
        raise ValueError(
            f"{path}: cannot be decoded as Python source ({exc.msg if isinstance(exc, SyntaxError) else exc}): "
            "save it as UTF-8, or declare its encoding on its first line (# -*- coding: latin-1 -*-) as "
            "Python requires"
        ) from exc


_NUL = "{path}: holds NUL bytes, so it is not Python source (a binary or damaged file?): pass the training script's .py file"
# cell magics whose body is still Python
_PYTHON_CELL_MAGICS = ("%%time", "%%timeit", "%%capture", "%%prun", "%%debug")


def _parse(source: str, path: str, at: Callable[[int], str]) -> ast.Module:
    """The module ``source`` holds; a ValueError that names what is wrong and the fix when it is
    not Python (``at(line)`` says where a line is)."""
    try:
        return ast.parse(source, filename=path)
    except (SyntaxError, ValueError) as exc:  # ValueError: NUL bytes, before Python 3.12
        msg = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        line = exc.lineno if isinstance(exc, SyntaxError) else None
        text = (exc.text or "") if isinstance(exc, SyntaxError) else ""
        if "null bytes" in msg:
            raise ValueError(_NUL.format(path=path)) from exc
        where = at(line) if line else path
        if "Missing parentheses in call to" in msg:
            fix = ("this is Python 2 code: the script check reads Python 3 source only; port the script to "
                   "Python 3 first (torch_xla runs on Python 3)")
        elif text.lstrip().startswith(("%", "!")):
            fix = ("an IPython magic is not Python: the script check reads Python source only; pass the "
                   ".ipynb notebook itself, or export it with 'jupyter nbconvert --to script' first")
        else:
            fix = (f"the script check reads Python source only: fix the syntax there (python -m py_compile "
                   f"{path} shows the same error)")
        raise ValueError(f"{where}: not valid Python ({msg}): {fix}") from exc
