"""Bad input and faults, tried as a new user would, on the command line and in Python.

Each case asserts the exit status (or the error type), that the message names the problem and
what to do, and, where an earlier run directory is in play, that none of its files changed (a
sha256 of every file before and after). Command-line cases run ``xlatrain.cli.main`` in this
process (what the ``xlatrain`` script calls) to stay fast; a few run the real command to check
that no traceback is printed. Runs are tiny and shared between cases.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import xlatrain
from conftest import script_env

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits.yaml")
TINY = ["--set", "trainer.epochs=1", "--set", "data.image_size=16", "--set", "trainer.log_every=1000",
        "--set", "backend.accelerator=cpu"]


# --- helpers ------------------------------------------------------------------------------------

def cli(*argv: str) -> tuple[int, str]:
    """``xlatrain ARGV`` in this process: (exit status, everything it printed)."""
    from xlatrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue()


def fingerprint(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@dataclass
class Case:
    run: Callable[[Path], tuple[Any, str]]  # -> (exit status or error type name, message)
    expect: Any  # exit status (int) or the name of the error type raised
    problem: str  # a regex the message must match: the problem, named
    fix: str  # a regex the message must match: what to do
    keeps: bool = False  # runs against a copy of a finished run, which must not change
    setup: Callable[[Path], None] | None = None  # prepares the copy (damage, extra files) first
    marks: list = field(default_factory=list)


def api(fn: Callable[[Path], Any]) -> Callable[[Path], tuple[str, str]]:
    """A Python-API case: the error type and message ``fn`` raised ("ok" when it did not)."""
    def run(run_dir: Path) -> tuple[str, str]:
        try:
            fn(run_dir)
        except Exception as exc:  # noqa: BLE001 - the case says which type it expects
            notes = "\n".join(getattr(exc, "__notes__", []))
            return type(exc).__name__, f"{exc}\n{notes}"
        return "ok", ""
    return run


def fit_cli(*sets: str, config: str = DIGITS, extra: tuple[str, ...] = ()) -> Callable[[Path], tuple[int, str]]:
    def run(run_dir: Path) -> tuple[int, str]:
        args = ["fit", config, *TINY, "--set", f"trainer.run_dir={run_dir}"]
        for item in sets:
            args += ["--set", item]
        return cli(*args, *extra)
    return run


# --- what the Python-API cases train ----------------------------------------------------------

def data(n: int = 32, classes: int = 3, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, torch.randint(0, classes, (n,), generator=g))


def trainer(run_dir: Path, model: Any = None, loss: Any = None, opt: Any = None, **kw: Any) -> xlatrain.Trainer:
    cfg = {"epochs": 1, "batch_size": 8, "run_dir": str(run_dir), "log_every": 1000, **kw.pop("cfg", {})}
    torch.manual_seed(0)
    return xlatrain.Trainer(
        nn.Linear(4, 3) if model is None else model,
        nn.CrossEntropyLoss() if loss is None else loss,
        functools.partial(torch.optim.SGD, lr=0.1) if opt is None else opt,
        config=xlatrain.TrainConfig(**cfg), backend=kw.pop("backend", "cpu"), **kw,
    )


class Items(Dataset):
    """A dataset whose item ``bad`` is whatever ``make_bad`` returns (or raises)."""

    def __init__(self, bad: int, make_bad: Callable[[int], Any], n: int = 32) -> None:
        self.base, self.bad, self.make_bad, self.n = data(n), bad, make_bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.make_bad(i) if i == self.bad else self.base[i]


def _raise(exc: Exception) -> Any:
    raise exc


def _detached_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, targets).detach()


def _vector_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


class LateBadLabels(Dataset):
    """Valid class indices except one sample late in the order (not in the dry run's first batch)."""

    def __init__(self) -> None:
        self.base = data(32)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> Any:
        x, y = self.base[i]
        return x, (torch.tensor(7) if i == 30 else y)


class MetaNoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x * self.scale)


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return MetaNoReset()


# --- damage to a finished run ---------------------------------------------------------------------

