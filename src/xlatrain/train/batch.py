"""Batches of any structure, and where the Trainer finds a model's inputs and the loss targets.

Dataset items may be ``(inputs, targets)`` pairs, dicts, or nested tuples / lists / dicts /
dataclasses of tensors. They are batched, moved to the device, sharded and padded as trees
(:mod:`xlatrain.tree`).

How a batch feeds the model (:class:`BatchLayout`):

- a pair ``(inputs, targets)`` (the default): ``model(inputs)``, ``loss_fn(outputs, targets)``;
- a mapping or dataclass with ``inputs=`` / ``targets=`` key names given to the Trainer:
  ``inputs="image"`` calls ``model(batch["image"])``, ``inputs=("image", "meta")`` calls
  ``model(batch["image"], batch["meta"])``; ``targets="mask"`` passes ``batch["mask"]`` to the
  loss, ``targets=("mask", "depth")`` the tuple ``(batch["mask"], batch["depth"])``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from xlatrain.tree import Spec, tree_flatten, tree_map, tree_unflatten

__all__ = ["BatchLayout", "collate", "fields_of", "num_rows", "tree_flatten", "tree_map", "tree_unflatten"]

def collate(items: Sequence[Any]) -> Any:
    """Stack a list of dataset items into one batch of the same structure.

    Tensors and NumPy arrays are stacked along a new dim 0, numbers become a 1-D tensor, strings
    stay a list. Every item must have the first item's structure.
    """
    first = items[0]
    if type(first) is tuple and all(isinstance(v, torch.Tensor) for v in first):
        # The common case, (inputs, targets) tensors as TensorDataset gives them: stacked column
        # by column without walking each item's tree (a tenth of a millisecond per batch of 64).
        width = len(first)
        if all(type(item) is tuple and len(item) == width for item in items):
            try:
                return tuple(torch.stack([item[k] for item in items]) for k in range(width))
            except (TypeError, RuntimeError):
                pass  # a non-tensor or a shape that differs: the general path names it
    specs = [tree_flatten(item) for item in items]
    first_spec = specs[0][1]
    for i, (_, spec) in enumerate(specs[1:], start=1):
        if spec != first_spec:
            where, a, b = _first_difference(first_spec, spec)
            ragged = a.startswith(("a list of", "a tuple of")) and b.startswith(("a list of", "a tuple of"))
            raise ValueError(
                f"dataset items 0 and {i} of one batch differ in structure: {where} is {a} in item 0 but {b} in item "
                f"{i}. " + (
                    "Sequences of different lengths are batched by a padding collate_fn (xlatrain.data.PadCollate, "
                    "or transformers' DataCollatorWithPadding), given as collate_fn= (and eval_collate_fn= where "
                    "evaluation batches differ)" if ragged else
                    "Every item must have the same keys, fields and nesting, an (inputs, targets) pair by default "
                    "(or give the Trainer inputs=/targets= names)")
            )
    columns = zip(*(leaves for leaves, _ in specs))
    return tree_unflatten([_stack(list(col), k) for k, col in enumerate(columns)], first_spec)


def _stack(values: list[Any], field: int = 0) -> Any:
    first = values[0]
    if isinstance(first, (torch.Tensor, np.ndarray)):
        shapes = [tuple(v.shape) for v in values]
        differs = next((i for i, shape in enumerate(shapes) if shape != shapes[0]), None)
        if differs is not None:
            raise ValueError(
                f"dataset items of one batch have tensors of different shapes: {shapes[0]} in item 0 and "
                f"{shapes[differs]} in item {differs} (field {field} of each item). Batched items must have the "
                "same shape: resize or pad them in the dataset"
            )
    if isinstance(first, torch.Tensor):
        return torch.stack(values)
    if isinstance(first, np.ndarray):
        return torch.from_numpy(np.stack(values))
    if isinstance(first, (bool, int, float, np.number)):
        return torch.tensor(values)
    return values


def _first_difference(a: Spec, b: Spec, path: str = "the item") -> tuple[str, str, str]:
    """Where two item structures first differ, and what each is there."""
    if a is None or b is None or a[0] != b[0] or a[1] != b[1] or len(a[2]) != len(b[2]):
        return path, _describe(a), _describe(b)
    kind, aux, children = a
    names = aux[1] if kind in ("dict", "dataclass") else range(len(children))
    for name, ca, cb in zip(names, children, b[2]):
        if ca != cb:
            return _first_difference(ca, cb, f"field {name!r}" if path == "the item" else f"{path}[{name!r}]")
    return path, _describe(a), _describe(b)


def _describe(spec: Spec) -> str:
    if spec is None:
        return "a value"
    kind, aux, children = spec
    if kind in ("dict", "dataclass"):
        return f"a {aux[0].__name__} with keys {', '.join(map(str, aux[1]))}"
    return f"a {aux.__name__} of {len(children)} items"


class BatchLayout:
    """Where the model's inputs and the loss targets are in a batch.

    Args:
        inputs: key(s) of the model's inputs in a mapping or dataclass batch; ``None`` for
            ``(inputs, targets)`` pairs.
        targets: key(s) of the loss targets; required with ``inputs``.
    """

    def __init__(self, inputs: str | Sequence[str] | None = None, targets: str | Sequence[str] | None = None) -> None:
        if (inputs is None) != (targets is None):
            given, missing = ("inputs", "targets") if targets is None else ("targets", "inputs")
            raise ValueError(
                f"{given}= was given without {missing}=: name both, e.g. inputs='image', "
                "targets=('mask', 'depth'), or neither for (inputs, targets) pairs"
            )
        for name, keys in (("inputs", inputs), ("targets", targets)):
            if keys is not None and not (isinstance(keys, str) or all(isinstance(k, str) for k in keys)):
                raise ValueError(f"{name}={keys!r} is not valid: give a key name or a tuple of key names")
        self.inputs = inputs
        self.targets = targets

    @property
    def keyed(self) -> bool:
        return self.inputs is not None

    def split(self, batch: Any) -> tuple[tuple[Any, ...], Any]:
        """``(model positional args, loss targets)`` of one batch."""
        if not self.keyed:
            if isinstance(batch, (list, tuple)) and len(batch) == 2:
                return (batch[0],), batch[1]
            raise ValueError(self._pair_error(batch))
        return self.model_args(batch), self._take(batch, self.targets, "targets")

    def model_args(self, batch: Any) -> tuple[Any, ...]:
        """The model's positional args from a batch (``predict`` also accepts bare inputs)."""
        if not self.keyed:
            return (batch[0],) if isinstance(batch, (list, tuple)) and len(batch) == 2 else (batch,)
        taken = self._take(batch, self.inputs, "inputs")
        return taken if isinstance(self.inputs, (list, tuple)) else (taken,)

    def _take(self, batch: Any, keys: str | Sequence[str] | None, role: str) -> Any:
        fields = fields_of(batch)
        if fields is None:
            raise ValueError(
                f"{role}={keys!r} names keys, but a batch is a {type(batch).__name__}, not a mapping or "
                "dataclass: drop inputs=/targets= for (inputs, targets) pairs"
            )
        wanted = [keys] if isinstance(keys, str) else list(keys or ())
        missing = [k for k in wanted if k not in fields]
        if missing:
            raise ValueError(
                f"{role}={keys!r}: the batch has no key {', '.join(map(repr, missing))}; its keys are "
                f"{', '.join(map(repr, fields))}"
            )
        values = tuple(fields[k] for k in wanted)
        return values[0] if isinstance(keys, str) else values

    @staticmethod
    def _pair_error(batch: Any) -> str:
        fields = fields_of(batch)
        if fields is not None:
            keys = list(fields)
            return (
                f"each batch is a {type(batch).__name__} with keys {', '.join(map(repr, keys))}: tell the Trainer "
                f"which are the model's inputs and which the loss targets, e.g. Trainer(..., "
                f"inputs={keys[0]!r}, targets={tuple(keys[1:]) if len(keys) > 2 else (keys[1] if len(keys) > 1 else 'KEY')!r})"
            )
        return (
            "each dataset item must be an (inputs, targets) pair, or a mapping / dataclass with inputs= and "
            f"targets= key names given to the Trainer; got a batch of type {type(batch).__name__}"
        )


def fields_of(batch: Any) -> dict[str, Any] | None:
    """A mapping's or dataclass's fields by name; None for any other batch."""
    if isinstance(batch, Mapping):
        return dict(batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return None


def num_rows(tree: Any) -> int:
    """Rows in a batch: dim 0 of its first tensor leaf."""
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError("the batch holds no tensor with a batch dimension")
