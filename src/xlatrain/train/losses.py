"""Losses as users write them: a scalar, or named terms plus a total; per sample or per batch.
(A model that computes its own loss is read by :mod:`xlatrain.train.model_io`; evaluation then
averages its per-batch loss over the batch's real rows.) Training adds each step's loss and terms
to running sums on the device (:func:`add_to_sums`).

``loss_fn(outputs, targets)`` may return

- a scalar tensor: the loss;
- a mapping ``{"loss": total, "mask": term, "depth": term, ...}``: the total is what is
  minimised; every term is summed on the device and logged under its name
  (``train_mask``, ``val_mask``, ...).

Evaluation counts every validation sample once, so padded rows of the last batch must not
count. It uses one of two forms, chosen by a dry run on one batch before training starts:

- per sample: an ``nn`` loss module with a ``reduction`` attribute, or a function taking
  ``reduction=``, called with ``reduction="none"`` returns one value per sample (a ``[B]``
  tensor, or a mapping of them). Padded rows are masked out of on-device sums, so the validation
  loss is the mean over samples. A cross-entropy or NLL loss's mean is the one it takes itself:
  over the targets it does not ignore (``ignore_index``), weighted by ``weight``; a
  ``"batchmean"`` KL divergence sums each row. The form is used only where it averages to the
  loss's own value on the dry run's batch;
- whole set: any other loss (a Dice or an RMSE over the batch, a ``reduction="sum"``, a function
  whose unreduced values are weighted or ignore some targets). The outputs and targets of every
  real validation row are gathered to the host in dataset order (padding dropped) and the loss is
  computed once over all of them, in float32 on the CPU: exactly ``loss_fn`` over the whole
  validation set in one pass, as the user defined it.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

LossFn = Callable[[Any, Any], Any]


def loss_terms(result: Any, *, per_sample: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(total, {name: term})`` of what ``loss_fn`` returned; a clear error for anything else.

    With ``per_sample`` each value has one entry per row (``[B]``); otherwise each is a scalar.
    Only shapes are checked (host metadata): no device value is read.
    """
    if isinstance(result, Mapping):
        if "loss" not in result:
            raise ValueError(
                f"loss_fn returned a mapping with keys {', '.join(map(repr, result))} but no 'loss': "
                "return {'loss': total, 'name': term, ...}, the total being what is minimised"
            )
        total, terms = result["loss"], {str(k): v for k, v in result.items() if k != "loss"}
    else:
        total, terms = result, {}
    for name, value in (("loss", total), *terms.items()):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"loss_fn's {name!r} is a {type(value).__name__}, not a tensor: return tensors")
        if per_sample and value.dim() == 0:
            raise _ScalarUnderNone(name)
        if not per_sample and value.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar {name!r}, got shape {tuple(value.shape)}: reduce it inside "
                "loss_fn (reduction='mean', or .mean() over the batch)"
            )
        if not name.isidentifier():
            raise ValueError(f"loss term name {name!r} is not valid: use letters, digits and _ (it names a history column)")
    return total, terms


class _ScalarUnderNone(ValueError):
    """``reduction='none'`` still returned a scalar: the loss has no per-sample form."""


def per_sample_form(loss_fn: LossFn) -> LossFn | None:
    """``loss_fn`` switched to ``reduction='none'``, or ``None`` when it offers no such switch."""
    if isinstance(loss_fn, torch.nn.Module) and hasattr(loss_fn, "reduction"):
        unreduced = copy.copy(loss_fn)
        unreduced.reduction = "none"
        return unreduced
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return None
    return functools.partial(loss_fn, reduction="none") if "reduction" in params else None


def rows_mean(values: torch.Tensor) -> torch.Tensor:
    """One float32 value per row: a ``[B, ...]`` unreduced loss averaged over all but dim 0."""
    return values.float().reshape(values.shape[0], -1).mean(dim=1)


def _rows_sum(values: torch.Tensor) -> torch.Tensor:
    return values.float().reshape(values.shape[0], -1).sum(dim=1)


