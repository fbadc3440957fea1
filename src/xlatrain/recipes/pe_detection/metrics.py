"""PE-detection metrics on the host: per-label AUC and the competition's weighted log loss.

The weighted log loss (RSNA STR Pulmonary Embolism Detection, Kaggle 2020, Evaluation page):
with ``BCE(p, y) = -(y log p + (1 - y) log(1 - p))``,

- every exam ``i`` contributes ``w_j * BCE(p_ij, y_ij)`` for each of the nine exam-level labels
  ``j`` (fixed weights ``w_j``, :data:`~.labels.EXAM_LABEL_WEIGHTS`);
- every image ``k`` of exam ``i`` contributes ``w * q_i * BCE(p_ik, y_ik)`` for
  ``pe_present_on_image``, where ``w`` is :data:`~.labels.IMAGE_LABEL_WEIGHT` and
  ``q_i = m_i / n_i`` is the share of positive images in the exam (``m_i`` positive of ``n_i``);
  images of an exam without positive images therefore weigh nothing;
- the total is the sum of all contributions divided by the sum of all weights:
  ``sum_i (sum_j w_j + w * q_i * n_i)`` = ``num_exams * sum_j w_j + w * (positive images)``.

Probabilities are clipped to ``[eps, 1 - eps]`` (``eps = 1e-15``, scikit-learn's historical
``log_loss`` default) so a confident mistake costs a large finite amount. Everything is float64.

Exam-level predictions come from per-image model outputs (the model sees one slice at a time and
predicts all ten labels for it; every slice of an exam carries the exam's labels): see
:func:`exam_level_predictions`.

Shape legend: N images, S studies (exams), L labels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from xlatrain.recipes.pe_detection.labels import (
    EXAM_LABEL_WEIGHTS,
    EXAM_LABELS,
    IMAGE_LABEL,
    IMAGE_LABEL_WEIGHT,
    TARGET_NAMES,
)
from xlatrain.train.metrics import roc_auc

AGGREGATIONS = ("mean", "max")
_EXAM_WEIGHTS_L = np.array([EXAM_LABEL_WEIGHTS[name] for name in EXAM_LABELS], dtype=np.float64)


def _array(name: str, value: Any, ndim: int | tuple[int, ...]) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu", torch.float64).numpy()
    array = np.asarray(value, dtype=np.float64)
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if array.ndim not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dimension(s), got shape {array.shape}")
    return array


def _ids(study_ids: Any) -> np.ndarray:
    if isinstance(study_ids, torch.Tensor):
        study_ids = study_ids.detach().cpu().numpy()
    ids = np.asarray(study_ids)
    if ids.ndim != 1:
        raise ValueError(f"study_ids must be one id per image (1-D), got shape {ids.shape}")
    return ids


def _check_probs(name: str, probs: np.ndarray) -> None:
    if probs.size and not (np.all(probs >= 0) and np.all(probs <= 1)):  # also catches NaN
        raise ValueError(
            f"{name} must be probabilities in [0, 1] (found values from {np.nanmin(probs):g} to "
            f"{np.nanmax(probs):g}, or NaN): pass sigmoid(logits), not the logits"
        )


def _check_labels(name: str, labels: np.ndarray) -> None:
    if not np.all((labels == 0) | (labels == 1)):
        raise ValueError(f"{name} must hold 0/1 labels, found {np.unique(labels)[:10]}")


def unique_studies(study_ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """Studies in order of first appearance, and each image's row in that order.

    Returns:
        ``(studies_S, index_N)`` with ``studies_S[index_N] == study_ids``.
    """
    studies, index_N, _ = _study_layout(study_ids)
    return studies, index_N


def _study_layout(study_ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(studies_S, index_N, first_row_S)``: studies by first appearance, each image's study
    row, and the first image row of each study."""
    ids = _ids(study_ids)
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(uniq), dtype=np.int64)
    rank[order] = np.arange(len(uniq))
    return uniq[order], rank[inverse.reshape(-1)], first[order]


