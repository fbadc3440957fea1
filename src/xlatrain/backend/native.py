"""CPU, CUDA and TorchTPU through eager PyTorch; DDP when the process was launched by torchrun.

The device kind is data: ``cpu``, ``cuda`` or ``tpu`` (TorchTPU's device, PrivateUse1 renamed by
``torch_tpu``) pick the process-group backend, the prefetcher, autocast's device type and the
``torch.compile`` backend; the training code is the same for all three.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from xlatrain.backend.base import _b64, _unb64, host_rng_state, set_host_rng_state
from xlatrain.backend.errors import BackendUnavailableError
from xlatrain.tree import tree_map

# Collectives on the device: gloo on the CPU, NCCL on CUDA, TorchTPU's own group on TPUs.
PROCESS_GROUP = {"cpu": "gloo", "cuda": "nccl", "tpu": "tpu_dist"}
# torch.compile backends: TorchTPU's "tpu" takes static shapes only (dynamic=True raises there).
COMPILE = {"cpu": {}, "cuda": {}, "tpu": {"backend": "tpu", "dynamic": False}}


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "WORLD_SIZE" in os.environ and "RANK" in os.environ and "LOCAL_RANK" in os.environ
    )


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class NativeBackend:
    """Eager CPU, CUDA or TorchTPU; one replica per process, DDP over processes started by torchrun.

    For TorchTPU, launch as torch_tpu documents: ``eval "$(python -m torch.tpu.distributed)"``
    (its launch environment: topology and slice addresses) and then ``torchrun`` with one process
    per TPU device.
    """

    def __init__(self, device_type: str, devices: int | None = None) -> None:
        if device_type not in PROCESS_GROUP:
            raise ValueError(f"NativeBackend runs on {', '.join(map(repr, PROCESS_GROUP))}, not {device_type!r}")
        if device_type == "tpu" and torch._C._get_privateuse1_backend_name() != "tpu":
            from xlatrain.backend import runtimes

            raise runtimes.unavailable(runtimes.probe(), "torch_tpu")
        if device_type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError(
                "accelerator='cuda' was asked for but torch sees no CUDA device "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). "
                "Use accelerator='auto' to take whatever is present, or 'cpu'."
            )
        self.name = device_type
        self.platform = device_type
        self.planned_reads = 0
        distributed = launched_by_torchrun() and int(os.environ.get("WORLD_SIZE", "1")) > 1
        world = int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1
        if devices is not None and devices != world:
            hint = (
                f"launch it with `torchrun --nproc-per-node {devices} your_script.py`"
                if devices > 1
                else "leave devices unset under torchrun"
            )
            raise ValueError(
                f"devices={devices} with accelerator={device_type!r} means {devices} processes, one per "
                f"device, but this job has {world}: {hint}"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        elif device_type == "tpu":
            # TorchTPU binds each process to its device from the launch environment; the index
            # may be the global device id, so it is asked for, not computed from LOCAL_RANK.
            self.device = torch.device("tpu", torch.accelerator.current_device_index())
        else:
            self.device = torch.device("cpu")
        if distributed and not dist.is_initialized():
            dist.init_process_group(backend=PROCESS_GROUP[device_type])
            # The group this backend made is torn down while the interpreter is still whole:
            # left to interpreter shutdown, gloo's worker threads can be destroyed still running
            # and abort the process (SIGABRT) after training succeeded. A group the user made
            # is theirs to destroy.
            atexit.register(_destroy_process_group)
        # Host-side agreement (stop requests, RNG states) goes over gloo, so it never syncs the device
        # (and TorchTPU's group takes TPU tensors only).
        self._host_group = (
            dist.new_group(backend="gloo") if distributed and device_type != "cpu" else None
        )
        self._distributed = distributed
        self.world_size = world
        self.num_processes = world
        self.process_index = dist.get_rank() if distributed else 0
        self.devices_per_process = 1
        # (event, fn, host tensors) of deferred reads still in flight; CUDA only.
        self._pending: list[tuple[Any, Callable[..., None], list[torch.Tensor]]] = []

    @property
    def is_main(self) -> bool:
        return self.process_index == 0

    def describe(self) -> str:
        where = {"cuda": lambda: torch.cuda.get_device_name(self.device), "tpu": lambda: "TorchTPU"}.get(
            self.name, lambda: "CPU"
        )()
        mode = f"DDP over {self.world_size} processes" if self._distributed else "single process"
        return f"{self.name} ({where}), {mode}"

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        if self._distributed:
            ids = [self.device.index] if self.name == "cuda" else None
            return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return model

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
        return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model

    def compile(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` under ``torch.compile`` with this device's compiler (TorchTPU: backend "tpu")."""
        return torch.compile(model, **COMPILE[self.name])

    def wrap_loader(self, loader: Iterable[Any]) -> Iterable[Any]:
        if self.name == "cpu":
            return loader
        if self.name == "cuda":
            return _CudaPrefetcher(loader, self.device)
        return _AheadCopier(loader, self.device)

    def autocast(self, precision: str) -> contextlib.AbstractContextManager[Any]:
        if precision == "bf16":
            return torch.autocast(device_type=self.name, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # DDP all-reduces in backward

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._distributed:
            return tensor
        out = tensor.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(tensor) / self.world_size if self._distributed else tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._distributed:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.detach().contiguous())
        return torch.cat(parts)

    def step_begin(self, seed: int) -> None:
        pass  # eager generators are saved and restored with the checkpoint

    def step_end(self) -> None:
        if self._pending:
            self._run_ready(wait=False)

    def defer(self, fn: Callable[..., None], tensors: Sequence[torch.Tensor]) -> None:
        self.planned_reads += 1
        if self.name != "cuda":
            # CPU: the values exist now. TorchTPU has no queryable events (Event.query raises),
            # so the read waits for the device here, once per log interval.
            fn(*[t.detach().to("cpu") for t in tensors])
            return
        # Copy into pinned host memory without waiting; run fn once the copy has landed.
        host = [t.detach().to("cpu", non_blocking=True) for t in tensors]
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, fn, host))

    def read(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self._run_ready(wait=True)
        self.planned_reads += bool(tensors)
        return [t.detach().cpu() for t in tensors]

    def _run_ready(self, wait: bool) -> None:
        while self._pending:
            event, fn, host = self._pending[0]
            if not wait and not event.query():
                return
            event.synchronize()
            self._pending.pop(0)
            fn(*host)

    def barrier(self) -> None:
        if self._distributed:
            dist.barrier()

    def runtime_stats(self) -> dict[str, float]:
        return {}

    def seed_everything(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # also seeds every CUDA device

    def rng_state(self) -> dict[str, Any]:
        state = host_rng_state()
        if self.name == "cuda":
            state["cuda"] = _b64(torch.cuda.get_rng_state(self.device))
        elif self.name == "tpu":
            # 16 bytes (seed, offset) of the process's TPU generator; reading them syncs.
            state["tpu"] = _b64(torch.accelerator.random.get_rng_state())
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        set_host_rng_state(state)
        if self.name == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(_unb64(state["cuda"]), self.device)
        elif self.name == "tpu" and "tpu" in state:
            torch.tpu.set_rng_state(_unb64(state["tpu"]))

    def gather_objects(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._host_group)
        return out

    def any_process(self, flag: bool) -> bool:
        if not self._distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._host_group)
        return bool(t[0])


class _DeviceFeed:
    """Batches of ``loader`` moved to ``device``, each copy started before the previous batch is used."""

    def __init__(self, loader: Iterable[Any], device: torch.device) -> None:
        self._loader = loader
        self._device = device

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def _copy(self, t: Any) -> Any:
        return t.to(self._device, non_blocking=True) if isinstance(t, torch.Tensor) else t


class _CudaPrefetcher(_DeviceFeed):
    """Copies the next batch to the GPU on a side stream while the current one computes."""

    def __iter__(self) -> Iterator[Any]:
        stream = torch.cuda.Stream(self._device)
        pending = None
        for batch in self._loader:
            with torch.cuda.stream(stream):
                on_device = tree_map(self._copy, batch)
            copied = stream.record_event()
            if pending is not None:
                yield self._ready(*pending)
            pending = (on_device, copied)
        if pending is not None:
            yield self._ready(*pending)

    @staticmethod
    def _ready(batch: Any, copied: Any) -> Any:
        current = torch.cuda.current_stream()
        current.wait_event(copied)
        # The tensors were allocated on the side stream; tell the allocator they are used here.
        tree_map(lambda t: t.record_stream(current) if isinstance(t, torch.Tensor) else t, batch)
        return batch


class _AheadCopier(_DeviceFeed):
    """Starts the next batch's host-to-device copy (non-blocking) before the current one is used.

    For TorchTPU, whose streams and events are not usable for this yet: its non-blocking copy
    keeps the source alive and returns at once, so the copy overlaps the step.
    """

    def __iter__(self) -> Iterator[Any]:
        pending = None
        for batch in self._loader:
            on_device = tree_map(self._copy, batch)
            if pending is not None:
                yield pending
            pending = on_device
        if pending is not None:
            yield pending