class _TargetWeights:
    """The weight a cross-entropy or NLL loss's ``"mean"`` gives each row: the sum over its targets
    of ``weight[target]`` (1 without ``weight``), the ignored ones (``ignore_index``, -100 unless
    set) counting 0. The mean divides the weighted sum by these, not by the row count."""

    def __init__(self, weight: torch.Tensor | None, ignore_index: int) -> None:
        self.weight, self.ignore_index = weight, ignore_index

    @classmethod
    def of(cls, loss_fn: Any) -> _TargetWeights | None:
        """For a cross-entropy or NLL module, or torch's function (bare or in a
        ``functools.partial``), that takes the mean; else None."""
        if isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)):
            return cls(loss_fn.weight, loss_fn.ignore_index) if loss_fn.reduction == "mean" else None
        func, keywords = (loss_fn.func, loss_fn.keywords) if isinstance(loss_fn, functools.partial) and not loss_fn.args \
            else (loss_fn, {})
        if func not in (torch.nn.functional.cross_entropy, torch.nn.functional.nll_loss):
            return None
        return cls(keywords.get("weight"), keywords.get("ignore_index", -100)) if keywords.get("reduction", "mean") == "mean" \
            else None

    @staticmethod
    def apply_to(targets: Any) -> bool:
        """Class indices; class probabilities take a plain mean over positions."""
        return isinstance(targets, torch.Tensor) and not targets.is_floating_point()

    def __call__(self, targets: Any) -> torch.Tensor | None:
        if not self.apply_to(targets):
            return None
        kept = targets != self.ignore_index
        if self.weight is not None and self.weight.device != targets.device:
            self.weight = self.weight.to(targets.device)  # once: a function's weights may sit on the host
        per_target = kept.float() if self.weight is None else self.weight.float()[torch.where(kept, targets, 0)] * kept
        return _rows_sum(per_target)


