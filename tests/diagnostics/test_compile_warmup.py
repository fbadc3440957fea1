"""torch.compile's warm-up as the diagnostics judge it: in the first epoch a clean run compiles each
function's first version per phase (training, evaluation's own) and nothing more once the
Trainer's warm-up steps are done; a version compiled again for a changed value is named for that
value, not for the mode guard dynamo happens to report.

Dynamo's events are the real ones (the "aot_eager" backend, as in test_compile_diagnostics.py);
one test runs a whole compiled fit under ``strict=True``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from test_compile_diagnostics import BACKEND, Scaled, fresh_dynamo  # noqa: F401 (an autouse fixture)
from xlatrain import TrainConfig, Trainer
from xlatrain.diagnostics.compile import CompileWatch
from xlatrain.diagnostics.run import DiagnosticsError


def train_steps(watch: CompileWatch, model: nn.Module, compiled: nn.Module, sizes: list[int],
                warm_up_steps: int = 0) -> None:
    """A training pass as RunDiagnostics reports it to the watch: its first steps are warm-up."""
    model.train()
    for step, size in enumerate(sizes, start=1):
        watch.at("train", step <= warm_up_steps)
        compiled(torch.randn(size, 4)).sum().backward()
    watch.at(None, False)


def evaluate(watch: CompileWatch, model: nn.Module, compiled: nn.Module) -> None:
    model.eval()
    watch.at("eval", False)
    with torch.no_grad():
        compiled(torch.randn(8, 4))
    watch.at(None, False)


def test_a_value_changed_after_the_warm_up_steps_of_epoch_one_is_after_warm_up():
    model = Scaled()
    compiled = torch.compile(model, backend=BACKEND)
    with CompileWatch() as watch:
        train_steps(watch, model, compiled, [8, 8, 8], warm_up_steps=2)
        model.scale = 0.25  # e.g. a callback at step 3 of epoch 1
        train_steps(watch, model, compiled, [8, 8])
        evaluate(watch, model, compiled)  # evaluation's own first version: as a clean run compiles
        watch.end_epoch(1)

    (finding,) = watch.findings()
    assert "self.scale changed" in finding.title
    assert "1 after warm-up (epoch 1)" in finding.evidence and "in warm-up" not in finding.evidence
    error = watch.strict_error(graph_breaks=False)
    assert error is not None and "self.scale changed" in error
    summary = watch.summary()
    assert summary["recompilations_after_warm_up"] == 1 and summary["recompilations_for_evaluation"] == 1
    assert [e["warm_up"] for e in summary["events"]] == [True, False, True]
    assert watch.notes()[0].startswith("torch.compile warm-up: 2 compilation(s)")


def test_a_recompilation_inside_the_warm_up_steps_stays_warm_up():
    # A batch of another size at step 2: a finding (with its fix), not strict mode's error.
    model = Scaled()
    compiled = torch.compile(model, backend=BACKEND)
    with CompileWatch() as watch:
        train_steps(watch, model, compiled, [16, 8, 8], warm_up_steps=2)
        evaluate(watch, model, compiled)
        watch.end_epoch(1)
    (finding,) = watch.findings()
    assert "tensor 'x' changed shape" in finding.title and "1 in warm-up (epoch 1)" in finding.evidence
    assert watch.strict_error(graph_breaks=False) is None
    assert watch.summary()["recompilations_after_warm_up"] == 0


def test_a_value_change_that_recompiles_both_modes_is_one_finding_with_its_true_fix():
    model = Scaled()
    compiled = torch.compile(model, backend=BACKEND)
    with CompileWatch() as watch:
        train_steps(watch, model, compiled, [8, 8], warm_up_steps=2)
        evaluate(watch, model, compiled)
        watch.end_epoch(1)
        model.scale = 0.25  # both versions, training's and evaluation's, compile again
        train_steps(watch, model, compiled, [8, 8])
        evaluate(watch, model, compiled)
        watch.end_epoch(2)

    (finding,) = watch.findings()
    assert finding.title.startswith("2 recompilation(s) of forward") and "self.scale changed" in finding.title
    assert "grad_mode" in finding.evidence and "so this same change compiled them again" in finding.evidence
    assert "register_buffer" in finding.fix
    error = watch.strict_error(graph_breaks=False)
    assert "grad mode" not in error and "torch._dynamo.reset()" not in error
    summary = watch.summary()
    assert summary["recompilations_after_warm_up"] == 2
    assert [e.get("cause") for e in summary["events"][2:]].count("self.scale == 0.5") >= 1


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)  # training mode matters: dynamo guards it

    def forward(self, x):
        return self.drop(self.lin(x))


def test_a_mode_recompilation_without_another_cause_blames_no_reset_that_did_not_happen():
    # A callback that calls the model in training mode under no_grad makes a third version, and
    # dynamo names the grad-mode guard of training's version.
    model = Dropped()
    compiled = torch.compile(model, backend=BACKEND)
    with CompileWatch() as watch:
        train_steps(watch, model, compiled, [8, 8], warm_up_steps=2)
        evaluate(watch, model, compiled)
        watch.end_epoch(1)
        train_steps(watch, model, compiled, [8])
        with torch.no_grad():
            compiled(torch.randn(8, 4))
        watch.end_epoch(2)
    (finding,) = watch.findings()
    assert "grad mode or train/eval mode changed" in finding.title
    assert "GLOBAL_STATE changed: grad_mode" in finding.evidence and "recompiles_verbose" in finding.evidence
    assert "torch._dynamo.reset()" not in finding.fix and "model.train() with gradients" in finding.fix


class ScaleAt:
    """Sets a plain float on the model when the run reaches ``global_step``."""

    def __init__(self, global_step: int) -> None:
        self.global_step = global_step

    def on_interval(self, trainer, values):
        if values["global_step"] == self.global_step:
            trainer.strategy.unwrap(trainer.model).scale = 0.5


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :3].argmax(1))


def test_strict_raises_on_a_recompilation_after_the_warm_up_steps_of_the_first_epoch(tmp_path):
    torch.manual_seed(0)
    trainer = Trainer(Scaled(8, 3, scale=1.0), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.05),
                      config=TrainConfig(compile=True, strict=True, epochs=1, batch_size=16, log_every=5,
                                         num_workers=0, run_dir=str(tmp_path)),
                      accelerator="cpu", callbacks=[ScaleAt(10)])  # step 11 of 20 compiles again
    expected = r"^strict \(torch\.compile\): 1 recompilation\(s\) of forward .*self\.scale changed -> Keep self\.scale"
    with pytest.raises(DiagnosticsError, match=expected):
        trainer.fit(_data(320, 0), _data(48, 1))