def _truncate_checkpoints(run_dir: Path) -> None:
    for state in run_dir.glob("checkpoints/*/state.safetensors"):
        state.write_bytes(state.read_bytes()[: len(state.read_bytes()) // 2])


def _remove_checkpoints(run_dir: Path) -> None:
    shutil.rmtree(run_dir / "checkpoints")


def _checkpoints_a_file(run_dir: Path) -> None:
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").write_text("not a directory")


def _bad_history(run_dir: Path) -> None:
    (run_dir / "history.json").write_text("{not json")


def _hold_lock(run_dir: Path) -> None:
    from xlatrain.storage import lock as run_lock

    _HELD.append(run_lock.acquire(run_dir))


_HELD: list[Any] = []


# --- the cases ------------------------------------------------------------------------------------

CASES: dict[str, Case] = {
    # config files and keys
    "config file missing": Case(lambda d: cli("fit", str(d / "nope.yaml")), 2, r"config file .*nope\.yaml does not exist",
                                r"give the path of a YAML config"),
    "config is a directory": Case(lambda d: (d.mkdir(parents=True, exist_ok=True), cli("fit", str(d)))[-1], 2,
                                  r"is a directory, not a config file",
                                  r"give the path of a YAML config"),
    "config not YAML": Case(lambda d: (d.mkdir(parents=True, exist_ok=True), (d / "c.yaml").write_text("a: [1, 2"),
                                       cli("fit", str(d / "c.yaml")))[-1], 2, r"not valid YAML", r"c\.yaml"),
    "config top level a list": Case(lambda d: (d.mkdir(parents=True, exist_ok=True), (d / "c.yaml").write_text("- 1\n"),
                                               cli("fit", str(d / "c.yaml")))[-1], 2, r"top level must be a mapping",
                                    r"sections"),
    "unknown section": Case(fit_cli("trainr.epochs=2"), 2, r"trainr", r"valid|sections are"),
    "unknown trainer key": Case(fit_cli("trainer.epoch=2"), 2, r"unknown TrainConfig key\(s\) trainer\.epoch",
                                r"valid keys are .*epochs"),
    "epochs not a number": Case(fit_cli("trainer.epochs=three"), 2, r"trainer\.epochs='three'", r"expected int"),
    "epochs zero": Case(fit_cli("trainer.epochs=0"), 2, r"epochs=0 is not valid", r"integer >= 1"),
    "batch size negative": Case(fit_cli("trainer.batch_size=-4"), 2, r"batch_size=-4 is not valid", r">= 1"),
    "precision unknown": Case(fit_cli("trainer.precision=fp8"), 2, r"precision='fp8' is not valid", r"choose one of"),
    "task unknown": Case(fit_cli("trainer.task=regression"), 2, r"task='regression' is not valid", r"'none'"),
    "monitor without mode": Case(fit_cli("trainer.monitor=val_mae"), 2, r"monitor='val_mae' needs monitor_mode",
                                 r"monitor_mode='max'"),
    "monitor mode unknown": Case(fit_cli("trainer.monitor_mode=up"), 2, r"monitor_mode='up' is not valid", r"'max'"),
    "scheduler interval unknown": Case(fit_cli("trainer.scheduler_interval=batch"), 2,
                                       r"scheduler_interval='batch' is not valid", r"'step'"),
    "nan policy unknown": Case(fit_cli("trainer.nan_policy=retry"), 2, r"nan_policy='retry' is not valid", r"skip_step"),
    "clip zero": Case(fit_cli("trainer.clip_grad_norm=0"), 2, r"clip_grad_norm=0", r"positive number, or None"),
    "log every zero": Case(fit_cli("trainer.log_every=0"), 2, r"log_every=0 is not valid", r">= 1"),
    "workers negative": Case(fit_cli("trainer.num_workers=-1"), 2, r"num_workers=-1 is not valid", r">= 0"),
    "profile steps backwards": Case(fit_cli("trainer.profile_steps=[5,2]"), 2, r"profile_steps=\[5, 2\] is not valid",
                                    r"give the first and last training step"),
    "run dir empty": Case(fit_cli("trainer.run_dir="), 2, r"trainer\.run_dir has no value", r"give one"),
    "accelerator unknown": Case(fit_cli("backend.accelerator=gpu"), 2, r"accelerator='gpu' is not valid",
                                r"'cuda'"),
    "devices zero": Case(fit_cli("backend.devices=0"), 2, r"devices=0 is not valid", r">= 1"),
    "xla mode unknown": Case(fit_cli("backend.xla_mode=threads"), 2, r"xla_mode='threads' is not valid", r"'spmd'"),
    "strategy unknown": Case(fit_cli("backend.strategy=zero3"), 2, r"strategy='zero3' is not valid", r"'fsdp'"),
    "units without fsdp": Case(fit_cli("backend.units=[Block]"), 2, r"units=.*takes effect only with strategy='fsdp'",
                               r"leave units unset"),
    "tpu runtime unknown": Case(fit_cli("backend.tpu_runtime=jax"), 2, r"tpu_runtime='jax' is not valid", r"torch_xla"),
    "every steps zero": Case(fit_cli("checkpoint.every_steps=0"), 2, r"every_steps=0 is not valid", r">= 1"),
    "keep last zero": Case(fit_cli("checkpoint.keep_last=0"), 2, r"keep_last=0 is not valid", r">= 1"),
    "set without equals": Case(lambda d: cli("fit", DIGITS, "--set", "trainer.epochs"), 2, r"trainer\.epochs",
                               r"SECTION\.KEY=VALUE|key=value"),
    "set without section": Case(lambda d: cli("fit", DIGITS, "--set", "epochs=2"), 2, r"epochs",
                                r"SECTION\.KEY=VALUE|section"),
    "epochs a fraction": Case(fit_cli("trainer.epochs=3.5"), 2, r"trainer\.epochs=3\.5", r"expected int"),
    "recipe unknown": Case(fit_cli("recipe=mnist"), 2, r"recipe", r"digits"),
    "optimizer unknown": Case(fit_cli("optimizer.name=lamb"), 2, r"optimizer\.name='lamb'", r"adam"),
    "learning rate negative": Case(fit_cli("optimizer.lr=-1"), 2, r"optimizer\.lr=-1", r"positive"),
    "schedule unknown": Case(fit_cli("schedule.name=linear"), 2, r"schedule\.name='linear'", r"cosine"),
    "val fraction above one": Case(fit_cli("data.val_fraction=1.5"), 2, r"data\.val_fraction=1\.5",
                                   r"between 0 and 1|in \(0, 1\)"),
    "image size zero": Case(fit_cli("data.image_size=0"), 2, r"data\.image_size=0", r">= "),
    "model unknown": Case(fit_cli("model.name=resnet999"), 2, r"resnet999", r"resnet18"),
    "pretrained file missing": Case(fit_cli("model.pretrained=/nonexistent/w.safetensors"), 2,
                                    r"pretrained weights file '/nonexistent/w\.safetensors' does not exist",
                                    r"local \.safetensors"),
    "pretrained true": Case(fit_cli("model.pretrained=true"), 2, r"pretrained", r"local|path"),
    "model width zero": Case(fit_cli("model.width=0"), 2, r"model\.width=0", r">= 1"),
    "cuda absent": Case(fit_cli("backend.accelerator=cuda"), 2, r"no CUDA device", r"'cpu'"),
    "tpu absent": Case(fit_cli("backend.accelerator=tpu"), 2, r"none can run here", r"accelerator='xla'|install"),
    "xla absent": Case(fit_cli("backend.accelerator=xla"), 2, r"needs torch_xla, which is not installed",
                       r"pip install"),
    "several cpu devices without torchrun": Case(fit_cli("backend.devices=2"), 2, r"devices=2 .*2 processes",
                                                  r"torchrun --nproc-per-node 2"),
    "resume and fresh together": Case(lambda d: cli("fit", DIGITS, "--fresh", "--resume", str(d)), 2,
                                      r"not allowed with", r"--fresh|--resume"),
    # run directories
    "run dir is a file": Case(lambda d: (d.parent.mkdir(parents=True, exist_ok=True), d.write_text("x"),
                                         fit_cli()(d))[-1], 2, r"the run directory is a file",
                              r"give trainer\.run_dir .* a directory"),
    "run dir parent is a file": Case(lambda d: (d.parent.mkdir(parents=True, exist_ok=True), d.write_text("x"),
                                                fit_cli()(d / "run"))[-1], 2, r"a parent of the run directory, is a file",
                                     r"give trainer\.run_dir"),
    "resume path missing": Case(fit_cli(extra=("--resume", "/nonexistent/run")), 2, r"no such file or directory",
                                r"checkpoint .*or a run directory"),
    "resume not a checkpoint": Case(lambda d: (d.mkdir(parents=True, exist_ok=True),
                                               fit_cli(extra=("--resume", str(d)))(d.parent / "other"))[-1], 2,
                                    r"is not a checkpoint \(no meta\.json", r"checkpoints/step-"),
    "checkpoints dir a file": Case(fit_cli(), 2, r"checkpoints is a file", r"move it away|--fresh",
                                   keeps=True, setup=_checkpoints_a_file),
    "run dir in use": Case(fit_cli(), 2, r"is in use by another run \(process \d+ on host", r"--fresh|run_dir",
                           keeps=True, setup=_hold_lock),
    "all checkpoints damaged": Case(fit_cli("trainer.epochs=3"), 2, r"holds 2 checkpoint\(s\) and none can be loaded",
                                    r"--resume PATH.*--fresh.*--overwrite", keeps=True, setup=_truncate_checkpoints),
    "results without a checkpoint": Case(fit_cli("trainer.epochs=3"), 2,
                                         r"holds an earlier run's results \(history\.json, best\.safetensors\) but no "
                                         r"checkpoint", r"--fresh.*--overwrite", keeps=True, setup=_remove_checkpoints),
    "finished run again": Case(fit_cli("trainer.epochs=2", "checkpoint.keep_last=5"), 0, r"nothing to train",
                               r"Raise epochs|--fresh", keeps=True),
    "fewer epochs than done": Case(fit_cli("trainer.epochs=1", "checkpoint.keep_last=5"), 2,
                                   r"trainer\.epochs 2 -> 1 \(the checkpoint has finished 2 epoch", r"--fresh",
                                   keeps=True),
    "another batch size on resume": Case(fit_cli("trainer.epochs=3", "trainer.batch_size=16"), 2,
                                         r"cannot resume .*run\.global_batch 32 -> 16", r"--fresh", keeps=True),
    "another model on resume": Case(fit_cli("trainer.epochs=3", "model.width=8"), 2,
                                    r"cannot resume .*(model differs|model\.width)", r"--fresh", keeps=True),
    "another seed on resume": Case(fit_cli("trainer.epochs=3", "trainer.seed=3"), 2, r"trainer\.seed 0 -> 3",
                                   r"--fresh", keeps=True),
    # the Python API: what is handed to the Trainer
    "model a function": Case(api(lambda d: trainer(d, model=lambda x: x)), "TypeError", r"model .*is a function",
                             r"nn\.Module"),
    "model None": Case(api(lambda d: xlatrain.Trainer(None, nn.CrossEntropyLoss(), torch.optim.SGD)), "TypeError",
                       r"model is None", r"nn\.Module"),
    "loss a string": Case(api(lambda d: trainer(d, loss="cross_entropy")), "TypeError", r"loss_fn 'cross_entropy'",
                          r"callable|nn\.CrossEntropyLoss\(\)"),
    "optimizer an instance": Case(api(lambda d: trainer(d, opt=torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))),
                                  "TypeError", r"optimizer_fn is an optimizer \(SGD\)",
                                  r"functools\.partial\(torch\.optim\.SGD"),
    "optimizer a string": Case(api(lambda d: trainer(d, opt="adam")), "TypeError", r"optimizer_fn 'adam'",
                               r"functools\.partial"),
    "optimizer factory returns something else": Case(api(lambda d: trainer(d, opt=lambda params: 0.1)), "TypeError",
                                                     r"optimizer_fn returned a float", r"torch\.optim"),
    "scheduler an int": Case(api(lambda d: trainer(d, scheduler_fn=3)), "TypeError", r"scheduler_fn 3",
                             r"functools\.partial\(torch\.optim\.lr_scheduler"),
    "scheduler an instance": Case(api(lambda d: trainer(d, scheduler_fn=torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), 1))), "TypeError", r"scheduler_fn is a scheduler",
        r"factory"),
    "config a dict": Case(api(lambda d: xlatrain.Trainer(nn.Linear(4, 3), nn.CrossEntropyLoss(),
                                                         functools.partial(torch.optim.SGD, lr=0.1),
                                                         config={"epochs": 2})), "TypeError",
                          r"config is a dict", r"TrainConfig\(\*\*"),
    "backend name unknown": Case(api(lambda d: trainer(d, backend="gpu")), "ValueError", r"accelerator 'gpu'",
                                 r"choose one of"),
    "backend twice": Case(api(lambda d: trainer(d, accelerator="cpu")), "ValueError", r"both say where to run",
                          r"give one"),
    "strategy unknown in python": Case(api(lambda d: trainer(d, backend="auto", strategy="zero")), "ValueError",
                                       r"strategy='zero' is not valid", r"'fsdp'"),
    "train data empty": Case(api(lambda d: trainer(d).fit(data(0))), "ValueError", r"training set is empty",
                             r"check the dataset's path, filter or split"),
    "train data smaller than a batch": Case(api(lambda d: trainer(d).fit(data(5))), "ValueError",
                                            r"has 5 samples, fewer than one optimizer step", r"Lower batch_size"),
    "train data not a dataset": Case(api(lambda d: trainer(d).fit(42)), "TypeError", r"train_data 42",
                                     r"Dataset|__getitem__"),
    "val data not a dataset": Case(api(lambda d: trainer(d).fit(data(), "val")), "TypeError", r"val_data 'val'",
                                   r"Dataset|__getitem__"),
    "item None": Case(api(lambda d: trainer(d).fit(Items(1, lambda i: None))), "ValueError",
                      r"Items\[1\] returned None", r"__getitem__ must return"),
    "item raises": Case(api(lambda d: trainer(d).fit(Items(1, lambda i: _raise(KeyError("scan_0001.png"))))), "KeyError",
                        r"scan_0001", r"raised by Items\.__getitem__\(1\)"),
    "item without target": Case(api(lambda d: trainer(d).fit(Items(0, lambda i: torch.ones(4), n=32))), "ValueError",
                                r"item|targets", r"\(inputs, targets\)|inputs=|targets="),
    "items of different shapes": Case(api(lambda d: trainer(d).fit(Items(1, lambda i: (torch.ones(5), torch.tensor(0))))),
                                      "ValueError", r"shape", r"same shape|resize|pad"),
    "mse broadcast": Case(api(lambda d: trainer(d, model=nn.Linear(4, 1), loss=nn.MSELoss(), cfg={"task": "none"}).fit(
        TensorDataset(torch.randn(32, 4), torch.randn(32)))), "ValueError",
        r"outputs of shape \(2, 1\) and targets of shape \(2,\): torch broadcasts them to \(2, 2\)",
        r"squeeze the model's outputs"),
    "l1 broadcast": Case(api(lambda d: trainer(d, model=nn.Linear(4, 1), loss=nn.L1Loss(), cfg={"task": "none"}).fit(
        TensorDataset(torch.randn(32, 4), torch.randn(32)))), "ValueError", r"broadcasts them to \(2, 2\)",
        r"squeeze|reshape the targets"),
    "loss returns a float": Case(api(lambda d: trainer(d, loss=lambda o, t: 0.5).fit(data())), "ValueError",
                                 r"'loss' is a float, not a tensor", r"return tensors"),
    "loss not reduced": Case(api(lambda d: trainer(d, loss=_vector_loss, cfg={"task": "none"}).fit(data())),
                             "ValueError", r"must return a scalar 'loss', got shape \(\d+,\)", r"reduce it"),
    "loss without grad_fn": Case(api(lambda d: trainer(d, loss=_detached_loss).fit(data())), "ValueError",
                                 r"does not depend on the model's parameters \(no grad_fn\)", r"Return the loss tensor"),
    "loss dict without loss": Case(api(lambda d: trainer(d, loss=lambda o, t: {"ce": o.sum()}).fit(data())),
                                   "ValueError", r"mapping with keys 'ce' but no 'loss'", r"return \{'loss'"),
    "cross entropy float targets": Case(api(lambda d: trainer(d).fit(TensorDataset(torch.randn(32, 4),
                                                                                   torch.rand(32)))),
                                        "ValueError", r"CrossEntropyLoss .*float targets of shape \(\d+,\)",
                                        r"\.long\(\)|class probabilities"),
    "class index out of range in the first batch": Case(api(lambda d: trainer(d).fit(TensorDataset(
        torch.randn(32, 4), torch.full((32,), 5)))), "ValueError", r"class index 5\b.*3 outputs",
        r"num_outputs|labels"),
    "class index out of range mid-epoch": Case(api(lambda d: trainer(d).fit(LateBadLabels())), "IndexError",
                                               r"out of bounds|out of range",
                                               r"sample 30\b.*epoch 1 step \d+"),
    "multilabel shapes": Case(api(lambda d: trainer(d, loss=nn.BCEWithLogitsLoss()).fit(
        data(), TensorDataset(torch.randn(8, 4), torch.ones(8, 5)))), "ValueError", r"size|shape",
        r"same|match"),
    "classification outputs not logits": Case(api(lambda d: trainer(d, model=nn.Linear(4, 1), loss=nn.MSELoss(),
                                                                    cfg={"task": "classification"}).fit(
        TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), TensorDataset(torch.randn(8, 4), torch.randn(8, 1)))),
        "ValueError", r"task='classification' reports accuracy", r"task='none'"),
    "monitor not a column": Case(api(lambda d: trainer(d, cfg={"monitor": "val_f1", "monitor_mode": "max"}).fit(
        data(), data(8))), "ValueError", r"monitor='val_f1' is not a column this run's history will have",
        r"Set monitor"),
    "monitor val without val data": Case(api(lambda d: trainer(d, cfg={"monitor": "val_loss"}).fit(data())),
                                         "ValueError", r"no validation data was given", r"Set monitor"),
    "metrics_fn not a mapping": Case(api(lambda d: trainer(d, metrics_fn=lambda o, t: 0.5).fit(data(), data(8))),
                                     "TypeError", r"metrics_fn .*returned a float", r"\{name: value\}"),
    "metrics_fn value of several numbers": Case(
        api(lambda d: trainer(d, metrics_fn=lambda o, t: {"recall": torch.ones(3)}).fit(data(), data(8))),
        "TypeError", r"metrics_fn .*returned a Tensor of shape \(3,\) for 'recall'", r"one key per number"),
    "metrics_fn value a string": Case(
        api(lambda d: trainer(d, metrics_fn=lambda o, t: {"device": "cpu"}).fit(data(), data(8))),
        "TypeError", r"returned str 'cpu' for 'device'", r"must be one number"),
    "cross-entropy targets as int32": Case(
        api(lambda d: trainer(d).fit(TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,), dtype=torch.int32)))),
        "ValueError", r"CrossEntropyLoss got class indices as int32", r"\.long\(\)"),
    "cross-entropy mask targets as uint8": Case(
        api(lambda d: trainer(d, model=nn.Conv2d(1, 3, 1)).fit(
            TensorDataset(torch.randn(16, 1, 4, 4), torch.randint(0, 3, (16, 4, 4), dtype=torch.uint8)))),
        "ValueError", r"CrossEntropyLoss got class indices as uint8 of shape \(2, 4, 4\)", r"mask\.long\(\)"),
    "BCE-with-logits targets as integers": Case(
        api(lambda d: trainer(d, model=nn.Linear(4, 3), loss=nn.BCEWithLogitsLoss()).fit(
            TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32, 3))))),
        "ValueError", r"BCEWithLogitsLoss got int64 targets", r"\.float\(\)"),
    "collate_fn that does not stack": Case(
        api(lambda d: trainer(d, collate_fn=lambda items: items).fit(data(), data(8))),
        "ValueError", r"collate_fn .* returned the 2 items it was given, one by one, not a batch", r"default_collate"),
    "inputs key missing": Case(api(lambda d: trainer(d, inputs="image").fit([{"x": torch.ones(4), "y": 0}] * 32)),
                               "ValueError", r"'image'", r"inputs="),
    "predict on empty data": Case(api(lambda d: trainer(d).predict(data(0))), "ValueError",
                                  r"evaluation set is empty", r"at least one sample"),
    "evaluate on empty data": Case(api(lambda d: trainer(d).evaluate(data(0))), "ValueError",
                                   r"evaluation set is empty", r"at least one sample"),
    "resume an int": Case(api(lambda d: trainer(d).fit(data(), resume=123)), "ValueError", r"resume=123 is not valid",
                          r"'auto', False, 'overwrite'"),
    "resume path missing in python": Case(api(lambda d: trainer(d).fit(data(), resume=str(d / "none"))), "RunDirError",
                                          r"no such file or directory", r"checkpoint .*or a run directory"),
    "label names wrong count": Case(api(lambda d: trainer(d, loss=nn.BCEWithLogitsLoss(), label_names=["a", "b"]).fit(
        TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32, 3)).float()),
        TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8, 3)).float()))), "ValueError",
        r"label_names has 2 names but the model outputs 3", r"label_names"),
    "eval batch size zero": Case(api(lambda d: trainer(d, cfg={"eval_batch_size": 0})), "ValueError",
                                 r"eval_batch_size=0 is not valid", r">= 1"),
    "meta model without reset": Case(api(lambda d: trainer(d, model=_meta_model())), "ValueError",
                                     r"built on the meta device, and MetaNoReset has weights but no reset_parameters",
                                     r"init_weights=fn"),
    "fsdp units unknown": Case(api(lambda d: trainer(d, backend=xlatrain.BackendConfig(
        accelerator="cpu", strategy="fsdp", units=["Block"]))), "ValueError", r"units names 'Block', which the model",
        r"classes are .*Linear"),
    "accumulation longer than the data": Case(api(lambda d: trainer(d, cfg={"grad_accum_steps": 8}).fit(data())),
                                              "ValueError", r"fewer than one optimizer step needs: 8 micro-batch",
                                              r"grad_accum_steps"),
    # report, pack, doctor, export
    "report missing dir": Case(lambda d: cli("report", str(d / "none")), 2, r"none", r"run directory|history\.json"),
    "report without history": Case(lambda d: (d.mkdir(parents=True, exist_ok=True), cli("report", str(d)))[-1], 2,
                                   r"history\.json", r"run directory|xlatrain fit"),
    "report malformed history": Case(lambda d: cli("report", str(d)), 2, r"history\.json .*not (valid|readable) JSON",
                                     r"delete|rerun|restore", keeps=True, setup=_bad_history),
    "report out is a file": Case(lambda d: (Path(str(d) + ".out").write_text("x"),
                                            cli("report", str(d), "--out", str(d) + ".out"))[-1], 2,
                                 r"\.out is a file", r"directory", keeps=True),
    "pack csv missing": Case(lambda d: (d.mkdir(parents=True, exist_ok=True),
                                        cli("pack", "--csv", str(d / "none.csv"), "--images", str(d), "--out",
                                            str(d / "shards"), "--path-column", "p"))[-1], 2, r"none\.csv", r"--csv"),
    "pack images missing": Case(lambda d: (d.mkdir(parents=True, exist_ok=True), (d / "t.csv").write_text("p,y\na.jpg,1\n"),
                                           cli("pack", "--csv", str(d / "t.csv"), "--images", str(d / "imgs"), "--out",
                                               str(d / "shards"), "--path-column", "p"))[-1], 2, r"imgs", r"--images"),
    "pack out is a file": Case(lambda d: (d.mkdir(parents=True, exist_ok=True), (d / "t.csv").write_text("p,y\na.jpg,1\n"),
                                          (d / "shards").write_text("x"),
                                          cli("pack", "--csv", str(d / "t.csv"), "--images", str(d), "--out",
                                              str(d / "shards"), "--path-column", "p"))[-1], 2, r"--out .*shards is a file",
                               r"directory"),
    "pack out parent is a file": Case(lambda d: (d.mkdir(parents=True, exist_ok=True),
                                                 (d / "t.csv").write_text("p,y\na.jpg,1\n"), (d / "f").write_text("x"),
                                                 cli("pack", "--csv", str(d / "t.csv"), "--images", str(d), "--out",
                                                     str(d / "f" / "shards"), "--path-column", "p"))[-1], 2,
                                      r"is a file", r"directory"),
    "pack unknown path column": Case(lambda d: (d.mkdir(parents=True, exist_ok=True),
                                                (d / "t.csv").write_text("p,y\na.jpg,1\n"),
                                                cli("pack", "--csv", str(d / "t.csv"), "--images", str(d), "--out",
                                                    str(d / "shards"), "--path-column", "path"))[-1], 2, r"'path'",
                                     r"columns are|p"),
    "pack without where": Case(lambda d: cli("pack", "--csv", "a.csv", "--images", ".", "--out", str(d)), 2,
                               r"say where each image is", r"--path-columns"),
    "pack shard size 0": Case(lambda d: cli("pack", "--csv", "a.csv", "--images", ".", "--out", str(d), "--shard-mb", "0"),
                              2, r"argument --shard-mb: '0' is not a shard size", r"at least one byte's worth"),
    "demo unreachable accuracy": Case(lambda d: cli("demo", "--run-dir", str(d), "--min-accuracy", "2"), 2,
                                      r"argument --min-accuracy: 2 is not an accuracy from 0 to 1", r"0\.95 is 95%"),
    "pack verify missing dir": Case(lambda d: cli("pack", "--verify", str(d / "none")), 2, r"none", r"shard directory"),
    "doctor missing script": Case(lambda d: cli("doctor", str(d / "train.py")), 2, r"train\.py", r"path|script"),
    "export missing dir": Case(lambda d: cli("export", str(d / "none")), 2,
                               r"neither a run directory .*nor a checkpoint", r"give RUN_DIR"),
    "export run without checkpoint": Case(lambda d: cli("export", str(d)), 2, r"neither a run directory|no checkpoint",
                                          r"RUN_DIR", keeps=True, setup=_remove_checkpoints),
    "export damaged checkpoints": Case(lambda d: cli("export", str(d)), 2, r"no checkpoint that verifies",
                                       r"nothing to export|--resume|copy", keeps=True, setup=_truncate_checkpoints),
}


