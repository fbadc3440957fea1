"""What the script check's engine and rules share: the finding, the torch_xla API tables, the
porting notes, AST helpers and the name patterns rules read."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

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
    cell: int | None = None  # in a notebook: the code cell (1-based; ``line`` counts within it)


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
    "process owns one TPU device, so there is no index to pick",
    "Trainer(..., backend='auto') picks the device and moves the model; nothing to write",
)
_PORT_SYNC = _Port(
    "port:sync",
    "tensors on the 'tpu' device run eagerly, so there is no lazy graph to cut: delete the call; "
    "compile the step with torch.compile(...) (TorchTPU makes backend='tpu', dynamic=False the "
    "default for TPU inputs); torch.accelerator.synchronize() waits for the device, for timing only",
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
    "and start the workers with torchrun or torch.multiprocessing.spawn (in a shell, "
    "`( set -a; eval \"$(python -m torch.tpu.distributed)\"; set +a; torchrun ... )` exports the same "
    "variables to torchrun, in a subshell that leaves none of them set); each worker calls "
    "torch.distributed.init_process_group('tpu_dist')",
    "no worker function: Trainer(...).fit(...) drives every local device (SPMD on torch_xla); "
    "xlatrain.spawn(fn) when you want one process per chip",
)
_PORT_PRINT = _Port(
    "port:print",
    "print(...) where torch.distributed.get_rank() == 0, of values every process read (v = t.item() on "
    "every process: a read on one process only stops the TPU mesh)",
    "progress lines come from the main process every TrainConfig(log_every=N) steps",
)
_PORT_SAVE = _Port(
    "port:save",
    "torch.save (or safetensors) where torch.distributed.get_rank() == 0 of a CPU copy of the state "
    "that every process made (a read on one process only stops the TPU mesh)",
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
    "torch.accelerator.synchronize()",
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
_META_ATTRS = {"shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "layout", "names", "grad_fn",
               "is_cuda", "is_xla", "is_cpu", "is_meta", "is_sparse", "is_quantized", "itemsize", "nbytes"}
_META_METHODS = {"size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "is_contiguous",
                 "get_device", "__len__", "is_floating_point", "is_complex", "is_signed", "storage_offset"}
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




def is_port_note(finding: ScriptFinding) -> bool:
    """True for a porting note (what a torch_xla call becomes on TorchTPU and under xlatrain)."""
    return finding.code.startswith(PORT_PREFIX)


def exit_code(findings: Iterable[ScriptFinding]) -> int:
    """1 when anything is an error or a warning, else 0 (infos and porting notes alone pass)."""
    return 1 if any(f.severity in ("error", "warning") for f in findings) else 0


def render_text(path: str, findings: Sequence[ScriptFinding] | str) -> str:
    """Compiler-style lines (``path:line:col: severity [code] message``, the fix under each; ``path:
    cell N, line L:`` in a notebook), then the porting notes grouped by what they port, one entry per
    kind of call with its lines. ``findings`` as a string is why the script could not be checked."""
    if isinstance(findings, str):
        return findings
    problems = [f for f in findings if not is_port_note(f)]
    ports = [f for f in findings if is_port_note(f)]
    lines = []
    if not problems:
        lines.append(f"{path}: no known torch_xla pitfalls found")
    for f in problems:
        where = f"{path}:{f.line}:{f.col + 1}" if f.cell is None else f"{path}: cell {f.cell}, line {f.line}"
        lines.append(f"{where}: {f.severity} [{f.code}] {f.message}")
        lines.append(f"    fix: {f.fix}")
    if ports:
        # one entry per kind of port, naming each torch_xla call and its lines once
        groups: dict[tuple[str, str, str], dict[str, list[tuple[int | None, int]]]] = {}
        for f in ports:
            what, _, text = f.message.partition(_PORT_SEP)
            at = groups.setdefault((f.code, text, f.fix), {}).setdefault(what, [])
            if (f.cell, f.line) not in at:
                at.append((f.cell, f.line))
        lines.append(f"{path}: porting to TorchTPU ({len(ports)} torch_xla call(s), {len(groups)} kind(s)):")
        for (code, text, fix), calls in groups.items():
            where = ", ".join(f"{what} ({_places(at)})" for what, at in calls.items())
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


def _places(at: Sequence[tuple[int | None, int]]) -> str:
    if all(cell is None for cell, _ in at):
        return f"line{'s' if len(at) > 1 else ''} {_lines([line for _, line in at])}"
    return _lines([f"cell {cell}, line {line}" for cell, line in at], "; ")


def _lines(at: Sequence[object], sep: str = ", ") -> str:
    shown = sep.join(map(str, at[:8]))
    return shown + (f" and {len(at) - 8} more" if len(at) > 8 else "")


def render_json(results: Mapping[str, Sequence[ScriptFinding] | str]) -> str:
    """``{"scripts": [{"path", "exit_code", "findings": [...]}], "exit_code"}`` as JSON; porting
    notes are findings with a ``port:`` code and severity ``info``; ``cell`` is the notebook cell
    (null in a script). A script that could not be checked (its value a string: why) has exit code
    2, no findings and ``"error"``: the message."""
    scripts = [
        {"path": path, "exit_code": 2, "error": fs, "findings": []} if isinstance(fs, str)
        else {"path": path, "exit_code": exit_code(fs), "findings": [asdict(f) for f in fs]}
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
