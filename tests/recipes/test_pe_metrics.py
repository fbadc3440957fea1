"""PE-detection labels and metrics: the weighted log loss on a worked example, AUC vs scikit-learn."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from xlatrain.recipes.pe_detection import (
    CARRIED_LABELS,
    EXAM_LABEL_WEIGHTS,
    EXAM_LABELS,
    IMAGE_LABEL_WEIGHT,
    TARGET_NAMES,
    exam_level_labels,
    exam_level_predictions,
    label_consistency_errors,
    make_metrics_fn,
    pe_metrics,
    prior_baseline,
    prior_probabilities,
    unique_studies,
    weighted_log_loss,
)
from xlatrain.train.metrics import roc_auc

W = EXAM_LABEL_WEIGHTS
W_IMG = IMAGE_LABEL_WEIGHT
ln = math.log


def test_label_names_and_weights():
    assert TARGET_NAMES[0] == "pe_present_on_image"
    assert TARGET_NAMES[1:] == EXAM_LABELS == (
        "negative_exam_for_pe", "indeterminate", "chronic_pe", "acute_and_chronic_pe", "central_pe",
        "leftsided_pe", "rightsided_pe", "rv_lv_ratio_gte_1", "rv_lv_ratio_lt_1",
    )  # fmt: skip
    assert CARRIED_LABELS == ("qa_motion", "qa_contrast", "flow_artifact", "true_filling_defect_not_pe")
    assert set(W) == set(EXAM_LABELS)
    assert sum(W.values()) == pytest.approx(1.0, abs=1e-9)  # the competition's exam weights sum to 1
    assert W["rv_lv_ratio_gte_1"] == 0.2346625767 and W_IMG == 0.07361963


# --- the worked example -------------------------------------------------------------------------
# Study A: three images, two positive (q_A = 2/3), a positive exam (central + left PE, RV/LV >= 1).
# Study B: two images, none positive (q_B = 0: its images weigh nothing), a negative exam.
IMAGE_STUDIES = ["A", "A", "A", "B", "B"]
IMAGE_LABELS = [1, 0, 1, 0, 0]
IMAGE_PROBS = [0.9, 0.2, 0.6, 0.3, 0.1]
#                  neg  ind  chr  a&c  cen  left right gte  lt
EXAM_LABEL_ROWS = [[0, 0, 0, 0, 1, 1, 0, 1, 0],
                   [1, 0, 0, 0, 0, 0, 0, 0, 0]]  # fmt: skip
EXAM_PROB_ROWS = [[0.1, 0.1, 0.2, 0.2, 0.7, 0.8, 0.4, 0.6, 0.4],
                  [0.8, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]]  # fmt: skip


def _hand_computed_worked_example() -> float:
    # Each term: weight * -log(probability given to the true outcome).
    exam_a = (
        W["negative_exam_for_pe"] * -ln(0.9) + W["indeterminate"] * -ln(0.9)
        + W["chronic_pe"] * -ln(0.8) + W["acute_and_chronic_pe"] * -ln(0.8)
        + W["central_pe"] * -ln(0.7) + W["leftsided_pe"] * -ln(0.8) + W["rightsided_pe"] * -ln(0.6)
        + W["rv_lv_ratio_gte_1"] * -ln(0.6) + W["rv_lv_ratio_lt_1"] * -ln(0.6)
    )  # fmt: skip
    exam_b = W["negative_exam_for_pe"] * -ln(0.8) + (sum(W.values()) - W["negative_exam_for_pe"]) * -ln(0.9)
    images_a = W_IMG * (2 / 3) * (-ln(0.9) - ln(0.8) - ln(0.6))
    images_b = 0.0  # q_B = 0
    weights = 2 * sum(W.values()) + W_IMG * (2 / 3) * 3 + W_IMG * 0 * 2
    return (exam_a + exam_b + images_a + images_b) / weights


def test_weighted_log_loss_worked_example():
    expected = _hand_computed_worked_example()
    # 0.336714 (exam A) + 0.114032 (exam B) + 0.041194 (images of A), over 2 + 2 * 0.0736196.
    assert expected == pytest.approx(0.2291036, abs=1e-7)
    got = weighted_log_loss(IMAGE_PROBS, IMAGE_LABELS, IMAGE_STUDIES, EXAM_PROB_ROWS, EXAM_LABEL_ROWS)
    assert got == pytest.approx(expected, rel=1e-12)


def test_weighted_log_loss_ignores_image_order_and_matches_a_per_exam_loop():
    rng = np.random.default_rng(0)
    num_images = 60
    studies = rng.choice(["s1", "s2", "s3", "s4", "s5"], size=num_images)
    img_y = rng.integers(0, 2, num_images)
    img_p = rng.uniform(0.01, 0.99, num_images)
    order, index = unique_studies(studies)
    exam_y = rng.integers(0, 2, (len(order), 9))
    exam_p = rng.uniform(0.01, 0.99, (len(order), 9))
    got = weighted_log_loss(img_p, img_y, studies, exam_p, exam_y)

    # The definition written as a loop over exams, the way the competition describes it.
    weights = np.array([W[name] for name in EXAM_LABELS])
    total_loss = total_weight = 0.0
    for s, study in enumerate(order):
        rows = studies == study
        q = img_y[rows].sum() / rows.sum()
        total_loss += sum(-weights[j] * (exam_y[s, j] * ln(exam_p[s, j]) + (1 - exam_y[s, j]) * ln(1 - exam_p[s, j])) for j in range(9))
        total_loss += sum(-W_IMG * q * (y * ln(p) + (1 - y) * ln(1 - p)) for y, p in zip(img_y[rows], img_p[rows]))
        total_weight += weights.sum() + W_IMG * q * rows.sum()
    assert got == pytest.approx(total_loss / total_weight, rel=1e-12)

    # Shuffled images with exam rows matched by id give the same value.
    perm = rng.permutation(num_images)
    reversed_rows = np.arange(len(order))[::-1]
    shuffled = weighted_log_loss(
        img_p[perm], img_y[perm], studies[perm], exam_p[reversed_rows], exam_y[reversed_rows],
        exam_study_ids=order[reversed_rows],
    )  # fmt: skip
    assert shuffled == pytest.approx(got, rel=1e-12)


def test_weighted_log_loss_reference_points():
    half = weighted_log_loss([0.5] * 5, IMAGE_LABELS, IMAGE_STUDIES, np.full((2, 9), 0.5), EXAM_LABEL_ROWS)
    assert half == pytest.approx(math.log(2))
    perfect = weighted_log_loss(IMAGE_LABELS, IMAGE_LABELS, IMAGE_STUDIES, EXAM_LABEL_ROWS, EXAM_LABEL_ROWS)
    assert 0 <= perfect < 1e-12  # clipped at 1e-15, so finite
    wrong = weighted_log_loss([1 - y for y in IMAGE_LABELS], IMAGE_LABELS, IMAGE_STUDIES,
                              1 - np.array(EXAM_LABEL_ROWS), EXAM_LABEL_ROWS)  # fmt: skip
    assert wrong == pytest.approx(-math.log(1e-15), rel=1e-4)


def test_weighted_log_loss_errors_name_the_fix():
    with pytest.raises(ValueError, match="not the logits"):
        weighted_log_loss([2.0, 0.2, 0.6, 0.3, 0.1], IMAGE_LABELS, IMAGE_STUDIES, EXAM_PROB_ROWS, EXAM_LABEL_ROWS)
    with pytest.raises(ValueError, match="one row per study"):
        weighted_log_loss(IMAGE_PROBS, IMAGE_LABELS, IMAGE_STUDIES, EXAM_PROB_ROWS[:1], EXAM_LABEL_ROWS[:1])
    with pytest.raises(ValueError, match="0/1"):
        weighted_log_loss(IMAGE_PROBS, [2, 0, 1, 0, 0], IMAGE_STUDIES, EXAM_PROB_ROWS, EXAM_LABEL_ROWS)
    with pytest.raises(ValueError, match="one entry per image"):
        weighted_log_loss(IMAGE_PROBS[:4], IMAGE_LABELS, IMAGE_STUDIES, EXAM_PROB_ROWS, EXAM_LABEL_ROWS)
    with pytest.raises(ValueError, match="different studies"):
        weighted_log_loss(IMAGE_PROBS, IMAGE_LABELS, IMAGE_STUDIES, EXAM_PROB_ROWS, EXAM_LABEL_ROWS, exam_study_ids=["A", "C"])


# --- aggregation --------------------------------------------------------------------------------
def test_exam_level_predictions_mean_and_max_in_first_appearance_order():
    probs = np.array([[0.2, 0.9], [0.6, 0.1], [0.4, 0.5], [0.8, 0.3]])
    studies = ["z", "a", "z", "a"]
    order, mean = exam_level_predictions(probs, studies)
    assert order.tolist() == ["z", "a"]
    np.testing.assert_allclose(mean, [[0.3, 0.7], [0.7, 0.2]])
    _, peak = exam_level_predictions(probs, studies, how="max")
    np.testing.assert_allclose(peak, [[0.4, 0.9], [0.8, 0.3]])
    _, one_column = exam_level_predictions(probs[:, 0], studies)
    np.testing.assert_allclose(one_column, [0.3, 0.7])
    with pytest.raises(ValueError, match="how="):
        exam_level_predictions(probs, studies, how="median")


def test_exam_level_labels_must_agree_within_a_study():
    studies, labels = exam_level_labels([[1, 0], [0, 1], [1, 0]], [7, 8, 7])
    assert studies.tolist() == [7, 8] and labels.tolist() == [[1, 0], [0, 1]]
    with pytest.raises(ValueError, match="study 7"):
        exam_level_labels([[1, 0], [0, 1], [0, 0]], [7, 8, 7])


# --- AUC ----------------------------------------------------------------------------------------
def test_roc_auc_matches_scikit_learn_with_ties():
    rng = np.random.default_rng(1)
    for _ in range(20):
        labels = rng.integers(0, 2, 50)
        scores = np.round(rng.uniform(size=50) + 0.3 * labels, 1)  # rounding makes ties
        assert roc_auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert math.isnan(roc_auc(np.array([0.1, 0.2]), np.array([1, 1])))


def _synthetic_split(rng: np.random.Generator, num_studies: int, informative: bool):
    """Image rows with ten labels that follow the consistency rules, and predictions."""
    rows, ids = [], []
    for s in range(num_studies):
        positive = rng.random() < 0.4
        exam = {name: 0 for name in EXAM_LABELS}
        if positive:
            exam[rng.choice(["central_pe", "leftsided_pe", "rightsided_pe"])] = 1
            exam[rng.choice(["rv_lv_ratio_gte_1", "rv_lv_ratio_lt_1"])] = 1
            exam["chronic_pe"] = int(rng.random() < 0.2)
        else:
            exam[rng.choice(["negative_exam_for_pe", "indeterminate"], p=[0.9, 0.1])] = 1
        num_images = int(rng.integers(3, 8))
        image_y = (rng.random(num_images) < 0.5).astype(int) if positive else np.zeros(num_images, int)
        if positive and image_y.sum() == 0:
            image_y[0] = 1
        assert label_consistency_errors(exam, any_positive_image=bool(image_y.any())) == []
        for y in image_y:
            rows.append([y, *[exam[name] for name in EXAM_LABELS]])
            ids.append(f"study{s}")
    labels = np.array(rows, dtype=float)
    noise = rng.uniform(0.05, 0.25, labels.shape)
    probs = np.abs(labels - noise) if informative else rng.uniform(0.05, 0.95, labels.shape)
    return labels, np.array(ids), probs


def test_pe_metrics_per_label_auc_matches_scikit_learn():
    rng = np.random.default_rng(2)
    labels, ids, probs = _synthetic_split(rng, 40, informative=False)
    metrics = pe_metrics(probs, labels, ids)
    assert metrics["auc_pe_present_on_image"] == pytest.approx(roc_auc_score(labels[:, 0], probs[:, 0]))
    _, exam_p = exam_level_predictions(probs[:, 1:], ids)
    _, exam_y = exam_level_labels(labels[:, 1:], ids)
    for j, name in enumerate(EXAM_LABELS):
        if 0 < exam_y[:, j].sum() < len(exam_y):
            assert metrics[f"auc_{name}"] == pytest.approx(roc_auc_score(exam_y[:, j], exam_p[:, j]), abs=1e-12)
        else:
            assert math.isnan(metrics[f"auc_{name}"])
    defined = [metrics[f"auc_{n}"] for n in TARGET_NAMES if not math.isnan(metrics[f"auc_{n}"])]
    assert metrics["mean_auc"] == pytest.approx(np.mean(defined))
    assert metrics["weighted_log_loss"] == pytest.approx(
        weighted_log_loss(probs[:, 0], labels[:, 0], ids, exam_p, exam_y), rel=1e-12
    )


def test_metrics_fn_takes_logits_and_checks_the_study_count():
    rng = np.random.default_rng(3)
    labels, ids, probs = _synthetic_split(rng, 12, informative=True)
    logits = np.log(probs) - np.log1p(-probs)
    metrics = make_metrics_fn(ids)(logits, labels)
    expected = pe_metrics(probs, labels, ids)
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, nan_ok=True)
    with pytest.raises(ValueError, match="dataset order"):
        make_metrics_fn(ids[:-1])(logits, labels)


def test_prior_baseline_uses_training_priors_and_a_model_beats_it():
    rng = np.random.default_rng(4)
    train_labels, train_ids, _ = _synthetic_split(rng, 60, informative=False)
    val_labels, val_ids, val_probs = _synthetic_split(rng, 30, informative=True)
    priors = prior_probabilities(train_labels, train_ids)
    assert priors[0] == pytest.approx(train_labels[:, 0].mean())
    _, train_exam = exam_level_labels(train_labels[:, 1:], train_ids)
    np.testing.assert_allclose(priors[1:], train_exam.mean(axis=0))

    baseline = prior_baseline(train_labels, train_ids, val_labels, val_ids)
    assert baseline["mean_auc"] == pytest.approx(0.5)  # constant scores
    assert baseline["prior_pe_present_on_image"] == pytest.approx(priors[0])
    model = pe_metrics(val_probs, val_labels, val_ids)
    assert model["mean_auc"] > 0.9 and model["weighted_log_loss"] < baseline["weighted_log_loss"]


def test_label_consistency_rules():
    negative = {name: 0 for name in EXAM_LABELS} | {"negative_exam_for_pe": 1}
    assert label_consistency_errors(negative, any_positive_image=False) == []
    assert label_consistency_errors(negative | {"central_pe": 1}, any_positive_image=False) == [
        "a negative exam (no positive image) cannot have central_pe"
    ]
    errors = label_consistency_errors(negative, any_positive_image=True)
    assert len(errors) == 3  # negative flag set, no RV/LV ratio, no location
    positive = {name: 0 for name in EXAM_LABELS} | {"leftsided_pe": 1, "rv_lv_ratio_lt_1": 1}
    assert label_consistency_errors(positive, any_positive_image=True) == []
    assert label_consistency_errors(positive | {"chronic_pe": 1, "acute_and_chronic_pe": 1}, True) == [
        "a positive exam has at most one of chronic_pe, acute_and_chronic_pe"
    ]
    with pytest.raises(ValueError, match="missing"):
        label_consistency_errors({"central_pe": 1}, True)
