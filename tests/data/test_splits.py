import numpy as np
import pytest

from xlatrain.data.splits import assign_group_folds, group_kfold


def _groups(seed=0, num_groups=23):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 40, num_groups)
    return np.repeat([f"study{i:03d}" for i in range(num_groups)], sizes)


@pytest.mark.parametrize("num_folds", [2, 3, 5])
def test_no_group_is_in_both_train_and_val_and_every_record_is_validated_once(num_folds):
    groups = _groups()
    seen = []
    for fold in range(num_folds):
        train, val = group_kfold(groups, num_folds=num_folds, fold=fold)
        assert not set(groups[train]) & set(groups[val])
        assert len(train) + len(val) == len(groups) and not set(train) & set(val)
        seen += val.tolist()
    assert sorted(seen) == list(range(len(groups)))


def test_folds_are_deterministic_balanced_and_seeded():
    groups = _groups(num_groups=200)
    a = assign_group_folds(groups, num_folds=5, seed=1)
    assert np.array_equal(a, assign_group_folds(list(groups), num_folds=5, seed=1))
    counts = np.bincount(a, minlength=5)
    assert counts.max() - counts.min() <= 39  # at most one group's size apart (greedy bound)
    assert not np.array_equal(a, assign_group_folds(groups, num_folds=5, seed=2))


def test_stratify_spreads_positive_groups_over_the_folds():
    groups = np.repeat(np.arange(40), 5)
    positive = (np.arange(40) < 10).repeat(5).astype(int)  # 10 positive groups, first ones
    folds = assign_group_folds(groups, num_folds=5, stratify=positive)
    per_fold = np.bincount(folds[positive == 1], minlength=5) // 5
    assert per_fold.tolist() == [2, 2, 2, 2, 2]
    for g in range(40):
        assert len(set(folds[groups == g])) == 1


def test_bad_arguments_say_what_to_use():
    with pytest.raises(ValueError, match=r"only 2 distinct group\(s\) for num_folds=3: use num_folds <= 2"):
        group_kfold(["a", "a", "b"], num_folds=3)
    with pytest.raises(ValueError, match="fold=5 is not valid: use 0 .. 4"):
        group_kfold(_groups(), num_folds=5, fold=5)
    with pytest.raises(ValueError, match="num_folds=1"):
        group_kfold(_groups(), num_folds=1)
    with pytest.raises(ValueError, match="one per record"):
        assign_group_folds(["a", "b"], num_folds=2, stratify=[1])
