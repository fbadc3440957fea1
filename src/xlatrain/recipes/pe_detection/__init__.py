"""PE-detection recipe: multi-label classification of CT slices (RSNA STR PE data layout).

A model sees one slice and predicts the ten scored targets (:data:`TARGET_NAMES`): whether this
slice shows PE, and the nine exam-level labels its exam carries. Exam-level predictions are the
mean over the exam's slices (:func:`exam_level_predictions`); the competition's weighted log loss
(:func:`weighted_log_loss`) and per-label AUCs score them (:func:`pe_metrics`,
:func:`make_metrics_fn`), against the trivial prior-probability model (:func:`prior_baseline`).
"""

from xlatrain.recipes.pe_detection.labels import (
    CARRIED_LABELS,
    EXAM_LABEL_WEIGHTS,
    EXAM_LABELS,
    ID_COLUMNS,
    IMAGE_COLUMN,
    IMAGE_LABEL,
    IMAGE_LABEL_WEIGHT,
    SERIES_COLUMN,
    STUDY_COLUMN,
    TARGET_NAMES,
    label_consistency_errors,
)
from xlatrain.recipes.pe_detection.metrics import (
    exam_level_labels,
    exam_level_predictions,
    make_metrics_fn,
    pe_metrics,
    prior_baseline,
    prior_probabilities,
    unique_studies,
    weighted_log_loss,
)

__all__ = [
    "CARRIED_LABELS",
    "EXAM_LABELS",
    "EXAM_LABEL_WEIGHTS",
    "ID_COLUMNS",
    "IMAGE_COLUMN",
    "IMAGE_LABEL",
    "IMAGE_LABEL_WEIGHT",
    "SERIES_COLUMN",
    "STUDY_COLUMN",
    "TARGET_NAMES",
    "exam_level_labels",
    "exam_level_predictions",
    "label_consistency_errors",
    "make_metrics_fn",
    "pe_metrics",
    "prior_baseline",
    "prior_probabilities",
    "unique_studies",
    "weighted_log_loss",
]
