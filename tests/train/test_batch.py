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


def test_a_tensor_dataset_batch_is_gathered_whole_and_equals_its_items_stacked():
    import random

    import numpy as np
    from torch.utils.data import SequentialSampler, TensorDataset

    from xlatrain.config import TrainConfig
    from xlatrain.train.feed import Items, SeededBatches, data_loader

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(10, 3, 4, generator=g), torch.randint(0, 5, (10,), generator=g))
    keys = [(7, i) for i in (4, 0, 9)]
    whole = SeededBatches(Items(data), collate)
    item_by_item = SeededBatches(data, collate)  # not the plain Items wrapper: collated item by item
    assert whole._tensors is not None and item_by_item._tensors is None  # which path each takes
    for a, b in zip(whole.__getitems__(keys)[0], item_by_item.__getitems__(keys)[0]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # A whole epoch through the loader: the same batches either way, and the process's random
    # generators as they were (the user's model may draw from them between batches).
    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()

    class Runtime:
        pin_memory = False

    loader = data_loader(TrainConfig(batch_size=4), Runtime(), data, _Batched(SequentialSampler(data), 4))
    batches = list(loader)
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    assert torch.equal(torch.cat([b[0] for b in batches]), data.tensors[0])
    assert random.getstate() == states[0] and (np.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.get_rng_state(), states[2])


class _Batched:
    def __init__(self, sampler, loader_batch):
        self.sampler, self.loader_batch = sampler, loader_batch

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self):
        return len(self.sampler)