def exam_level_predictions(image_probs: Any, study_ids: Any, *, how: str = "mean") -> tuple[np.ndarray, np.ndarray]:
    """One prediction per study from the per-image predictions of its images.

    ``how="mean"`` (default) averages the images' probabilities. Every image of an exam is
    trained on the exam's labels, so each image's output is an estimate of the same exam-level
    probability and the mean is the least noisy combination; it is also what keeps a label that
    is *negative* for PE (``negative_exam_for_pe``) from being pushed up by one odd slice.
    ``how="max"`` takes the largest probability (the most suspicious slice), which suits "is
    there PE anywhere" questions but over-predicts every label on long exams.

    Args:
        image_probs: ``[N]`` or ``[N, L]`` probabilities, one row per image.
        study_ids: ``[N]`` study id of each image (strings or integers).
        how: ``"mean"`` or ``"max"``.

    Returns:
        ``(studies_S, exam_probs_S or exam_probs_SL)``, studies in order of first appearance.
    """
    if how not in AGGREGATIONS:
        raise ValueError(f"how={how!r} is not valid: choose one of {', '.join(map(repr, AGGREGATIONS))}")
    probs = _array("image_probs", image_probs, (1, 2))
    studies, index_N = unique_studies(study_ids)
    if len(index_N) != probs.shape[0]:
        raise ValueError(f"image_probs has {probs.shape[0]} rows but study_ids has {len(index_N)}: give one id per image")
    probs_NL = probs.reshape(probs.shape[0], -1)
    if how == "mean":
        sums_SL = np.zeros((len(studies), probs_NL.shape[1]))
        np.add.at(sums_SL, index_N, probs_NL)
        out_SL = sums_SL / np.bincount(index_N, minlength=len(studies))[:, None]
    else:
        out_SL = np.full((len(studies), probs_NL.shape[1]), -np.inf)
        np.maximum.at(out_SL, index_N, probs_NL)
    return studies, out_SL.reshape((len(studies), *probs.shape[1:]))


