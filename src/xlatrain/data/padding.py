"""Batches of sequences of different lengths, padded to a few lengths only.

On XLA and TorchTPU every new batch shape compiles a new graph, so a collate that pads each batch to
its own longest sequence compiles once per length it meets (dozens of graphs, each taking seconds
to minutes); on CUDA and the CPU it costs nothing. :class:`PadCollate` pads to a multiple of
``pad_to_multiple_of``, or up to the next of a few ``buckets``, so a run compiles a handful of
shapes. Hugging Face's ``DataCollatorWithPadding(tokenizer, pad_to_multiple_of=...)`` does the same
for tokenizer output.

Example:
    >>> collate = PadCollate(pad_to_multiple_of=8, pad_values={"labels": -100})
    >>> batch = collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8], "labels": [8]}])
    >>> batch["input_ids"].shape, batch["labels"][1].tolist()
    (torch.Size([2, 8]), [8, -100, -100, -100, -100, -100, -100, -100])
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from xlatrain.train.batch import collate

# Pad values by key, as Hugging Face models read them: -100 is the label their losses (and
# torch's cross_entropy) ignore; a 0 in an attention mask marks padding.
DEFAULT_PAD_VALUES = {"labels": -100, "attention_mask": 0}


class PadCollate:
    """A collate function that pads each item's sequences (lists, 1-D arrays or tensors) to one length.

    Args:
        pad_to_multiple_of: pad to the longest sequence of the batch rounded up to this multiple.
        buckets: pad to the smallest of these lengths that holds the longest sequence (a batch
            longer than the largest is an error naming it); give this or ``pad_to_multiple_of``.
        pad_values: the value each key (a tuple item's position) is padded with (default 0;
            ``labels`` and a tuple's last field -100, ``attention_mask`` 0); ``None``: the field is
            never padded, but stacked.
        max_length: cut longer sequences to this length first.
        attention_mask: the key of a mask (1 for tokens, 0 for padding) to add where the items
            have none; ``None`` adds none.

    Items are mappings (a tokenizer's output with ``input_ids``, ``labels``, ...) or tuples. The
    fields that are sequences are padded to the batch's length on the right: a 1-D field whose
    length varies from item to item, or that has each item's length of the batch's sequence
    (``input_ids``, else the first field whose length varies); a 1-D field of one size in every item
    that is not (a multi-hot target, a feature vector) is stacked, as the Trainer's default collate
    stacks the other fields. A field of one size that every item's sequence happens to match
    (a 10-wide target beside 10 tokens, likeliest in a batch of one) cannot be told apart: name it
    in ``pad_values`` with ``None``. In tuple items the last field (the targets of the Trainer's
    ``(inputs, targets)`` pairs) pads as ``labels`` do; ``pad_values`` keyed by position (0, 1, ...)
    sets a tuple field's value.
    """

    def __init__(
        self, *, pad_to_multiple_of: int | None = None, buckets: Sequence[int] | None = None,
        pad_values: Mapping[str | int, float] | None = None, max_length: int | None = None,
        attention_mask: str | None = None,
    ) -> None:
        if pad_to_multiple_of is not None and buckets is not None:
            raise ValueError("give pad_to_multiple_of or buckets, not both: both choose the padded length")
        if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r} is not valid: give a positive integer, e.g. 64")
        if buckets is not None:
            buckets = sorted(int(b) for b in buckets)
            if not buckets or buckets[0] < 1:
                raise ValueError(f"buckets={buckets!r} is not valid: give positive lengths, e.g. (128, 256, 512)")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.buckets = tuple(buckets) if buckets is not None else None
        self.pad_values = {**DEFAULT_PAD_VALUES, **(pad_values or {})}
        self._stacked = {k for k, v in self.pad_values.items() if v is None}
        self.max_length = max_length
        self.attention_mask = attention_mask

    def length(self, longest: int) -> int:
        """The padded length of a batch whose longest sequence has ``longest`` elements."""
        if self.buckets is not None:
            for bucket in self.buckets:
                if longest <= bucket:
                    return bucket
            raise ValueError(
                f"a batch holds a sequence of {longest} elements, longer than the largest bucket {self.buckets[-1]}: "
                f"add a bucket of at least {longest}, or cut sequences with max_length={self.buckets[-1]}"
            )
        if self.pad_to_multiple_of is not None:
            return -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return longest

    def __call__(self, items: Sequence[Any]) -> Any:
        first = items[0]
        if isinstance(first, Mapping):
            keys = list(first)
            columns = _sequences(items, keys, self.max_length, preferred="input_ids", stacked=self._stacked)
            width = self.length(max((len(v) for col in columns.values() for v in col), default=0))
            batch = {k: _pad(columns[k], width, self.pad_values.get(k, 0)) if k in columns
                     else collate([item[k] for item in items]) for k in keys}
            if self.attention_mask is not None and self.attention_mask not in batch and columns:
                lengths = torch.tensor([len(v) for v in next(iter(columns.values()))])
                batch[self.attention_mask] = (torch.arange(width)[None, :] < lengths[:, None]).long()
            return batch
        if isinstance(first, (tuple, list)):
            positions = list(range(len(first)))
            columns = _sequences(items, positions, self.max_length, stacked=self._stacked)
            width = self.length(max((len(v) for col in columns.values() for v in col), default=0))
            targets = len(first) - 1 if len(first) > 1 else None  # pads as labels do
            values = {i: self.pad_values.get(i, self.pad_values["labels"] if i == targets else 0) for i in columns}
            return tuple(_pad(columns[i], width, values[i]) if i in columns else collate([item[i] for item in items])
                         for i in positions)
        return collate(list(items))


def _sequences(items: Sequence[Any], fields: list[Any], max_length: int | None, preferred: Any = None,
               stacked: Collection[Any] = ()) -> dict[Any, list[torch.Tensor]]:
    """The fields of ``items`` that are sequences to pad, each as its items' 1-D tensors: those
    whose length varies from item to item, and those with each item's length of the reference
    field (``preferred`` where the items have it as a 1-D field, else the first that varies, else
    the first 1-D field); never those in ``stacked``."""
    candidates = [f for f in fields if f not in stacked and _is_sequence(items[0][f])]
    columns = {f: [_as_1d(item[f], max_length) for item in items] for f in candidates}
    lengths = {f: [len(v) for v in col] for f, col in columns.items()}
    varying = [f for f in candidates if len(set(lengths[f])) > 1]
    reference = preferred if preferred in lengths else (varying or candidates or [None])[0]
    return {f: col for f, col in columns.items() if f in varying or lengths[f] == lengths.get(reference)}


def _is_sequence(value: Any) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(value, np.ndarray):
        return value.ndim == 1
    return isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, bool, np.number)) for v in value)


def _as_1d(value: Any, max_length: int | None) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    return t[:max_length] if max_length is not None else t


def _pad(rows: list[torch.Tensor], width: int, value: float) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out
