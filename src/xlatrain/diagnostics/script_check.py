"""``xlatrain doctor SCRIPT.py``: read a training script (never run it) and list, line by line,
what will break or slow it down on torch_xla 2.9, with the fix, and what each torch_xla call
becomes on TorchTPU and under xlatrain.

Severities are promises:

- ``error``: the script will certainly fail, or certainly compute something other than what it
  says, on torch_xla 2.9 (a removed API, ``xmp.spawn(nprocs=8)``, iterating a ``ParallelLoader``).
- ``warning``: the script certainly runs slower than it has to (a host read every step, a ragged
  training batch that compiles its own graphs).
- ``info``: everything else, including what the check could not tell. Infos never change the
  exit code; the porting notes (codes ``port:*``) are infos too.

What a name holds is read from the code: the assignment that reaches the use in its scope
(``para_loader = pl.ParallelLoader(...)``), or, for a function parameter, the arguments at every
call site of that function in the file. Import aliases are resolved the same way (``import
torch_xla.core.xla_model as xm`` makes ``xm.get_ordinal`` the removed
``torch_xla.core.xla_model.get_ordinal``). When the code does not say (a parameter of a function
called from another file, a value read from the command line), the check says nothing or writes
an info that names what it could not tell; what a name merely suggests (``train_loader``,
``num_cores``) only ever picks between infos.

Which calls are removed and which only deprecated was read from torch_xla 2.9.0 itself
(``core/xla_model.py``: ``xrt_world_size`` and ``get_ordinal`` are gone, ``xla_device`` and
``mark_step`` carry ``@deprecated``; ``_internal/pjrt.py``: ``spawn`` raises for ``nprocs`` other
than 1 or None, and refuses to start once the parent process has started the runtime). The
TorchTPU names in the porting notes were read from the torch_tpu 0.2.0 wheel.

Example:
    >>> from xlatrain.diagnostics.script_check import check_source
    >>> src = "import torch_xla.core.xla_model as xm\\nn = xm.xrt_world_size()\\n"
    >>> [(f.line, f.code, f.severity) for f in check_source(src) if not f.code.startswith("port:")]
    [(2, 'removed-api', 'error')]
"""

from __future__ import annotations

import ast
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xlatrain.diagnostics.doctor import env_trap

XM = "torch_xla.core.xla_model"
XMP = "torch_xla.distributed.xla_multiprocessing"
PL = "torch_xla.distributed.parallel_loader"
XR = "torch_xla.runtime"
XS = "torch_xla.distributed.spmd"
MET = "torch_xla.debug.metrics"

SEVERITIES = ("error", "warning", "info")
PORT_PREFIX = "port:"
_PORT_SEP = ": on TorchTPU, "


@dataclass(frozen=True)
class ScriptFinding:
    """One problem in a script: where, what (``code``), why (``message``) and what to write instead."""

    line: int
    col: int
    code: str
    severity: str
    message: str
    fix: str


@dataclass(frozen=True)
class _Api:
    code: str
    severity: str
    message: str
    fix: str


_LOADER_FIX = (
    "let xlatrain feed the device: Trainer(...).fit(train_data, val_data) wraps the loader itself "
    "(device prefetch, full static batches, per-rank split) - no ParallelLoader / MpDeviceLoader"
)

# Fully qualified name -> what torch_xla 2.9 does with it (read from its installed source).
_APIS: dict[str, _Api] = {
    f"{XM}.xrt_world_size": _Api(
        "removed-api",
        "error",
        "xm.xrt_world_size() was removed in torch_xla 2.x: AttributeError in 2.9",
        "torch_xla.runtime.world_size() (under xlatrain: trainer.backend.world_size)",
    ),
    f"{XM}.get_ordinal": _Api(
        "removed-api",
        "error",
        "xm.get_ordinal() was removed in torch_xla 2.x: AttributeError in 2.9",
        "torch_xla.runtime.global_ordinal() (under xlatrain: trainer.backend.process_index)",
    ),
    f"{XR}.using_pjrt": _Api(
        "removed-api",
        "error",
        "torch_xla.runtime.using_pjrt() is gone in 2.9: PJRT is the only runtime",
        "drop the check",
    ),
    f"{XM}.xla_device": _Api(
        "deprecated-api",
        "info",
        "xm.xla_device() is @deprecated in torch_xla 2.9 ('Use torch_xla.device instead'); its "
        "devkind argument is ignored",
        "torch_xla.device() (under xlatrain: Trainer(..., backend='auto') picks the device)",
    ),
    f"{XM}.mark_step": _Api(
        "deprecated-api",
        "info",
        "xm.mark_step() is @deprecated in torch_xla 2.9 ('Use torch_xla.sync instead')",
        "torch_xla.sync(), or let xlatrain's Trainer cut the graph once per step",
    ),
    f"{XM}.get_local_ordinal": _Api(
        "legacy-api",
        "info",
        "xm.get_local_ordinal() still works in torch_xla 2.9 (it wraps torch_xla.runtime.local_ordinal())",
        "torch_xla.runtime.local_ordinal()",
    ),
    f"{XM}.is_master_ordinal": _Api(
        "legacy-api",
        "info",
        "xm.is_master_ordinal() still works, but its default local=True is true on the first "
        "process of every host, not once per job",
        "torch_xla.runtime.global_ordinal() == 0 to act once per job (under xlatrain: "
        "trainer.backend.is_main)",
    ),
    f"{XM}.master_print": _Api(
        "legacy-api",
        "info",
        "xm.master_print() prints on ordinal 0 only, but every process still evaluates its "
        "arguments: a tensor or .item() in them syncs every replica",
        "let xlatrain print progress on rank 0 from values it reads every log_every steps",
    ),
    f"{PL}.ParallelLoader": _Api(
        "parallel-loader", "info", "ParallelLoader still works in torch_xla 2.9 but is hand-wiring", _LOADER_FIX
    ),
    f"{PL}.MpDeviceLoader": _Api(
        "parallel-loader", "info", "MpDeviceLoader still works in torch_xla 2.9 but is hand-wiring", _LOADER_FIX
    ),
}

_REMOVED_MODULES = {
    "torch_xla_py": _Api(
        "removed-api",
        "error",
        "torch_xla_py is not part of torch_xla 2.9 (its modules live under torch_xla now): "
        "ModuleNotFoundError",
        "import torch_xla.core.xla_model as xm (and torch_xla.distributed.parallel_loader as pl)",
    ),
    "torch_xla.distributed.xla_dist": _Api(
        "removed-api",
        "error",
        "torch_xla.distributed.xla_dist (the XRT pod launcher) was removed: ModuleNotFoundError in 2.9",
        "run the same command on every host of the slice (gcloud compute tpus tpu-vm ssh NAME "
        "--worker=all --command=...); PJRT finds the other hosts itself",
    ),
    "torch_xla.experimental.pjrt": _Api(
        "removed-api",
        "error",
        "torch_xla.experimental.pjrt moved into torch_xla.runtime: ModuleNotFoundError in 2.9",
        "import torch_xla.runtime as xr",
    ),
}


@dataclass(frozen=True)
class _Port:
    code: str
    torch_tpu: str
    xlatrain: str


# What each torch_xla call becomes on TorchTPU (every torch.tpu / torch_tpu name below was read
# from the torch_tpu 0.2.0 wheel) and under xlatrain.
_PORT_DEVICE = _Port(
    "port:device",
    "the device is torch.device('tpu'): model.to('tpu') / tensor.to('tpu') (or model.tpu()); each "
    "process owns one TPU device, so there is no index to pick (torch.tpu.set_device only checks it)",
    "Trainer(..., backend='auto') picks the device and moves the model; nothing to write",
)
_PORT_SYNC = _Port(
    "port:sync",
    "tensors on the 'tpu' device run eagerly, so there is no lazy graph to cut: delete the call; "
    "compile the step with torch.compile(...) (TorchTPU makes backend='tpu', dynamic=False the "
    "default for TPU inputs); torch.tpu.synchronize() waits for the device, for timing only",
    "the Trainer runs one compiled step per phase; nothing to write",
)
_PORT_COMPILE = _Port(
    "port:compile",
    "torch.compile(fn): TorchTPU makes backend='tpu' with dynamic=False the default for TPU inputs",
    "the Trainer compiles the step itself",
)
_PORT_OPTIMIZER = _Port(
    "port:optimizer-step",
    "optimizer.step(): wrap the model in torch.nn.parallel.DistributedDataParallel over the "
    "'tpu_dist' process group, and backward all-reduces the gradients",
    "the Trainer steps the optimizer it builds from optimizer_fn (TrainConfig(grad_accum_steps=..., "
    "clip_grad_norm=...))",
)
_PORT_LOADER = _Port(
    "port:loader",
    "a plain torch DataLoader; move each batch with .to('tpu')",
    "Trainer.fit(train_data, val_data) takes the Dataset or DataLoader and prefetches batches to "
    "the device",
)
_PORT_LAUNCH = _Port(
    "port:launch",
    "one process per TPU device: call torch.tpu.distributed.set_tpu_launch_env() in the parent "
    "and start the workers with torchrun or torch.multiprocessing.spawn ('python -m "
    "torch.tpu.distributed' prints the same variables for a shell launcher); each worker calls "
    "torch.distributed.init_process_group('tpu_dist')",
    "no worker function: Trainer(...).fit(...) drives every local device (SPMD on torch_xla); "
    "xlatrain.spawn(fn) when you want one process per chip",
)
_PORT_PRINT = _Port(
    "port:print",
    "print(...) where torch.distributed.get_rank() == 0",
    "progress lines come from the main process every TrainConfig(log_every=N) steps",
)
_PORT_SAVE = _Port(
    "port:save",
    "torch.save (or safetensors) of a CPU copy of the state where torch.distributed.get_rank() == 0",
    "best.safetensors and resumable checkpoints in run_dir (CheckpointConfig); xlatrain.load_weights "
    "reads them back",
)
_PORT_COLLECTIVE = _Port(
    "port:collective",
    "torch.distributed.all_reduce / all_gather_into_tensor / barrier over the 'tpu_dist' process "
    "group, which takes TPU tensors only (put a host value such as mesh_reduce's into a tensor "
    "on 'tpu' first)",
    "the Trainer all-reduces metric sums and counts itself, once per evaluation",
)
_PORT_WORLD = _Port(
    "port:world",
    "torch.distributed.get_world_size() / get_rank() once init_process_group('tpu_dist') has "
    "run; the local rank is torchrun's LOCAL_RANK",
    "trainer.backend.world_size, trainer.backend.process_index, trainer.backend.is_main",
)
_PORT_SAMPLER = _Port(
    "port:sampler",
    "DistributedSampler(dataset) reads num_replicas and rank from the initialized process group",
    "the Trainer inserts its own per-rank sampler and reshuffles every epoch from TrainConfig(seed=...)",
)
_PORT_BF16 = _Port(
    "port:bf16",
    "torch.autocast('tpu', dtype=torch.bfloat16) around the forward pass and the loss (bfloat16 "
    "is in torch.tpu.get_amp_supported_dtype()); weights stay float32",
    "TrainConfig(precision='bf16')",
)
_PORT_CLOSURE = _Port(
    "port:step-closure",
    "there are no step closures: read values (.item()) every N steps instead; each read waits for "
    "the device",
    "TrainConfig(log_every=N): the Trainer reads device values on the host only every N steps",
)
_PORT_METRICS = _Port(
    "port:metrics",
    "torch_xla's metrics do not exist: profile with torch.profiler (TorchTPU registers a Kineto "
    "backend; TPU options in torch.tpu.profiler.TpuProfilerConfig), or set TORCH_TRACE before "
    "import torch for tlparse traces of each compiled batch",
    "TrainConfig(diagnostics=True) reports recompilations, host reads and CPU fallbacks at the end "
    "of fit and in RUN_DIR/diagnostics.json",
)
_PORT_WAIT = _Port(
    "port:wait",
    "torch.tpu.synchronize()",
    "fit returns once the device is done",
)
_PORT_SEED = _Port(
    "port:seed",
    "torch.manual_seed(seed); torch.tpu.manual_seed_all(seed) seeds every TPU device",
    "TrainConfig(seed=...)",
)
_PORT_SPMD = _Port(
    "port:spmd",
    "shard with torch.distributed's DeviceMesh and DTensor; "
    "torch.tpu.distributed.topology_aware_mesh(mesh_shape) lays the ranks out along the chip topology",
    "BackendConfig(xla_mode='spmd') (the default) shards each global batch over the local devices",
)
_PORT_IMPORT = _Port(
    "port:import",
    "nothing to import: with torch_tpu installed and a TPU attached, 'import torch' registers the "
    "'tpu' device (TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns that off)",
    "import xlatrain; the backend imports what the hardware needs",
)

