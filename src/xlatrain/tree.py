"""Trees of tensors: flatten to leaves and rebuild, for tuples, lists, namedtuples, mappings and
dataclasses, without registering any type globally (a user's dataclass stays the user's)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

Spec = Any  # None for a leaf, else (kind, aux, child specs)


def tree_flatten(tree: Any) -> tuple[list[Any], Spec]:
    """Leaves (tensors and anything not a container) in a fixed order, and the structure."""
    if isinstance(tree, Mapping):
        keys = list(tree)
        parts = [tree_flatten(tree[k]) for k in keys]
        return [leaf for leaves, _ in parts for leaf in leaves], ("dict", (type(tree), keys), [s for _, s in parts])
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        names = [f.name for f in dataclasses.fields(tree)]
        parts = [tree_flatten(getattr(tree, n)) for n in names]
        return [leaf for leaves, _ in parts for leaf in leaves], ("dataclass", (type(tree), names), [s for _, s in parts])
    if isinstance(tree, (tuple, list)):
        parts = [tree_flatten(v) for v in tree]
        return [leaf for leaves, _ in parts for leaf in leaves], ("seq", type(tree), [s for _, s in parts])
    return [tree], None


def tree_unflatten(leaves: Sequence[Any], spec: Spec) -> Any:
    """The inverse of :func:`tree_flatten`."""
    return _build(iter(leaves), spec)


# A module-level function, not a closure that calls itself: such a closure and its cell form a
# reference cycle that keeps the leaves alive until the cyclic collector runs. On XLA a device
# tensor still alive at the next step cut becomes an output of that graph, so when the collector
# happened to run decided which graph compiled (measured: a clean run compiled a new graph after
# warm-up in about half its runs).
def _build(it: Iterator[Any], s: Spec) -> Any:
    if s is None:
        return next(it)
    kind, aux, children = s
    values = [_build(it, c) for c in children]
    if kind == "dict":
        cls, keys = aux
        out = dict(zip(keys, values))
        return out if cls is dict else _rebuild_mapping(cls, out)
    if kind == "dataclass":
        cls, names = aux
        return cls(**dict(zip(names, values)))
    cls = aux
    if cls in (tuple, list):
        return cls(values)
    return cls(*values)  # a namedtuple


def _rebuild_mapping(cls: type, values: dict[str, Any]) -> Any:
    try:
        return cls(values)
    except TypeError:
        return values  # a mapping type that cannot be built from a dict comes back as a dict


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([fn(leaf) for leaf in leaves], spec)


def flatten_keys(
    config: Mapping[str, Any], descend: Callable[[str, Mapping[str, Any]], bool] = lambda name, value: True,
    prefix: str = "",
) -> dict[str, Any]:
    """A nested config as ``{"section.key": value}``: each mapping that ``descend(dotted name,
    mapping)`` accepts is opened into its keys; any other value, and a refused mapping, is a leaf."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and descend(name, value):
            flat.update(flatten_keys(value, descend, name + "."))
        else:
            flat[name] = value
    return flat