class EvalLoss:
    """How evaluation computes the loss: ``per_sample`` on the device, or ``whole_set`` on the host.

    Built by :meth:`choose` from one batch (the Trainer's dry run), so a loss that cannot
    evaluate is found before the first training step.
    """

    def __init__(self, loss_fn: LossFn | None, per_sample: LossFn | None,
                 own: Callable[[Any], tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = None) -> None:
        self.loss_fn = loss_fn
        self.per_sample = per_sample
        self.own = own  # the model's own loss, taken from its outputs (loss_fn=None)
        # The weight each row carries in the loss's mean (where it is not one per row).
        self.target_weights = _TargetWeights.of(loss_fn) if per_sample is not None else None
        self._batchmean = getattr(loss_fn, "reduction", None) == "batchmean"  # a KL divergence: row sums over rows
        self.note: str | None = None  # why a per-sample form was not used, where it was not

    @property
    def mode(self) -> str:
        if self.own is not None:
            return "own"
        if self.loss_fn is None:
            return "none"  # the model's evaluation returns no loss (a detector's detections)
        return "per_sample" if self.per_sample is not None else "whole_set"

    @classmethod
    def choose(cls, loss_fn: LossFn, outputs: Any, targets: Any) -> EvalLoss:
        """Try the per-sample form on one batch: where there is none, or its rows do not average
        to what ``loss_fn`` itself returns for the batch (reads two numbers on the host, before
        training), the whole set decides."""
        form = per_sample_form(loss_fn)
        if getattr(loss_fn, "reduction", "mean") not in ("mean", "batchmean"):
            form = None  # a "sum" grows with the set: only the whole set is loss_fn over it
        chosen = cls(loss_fn, form)
        if form is None:
            return chosen
        try:
            rows = chosen.rows(outputs, targets)
        except _ScalarUnderNone:
            return cls(loss_fn, None)  # a reduction attribute that the loss does not honour
        with torch.no_grad():
            own, _ = loss_terms(loss_fn(outputs, targets))
        weights = chosen.weights(targets)
        mean = rows["loss"].sum() / (weights.sum() if weights is not None else rows["loss"].shape[0])
        own_value, mean_value = float(own), float(mean)
        if math.isclose(own_value, mean_value, rel_tol=1e-3, abs_tol=1e-6) or not math.isfinite(own_value):
            return chosen
        whole = cls(loss_fn, None)
        whole.note = (f"note: val_loss is loss_fn over the whole validation set, computed on the host: its "
                      f"reduction='none' values do not average to its own value on a validation batch ({mean_value:.6g} "
                      f"against {own_value:.6g}: a sum, a weighted mean, or targets it ignores)")
        return whole

    def weights(self, targets: Any) -> torch.Tensor | None:
        """Per-sample mode: the weight of each row in the loss's mean, ``[B]``; None: one each."""
        return self.target_weights(targets) if self.target_weights is not None else None

    def rows(self, outputs: Any, targets: Any) -> dict[str, torch.Tensor]:
        """Per-sample mode: ``{"loss": [B], term: [B], ...}``, float32, each row's share of the
        loss: its mean, or its sum where the loss's mean divides by :meth:`weights` or the rows."""
        assert self.per_sample is not None
        total, terms = loss_terms(self.per_sample(outputs, targets), per_sample=True)
        weighted = self.target_weights is not None and self.target_weights.apply_to(targets)
        row = _rows_sum if self._batchmean or weighted else rows_mean
        return {"loss": row(total), **{k: row(v) for k, v in terms.items()}}

    def whole_set(self, outputs: Any, targets: Any) -> dict[str, float]:
        """Whole-set mode: the loss and its terms over every validation row at once, on the CPU."""
        loss_fn = self.loss_fn
        if isinstance(loss_fn, torch.nn.Module):
            loss_fn = copy.deepcopy(loss_fn).to("cpu")  # its buffers (class weights, ...) follow the rows
        with torch.no_grad():
            total, terms = loss_terms(loss_fn(outputs, targets))
        return {"loss": float(total), **{k: float(v) for k, v in terms.items()}}


def new_sums(term_names: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """An epoch's running sums on ``device``, at zero: the loss, the count of non-finite steps and
    each of the loss's named terms. Every sum exists from the first step, the terms included, so
    each step of an epoch has the same structure (on XLA, the same graph). Made on the host and
    sent as data: zeros made on an XLA device would be a small graph of their own to compile."""
    names = ["loss", "nonfinite", *(f"term.{t}" for t in term_names)]
    return {name: torch.zeros(()).to(device) for name in names}


def add_to_sums(sums: dict[str, torch.Tensor], values: dict[str, torch.Tensor], finite: torch.Tensor,
                *, skip: bool, group: SkippedGroup | None = None, last_micro: bool = True) -> None:
    """One micro-batch's loss and terms (``values``) into the epoch's running sums on the device,
    and whether it was non-finite into ``sums["nonfinite"]``; no read of the device. Under
    ``nan_policy='skip_step'`` (``skip``) a non-finite micro-batch adds nothing, so the means are
    over the steps that counted; with gradient accumulation, ``group`` makes that hold for whole
    accumulation groups (:class:`SkippedGroup`)."""
    if group is not None and last_micro:
        group.close(sums, values, taken=finite)
        return
    for name, value in values.items():
        sums[name] = sums[name] + (torch.where(finite, value, 0.0) if skip else value)
    sums["nonfinite"] = sums["nonfinite"] + (~finite).float()


class SkippedGroup:
    """``nan_policy='skip_step'`` under gradient accumulation: the running sums as the accumulation
    group under way began. A group whose optimizer step is skipped (a NaN/Inf loss in any of its
    micro-batches, or in the gradients' norm) puts the sums back there and counts all of its
    micro-batches as skipped; a group whose step is taken keeps them all. The means are then over
    the micro-batches whose step was taken, with no read of the device, and the micro-batches
    before a group's last run the same operations as without accumulation. A progress read due
    inside a group waits for its last micro-batch, so that no interval holds part of one (a group
    counted in one interval and taken back in the next). A group an epoch cuts short (its source
    gave fewer batches than it announced, which the run warns of) reaches no step and keeps its
    finite micro-batches in the means. Under fp16 a gradient overflow is the GradScaler's to skip
    (it lowers its scale) and is not counted here; a NaN/Inf loss is, as without fp16."""

    def __init__(self, sums: dict[str, torch.Tensor], micro_batches: int) -> None:
        self._start = dict(sums)  # the sums' tensors, never written in place: each step makes new ones
        self._micro_batches = micro_batches

    def step_taken(self, sums: dict[str, torch.Tensor], finite: torch.Tensor) -> torch.Tensor:
        """Whether the group's optimizer step is taken, before its last micro-batch joins ``sums``:
        that one's ``finite`` (its loss, and the gradients' norm but under fp16) and every earlier
        one's loss finite."""
        return finite & (sums["nonfinite"] == self._start["nonfinite"])

    def close(self, sums: dict[str, torch.Tensor], values: dict[str, torch.Tensor], *, taken: torch.Tensor) -> None:
        """The group's last micro-batch, ``taken`` the decision on its step (:meth:`step_taken`, the
        same on every process)."""
        for name, value in values.items():
            sums[name] = torch.where(taken, sums[name] + value, self._start[name])
        sums["nonfinite"] = torch.where(taken, sums["nonfinite"], self._start["nonfinite"] + self._micro_batches)
        self._start = dict(sums)
