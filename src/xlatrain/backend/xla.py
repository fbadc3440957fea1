"""torch_xla's runtime: TPUs, and XLA:CPU to rehearse a TPU program without one.

Lazy tensors traced into one graph per step, cut at each step's end; host reads through step
closures; batches sharded onto the devices by torch_xla's loader threads. How the model is spread
is a strategy's business: ``spmd.py`` (one process per host over a ``data`` or ``fsdp`` mesh, the
default) or ``xla_processes.py`` (one process per chip, started by :func:`spawn`).

torch_xla is imported only inside this module's functions, so ``import xlatrain`` works without it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from xlatrain.backend.base import host_rng_state, seed_host, set_host_rng_state
from xlatrain.backend.errors import BackendUnavailableError
from xlatrain.backend.hardware import default_cache_dir, find_tpu_chips


def tpu_chip_count() -> int:
    """TPU chips attached to this host, found on the PCI bus without starting any runtime."""
    return len(find_tpu_chips())


def tpu_present() -> bool:
    return os.environ.get("PJRT_DEVICE", "").upper() == "TPU" or tpu_chip_count() > 0


def configure_runtime(devices: int | None) -> None:
    """Choose the PJRT device (and the XLA:CPU device count) before the runtime starts.

    Without a TPU and with ``PJRT_DEVICE`` unset, torch_xla would fall back to CPU with a warning;
    this makes that choice explicit. ``CPU_NUM_DEVICES`` is what creates N virtual XLA:CPU devices.
    """
    if "PJRT_DEVICE" not in os.environ:  # set before torch_xla is imported, which reads it
        os.environ["PJRT_DEVICE"] = "TPU" if tpu_chip_count() > 0 else "CPU"
    if os.environ["PJRT_DEVICE"].upper() == "CPU":
        cpu_runtime_defaults(os.environ, torch_xla_imported="torch_xla" in sys.modules)
    import torch_xla

    if torch_xla._XLAC._xla_runtime_is_initialized():
        return
    if os.environ["PJRT_DEVICE"].upper() == "CPU":
        os.environ["CPU_NUM_DEVICES"] = str(devices or int(os.environ.get("CPU_NUM_DEVICES", "1")))


def cpu_runtime_defaults(env: MutableMapping[str, str], torch_xla_imported: bool) -> None:
    """Settings for XLA:CPU that the user has not chosen, written into ``env`` before torch_xla reads them.

    - ``XLA_ENABLE_PARAM_ALIASING=0``: XLA:CPU frees a parameter buffer donated to a step only
      once that step has run, and the thread that launched the step waits for it, so the host
      cannot trace step N+1 while step N runs. Donation saves device memory; on the CPU that
      is host memory. TPUs keep donating.
    - ``TF_CPP_MIN_LOG_LEVEL=2``: torch_xla's C++ warnings off, errors still shown. On XLA:CPU
      they repeat at every compilation: XLA's notice that GSPMD sharding propagation will be
      deprecated (each SPMD graph), and "Failed to deserialize executable" for each graph
      looked up in the persistent cache, which XLA:CPU cannot load (the run's counters still
      record that). It is the narrowest switch the C++ logging has (only a minimum level), so
      every other C++ warning goes too; ``TF_CPP_MIN_LOG_LEVEL=1`` brings them all back. Left
      alone once torch_xla is imported: it has set its own default and there is no telling
      whether the user chose the value.
    """
    env.setdefault("XLA_ENABLE_PARAM_ALIASING", "0")
    if not torch_xla_imported:
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), devices: int | None = None) -> None:
    """Run ``fn(index, *args)`` once per local chip, the one-process-per-chip way.

    Inside ``fn`` build the Trainer with ``BackendConfig(accelerator="xla", xla_mode="multiprocess")``.
    torch_xla chooses the process count from the devices present (``nprocs`` other than 1 or None
    is an error in torch_xla 2.x, so it is never passed).
    """
    configure_runtime(devices)
    import torch_xla.distributed.xla_multiprocessing as xmp

    with forwarding_stop_signals():
        xmp.spawn(functools.partial(_stoppable, fn), args=args)


def _stoppable(fn: Callable[..., Any], index: int, *args: Any) -> None:
    """``fn`` in a process of torch_xla's pool: a run stopped by SIGTERM ends with SystemExit(0),
    which would break the pool (torch_xla reports the process as terminated abruptly); it returns
    instead, so the launch exits 0 as the process did."""
    try:
        fn(index, *args)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise


@contextlib.contextmanager
def forwarding_stop_signals() -> Iterator[None]:
    """While the processes it started train, the launching process passes a SIGTERM or SIGINT it
    gets on to them and waits for them, instead of dying first and leaving them running.

    torch_xla runs each process's training in a thread of its own (thread per device), where no
    signal handler can be installed: a forwarded SIGTERM ends a process without a checkpoint of
    its step, the launch then fails (exit 1), ``status.json`` still says ``running``, and the same
    command resumes from the last periodic or epoch checkpoint. A stop a peer agreed on (raised
    as SystemExit(0) in its thread) ends that process cleanly (see :func:`_stoppable`)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for pid, cmdline in _children():
            if "resource_tracker" not in cmdline:  # multiprocessing's helper, not a training process
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _children() -> list[tuple[int, str]]:
    """(pid, command line) of this process's direct children, from /proc (TPU hosts run Linux)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid():
                found.append((int(entry), open(f"/proc/{entry}/cmdline").read().replace("\0", " ")))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return found


BF16_SWITCHES = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")


class XlaRuntime:
    """torch_xla's lazy tensors on a TPU, or on XLA:CPU to rehearse a TPU program.

    Args:
        devices: devices expected (virtual XLA:CPU devices to create without a TPU).
        spmd: one process drives every local device through SPMD meshes (the strategies in
            ``spmd.py``); otherwise one process per device (``xla_processes.py``).
    """

    kind = "xla"
    trace_kind = "xla"
    autocast_device = "xla"
    fp16 = False
    pin_memory = False
    measures_step_memory = False

    def notes(self, compiled: bool) -> list[str]:
        # The tutorials' bf16 switches, still honoured by torch_xla 2.9's runtime: the run's
        # "precision 32" would be untrue, and nothing else shows it (dtype reads float32).
        on = [n for n in BF16_SWITCHES if os.environ.get(n, "").strip().lower() not in ("", "0", "false", "no", "off")]
        if not on:
            return []
        return [f"{on[0]}={os.environ[on[0]]} is set: torch_xla stores every float32 tensor as bfloat16 on the "
                "device (weights, optimizer state and loss sums included) while its dtype still reads float32, "
                "so this run trains in bfloat16 whatever its precision says; unset it and use precision='bf16' "
                "(autocast: bfloat16 matmuls and convolutions, float32 weights and sums)"]

    def __init__(
        self, devices: int | None = None, spmd: bool = True, require_tpu: bool = False, compile_cache: bool = True
    ) -> None:
        if require_tpu and not tpu_present():
            raise BackendUnavailableError(
                "accelerator='tpu' was asked for but this host has no TPU (no Google TPU device on "
                f"the PCI bus, PJRT_DEVICE={os.environ.get('PJRT_DEVICE', '<unset>')}). Use "
                "accelerator='xla' with devices=N to rehearse the run on N virtual XLA:CPU devices, "
                "or accelerator='auto' to take what is present."
            )
        configure_runtime(devices)
        import torch_xla
        import torch_xla.runtime as xr

        from xlatrain.diagnostics import xla_metrics

        self.compile_cache_dir = _start_compile_cache(spmd) if compile_cache else None
        self.spmd = spmd
        if spmd:
            xr.use_spmd()  # before any tensor exists on the device
            self.num_devices = xr.global_runtime_device_count()
        else:
            self.num_devices = xr.world_size()
        _check_count(devices, self.num_devices, spmd)
        self.device = torch_xla.device()
        self._device_type = xr.device_type() or "CPU"
        self.planned_reads = 0  # host reads made through defer/read
        self._own_stats: dict[str, float] = {}  # what peak_flops's own measurement compiled: not the run's
        self._counting = False  # inside planned_transfers, which counts the reads itself
        # XLA:CPU is this host's CPU: diagnostics judge it as a CPU, not as an accelerator.
        kind = self._device_type.upper()
        self.platform = {"TPU": "tpu", "CUDA": "cuda", "GPU": "cuda"}.get(kind, kind.lower())
        self.evidence = xla_metrics  # compilations, transfers, fallbacks: read by diagnostics

    def describe(self) -> str:
        return f"xla ({self._device_type}, {self.num_devices} device(s))"

    def compile(self, model: torch.nn.Module) -> torch.nn.Module:
        raise ValueError(
            "compile=True runs the model under torch.compile on CPU, CUDA and TorchTPU; torch_xla "
            "already compiles every step (lazy tensors): leave compile off with accelerator='xla'"
        )

    def wrap_loader(self, loader: Iterable[Any], sharding: Any = None) -> Iterable[Any]:
        return _DeviceLoader(loader, self.device, sharding)

    def step_begin(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm

        # The seed enters the graph as device data, not a constant: no recompilation.
        xm.set_rng_state(seed)

    def step_end(self) -> None:
        import torch_xla

        torch_xla.sync()

    def defer(self, fn: Callable[..., None], tensors: Sequence[torch.Tensor]) -> None:
        import torch_xla.core.xla_model as xm

        self.planned_reads += bool(tensors)  # diagnostics tell these apart from reads the user's code makes
        # Runs after the step's graph has executed: one transfer for all tensors, no extra compile.
        xm.add_step_closure(lambda *ts: fn(*xm._maybe_convert_to_cpu(list(ts))), args=tuple(tensors))

    def read(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        self.planned_reads += bool(tensors) and not self._counting
        # One transfer for the whole list (what xm.save uses), not one per tensor.
        return list(xm._maybe_convert_to_cpu(list(tensors))) if tensors else []

    def peak_flops(self, dtype: torch.dtype) -> tuple[float, str] | None:
        """Dense peak FLOP/s of one device: a TPU's published figure, else (XLA:CPU) measured."""
        from xlatrain.backend.hardware import tpu_spec

        if self.platform == "tpu":
            spec = tpu_spec()
            return (spec.peak_bf16, spec.source) if spec is not None else None
        if self.platform != "cpu":
            return None
        import torch_xla.core.xla_model as xm
        from xlatrain.backend.peak import measured_peak

        # The host's cores serve every virtual device: one device's share of the measured rate.
        # Only the matmul is computed (the run's pending work stays pending); it compiles once per
        # machine, then the figure is cached: the run's compile counts leave it out. unlazy returns
        # once the matmul is dispatched, not done (timed alone it read ~1,500x the real rate):
        # wait_device_ops waits for it to finish.
        def sync(t: torch.Tensor) -> None:
            xm.unlazy([t])
            xm.wait_device_ops()

        before = self.runtime_stats()
        rate, source = measured_peak(self.device, dtype, sync, "XLA:CPU")
        after = self.runtime_stats()
        for key, value in after.items():
            self._own_stats[key] = self._own_stats.get(key, 0) + value - before.get(key, 0)
        return rate / self.num_devices, f"{source}, shared by {self.num_devices} virtual device(s)"

    def memory_capacity(self) -> tuple[int, str] | None:
        from xlatrain.backend.hardware import host_memory_available

        try:
            import torch_xla.core.xla_model as xm

            info = xm.get_memory_info(self.device)
            limit = info.get("bytes_limit") or info.get("kb_total", 0) * 1024
            if limit:
                return int(limit), "torch_xla's memory limit for this device"
        except (RuntimeError, NotImplementedError, AttributeError):
            pass  # XLA:CPU has none (UNIMPLEMENTED): its devices share the host's memory
        available = host_memory_available()
        if available and self.platform == "cpu":
            return available // self.num_devices, f"the host's available memory, shared by {self.num_devices} device(s)"
        return None

    def reset_memory_peak(self) -> None:
        pass  # torch_xla keeps one peak per process: it is said as the process's

    def step_memory(self, step: Callable[[], None]) -> int | None:
        return None  # a step compiles before it runs: measuring would cost a compilation up front

    def memory_peak(self) -> tuple[int, str] | None:
        try:
            import torch_xla.core.xla_model as xm

            info = xm.get_memory_info(self.device)
            peak = info.get("peak_bytes_used")
            return (int(peak), "torch_xla's peak bytes in use") if peak else None
        except (RuntimeError, NotImplementedError, AttributeError):
            return None

    @contextlib.contextmanager
    def planned_transfers(self) -> Iterator[None]:
        """Count every device-to-host transfer inside as planned (a sharded checkpoint reads
        each shard separately)."""
        import torch_xla.debug.metrics as met

        def count() -> int:
            data = met.metric_data("TransferFromDeviceTime")
            return int(data[0]) if data else 0

        before, self._counting = count(), True
        try:
            yield
        finally:
            self._counting = False
            self.planned_reads += count() - before

    def runtime_stats(self) -> dict[str, float]:
        import torch_xla.debug.metrics as met

        compile_data = met.metric_data("CompileTime")
        transfer_data = met.metric_data("TransferFromDeviceTime")
        stats = {
            "xla_compilations": compile_data[0] if compile_data else 0,
            "xla_host_transfers": transfer_data[0] if transfer_data else 0,
        }
        if self.compile_cache_dir is not None:
            for name, key in (("PersistentCacheHit", "hits"), ("PersistentCacheMiss", "misses"),
                              ("PersistentCacheDeserializeFailure", "load_failures")):
                stats[f"xla_cache_{key}"] = met.counter_value(name) or 0
        return {key: value - self._own_stats.get(key, 0) for key, value in stats.items()}

    def seed_everything(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm

        seed_host(seed)
        xm.set_rng_state(seed)

    def rng_state(self) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm

        return {**host_rng_state(), "xla": int(xm.get_rng_state())}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        import torch_xla.core.xla_model as xm

        set_host_rng_state(state)
        if "xla" in state:
            xm.set_rng_state(state["xla"])


def _check_count(asked: int | None, found: int, spmd: bool = True) -> None:
    if asked is None or asked == found:
        return
    kind = os.environ.get("PJRT_DEVICE", "XLA")
    if not spmd:
        # One process per device: the count is the launch's, which a setting in the process cannot change.
        launch = ("Start the training function with xlatrain.spawn(fn, args) (one process per device present; "
                  "the command line does not spawn), or use" if found == 1 else "Use")
        raise ValueError(
            f"devices={asked} with xla_mode='multiprocess', but this process is one of {found} {kind} process(es): "
            f"that mode runs one process per device, so the launch sets the count: use devices={found} or None. "
            f"{launch} xla_mode='spmd' (the default), where one process spreads over devices={asked}"
            + (". On XLA:CPU use SPMD: torch_xla's collectives between processes there hang" if kind == "CPU" else "")
        )
    raise ValueError(
        f"devices={asked} but the XLA runtime already runs with {found} {kind} device(s); this process cannot "
        f"change it. Use devices={found} or None, or start a new process (on XLA:CPU, set "
        f"CPU_NUM_DEVICES={asked} before torch_xla starts)."
    )


def _start_compile_cache(spmd: bool) -> str | None:
    """torch_xla's persistent compilation cache, so a second identical run skips compiling.

    Must start before the first computation; a process that already compiled keeps running
    without it. On XLA:CPU torch_xla 2.9 writes entries but cannot load them back (the history's
    ``xla_cache_load_failures`` column says so); the saving shows on TPU and GPU.
    """
    import torch_xla
    import torch_xla.runtime as xr

    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        return None
    path = default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    # One writer per host: the other processes of a one-process-per-chip job only read.
    xr.initialize_cache(str(path), readonly=not spmd and xr.local_ordinal() != 0)
    return str(path)


# torch_xla's loader cuts the graph (torch_xla.sync) every this many batches. The caller's
# step_end already cuts it once per step, so the loader never should.
_NO_LOADER_SYNC = 2**62


class BatchSharding:
    """Dim 0 of every batch tensor over the mesh's ``axis``, whatever the tensor's rank.

    Duck-types the one ``ShardingSpec`` torch_xla's loader accepts for all tensors
    (``xla_spec(t)`` per tensor, and ``minibatch``), so a whole batch structure travels as is:
    a single spec would fit only tensors of its own rank, a dict of specs only dict batches.
    """

    def __init__(self, mesh: Any, axis: str, minibatch: bool) -> None:
        self.mesh = mesh
        self.axis = axis
        self.minibatch = minibatch
        self._by_rank: dict[int, Any] = {}

    def xla_spec(self, t: torch.Tensor) -> Any:
        if t.dim() == 0:
            return None  # a scalar is replicated
        spec = self._by_rank.get(t.dim())
        if spec is None:
            import torch_xla.distributed.spmd as xs

            partition = (self.axis,) + (None,) * (t.dim() - 1)
            spec = self._by_rank[t.dim()] = xs.ShardingSpec(self.mesh, partition, minibatch=self.minibatch)
        return spec.xla_spec(t)


class _DeviceLoader:
    """Host batches to the device in torch_xla's background threads, ahead of the step that needs them.

    Unlike ``MpDeviceLoader``, taking a batch does not cut the graph: the caller's ``step_end``
    does, once per step. A second cut right after it has nothing to run, yet waits for the step
    just launched to finish (torch_xla's barrier on an empty sync), so the host could not trace
    step N+1 while the device runs step N. Batches keep their structure (tuples stay tuples).
    """

    def __init__(self, loader: Iterable[Any], device: torch.device, sharding: BatchSharding | None) -> None:
        self._loader = loader
        self._device = device
        self._sharding = sharding

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.parallel_loader as pl

        # Work queued before the first batch (fresh running sums, restored state) runs as a
        # graph of its own, so the first step traces the same graph in every epoch.
        torch_xla.sync()
        # The first batch is made here, on this thread, with the device idle; torch_xla's threads
        # take the rest. A loader forks its worker processes (a DataLoader's, a ShardDataset's
        # decoders) when it makes its first batch, and a process forked while another thread
        # holds a lock gets that lock held forever: a DataLoader worker forked from torch_xla's
        # loader thread while XLA ran a fresh program hung in at::set_num_threads, waiting for
        # glibc's atexit lock (a CI run; here once in 521 runs with empty compile caches). Waiting
        # costs at most the step still running when a phase starts.
        xm.wait_device_ops()
        batches = iter(self._loader)
        first = list(itertools.islice(batches, 1))  # empty where the loader has no batch
        host = _Flattened(self._loader, itertools.chain(first, batches))
        parallel = pl.ParallelLoader(
            host, [self._device], batches_per_execution=_NO_LOADER_SYNC, input_sharding=self._sharding
        )
        try:
            for leaves in parallel.per_device_loader(self._device):
                yield tree_unflatten(leaves, host.specs.popleft())
        finally:
            parallel.close()  # an epoch left early (preemption, an error) stops the threads
        if host.error is not None:
            raise host.error


class _Flattened:
    """``loader``'s batches as lists of tensors for torch_xla's loader threads.

    Their tree specs queue up in ``specs`` in batch order (one loader thread and one transfer
    thread keep it). An error from ``loader`` is kept in ``error``: torch_xla's loader thread
    would print it and end the epoch early as if the data had run out.
    """

    def __init__(self, loader: Iterable[Any], batches: Iterator[Any]) -> None:
        self._loader, self._batches = loader, batches
        self.specs: collections.deque[Any] = collections.deque()
        self.error: BaseException | None = None

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[Any]]:
        try:
            for batch in self._batches:
                leaves, spec = tree_flatten(batch)
                self.specs.append(spec)
                yield leaves
        except Exception as exc:
            self.error = exc
