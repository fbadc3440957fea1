"""collate: the fast path for tuples of tensors builds what the general tree path builds."""

import pytest
import torch

from xlatrain.train.batch import collate


def test_tuples_of_tensors_stack_column_by_column_like_any_tree():
    items = [(torch.full((2,), float(i)), torch.tensor(i)) for i in range(5)]
    fast = collate(items)
    general = collate([{"x": x, "y": y} for x, y in items])  # the tree path
    assert type(fast) is tuple and len(fast) == 2
    assert torch.equal(fast[0], general["x"]) and torch.equal(fast[1], general["y"])


def test_mixed_leaves_and_differing_items_take_the_general_path():
    mixed = collate([(torch.zeros(2), 1), (torch.ones(2), 2)])  # a number leaf becomes a tensor
    assert torch.equal(mixed[1], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="dataset items 0 and 1 of one batch differ in structure"):
        collate([(torch.zeros(2), torch.zeros(1)), (torch.zeros(2),)])
    with pytest.raises(ValueError, match=r"different shapes: \(2,\) in item 0 and \(3,\) in item 1 .*resize or pad"):
        collate([(torch.zeros(2),), (torch.zeros(3),)])