_PORTS: dict[str, _Port] = {
    f"{XM}.xla_device": _PORT_DEVICE,
    "torch_xla.device": _PORT_DEVICE,
    "torch_xla.devices": _PORT_DEVICE,
    f"{XM}.get_xla_supported_devices": _PORT_DEVICE,
    f"{XM}.mark_step": _PORT_SYNC,
    "torch_xla.sync": _PORT_SYNC,
    "torch_xla.step": _PORT_SYNC,
    "torch_xla.compile": _PORT_COMPILE,
    f"{XM}.optimizer_step": _PORT_OPTIMIZER,
    f"{XM}.reduce_gradients": _PORT_OPTIMIZER,
    f"{PL}.ParallelLoader": _PORT_LOADER,
    f"{PL}.MpDeviceLoader": _PORT_LOADER,
    f"{XMP}.spawn": _PORT_LAUNCH,
    "torch_xla.launch": _PORT_LAUNCH,
    f"{XM}.master_print": _PORT_PRINT,
    f"{XM}.save": _PORT_SAVE,
    f"{XM}.mesh_reduce": _PORT_COLLECTIVE,
    f"{XM}.all_reduce": _PORT_COLLECTIVE,
    f"{XM}.all_gather": _PORT_COLLECTIVE,
    f"{XM}.reduce_scatter": _PORT_COLLECTIVE,
    f"{XM}.rendezvous": _PORT_COLLECTIVE,
    f"{XM}.xrt_world_size": _PORT_WORLD,
    f"{XM}.get_ordinal": _PORT_WORLD,
    f"{XM}.get_local_ordinal": _PORT_WORLD,
    f"{XM}.is_master_ordinal": _PORT_WORLD,
    f"{XR}.world_size": _PORT_WORLD,
    f"{XR}.global_ordinal": _PORT_WORLD,
    f"{XR}.local_ordinal": _PORT_WORLD,
    f"{XR}.global_runtime_device_count": _PORT_WORLD,
    f"{XM}.add_step_closure": _PORT_CLOSURE,
    f"{MET}.metrics_report": _PORT_METRICS,
    f"{MET}.short_metrics_report": _PORT_METRICS,
    f"{MET}.metric_data": _PORT_METRICS,
    f"{MET}.counter_value": _PORT_METRICS,
    f"{MET}.executed_fallback_ops": _PORT_METRICS,
    f"{XM}.wait_device_ops": _PORT_WAIT,
    f"{XM}.set_rng_state": _PORT_SEED,
    "torch_xla.manual_seed": _PORT_SEED,
    "torch_xla.amp.autocast": _PORT_BF16,
    f"{XR}.use_spmd": _PORT_SPMD,
    f"{XS}.Mesh": _PORT_SPMD,
    f"{XS}.mark_sharding": _PORT_SPMD,
}
_BF16_ENV = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")

# Calls that start the XLA runtime in the calling process (measured with torch_xla 2.9:
# _xla_runtime_is_initialized() is true after each of them; xr.device_type() leaves it off).
_RUNTIME_CALLS = {
    f"{XM}.xla_device",
    "torch_xla.device",
    "torch_xla.devices",
    f"{XM}.get_xla_supported_devices",
    f"{XM}.get_local_ordinal",
    f"{XM}.is_master_ordinal",
    f"{XR}.world_size",
    f"{XR}.global_ordinal",
    f"{XR}.local_ordinal",
    f"{XR}.global_runtime_device_count",
    f"{XR}.addressable_device_count",
    f"{XR}.process_index",
    f"{XR}.process_count",
}
_DEVICE_CALLS = {f"{XM}.xla_device", "torch_xla.device"}
_WORLD_CALLS = {f"{XM}.xrt_world_size", f"{XM}.get_ordinal", f"{XR}.world_size", f"{XR}.global_ordinal"}
# Anything that cuts the lazy graph once per step.
_STEP_BOUNDARIES = {
    f"{XM}.mark_step",
    "torch_xla.sync",
    "torch_xla.step",
    "torch_xla.compile",
    f"{PL}.ParallelLoader",
    f"{PL}.MpDeviceLoader",
}
_DATALOADERS = {"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"}

