"""Group k-fold: folds by group key (patient, study), so no group is on both sides of a split.

CT slices of one study are near-duplicates; a random split that puts some in training and the
rest in validation measures memory, not generalisation. Folds here are balanced by record count
(largest groups first, each to the fold with the fewest records so far -- optionally per stratum
first), and are a pure function of the groups and ``seed``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np


def _codes(values: Sequence[Hashable] | np.ndarray) -> tuple[np.ndarray, int]:
    """Per-record group code, numbered in order of first appearance (no hashing order involved)."""
    codes: dict[Any, int] = {}
    out = np.fromiter((codes.setdefault(v, len(codes)) for v in np.asarray(values, dtype=object).tolist()), dtype=np.int64)
    return out, len(codes)


def assign_group_folds(
    groups: Sequence[Hashable] | np.ndarray,
    *,
    num_folds: int = 5,
    seed: int = 0,
    stratify: Sequence[Any] | np.ndarray | None = None,
) -> np.ndarray:
    """The fold (``0 .. num_folds - 1``) of every record; all records of a group share one.

    Args:
        groups: one group key per record (e.g. ``ShardDataset.groups``).
        num_folds: number of folds (at least 2, at most the number of groups).
        seed: orders groups of equal size; the same seed gives the same folds.
        stratify: optional value per record (e.g. a binary label); a group's stratum is its
            largest value (a study with any positive slice is positive), and every stratum is
            spread evenly over the folds.
    """
    if isinstance(num_folds, bool) or not isinstance(num_folds, int) or num_folds < 2:
        raise ValueError(f"num_folds={num_folds!r} is not valid: use 2 or more folds")
    codes, num_groups = _codes(groups)
    if num_groups < num_folds:
        raise ValueError(
            f"only {num_groups} distinct group(s) for num_folds={num_folds}: use num_folds <= {num_groups} "
            "(or more groups); a fold without a group would be empty"
        )
    sizes = np.bincount(codes, minlength=num_groups)
    if stratify is None:
        strata = np.zeros(num_groups, dtype=np.int64)
    else:
        values = np.asarray(stratify)
        if len(values) != len(codes):
            raise ValueError(f"stratify has {len(values)} values for {len(codes)} records: give one per record")
        value_codes = np.unique(values, return_inverse=True)[1].reshape(-1)
        strata = np.full(num_groups, -1, dtype=np.int64)
        np.maximum.at(strata, codes, value_codes)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed % 2**63, 0x6B666F6C64])))
    shuffled = rng.permutation(num_groups)
    # Largest groups first (longest-processing-time greedy); ties in the seeded order.
    order = shuffled[np.argsort(-sizes[shuffled], kind="stable")]
    fold_of_group = np.empty(num_groups, dtype=np.int64)
    totals = [0] * num_folds
    for stratum in np.unique(strata):
        in_stratum = [0] * num_folds
        for g in order[strata[order] == stratum].tolist():
            best = min(range(num_folds), key=lambda f: (in_stratum[f], totals[f], f))
            fold_of_group[g] = best
            in_stratum[best] += int(sizes[g])
            totals[best] += int(sizes[g])
    return fold_of_group[codes]


def group_kfold(
    groups: Sequence[Hashable] | np.ndarray,
    *,
    num_folds: int = 5,
    fold: int = 0,
    seed: int = 0,
    stratify: Sequence[Any] | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(train_indices, val_indices)`` of fold ``fold``: sorted record positions, no group in both.

    Example:
        >>> full = ShardDataset("shards/", image_size=128)
        >>> train_ids, val_ids = group_kfold(full.groups, num_folds=5, fold=0)
        >>> train, val = full.subset(train_ids), full.subset(val_ids)
    """
    if isinstance(fold, bool) or not isinstance(fold, int) or not 0 <= fold < num_folds:
        raise ValueError(f"fold={fold!r} is not valid: use 0 .. {num_folds - 1} for num_folds={num_folds}")
    folds = assign_group_folds(groups, num_folds=num_folds, seed=seed, stratify=stratify)
    return np.flatnonzero(folds != fold), np.flatnonzero(folds == fold)