def _images(root: Path, names: list[str]) -> None:
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        Image.new("L", (16, 16), color=20 * i).save(root / name, quality=90)


def _pack_inputs(d: Path) -> None:
    """Images a..d and two CSVs over them; a pack of the first CSV in d/shards."""
    _images(d / "imgs", ["a.jpg", "b.jpg", "c.jpg", "d.jpg"])
    (d / "one.csv").write_text("p,y\na.jpg,1\nb.jpg,0\nc.jpg,1\nd.jpg,0\n")
    (d / "two.csv").write_text("p,y\na.jpg,1\nb.jpg,0\n")
    code, out = cli("pack", "--csv", str(d / "one.csv"), "--images", str(d / "imgs"), "--out", str(d / "shards"),
                    "--path-column", "p", "--labels", "y", "--workers", "1", "--quiet")
    assert code == 0, out


def _pack_again(csv: str, *extra: str) -> Callable[[Path], tuple[int, str]]:
    def run(d: Path) -> tuple[int, str]:
        return cli("pack", "--csv", str(d / csv), "--images", str(d / "imgs"), "--out", str(d / "shards"),
                   "--path-column", "p", "--labels", "y", "--workers", "1", "--quiet", *extra)
    return run


def _stale_lock(run_dir: Path) -> None:
    """A lock file left by a process of this host that is gone (a kill -9)."""
    import socket

    (run_dir / ".xlatrain.lock").write_text(json.dumps(
        {"pid": 2**22 + 17, "host": socket.gethostname(), "started": 1.0, "command": "xlatrain fit (killed)"}))


