"""What the script check reads: notebooks, files in other encodings, files it cannot check (each
named with its fix), and several files on one command line."""

import argparse
import io
import json
from pathlib import Path

import pytest

from xlatrain.diagnostics.cli import add_doctor_parser
from xlatrain.diagnostics.script_check import check_file, is_port_note, render_text

REMOVED = "import torch_xla.core.xla_model as xm\nn = xm.xrt_world_size()\n"


def _doctor(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="xlatrain")
    add_doctor_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *argv])
    out = io.StringIO()
    return args.func(args, out=out), out.getvalue()


def _notebook(path: Path, *cells: tuple[str, str]) -> Path:
    path.write_text(json.dumps({
        "cells": [{"cell_type": kind, "metadata": {}, "source": text.splitlines(keepends=True)}
                  for kind, text in cells],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
    }))
    return path


def test_a_notebook_is_checked_cell_by_cell_with_its_magics_skipped(tmp_path):
    nb = _notebook(
        tmp_path / "train.ipynb",
        ("markdown", "# TPU training\n"),
        ("code", "%matplotlib inline\n!pip install timm\nimport torch\nimport torch_xla\n"),
        ("code", "%%bash\nls -l | grep x\n"),  # another language's cell
        ("code", "import torch_xla.core.xla_model as xm\nif True:\n    !nvidia-smi\nn = xm.xrt_world_size()\n"
                 "model = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"),
        ("code", "model.to(torch_xla.device())\n"),
    )
    findings = check_file(nb)
    got = {(f.cell, f.line, f.code, f.severity) for f in findings if not is_port_note(f)}
    assert (4, 4, "removed-api", "error") in got and (4, 6, "optimizer-before-move", "error") in got
    move = next(f for f in findings if f.code == "optimizer-before-move")
    assert "(cell 5, line 1)" in move.message  # a line named in a message is named by cell too
    text = render_text(str(nb), findings)
    assert f"{nb}: cell 4, line 4: error [removed-api]" in text
    assert "import torch_xla (cell 2, line 4)" in text  # the porting notes too
    code, out = _doctor("--json", str(nb))
    data = json.loads(out)
    assert code == data["exit_code"] == 1
    assert {(f["cell"], f["line"]) for f in data["scripts"][0]["findings"] if f["code"] == "removed-api"} == {(4, 4)}


def test_a_notebook_cell_that_is_not_python_is_named_by_cell_and_line(tmp_path):
    nb = _notebook(tmp_path / "nb.ipynb", ("code", "import os\n"), ("code", "x = 1\ndef f(:\n"))
    with pytest.raises(ValueError, match=r"nb\.ipynb: cell 2, line 2: not valid Python"):
        check_file(nb)
    (tmp_path / "broken.ipynb").write_text('{"cells": [')
    with pytest.raises(ValueError, match=r"broken\.ipynb: not a Jupyter notebook \(not valid JSON.*nbconvert --to script"):
        check_file(tmp_path / "broken.ipynb")


def test_a_byte_order_mark_and_a_coding_declaration_are_read_as_python_reads_them(tmp_path):
    (tmp_path / "bom.py").write_bytes(b"\xef\xbb\xbf" + REMOVED.encode())
    (tmp_path / "latin1.py").write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\n" + REMOVED.encode())
    assert [(f.line, f.code) for f in check_file(tmp_path / "bom.py") if not is_port_note(f)] == [(2, "removed-api")]
    assert [(f.line, f.code) for f in check_file(tmp_path / "latin1.py") if not is_port_note(f)] == [(4, "removed-api")]
    (tmp_path / "undeclared.py").write_bytes(b"# caf\xe9\n" + REMOVED.encode())
    with pytest.raises(ValueError, match=r"undeclared\.py: cannot be decoded as Python source .*save it as UTF-8, or declare its encoding"):
        check_file(tmp_path / "undeclared.py")


@pytest.mark.parametrize("content, problem, fix", [
    (b"import torch_xla\nprint 'hello'\n", r"t\.py:2: not valid Python", r"Python 2 code: .*port the script to Python 3"),
    (b"import os\x00\n", r"t\.py: holds NUL bytes", r"pass the training script's \.py file"),
    (b"def f(:\n", r"t\.py:1: not valid Python", r"Python source only: fix the syntax .*py_compile"),
])
def test_a_file_that_is_not_python_gets_a_true_message_with_its_fix(tmp_path, content, problem, fix):
    (tmp_path / "t.py").write_bytes(content)
    with pytest.raises(ValueError) as caught:
        check_file(tmp_path / "t.py")
    message = str(caught.value)
    assert __import__("re").search(problem, message) and __import__("re").search(fix, message), message
    assert "None" not in message and "nbconvert" not in message  # not a notebook: no export advice


def test_a_directory_is_named_as_one_with_the_scripts_in_it(tmp_path):
    (tmp_path / "train.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"is a directory: pass the training script's file \(1 in it: xlatrain doctor .*\*\.py\)"):
        check_file(tmp_path)


def test_several_files_are_each_reported_and_one_that_cannot_be_checked_gets_its_error_in_place(tmp_path):
    good = tmp_path / "good.py"
    good.write_text("x = 1\n")
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    code, text = _doctor(str(good), str(bad), str(tmp_path / "gone.py"))
    assert code == 2  # the worst
    assert f"{good}: no known torch_xla pitfalls found" in text
    assert f"{bad}:1: not valid Python" in text and "gone.py: no such file" in text
    code, out = _doctor("--json", str(good), str(bad))
    data = json.loads(out)
    assert code == data["exit_code"] == 2
    first, second = data["scripts"]
    assert first["path"] == str(good) and first["exit_code"] == 0 and "error" not in first
    assert second["exit_code"] == 2 and second["findings"] == [] and "not valid Python" in second["error"]
