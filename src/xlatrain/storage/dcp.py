"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), stored without pickle.

DCP plans which process writes which piece of which tensor and, on load, which pieces each
process reads for the layout it has now: that is what lets a run saved by 2 processes resume in
1 or 4 (resharding). Its own file storage pickles the global metadata and ``torch.save``s each
tensor; this storage keeps DCP's planning and writes

- one safetensors file per writing process (``__<rank>.safetensors``): every chunk it holds,
  under the key ``<name>@<offset,offset,...>``;
- ``index.json``, written by the coordinating process once every file is written: each tensor's
  global shape, dtype and chunks, where each chunk lives, and every file's sha256.

Nothing is unpickled on load; safetensors and JSON only. Files go into the directory given; the
caller makes the directory visible atomically (see :func:`xlatrain.checkpoint.commit_dir`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from xlatrain.storage import write_synced

INDEX_FILE = "index.json"
INDEX_FORMAT = 1

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
)}


def _chunk_key(fqn: str, offsets: Iterable[int]) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def shard_file(process: int) -> str:
    """The file process ``process`` writes (DCP orders the save plans by process rank)."""
    return f"__{process}.safetensors"


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


class SafeShardWriter(StorageWriter):
    """DCP storage writer: one safetensors file per process and a JSON index (see the module doc)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Each process learns the file it writes from the coordinator's plan.
        return [dataclasses.replace(plan, storage_data=shard_file(i)) for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        file_name = plan.storage_data
        tensors: dict[str, torch.Tensor] = {}
        results: list[WriteResult] = []
        seen: set[int] = set()
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise ValueError(
                    f"sharded checkpoints hold tensors only, but the state has a non-tensor value at "
                    f"{item.index.fqn!r}; keep such values in the checkpoint's JSON part"
                )
            data = planner.resolve_data(item)
            assert isinstance(data, torch.Tensor)
            tensor = data.detach().to("cpu").contiguous()
            # safetensors refuses two keys over one storage (a tied weight seen twice): copy it.
            if tensor.untyped_storage().data_ptr() in seen and tensor.numel():
                tensor = tensor.clone()
            seen.add(tensor.untyped_storage().data_ptr())
            key = _chunk_key(item.index.fqn, item.index.offset or ())
            tensors[key] = tensor
            results.append(WriteResult(
                index=item.index, size_in_bytes=tensor.numel() * tensor.element_size(),
                storage_data={"file": file_name, "key": key},
            ))
        blob = st_save(tensors)
        write_synced(self.path / file_name, blob)
        digest = hashlib.sha256(blob).hexdigest()
        # The file's checksum travels to the coordinator with the results.
        results = [dataclasses.replace(r, storage_data={**r.storage_data, "sha256": digest}) for r in results]
        if not results:
            results = [WriteResult(index=MetadataIndex("__file__"), size_in_bytes=0,
                                   storage_data={"file": file_name, "key": None, "sha256": digest})]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, str] = {}
        where: list[dict[str, Any]] = []
        for per_process in results:
            for r in per_process:
                files[r.storage_data["file"]] = r.storage_data["sha256"]
                if r.storage_data["key"] is not None:
                    where.append({"fqn": r.index.fqn, "offset": list(r.index.offset or ()),
                                  "file": r.storage_data["file"], "key": r.storage_data["key"]})
        tensors: dict[str, Any] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"sharded checkpoints hold tensors only; {fqn!r} is not one")
            tensors[fqn] = {
                "dtype": str(md.properties.dtype).removeprefix("torch."),
                "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        index = {
            "format": INDEX_FORMAT,
            "version": metadata.version,
            "tensors": tensors,
            "storage": where,
            "files": files,
            "planner_data": _jsonable_planner_data(metadata.planner_data),
        }
        write_synced(self.path / INDEX_FILE, (json.dumps(index, indent=1) + "\n").encode())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path))


def _jsonable_planner_data(data: Any) -> Any:
    """DCP's default planner keeps ``{flat name: (key, key, ...)}``: tuples become lists."""
    if not isinstance(data, dict):
        return None
    try:
        return {k: list(v) for k, v in data.items()}
    except TypeError:
        return None


def read_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON index of a sharded state directory; ``ValueError`` names what is wrong."""
    file = Path(path) / INDEX_FILE
    try:
        index = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{file} is missing: the sharded state was never completed") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file} is not readable JSON ({exc})") from None
    if index.get("format") != INDEX_FORMAT:
        raise ValueError(f"{file} has format {index.get('format')!r}; this xlatrain reads format {INDEX_FORMAT}")
    return index


class SafeShardReader(StorageReader):
    """DCP storage reader for what :class:`SafeShardWriter` wrote; any process layout may read it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        self._where: dict[MetadataIndex, dict[str, Any]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        index = read_index(self.path)
        state: dict[str, Any] = {}
        for fqn, t in index["tensors"].items():
            state[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_DTYPES[t["dtype"]]),
                size=torch.Size(t["size"]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                        for c in t["chunks"]],
            )
        where = {MetadataIndex(w["fqn"], w["offset"]): {"file": w["file"], "key": w["key"]} for w in index["storage"]}
        planner_data = index.get("planner_data")
        if planner_data is not None:
            planner_data = {k: tuple(v) for k, v in planner_data.items()}
        return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=where,
                        storage_meta=StorageMeta(checkpoint_id=str(self.path)), version=index.get("version"))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._where = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[Any]] = {}
        for req in plan.items:
            by_file.setdefault(self._where[req.storage_index]["file"], []).append(req)
        for file_name, reqs in by_file.items():
            with safe_open(str(self.path / file_name), framework="pt") as f:
                for req in reqs:
                    key = self._where[req.storage_index]["key"]
                    part = f.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))]
                    target = planner.resolve_tensor(req).detach()
                    if target.shape != part.shape:
                        raise ValueError(
                            f"{self.path / file_name}: chunk {key} gives {tuple(part.shape)} where "
                            f"{tuple(target.shape)} was planned; the checkpoint is damaged"
                        )
                    target.copy_(part)
                    planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


def verify_files(path: str | os.PathLike[str], index: dict[str, Any], which: Iterable[str] | None = None) -> list[str]:
    """Files of the index (all, or ``which``) that are missing or do not match their sha256."""
    bad = []
    for name in (which if which is not None else sorted(index["files"])):
        file = Path(path) / name
        try:
            ok = sha256_file(file) == index["files"][name]
        except OSError:
            ok = False
        if not ok:
            bad.append(name)
    return bad


def consolidate(path: str | os.PathLike[str], prefix: str = "") -> dict[str, torch.Tensor]:
    """Whole tensors (those whose name starts with ``prefix``, which is stripped) from the chunks,
    on the host, in one process: what ``xlatrain export`` writes for inference."""
    path = Path(path)
    index = read_index(path)
    out = {
        fqn[len(prefix):]: torch.empty(t["size"], dtype=_DTYPES[t["dtype"]])
        for fqn, t in index["tensors"].items() if fqn.startswith(prefix)
    }
    by_file: dict[str, list[dict[str, Any]]] = {}
    for w in index["storage"]:
        if w["fqn"].startswith(prefix):
            by_file.setdefault(w["file"], []).append(w)
    for file_name, items in by_file.items():
        with safe_open(str(path / file_name), framework="pt") as f:
            for w in items:
                part = f.get_tensor(w["key"])
                region = tuple(slice(o, o + n) for o, n in zip(w["offset"], part.shape))
                out[w["fqn"][len(prefix):]][region].copy_(part)
    return out
