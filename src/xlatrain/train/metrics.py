"""Evaluation metrics: summed on the device per batch, read on the host once per evaluation.

Padding rows (see ``data.sampling.EvalSampler``) carry ``valid == False`` and are masked out of
every sum, so each real sample counts exactly once whatever the batch and device count.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from xlatrain.backend.base import Runtime, Strategy
from xlatrain.data.sampling import EvalSampler
from xlatrain.logs import get_logger
from xlatrain.train.batch import tree_flatten, tree_map, tree_unflatten
from xlatrain.train.detection import DetectionMAP
from xlatrain.train.losses import EvalLoss

log = get_logger(__name__)


def infer_task(loss_fn: Any) -> str:
    """``classification`` for a cross-entropy (``CrossEntropyLoss``, ``F.cross_entropy``, and losses
    named as one, such as timm's ``SoftTargetCrossEntropy``), ``multilabel`` for BCE-with-logits,
    else ``none``."""
    inner = getattr(loss_fn, "func", loss_fn)  # functools.partial
    if isinstance(loss_fn, torch.nn.CrossEntropyLoss) or inner is torch.nn.functional.cross_entropy:
        return "classification"
    if isinstance(loss_fn, torch.nn.BCEWithLogitsLoss) or inner is torch.nn.functional.binary_cross_entropy_with_logits:
        return "multilabel"
    if isinstance(loss_fn, torch.nn.Module) and type(loss_fn).__name__.endswith("CrossEntropy"):
        return "classification"
    return "none"


# A Hugging Face model's config.problem_type, where it says the task (None: the batch decides).
_PROBLEM_TYPES = {"single_label_classification": "classification", "multi_label_classification": "multilabel",
                  "regression": "none"}


def task_from_shapes(predictions: Any, targets: Any, model: Any = None) -> str:
    """What a batch says the task is, where the loss does not (the model's own loss):
    ``classification`` for ``[N, C]`` logits with ``[N]`` class indices or ``[N, C]`` class
    probabilities (rows that sum to 1: one-hot, smoothed, mixed), ``multilabel`` for ``[N, C]``
    targets of 0s and 1s that are not one-hot (a multi-label classifier's), else ``none`` (float
    targets of another kind are a regression's). Float targets are read once on the host. A
    Hugging Face ``model`` whose ``config.problem_type`` is set says it instead (a multi-label
    batch with one positive in every row reads as one-hot)."""
    said = _PROBLEM_TYPES.get(getattr(getattr(model, "config", None), "problem_type", None) or "")
    if said is not None:
        return said
    if not (isinstance(predictions, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return "none"
    if predictions.dim() != 2 or not predictions.is_floating_point() or predictions.shape[1] < 2:
        return "none"
    if targets.dim() == 1 and not targets.is_floating_point() and targets.dtype != torch.bool \
            and targets.shape[0] == predictions.shape[0]:
        return "classification"
    if targets.is_floating_point() and targets.shape == predictions.shape:
        binary, distribution = float_target_rows(targets)
        return "classification" if distribution else "multilabel" if binary else "none"
    return "none"


def float_target_rows(targets: torch.Tensor) -> tuple[bool, bool]:
    """Whether ``[N, C]`` float targets are all 0s and 1s, and whether each row sums to 1 (class
    probabilities: one-hot, smoothed, mixed); one read of them on the host."""
    t = targets.detach().float()
    binary, distribution = torch.stack([((t == 0) | (t == 1)).all(), ((t.sum(dim=1) - 1).abs() <= 1e-3).all()]).tolist()
    return binary, distribution


def is_streaming(metrics_fn: Any) -> bool:
    """A metric object fed batch by batch (``update(preds, targets)``, then ``compute()``), as
    torchmetrics' metrics are, rather than a function of the whole set."""
    return callable(getattr(metrics_fn, "update", None)) and callable(getattr(metrics_fn, "compute", None))


def default_monitor(task: str) -> tuple[str, str]:
    return {
        "classification": ("val_accuracy", "max"),
        "multilabel": ("val_mean_auc", "max"),
    }.get(task, ("val_loss", "min"))


class RowCollector:
    """Per-batch device trees (outputs, targets, ...) -> one host tree in dataset order.

    Each batch is gathered over processes on the device (a fixed-shape collective, compiled once;
    the identity under SPMD) and moved to the host through ``runtime.defer``, so nothing waits
    for it and no graph grows with the dataset. ``result`` restores dataset order and drops the
    padding rows.
    """

    def __init__(self, runtime: Runtime, strategy: Strategy, layout: EvalSampler) -> None:
        self._runtime = runtime
        self._strategy = strategy
        self._layout = layout
        self._host: list[list[torch.Tensor]] = []
        self._spec: Any = None

    def add(self, tree: Any) -> None:
        leaves, self._spec = tree_flatten(tree)
        slot: list[torch.Tensor] = []
        self._host.append(slot)
        self._runtime.defer(lambda *ts: slot.extend(ts), gathered(self._strategy, leaves))

    def result(self) -> Any:
        self._runtime.read([])  # run any deferred copies still in flight
        lay = self._layout
        indices = [lay.indices(p).reshape(lay.steps, lay.loader_batch) for p in range(lay.num_processes)]
        # Batch k arrives as [process 0's rows, process 1's rows, ...].
        order = torch.cat([torch.cat([idx[k] for idx in indices]) for k in range(len(self._host))])
        real = order < lay.num_samples
        columns = []
        for i in range(len(self._host[0])):
            col = padded_cat([batch[i] for batch in self._host])
            out = torch.empty((lay.num_samples, *col.shape[1:]), dtype=col.dtype)
            out[order[real]] = col[real]
            columns.append(out)
        return tree_unflatten(columns, self._spec)


def gathered(strategy: Strategy, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's rows from every process, joined along dim 0 in process order. Each process
    may have padded its sequences to its own longest, and a gather needs one size: where the
    processes' sizes differ, every process pads as :func:`padded_cat` pads (the sizes are compared
    on the host, with no device read)."""
    leaves = [t.detach() for t in leaves]
    sizes = [n for t in leaves for n in t.shape[1:]]
    most = strategy.host_max(sizes + [-n for n in sizes])
    widest, narrowest = iter(most[:len(sizes)]), iter(most[len(sizes):])
    for i, t in enumerate(leaves):
        w, n = [next(widest) for _ in t.shape[1:]], [-next(narrowest) for _ in t.shape[1:]]
        if w != n:
            leaves[i] = pad_to(t, w)
    return [strategy.all_gather(t) for t in leaves]


def combines_processes(metric: Any) -> bool:
    """Whether a streaming metric joins what every process saw by itself at ``compute()``:
    torchmetrics' metrics do (their ``sync``), as does an object that says so with
    ``combines_processes = True`` (xlatrain's :class:`DetectionMAP`), or whose ``compute`` calls a
    collective itself (a meter ported from a torch_xla script: ``xm.mesh_reduce``,
    ``dist.all_reduce``). Any other is fed every process's rows."""
    if callable(getattr(metric, "sync", None)) or getattr(metric, "combines_processes", False) is True:
        return True
    code = getattr(getattr(type(metric), "compute", None), "__code__", None)
    return code is not None and bool(_COLLECTIVE_NAMES & _names_in(code))


def check_gatherable(metric: Any, num_processes: int, predictions: Any, targets: Any) -> None:
    """Refuse a metric object the Trainer would have to feed every process's rows (see
    :func:`combines_processes`) where they are not all tensors, which it cannot gather."""
    if not is_streaming(metric) or num_processes == 1 or combines_processes(metric):
        return
    if not (_rows_of_tensors(predictions) and _rows_of_tensors(targets)):
        raise ValueError(
            f"metrics_fn {metric!r} is a metric object fed batch by batch on {num_processes} processes, and its "
            "predictions or targets are not tensors of rows (a list of per-sample items, a detector's dicts), "
            "so the Trainer cannot gather them: each process would "
            "compute it on its own rows and the processes would disagree. Give it combines_processes = True and "
            "join the processes in its compute() (torch.distributed.all_gather_object), as torchmetrics' "
            "metrics and xlatrain.DetectionMAP do"
        )


def _rows_of_tensors(tree: Any) -> bool:
    """A tensor with rows, or a mapping / tuple / dataclass of them: what a gather joins by rows.
    A list is taken for per-sample items (a detector's images or dicts), which it cannot join."""
    if isinstance(tree, torch.Tensor):
        return tree.dim() > 0
    if isinstance(tree, Mapping):
        return all(_rows_of_tensors(v) for v in tree.values())
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return all(_rows_of_tensors(getattr(tree, f.name)) for f in dataclasses.fields(tree))
    return isinstance(tree, tuple) and all(_rows_of_tensors(v) for v in tree)


# Names a compute() that joins processes itself calls (torch.distributed's and torch_xla's).
_COLLECTIVE_NAMES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter",
                     "broadcast", "broadcast_object_list", "gather_object", "reduce", "mesh_reduce", "rendezvous"}


def _names_in(code: Any) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_in(const)
    return names


# What fills the positions a batch did not have where batches of different widths are joined
# (sequences padded per batch): the Hugging Face Trainer's padding for predictions and labels,
# and the index a cross-entropy ignores by default.
PAD_VALUE = -100


def padded_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along rows of tensors whose other sizes may differ from batch to batch
    (tokens padded to each batch's longest): each is padded at the end of every such dimension to
    the largest, with :data:`PAD_VALUE` (False for booleans; unsigned integers, which cannot hold
    it, become int64)."""
    sizes = {tuple(p.shape[1:]) for p in parts}
    if len(sizes) == 1:
        return torch.cat(parts)
    if len({len(size) for size in sizes}) > 1:
        raise ValueError(f"evaluation's batches give outputs or targets of different ranks ({sorted(sizes)}): "
                         "return the same structure for every batch")
    widest = [max(size[d] for size in sizes) for d in range(len(next(iter(sizes))))]
    return torch.cat([pad_to(part, widest) for part in parts])


def pad_to(part: torch.Tensor, widest: list[int]) -> torch.Tensor:
    """``part`` padded at the end of each dimension after the first to ``widest``, as
    :func:`padded_cat` pads (unsigned integers become int64 even where nothing is padded)."""
    if part.dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        part = part.long()  # -100 would wrap (156 in a uint8)
    out = part.new_full((part.shape[0], *widest), False if part.dtype == torch.bool else PAD_VALUE)
    out[(slice(None), *(slice(0, n) for n in part.shape[1:]))] = part
    return out


# Output keys that hold an attention cache (Hugging Face's past_key_values, named cache and
# cache_params in newer releases, each a DynamicCache or the like): no loss reads one, a cache
# object cannot be gathered, and kept for a whole-set loss it would cost host memory as the
# activations do.
_CACHE_KEYS = ("past_key_values", "cache", "cache_params")


def _is_cache(key: Any, value: Any) -> bool:
    return key in _CACHE_KEYS or type(value).__name__.endswith("Cache")


def without_caches(outputs: Any) -> Any:
    """A model's outputs as a whole-set loss reads them: without an attention cache."""
    if not (isinstance(outputs, Mapping) and any(_is_cache(k, v) for k, v in outputs.items())):
        return outputs
    kept = {k: v for k, v in outputs.items() if not _is_cache(k, v)}
    try:
        return kept if type(outputs) is dict else type(outputs)(**kept)
    except TypeError:  # a mapping that is not built from keywords
        return kept


def as_float(tree: Any) -> Any:
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


class EvalAccumulator:
    """Running sums for one evaluation pass, kept on the device.

    The loss is summed over real rows: per sample (an unreduced ``loss_fn`` masked by ``valid``),
    or per batch for the model's own loss (its mean times the batch's real rows; padding rows were
    cut from the batch before the model saw it), or over the whole set on the host. Accuracy and
    top-k are summed per batch, over the real rows whose target is a class: one whose target is
    negative (-100, the index a cross-entropy ignores) is left out of both counts, as the loss
    leaves it out. Predictions and targets go to the host only when something needs
    every row: a whole-set loss, multilabel AUC, a ``metrics_fn`` function. A streaming metric
    (``update``/``compute``) gets each batch's real rows.
    """

    def __init__(
        self, task: str, runtime: Runtime, strategy: Strategy, layout: EvalSampler, loss: EvalLoss | None,
        io: Any, *, top_k: Sequence[int] = (), metrics_fn: Any = None,
    ) -> None:
        self.task = task
        self.io = io
        # top-1 is ``accuracy``: its own column would repeat it.
        self.top_k = [k for k in top_k if k > 1] if task == "classification" else []
        self.loss = loss
        self.layout = layout
        self.full_rows = layout.loader_batch
        self.sums: dict[str, torch.Tensor] = {}
        device = runtime.device
        self.count = torch.zeros((), device=device)
        self.weight = None  # the loss's mean divides by this where its rows carry weights (target_weights)
        self.correct = torch.zeros((), device=device)
        self.scored = torch.zeros((), device=device)  # accuracy's rows: real ones whose target is not ignored
        self.top_correct = [torch.zeros((), device=device) for _ in self.top_k]
        # torchmetrics' metrics sync themselves over torch.distributed at compute().
        self.streaming = metrics_fn if is_streaming(metrics_fn) else None
        # One that does not join processes itself is fed every process's real rows of each batch,
        # so that every process computes the same value (and decides alike on best and stopping).
        self._feed_all = self.streaming is not None and layout.num_processes > 1 and not combines_processes(self.streaming)
        self._every_count = [layout.valid_counts(p) for p in range(layout.num_processes)] if self._feed_all else []
        self._strategy = strategy
        self._batches = 0
        keep_rows = (metrics_fn is not None and self.streaming is None) or task == "multilabel" or (
            loss is not None and loss.mode == "whole_set")
        self.rows = RowCollector(runtime, strategy, layout) if keep_rows else None
        self._valid_counts = layout.valid_counts(layout.process_index)

    def trim(self, index: int, batch: Any, valid_B: torch.Tensor) -> tuple[Any, torch.Tensor, int]:
        """Under the model's own loss, batch ``index`` without its padding rows (at least one row
        is kept: every process runs the model, as sharded weights need), its validity flags, and
        its real row count (known on the host from the layout: no device read)."""
        real = self._valid_counts[index] if index < len(self._valid_counts) else self.full_rows
        if not self.io.own_loss or real == self.full_rows:
            return batch, valid_B, real
        rows = max(real, 1)
        return trim_rows(batch, rows, self.full_rows), valid_B[:rows], real

    def update(self, outputs: Any, targets: Any, valid_B: torch.Tensor, real: int) -> None:
        rows = int(valid_B.shape[0])
        mask_B = valid_B.float()
        self.count = self.count + mask_B.sum()
        predictions = as_float(self.io.predictions(outputs))
        if self.loss is not None and self.loss.mode == "own":
            total, terms = self.loss.own(outputs)
            for name, value in (("loss", total), *terms.items()):
                weighted = value.float() * mask_B.sum()
                self.sums[name] = self.sums[name] + weighted if name in self.sums else weighted
        elif self.loss is not None and self.loss.per_sample is not None:
            for name, values_B in self.loss.rows(self.io.field(as_float(outputs)), targets).items():
                masked = (values_B * mask_B).sum()
                self.sums[name] = self.sums[name] + masked if name in self.sums else masked
            if (weights_B := self.loss.weights(targets)) is not None:
                weight = (weights_B * mask_B).sum()
                self.weight = weight if self.weight is None else self.weight + weight
        if self.task == "classification":
            # Soft targets (label smoothing, mixup) count as their likeliest class, for accuracy and
            # for the metrics after it (a torchmetrics classifier takes class indices).
            targets = classes_B = targets.argmax(dim=1) if targets.is_floating_point() else targets
            # A negative class index is an ignored row (-100: a cross-entropy's ignore_index, a
            # Hugging Face label mask), which val_loss leaves out: so do accuracy and top-k.
            scored_B = valid_B & (classes_B >= 0)
            self.scored = self.scored + scored_B.sum().to(self.scored.dtype)
            hit_B = (predictions.argmax(dim=1) == classes_B) & scored_B
            self.correct = self.correct + hit_B.sum().to(self.correct.dtype)
            if self.top_k:
                top_BK = predictions.topk(max(self.top_k), dim=1).indices == classes_B[:, None]
                for i, k in enumerate(self.top_k):
                    hits = top_BK[:, :k].any(dim=1) & scored_B
                    self.top_correct[i] = self.top_correct[i] + hits.sum().to(self.correct.dtype)
        if self._feed_all:
            self._update_from_every_process(predictions, targets, rows)
        elif self.streaming is not None and real > 0:
            self.streaming.update(first_rows(predictions, real, rows), first_rows(targets, real, rows))
        self._batches += 1
        if self.rows is not None:
            whole_set = self.loss is not None and self.loss.mode == "whole_set"
            kept = without_caches(self.io.field(as_float(outputs))) if whole_set else predictions
            self.rows.add(pad_rows((kept, targets), rows, self.full_rows))

    def _update_from_every_process(self, predictions: Any, targets: Any, rows: int) -> None:
        check_gatherable(self.streaming, self.layout.num_processes, predictions, targets)
        leaves, spec = tree_flatten(pad_rows((predictions, targets), rows, self.full_rows))
        every = gathered(self._strategy, leaves)
        # Batch k arrives as [process 0's rows, process 1's rows, ...]; each process's real ones first.
        real = [counts[self._batches] for counts in self._every_count]
        keep = torch.cat([torch.arange(p * self.full_rows, p * self.full_rows + n) for p, n in enumerate(real)])
        if len(keep):
            preds, targs = tree_unflatten([t[keep.to(t.device)] for t in every], spec)
            self.streaming.update(preds, targs)

    def compute(
        self,
        runtime: Runtime,
        strategy: Strategy,
        label_names: Sequence[str] | None = None,
        metrics_fn: Callable[[Any, Any], dict[str, float]] | None = None,
    ) -> dict[str, float]:
        """Reduce over processes, read once, and return host floats."""
        names = list(self.sums)
        weight = [self.weight] if self.weight is not None else []
        stacked = torch.stack([self.sums[n] for n in names]
                              + [self.count, self.correct, self.scored, *self.top_correct, *weight])
        (sums,) = runtime.read([strategy.all_reduce_sum(stacked)])
        values = sums.double().tolist()
        *term_sums, count, correct, scored = values[: len(names) + 3]
        top_correct = values[len(names) + 3: len(names) + 3 + len(self.top_correct)]
        divisor = values[-1] if weight else count
        out: dict[str, float] = {name: value / divisor if divisor else math.nan for name, value in zip(names, term_sums)}
        out["num_samples"] = int(count)
        if self.task == "classification":
            # Over the rows whose target is a class: NaN where every one was ignored (no row to score).
            out["accuracy"] = correct / scored if scored else math.nan
            out.update({f"top{k}_accuracy": c / scored if scored else math.nan for k, c in zip(self.top_k, top_correct)})
        if self.streaming is not None:
            # DetectionMAP joins the processes through the strategy (a subclass whose compute() takes
            # none, through torch.distributed's group); torchmetrics' metrics sync themselves.
            through_strategy = isinstance(self.streaming, DetectionMAP) and \
                "strategy" in inspect.signature(self.streaming.compute).parameters
            found = self.streaming.compute(strategy) if through_strategy else self.streaming.compute()
            if hasattr(self.streaming, "reset"):
                self.streaming.reset()
            out.update(_metric_values(self.streaming, found, say=strategy.is_main))
        if self.rows is not None:
            outputs, targets = self.rows.result()
            if self.loss is not None and self.loss.mode == "whole_set":
                out.update(self.loss.whole_set(outputs, targets))
            if self.task == "multilabel":
                probs = torch.sigmoid(outputs)
                out.update(multilabel_auc(probs.numpy(), targets.numpy(), label_names))
            if metrics_fn is not None and self.streaming is None:
                found = metrics_fn(outputs, targets)
                if not isinstance(found, Mapping):
                    raise TypeError(
                        f"metrics_fn {metrics_fn!r} returned a {type(found).__name__}, not a mapping: return "
                        "{name: value}, e.g. {'f1': f1}; each becomes the history column val_<name>"
                    )
                out.update(metric_numbers(metrics_fn, found))
        return out


def metric_numbers(metrics_fn: Any, found: Mapping[Any, Any]) -> dict[str, float]:
    """``metrics_fn``'s result as history columns, one number each: a value that is not one number
    (a tensor of several, a string) is refused, naming the function and the key."""
    out = {}
    for key, value in found.items():
        array = isinstance(value, (torch.Tensor, np.ndarray))
        try:
            if array and math.prod(value.shape) != 1:
                raise TypeError(key)  # float() would take one element of a bigger array's only row
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            what = (f"a {type(value).__name__} of shape {tuple(value.shape)}" if array
                    else f"{type(value).__name__} {value!r:.60}")
            raise TypeError(
                f"metrics_fn {metrics_fn!r} returned {what} for {key!r}: each value becomes one history column "
                f"(val_{key}) and must be one number (a float, or a tensor of one element). Return one key per "
                f"number, e.g. {{f'{key}_{{i}}': float(v) for i, v in enumerate(values)}}"
            ) from None
    return out


def _metric_values(metric: Any, found: Any, say: bool = True) -> dict[str, float]:
    """A streaming metric's result as history columns: a mapping's numbers by name, a single
    number under the metric's class name in snake case. A float vector (a per-class figure, as
    torchmetrics gives with ``average=None``) becomes one column per element, named by the class
    ids where the result lists them under ``classes`` (as ``MeanAveragePrecision`` does), else by
    position; what is no figure (class ids, a confusion matrix) is left out, and said once (where
    ``say``: the main process)."""
    name = "".join(f"_{c.lower()}" if c.isupper() else c for c in type(metric).__name__).lstrip("_")
    items = list(found.items()) if isinstance(found, Mapping) else [(name, found)]
    classes = dict(items).get("classes")
    ids = classes.reshape(-1).tolist() if isinstance(classes, torch.Tensor) and not classes.is_floating_point() else None
    out: dict[str, float] = {}
    for key, value in items:
        key = str(key)
        if key == "classes" and ids is not None:
            continue  # the class ids: they name the per-class columns
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            if value.dim() == 1 and value.numel() and value.is_floating_point():
                labels = ids if ids is not None and len(ids) == value.numel() else range(value.numel())
                out.update({f"{key}_{label}": float(v) for label, v in zip(labels, value.tolist())})
            elif say and (type(metric).__name__, key) not in _SAID_LEFT_OUT:
                _SAID_LEFT_OUT.add((type(metric).__name__, key))
                log.warning("%s's %r is a %s tensor of shape %s, which is no history column: left out (a figure "
                            "is one number, or a float vector of one per class)", type(metric).__name__, key,
                            str(value.dtype).removeprefix("torch."), tuple(value.shape))
            continue
        out[key] = float(value)
    return out


_SAID_LEFT_OUT: set[tuple[str, str]] = set()  # streaming results said as left out (on the main process)


def trim_rows(batch: Any, rows: int, full: int) -> Any:
    """The first ``rows`` of a batch of ``full`` rows. The batch's top level holds its fields (a
    pair, a mapping, a dataclass's values); a field is a tensor (rows along dim 0), a list / tuple
    of per-row items (a detector's images and target dicts), or fields again."""
    if isinstance(batch, torch.Tensor):
        return batch[:rows] if batch.dim() > 0 and batch.shape[0] == full else batch
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: _trim_field(getattr(batch, f.name), rows, full)
                                             for f in dataclasses.fields(batch)})
    if isinstance(batch, Mapping):
        return {k: _trim_field(v, rows, full) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_trim_field(v, rows, full) for v in batch)
    return batch


def _trim_field(field: Any, rows: int, full: int) -> Any:
    if isinstance(field, (list, tuple)) and not isinstance(field, torch.Size):
        batched = all(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == full for v in field)
        if len(field) == full and not batched:
            return type(field)(field[:rows])  # one item per row
    return trim_rows(field, rows, full)


def first_rows(tree: Any, rows: int, have: int) -> Any:
    """The first ``rows`` of a model's predictions or a batch's targets (a tensor, a list of
    per-row items, or a mapping / tuple of those)."""
    if rows == have:
        return tree
    if isinstance(tree, torch.Tensor):
        return tree[:rows] if tree.dim() > 0 and tree.shape[0] == have else tree
    if isinstance(tree, Mapping):
        return {k: first_rows(v, rows, have) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree[:rows]) if len(tree) == have else type(tree)(first_rows(v, rows, have) for v in tree)
    return tree


def pad_rows(tree: Any, rows: int, full: int) -> Any:
    """Tensors of ``rows`` rows back to ``full`` (zeros after), so every process gathers one shape."""
    if rows == full:
        return tree
    def pad(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows:
            return torch.cat([t, t.new_zeros((full - rows, *t.shape[1:]))])
        return t
    return tree_map(pad, tree)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve with ties counted half (Mann-Whitney U); NaN if one class only."""
    labels = labels.astype(bool)
    num_pos = int(labels.sum())
    num_neg = labels.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(scores.size, dtype=np.float64)
    sorted_scores = scores[order]
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


def multilabel_auc(probs: np.ndarray, targets: np.ndarray, label_names: Sequence[str] | None = None) -> dict[str, float]:
    num_labels = probs.shape[1]
    names = list(label_names) if label_names is not None else [str(i) for i in range(num_labels)]
    if len(names) != num_labels:
        raise ValueError(f"label_names has {len(names)} names but the model outputs {num_labels} labels")
    aucs = {f"auc_{name}": roc_auc(probs[:, i], targets[:, i]) for i, name in enumerate(names)}
    defined = [v for v in aucs.values() if not math.isnan(v)]
    aucs["mean_auc"] = float(np.mean(defined)) if defined else math.nan
    return aucs
