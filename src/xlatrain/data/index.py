"""What a shard reader knows of its records, whatever stored them (xlatrain shards or WebDataset
tars): one module that both formats' readers import, so neither imports the other back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


class ShardError(ValueError):
    """A shard (or a record in it) is missing, truncated, corrupt or fails its checksum."""


@dataclass(kw_only=True)
class RecordIndex:
    """Every manifest record (rows of dropped shards have ``length == -1``)."""

    root: Path | str  # a local directory, or an object-storage URL
    shard_names: list[str]
    shard_bytes: list[int]
    shard: np.ndarray
    local: np.ndarray
    start: np.ndarray
    length: np.ndarray
    crc32: np.ndarray
    height: np.ndarray
    width: np.ndarray
    channels: np.ndarray
    labels: np.ndarray
    label_names: tuple[str, ...]
    group_codes: np.ndarray
    group_names: list[str]
    # (shard, records, reason) left out under on_error="skip"; a WebDataset tar counts the records found
    # before it breaks, and None where none were (one row with length -1 stands for it), or those of
    # its samples that have no image member.
    dropped: list[tuple[str, int | None, str]]
    crc_known: bool = True  # WebDataset tars store no checksums
    paths: list[str] | None = None  # each record's source, where the shards' own indexes do not hold it
