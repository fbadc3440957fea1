"""CPU, CUDA and TorchTPU through eager PyTorch: one device per process.

The device kind is data: ``cpu``, ``cuda`` or ``tpu`` (TorchTPU's device, PrivateUse1 renamed by
``torch_tpu``) pick the prefetcher, autocast's device type and the ``torch.compile`` backend; the
training code is the same for all three. How the model is spread over processes is a strategy's
business (``single``, ``ddp``, ``fsdp``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from xlatrain.backend.base import _b64, _unb64, host_rng_state, seed_host, set_host_rng_state
from xlatrain.backend.errors import BackendUnavailableError
from xlatrain.backend.processes import PROCESS_GROUP
from xlatrain.tree import tree_map

# torch.compile backends: TorchTPU's "tpu" takes static shapes only (dynamic=True raises there).
COMPILE = {"cpu": {}, "cuda": {}, "tpu": {"backend": "tpu", "dynamic": False}}


class NativeRuntime:
    """Eager CPU, CUDA or TorchTPU: one device per process.

    For TorchTPU, export its launch variables (topology, slice addresses), which the module prints
    as plain ``NAME="value"`` lines, and start ``torchrun`` with one process per TPU device, in a
    subshell, so that none of the variables stay in the shell:
    ``( set -a; eval "$(python -m torch.tpu.distributed)"; set +a; torchrun --nproc-per-node N ... )``
    (or call ``torch.tpu.distributed.set_tpu_launch_env()`` in the parent process of a launcher).
    """

    trace_kind = "torch"
    evidence = None  # no compile/transfer counters beyond what torch.compile's watch reads

    def __init__(self, device_type: str) -> None:
        if device_type not in PROCESS_GROUP:
            raise ValueError(f"NativeRuntime runs on {', '.join(map(repr, PROCESS_GROUP))}, not {device_type!r}")
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
        self.kind = device_type
        self.platform = device_type
        self.autocast_device = device_type
        self.fp16 = device_type in ("cuda", "cpu")
        self.pin_memory = device_type == "cuda"
        self.measures_step_memory = device_type == "cuda"
        self.planned_reads = 0
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
        # (event, fn, host tensors) of deferred reads still in flight; CUDA only.
        self._pending: list[tuple[Any, Callable[..., None], list[torch.Tensor]]] = []

    def describe(self) -> str:
        where = {"cuda": lambda: torch.cuda.get_device_name(self.device), "tpu": lambda: "TorchTPU"}.get(
            self.kind, lambda: "CPU"
        )()
        return f"{self.kind} ({where})"

    def notes(self, compiled: bool) -> list[str]:
        if self.kind != "tpu":
            return []
        from xlatrain.backend.runtimes import torch_tpu_notes

        mode = getattr(torch.tpu.eager_mode, "name", str(torch.tpu.eager_mode))  # type: ignore[attr-defined]
        return torch_tpu_notes(mode, torch.get_float32_matmul_precision(), compiled)

    def compile(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` under ``torch.compile`` with this device's compiler (TorchTPU: backend "tpu")."""
        return torch.compile(model, **COMPILE[self.kind])

    def wrap_loader(self, loader: Iterable[Any], sharding: Any = None) -> Iterable[Any]:
        if self.kind == "cpu":
            return loader
        if self.kind == "cuda":
            return _CudaPrefetcher(loader, self.device)
        return _AheadCopier(loader, self.device)

    def step_begin(self, seed: int) -> None:
        pass  # eager generators are saved and restored with the checkpoint

    def step_end(self) -> None:
        if self._pending:
            self._run_ready(wait=False)

    def defer(self, fn: Callable[..., None], tensors: Sequence[torch.Tensor]) -> None:
        self.planned_reads += bool(tensors)
        if self.kind != "cuda":
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

    def peak_flops(self, dtype: torch.dtype) -> tuple[float, str] | None:
        """Dense peak FLOP/s of this device in ``dtype`` (float32, bfloat16 or float16), and its source."""
        from xlatrain.backend.hardware import spec_for_name, tpu_spec

        spec = None
        if self.kind == "cuda":
            spec = spec_for_name(torch.cuda.get_device_name(self.device))
        elif self.kind == "tpu":
            spec = tpu_spec()
        if spec is not None:
            rate = spec.peak_bf16 if dtype != torch.float32 or spec.peak_fp32 is None else spec.peak_fp32
            return rate, spec.source
        if self.kind != "cpu" or dtype == torch.float16:
            # A GPU or TPU the table does not know, or float16 on a CPU (no fast kernels: a
            # 2048^2 matmul takes seconds): no figure rather than a wrong or slow one.
            return None
        from xlatrain.backend.peak import measured_peak

        return measured_peak(self.device, dtype, lambda t: None, "cpu")

    def memory_capacity(self) -> tuple[int, str] | None:
        """Bytes the device can hold, and where the figure comes from."""
        if self.kind == "cuda":
            return torch.cuda.mem_get_info(self.device)[1], f"{torch.cuda.get_device_name(self.device)} (CUDA)"
        if self.kind == "tpu":
            # TorchTPU's allocator: (free, limit) of this device.
            limit = torch.accelerator.get_memory_info()[1]
            return (limit, "TorchTPU's memory limit for this device") if limit else None
        from xlatrain.backend.hardware import host_memory_available

        available = host_memory_available()
        if not available:
            return None
        # The processes torchrun started on this host share its memory.
        local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
        shared = f", shared by {local} processes" if local > 1 else ""
        return available // local, f"the host's available memory{shared}"

    def reset_memory_peak(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_memory(self, step: Callable[[], None]) -> int | None:
        if self.kind != "cuda":
            return None  # the CPU's allocator keeps no peak of its own; TorchTPU's compiles first
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            step()
            torch.cuda.synchronize(self.device)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None
        finally:
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def memory_peak(self) -> tuple[int, str] | None:
        """The most memory held on the device since the last reset (the fit's start, or the end of
        the measured pass before its first step), and what that figure is."""
        if self.kind == "cuda":
            return (torch.cuda.max_memory_allocated(self.device),
                    "CUDA's peak allocated in the fit (a measured pass before the first step left out)")
        if self.kind == "tpu":
            stats = torch.accelerator.memory_stats()
            peak = stats.get("active_bytes.all.peak")
            return (int(peak), "TorchTPU's peak bytes in use") if peak else None
        import resource

        # ru_maxrss is in KiB on Linux: the whole process's peak, Python and libraries included.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "the process's peak resident memory"

    def planned_transfers(self) -> contextlib.AbstractContextManager[None]:
        """Device reads inside are planned ones (nothing to count: diagnostics count XLA's only)."""
        return contextlib.nullcontext()

    def runtime_stats(self) -> dict[str, float]:
        return {}

    def seed_everything(self, seed: int) -> None:
        seed_host(seed)

    def rng_state(self) -> dict[str, Any]:
        state = host_rng_state()
        if self.kind == "cuda":
            state["cuda"] = _b64(torch.cuda.get_rng_state(self.device))
        elif self.kind == "tpu":
            # 16 bytes (seed, offset) of the process's TPU generator; reading them syncs.
            state["tpu"] = _b64(torch.accelerator.random.get_rng_state())
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        set_host_rng_state(state)
        if self.kind == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(_unb64(state["cuda"]), self.device)
        elif self.kind == "tpu" and "tpu" in state:
            torch.tpu.set_rng_state(_unb64(state["tpu"]))


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
    """Copies the next batch to the GPU on a side stream while the current one computes; the
    compute stream waits for the copy's event before the step that uses it.

    Every batch takes the side stream. Copying small page-locked batches on the compute stream
    instead, one batch ahead, saved the launching thread 0.24 ms a batch on an H200 host (the PE
    recipe's 4 MiB batches), but it held the 85M LM benchmark, compiled, at 0.68-0.89 of the hand
    loop's tokens/s on an H200 in three runs, where the side stream gave 1.00-1.07 on the same
    machine just before the 0.68-0.73 (benchmarks/cuda/NVIDIA-H200-2026-11-28.log); why was not
    found. A pageable batch could never go on the compute stream: CUDA synchronizes the stream a
    pageable copy is issued on, which would make the host wait for every step queued before it."""

    def __iter__(self) -> Iterator[Any]:
        stream = torch.cuda.Stream(self._device)
        pending = None
        for batch in self._loader:
            with torch.cuda.stream(stream):
                on_device = tree_map(self._copy, batch)
            ready = (on_device, stream.record_event())
            if pending is not None:
                yield self._ready(*pending)
            pending = ready
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
