"""What the Trainer is handed, checked before any work: the kinds of its arguments, and what a
dry run's batch says about the loss, the targets and the task's metrics. Each refusal names the
problem and the fix."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from xlatrain.config import CheckpointConfig, TrainConfig
from xlatrain.data.source import BatchSource
from xlatrain.train.batch import tree_map
from xlatrain.train.metrics import float_target_rows


def check_arguments(
    model: Any, loss_fn: Any, optimizer_fn: Any, scheduler_fn: Any, config: Any, checkpoint: Any, metrics_fn: Any,
    val_loss_fn: Any = None,
) -> None:
    """What the Trainer is handed has the kind it needs, or a TypeError saying what to pass."""
    if not isinstance(model, torch.nn.Module):
        what = "None" if model is None else (
            f"{model!r} is a function" if callable(model) else f"{type(model).__name__}")
        raise TypeError(
            f"model {what}, not a torch.nn.Module: pass the module (an nn.Module subclass, or wrap a function's "
            "layers in one), so that its parameters can be trained and saved"
            if model is not None else
            "model is None: pass the torch.nn.Module to train"
        )
    for name, fn in (("loss_fn", loss_fn), ("val_loss_fn", val_loss_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(
                f"{name} {fn!r} is not callable: pass {name}(outputs, targets) -> loss, e.g. nn.CrossEntropyLoss(), "
                "or loss_fn=None to train on the loss the model computes itself (out.loss)"
            )
    if isinstance(optimizer_fn, torch.optim.Optimizer) or not callable(optimizer_fn):
        what = f"is an optimizer ({type(optimizer_fn).__name__})" if isinstance(optimizer_fn, torch.optim.Optimizer) \
            else f"{optimizer_fn!r} is not callable"
        raise TypeError(
            f"optimizer_fn {what}: pass a factory that builds the optimizer from the parameters once they are on the "
            "device, e.g. functools.partial(torch.optim.SGD, lr=0.1)"
        )
    if scheduler_fn is not None and (
        isinstance(scheduler_fn, torch.optim.lr_scheduler.LRScheduler) or not callable(scheduler_fn)
    ):
        what = "is a scheduler (already built on another optimizer)" if callable(getattr(scheduler_fn, "step", None)) \
            else f"{scheduler_fn!r} is not callable"
        raise TypeError(
            f"scheduler_fn {what}: pass a factory that builds it from the optimizer, e.g. "
            "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3), or lambda opt, run: "
            "OneCycleLR(opt, max_lr=0.1, total_steps=run.total_steps)"
        )
    for name, value, cls in (("config", config, TrainConfig), ("checkpoint", checkpoint, CheckpointConfig)):
        if value is not None and not isinstance(value, cls):
            raise TypeError(
                f"{name} is a {type(value).__name__}, not a {cls.__name__}: pass {cls.__name__}(**your_values)"
            )
    if scheduler_fn is None and config is not None and config.scheduler_interval not in ("auto", "epoch"):
        raise ValueError(
            f"scheduler_interval={config.scheduler_interval!r} says when a learning-rate schedule steps, and there is "
            "none: give scheduler_fn (schedule.name in a config file), or leave scheduler_interval out")
    streaming = callable(getattr(metrics_fn, "update", None)) and callable(getattr(metrics_fn, "compute", None))
    if metrics_fn is not None and not callable(metrics_fn) and not streaming:
        raise TypeError(
            f"metrics_fn {metrics_fn!r} is not callable: pass metrics_fn(outputs, targets) -> {{name: value}}, or a "
            "metric object with update(preds, targets) and compute() (a torchmetrics metric)"
        )


def check_pipeline_arguments(
    collate_fn: Any, sampler: Any, batch_transform: Any, train_batch_transform: Any = None, eval_collate_fn: Any = None,
) -> None:
    """The pipeline's own pieces (``collate_fn``, ``sampler``, the batch transforms), as
    :func:`check_arguments` checks the rest."""
    for name, fn in (("collate_fn", collate_fn), ("eval_collate_fn", eval_collate_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(
                f"{name}={fn!r} is not callable: give a function that makes one batch from a list of "
                "dataset items, e.g. lambda items: mixup(*default_collate(items))"
            )
    if sampler is not None and not (callable(sampler) or hasattr(sampler, "__iter__")):
        raise TypeError(
            f"sampler={sampler!r} is neither a sampler (iterable over dataset indices) nor a factory "
            "sampler(dataset, num_replicas=..., rank=...) building one"
        )
    for name, fn in (("batch_transform", batch_transform), ("train_batch_transform", train_batch_transform)):
        if fn is not None and not callable(fn):
            raise TypeError(
                f"{name}={fn!r} is not callable: give a function of a batch on the device that returns the batch, "
                "e.g. lambda b: (normalize(b[0]), b[1])"
            )


def check_dataset(name: str, data: Any) -> None:
    if isinstance(data, BatchSource):
        return
    if isinstance(data, (str, bytes)) or not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(
            f"{name} {data!r} is not a dataset: give a map-style Dataset (with __len__ and __getitem__ returning "
            "(inputs, targets)), a list of items, or a BatchSource such as xlatrain's ShardDataset"
        )


def required_positional(fn: Callable[..., Any]) -> int:
    """Positional parameters of ``fn`` that have no default (``functools.partial`` applied)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def is_cross_entropy(loss_fn: Any) -> bool:
    inner = getattr(loss_fn, "func", loss_fn)  # functools.partial
    return isinstance(loss_fn, torch.nn.CrossEntropyLoss) or inner is torch.nn.functional.cross_entropy