# Methods that copy a device tensor to the host: each one waits for the device to finish.
_SYNC_METHODS = {"item", "tolist", "numpy", "cpu"}
# Attributes and methods of a tensor that are plain Python values, read without a sync.
_META_ATTRS = {"shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "layout", "names"}
_META_METHODS = {"size", "dim", "numel", "element_size", "stride", "is_contiguous", "get_device", "__len__"}
# Methods that return their receiver (a module or tensor) unchanged in kind.
_SAME_KIND_METHODS = {"train", "eval", "float", "half", "bfloat16", "double", "requires_grad_",
                      "detach", "clone", "contiguous", "share_memory"}
_PRINTS = {"print", f"{XM}.master_print", "logging.info", "logging.debug", "logging.warning", "tqdm.tqdm.write"}
_TORCH_NOT_TENSOR = ("torch.nn.", "torch.optim", "torch.utils", "torch.cuda", "torch.backends",
                     "torch.distributed", "torch.jit", "torch.amp", "torch.autograd.", "torch.set_",
                     "torch.get_", "torch.manual_seed", "torch.no_grad", "torch.enable_grad",
                     "torch.inference_mode", "torch.autocast", "torch.device", "torch.save",
                     "torch.load", "torch.is_", "torch.compile", "torch.finfo", "torch.iinfo",
                     "torch.use_deterministic", "torch.multiprocessing", "torch.hub", "torch.onnx")
_TORCH_FACTORIES = {"zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange",
                    "linspace", "logspace", "eye", "tensor", "as_tensor", "from_numpy", "Tensor",
                    "FloatTensor", "LongTensor"}
_HOST_MODULES = ("numpy", "math", "time", "random", "os", "json", "statistics", "datetime", "pandas")
_HOST_BUILTINS = {"len", "int", "float", "str", "bool", "round", "repr", "format", "range", "isinstance",
                  "hasattr", "id", "hash", "type", "sorted", "list", "dict", "set", "tuple", "input"}
_ITER_WRAPPERS = {"tqdm", "iter", "islice", "tqdm_notebook", "reversed", "cycle", "chain"}
_DYNAMIC_SHAPE = {"nonzero", "unique", "masked_select", "argwhere", "unique_consecutive"}
_WORLD_SIZE_CALLS = ("xrt_world_size", "world_size", "get_world_size", "global_runtime_device_count")
_OPTIMIZER_CLASSES = {
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "LBFGS",
    "SparseAdam", "ASGD", "Rprop", "Adafactor", "Lamb", "LAMB", "AdaBelief", "Lion",
}
_CATCHES_IMPORT = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
_CATCHES_ATTRIBUTE = {"AttributeError", "Exception", "BaseException"}

# What an expression holds, as far as the code says. A set of these is an expression's "kinds";
# _K_UNKNOWN in it means the code does not settle the question.
_K_DEVICE = "device-tensor"  # a tensor on the XLA device
_K_TENSOR = "tensor"  # a tensor on a device the code does not name
_K_CPU = "cpu-tensor"  # a tensor that is not on the XLA device
_K_HOST = "host"  # a plain Python / numpy value
_K_XLA_DEVICE = "xla-device"
_K_OTHER_DEVICE = "other-device"
_K_MODULE = "module"  # an nn.Module not known to be on the XLA device
_K_MODULE_XLA = "module-on-xla"
_K_ON_XLA = "on-xla"  # x.to(xla_device) of an x the code does not describe: a module or a tensor
_K_LOSS = "loss-module"  # an nn.*Loss instance: calling it computes on its inputs' device
_K_DATALOADER = "dataloader"
_K_PARALLEL_LOADER = "parallel-loader"
_K_DEVICE_LOADER = "device-loader"  # MpDeviceLoader / per_device_loader: batches arrive on the device
_K_BATCH_DEVICE = "batch-on-device"
_K_BATCH_CPU = "batch-on-cpu"
_K_FUNC = "function"
_K_INSTANCE = "instance"
_K_UNKNOWN = "unknown"
# How deep the check follows one value through names and calls before it calls it unsettled
# (each level costs a handful of Python frames).
_MAX_DEPTH = 120
_ON_DEVICE = frozenset({_K_DEVICE, _K_ON_XLA, _K_BATCH_DEVICE})
# kinds an element of a tuple of them keeps (a tuple of loaders, a tensor's row)
_KEPT_BY_ELEMENT = frozenset(
    {_K_TENSOR, _K_MODULE, _K_MODULE_XLA, _K_DATALOADER, _K_DEVICE_LOADER, _K_PARALLEL_LOADER, _K_XLA_DEVICE}
)
_TENSORISH = _ON_DEVICE | {_K_TENSOR, _K_CPU, _K_BATCH_CPU}
_MODULES = frozenset({_K_MODULE, _K_MODULE_XLA, _K_ON_XLA})


def check_source(source: str, path: str = "<script>") -> tuple[ScriptFinding, ...]:
    """Findings for a script's source text, sorted by line (porting notes included).

    Raises:
        ValueError: the text is not valid Python (the message names the line).
    """
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise ValueError(
            f"{path}:{exc.lineno}: not valid Python ({exc.msg}): the script check reads Python "
            "source only; export a notebook with 'jupyter nbconvert --to script' first"
        ) from exc
    return _Checker(tree).run()


def check_file(path: str | Path) -> tuple[ScriptFinding, ...]:
    """Findings for the script at ``path`` (read, never run)."""
    p = Path(path)
    try:
        source = p.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ValueError(f"{p}: no such file: pass the path of a Python training script") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: cannot be read as UTF-8 text ({exc}): pass a Python source file") from exc
    return check_source(source, str(p))


def is_port_note(finding: ScriptFinding) -> bool:
    """True for a porting note (what a torch_xla call becomes on TorchTPU and under xlatrain)."""
    return finding.code.startswith(PORT_PREFIX)


def exit_code(findings: Iterable[ScriptFinding]) -> int:
    """1 when anything is an error or a warning, else 0 (infos and porting notes alone pass)."""
    return 1 if any(f.severity in ("error", "warning") for f in findings) else 0


def render_text(path: str, findings: Sequence[ScriptFinding]) -> str:
    """Compiler-style lines (``path:line:col: severity [code] message``, the fix under each), then
    the porting notes grouped by what they port, one entry per kind of call with its lines."""
    problems = [f for f in findings if not is_port_note(f)]
    ports = [f for f in findings if is_port_note(f)]
    lines = []
    if not problems:
        lines.append(f"{path}: no known torch_xla pitfalls found")
    for f in problems:
        lines.append(f"{path}:{f.line}:{f.col + 1}: {f.severity} [{f.code}] {f.message}")
        lines.append(f"    fix: {f.fix}")
    if ports:
        # one entry per kind of port, naming each torch_xla call and its lines once
        groups: dict[tuple[str, str, str], dict[str, list[int]]] = {}
        for f in ports:
            what, _, text = f.message.partition(_PORT_SEP)
            at = groups.setdefault((f.code, text, f.fix), {}).setdefault(what, [])
            if f.line not in at:
                at.append(f.line)
        lines.append(f"{path}: porting to TorchTPU ({len(ports)} torch_xla call(s), {len(groups)} kind(s)):")
        for (code, text, fix), calls in groups.items():
            where = ", ".join(f"{what} (line{'s' if len(at) > 1 else ''} {_lines(at)})" for what, at in calls.items())
            lines.append(f"  [{code}] {where}")
            lines.append(f"      TorchTPU: {text}")
            lines.append(f"      xlatrain: {fix}")
    if problems:
        counts = {s: sum(f.severity == s for f in problems) for s in SEVERITIES}
        lines.append(
            f"{path}: {counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} note(s)"
            + (f", {len(ports)} porting note(s)" if ports else "")
        )
    return "\n".join(lines)


def _lines(at: Sequence[int]) -> str:
    shown = ", ".join(map(str, at[:8]))
    return shown + (f" and {len(at) - 8} more" if len(at) > 8 else "")


def render_json(results: Mapping[str, Sequence[ScriptFinding]]) -> str:
    """``{"scripts": [{"path", "exit_code", "findings": [...]}], "exit_code"}`` as JSON; porting
    notes are findings with a ``port:`` code and severity ``info``."""
    scripts = [
        {"path": path, "exit_code": exit_code(fs), "findings": [asdict(f) for f in fs]}
        for path, fs in results.items()
    ]
    worst = max((s["exit_code"] for s in scripts), default=0)
    return json.dumps({"exit_code": worst, "scripts": scripts}, indent=2)


# --------------------------------------------------------------------------- helpers


def _walk(nodes: Iterable[ast.AST], into_defs: bool = False) -> Iterator[ast.AST]:
    """Every node under ``nodes``; nested function and class bodies only with ``into_defs``."""
    stack = list(nodes)[::-1]
    while stack:
        node = stack.pop()
        yield node
        if not into_defs and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _const(node: ast.AST | None) -> Any:
    return node.value if isinstance(node, ast.Constant) else None


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _arg(call: ast.Call, index: int, name: str) -> ast.expr | None:
    value = _kw(call, name)
    if value is None and len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
        value = call.args[index]
    return value


def _names_in(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


_SCOPES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_SIMPLE_BINDERS = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Import, ast.ImportFrom, ast.FunctionDef,
                   ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True, eq=False)
class _Binding:
    """One place a name gets a value: ``kind`` is assign, aug, loop, with, param, import, def or
    other; ``value`` is the bound expression (an element of it along ``path`` when unpacked)."""

    name: str
    kind: str
    stmt: ast.AST | None  # the statement (or handler / comprehension) that binds; None for a parameter
    value: ast.AST | None = None
    path: tuple[int, ...] = ()
    target: str = ""  # for an import: the dotted name it binds
    func: ast.AST | None = None  # for a parameter: its function


@dataclass(frozen=True)
class _Resolved:
    """The bindings that can reach a use, and whether the file shows all of them."""

    bindings: tuple[_Binding, ...]
    complete: bool

    @property
    def single(self) -> _Binding | None:
        return self.bindings[0] if self.complete and len(self.bindings) == 1 else None


class _Sites:
    """Who calls a function defined in the file: plain calls (with how many leading parameters
    the call does not pass, 1 for ``self.method(...)``), spawns (``xmp.spawn(fn, args=...)``),
    and whether it also escapes (passed on, decorated, a method others may call)."""

    def __init__(self) -> None:
        self.calls: list[tuple[ast.Call, int]] = []
        self.spawns: list[ast.Call] = []
        self.escapes = False


class _Checker:
    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.parents: dict[ast.AST, ast.AST] = {}
        self.slot: dict[ast.AST, tuple[ast.AST, str, int]] = {}
        for node in ast.walk(tree):
            for field, value in ast.iter_fields(node):
                if isinstance(value, list):
                    for i, child in enumerate(value):
                        if isinstance(child, ast.AST):
                            self.parents[child] = node
                            self.slot[child] = (node, field, i)
                elif isinstance(value, ast.AST):
                    self.parents[value] = node
        self.findings: dict[tuple[int, str, str], ScriptFinding] = {}
        self.star_modules: list[str] = []
        self.module_classes: set[str] = set()
        self._tables: dict[ast.AST, dict[str, list[_Binding]]] = {}
        self._globals: dict[ast.AST, set[str]] = {}
        self._nonlocals: dict[ast.AST, set[str]] = {}
        self._resolved: dict[ast.Name, _Resolved] = {}
        self._kinds: dict[ast.AST, frozenset[str]] = {}
        self._binding_kinds: dict[_Binding, frozenset[str]] = {}
        self._busy: set[Any] = set()
        self._sites: dict[ast.AST, _Sites] | None = None
        self._moved: set[_Binding] = set()
        self._imported: list[str] = []
        self._scopes: list[ast.AST] | None = None

    # ------------------------------------------------------------------ plumbing

    def add(self, node: ast.AST, code: str, severity: str, message: str, fix: str) -> None:
        line, col = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
        key = (line, code, message)
        if key not in self.findings:
            self.findings[key] = ScriptFinding(line, col, code, severity, message, fix)

    def add_port(self, node: ast.AST, what: str, port: _Port) -> None:
        self.add(node, port.code, "info", f"{what}{_PORT_SEP}{port.torch_tpu}", port.xlatrain)

    def scope_of(self, node: ast.AST) -> ast.AST:
        """The function, lambda, class body or module whose names ``node`` sees first."""
        cur = self.parents.get(node)
        while cur is not None and not isinstance(cur, _SCOPES):
            cur = self.parents.get(cur)
        return cur if cur is not None else self.tree

    def stmt_of(self, node: ast.AST) -> ast.AST:
        cur: ast.AST | None = node
        while cur is not None and not isinstance(cur, (ast.stmt, ast.ExceptHandler)):
            cur = self.parents.get(cur)
        return cur if cur is not None else self.tree

    def inside(self, node: ast.AST, ancestor: ast.AST) -> bool:
        cur = self.parents.get(node)
        while cur is not None:
            if cur is ancestor:
                return True
            cur = self.parents.get(cur)
        return False

    def enclosing_function(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        scope = self.scope_of(node)
        return scope if isinstance(scope, _FUNCS) else None

    def enclosing_class(self, fn: ast.AST | None) -> ast.ClassDef | None:
        parent = self.parents.get(fn) if fn is not None else None
        return parent if isinstance(parent, ast.ClassDef) else None

    @property
    def uses_xla(self) -> bool:
        return any(t == "torch_xla" or t.startswith("torch_xla.") for t in self._imported)

    @property
    def uses_lightning(self) -> bool:
        return any(t.split(".")[0] in ("pytorch_lightning", "lightning") for t in self._imported)

    @property
    def lightning_on_tpu(self) -> bool:
        """A Lightning Trainer the code points at TPUs (accelerator='tpu', or the old tpu_cores)."""
        for call in (n for n in ast.walk(self.tree) if isinstance(n, ast.Call)):
            name = self.call_name(call)
            if name.endswith("Trainer") and name.split(".")[0] in ("pytorch_lightning", "lightning"):
                if _kw(call, "tpu_cores") is not None or self.static_values(_kw(call, "accelerator")) == {"tpu"}:
                    return True
        return False

    # ------------------------------------------------------------------ names: scopes and bindings

    def table(self, scope: ast.AST) -> dict[str, list[_Binding]]:
        """Every binding of every name in ``scope`` (not in the scopes nested in it)."""
        if scope in self._tables:
            return self._tables[scope]
        table: dict[str, list[_Binding]] = defaultdict(list)
        self._tables[scope] = table
        self._globals[scope], self._nonlocals[scope] = set(), set()
        if isinstance(scope, (*_FUNCS, ast.Lambda)):
            a = scope.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                table[arg.arg].append(_Binding(arg.arg, "param", None, value=arg, func=scope))
            for arg in (a.vararg, a.kwarg):
                if arg is not None:
                    table[arg.arg].append(_Binding(arg.arg, "other", None, func=scope))
        body = [scope.body] if isinstance(scope, ast.Lambda) else scope.body
        for node in _walk(body):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self._bind(table, target, node.value, node, "assign", ())
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                self._bind(table, node.target, node.value, node, "assign", ())
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                table[node.target.id].append(_Binding(node.target.id, "aug", node, node.value))
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                self._bind(table, node.target, node.iter, node, "loop", ())
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        self._bind(table, item.optional_vars, None, node, "with", ())
            elif isinstance(node, ast.NamedExpr):
                self._bind(table, node.target, node.value, self.stmt_of(node), "walrus", ())
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.asname or alias.name.split(".")[0]
                    target = alias.name if alias.asname else name
                    table[name].append(_Binding(name, "import", node, target=target))
                    self._imported.append(alias.name)
            elif isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                for alias in node.names:
                    if alias.name == "*":
                        if node.level == 0 and node.module:
                            self.star_modules.append(node.module)
                        continue
                    name = alias.asname or alias.name
                    table[name].append(_Binding(name, "import", node, target=f"{module}.{alias.name}"))
                    self._imported.append(f"{module}.{alias.name}")
            elif isinstance(node, (*_FUNCS, ast.ClassDef)) and node is not scope:
                table[node.name].append(_Binding(node.name, "def", node, value=node))
            elif isinstance(node, ast.ExceptHandler) and node.name:
                table[node.name].append(_Binding(node.name, "other", node))
            elif isinstance(node, ast.Global):
                self._globals[scope].update(node.names)
            elif isinstance(node, ast.Nonlocal):
                self._nonlocals[scope].update(node.names)
        return table

    def _bind(self, table: dict[str, list[_Binding]], target: ast.AST, value: ast.AST | None,
              stmt: ast.AST, kind: str, path: tuple[int, ...]) -> None:
        if isinstance(target, ast.Name):
            table[target.id].append(_Binding(target.id, kind, stmt, value, path))
        elif isinstance(target, (ast.Tuple, ast.List)):
            starred = any(isinstance(e, ast.Starred) for e in target.elts)
            literal = (
                kind == "assign"
                and not path
                and isinstance(value, (ast.Tuple, ast.List))
                and len(value.elts) == len(target.elts)
                and not any(isinstance(e, ast.Starred) for e in value.elts)
            )
            for i, elt in enumerate(target.elts):
                if starred or isinstance(elt, ast.Starred):
                    self._bind(table, elt.value if isinstance(elt, ast.Starred) else elt, None, stmt, "other", ())
                elif literal:
                    self._bind(table, elt, value.elts[i], stmt, kind, ())  # type: ignore[union-attr]
                else:
                    self._bind(table, elt, value, stmt, kind, (*path, i))

    def all_tables(self) -> list[ast.AST]:
        if self._scopes is None:
            self._scopes = [n for n in ast.walk(self.tree) if isinstance(n, _SCOPES)]
            for s in self._scopes:
                self.table(s)
        return self._scopes

    def resolve(self, node: ast.Name) -> _Resolved:
        """The bindings of ``node.id`` that can reach this use."""
        if node in self._resolved:
            return self._resolved[node]
        result = self._resolve(node)
        self._resolved[node] = result
        return result

    def _resolve(self, node: ast.Name) -> _Resolved:
        name = node.id
        child: ast.AST = node
        parent = self.parents.get(node)
        while parent is not None and not isinstance(parent, _SCOPES):
            if isinstance(parent, _COMPREHENSIONS):
                for gen in parent.generators:
                    if child is parent.generators[0].iter:
                        break  # the first iterable is evaluated outside the comprehension
                    if name in _names_in(gen.target):
                        table: dict[str, list[_Binding]] = defaultdict(list)
                        self._bind(table, gen.target, gen.iter, gen, "loop", ())
                        return _Resolved(tuple(table[name]), True)
            child, parent = parent, self.parents.get(parent)
        return self._lookup(name, node, self.scope_of(node))

    def _lookup(self, name: str, use: ast.AST, scope: ast.AST) -> _Resolved:
        if isinstance(scope, ast.Module):
            return self._module_lookup(name, use)
        table = self.table(scope)
        if name in self._globals[scope]:
            return self._module_lookup(name, None)
        if name in table and name not in self._nonlocals[scope]:
            if self.scope_of(use) is scope:
                found, complete = self._reaching(name, use, scope, table[name])
                return _Resolved(tuple(found), complete)
            return _Resolved(tuple(table[name]), True)  # a closure sees whatever was bound last
        outer = self.scope_of(scope)
        while not isinstance(outer, ast.Module):
            if not isinstance(outer, ast.ClassDef):  # a class body is not visible from its methods
                t = self.table(outer)
                if name in t and name not in self._nonlocals[outer]:
                    return _Resolved(tuple(t[name]), True)
            outer = self.scope_of(outer)
        return self._module_lookup(name, None)

    def _module_lookup(self, name: str, use: ast.AST | None) -> _Resolved:
        table = self.table(self.tree)
        extra = [
            b
            for s in self.all_tables()
            if s is not self.tree and name in self._globals.get(s, ())
            for b in self.table(s).get(name, [])
            if b.kind != "param"
        ]
        if name not in table:
            return _Resolved(tuple(extra), bool(extra))
        if use is not None:
            # a function that only ever runs as a spawn target cannot rebind this process's globals
            extra = [b for b in extra if not self.spawn_only(self.scope_of(b.stmt) if b.stmt else None)]
            found, complete = self._reaching(name, use, self.tree, table[name])
            return _Resolved(tuple(found + extra), complete)
        return _Resolved(tuple(table[name] + extra), True)

    def spawn_only(self, fn: ast.AST | None) -> bool:
        """True for a module-level function whose name appears only as the function argument of
        xmp.spawn / torch_xla.launch: it runs in the spawned processes, never in this one."""
        if not isinstance(fn, _FUNCS) or self.scope_of(fn) is not self.tree or fn.decorator_list:
            return False
        refs = [n for n in ast.walk(self.tree) if isinstance(n, ast.Name) and n.id == fn.name]
        for ref in refs:
            call = self.parents.get(ref)
            if not (
                isinstance(call, ast.Call)
                and call.args
                and call.args[0] is ref
                and isinstance(call.func, ast.Attribute)
                and call.func.attr in ("spawn", "launch")
            ):
                return False
        return bool(refs)

    def _reaching(self, name: str, use: ast.AST, scope: ast.AST, binds: list[_Binding]) -> tuple[list[_Binding], bool]:
        """The bindings of ``name`` in ``scope`` that can reach ``use``: walk back from the use's
        statement through the statements before it, block by block; a plain assignment before
        the use ends the walk, a binding inside a branch or loop only adds a possibility."""
        found: list[_Binding] = []

        def add(bs: Iterable[_Binding]) -> None:
            found.extend(b for b in bs if b not in found)

        def within(b: _Binding, node: ast.AST) -> bool:
            return b.stmt is not None and (b.stmt is node or self.inside(b.stmt, node))

        cur = self.stmt_of(use)
        if isinstance(cur, ast.While) and self.inside(use, cur.test):
            add(b for b in binds if within(b, cur) and b.stmt is not cur)
        while cur is not scope and cur in self.slot:
            parent, field, idx = self.slot[cur]
            for prev in reversed(getattr(parent, field)[:idx]):
                here = [b for b in binds if within(b, prev)]
                definite = [
                    b for b in here if b.stmt is prev and b.kind in ("assign", "aug", "import", "def")
                    and isinstance(prev, _SIMPLE_BINDERS)
                ]
                if definite:
                    add(definite)
                    return found, True
                add(here)
            if parent is scope:
                break
            if isinstance(parent, (ast.For, ast.AsyncFor, ast.While)):
                # a loop body sees what the previous iteration bound, and a For its target
                add(b for b in binds if within(b, parent) and b.stmt is not parent)
                target = [b for b in binds if b.stmt is parent]
                if target and field == "body":
                    add(target)
                    return found, True
                add(target)
            elif isinstance(parent, (ast.With, ast.AsyncWith, ast.ExceptHandler)):
                target = [b for b in binds if b.stmt is parent]
                if target:
                    add(target)
                    return found, True
            elif isinstance(parent, ast.Try) and field != "body":
                add(b for b in binds if any(within(b, s) for s in parent.body))
            cur = parent
        add(b for b in binds if b.stmt is None)  # parameters bind before the first statement
        return found, bool(found)

    def qualify(self, node: ast.AST) -> str | None:
        """Dotted name of ``node`` with import aliases resolved (``xm.get_ordinal`` ->
        ``torch_xla.core.xla_model.get_ordinal``); a builtin keeps its name; None for a name the
        script binds to anything but an import, and for anything but a name chain."""
        if isinstance(node, ast.Name):
            res = self.resolve(node)
            if res.bindings:
                targets = {b.target for b in res.bindings if b.kind == "import"}
                if len(targets) == 1 and all(b.kind == "import" for b in res.bindings):
                    return targets.pop()
                return None
            for module in self.star_modules:
                full = f"{module}.{node.id}"
                if full in _APIS or full in _PORTS or full in _RUNTIME_CALLS or full in _DATALOADERS:
                    return full
            if node.id == "DataLoader":
                # a snippet that leaves out its imports: no other DataLoader is in scope
                return "torch.utils.data.DataLoader"
            return node.id
        if isinstance(node, ast.Attribute):
            base = self.qualify(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def call_name(self, call: ast.Call) -> str:
        return self.qualify(call.func) or ""

    # ------------------------------------------------------------------ who calls a function

    def sites(self, fn: ast.AST) -> _Sites:
        if self._sites is None:
            self._sites = defaultdict(_Sites)
            for node in ast.walk(self.tree):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                    bindings = self.resolve(node).bindings
                    defs = [b.value for b in bindings if b.kind == "def" and isinstance(b.value, _FUNCS)]
                    if not defs:
                        continue
                    parent = self.parents.get(node)
                    # a name that may hold one of several functions (one redefined) is a possible
                    # call of each: each one's parameters may get these arguments
                    for d in defs:
                        rec = self._sites[d]
                        if isinstance(parent, ast.Call) and parent.func is node:
                            rec.calls.append((parent, 0))
                        elif (
                            isinstance(parent, ast.Call)
                            and parent.args
                            and parent.args[0] is node
                            and self.call_name(parent) in (f"{XMP}.spawn", "torch_xla.launch")
                        ):
                            rec.spawns.append(parent)
                        else:
                            rec.escapes = True
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    cls = self.enclosing_class(self.enclosing_function(node))
                    method = self.method(cls, node.attr)
                    if method is not None:
                        parent = self.parents.get(node)
                        if isinstance(parent, ast.Call) and parent.func is node:
                            self._sites[method].calls.append((parent, 1))
            for fn_node in ast.walk(self.tree):
                if isinstance(fn_node, _FUNCS) and (fn_node.decorator_list or self.enclosing_class(fn_node)):
                    self._sites[fn_node].escapes = True  # decorated, or a method others may call
        return self._sites[fn]

    def method(self, cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        if cls is None:
            return None
        return next((f for f in cls.body if isinstance(f, _FUNCS) and f.name == name), None)

    def param_args(self, b: _Binding) -> tuple[list[ast.AST], bool, bool]:
        """(the expressions passed for parameter ``b`` at every call site in the file, whether
        those are all the callers, whether a spawn passes the process index to it)."""
        fn = b.func
        if not isinstance(fn, _FUNCS) or not isinstance(b.value, ast.arg):
            return [], False, False
        rec = self.sites(fn)
        a = fn.args
        positional = [*a.posonlyargs, *a.args]
        values: list[ast.AST] = []
        complete = not rec.escapes and bool(rec.calls or rec.spawns)
        index_from_spawn = False
        for call, shift in rec.calls:
            value = self._arg_value(call, fn, b.value, shift)
            if value is None:
                complete = False
            else:
                values.append(value)
        for call in rec.spawns:
            if b.value in positional and positional.index(b.value) == 0:
                index_from_spawn = True
                continue
            spawn_args = _arg(call, 1, "args")
            i = positional.index(b.value) - 1 if b.value in positional else -1
            if isinstance(spawn_args, ast.Tuple) and 0 <= i < len(spawn_args.elts):
                values.append(spawn_args.elts[i])
            else:
                complete = False
        return values, complete, index_from_spawn

    def _arg_value(self, call: ast.Call, fn: ast.AST, param: ast.arg, shift: int) -> ast.AST | None:
        a = fn.args  # type: ignore[attr-defined]
        if any(k.arg is None for k in call.keywords):
            return None  # **kwargs: cannot tell which names it fills
        if param in a.kwonlyargs:
            value = _kw(call, param.arg)
            return value if value is not None else a.kw_defaults[a.kwonlyargs.index(param)]
        positional = [*a.posonlyargs, *a.args]
        if param not in positional:
            return None
        j = positional.index(param)
        i = j - shift
        if i < 0:
            return None
        if param not in a.posonlyargs and _kw(call, param.arg) is not None:
            return _kw(call, param.arg)
        if any(isinstance(x, ast.Starred) for x in call.args[: i + 1]):
            return None
        if i < len(call.args):
            return call.args[i]
        first_default = len(positional) - len(a.defaults)
        return a.defaults[j - first_default] if j >= first_default else None

    def self_attr_values(self, node: ast.Attribute) -> tuple[list[ast.AST], bool]:
        """Values assigned to ``self.<attr>`` in the class of the method holding ``node``."""
        fn = self.enclosing_function(node)
        cls = self.enclosing_class(fn)
        if cls is None:
            return [], False
        classes, complete = [cls], True
        for base in cls.bases:
            q = self.qualify(base) or ""
            local = next(
                (c for c in ast.walk(self.tree) if isinstance(c, ast.ClassDef) and c.name == ast.unparse(base)), None
            )
            if local is not None and local is not cls:
                classes.append(local)
            elif not (q.endswith("Module") or q in ("object", "torch.utils.data.Dataset")):
                complete = False  # a base from another file may set it too
        values: list[ast.AST] = []
        for c in classes:
            for f in c.body:
                if not isinstance(f, _FUNCS) or not f.args.args:
                    continue
                me = f.args.args[0].arg
                for n in _walk(f.body):
                    if isinstance(n, ast.Assign):
                        for t in n.targets:
                            if (
                                isinstance(t, ast.Attribute)
                                and t.attr == node.attr
                                and isinstance(t.value, ast.Name)
                                and t.value.id == me
                            ):
                                values.append(n.value)
        return values, complete and bool(values)

    # ------------------------------------------------------------------ what an expression holds

    def kinds(self, node: ast.AST | None) -> frozenset[str]:
        """What ``node`` can hold, as far as the code shows (the _K_ constants); an empty
        set or _K_UNKNOWN in it means the code does not settle it."""
        if node is None:
            return frozenset({_K_UNKNOWN})
        if node in self._kinds:
            return self._kinds[node]
        if node in self._busy:
            return frozenset()  # a cycle (x = x + 1 in a loop) adds nothing new
        if len(self._busy) > _MAX_DEPTH:
            return frozenset({_K_UNKNOWN})  # a chain too long to follow: say it is not settled
        self._busy.add(node)
        try:
            result = frozenset(self._compute_kinds(node))
        finally:
            self._busy.discard(node)
        self._kinds[node] = result
        return result

    def is_device(self, node: ast.AST) -> bool:
        """Certainly a tensor on the XLA device."""
        k = self.kinds(node)
        return bool(k) and k <= _ON_DEVICE

    def maybe_device(self, node: ast.AST) -> bool:
        """Could be a tensor on the XLA device: the code does not rule it out."""
        k = self.kinds(node)
        return not k or bool(k & (_ON_DEVICE | {_K_TENSOR, _K_UNKNOWN}))

    def _compute_kinds(self, node: ast.AST) -> set[str]:
        if isinstance(node, ast.Name):
            res = self.resolve(node)
            out: set[str] = set()
            for b in res.bindings:
                out |= self.binding_kinds(b)
            if not res.complete:
                out.add(_K_UNKNOWN)
            return out
        if isinstance(node, ast.Constant):
            return self._device_string(node.value) or {_K_HOST}
        if isinstance(node, ast.JoinedStr):
            return {_K_HOST}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(self.kinds(e) for e in node.elts)) if node.elts else {_K_HOST}
        if isinstance(node, ast.Dict):
            return set().union(*(self.kinds(v) for v in node.values)) if node.values else {_K_HOST}
        if isinstance(node, (ast.BinOp, ast.Compare)):
            operands = [node.left, node.right] if isinstance(node, ast.BinOp) else [node.left, *node.comparators]
            return self._combine(operands)
        if isinstance(node, ast.UnaryOp):
            return set(self.kinds(node.operand))
        if isinstance(node, ast.BoolOp):
            return set().union(*(self.kinds(v) for v in node.values))
        if isinstance(node, ast.IfExp):
            return set(self.kinds(node.body) | self.kinds(node.orelse))
        if isinstance(node, (ast.Starred, ast.NamedExpr, ast.Await)):
            return set(self.kinds(node.value))
        if isinstance(node, ast.Subscript):
            return self._element(self.kinds(node.value))
        if isinstance(node, ast.Attribute):
            return self._attribute_kinds(node)
        if isinstance(node, ast.Call):
            return self._call_kinds(node)
        if isinstance(node, ast.Lambda):
            return {_K_FUNC}
        return {_K_UNKNOWN}

    def binding_kinds(self, b: _Binding) -> frozenset[str]:
        if b in self._binding_kinds:
            return self._binding_kinds[b]
        if b in self._busy:
            return frozenset()
        if len(self._busy) > _MAX_DEPTH:
            return frozenset({_K_UNKNOWN})
        self._busy.add(b)
        try:
            out = frozenset(self._compute_binding_kinds(b))
        finally:
            self._busy.discard(b)
        self._binding_kinds[b] = out
        return out

    def _compute_binding_kinds(self, b: _Binding) -> set[str]:
        if b.kind in ("assign", "walrus"):
            out = set(self.kinds(b.value))
            for _ in b.path:
                out = self._element(out)
            if _K_MODULE in out and b in self._moved:  # model.to(xla_device) moves the module in place
                out = (out - {_K_MODULE}) | {_K_MODULE_XLA}
            return out
        if b.kind == "aug":
            assert isinstance(b.stmt, ast.AugAssign)
            before = self.resolve(b.stmt.target) if isinstance(b.stmt.target, ast.Name) else _Resolved((), False)
            earlier: set[str] = set()
            for e in before.bindings:
                earlier |= self.binding_kinds(e)
            return self._combine_kinds(self.kinds(b.value), earlier)
        if b.kind == "loop":
            return self._iter_element(b.value, b.path)
        if b.kind == "param":
            fn = b.func
            cls = self.enclosing_class(fn)
            is_static = any(ast.unparse(d) == "staticmethod" for d in getattr(fn, "decorator_list", []))
            args = fn.args.args  # type: ignore[union-attr]
            if cls is not None and not is_static and args and args[0] is b.value:
                return {_K_INSTANCE}
            values, complete, index = self.param_args(b)
            out = {_K_HOST} if index else set()
            for v in values:
                out |= self.kinds(v)
            if not complete:
                out.add(_K_UNKNOWN)
            return out
        if b.kind == "def":
            return {_K_FUNC}
        return {_K_UNKNOWN}

    def _device_string(self, value: Any) -> set[str]:
        if not isinstance(value, str):
            return set()
        head = value.split(":")[0]
        if head == "xla":
            return {_K_XLA_DEVICE}
        if head in ("cpu", "cuda", "mps", "tpu", "meta"):
            return {_K_OTHER_DEVICE}
        return set()

    def _combine(self, operands: Sequence[ast.AST]) -> set[str]:
        return self._combine_kinds(*(self.kinds(o) for o in operands))

    def _combine_kinds(self, *parts: Iterable[str]) -> set[str]:
        """An arithmetic result: on the device if any operand is; a tensor if any operand is one."""
        ks: set[str] = set().union(*parts)
        if ks & _ON_DEVICE:
            return {_K_DEVICE}
        if ks & {_K_TENSOR, _K_CPU, _K_BATCH_CPU}:
            return {_K_CPU} if ks <= {_K_CPU, _K_BATCH_CPU, _K_HOST} else {_K_TENSOR}
        if ks and ks <= {_K_HOST}:
            return {_K_HOST}
        return {_K_UNKNOWN}

    def _element(self, ks: Iterable[str]) -> set[str]:
        """What indexing or unpacking a value of these kinds gives."""
        out: set[str] = set()
        for k in ks:
            if k in (_K_DEVICE, _K_ON_XLA, _K_BATCH_DEVICE):
                out.add(_K_DEVICE)
            elif k in (_K_CPU, _K_BATCH_CPU):
                out.add(_K_CPU)
            elif k in _KEPT_BY_ELEMENT:
                out.add(k)  # a tuple of these, or a tensor's row
            else:
                out.add(_K_UNKNOWN)
        return out or {_K_UNKNOWN}

    def _iter_element(self, it: ast.AST | None, path: tuple[int, ...]) -> set[str]:
        """What a loop over ``it`` binds, unpacked along ``path``."""
        if isinstance(it, ast.Call):
            last = self.call_name(it).split(".")[-1]
            if last == "enumerate" and it.args:
                if not path:
                    return {_K_UNKNOWN}
                return {_K_HOST} if path[0] == 0 else self._iter_element(it.args[0], path[1:])
            if last == "zip" and it.args:
                if not path or path[0] >= len(it.args):
                    return {_K_UNKNOWN}
                return self._iter_element(it.args[path[0]], path[1:])
            if last in _ITER_WRAPPERS and it.args:
                return self._iter_element(it.args[0], path)
            if last in ("range", "trange"):
                return {_K_HOST}
        out: set[str] = set()
        for k in self.kinds(it):
            if k == _K_DEVICE_LOADER:
                out.add(_K_DEVICE if path else _K_BATCH_DEVICE)
            elif k == _K_DATALOADER:
                out.add(_K_CPU if path else _K_BATCH_CPU)
            elif k in (_K_DEVICE, _K_ON_XLA, _K_BATCH_DEVICE):
                out.add(_K_DEVICE)
            elif k in (_K_CPU, _K_BATCH_CPU):
                out.add(_K_CPU)
            elif k == _K_TENSOR:
                out.add(_K_TENSOR)
            else:
                out.add(_K_UNKNOWN)
        return out or {_K_UNKNOWN}

    def _attribute_kinds(self, node: ast.Attribute) -> set[str]:
        base = self.kinds(node.value)
        if node.attr in _META_ATTRS and base and base <= _TENSORISH:
            return {_K_HOST}
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            values, complete = self.self_attr_values(node)
            out: set[str] = set()
            for v in values:
                out |= self.kinds(v)
            if not complete:
                out.add(_K_UNKNOWN)
            return out
        if base and base <= _TENSORISH:
            return self._element(base)  # x.T, x.data, x.grad
        return {_K_UNKNOWN}

    def move_target(self, call: ast.Call) -> str | None:
        """For ``x.to(...)``: _K_XLA_DEVICE, _K_OTHER_DEVICE, _K_UNKNOWN, or None when it moves nothing
        (``x.to(torch.float16)``)."""
        arg = _arg(call, 0, "device")
        if arg is None:
            return None
        q = self.qualify(arg) or ""
        if q.startswith("torch.") and q != "torch.device":
            return None  # a dtype
        k = self.kinds(arg)
        if k == {_K_XLA_DEVICE}:
            return _K_XLA_DEVICE
        if k == {_K_OTHER_DEVICE}:
            return _K_OTHER_DEVICE
        return _K_UNKNOWN

    def _moved_kinds(self, receiver: frozenset[str], target: str | None) -> set[str]:
        if target is None:
            return set(receiver)
        out: set[str] = set()
        for k in receiver or {_K_UNKNOWN}:
            if k in (_K_MODULE, _K_MODULE_XLA, _K_ON_XLA):
                out.add(_K_MODULE_XLA if target == _K_XLA_DEVICE else _K_MODULE)
            elif k in _TENSORISH:
                out.add(_K_DEVICE if target == _K_XLA_DEVICE else _K_CPU if target == _K_OTHER_DEVICE else _K_TENSOR)
            else:
                out.add(_K_ON_XLA if target == _K_XLA_DEVICE else _K_UNKNOWN)
        return out

    def _call_result(self, callee: Iterable[str], call: ast.Call) -> set[str]:
        """What calling a value of kinds ``callee`` returns."""
        out: set[str] = set()
        for k in callee:
            if k in (_K_MODULE_XLA, _K_ON_XLA):
                out.add(_K_DEVICE)
            elif k == _K_MODULE:
                out.add(_K_TENSOR)
            elif k == _K_LOSS:
                out |= self._combine_kinds(*(self.kinds(a) for a in call.args)) - {_K_HOST}
            else:
                out.add(_K_UNKNOWN)
        return out or {_K_UNKNOWN}

    def returns(self, fn: ast.AST) -> set[str]:
        """What a function defined in the file returns."""
        if not isinstance(fn, _FUNCS) or any(
            ast.unparse(d) not in ("staticmethod", "classmethod") for d in fn.decorator_list
        ):
            return {_K_UNKNOWN}
        body = list(_walk(fn.body))
        if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in body):
            return {_K_UNKNOWN}
        rets = [n for n in body if isinstance(n, ast.Return)]
        if not rets:
            return {_K_HOST}
        out: set[str] = set()
        for r in rets:
            out |= self.kinds(r.value) if r.value is not None else {_K_HOST}
        return out

    def _torch_op(self, call: ast.Call, factory: bool) -> set[str]:
        device = _kw(call, "device")
        if device is not None:
            k = self.kinds(device)
            return {_K_DEVICE} if k == {_K_XLA_DEVICE} else {_K_CPU} if k == {_K_OTHER_DEVICE} else {_K_TENSOR}
        args = [*call.args, *(k.value for k in call.keywords)]
        ks: set[str] = set().union(*(self.kinds(a) for a in args)) if args else set()
        if ks & _ON_DEVICE:
            return {_K_DEVICE}
        if factory:
            return {_K_CPU}
        return {_K_CPU} if ks and ks <= {_K_CPU, _K_BATCH_CPU, _K_HOST} else {_K_TENSOR}

    def _call_kinds(self, call: ast.Call) -> set[str]:
        func = call.func
        q = self.call_name(call)
        last = q.split(".")[-1]
        if q:
            if q in _DEVICE_CALLS:
                return {_K_XLA_DEVICE}
            if q == "torch.device":
                k = self.kinds(call.args[0]) if call.args else frozenset()
                return set(k) if k and k <= {_K_XLA_DEVICE, _K_OTHER_DEVICE} else {_K_UNKNOWN}
            if q == f"{PL}.ParallelLoader":
                return {_K_PARALLEL_LOADER}
            if q == f"{PL}.MpDeviceLoader":
                return {_K_DEVICE_LOADER}
            if q in _DATALOADERS:
                return {_K_DATALOADER}
            if q in (f"{XM}.all_reduce", f"{XM}.all_gather", f"{XM}.reduce_scatter"):
                return {_K_DEVICE}
            if q == f"{XMP}.MpModelWrapper" or q.startswith("torchvision.models.") or q == "timm.create_model":
                return {_K_MODULE}
            if q in ("torch.nn.parallel.DistributedDataParallel", "torch.nn.DataParallel") and call.args:
                return set(self.kinds(call.args[0]))
            if q.startswith("torch.nn.") and last[:1].isupper():
                return {_K_LOSS} if last.endswith("Loss") else {_K_MODULE}
            if q.startswith("torch.nn.functional."):
                return self._torch_op(call, factory=False)
            tensor_fn = last[:1].islower() or last in _TORCH_FACTORIES
            if q.startswith("torch.") and not q.startswith(_TORCH_NOT_TENSOR) and tensor_fn:
                return self._torch_op(call, factory=last in _TORCH_FACTORIES)
            if q.split(".")[0] in _HOST_MODULES or q in _HOST_BUILTINS:
                return {_K_HOST}
        if isinstance(func, ast.Attribute):
            return self._method_kinds(call, func)
        if isinstance(func, ast.Name) and not q:
            res = self.resolve(func)
            out: set[str] = set()
            for b in res.bindings:
                if b.kind == "def" and isinstance(b.value, ast.ClassDef):
                    out.add(_K_MODULE if b.value.name in self.module_classes else _K_INSTANCE)
                elif b.kind == "def":
                    out |= self.returns(b.value)
                else:
                    out |= self._call_result(self.binding_kinds(b), call)
            if not res.complete:
                out.add(_K_UNKNOWN)
            return out
        if not isinstance(func, ast.Name):
            return self._call_result(self.kinds(func), call)  # nn.BCEWithLogitsLoss()(out, y)
        return {_K_UNKNOWN}

    def _method_kinds(self, call: ast.Call, func: ast.Attribute) -> set[str]:
        attr = func.attr
        if attr == "per_device_loader":
            return {_K_DEVICE_LOADER}
        if attr in ("item", "tolist", "numpy") or attr in _META_METHODS:
            return {_K_HOST}
        receiver = self.kinds(func.value)
        if attr == "to":
            return self._moved_kinds(receiver, self.move_target(call))
        if attr in ("cpu", "cuda"):
            return self._moved_kinds(receiver, _K_OTHER_DEVICE)
        if attr in _SAME_KIND_METHODS:
            return set(receiver)
        if attr == "forward" and receiver and receiver <= _MODULES:
            return self._call_result(receiver, call)
        if isinstance(func.value, ast.Name) and func.value.id == "self":
            cls = self.enclosing_class(self.enclosing_function(call))
            method = self.method(cls, attr)
            if method is not None:
                return self.returns(method)
            return self._call_result(self._attribute_kinds(func), call)
        if receiver and receiver <= _TENSORISH:
            return self._element(receiver)  # a tensor method gives a tensor on the same device
        return {_K_UNKNOWN}

    # ------------------------------------------------------------------ order of execution

    def unconditional(self, node: ast.AST, stmt: ast.AST) -> bool:
        """True when ``node`` is evaluated every time its statement runs (not in one arm of an
        ``a if c else b``, after an ``and`` / ``or``, in a lambda or a comprehension's body)."""
        cur = node
        while cur is not stmt and cur is not None:
            parent = self.parents.get(cur)
            if isinstance(parent, ast.IfExp) and cur is not parent.test:
                return False
            if isinstance(parent, ast.BoolOp) and cur is not parent.values[0]:
                return False
            if isinstance(parent, ast.Lambda):
                return False
            if isinstance(parent, _COMPREHENSIONS) and cur is not parent.generators[0]:
                return False
            if isinstance(parent, ast.comprehension) and cur is not parent.iter:
                return False
            cur = parent  # type: ignore[assignment]
        return cur is stmt

    def runs_before(self, first: ast.AST, later: ast.AST) -> bool:
        """True when ``first`` certainly runs before ``later`` each time ``later`` runs: both in
        one scope, ``first`` unconditional in a statement that comes earlier in a block holding
        ``later`` (directly or inside a later compound statement)."""
        if self.scope_of(first) is not self.scope_of(later):
            return False
        stmt = self.stmt_of(first)
        if not self.unconditional(first, stmt) or stmt not in self.slot:
            return False
        parent, field, idx = self.slot[stmt]
        return any(s is later or self.inside(later, s) for s in getattr(parent, field)[idx + 1 :])

    def anchors(self, call: ast.Call, depth: int = 3) -> list[ast.Call]:
        """``call`` and the calls that reach it: the call sites of its function, and theirs."""
        out = [call]
        fn = self.enclosing_function(call)
        if fn is not None and depth > 0:
            for site, _ in self.sites(fn).calls:
                out += self.anchors(site, depth - 1)
        return out

    def guarded(self, node: ast.AST, catches: set[str]) -> bool:
        """True when ``node`` sits in a try body whose handler catches one of ``catches``, or
        behind an ``if`` on hasattr() or a version: code written to survive the failure."""
        cur: ast.AST = node
        parent = self.parents.get(cur)
        while parent is not None and not isinstance(parent, _SCOPES):
            if isinstance(parent, ast.Try) and any(cur is s for s in parent.body):
                for handler in parent.handlers:
                    if handler.type is None:
                        return True
                    names = {n.id for n in ast.walk(handler.type) if isinstance(n, ast.Name)}
                    names |= {n.attr for n in ast.walk(handler.type) if isinstance(n, ast.Attribute)}
                    if names & catches:
                        return True
            if isinstance(parent, (ast.If, ast.IfExp, ast.While)) and cur is not parent.test:
                test = ast.unparse(parent.test)
                if "hasattr" in test or "version" in test.lower():
                    return True
                # a switch between releases: the other arm calls torch_xla 2.x's replacement
                other = parent.orelse if self._in_arm(cur, parent.body) else parent.body
                for n in _walk(other if isinstance(other, list) else [other]):
                    if isinstance(n, ast.Call) and self.call_name(n).startswith(f"{XR}."):
                        return True
            cur, parent = parent, self.parents.get(parent)
        return False

    @staticmethod
    def _in_arm(node: ast.AST, arm: Any) -> bool:
        return node is arm or (isinstance(arm, list) and any(node is s for s in arm))

    def static_values(self, node: ast.AST | None, depth: int = 0) -> set[Any] | None:
        """Every value ``node`` can have when the code settles it (literals, names assigned
        literals, ``FLAGS['key']`` with every write to that key a literal), else None."""
        if depth > 8:
            return None
        if node is None:
            return {None}
        if isinstance(node, ast.Constant):
            return {node.value}
        if isinstance(node, ast.IfExp):
            a, b = self.static_values(node.body, depth + 1), self.static_values(node.orelse, depth + 1)
            return a | b if a is not None and b is not None else None
        if isinstance(node, ast.Name):
            res = self.resolve(node)
            if not res.complete or not res.bindings:
                return None
            values: set[Any] = set()
            for b in res.bindings:
                if b.kind != "assign" or b.path:
                    return None
                v = self.static_values(b.value, depth + 1)
                if v is None:
                    return None
                values |= v
            return values
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            return self._dict_item_values(node.value, _const(node.slice), depth)
        return None

    def _dict_item_values(self, base: ast.Name, key: Any, depth: int) -> set[Any] | None:
        b = self.resolve(base).single
        if key is None or b is None or b.kind != "assign" or b.path or not isinstance(b.value, ast.Dict):
            return None
        values: set[Any] = set()

        def take(value: ast.AST) -> bool:
            v = self.static_values(value, depth + 1)
            if v is not None:
                values.update(v)
            return v is not None

        for k, v in zip(b.value.keys, b.value.values):
            if k is None or (_const(k) == key and not take(v)):
                return None
        for n in ast.walk(self.tree):
            if isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del)):
                k = _const(n.slice)
                parent = self.parents.get(n)
                if k == key:  # any dict's entry under this key: it may be this dict, passed along
                    if not (isinstance(parent, ast.Assign) and parent.targets == [n] and take(parent.value)):
                        return None
                elif k is None and isinstance(n.value, ast.Name) and self.resolve(n.value).single is b:
                    return None
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in ("update", "setdefault", "pop", "clear", "__setitem__")
                and isinstance(n.func.value, ast.Name)
                and self.resolve(n.func.value).single is b
            ):
                return None
        return values or None

    # ------------------------------------------------------------------ run

    def run(self) -> tuple[ScriptFinding, ...]:
        self.all_tables()
        self.read_classes()
        self.read_moves()
        calls = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)]
        self.check_imports()
        for call in calls:
            self.check_call(call)
        self.check_env_assignments()
        self.check_step_loops()
        self.check_dataloaders(calls)
        self.check_optimizer_before_move(calls)
        self.check_device_before_spawn(calls)
        self.check_classes()
        self.check_lr_scaling()
        self.check_samplers(calls)
        order = {s: i for i, s in enumerate(SEVERITIES)}
        return tuple(sorted(self.findings.values(), key=lambda f: (f.line, f.col, order[f.severity], f.code)))

    def read_classes(self) -> None:
        classes = [n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)]
        changed = True
        while changed:
            changed = False
            for cls in classes:
                if cls.name in self.module_classes:
                    continue
                for base in cls.bases:
                    q = self.qualify(base) or ""
                    library = q.split(".")[0] in ("torch", "pytorch_lightning", "lightning") and q.endswith("Module")
                    if library or ast.unparse(base) in self.module_classes:
                        self.module_classes.add(cls.name)
                        changed = True
                        break

    def read_moves(self) -> None:
        """Which bindings ``x.to(xla_device)`` moves in place (a module's ``to`` returns itself)."""
        self.xla_moves: list[ast.Call] = []
        for call in (n for n in ast.walk(self.tree) if isinstance(n, ast.Call)):
            func = call.func
            if isinstance(func, ast.Attribute) and func.attr == "to" and self.move_target(call) == _K_XLA_DEVICE:
                self.xla_moves.append(call)
                if isinstance(func.value, ast.Name):
                    self._moved.update(self.resolve(func.value).bindings)
        self._kinds.clear()  # kinds read so far did not know about the moves
        self._binding_kinds.clear()

    # ------------------------------------------------------------------ imports and calls

    def add_api(self, node: ast.AST, api: _Api, prefix: str = "") -> None:
        if api.severity == "error" and self.guarded(node, _CATCHES_ATTRIBUTE | _CATCHES_IMPORT):
            self.add(
                node,
                api.code,
                "info",
                f"{prefix}{api.message}; it sits behind a try/except or a version check here, so it "
                "fails only where that branch still takes it",
                api.fix,
            )
        else:
            self.add(node, api.code, api.severity, f"{prefix}{api.message}", api.fix)

    def check_imports(self) -> None:
        ported = False
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"] or [node.module]
                for alias in node.names:
                    api = _APIS.get(f"{node.module}.{alias.name}")
                    if api is not None and api.severity == "error":
                        self.add_api(node, api, prefix=f"import of {node.module}.{alias.name}: ")
            else:
                continue
            for module in modules:
                for removed, api in _REMOVED_MODULES.items():
                    if module == removed or module.startswith(removed + "."):
                        self.add_api(node, api)
                if not ported and (module == "torch_xla" or module.startswith("torch_xla.")):
                    ported = True
                    self.add_port(node, "import torch_xla", _PORT_IMPORT)

    def check_call(self, call: ast.Call) -> None:
        name = self.call_name(call)
        api = _APIS.get(name)
        if api is not None:
            self.add_api(call, api)
        port = _PORTS.get(name)
        if port is not None:
            self.add_port(call, ast.unparse(call.func), port)
        if name == f"{XM}.get_xla_supported_devices":
            first = call.args[0] if call.args else None
            if _kw(call, "devkind") is not None or isinstance(_const(first), str):
                self.add_api(
                    call,
                    _Api(
                        "removed-api",
                        "error",
                        "get_xla_supported_devices() lost its devkind argument: torch_xla 2.9's "
                        "signature is (max_devices=None), so a device kind fails with TypeError",
                        "torch_xla.devices() for the device list, "
                        "torch_xla.runtime.global_runtime_device_count() for the count",
                    ),
                )
        if name == f"{XMP}.spawn":
            self.check_spawn(call)
        if name in ("torch.save", f"{XM}.save"):
            short = "xm.save" if name != "torch.save" else "torch.save"
            self.add(
                call,
                "pickle-checkpoint",
                "info",
                f"{short}() writes a pickle in place: a crash mid-write leaves a truncated file, and "
                "reading it back means unpickling (unsafe with weights_only=False)",
                "save tensors with safetensors: safetensors.torch.save_file({k: v.cpu() for k, v in "
                "model.state_dict().items()}, 'best.safetensors') - xlatrain's best weights and "
                "checkpoints are safetensors + JSON",
            )
        if name == "torch.load":
            self.check_torch_load(call)
        if name.endswith("Trainer") and name.split(".")[0] in ("pytorch_lightning", "lightning"):
            if _kw(call, "tpu_cores") is not None:
                self.add(
                    call,
                    "removed-api",
                    "error",
                    "Trainer(tpu_cores=...) was removed in Lightning 2.0: TypeError",
                    "Trainer(accelerator='tpu', devices=8) in Lightning; with xlatrain: "
                    "Trainer(model, loss_fn, optimizer_fn, backend='tpu')",
                )
        self.check_dynamic_shape(call, name)
        self.check_env_call(call, name)

    def check_dynamic_shape(self, call: ast.Call, name: str) -> None:
        if not self.uses_xla:
            return
        func = call.func
        if name == "torch.where" and len(call.args) == 1 and not call.keywords:
            operand: ast.AST | None = call.args[0]  # one-argument torch.where is nonzero()
        elif name.startswith("torch.") and name.split(".")[-1] in _DYNAMIC_SHAPE:
            operand = call.args[0] if call.args else None
        elif not name and isinstance(func, ast.Attribute) and func.attr in _DYNAMIC_SHAPE:
            operand = func.value
        else:
            return
        fn = self.enclosing_function(call)
        cls = self.enclosing_class(fn)
        in_forward = (
            fn is not None
            and fn.name in _TENSOR_ARG_METHODS
            and cls is not None
            and cls.name in self.module_classes
            and (name.startswith("torch.") or (operand is not None and self.maybe_device(operand)))
        )
        if operand is not None and self.is_device(operand) and (in_forward or self.in_step_loop(call)):
            severity, where = "warning", ""
        elif operand is not None and self.is_device(operand):
            severity, where = "info", " (once here, outside any per-batch loop)"
        elif in_forward:
            severity = "warning" if self.xla_moves else "info"
            where = "" if self.xla_moves else " (when this model runs on the XLA device)"
        else:
            return
        self.add(
            call,
            "dynamic-shape",
            severity,
            f"{ast.unparse(call.func)}() returns a tensor whose shape depends on the data{where}: XLA "
            "falls back to the CPU for it or compiles a new graph for each new shape",
            "keep shapes static: mask instead of selecting (torch.where(cond, x, 0), x * mask, "
            "sum over the mask) and count with mask.sum()",
        )

    def check_spawn(self, call: ast.Call) -> None:
        nprocs = _arg(call, 2, "nprocs")
        values = self.static_values(nprocs)
        fix = (
            "drop nprocs: torch_xla starts one process per local chip itself; or use xlatrain's "
            "default SPMD mode (one process drives every chip)"
        )
        if values is None:
            self.add(
                call,
                "spawn-nprocs",
                "info",
                f"xmp.spawn(nprocs={ast.unparse(nprocs)}): the check cannot read its value without "
                "running the script; torch_xla 2.9 raises ValueError for anything but 1 or None",
                fix,
            )
            return
        bad = sorted((v for v in values if v not in (None, 1)), key=repr)
        if not bad:
            return
        shown = " or ".join(map(repr, bad))
        if len(bad) == len(values):
            self.add(
                call,
                "spawn-nprocs",
                "error",
                f"xmp.spawn(nprocs={shown}) raises ValueError in torch_xla 2.9: only 1 or None are "
                "accepted ('Unsupported nprocs')",
                fix,
            )
        else:
            self.add(
                call,
                "spawn-nprocs",
                "info",
                f"xmp.spawn(nprocs={ast.unparse(nprocs)}) is {shown} on some paths (it can also be "
                f"{' or '.join(repr(v) for v in sorted(values - set(bad), key=repr))}): there torch_xla "
                "2.9 raises ValueError ('Unsupported nprocs')",
                fix,
            )

    def check_torch_load(self, call: ast.Call) -> None:
        weights_only = _kw(call, "weights_only")
        if weights_only is None:
            self.add(
                call,
                "torch-load",
                "info",
                "torch.load() without weights_only: torch >= 2.6 defaults to weights_only=True, older "
                "torch unpickles anything in the file",
                "pass weights_only=True explicitly, or store weights as safetensors and read them "
                "with safetensors.torch.load_file (xlatrain.load_weights)",
            )
        elif self.static_values(weights_only) != {True}:
            self.add(
                call,
                "torch-load",
                "info",
                f"torch.load(weights_only={ast.unparse(weights_only)}) unpickles the file: a "
                "checkpoint from anyone else can run code on load",
                "use weights_only=True, or safetensors (xlatrain.load_weights)",
            )

    # ------------------------------------------------------------------ loaders and samplers

    def assigned_names(self, node: ast.AST) -> list[str]:
        """Names a value is assigned to (``x = <node>``, ``self.x = <node>``)."""
        parent = self.parents.get(node)
        if isinstance(parent, (ast.Assign, ast.AnnAssign)):
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            return [ast.unparse(t) for t in targets]
        return []

    def loader_role(self, call: ast.Call) -> str | None:
        """'train' or 'eval' as the names around a DataLoader / sampler call suggest, or None.
        A guess: it only ever picks between infos."""
        near = " ".join(
            self.assigned_names(call)
            + [ast.unparse(a) for a in call.args[:1]]
            + [ast.unparse(v) for k in ("dataset", "sampler") if (v := _kw(call, k)) is not None]
        )
        fn = self.enclosing_function(call)
        for text in (near, fn.name if fn is not None else ""):
            if _EVAL_HINT.search(text):
                return "eval"
            if "train" in text.lower():
                return "train"
        if _const(_kw(call, "shuffle")) is True:
            return "train"
        return None

    def loader_sources(self, expr: ast.AST | None, seen: set[Any] | None = None) -> set[ast.Call]:
        """The ``DataLoader(...)`` calls whose batches ``expr`` yields, followed through names,
        parameters (their call sites), ParallelLoader / MpDeviceLoader / per_device_loader,
        enumerate / tqdm / zip, and functions that return a loader."""
        seen = set() if seen is None else seen
        if expr is None or expr in seen or len(seen) > _MAX_DEPTH:
            return set()
        seen.add(expr)
        out: set[ast.Call] = set()
        if isinstance(expr, ast.Call):
            q = self.call_name(expr)
            last = q.split(".")[-1]
            if q in _DATALOADERS:
                return {expr}
            if last in ("enumerate", "zip", *_ITER_WRAPPERS):
                for a in expr.args if last == "zip" else expr.args[:1]:
                    out |= self.loader_sources(a, seen)
            elif q in (f"{PL}.ParallelLoader", f"{PL}.MpDeviceLoader"):
                out |= self.loader_sources(_arg(expr, 0, "loader"), seen)
            elif isinstance(expr.func, ast.Attribute) and expr.func.attr == "per_device_loader":
                out |= self.loader_sources(expr.func.value, seen)
            elif isinstance(expr.func, ast.Name) and not q:
                for b in self.resolve(expr.func).bindings:
                    if b.kind == "def" and isinstance(b.value, _FUNCS):
                        for r in _walk(b.value.body):
                            if isinstance(r, ast.Return):
                                out |= self.loader_sources(r.value, seen)
        elif isinstance(expr, ast.Name):
            for b in self.resolve(expr).bindings:
                if b.kind in ("assign", "walrus"):
                    for e in self.element_exprs(b.value, b.path):
                        out |= self.loader_sources(e, seen)
                elif b.kind == "param":
                    for v in self.param_args(b)[0]:
                        out |= self.loader_sources(v, seen)
        elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
            for v in self.self_attr_values(expr)[0]:
                out |= self.loader_sources(v, seen)
        elif isinstance(expr, ast.IfExp):
            out |= self.loader_sources(expr.body, seen) | self.loader_sources(expr.orelse, seen)
        return out

    def element_exprs(self, value: ast.AST | None, path: tuple[int, ...], depth: int = 0) -> list[ast.AST]:
        """The expressions at ``path`` inside ``value``: an element of a tuple literal, or of the
        tuples a function defined in the file returns (``train, val = make_loaders()``); none
        when the code does not show which element is which."""
        if value is None or depth > 6:
            return []
        if not path:
            return [value]
        i, rest = path[0], path[1:]
        if isinstance(value, (ast.Tuple, ast.List)):
            if any(isinstance(e, ast.Starred) for e in value.elts) or i >= len(value.elts):
                return []
            return self.element_exprs(value.elts[i], rest, depth + 1)
        out: list[ast.AST] = []
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            for b in self.resolve(value.func).bindings:
                if b.kind == "def" and isinstance(b.value, _FUNCS):
                    for r in _walk(b.value.body):
                        if isinstance(r, ast.Return):
                            out += self.element_exprs(r.value, path, depth + 1)
        return out

    def runs_step(self, loop: ast.AST) -> bool:
        """True when the loop's own body (not a nested loop's) runs backward or an optimizer step."""
        stack: list[ast.AST] = list(getattr(loop, "body", []))
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.For, ast.AsyncFor, ast.While, *_FUNCS, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "backward" or self.call_name(node) == f"{XM}.optimizer_step":
                    return True
            stack.extend(ast.iter_child_nodes(node))
        return False

    def fed_loaders(self) -> tuple[set[ast.Call], set[ast.Call]]:
        """(DataLoaders that feed a training loop, DataLoaders that feed another loop), per the code."""
        train: set[ast.Call] = set()
        other: set[ast.Call] = set()
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.For, ast.AsyncFor)):
                (train if self.runs_step(node) else other).update(self.loader_sources(node.iter))
            elif isinstance(node, _FUNCS) and node.name in ("train_dataloader", "val_dataloader", "test_dataloader"):
                for r in _walk(node.body):
                    if isinstance(r, ast.Return):
                        (train if node.name == "train_dataloader" else other).update(self.loader_sources(r.value))
            elif (
                self.uses_lightning
                and isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "fit"
            ):
                for a in [*node.args[1:2], _kw(node, "train_dataloaders"), _kw(node, "train_dataloader")]:
                    train.update(self.loader_sources(a))
        return train, other - train

    def check_dataloaders(self, calls: list[ast.Call]) -> None:
        train, other = self.fed_loaders()
        for call in calls:
            if self.call_name(call) in _DATALOADERS:
                self.check_dataloader(call, call in train, call in other)

    def check_dataloader(self, call: ast.Call, feeds_training: bool, feeds_other: bool) -> None:
        if _arg(call, 4, "batch_sampler") is not None:
            return
        # DataLoader(dataset, batch_size=1, shuffle, sampler, batch_sampler, num_workers,
        # collate_fn, pin_memory, drop_last=False, ...): **kwargs may carry either
        opaque = any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args)
        size_node = _arg(call, 1, "batch_size")
        default_size = None if opaque else {1}
        sizes = self.static_values(size_node) if size_node is not None else default_size
        if sizes == {None}:
            return  # batch_size=None: the dataset yields whole batches itself
        drop_last = _arg(call, 8, "drop_last")
        drops = self.static_values(drop_last) if drop_last is not None else (None if opaque else {False})
        xla = self.uses_xla or self.lightning_on_tpu
        role = self.loader_role(call)
        ragged = (
            "unless the dataset size is a multiple of the batch size, the last batch of each epoch "
            "is smaller, and on XLA a new batch shape compiles its own graphs (forward, backward, "
            "optimizer step) - compile time and device memory spent on one batch"
        )
        ragged_fix = (
            "DataLoader(..., drop_last=True) (a DistributedSampler's drop_last only evens out "
            "replicas, not batches); xlatrain drops or pads the tail itself"
        )
        if drops != {True} and (sizes is None or any(s != 1 for s in sizes)):
            if feeds_training and drops is None:
                self.add(
                    call,
                    "ragged-batch",
                    "info",
                    f"training DataLoader with drop_last={ast.unparse(drop_last) if drop_last else '<in **kwargs>'}, "
                    f"which the check cannot read: if it is false, {ragged}",
                    ragged_fix,
                )
            elif feeds_training:
                self.add(
                    call,
                    "ragged-batch",
                    "warning" if xla else "info",
                    f"this DataLoader feeds a training loop without drop_last=True: {ragged}",
                    ragged_fix,
                )
            elif not feeds_other and role == "train":
                self.add(
                    call,
                    "ragged-batch",
                    "info",
                    "this looks like a training DataLoader (its names or shuffle=True; the check did "
                    f"not find the loop it feeds) without drop_last=True: if it feeds training, {ragged}",
                    ragged_fix,
                )
        if sizes and all(isinstance(s, int) and not isinstance(s, bool) and 0 < s < 8 for s in sizes):
            size = " or ".join(map(str, sorted(sizes)))
            message = (
                f"batch_size={size} per device: a TPU core's matrix unit is 128 wide (256 on v6e), so "
                "each step pays its fixed cost for a handful of samples; ParallelLoader does not "
                "batch further"
            )
            fix = (
                "use the largest per-device batch that fits (a multiple of 8, ideally of 128) and "
                "scale the learning rate with it"
            )
            if feeds_training:
                self.add(call, "small-batch", "warning" if xla else "info", message, fix)
            elif not feeds_other and role != "eval":
                self.add(call, "small-batch", "info", f"{message} (if this loader feeds training)", fix)

    def sampler_of(self, node: ast.AST | None) -> ast.Call | None:
        """The DistributedSampler(...) call that ``node`` (a sampler= argument) holds, when certain."""
        if isinstance(node, ast.Name):
            b = self.resolve(node).single
            node = b.value if b is not None and b.kind == "assign" and not b.path else None
        if isinstance(node, ast.Call) and self.call_name(node).endswith("DistributedSampler"):
            return node
        return None

    def check_samplers(self, calls: list[ast.Call]) -> None:
        samplers = [c for c in calls if self.call_name(c).endswith("DistributedSampler")]
        sets_epoch = any(isinstance(c.func, ast.Attribute) and c.func.attr == "set_epoch" for c in calls)
        train, other = self.fed_loaders()
        feeds = {}
        for loader in calls:
            sampler = self.sampler_of(_kw(loader, "sampler"))
            if sampler is not None and self.call_name(loader) in _DATALOADERS:
                feeds[sampler] = "train" if loader in train else "eval" if loader in other else feeds.get(sampler)
        for call in samplers:
            shuffles = self.static_values(_kw(call, "shuffle")) if _kw(call, "shuffle") is not None else {True}
            role = feeds.get(call) or self.loader_role(call)
            world = [_kw(call, "num_replicas"), _kw(call, "rank")]
            if any(isinstance(w, ast.Call) and self.call_name(w) in _WORLD_CALLS for w in world):
                self.add_port(call, "DistributedSampler(num_replicas=..., rank=...) from torch_xla", _PORT_SAMPLER)
            if shuffles == {True} and not sets_epoch and role != "eval":
                self.add(
                    call,
                    "sampler-set-epoch",
                    "info",
                    "DistributedSampler shuffles, but sampler.set_epoch() is never called: every epoch "
                    "draws the same order",
                    "call sampler.set_epoch(epoch) at the start of each epoch; xlatrain's sampler "
                    "reshuffles per epoch from the seed itself",
                )
            if (role == "eval" or shuffles == {False}) and self.static_values(_kw(call, "drop_last")) != {True}:
                self.add(
                    call,
                    "eval-sampler-padding",
                    "info",
                    "a DistributedSampler without drop_last pads each replica's share by repeating "
                    "samples when the dataset does not divide evenly: in evaluation those samples "
                    "count twice in the metrics",
                    "let xlatrain evaluate: it pads the last batch and masks the padding out, so "
                    "every sample counts exactly once",
                )

    # ------------------------------------------------------------------ environment

    def env_finding(self, node: ast.AST, name: str, value: ast.AST | None) -> None:
        literal = _const(value)
        is_literal = isinstance(value, ast.Constant)
        off = isinstance(literal, str) and literal.strip().lower() in ("", "0", "false", "no", "off")
        if name in _BF16_ENV and not off:
            self.add_port(node, f"{name}=1", _PORT_BF16)
        trap = env_trap(name)
        if trap is None:
            return
        if trap.flag and off:
            return
        if trap.flag and not is_literal:
            self.add(
                node,
                "env-var",
                "info",
                f"sets {name} from a value the check cannot read ({ast.unparse(value) if value is not None else '?'}): "
                f"if it is on, {trap.today}",
                trap.fix,
            )
            return
        self.add(node, "env-var", trap.severity, f"sets {name}: {trap.today}", trap.fix)

    def check_env_assignments(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (
                        isinstance(target, ast.Subscript)
                        and self.qualify(target.value) == "os.environ"
                        and isinstance(_const(target.slice), str)
                    ):
                        name = _const(target.slice)
                        if isinstance(node.value, ast.Constant) and not isinstance(node.value.value, str):
                            self.add(
                                node,
                                "env-var",
                                "error",
                                f"os.environ[{name!r}] = {ast.unparse(node.value)}: os.environ takes str "
                                f"values only (TypeError: str expected, not {type(node.value.value).__name__})",
                                f"os.environ[{name!r}] = {str(node.value.value)!r}, or better leave {name} "
                                "unset and configure xlatrain instead",
                            )
                        else:
                            self.env_finding(node, name, node.value)

    def check_env_call(self, call: ast.Call, name: str) -> None:
        if name in ("os.environ.setdefault", "os.putenv") and call.args and isinstance(_const(call.args[0]), str):
            self.env_finding(call, _const(call.args[0]), call.args[1] if len(call.args) > 1 else None)
        elif name == "os.environ.update":
            for arg in call.args:
                if isinstance(arg, ast.Dict):
                    for k, v in zip(arg.keys, arg.values):
                        if isinstance(_const(k), str):
                            self.env_finding(call, _const(k), v)
            for kw in call.keywords:
                if kw.arg:
                    self.env_finding(call, kw.arg, kw.value)
        elif isinstance(call.func, ast.Attribute) and call.func.attr == "run_line_magic":
            # a notebook exported to .py: get_ipython().run_line_magic('env', 'XLA_USE_BF16=1')
            if len(call.args) == 2 and _const(call.args[0]) == "env" and isinstance(_const(call.args[1]), str):
                var, _, val = _const(call.args[1]).partition("=")
                self.env_finding(call, var.strip(), ast.Constant(val.strip()))

    # ------------------------------------------------------------------ per-batch loops

    def iter_source(self, it: ast.AST) -> list[ast.AST]:
        """What a loop really iterates, under enumerate / tqdm / iter / zip."""
        while isinstance(it, ast.Call) and it.args:
            last = self.call_name(it).split(".")[-1]
            if last == "zip":
                return [x for a in it.args for x in self.iter_source(a)]
            if last not in ("enumerate", *_ITER_WRAPPERS):
                break
            it = it.args[0]
        return [it]

    def loop_certainty(self, loop: ast.AST) -> str | None:
        """'step' when the code shows the loop runs once per batch (it runs backward or an
        optimizer step, or iterates a loader the code builds), 'guess' when only names say so."""
        if self.runs_step(loop):
            return "step"
        if not isinstance(loop, (ast.For, ast.AsyncFor)):
            return None
        loaders = {_K_DATALOADER, _K_DEVICE_LOADER, _K_PARALLEL_LOADER}
        sources = self.iter_source(loop.iter)
        kinds: set[str] = set().union(*(self.kinds(s) for s in sources))
        if kinds and kinds <= loaders:
            return "step"
        if kinds & loaders:
            return "guess"
        named = [ast.unparse(s).split(".")[-1] for s in sources if isinstance(s, (ast.Name, ast.Attribute))]
        if any(_LOADER_NAME.search(n) for n in named):
            return "guess"
        return None

    def in_step_loop(self, node: ast.AST) -> bool:
        """True when ``node`` runs inside a loop of its scope that the code shows to be per-batch."""
        scope = self.scope_of(node)
        cur = self.parents.get(node)
        while cur is not None and cur is not scope:
            if isinstance(cur, (ast.For, ast.AsyncFor, ast.While)) and self.loop_certainty(cur) == "step":
                return True
            cur = self.parents.get(cur)
        return False

    def check_parallel_loader_iter(self, loop: ast.For | ast.AsyncFor) -> None:
        for it in self.iter_source(loop.iter):
            kinds = self.kinds(it)
            shown = ast.unparse(it)
            if kinds == {_K_PARALLEL_LOADER}:
                self.add(
                    loop.iter,
                    "parallel-loader-iter",
                    "error",
                    f"iterates the ParallelLoader {shown} itself: a ParallelLoader has no __iter__ "
                    "in torch_xla 2.9 (TypeError: 'ParallelLoader' object is not iterable)",
                    f"iterate {shown}.per_device_loader(device), or use pl.MpDeviceLoader(loader, "
                    "device); with xlatrain pass the DataLoader to Trainer.fit",
                )
            elif _K_PARALLEL_LOADER in kinds:
                self.add(
                    loop.iter,
                    "parallel-loader-iter",
                    "info",
                    f"one of the values that can reach {shown} here is a ParallelLoader, which has no "
                    "__iter__ in torch_xla 2.9; the code does not show which one this loop gets",
                    f"make sure {shown} is ParallelLoader(...).per_device_loader(device) or an MpDeviceLoader",
                )

    def every_n(self, node: ast.AST, loop: ast.AST) -> str | None:
        """The condition of an ``if step % N == 0`` that holds ``node`` inside ``loop``, if any."""
        cur: ast.AST = node
        parent = self.parents.get(cur)
        while parent is not None and parent is not loop:
            if isinstance(parent, (ast.If, ast.IfExp)) and cur is not parent.test:
                if any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(parent.test)):
                    return ast.unparse(parent.test)
            cur, parent = parent, self.parents.get(parent)
        return None

    def check_step_loops(self) -> None:
        for loop in (n for n in ast.walk(self.tree) if isinstance(n, (ast.For, ast.AsyncFor))):
            self.check_parallel_loader_iter(loop)
        owner: dict[ast.AST, tuple[ast.AST, str]] = {}
        loops = []
        for loop in (n for n in ast.walk(self.tree) if isinstance(n, (ast.For, ast.AsyncFor, ast.While))):
            certainty = self.loop_certainty(loop)
            if certainty is None:
                continue
            loops.append(loop)
            for node in _walk(loop.body):
                owner[node] = (loop, certainty)  # ast.walk is breadth first: inner loops win
        for node, (loop, certainty) in owner.items():
            self.check_in_step(node, loop, certainty)
        if self.uses_xla and not self.uses_lightning:
            self.check_step_boundary(loops)

    def printed(self, node: ast.AST, test: Any) -> bool:
        """True when formatting ``node`` for print formats a value for which ``test`` holds."""
        if test(node):
            return True
        if isinstance(node, ast.JoinedStr):
            return any(isinstance(v, ast.FormattedValue) and self.printed(v.value, test) for v in node.values)
        if isinstance(node, ast.Call):
            fn = node.func
            if (isinstance(fn, ast.Name) and fn.id in ("str", "repr", "format")) or (
                isinstance(fn, ast.Attribute) and fn.attr == "format"
            ):
                return any(self.printed(a, test) for a in [*node.args, *(k.value for k in node.keywords)])
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
            return self.printed(node.left, test) or self.printed(node.right, test)
        if isinstance(node, (ast.Tuple, ast.List)):
            return any(self.printed(e, test) for e in node.elts)
        return False

    def check_in_step(self, node: ast.AST, loop: ast.AST, certainty: str) -> None:
        sync_fix = (
            "keep per-step values on the device (sum the loss into a tensor) and read them once per "
            "epoch or every N steps through xm.add_step_closure; xlatrain's Trainer does this and "
            "reads the host only every log_every steps"
        )
        every = self.every_n(node, loop)

        def certain(subject: str) -> tuple[str, str]:
            if certainty == "step" and every is None:
                return "warning", f"{subject} inside a per-batch loop"
            if certainty == "step":
                # still mid-step: each read stops the host until the device has computed the value
                return "warning", f"{subject} every few steps (under `if {every}`)"
            return "info", f"{subject} inside a loop that looks per-batch (if it runs once per batch)"

        def unsure(subject: str, value: ast.AST) -> str:
            return (
                f"{subject} inside a per-batch loop, on {ast.unparse(value)}, which the code does not "
                "show to be on the XLA device: if it is there"
            )

        if isinstance(node, ast.Call):
            func = node.func
            name = self.call_name(node)
            what = (
                "the host waits for the device to finish the step and copies the value back (one "
                "device-to-host transfer each time)"
            )
            if isinstance(func, ast.Attribute) and func.attr in _SYNC_METHODS and not node.args:
                if self.is_device(func.value):
                    severity, where = certain(ast.unparse(node))
                    self.add(node, "host-sync", severity, f"{where}: {what}", sync_fix)
                elif certainty == "step" and every is None and (
                    _K_TENSOR in self.kinds(func.value) or (func.attr == "item" and self.maybe_device(func.value))
                ):
                    self.add(node, "host-sync", "info", f"{unsure(ast.unparse(node), func.value)}, {what}", sync_fix)
            elif name in ("float", "int", "bool") and node.args:
                if self.is_device(node.args[0]):
                    severity, where = certain(ast.unparse(node))
                    self.add(node, "host-sync", severity, f"{where} reads a device tensor on the host: a "
                             "sync and a device-to-host copy every time", sync_fix)
                elif certainty == "step" and every is None and _K_TENSOR in self.kinds(node.args[0]):
                    self.add(node, "host-sync", "info", f"{unsure(ast.unparse(node), node.args[0])}, {what}", sync_fix)
            elif name in _PRINTS or (isinstance(func, ast.Attribute) and func.attr in ("set_postfix", "write")):
                args = [*node.args, *(k.value for k in node.keywords)]
                what = "formatting it waits for the device and copies the value to the host"
                if any(self.printed(a, self.is_device) for a in args):
                    severity, where = certain(f"{ast.unparse(func)}() of a device tensor")
                    self.add(node, "print-tensor", severity, f"{where}: {what}", sync_fix)
                elif certainty == "step" and every is None and any(
                    self.printed(a, lambda n: _K_TENSOR in self.kinds(n)) for a in args
                ):
                    self.add(
                        node,
                        "print-tensor",
                        "info",
                        f"{ast.unparse(func)}() of a tensor inside a per-batch loop: if it is on the "
                        f"XLA device, {what}",
                        sync_fix,
                    )
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            test = node.test
            fix = (
                "decide on the device (torch.where / masks), or compare once per epoch on values "
                "read through xm.add_step_closure"
            )
            if self.is_device(test):
                severity, where = certain(f"Python branches on a device tensor ({ast.unparse(test)})")
                self.add(test, "tensor-condition", severity, f"{where}: the host must wait for its value", fix)

    def opaque_calls(self, loop: ast.AST) -> list[str]:
        """Calls in the loop into code the file does not show (imported from a module of the
        project, or a method of a class with a base from elsewhere): they may cut the graph."""
        out = []
        for node in _walk(getattr(loop, "body", [])):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name):
                res = self.resolve(func)
                top = {b.target.lstrip(".").split(".")[0] for b in res.bindings if b.kind == "import"}
                relative = any(b.target.startswith(".") for b in res.bindings if b.kind == "import")
                if (top and not top <= _LIBRARIES) or relative:
                    out.append(ast.unparse(func))
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                cls = self.enclosing_class(self.enclosing_function(node))
                if self.method(cls, func.attr) is None and not self.self_attr_values(func)[1]:
                    out.append(ast.unparse(func))
        return out

    def check_step_boundary(self, loops: list[ast.AST]) -> None:
        calls = [c for c in ast.walk(self.tree) if isinstance(c, ast.Call)]
        names = {self.call_name(c) for c in calls}
        per_device = any(isinstance(c.func, ast.Attribute) and c.func.attr == "per_device_loader" for c in calls)
        barrier = any(
            self.call_name(c) == f"{XM}.optimizer_step" and _const(_kw(c, "barrier")) is True for c in calls
        )
        if names & _STEP_BOUNDARIES or per_device or barrier:
            return
        for loop in loops:
            if not self.runs_step(loop):
                continue
            unseen = self.opaque_calls(loop)
            sources = self.iter_source(loop.iter) if isinstance(loop, (ast.For, ast.AsyncFor)) else []
            fed: set[str] = set().union(*(self.kinds(s) for s in sources)) if sources else {_K_HOST}
            if self.xla_moves and fed and fed <= {_K_DATALOADER, _K_HOST} and not unseen:
                self.add(
                    loop,
                    "no-step-boundary",
                    "warning",
                    "this training loop on XLA never cuts the lazy graph (no torch_xla.sync(), "
                    "MpDeviceLoader or optimizer_step(barrier=True)): the traced graph grows step after "
                    "step until something reads a value",
                    "call torch_xla.sync() after optimizer.step() (or iterate an MpDeviceLoader); "
                    "xlatrain's Trainer compiles one step and cuts the graph there",
                )
            else:
                unknown = ", ".join(unseen) or (", ".join(ast.unparse(s) for s in sources) + " (what it iterates)")
                self.add(
                    loop,
                    "no-step-boundary",
                    "info",
                    "this training loop shows no graph cut in this file (no torch_xla.sync(), "
                    f"MpDeviceLoader or optimizer_step(barrier=True)); the check cannot see inside "
                    f"{unknown}: if nothing there cuts it either, the traced graph grows step after step",
                    "call torch_xla.sync() after optimizer.step() (or iterate an MpDeviceLoader); "
                    "xlatrain's Trainer compiles one step and cuts the graph there",
                )
            return

    # ------------------------------------------------------------------ ordering problems

    def is_optimizer(self, call: ast.Call) -> bool:
        name = self.call_name(call)
        last = name.split(".")[-1]
        return (name.startswith("torch.optim.") and "lr_scheduler" not in name) or (
            last in _OPTIMIZER_CLASSES and bool(name)
        )

    def check_optimizer_before_move(self, calls: list[ast.Call]) -> None:
        if not self.uses_xla:
            return  # CPU -> CUDA .to() keeps the Parameter objects; only XLA replaces them
        moves = [
            c for c in calls
            if isinstance(c.func, ast.Attribute) and c.func.attr in ("to", "cuda", "cpu") and isinstance(c.func.value, ast.Name)
        ]
        for opt in calls:
            params = _arg(opt, 0, "params")
            if not (
                self.is_optimizer(opt)
                and isinstance(params, ast.Call)
                and isinstance(params.func, ast.Attribute)
                and params.func.attr == "parameters"
                and isinstance(params.func.value, ast.Name)
            ):
                continue
            model = params.func.value
            b = self.resolve(model).single
            built = self.kinds(b.value) if b is not None and b.kind == "assign" and not b.path else frozenset()
            if not built or not built <= {_K_MODULE}:
                continue  # not a module the code builds on the CPU right there
            same = [m for m in moves if b in self.resolve(m.func.value).bindings]
            if any(len(self.resolve(m.func.value).bindings) > 1 for m in same):
                continue
            for move in same:
                target = self.move_target(move) if move.func.attr == "to" else _K_OTHER_DEVICE  # type: ignore[union-attr]
                if target in (None, _K_OTHER_DEVICE):
                    continue
                after = self.runs_before(opt, move) or self._steps_after_move(opt, move)
                earlier = [m for m in same if m is not move and not self.runs_before(opt, m)]
                if not after or earlier:
                    continue
                certain = target == _K_XLA_DEVICE
                where = "the XLA device" if certain else ast.unparse(move.args[0]) if move.args else "the device"
                unsure = "" if certain else ", which the check cannot place"
                then = "" if certain else f"if {where} is an XLA device, "
                self.add(
                    opt,
                    "optimizer-before-move",
                    "error" if certain else "info",
                    f"the optimizer takes {model.id}.parameters() before {model.id} moves to {where} "
                    f"(line {move.lineno}){unsure}: on XLA .to(device) replaces every Parameter (measured "
                    f"with torch_xla 2.9), so {then}this optimizer keeps updating the CPU copies and the "
                    "model on the device never learns",
                    f"build the optimizer after {model.id}.to(device); xlatrain's Trainer takes an "
                    "optimizer_fn and builds the optimizer once the model is on the device",
                )
                break

    def _steps_after_move(self, opt: ast.Call, move: ast.Call) -> bool:
        """An optimizer built at import time and stepped in a function after that function moves
        the model: the steps certainly update the CPU copies."""
        if not isinstance(self.scope_of(opt), ast.Module):
            return False
        holder = self.parents.get(opt)
        if not (isinstance(holder, ast.Assign) and len(holder.targets) == 1 and isinstance(holder.targets[0], ast.Name)):
            return False
        opt_name = holder.targets[0].id
        fn = self.enclosing_function(move)
        if fn is None:
            return False
        for node in _walk(fn.body):
            if not isinstance(node, ast.Call):
                continue
            used = None
            if isinstance(node.func, ast.Attribute) and node.func.attr == "step" and isinstance(node.func.value, ast.Name):
                used = node.func.value
            elif self.call_name(node) == f"{XM}.optimizer_step" and node.args and isinstance(node.args[0], ast.Name):
                used = node.args[0]
            if used is not None and used.id == opt_name:
                b = self.resolve(used).single
                if b is not None and b.stmt is holder and self.runs_before(move, node):
                    return True
        return False

    def check_device_before_spawn(self, calls: list[ast.Call]) -> None:
        spawns: list[tuple[ast.Call, bool]] = []
        for call in calls:
            name = self.call_name(call)
            if name == f"{XMP}.spawn":
                values = self.static_values(_arg(call, 2, "nprocs"))
                if values != {1}:
                    spawns.append((call, values is not None and 1 not in values))
            elif name == "torch_xla.launch":
                if self.static_values(_arg(call, 3, "debug_single_process")) != {True}:
                    spawns.append((call, False))  # under torchrun launch calls the function directly
        if not spawns:
            return
        for call in calls:
            if self.call_name(call) not in _RUNTIME_CALLS:
                continue
            for spawn, certain in spawns:
                if any(self.runs_before(call, anchor) for anchor in self.anchors(spawn)):
                    self.add(
                        call,
                        "xla-before-spawn",
                        "error" if certain else "info",
                        f"{ast.unparse(call.func)}() runs in the parent process before the spawn (line "
                        f"{spawn.lineno}): it starts the XLA runtime there, and torch_xla 2.9 then "
                        "refuses to spawn ('Runtime is already initialized. Do not use the XLA device "
                        "before calling xmp.spawn.')"
                        + ("" if certain else "; unless this spawn runs a single process (nprocs=1, or "
                           "torch_xla.launch under torchrun)"),
                        "touch the device only inside the spawned function (device = torch_xla.device() "
                        "there); xlatrain's SPMD mode needs no spawn at all",
                    )
                    break

    def constructed_class(self, expr: ast.AST | None, depth: int = 0) -> str | None:
        """The class defined in the file whose instance ``expr`` is, when the code shows it."""
        if expr is None or depth > 6:
            return None
        if isinstance(expr, ast.Call):
            if isinstance(expr.func, ast.Name):
                b = self.resolve(expr.func).single
                if b is not None and b.kind == "def" and isinstance(b.value, ast.ClassDef):
                    return b.value.name
            if isinstance(expr.func, ast.Attribute) and expr.func.attr in ("to", *_SAME_KIND_METHODS):
                return self.constructed_class(expr.func.value, depth + 1)
        if isinstance(expr, ast.Name):
            b = self.resolve(expr).single
            if b is not None and b.kind == "assign" and not b.path:
                return self.constructed_class(b.value, depth + 1)
        return None

    def check_classes(self) -> None:
        moved_classes = {self.constructed_class(m.func.value) for m in self.xla_moves}  # type: ignore[union-attr]
        for cls in (n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)):
            bases = [self.qualify(b) or "" for b in cls.bases]
            lightning = any(b.split(".")[0] in ("pytorch_lightning", "lightning") or b.endswith("LightningModule") for b in bases)
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "on_post_move_to_device" and lightning:
                    self.add(
                        fn,
                        "removed-api",
                        "info",
                        "LightningModule.on_post_move_to_device was removed in Lightning 1.7: nothing "
                        "calls it any more (Lightning >= 1.5 re-ties shared parameters on TPU itself)",
                        "delete the hook; in a plain torch_xla loop tie the weights after model.to(device)",
                    )
            if lightning or not (self.uses_xla and cls.name in self.module_classes):
                continue
            init = self.method(cls, "__init__")
            for node in _walk(init.body if init else []):
                if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                    continue
                target, value = node.targets[0], node.value
                if not (
                    isinstance(target, ast.Attribute)
                    and isinstance(value, ast.Attribute)
                    and target.attr in ("weight", "bias")
                    and value.attr in ("weight", "bias")
                ):
                    continue
                tail = ast.unparse(target).split(".")[-2:]
                retied = any(
                    isinstance(n, ast.Assign)
                    and n is not node
                    and any(isinstance(t, ast.Attribute) and ast.unparse(t).split(".")[-2:] == tail for t in n.targets)
                    for n in ast.walk(self.tree)
                )
                if retied:
                    continue
                moved = cls.name in moved_classes
                self.add(
                    node,
                    "weight-tying",
                    "error" if moved else "info",
                    f"{ast.unparse(target)} = {ast.unparse(value)} ties weights before the model moves"
                    + ("" if moved else " (if it moves to an XLA device)")
                    + ": on XLA .to(device) copies each module's parameter separately (measured with "
                    "torch_xla 2.9: one tied weight became two parameters), so the tie is lost",
                    "tie the weights again after model.to(device) (a tie_weights() method called "
                    "after the move)",
                )

    def check_lr_scaling(self) -> None:
        for node in ast.walk(self.tree):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
                continue
            if not (self.is_world_size(node.left) or self.is_world_size(node.right)):
                continue
            parent = self.parents.get(node)
            context = ""
            if isinstance(parent, ast.keyword):
                context = parent.arg or ""
            elif isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                context = " ".join(self.assigned_names(node)) or ast.unparse(getattr(parent, "target", parent))
            elif isinstance(parent, ast.Dict):
                context = " ".join(ast.unparse(k) for k, v in zip(parent.keys, parent.values) if v is node and k)
            if _LR_NAME.search(context):
                counted = any(isinstance(s, ast.Call) and self.is_world_size(s) for s in (node.left, node.right))
                factor = "the device count" if counted else "what its name says is the device count"
                self.add(
                    node,
                    "manual-lr-scaling",
                    "info",
                    f"the learning rate is multiplied by {factor} by hand ({ast.unparse(node)})",
                    "TrainConfig(scale_lr=True) scales every learning rate by the number of devices "
                    "once, and the run log states the global batch and learning rate",
                )

    def is_world_size(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Call):
            return self.call_name(node).split(".")[-1] in _WORLD_SIZE_CALLS
        if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
            return bool(_WORLD_SIZE_NAME.search(ast.unparse(node)))
        return False


_TENSOR_ARG_METHODS = {"forward", "training_step", "validation_step", "test_step", "predict_step"}
_LOADER_NAME = re.compile(r"(?i)loader|^dl$|_dl$|batches")
_EVAL_HINT = re.compile(r"(?i)val|test|eval|holdout")
_LR_NAME = re.compile(r"(?i)(?:^|[^a-z])lr|learning_rate")
_WORLD_SIZE_NAME = re.compile(r"(?i)world_size|num_replicas|num_cores|n_?devices|nprocs|num_devices")
_LIBRARIES = {
    "torch", "torchvision", "torch_xla", "numpy", "math", "time", "os", "sys", "tqdm", "PIL", "pandas",
    "sklearn", "timm", "random", "collections", "itertools", "functools", "logging", "json", "gc",
    "datetime", "warnings", "copy", "pathlib", "matplotlib", "seaborn", "transformers", "typing",
}
