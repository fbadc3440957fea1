"""Column names and scoring weights of the RSNA STR Pulmonary Embolism Detection data.

``train.csv`` has one row per image (``SOPInstanceUID``) with the study and series it belongs
to, the image-level label ``pe_present_on_image``, and exam-level labels repeated on every row of
the exam. Ten labels are scored; four more are carried in the CSV but not scored.

The weights are the competition's (Kaggle, "RSNA STR Pulmonary Embolism Detection", Evaluation
page, 2020): one fixed weight per exam-level label, and one for the image-level label. The
exam-level weights sum to 1.
"""

from __future__ import annotations

from collections.abc import Mapping

STUDY_COLUMN = "StudyInstanceUID"
SERIES_COLUMN = "SeriesInstanceUID"
IMAGE_COLUMN = "SOPInstanceUID"
ID_COLUMNS = (STUDY_COLUMN, SERIES_COLUMN, IMAGE_COLUMN)

IMAGE_LABEL = "pe_present_on_image"

EXAM_LABELS = (
    "negative_exam_for_pe",
    "indeterminate",
    "chronic_pe",
    "acute_and_chronic_pe",
    "central_pe",
    "leftsided_pe",
    "rightsided_pe",
    "rv_lv_ratio_gte_1",
    "rv_lv_ratio_lt_1",
)

# The model's ten outputs, in the competition's order: the image label, then the exam labels.
TARGET_NAMES = (IMAGE_LABEL, *EXAM_LABELS)

# In train.csv, not scored; a data set that mirrors the real one carries them.
CARRIED_LABELS = ("qa_motion", "qa_contrast", "flow_artifact", "true_filling_defect_not_pe")

IMAGE_LABEL_WEIGHT = 0.07361963

EXAM_LABEL_WEIGHTS: Mapping[str, float] = {
    "negative_exam_for_pe": 0.0736196319,
    "indeterminate": 0.09202453988,
    "chronic_pe": 0.1042944785,
    "acute_and_chronic_pe": 0.1042944785,
    "central_pe": 0.1877300613,
    "leftsided_pe": 0.06257668712,
    "rightsided_pe": 0.06257668712,
    "rv_lv_ratio_gte_1": 0.2346625767,
    "rv_lv_ratio_lt_1": 0.0782208589,
}


def label_consistency_errors(exam: Mapping[str, float], any_positive_image: bool) -> list[str]:
    """The competition's label consistency rules that one exam breaks (empty when it keeps them).

    Works for labels (0/1) and for predictions (a value above 0.5 counts as positive). An exam is
    positive when any of its images has ``pe_present_on_image`` above 0.5.

    Positive exam: ``negative_exam_for_pe`` and ``indeterminate`` both off; exactly one of
    ``rv_lv_ratio_gte_1`` / ``rv_lv_ratio_lt_1``; at least one of ``central_pe`` /
    ``leftsided_pe`` / ``rightsided_pe``; at most one of ``chronic_pe`` / ``acute_and_chronic_pe``
    (neither means acute). Negative exam: exactly one of ``negative_exam_for_pe`` /
    ``indeterminate``, and every other exam label off.

    Example:
        >>> label_consistency_errors({name: 0 for name in EXAM_LABELS}, any_positive_image=False)
        ['a negative exam needs exactly one of negative_exam_for_pe, indeterminate']
    """
    missing = [name for name in EXAM_LABELS if name not in exam]
    if missing:
        raise ValueError(f"exam labels missing: {', '.join(missing)}; give all of {', '.join(EXAM_LABELS)}")
    on = {name: exam[name] > 0.5 for name in EXAM_LABELS}
    errors = []
    if any_positive_image:
        if on["negative_exam_for_pe"] or on["indeterminate"]:
            errors.append("a positive exam cannot be negative_exam_for_pe or indeterminate")
        if on["rv_lv_ratio_gte_1"] == on["rv_lv_ratio_lt_1"]:
            errors.append("a positive exam needs exactly one of rv_lv_ratio_gte_1, rv_lv_ratio_lt_1")
        if not (on["central_pe"] or on["leftsided_pe"] or on["rightsided_pe"]):
            errors.append("a positive exam needs at least one of central_pe, leftsided_pe, rightsided_pe")
        if on["chronic_pe"] and on["acute_and_chronic_pe"]:
            errors.append("a positive exam has at most one of chronic_pe, acute_and_chronic_pe")
    else:
        if on["negative_exam_for_pe"] == on["indeterminate"]:
            errors.append("a negative exam needs exactly one of negative_exam_for_pe, indeterminate")
        others = [name for name in EXAM_LABELS[2:] if on[name]]
        if others:
            errors.append(f"a negative exam (no positive image) cannot have {', '.join(others)}")
    return errors