def check_class_targets(loss_fn: Any, targets: Any) -> None:
    """The targets' dtype against what a cross-entropy loss takes: torch's own error names neither
    the dataset nor the fix. Read from the batch as the step gets it (after the batch transforms),
    which needs no value off the device."""
    if not isinstance(targets, torch.Tensor):
        return
    dtype = str(targets.dtype).removeprefix("torch.")
    own = _torchs_own(loss_fn, torch.nn.CrossEntropyLoss, torch.nn.functional.cross_entropy)
    if own and targets.device.type in _DTYPE_CHECKED and targets.dtype == torch.uint8 and targets.dim() > 1:
        raise ValueError(
            f"CrossEntropyLoss got class indices as uint8 of shape {tuple(targets.shape)}: per-position targets "
            "(a mask) must be int64 (torch.long). Return mask.long() in the dataset, or targets.long() in "
            "collate_fn or batch_transform"
        )
    if is_cross_entropy(loss_fn) and targets.dtype == torch.bool:
        raise ValueError(
            "CrossEntropyLoss got bool targets: give class indices (targets.long() in the dataset) or class "
            "probabilities (floats of the outputs' shape)"
        )
    if own and targets.device.type in _DTYPE_CHECKED and not targets.is_floating_point() \
            and targets.dtype not in (torch.int64, torch.uint8):
        raise ValueError(
            f"CrossEntropyLoss got class indices as {dtype}: it takes them as int64 (torch.long). Return "
            "torch.as_tensor(label).long() in the dataset, or targets.long() in collate_fn or batch_transform"
        )


# Devices whose torch kernels refuse these target dtypes (measured on the CPU; CUDA's checks are
# the same frontend's). torch_xla takes int32 class indices, and TorchTPU is not measured here.
_DTYPE_CHECKED = ("cpu", "cuda")


def _torchs_own(loss_fn: Any, module: type, function: Any) -> bool:
    """torch's own loss, not a subclass that may convert the targets before calling it."""
    return type(loss_fn) is module or getattr(loss_fn, "func", loss_fn) is function


def check_bce_targets(loss_fn: Any, outputs: Any, targets: Any) -> None:
    """BCE-with-logits' targets of the outputs' shape but not floats (integer labels): torch's own
    error speaks of a cast. Targets of another shape are left to the loss, whose error names the
    shapes: that is the first thing to mend."""
    bce = _torchs_own(loss_fn, torch.nn.BCEWithLogitsLoss, torch.nn.functional.binary_cross_entropy_with_logits)
    if not (bce and isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor)
            and targets.device.type in _DTYPE_CHECKED):
        return
    if targets.shape == outputs.shape and not targets.is_floating_point():
        dtype = str(targets.dtype).removeprefix("torch.")
        raise ValueError(
            f"BCEWithLogitsLoss got {dtype} targets: it takes floats (0.0 and 1.0, or probabilities). Return "
            "labels.float() in the dataset, or targets.float() in collate_fn or batch_transform"
        )