def _other_host_lock(run_dir: Path) -> None:
    (run_dir / ".xlatrain.lock").write_text(json.dumps(
        {"pid": 4242, "host": "tpu-vm-7", "started": 1.0, "command": "xlatrain fit configs/digits.yaml"}))


def _damage_a_shard(d: Path) -> None:
    _pack_inputs(d)
    shard = next((d / "shards").glob("shard-*"))
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    shard.write_bytes(bytes(blob))


MORE: dict[str, Case] = {
    "pack onto another pack": Case(lambda d: (_pack_inputs(d), _pack_again("two.csv")(d))[-1], 2,
                                   r"holds an earlier pack of 4 records made from other inputs \(the CSV: ",
                                   r"--replace"),
    "pack onto an edited CSV": Case(lambda d: (_pack_inputs(d), (d / "one.csv").write_text("p,y\na.jpg,1\n"),
                                               _pack_again("one.csv")(d))[-1], 2, r"the CSV's content changed",
                                    r"--replace"),
    "pack unknown label": Case(lambda d: (_pack_inputs(d), _pack_again("one.csv", "--labels", "pe")(d))[-1], 2,
                               r"'pe'", r"columns|label"),
    "pack verify damaged shard": Case(lambda d: (_damage_a_shard(d), cli("pack", "--verify", str(d / "shards")))[-1], 1,
                                      r"shard-.*(sha256|checksum|CRC)", r"re-pack|xlatrain pack|re-run"),
    "doctor a script that does not parse": Case(lambda d: (d.mkdir(parents=True, exist_ok=True),
                                                           (d / "t.py").write_text("def f(:\n"),
                                                           cli("doctor", str(d / "t.py")))[-1], 2,
                                                r"t\.py:1: not valid Python", r"Python source only"),
    "lock of another host": Case(fit_cli("trainer.epochs=3"), 2, r"locked by process 4242 on host tpu-vm-7",
                                 r"cannot be told.*delete .*\.xlatrain\.lock", keeps=True, setup=_other_host_lock),
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-epoch digits run (CLI), copied for every case that needs an earlier run."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    code, out = cli("fit", DIGITS, *TINY, "--set", f"trainer.run_dir={run_dir}", "--set", "checkpoint.keep_last=5",
                    "--set", "trainer.epochs=2")
    assert code == 0, out
    return run_dir


