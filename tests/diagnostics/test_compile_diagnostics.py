"""CompileWatch on real torch.compile on CPU: graph breaks, recompilations and the recompile limit
planted in tiny models are named with the user's file:line, the guard that failed and a fix.

Dynamo's events are the real ones; the fixtures compile with the "aot_eager" backend (dynamo and
AOTAutograd, no C++ code generation) to stay fast, and one test runs the default inductor.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from xlatrain.diagnostics.compile import CompileWatch

BACKEND = "aot_eager"
HERE = Path(__file__).name


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with no compiled code and no dynamo records, and leaves none behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def line_of(cls: type, text: str) -> int:
    """The line number in this file of the first line of ``cls`` that contains ``text``."""
    lines, first = inspect.getsourcelines(cls)
    return first + next(i for i, line in enumerate(lines) if text in line)


def steps(model: nn.Module, batches: list[int], features: int = 4) -> None:
    """Training steps (forward and backward) with batches of the given sizes."""
    for size in batches:
        model(torch.randn(size, features)).sum().backward()


class PrintsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        print("forward ran")
        return y.relu()


class ReadsItemInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        total = y.sum().item()
        return y * 2 + total


class BranchesOnTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            y = -y
        return y


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.lin(x)).relu()


class Scaled(nn.Module):
    """A linear layer times a plain float attribute: a value dynamo bakes into the graph."""

    def __init__(self, inputs: int = 4, outputs: int = 4, scale: float = 0.5) -> None:
        super().__init__()
        self.lin = nn.Linear(inputs, outputs)
        self.scale = scale

    def forward(self, x):
        return self.lin(x) * self.scale


class Stepped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.k = 0

    def forward(self, x):
        return self.lin(x) * self.k


def describe(y):
    print("describe ran")
    return y


class CallsLibraries(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = describe(self.lin(x))
        tag = json.dumps({"rows": 4})  # dynamo traces into json/, then into torch's own code
        return y * len(tag)


class PrintsInLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        for _ in range(2):
            x = self.lin(x)
            print("layer ran")
        return x


def test_a_print_in_forward_is_one_graph_break_named_with_its_line():
    compiled = torch.compile(PrintsInForward(), backend=BACKEND)
    with CompileWatch() as watch:
        steps(compiled, [8, 8, 8])
        first = watch.end_epoch(1)
        steps(compiled, [8, 8, 8])
        second = watch.end_epoch(2)
    line = line_of(PrintsInForward, "print(")

    (finding,) = watch.findings()  # met by every step, reported once
    assert finding.code == "graph-break"
    assert f"{HERE}:{line} in forward" in finding.title and "print" in finding.title
    assert '`print("forward ran")`' in finding.evidence and "met in 1 compilation(s)" in finding.evidence
    assert "Remove print" in finding.fix
    summary = watch.summary()
    assert (summary["graph_breaks"], summary["graph_break_sites"], summary["graphs"]) == (1, 1, 2)
    assert summary["recompilations"] == 0
    assert first["graph_breaks"] == 1 and first["graphs"] == 2
    assert second == {"compilations": 0, "recompilations": 0, "graphs": 0, "graph_breaks": 0, "compile_s": 0.0}
    # A graph break is a warning; strict mode makes it an error.
    assert f"{HERE}:{line}" in watch.strict_error()
    assert watch.strict_error(graph_breaks=False) is None


def test_item_and_a_branch_on_a_tensor_are_named_with_line_and_fix():
    item = torch.compile(ReadsItemInForward(), backend=BACKEND)
    branch = torch.compile(BranchesOnTensor(), backend=BACKEND)
    with CompileWatch() as watch:
        steps(item, [8, 8])
        steps(branch, [8, 8])
    by_line = {f.title: f for f in watch.findings() if f.code == "graph-break"}
    assert len(by_line) == 2

    item_line = line_of(ReadsItemInForward, ".item()")
    (read,) = [f for t, f in by_line.items() if f"{HERE}:{item_line} in forward" in t]
    assert ".item()" in read.title and "Tensor.item()" in read.evidence
    assert "return the tensor" in read.fix

    branch_line = line_of(BranchesOnTensor, "if y.sum()")
    (jump,) = [f for t, f in by_line.items() if f"{HERE}:{branch_line} in forward" in t]
    assert "`if` on a tensor value" in jump.title and "`if y.sum() > 0:`" in jump.evidence
    assert "torch.cond" in jump.fix and "torch.where" in jump.fix


def test_a_graph_break_names_the_innermost_line_of_user_code():
    compiled = torch.compile(CallsLibraries(), backend=BACKEND)
    with CompileWatch() as watch:
        steps(compiled, [8, 8])
    breaks = [f for f in watch.findings() if f.code == "graph-break"]
    assert len(breaks) == 2
    # In the helper the model calls, not at the call in forward.
    (helper,) = [f for f in breaks if f"{HERE}:{line_of(describe, 'print(')} in describe" in f.title]
    assert "print" in helper.title
    # The stack ends in json/encoder.py and torch/_dynamo/polyfills: the line to change is the call,
    # and the evidence says where inside the library dynamo stopped.
    (library,) = [f for f in breaks if f is not helper]
    assert f"{HERE}:{line_of(CallsLibraries, 'json.dumps')} in forward" in library.title
    assert "encoder.py" not in library.title and "polyfills" not in library.title
    assert f"json{os.sep}encoder.py" in library.evidence and "which this line calls" in library.evidence
    assert "move the call out of forward" in library.fix.lower()


def test_a_graph_break_in_an_installed_librarys_own_code_does_not_tell_the_user_to_edit_it(tmp_path, monkeypatch):
    # A Hugging Face model's loss_function logs inside forward: "Remove print / logging from
    # forward" asked the user to edit transformers.
    package = tmp_path / "site-packages" / "chattylib"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("def loss(y):\n    print('using the default loss')\n    return y.sum()\n")
    monkeypatch.syspath_prepend(str(package.parent))
    import chattylib

    class UsesLibrary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return chattylib.loss(self.lin(x))

    compiled = torch.compile(UsesLibrary(), backend=BACKEND)
    with CompileWatch() as watch:
        for _ in range(2):
            compiled(torch.randn(8, 4)).backward()
    (finding,) = [f for f in watch.findings() if f.code == "graph-break"]
    assert f"chattylib{os.sep}__init__.py:2 in loss" in finding.title and "print" in finding.title
    assert finding.fix.startswith("This line is chattylib's own code, not yours: look for the setting of chattylib")
    assert "Remove print" not in finding.fix  # the user's own forward has no print to remove


def test_a_changing_batch_size_is_a_recompilation_with_the_guard_and_the_sizes():
    compiled = torch.compile(Plain(), backend=BACKEND)
    with CompileWatch() as watch:
        steps(compiled, [16, 16])
        assert watch.end_epoch(1)["recompilations"] == 0
        steps(compiled, [16, 8])  # a ragged last batch in epoch 2
        assert watch.end_epoch(2)["recompilations"] == 1
    forward = line_of(Plain, "def forward")

    (finding,) = watch.findings()
    assert finding.code == "recompilation"
    assert "of forward (" in finding.title and f"{HERE}:{forward})" in finding.title
    assert "tensor 'x' changed shape" in finding.title
    assert "\"tensor 'x' size mismatch at index 0. expected 16, actual 8\" failed" in finding.evidence
    assert "'x' dim 0 16 -> 8" in finding.evidence and "1 after warm-up (epoch 2)" in finding.evidence
    assert "drop_last" in finding.fix and "mark_dynamic" in finding.fix
    assert watch.summary()["recompilations_after_warm_up"] == 1
    error = watch.strict_error(graph_breaks=False)
    assert error is not None and "tensor 'x' changed shape" in error


def test_a_python_attribute_that_changes_is_a_recompilation_naming_it():
    model = Scaled()
    compiled = torch.compile(model, backend=BACKEND)
    with CompileWatch() as watch:
        steps(compiled, [8, 8])
        watch.end_epoch(1)
        model.scale = 0.25  # e.g. a schedule that sets a plain float on the model
        steps(compiled, [8, 8])
    use = line_of(Scaled, "* self.scale")

    (finding,) = watch.findings()
    assert finding.code == "recompilation" and "self.scale changed" in finding.title
    assert "guard 'self.scale == 0.5' failed" in finding.evidence
    assert f"{HERE}:{use} (`return self.lin(x) * self.scale`)" in finding.evidence
    assert "register_buffer" in finding.fix
    assert watch.strict_error() is not None


def test_the_recompile_limit_is_a_finding_of_its_own():
    model = Stepped()
    compiled = torch.compile(model, backend=BACKEND)
    with torch._dynamo.config.patch(recompile_limit=3), CompileWatch() as watch:
        for k in range(5):
            model.k = k
            steps(compiled, [8])
    use = line_of(Stepped, "* self.k")
    forward = line_of(Stepped, "def forward")

    by_code = {f.code: f for f in watch.findings()}
    limit = by_code["recompile-limit"]
    assert "recompile limit (3) on forward (" in limit.title and f"{HERE}:{forward})" in limit.title
    assert "run eagerly" in limit.title
    assert "self.k == 2" in limit.evidence and f"{HERE}:{use}" in limit.evidence
    recompiled = by_code["recompilation"]
    assert "compiled for self.k == 0, 1," in recompiled.evidence and "2 recompilation(s)" in recompiled.title
    assert watch.summary()["recompile_limit_hits"] == 1
    assert "recompile limit" in watch.strict_error(graph_breaks=False)


def test_a_graph_break_in_a_loop_makes_dynamo_skip_the_function():
    compiled = torch.compile(PrintsInLoop(), backend=BACKEND)
    with CompileWatch() as watch:
        steps(compiled, [8, 8])
    (finding,) = watch.findings()
    assert finding.code == "compile-skipped" and "it runs eagerly" in finding.title
    assert "skipped forward (" in finding.title and f"{HERE}:{line_of(PrintsInLoop, 'def forward')})" in finding.title
    assert f"{HERE}:{line_of(PrintsInLoop, 'print(')}" in finding.evidence and "loop" in finding.evidence


def test_a_clean_model_with_evaluation_gives_no_finding():
    model = Plain()
    train = torch.compile(model, backend=BACKEND)
    evaluate = torch.compile(model, backend=BACKEND)  # compiled separately, as the Trainer does
    with CompileWatch() as watch:
        for epoch in (1, 2, 3):
            model.train()
            steps(train, [8, 8, 8])
            model.eval()
            with torch.no_grad():
                evaluate(torch.randn(8, 4))
            row = watch.end_epoch(epoch)
            assert (row["recompilations"], row["compilations"]) == ((1, 2) if epoch == 1 else (0, 0))

    assert watch.findings() == []
    assert watch.strict_error() is None
    # Evaluation compiles its own version of forward once: a note, not a finding.
    warm_up, evaluation = watch.notes()
    assert warm_up.startswith("torch.compile warm-up: 2 compilation(s)")
    assert "evaluation compiled its own version of 1 function(s)" in evaluation and "epoch 1," in evaluation
    summary = watch.summary()
    assert summary["recompilations"] == summary["recompilations_for_evaluation"] == 1
    assert summary["recompilations_after_warm_up"] == 0
    assert [e["epoch"] for e in summary["events"]] == [1, 1]


def test_evaluation_first_run_after_warm_up_is_not_a_recompilation_to_fix():
    model = Plain()
    compiled = torch.compile(model, backend=BACKEND)
    with CompileWatch() as watch:
        steps(compiled, [8, 8])
        watch.end_epoch(1)
        model.eval()
        with torch.no_grad():
            compiled(torch.randn(8, 4))  # evaluation runs for the first time in epoch 2
        watch.end_epoch(2)
        model.train()
        steps(compiled, [8, 8])
        model.eval()
        with torch.no_grad():
            compiled(torch.randn(8, 4))
    assert watch.findings() == [] and watch.strict_error() is None
    assert "in epoch 2, once each" in watch.notes()[1]


def test_evaluation_compiling_again_after_warm_up_is_a_finding():
    model = Plain()
    compiled = torch.compile(model, backend=BACKEND)
    with CompileWatch() as watch:
        for epoch in (1, 2):
            model.train()
            steps(compiled, [8])
            model.eval()
            with torch.no_grad():
                compiled(torch.randn(8, 4))
            watch.end_epoch(epoch)
            torch._dynamo.reset()  # throws away both compiled versions
    (finding,) = watch.findings()
    assert finding.code == "recompilation" and "grad mode or train/eval mode changed" in finding.title
    assert "GLOBAL_STATE changed: grad_mode" in finding.evidence and "1 after warm-up (epoch 2)" in finding.evidence
    assert "torch._dynamo.reset()" in finding.fix
    assert watch.strict_error() is not None


def test_what_compiled_before_start_is_not_counted():
    compiled = torch.compile(PrintsInForward(), backend=BACKEND)
    steps(compiled, [8])
    with CompileWatch() as watch:
        steps(compiled, [8, 8])
    assert watch.findings() == [] and watch.summary()["graphs"] == 0


def test_compilations_past_dynamos_ring_of_metrics_are_all_counted():
    from torch._dynamo import utils

    ring = utils._compilation_metrics.maxlen
    utils.set_compilation_metrics_limit(2)  # dynamo keeps the last 2 instead of 64
    try:
        model = Stepped()
        compiled = torch.compile(model, backend=BACKEND)
        with CompileWatch() as watch:
            for k in range(6):
                model.k = k
                steps(compiled, [8])
    finally:
        utils.set_compilation_metrics_limit(ring)
    summary = watch.summary()
    assert (summary["compilations"], summary["recompilations"]) == (6, 5)
    assert "compiled for self.k == 0, 1, 2, 3, 4," in watch.findings()[0].evidence
    assert watch.notes()[0].startswith("torch.compile warm-up: 6 compilation(s)")
    assert not any("could not be read" in note for note in watch.notes())


def test_a_dynamo_reset_during_the_run_does_not_stop_the_watch():
    with CompileWatch() as watch:
        steps(torch.compile(Plain(), backend=BACKEND), [8])
        torch._dynamo.reset()  # drops dynamo's callbacks and its list of graph breaks
        steps(torch.compile(PrintsInForward(), backend=BACKEND), [8])
    (finding,) = watch.findings()
    assert finding.code == "graph-break" and f"{HERE}:{line_of(PrintsInForward, 'print(')}" in finding.title
    assert any("torch._dynamo.reset()" in note for note in watch.notes())


def test_collection_runs_no_code_after_warm_up_and_leaves_torch_as_it_was():
    handler = torch._dynamo.callback_handler
    callbacks = list(handler.start_callbacks)
    torch_logger = logging.getLogger("torch")
    logging_before = (torch_logger.level, list(torch_logger.handlers), torch_logger.propagate,
                      dict(torch._logging._internal.log_state.log_qname_to_level))
    compiled = torch.compile(Plain(), backend=BACKEND)

    watch = CompileWatch().start()
    steps(compiled, [8, 8])
    watch.end_epoch(1)
    calls = []
    module = sys.modules[CompileWatch.__module__].__file__

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == module:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        steps(compiled, [8] * 20)
    finally:
        sys.setprofile(None)
    watch.stop()
    watch.stop()  # stopping twice is harmless

    assert calls == []  # the steady state never enters this module
    assert handler.start_callbacks == callbacks
    assert (torch_logger.level, list(torch_logger.handlers), torch_logger.propagate,
            dict(torch._logging._internal.log_state.log_qname_to_level)) == logging_before
    # After stop nothing more is collected.
    steps(compiled, [4])
    assert watch.summary()["recompilations"] == 0


def test_inductor_recompiles_a_built_in_module_on_a_new_batch_size():
    # torch.compile(nn.Sequential) compiles torch's wrapper around the module call: the finding
    # says so rather than pointing at a torch file as the user's line.
    compiled = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with CompileWatch() as watch, torch.no_grad():
        compiled(torch.randn(16, 4))
        compiled(torch.randn(16, 4))
        watch.end_epoch(1)
        compiled(torch.randn(8, 4))
    (finding,) = watch.findings()
    assert finding.code == "recompilation" and "the compiled module (torch's wrapper" in finding.title
    assert "'args[0]' dim 0 16 -> 8" in finding.evidence
    summary = watch.summary()
    assert summary["compile_s"] > 0 and summary["graphs"] == 2 and summary["recompilations_after_warm_up"] == 1