def check_class_outputs(loss_fn: Any, outputs: Any, targets: Any) -> None:
    """Cross-entropy's class-index targets against the number of outputs (host copy of the targets)."""
    if not (is_cross_entropy(loss_fn) and isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return
    if outputs.dim() < 2:
        return
    classes = outputs.shape[1]
    if targets.is_floating_point():
        if tuple(targets.shape) != tuple(outputs.shape):
            raise ValueError(
                f"CrossEntropyLoss got float targets of shape {tuple(targets.shape)}: it takes class indices "
                f"(integers, shape {tuple(outputs.shape[:1]) + tuple(outputs.shape[2:])}) or class probabilities "
                f"(floats, the outputs' shape {tuple(outputs.shape)}). Give class indices with .long() in the dataset, "
                "or probabilities of the outputs' shape"
            )
        return
    ignore = getattr(loss_fn, "ignore_index", -100)
    bad = targets[(targets != ignore) & ((targets < 0) | (targets >= classes))]
    if bad.numel():
        raise ValueError(
            f"the targets hold class index {int(bad[0])}, but the model has {classes} outputs (classes 0..{classes - 1}): "
            f"give the model's last layer one output per class (num_outputs), or map the labels to 0..{classes - 1} "
            "in the dataset"
        )


_BROADCAST = re.compile(r"target size \((.*?)\) that is different to the input size \((.*?)\)")


def refuse_broadcast_loss(caught: list[warnings.WarningMessage], loss_fn: Any) -> None:
    """torch warns, and goes on, when an elementwise loss (MSE, L1, Huber, ...) gets targets of
    another shape than the outputs: it broadcasts them, and every output meets every target. That
    is never what was meant; it is an error here. Other warnings are passed on as they were."""
    for w in caught:
        found = _BROADCAST.search(str(w.message))
        if found is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            continue
        target, output = (tuple(int(n) for n in re.findall(r"\d+", part)) for part in found.groups())
        into = tuple(torch.broadcast_shapes(target, output))
        raise ValueError(
            f"loss_fn {loss_fn!r} got outputs of shape {output} and targets of shape {target}: torch broadcasts "
            f"them to {into}, so every output is compared with every target and the loss is wrong. Give both one "
            f"shape: squeeze the model's outputs (outputs.squeeze(-1) in the model or the loss), or reshape the "
            "targets in the dataset"
        )


class PairwiseWatch(torch.overrides.TorchFunctionMode):
    """Around the dry run's loss: an op that takes the model's outputs and the targets themselves
    and broadcasts them into something larger than either ((N, 1) against (N,) gives (N, N)), so
    every output meets every target. torch warns of this only inside its own elementwise losses; a
    loss written by hand does it silently. A pairwise loss means it, so this is said, not refused."""

    def __init__(self, outputs: Any, targets: Any) -> None:
        super().__init__()
        self.pair = {id(outputs), id(targets)} if isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) \
            and outputs is not targets else set()
        self.found: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if self.found is None and self.pair and len(args) >= 2 and isinstance(result, torch.Tensor):
            a, b = args[0], args[1]
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and {id(a), id(b)} == self.pair \
                    and result.numel() > max(a.numel(), b.numel()):
                self.found = (tuple(a.shape), tuple(b.shape), tuple(result.shape))
        return result

    def note(self, loss_fn: Any) -> str | None:
        if self.found is None:
            return None
        a, b, into = self.found
        return (f"note: loss_fn {loss_fn!r} combined the outputs and the targets, of shapes {a} and {b}, into {into} "
                "by broadcasting: every output met every target. If the loss is meant row by row, give both one "
                "shape (outputs.squeeze(-1), or targets.view(-1, 1) in the dataset); a pairwise loss means this")


def shapes(batch: Any) -> str:
    leaves = tree_map(lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__, batch)
    return str(leaves)