def exam_level_labels(image_labels: Any, study_ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """Exam-level labels, one row per study, from image rows that repeat them (as ``train.csv`` does).

    Raises ``ValueError`` when the rows of one study disagree: exam labels belong to the exam.
    """
    labels = _array("image_labels", image_labels, (1, 2))
    studies, index_N, first_row_S = _study_layout(study_ids)
    if len(index_N) != labels.shape[0]:
        raise ValueError(f"image_labels has {labels.shape[0]} rows but study_ids has {len(index_N)}: give one id per image")
    out = labels[first_row_S]
    differs = np.any(labels.reshape(len(labels), -1) != out[index_N].reshape(len(labels), -1), axis=1)
    if differs.any():
        bad = studies.tolist()[index_N[np.flatnonzero(differs)[0]]]
        raise ValueError(
            f"exam-level labels differ between images of study {bad!r}: every image of an exam must "
            "carry the same exam labels; check the CSV"
        )
    return studies, out


def _bce(probs: np.ndarray, labels: np.ndarray, eps: float) -> np.ndarray:
    p = np.clip(probs, eps, 1.0 - eps)
    return -(labels * np.log(p) + (1.0 - labels) * np.log1p(-p))


def weighted_log_loss(
    image_probs: Any,
    image_labels: Any,
    study_ids: Any,
    exam_probs: Any,
    exam_labels: Any,
    *,
    exam_study_ids: Any | None = None,
    eps: float = 1e-15,
) -> float:
    """The RSNA STR PE competition's weighted log loss (see the module docstring for the formula).

    Args:
        image_probs: ``[N]`` probabilities of ``pe_present_on_image``, one per image.
        image_labels: ``[N]`` 0/1 ``pe_present_on_image`` labels.
        study_ids: ``[N]`` study of each image; images of a study need not be contiguous.
        exam_probs: ``[S, 9]`` probabilities of the exam labels, columns in
            :data:`~.labels.EXAM_LABELS` order.
        exam_labels: ``[S, 9]`` 0/1 exam labels, same layout.
        exam_study_ids: ``[S]`` study of each exam row; by default the rows follow the studies'
            order of first appearance in ``study_ids`` (what :func:`exam_level_predictions` returns).
        eps: probabilities are clipped to ``[eps, 1 - eps]``.

    Returns:
        The loss (lower is better; predicting 0.5 everywhere scores ``ln 2`` = 0.693).
    """
    img_p = _array("image_probs", image_probs, 1)
    img_y = _array("image_labels", image_labels, 1)
    exam_p = _array("exam_probs", exam_probs, 2)
    exam_y = _array("exam_labels", exam_labels, 2)
    studies, index_N = unique_studies(study_ids)
    if not (len(img_p) == len(img_y) == len(index_N)):
        raise ValueError(
            f"image_probs ({len(img_p)}), image_labels ({len(img_y)}) and study_ids ({len(index_N)}) "
            "must have one entry per image"
        )
    num_labels = len(EXAM_LABELS)
    if exam_p.shape != exam_y.shape or exam_p.shape[1] != num_labels:
        raise ValueError(
            f"exam_probs {exam_p.shape} and exam_labels {exam_y.shape} must both be [num_studies, {num_labels}] "
            f"with columns {', '.join(EXAM_LABELS)}"
        )
    if exam_study_ids is not None:
        exam_ids = _ids(exam_study_ids)
        if len(exam_ids) != len(exam_p) or len(np.unique(exam_ids)) != len(exam_ids):
            raise ValueError("exam_study_ids must give one distinct study per exam row")
        row_of = {sid: r for r, sid in enumerate(exam_ids.tolist())}
        absent = [sid for sid in studies.tolist() if sid not in row_of]
        if absent or len(exam_ids) != len(studies):
            raise ValueError(
                f"exam rows and images cover different studies (e.g. {(absent or exam_ids.tolist())[:3]}): "
                "give exam rows for exactly the studies of the images"
            )
        take = np.array([row_of[sid] for sid in studies.tolist()], dtype=np.int64)
        exam_p, exam_y = exam_p[take], exam_y[take]
    elif len(exam_p) != len(studies):
        raise ValueError(
            f"exam_probs has {len(exam_p)} rows but the images belong to {len(studies)} studies: give one "
            "row per study, in order of first appearance in study_ids (or pass exam_study_ids)"
        )
    for name, probs in (("image_probs", img_p), ("exam_probs", exam_p)):
        _check_probs(name, probs)
    for name, labels in (("image_labels", img_y), ("exam_labels", exam_y)):
        _check_labels(name, labels)
    if not 0 < eps < 0.5:
        raise ValueError(f"eps={eps!r} is not valid: use a small positive number such as 1e-15")

    exam_loss = float((_bce(exam_p, exam_y, eps) * _EXAM_WEIGHTS_L).sum())
    num_images_S = np.bincount(index_N, minlength=len(studies)).astype(np.float64)
    num_positive_S = np.bincount(index_N, weights=img_y, minlength=len(studies))
    q_N = (num_positive_S / num_images_S)[index_N]
    image_loss = float((IMAGE_LABEL_WEIGHT * q_N * _bce(img_p, img_y, eps)).sum())
    total_weight = len(studies) * float(_EXAM_WEIGHTS_L.sum()) + IMAGE_LABEL_WEIGHT * float(q_N.sum())
    return (exam_loss + image_loss) / total_weight


def pe_metrics(
    probs: Any,
    labels: Any,
    study_ids: Any,
    *,
    how: str = "mean",
    exam_probs: Any | None = None,
    eps: float = 1e-15,
) -> dict[str, float]:
    """Per-label AUC, mean AUC and weighted log loss from per-image predictions of all ten labels.

    ``pe_present_on_image``'s AUC is over images; each exam label's AUC is over exams, from the
    aggregated exam predictions (``how``), since an exam label is one decision per exam. A label
    with a single class in the set has an undefined AUC (NaN) and is left out of ``mean_auc``.

    Args:
        probs: ``[N, 10]`` probabilities, columns in :data:`~.labels.TARGET_NAMES` order.
        labels: ``[N, 10]`` 0/1 labels, same layout (exam labels repeated on every image row).
        study_ids: ``[N]`` study of each image.
        how: how exam predictions are made from image predictions (:func:`exam_level_predictions`).
        exam_probs: ``[S, 9]`` exam predictions to use instead (studies in order of first
            appearance); the columns 1-9 of ``probs`` are then ignored.

    Returns:
        ``{"auc_<label>": ..., "mean_auc": ..., "weighted_log_loss": ...}``.
    """
    p_NL = _array("probs", probs, 2)
    y_NL = _array("labels", labels, 2)
    if p_NL.shape != y_NL.shape or p_NL.shape[1] != len(TARGET_NAMES):
        raise ValueError(
            f"probs {p_NL.shape} and labels {y_NL.shape} must both be [num_images, {len(TARGET_NAMES)}] with "
            f"columns {', '.join(TARGET_NAMES)}"
        )
    _check_probs("probs", p_NL)
    _check_labels("labels", y_NL)
    studies, exam_y_SL = exam_level_labels(y_NL[:, 1:], study_ids)
    if exam_probs is None:
        _, exam_p_SL = exam_level_predictions(p_NL[:, 1:], study_ids, how=how)
    else:
        exam_p_SL = _array("exam_probs", exam_probs, 2)
        if exam_p_SL.shape != exam_y_SL.shape:
            raise ValueError(f"exam_probs must be [{len(studies)}, {len(EXAM_LABELS)}] (one row per study), got {exam_p_SL.shape}")
        _check_probs("exam_probs", exam_p_SL)
    out = {f"auc_{IMAGE_LABEL}": roc_auc(p_NL[:, 0], y_NL[:, 0])}
    for j, name in enumerate(EXAM_LABELS):
        out[f"auc_{name}"] = roc_auc(exam_p_SL[:, j], exam_y_SL[:, j])
    defined = [v for v in out.values() if not math.isnan(v)]
    out["mean_auc"] = float(np.mean(defined)) if defined else math.nan
    out["weighted_log_loss"] = weighted_log_loss(p_NL[:, 0], y_NL[:, 0], study_ids, exam_p_SL, exam_y_SL, eps=eps)
    return out


def make_metrics_fn(study_ids: Sequence[Any] | np.ndarray, *, how: str = "mean") -> Callable[[Any, Any], dict[str, float]]:
    """A ``metrics_fn(outputs, targets) -> dict`` for the Trainer, bound to the validation studies.

    ``outputs`` are the model's raw ``[N, 10]`` logits over the whole validation set in dataset
    order, ``targets`` the matching ``[N, 10]`` labels; ``study_ids`` is the study of each
    validation item, in the same order.

    Example:
        >>> metrics_fn = make_metrics_fn(val_frame["StudyInstanceUID"].to_numpy())  # doctest: +SKIP
    """
    ids = _ids(study_ids)
    if how not in AGGREGATIONS:
        raise ValueError(f"how={how!r} is not valid: choose one of {', '.join(map(repr, AGGREGATIONS))}")

    def metrics_fn(outputs: Any, targets: Any) -> dict[str, float]:
        logits = _array("outputs", outputs, 2)
        if len(logits) != len(ids):
            raise ValueError(
                f"metrics_fn got {len(logits)} outputs but was built with {len(ids)} study ids: build it "
                "from the validation set's study ids, one per item, in dataset order"
            )
        # 1 / (1 + exp(-x)) written to stay finite for large |x|.
        probs = np.exp(-np.logaddexp(0.0, -logits))
        return pe_metrics(probs, targets, ids, how=how)

    return metrics_fn


def prior_probabilities(labels: Any, study_ids: Any) -> np.ndarray:
    """Training-set priors for the ten targets: the image label's share over images, each exam
    label's share over exams (an exam counts once however many images it has)."""
    y_NL = _array("labels", labels, 2)
    if y_NL.shape[1] != len(TARGET_NAMES):
        raise ValueError(f"labels must be [num_images, {len(TARGET_NAMES)}] with columns {', '.join(TARGET_NAMES)}")
    _check_labels("labels", y_NL)
    _, exam_y_SL = exam_level_labels(y_NL[:, 1:], study_ids)
    return np.concatenate([[y_NL[:, 0].mean()], exam_y_SL.mean(axis=0)])


def prior_baseline(
    train_labels: Any, train_study_ids: Any, val_labels: Any, val_study_ids: Any, *, eps: float = 1e-15
) -> dict[str, float]:
    """Metrics of the trivial model that predicts the training priors for every image.

    The bar a trained model must clear: its AUCs are 0.5 (constant scores) and its weighted log
    loss is what knowing only the label frequencies achieves. Same keys as :func:`pe_metrics`,
    plus ``prior_<label>`` for each prior used.
    """
    priors = prior_probabilities(train_labels, train_study_ids)
    y_NL = _array("val_labels", val_labels, 2)
    if y_NL.shape[1:] != priors.shape:
        raise ValueError(f"val_labels must be [num_images, {len(TARGET_NAMES)}] with columns {', '.join(TARGET_NAMES)}")
    num_studies = len(unique_studies(val_study_ids)[0])
    # Exam predictions given directly: averaging equal floats over exams of different lengths can
    # round differently, and those last-bit differences would turn constant scores into rankings.
    out = pe_metrics(
        np.broadcast_to(priors, y_NL.shape),
        y_NL,
        val_study_ids,
        exam_probs=np.broadcast_to(priors[1:], (num_studies, len(EXAM_LABELS))),
        eps=eps,
    )
    out.update({f"prior_{name}": float(p) for name, p in zip(TARGET_NAMES, priors)})
    return out