# The pipeline's own pieces: a sampler, a collate function, callbacks, a batch transform, and the
# settings beside them (top-k, EMA, fp16).
PIECES = {
    "sampler not a sampler": Case(api(lambda d: trainer(d, sampler=3)), "TypeError",
                                  r"sampler=3 is neither a sampler", r"sampler\(dataset, num_replicas"),
    "sampler index out of range": Case(api(lambda d: trainer(d, sampler=list(range(40))).fit(data())), "ValueError",
                                       r"index 32 in epoch 1, outside the training set's 0\.\.31",
                                       r"build it over the dataset"),
    "sampler too short": Case(api(lambda d: trainer(d, sampler=[0, 1, 2]).fit(data())), "ValueError",
                              r"sampler gave 3 indices in epoch 1, fewer than one optimizer step needs",
                              r"Lower batch_size"),
    "sampler with a BatchSource": Case(api(lambda d: trainer(d, sampler=[0, 1]).fit(Batches())), "ValueError",
                                       r"train_data is a Batches, which reads and batches its own",
                                       r"pass a map-style dataset|leave sampler= and collate_fn= out"),
    "collate_fn not callable": Case(api(lambda d: trainer(d, collate_fn="stack")), "TypeError",
                                    r"collate_fn='stack' is not callable", r"a function that makes one batch"),
    "collate_fn wrong targets": Case(api(lambda d: trainer(d, collate_fn=lambda items: (
        torch.stack([i[0] for i in items]), torch.zeros(len(items), 7))).fit(data())), "ValueError",
        r"dry run on one training batch.*float targets of shape \(2, 7\)", r"probabilities of the outputs' shape"),
    "callback without hooks": Case(api(lambda d: trainer(d, callbacks=[object()])), "TypeError",
                                   r"has none of the methods on_fit_start", r"def on_epoch_end\(self, trainer, row\)"),
    "batch_transform not callable": Case(api(lambda d: trainer(d, batch_transform=1)), "TypeError",
                                         r"batch_transform=1 is not callable", r"lambda b:"),
    "top_k beyond the classes": Case(api(lambda d: trainer(d, cfg={"top_k": (5,)}).fit(data(), data(8))),
                                     "ValueError", r"top-5 accuracy, but the model has 3 outputs", r"at most 3"),
    "ema_decay out of range": Case(api(lambda d: trainer(d, cfg={"ema_decay": 1.0})), "ValueError",
                                   r"ema_decay=1\.0 is not valid", r"between 0 and 1"),
    # Keys that would take no effect (runs.md: every key takes effect or is an error naming it).
    "EMA settings without an EMA": Case(api(lambda d: trainer(d, cfg={"ema_every": 5, "ema_bn_batches": 2})),
                                        "ValueError", r"ema_every=5, ema_bn_batches=2 shape an EMA .* ema_decay is None",
                                        r"set ema_decay"),
    "scheduler_interval without a schedule": Case(api(lambda d: trainer(d, cfg={"scheduler_interval": "step"})),
                                                  "ValueError", r"scheduler_interval='step' .* there is none",
                                                  r"give scheduler_fn .* or leave scheduler_interval out"),
}