def check_task(task: str, outputs: Any, targets: Any, top_k: Sequence[int] = (), task_given: bool = False) -> None:
    """The task's metrics can be computed from these outputs and targets (shapes and dtypes only)."""
    def shape(x: Any) -> Any:
        return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__

    fix = "set TrainConfig(task='none') to report the loss (and metrics_fn's metrics) only"
    if task == "classification":
        ok = isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.dim() == 2 and (
            (targets.dim() == 1 and not targets.is_floating_point() and targets.shape[0] == outputs.shape[0])
            or (targets.is_floating_point() and targets.shape == outputs.shape and outputs.shape[1] > 1)  # probabilities
        )
        if not ok:
            raise ValueError(
                "task='classification' reports accuracy from [batch, classes] logits and [batch] class indices "
                f"(or class probabilities of the logits' shape), but the model returned {shape(outputs)} and the "
                f"targets are {shape(targets)}: {fix}"
            )
        if task_given and targets.is_floating_point() and outputs.shape[1] > 1:
            # One read of the dry run's targets: 0/1 rows that are not one-hot are several labels each.
            binary, distribution = float_target_rows(targets)
            if binary and not distribution:
                raise ValueError(
                    f"task='classification' was set, but the targets {shape(targets)} are multi-hot (rows of 0s and "
                    "1s with several 1s or none), which accuracy over one class per row cannot score: set "
                    "task='multilabel' (per-label AUC; trainer.task on the command line), or leave task to 'auto'"
                )
        if top_k and max(top_k) > outputs.shape[1]:
            raise ValueError(
                f"top_k={tuple(top_k)} asks for top-{max(top_k)} accuracy, but the model has {outputs.shape[1]} outputs "
                f"(classes): give ks of at most {outputs.shape[1]}"
            )
    elif top_k:
        raise ValueError(
            f"top_k={tuple(top_k)} asks for top-k accuracy, which task={task!r} does not report: top-k needs "
            "task='classification' ([batch, classes] logits and class targets; the task was "
            + ("set" if task_given else "inferred from the loss and the outputs' shapes") + f", the model returned "
            f"{shape(outputs)} and the targets are {shape(targets)}). Set TrainConfig(task='classification') "
            "(trainer.task) where the outputs are class scores, or drop top_k"
        )
    if task == "multilabel":
        ok = isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.dim() == 2 \
            and outputs.shape == targets.shape
        if not ok:
            raise ValueError(
                "task='multilabel' reports per-label AUC from [batch, labels] logits and targets of the same shape, "
                f"but the model returned {shape(outputs)} and the targets are {shape(targets)}: {fix}"
            )


_TARGET_OUT_OF_BOUNDS = re.compile(r"Target (-?\d+) is out of bounds")


# A torch op handed a model's structured output (a Hugging Face ModelOutput, a dict) for a tensor.
_NOT_A_TENSOR = re.compile(r"must be Tensor, not (\w*Output\w*|dict)\b")


def error_hints(exc: BaseException, trainer: Any, indices: list[int] | None = None, outputs: Any = None,
                targets: Any = None) -> list[str]:
    """What xlatrain can add to an error the model or the loss raised, where it knows the cause:
    a class index beyond the model's outputs (which sample, how many classes), channels-last
    memory order under a ``.view`` (the fix)."""
    text = str(exc)
    hints = []
    found = _TARGET_OUT_OF_BOUNDS.search(text)
    if found and isinstance(outputs, torch.Tensor) and outputs.dim() >= 2:
        bad, classes = int(found.group(1)), int(outputs.shape[1])
        where = ""
        if isinstance(targets, torch.Tensor) and targets.dim() >= 1:
            rows = (targets.detach().reshape(targets.shape[0], -1) == bad).any(dim=1).nonzero().flatten().tolist()
            if rows:
                row = rows[0]
                where = (f"; sample {indices[row]} of the dataset holds it" if indices and row < len(indices)
                         else f"; row {row} of the batch holds it")
        hints.append(
            f"xlatrain: class index {bad} is outside 0..{classes - 1}: the model has {classes} outputs{where}. Give the "
            f"model's last layer one output per class (num_outputs), or map the labels to 0..{classes - 1} in the dataset"
        )
    structured = _NOT_A_TENSOR.search(text)
    io = getattr(trainer, "io", None)
    if structured and io is not None and not io.own_loss and io.output_field is None:
        hints.append(
            f"xlatrain: loss_fn got the model's whole output, a {structured.group(1)}, where it takes a tensor: set "
            "output_field to the field it reads (output_field='logits' for a Hugging Face model), and loss_fn, metrics "
            "and predict get that field"
        )
    if _DDP_UNUSED in text:
        hints.append(_ddp_unused_hint(text, trainer))
    if "view size is not compatible" in text and getattr(trainer, "channels_last", False):
        hints.append(
            "xlatrain: channels_last is on (TrainConfig(channels_last='auto') on CUDA under bf16/fp16, or True): the "
            "model's images are in channels-last memory order, which .view() cannot flatten. Use .reshape() or "
            "torch.flatten() in the model, or set channels_last=False"
        )
    return hints


# torch's DDP, at the forward after a step in which a trainable parameter got no gradient.
_DDP_UNUSED = "Expected to have finished reduction in the prior iteration"
_DDP_UNUSED_NAMES = re.compile(r"Parameters which did not receive grad for rank \d+: ([^\n]+)")
_DDP_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


