"""xlatrain.tree: nested batches and outputs taken apart and put back together."""

import gc
import weakref

import torch

from xlatrain.tree import tree_flatten, tree_unflatten


def test_unflatten_keeps_no_leaf_alive_once_its_result_is_dropped():
    """A tree rebuilt and dropped frees its leaves at once, without the cyclic collector. On XLA a
    tensor still alive at the next step cut joins that graph as an output: a clean run compiled
    a new graph after warm-up whenever the collector had not yet run (a closure calling itself held
    the leaves in a reference cycle)."""
    tree = {"logits": torch.ones(4, 2), "aux": [torch.zeros(3), (torch.ones(1),)]}
    leaves, spec = tree_flatten(tree)
    copies = [leaf.float() * 2 for leaf in leaves]
    watched = [weakref.ref(c) for c in copies]
    gc.disable()
    try:
        rebuilt = tree_unflatten(copies, spec)
        assert rebuilt["aux"][1][0].shape == (1,) and torch.equal(rebuilt["logits"], torch.full((4, 2), 2.0))
        del rebuilt, copies
        assert [ref() is None for ref in watched] == [True] * len(watched)
    finally:
        gc.enable()