class Batches:
    """A source that reads and batches its own records (the BatchSource protocol)."""

    def __len__(self) -> int:
        return 32

    def train_batches(self, **layout: Any) -> Any:
        return iter([])

    def eval_batches(self, **layout: Any) -> Any:
        return iter([])


CASES.update(MORE)
CASES.update(PIECES)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_named_with_its_fix_and_loses_nothing(name, finished, tmp_path):
    case = CASES[name]
    run_dir = tmp_path / "run"
    before = None
    if case.keeps:
        shutil.copytree(finished, run_dir)
        if case.setup is not None:
            case.setup(run_dir)
        before = fingerprint(run_dir)
    try:
        got, message = case.run(run_dir)
        after = fingerprint(run_dir) if before is not None else None
    finally:
        while _HELD:
            _HELD.pop().release()
    assert got == case.expect, f"{name}: expected {case.expect!r}, got {got!r}:\n{message}"
    assert re.search(case.problem, message, re.S), f"{name}: problem not named:\n{message}"
    assert re.search(case.fix, message, re.S), f"{name}: no fix given:\n{message}"
    if before is not None:
        assert after == before, f"{name}: files changed: " + ", ".join(
            sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)))


def test_a_refused_pack_changes_nothing_and_replace_replaces(tmp_path):
    _pack_inputs(tmp_path)
    before = fingerprint(tmp_path / "shards")
    code, out = _pack_again("two.csv")(tmp_path)
    assert code == 2 and fingerprint(tmp_path / "shards") == before, out
    code, out = _pack_again("two.csv", "--replace")(tmp_path)
    assert code == 0, out
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["num_records"] == 2
    # The same inputs again: updated in place, no refusal.
    code, out = _pack_again("two.csv")(tmp_path)
    assert code == 0, out