def _ddp_unused_hint(text: str, trainer: Any) -> str:
    """The parameters DDP names (TORCH_DISTRIBUTED_DEBUG=DETAIL) or numbers (its reducer's order:
    the trainable parameters as ``named_parameters`` lists them, less those DDP ignores), and what
    to do. The dry run found none of them unused: they missed a gradient at a later step only."""
    names: list[str] = []
    if found := _DDP_UNUSED_NAMES.search(text):
        names = [n.strip() for n in found.group(1).split(",") if n.strip()]
    elif (found := _DDP_UNUSED_INDICES.search(text)) and getattr(trainer, "strategy", None) is not None:
        module = trainer.strategy.unwrap(trainer.model)
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        order = [n for n, p in module.named_parameters() if p.requires_grad and n not in ignored]
        names = [order[int(i)] for i in found.group(1).split() if int(i) < len(order)]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"xlatrain: DDP waits each step for a gradient of every trainable parameter, and "
        f"{shown or 'some'} got none in the step before this one (on this process). The dry run before training "
        "gave them one, so DDP was not told to look for unused parameters (find_unused_parameters, which xlatrain "
        "turns on where the dry run finds some). Freeze parameters never meant to train before building the "
        "Trainer (requires_grad_(False)); where the forward skips them on some batches only, make it use them on "
        "every batch (add 0 * their output to the result)"
    )


# What a collective raises on a process whose peer is gone: gloo's TCP pair, NCCL's remote error.
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|remote process exited|ncclRemoteError|Broken pipe")


def failed_collective(exc: BaseException) -> str | None:
    """``"peer"`` where a collective failed because another process went away (gloo's "Connection
    closed by peer", NCCL's remote error), ``"collective"`` for another error of torch.distributed's
    (a ``DistError``: named, not imported, so that only ``backend/`` imports torch.distributed),
    else None."""
    if _PEER_GONE.search(str(exc)) and isinstance(exc, RuntimeError):
        return "peer"
    if any(cls.__name__ == "DistError" for cls in type(exc).__mro__):
        return "collective"
    return None


def peer_failure_note(kind: str, where: str = "") -> str:
    """Said where a collective failed, instead of blaming this process's batch: another process's
    error is the cause, and it is in that process's own output."""
    first = (f"another process failed first: this process lost its connection to it{where}, so this error is "
             "its symptom, not the cause" if kind == "peer" else
             f"a collective between the processes failed{where}: if another process failed first, this error is "
             "its symptom")
    if where:
        first += " (this process's batch is not at fault)" if kind == "peer" else ""
    return (f"{first}. The first error is that process's own, in its output (its [rankN]: lines under torchrun, "
            "whose error summary names it under 'Root Cause')")


def failure_status(exc: BaseException) -> str:
    """What ``status.json`` records of a failed fit: the error, or, where a collective failed on a
    peer's failure, that another process failed first and where its error is (this process's
    symptom after it). The same is added to the error's notes, once, where no step said it."""
    own = f"{type(exc).__name__}: {str(exc)[:2000]}"
    kind = failed_collective(exc)
    if kind is None:
        return own
    note = peer_failure_note(kind)
    if hasattr(exc, "add_note") and not any("another process failed first" in n or "a collective between" in n
                                            for n in getattr(exc, "__notes__", ())):
        exc.add_note(f"xlatrain: {note}")
    return f"{note}; this process saw {type(exc).__name__}: {str(exc)[:1000]}"


@contextlib.contextmanager
def in_step(trainer: Any, cursor: Any, step: int) -> Iterator[list[Any]]:
    """An error raised in a training step keeps its traceback and says where: epoch, step, which
    function (the model, the loss, backward) and, for a map-style dataset, the batch's samples."""
    where: list[Any] = ["forward"]
    try:
        yield where
    except Exception as exc:
        if hasattr(exc, "add_note"):
            indices = trainer._feed.sample_indices(cursor.epoch, step) if trainer._feed is not None else None
            for hint in error_hints(exc, trainer, indices, *where[1:]):
                exc.add_note(hint)
                indices = None  # the hint names the sample that matters
            what = {"forward": f"the model's forward ({type(trainer.strategy.unwrap(trainer.model)).__name__})",
                    "loss": f"loss_fn {trainer.loss_fn!r}"}.get(where[0], where[0])
            if kind := failed_collective(exc):
                exc.add_note(f"xlatrain: {peer_failure_note(kind, f' in {what} at epoch {cursor.epoch} step {step}')}")
                raise
            exc.add_note(
                f"xlatrain: raised in {what} at epoch {cursor.epoch} step {step}"
                + (f"; this process's batch holds the dataset's sample indices {indices}" if indices else "")
            )
        raise
