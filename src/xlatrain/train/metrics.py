"""Evaluation metrics: summed on the device per batch, read on the host once per evaluation.

Padding rows (see ``data.sampling.EvalSampler``) carry ``valid == False`` and are masked out of
every sum, so each real sample counts exactly once whatever the batch and device count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from xlatrain.backend.base import Runtime, Strategy
from xlatrain.data.sampling import EvalSampler
from xlatrain.train.batch import tree_flatten, tree_map, tree_unflatten
from xlatrain.train.losses import EvalLoss


def infer_task(loss_fn: Any) -> str:
    """``classification`` for cross-entropy, ``multilabel`` for BCE-with-logits, else ``none``."""
    if isinstance(loss_fn, torch.nn.CrossEntropyLoss) or loss_fn is torch.nn.functional.cross_entropy:
        return "classification"
    if isinstance(loss_fn, torch.nn.BCEWithLogitsLoss) or (
        loss_fn is torch.nn.functional.binary_cross_entropy_with_logits
    ):
        return "multilabel"
    return "none"


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
        self._runtime.defer(lambda *ts: slot.extend(ts), [self._strategy.all_gather(t.detach()) for t in leaves])

    def result(self) -> Any:
        self._runtime.read([])  # run any deferred copies still in flight
        lay = self._layout
        indices = [lay.indices(p).reshape(lay.steps, lay.loader_batch) for p in range(lay.num_processes)]
        # Batch k arrives as [process 0's rows, process 1's rows, ...].
        order = torch.cat([torch.cat([idx[k] for idx in indices]) for k in range(len(self._host))])
        real = order < lay.num_samples
        columns = []
        for i in range(len(self._host[0])):
            col = torch.cat([batch[i] for batch in self._host])
            out = torch.empty((lay.num_samples, *col.shape[1:]), dtype=col.dtype)
            out[order[real]] = col[real]
            columns.append(out)
        return tree_unflatten(columns, self._spec)


def as_float(tree: Any) -> Any:
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


class EvalAccumulator:
    """Running sums for one evaluation pass, kept on the device.

    In per-sample mode the loss and each of its terms are summed per batch over real rows (and
    accuracy for classification). Outputs and targets go to the host only when something needs
    every row: a whole-set loss, multilabel AUC, ``metrics_fn``.
    """

    def __init__(
        self, task: str, device: torch.device, loss: EvalLoss, rows: RowCollector | None, top_k: Sequence[int] = ()
    ) -> None:
        self.task = task
        self.top_k = list(top_k) if task == "classification" else []
        self.loss = loss
        self.sums: dict[str, torch.Tensor] = {}
        self.count = torch.zeros((), device=device)
        self.correct = torch.zeros((), device=device)
        self.top_correct = [torch.zeros((), device=device) for _ in self.top_k]
        self.rows = rows

    def update(self, outputs: Any, targets: Any, valid_B: torch.Tensor) -> None:
        mask_B = valid_B.float()
        self.count = self.count + mask_B.sum()
        if self.loss.per_sample is not None:
            for name, values_B in self.loss.rows(outputs, targets).items():
                masked = (values_B * mask_B).sum()
                self.sums[name] = self.sums[name] + masked if name in self.sums else masked
        if self.task == "classification":
            if targets.is_floating_point():  # soft targets (label smoothing, mixup): their likeliest class
                targets = targets.argmax(dim=1)
            hit_B = (outputs.argmax(dim=1) == targets) & valid_B
            self.correct = self.correct + hit_B.sum().to(self.correct.dtype)
            if self.top_k:
                top_BK = outputs.topk(max(self.top_k), dim=1).indices == targets[:, None]
                for i, k in enumerate(self.top_k):
                    hits = top_BK[:, :k].any(dim=1) & valid_B
                    self.top_correct[i] = self.top_correct[i] + hits.sum().to(self.correct.dtype)
        if self.rows is not None:
            self.rows.add((outputs, targets))

    def compute(
        self,
        runtime: Runtime,
        strategy: Strategy,
        label_names: Sequence[str] | None = None,
        metrics_fn: Callable[[Any, Any], dict[str, float]] | None = None,
    ) -> dict[str, float]:
        """Reduce over processes, read once, and return host floats."""
        names = list(self.sums)
        stacked = torch.stack([self.sums[n] for n in names] + [self.count, self.correct, *self.top_correct])
        (sums,) = runtime.read([strategy.all_reduce_sum(stacked)])
        values = sums.double().tolist()
        *term_sums, count, correct = values[: len(names) + 2]
        top_correct = values[len(names) + 2:]
        out: dict[str, float] = {name: value / count for name, value in zip(names, term_sums)}
        out["num_samples"] = int(count)
        if self.task == "classification":
            out["accuracy"] = correct / count
            out.update({f"top{k}_accuracy": c / count for k, c in zip(self.top_k, top_correct)})
        if self.rows is not None:
            outputs, targets = self.rows.result()
            if self.loss.per_sample is None:
                out.update(self.loss.whole_set(outputs, targets))
            if self.task == "multilabel":
                probs = torch.sigmoid(outputs)
                out.update(multilabel_auc(probs.numpy(), targets.numpy(), label_names))
            if metrics_fn is not None:
                found = metrics_fn(outputs, targets)
                if not isinstance(found, Mapping):
                    raise TypeError(
                        f"metrics_fn {metrics_fn!r} returned a {type(found).__name__}, not a mapping: return "
                        "{name: value}, e.g. {'f1': f1}; each becomes the history column val_<name>"
                    )
                out.update({k: float(v) for k, v in found.items()})
        return out


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