def test_a_stale_lock_of_this_host_is_taken_over_and_said(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    _stale_lock(run_dir)
    code, out = fit_cli("trainer.epochs=3")(run_dir)
    assert code == 0, out
    assert re.search(r"was locked by process \d+ on host .*xlatrain fit \(killed\), which is no longer running", out), out
    assert "continuing at epoch 3" in out
    assert (run_dir / ".xlatrain.lock").read_text() == ""  # released


def _xlatrain(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xlatrain.cli", *argv], capture_output=True, text=True,
                          env=script_env(env), timeout=300, stdin=subprocess.DEVNULL)


def test_the_command_prints_errors_without_a_traceback_and_debug_shows_it(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    _truncate_checkpoints(run_dir)
    args = ["fit", DIGITS, *TINY, "--set", f"trainer.run_dir={run_dir}", "--set", "trainer.epochs=3"]
    proc = _xlatrain(*args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert "xlatrain: error:" in proc.stderr and "none can be loaded" in proc.stderr
    proc = _xlatrain(*args, "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "RunDirError" in proc.stderr
    proc = _xlatrain(*args, env={"XLATRAIN_DEBUG": "1"})
    assert "Traceback" in proc.stderr
    proc = _xlatrain("fit", DIGITS, *TINY, "--set", f"trainer.run_dir={tmp_path / 'c'}", "--set",
                     "backend.accelerator=cuda")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "no CUDA device" in proc.stderr, proc.stderr


@pytest.mark.multiprocess
def test_every_process_of_a_torchrun_job_is_refused_a_locked_run_dir_with_one_message(tmp_path):
    from xlatrain.storage import lock as run_lock

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with run_lock.acquire(run_dir):
        proc = subprocess.run(
            [torchrun, "--nproc-per-node", "2", "--standalone", str(ROOT / "tests" / "scripts" / "strategy_fit.py"),
             str(run_dir), "cpu", "ddp", "1", "8"],
            capture_output=True, text=True, env=script_env(), timeout=300, stdin=subprocess.DEVNULL,
        )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # Both ranks stop with the main process's verdict, before training.
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\].*RunDirError: .* is in use by another run \(process {os.getpid()}", out), out[-4000:]
    assert "HISTORY" not in out and not (run_dir / "history.json").exists()


AFTER = """
import json, sys
from pathlib import Path
from xlatrain.checkpoint import find_resumable
root = Path(sys.argv[1]) / "checkpoints"
found = find_resumable(root)
print("AFTER " + json.dumps({"latest": found[0].name if found else None,
                             "temporaries": sorted(p.name for p in root.glob(".tmp-*"))}))
"""


def _in_small_filesystem(size: str, run_dir: Path, *argv: str) -> subprocess.CompletedProcess:
    """``xlatrain ARGV`` with ``run_dir`` on a tmpfs of ``size``, in a private mount namespace; then,
    on the same mount, the newest checkpoint that verifies (an ``AFTER`` line)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a small filesystem")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / "after.py").write_text(AFTER)
    command = (f"mount -t tmpfs -o size={size} tmpfs {run_dir} || exit 77; {sys.executable} -m xlatrain.cli "
               + " ".join(f"'{a}'" for a in argv)
               + f"; code=$?; {sys.executable} {run_dir.parent / 'after.py'} {run_dir}; exit $code")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", command], capture_output=True,
                          text=True, env=script_env(), timeout=300, stdin=subprocess.DEVNULL)
    if proc.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    return proc


DISK_ARGS = ("fit", DIGITS, *TINY, "--set", "trainer.tensorboard=false", "--set", "trainer.epochs=4")


def test_a_disk_too_small_for_two_checkpoints_is_refused_before_the_first_step(tmp_path):
    # A checkpoint of this model (weights and Adam's two moments) takes about 0.7 MB.
    run_dir = tmp_path / "run"
    proc = _in_small_filesystem("1m", run_dir, *DISK_ARGS, "--set", f"trainer.run_dir={run_dir}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"the disk holding .* has [\d.]+ MB free, and this run needs about 1\.\d MB for two checkpoints",
                     proc.stderr), proc.stderr
    assert "point trainer.run_dir at a larger disk" in proc.stderr and "epoch 1" not in proc.stdout


class _Steps:
    def __init__(self) -> None:
        self.seen = 0

    def on_interval(self, trainer: Any, values: dict[str, Any]) -> None:
        self.seen += 1


def _tagged_groups(params: Any) -> torch.optim.Optimizer:
    """A parameter group that carries a dtype of its own (as mixed-precision optimizers' do)."""
    return torch.optim.SGD([{"params": list(params), "state_dtype": torch.bfloat16}], lr=0.1)


def test_an_optimizer_setting_no_checkpoint_can_hold_is_refused_before_the_first_step(tmp_path):
    steps = _Steps()
    with pytest.raises(ValueError) as err:
        trainer(tmp_path / "run", opt=_tagged_groups, cfg={"log_every": 1}, callbacks=[steps]).fit(data())
    assert "optimizer param_groups: [0]['state_dtype'] is a dtype, which a checkpoint cannot hold" in str(err.value)
    assert "CheckpointConfig(enabled=False)" in str(err.value)
    assert steps.seen == 0 and not (tmp_path / "run" / "checkpoints").exists()
    # Without checkpoints nothing needs the settings saved: the same optimizer trains.
    trainer(tmp_path / "off", opt=_tagged_groups, checkpoint=xlatrain.CheckpointConfig(enabled=False)).fit(data())
    # resume='overwrite' (--overwrite) is refused before it clears the earlier run.
    trainer(tmp_path / "kept").fit(data())
    before = fingerprint(tmp_path / "kept")
    with pytest.raises(ValueError, match="cannot hold"):
        trainer(tmp_path / "kept", opt=_tagged_groups).fit(data(), resume="overwrite")
    assert {k: v for k, v in fingerprint(tmp_path / "kept").items() if k != ".xlatrain.lock"} == \
        {k: v for k, v in before.items() if k != ".xlatrain.lock"}


def test_a_disk_that_fills_mid_run_stops_with_the_space_named_and_the_last_checkpoint_kept(tmp_path):
    run_dir = tmp_path / "run"
    proc = _in_small_filesystem("2200k", run_dir, *DISK_ARGS, "--set", f"trainer.run_dir={run_dir}",
                                "--set", "checkpoint.keep_last=3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # the run failed: not a bad input, not a success
    assert "Traceback" not in out
    assert re.search(r"could not (save checkpoint|write) .*No space left on device.* MB free", proc.stderr), out
    named = re.search(r"the latest checkpoint is still (step-\d+)", proc.stderr)
    assert named, out
    assert "epoch 1/4" in proc.stdout  # it trained before the disk filled
    after = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("AFTER ")][0][len("AFTER "):])
    assert after == {"latest": named.group(1), "temporaries": []}  # it is there, it verifies, nothing half-written


def test_fit_names_the_best_weights_only_where_it_wrote_them(tmp_path):
    status, out = fit_cli("trainer.save_best=false")(tmp_path / "nobest")
    assert status == 0 and f"history: {tmp_path / 'nobest'}/history.csv" in out and "best weights" not in out
    assert not (tmp_path / "nobest" / "best.safetensors").exists()
    status, out = fit_cli()(tmp_path / "best")
    assert status == 0 and f"best weights: {tmp_path / 'best'}/best.safetensors" in out
    assert (tmp_path / "best" / "best.safetensors").exists()


def test_a_demo_run_again_trains_nothing_says_so_and_starts_over_with_fresh_or_overwrite(tmp_path):
    run_dir = str(tmp_path / "demo")
    demo = ("demo", "--run-dir", run_dir, "--epochs", "1", "--min-accuracy", "0", "--accelerator", "cpu")
    status, out = cli(*demo)
    assert status == 0 and f"wrote {run_dir}/history.csv" in out
    status, out = cli(*demo)
    assert status == 0 and "nothing to train" in out and "--fresh or --overwrite on the command line" in out
    assert f"nothing trained, {run_dir}'s files are as they were" in out and "wrote" not in out
    status, out = cli(*demo[:-4], "--min-accuracy", "1", "--accelerator", "cpu")  # more than one epoch reached
    assert status == 1 and re.search(r"final val_accuracy 0\.\d{4} is below --min-accuracy 1\.0 ", out), out
    status, out = cli(*demo, "--overwrite")
    assert status == 0 and f"wrote {run_dir}/history.csv" in out and "nothing to train" not in out
    plot = (tmp_path / "demo" / "loss.png").read_bytes()
    status, out = cli(*demo, "--fresh")  # a new directory beside it; the old run's files are left alone
    fresh = [d for d in tmp_path.iterdir() if d.name != "demo"]
    assert status == 0 and len(fresh) == 1 and f"wrote {fresh[0]}/history.csv" in out and f"{fresh[0]}/loss.png" in out
    assert (fresh[0] / "loss.png").exists() and (tmp_path / "demo" / "loss.png").read_bytes() == plot
    status, out = cli(*demo, "--fresh", "--overwrite")
    assert status == 2 and "not allowed with" in out
    # The PE demo takes the same flags (a missing config stops it before any work).
    from xlatrain.recipes.pe_detection.demo import main as pe_demo

    with pytest.raises(ValueError, match="nope.yaml"):
        pe_demo([str(tmp_path / "nope.yaml"), "--fresh"])
