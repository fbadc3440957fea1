"""``xlatrain doctor SCRIPT.py``: read a training script (never run it) and list, line by line,
what will break or slow it down on torch_xla 2.9, with the fix.

The script is parsed with :mod:`ast`; import aliases are resolved (``import
torch_xla.core.xla_model as xm``, ``from torch_xla.core import xla_model``), so ``xm.get_ordinal``
and ``xla_model.get_ordinal`` are the same call. Host syncs are found with a small flow-insensitive
guess of which names hold device tensors: batches drawn from a loader, what a model, a loss or a
``torch.*`` function returns, and anything computed from those.

Which calls are removed and which only deprecated was read from torch_xla 2.9.0 itself
(``core/xla_model.py``: ``xrt_world_size`` and ``get_ordinal`` are gone, ``xla_device`` and
``mark_step`` carry ``@deprecated``; ``_internal/pjrt.py``: ``spawn`` raises for ``nprocs`` other
than 1 or None, and refuses to start once the parent process has used the device).

Example:
    >>> from xlatrain.diagnostics.script_check import check_source
    >>> src = "import torch_xla.core.xla_model as xm\\nn = xm.xrt_world_size()\\n"
    >>> [(f.line, f.code) for f in check_source(src)]
    [(2, 'removed-api')]
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xlatrain.diagnostics.doctor import env_trap

XM = "torch_xla.core.xla_model"
XMP = "torch_xla.distributed.xla_multiprocessing"
PL = "torch_xla.distributed.parallel_loader"
XR = "torch_xla.runtime"

SEVERITIES = ("error", "warning", "info")


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
        "torch_xla.runtime.world_size() (under xlatrain: backend.world_size)",
    ),
    f"{XM}.get_ordinal": _Api(
        "removed-api",
        "error",
        "xm.get_ordinal() was removed in torch_xla 2.x: AttributeError in 2.9",
        "torch_xla.runtime.global_ordinal() (under xlatrain: backend.rank)",
    ),
    f"{XR}.using_pjrt": _Api(
        "removed-api",
        "error",
        "torch_xla.runtime.using_pjrt() is gone in 2.9: PJRT is the only runtime",
        "drop the check",
    ),
    f"{XM}.xla_device": _Api(
        "deprecated-api",
        "warning",
        "xm.xla_device() is @deprecated in torch_xla 2.9 ('Use torch_xla.device instead'); its "
        "devkind argument is ignored",
        "torch_xla.device() (under xlatrain: backend.device)",
    ),
    f"{XM}.mark_step": _Api(
        "deprecated-api",
        "warning",
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
        "torch_xla.runtime.global_ordinal() == 0 to act once per job (under xlatrain: backend.is_main)",
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

# Calls that create the XLA device and so start the runtime in the calling process
# (measured: torch_xla 2.9 reports _xla_runtime_is_initialized() after xm.xla_device()).
_DEVICE_CALLS = {f"{XM}.xla_device", "torch_xla.device", "torch_xla.devices", f"{XM}.get_xla_supported_devices"}
_SPAWN_CALLS = {f"{XMP}.spawn", "torch_xla.launch"}
# Anything that cuts the lazy graph once per step.
_STEP_BOUNDARIES = {
    f"{XM}.mark_step",
    "torch_xla.sync",
    "torch_xla.step",
    "torch_xla.compile",
    f"{PL}.ParallelLoader",
    f"{PL}.MpDeviceLoader",
}

# Methods that copy a device tensor to the host: each one waits for the device to finish.
_SYNC_METHODS = {"item", "tolist", "numpy", "cpu"}
# Attributes and methods of a tensor that are plain Python values, read without a sync.
_META_ATTRS = {"shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "layout", "names"}
_META_METHODS = {"size", "dim", "numel", "element_size", "stride", "parameters", "named_parameters",
                 "state_dict", "keys", "items", "values", "is_contiguous", "get_device", "__len__"}
_PRINTS = {"print", f"{XM}.master_print", "logging.info", "logging.debug", "logging.warning", "tqdm.tqdm.write"}
_TORCH_NOT_TENSOR = ("torch.nn.", "torch.optim", "torch.utils", "torch.cuda", "torch.backends",
                     "torch.distributed", "torch.jit", "torch.amp", "torch.autograd.", "torch.set_",
                     "torch.get_", "torch.manual_seed", "torch.no_grad", "torch.enable_grad",
                     "torch.inference_mode", "torch.autocast", "torch.device", "torch.save",
                     "torch.load", "torch.is_", "torch.compile", "torch.finfo", "torch.iinfo",
                     "torch.use_deterministic")
_TORCH_TENSOR_PREFIX = ("torch.nn.functional.",)
_TENSOR_ARG_METHODS = {"forward", "training_step", "validation_step", "test_step", "predict_step"}
_LOADER_NAME = re.compile(r"(?i)loader|^dl$|_dl$|batches")
_MODEL_CALL_NAME = re.compile(r"(?i)model|net|criterion|loss")
_NOT_MODEL_CALL = re.compile(r"^(build|create|make|get|load|init|setup)_")
_EVAL_HINT = re.compile(r"(?i)val|test|eval|holdout")
_DYNAMIC_SHAPE = {"nonzero", "unique", "masked_select", "argwhere", "unique_consecutive"}
_WORLD_SIZE_CALLS = ("xrt_world_size", "world_size", "get_world_size", "global_runtime_device_count")
_LR_NAME = re.compile(r"(?i)(?:^|[^a-z])lr|learning_rate")
_WORLD_SIZE_NAME = re.compile(r"(?i)world_size|num_replicas|num_cores|n_?devices|nprocs|num_devices")


def check_source(source: str, path: str = "<script>") -> tuple[ScriptFinding, ...]:
    """Findings for a script's source text, sorted by line.

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


def exit_code(findings: Iterable[ScriptFinding]) -> int:
    """1 when anything is an error or a warning, else 0 (infos alone pass)."""
    return 1 if any(f.severity in ("error", "warning") for f in findings) else 0


def render_text(path: str, findings: Sequence[ScriptFinding]) -> str:
    """Compiler-style lines: ``path:line:col: severity [code] message`` and the fix under it."""
    if not findings:
        return f"{path}: no known torch_xla pitfalls found"
    lines = []
    for f in findings:
        lines.append(f"{path}:{f.line}:{f.col + 1}: {f.severity} [{f.code}] {f.message}")
        lines.append(f"    fix: {f.fix}")
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    lines.append(f"{path}: {counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} note(s)")
    return "\n".join(lines)


def render_json(results: Mapping[str, Sequence[ScriptFinding]]) -> str:
    """``{"scripts": [{"path", "exit_code", "findings": [...]}], "exit_code"}`` as JSON."""
    scripts = [
        {"path": path, "exit_code": exit_code(fs), "findings": [asdict(f) for f in fs]}
        for path, fs in results.items()
    ]
    worst = max((s["exit_code"] for s in scripts), default=0)
    return json.dumps({"exit_code": worst, "scripts": scripts}, indent=2)


# --------------------------------------------------------------------------- the checker


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
    if value is None and len(call.args) > index and not isinstance(call.args[index], ast.Starred):
        value = call.args[index]
    return value


class _Checker:
    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.aliases: dict[str, str] = {}
        self.star_modules: list[str] = []
        self.constants: dict[str, Any] = {}
        self.findings: dict[tuple[int, str, str], ScriptFinding] = {}
        self.loader_names: set[str] = set()
        self.parallel_loader_names: set[str] = set()
        self.module_classes: set[str] = set()
        self._tensor_cache: dict[ast.AST, set[str]] = {}

    # ------------------------------------------------------------------ plumbing

    def add(self, node: ast.AST, code: str, severity: str, message: str, fix: str) -> None:
        line, col = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
        key = (line, code, message)
        if key not in self.findings:
            self.findings[key] = ScriptFinding(line, col, code, severity, message, fix)

    def qualify(self, node: ast.AST) -> str | None:
        """Dotted name of ``node`` with import aliases resolved (``xm.get_ordinal`` ->
        ``torch_xla.core.xla_model.get_ordinal``), or None for anything but a name chain."""
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                return self.aliases[node.id]
            for module in self.star_modules:
                if f"{module}.{node.id}" in _APIS or f"{module}.{node.id}" in _SPAWN_CALLS | _DEVICE_CALLS:
                    return f"{module}.{node.id}"
            return node.id
        if isinstance(node, ast.Attribute):
            base = self.qualify(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def call_name(self, call: ast.Call) -> str:
        return self.qualify(call.func) or ""

    def scope_of(self, node: ast.AST) -> ast.AST:
        cur = self.parents.get(node)
        while cur is not None and not isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Module)):
            cur = self.parents.get(cur)
        return cur if cur is not None else self.tree

    def enclosing_function_name(self, node: ast.AST) -> str:
        scope = self.scope_of(node)
        return scope.name if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) else ""

    def assigned_names(self, node: ast.AST) -> list[str]:
        """Names a value is assigned to (``x = <node>``, ``self.x = <node>``)."""
        parent = self.parents.get(node)
        if isinstance(parent, (ast.Assign, ast.AnnAssign)):
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            return [ast.unparse(t) for t in targets]
        return []

    @property
    def uses_xla(self) -> bool:
        return any(v == "torch_xla" or v.startswith("torch_xla.") for v in self.aliases.values())

    @property
    def uses_lightning(self) -> bool:
        return any(v.split(".")[0] in ("pytorch_lightning", "lightning") for v in self.aliases.values())

    # ------------------------------------------------------------------ run

    def run(self) -> tuple[ScriptFinding, ...]:
        self.read_imports()
        self.read_constants()
        self.read_bindings()
        calls = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)]
        for call in calls:
            self.check_call(call)
        self.check_env_assignments()
        self.check_step_loops()
        self.check_optimizer_before_move(calls)
        self.check_device_before_spawn(calls)
        self.check_classes()
        self.check_lr_scaling()
        self.check_samplers(calls)
        order = {s: i for i, s in enumerate(SEVERITIES)}
        return tuple(sorted(self.findings.values(), key=lambda f: (f.line, f.col, order[f.severity], f.code)))

    def read_imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.check_module(node, alias.name)
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:  # `import a.b.c` binds `a`; attribute access then spells the full path
                        top = alias.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if alias.name == "*":
                        self.star_modules.append(node.module)
                        continue
                    self.check_module(node, full)
                    self.aliases[alias.asname or alias.name] = full
                    api = _APIS.get(full)
                    if api is not None and api.severity == "error":
                        self.add(node, api.code, api.severity, f"import of {full}: {api.message}", api.fix)

    def check_module(self, node: ast.AST, module: str) -> None:
        for removed, api in _REMOVED_MODULES.items():
            if module == removed or module.startswith(removed + "."):
                self.add(node, api.code, api.severity, api.message, api.fix)

    def read_constants(self) -> None:
        """Module-level literals (``NUM_CORES = 8``, ``FLAGS['num_cores'] = 8``, ``FLAGS = {...}``),
        so ``nprocs=FLAGS['num_cores']`` can be read without running anything."""
        for stmt in self.tree.body:
            if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
                continue
            target, value = stmt.targets[0], stmt.value
            if isinstance(target, ast.Name) and isinstance(value, ast.Dict):
                for k, v in zip(value.keys, value.values):
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant):
                        self.constants[f"{target.id}[{k.value!r}]"] = v.value
            elif isinstance(value, ast.Constant) and isinstance(target, (ast.Name, ast.Subscript)):
                self.constants[ast.unparse(target)] = value.value

    def static_value(self, node: ast.AST | None) -> tuple[bool, Any]:
        """(known, value) of an expression that is a literal or a module-level constant."""
        if node is None:
            return True, None
        if isinstance(node, ast.Constant):
            return True, node.value
        key = ast.unparse(node)
        if key in self.constants:
            return True, self.constants[key]
        return False, None

    def read_bindings(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):
                bases = [self.qualify(b) or "" for b in node.bases]
                if any(b.endswith(("Module", "Net", "LightningModule")) for b in bases):
                    self.module_classes.add(node.name)
            if isinstance(node, ast.Call) and self.is_loader_call(node):
                self.loader_names.update(self.assigned_names(node))
                if self.call_name(node) == f"{PL}.ParallelLoader":
                    self.parallel_loader_names.update(self.assigned_names(node))

    def is_loader_call(self, call: ast.Call) -> bool:
        name = self.call_name(call)
        if isinstance(call.func, ast.Attribute) and call.func.attr == "per_device_loader":
            return True
        return name.split(".")[-1] in ("DataLoader", "ParallelLoader", "MpDeviceLoader")

    # ------------------------------------------------------------------ calls

    def check_call(self, call: ast.Call) -> None:
        name = self.call_name(call)
        api = _APIS.get(name)
        if api is not None:
            self.add(call, api.code, api.severity, api.message, api.fix)
        if name == f"{XM}.get_xla_supported_devices":
            first = call.args[0] if call.args else None
            if _kw(call, "devkind") is not None or isinstance(_const(first), str):
                self.add(
                    call,
                    "removed-api",
                    "error",
                    "get_xla_supported_devices() lost its devkind argument: torch_xla 2.9's signature is "
                    "(max_devices=None), so a device kind fails with TypeError",
                    "torch_xla.devices() for the device list, torch_xla.runtime.global_runtime_device_count() for the count",
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
        if name.split(".")[-1] == "DataLoader":
            self.check_dataloader(call)
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
        if self.uses_xla and self.is_dynamic_shape(call, name):
            self.add(
                call,
                "dynamic-shape",
                "warning",
                f"{ast.unparse(call.func)}() returns a tensor whose shape depends on the data: XLA "
                "falls back to the CPU for it or compiles a new graph for each new shape",
                "keep shapes static: mask instead of selecting (torch.where(cond, x, 0), x * mask, "
                "sum over the mask) and count with mask.sum()",
            )
        self.check_env_call(call, name)

    def is_dynamic_shape(self, call: ast.Call, name: str) -> bool:
        if name == "torch.where" and len(call.args) == 1 and not call.keywords:
            return True  # one-argument torch.where is nonzero()
        if name.startswith("torch.") and name.split(".")[-1] in _DYNAMIC_SHAPE:
            return True
        # x.unique() only when x is a tensor: pandas and numpy have .unique() / .nonzero() too
        func = call.func
        return (
            isinstance(func, ast.Attribute)
            and func.attr in _DYNAMIC_SHAPE
            and self.is_tensor(func.value, self.tensor_names(self.scope_of(call)))
        )

    def check_spawn(self, call: ast.Call) -> None:
        nprocs = _arg(call, 2, "nprocs")
        known, value = self.static_value(nprocs)
        if known and value in (None, 1):
            return
        if known:
            self.add(
                call,
                "spawn-nprocs",
                "error",
                f"xmp.spawn(nprocs={value!r}) raises ValueError in torch_xla 2.9: only 1 or None are "
                "accepted ('Unsupported nprocs')",
                "drop nprocs: torch_xla starts one process per local chip itself; or use "
                "xlatrain's default SPMD mode (one process drives every chip)",
            )
        else:
            self.add(
                call,
                "spawn-nprocs",
                "warning",
                f"xmp.spawn(nprocs={ast.unparse(nprocs)}) cannot be read without running the script; "
                "torch_xla 2.9 raises ValueError for anything but 1 or None",
                "drop nprocs: torch_xla starts one process per local chip itself",
            )

    def check_torch_load(self, call: ast.Call) -> None:
        known, value = self.static_value(_kw(call, "weights_only"))
        if _kw(call, "weights_only") is None:
            self.add(
                call,
                "torch-load",
                "info",
                "torch.load() without weights_only: torch >= 2.6 defaults to weights_only=True, older "
                "torch unpickles anything in the file",
                "pass weights_only=True explicitly, or store weights as safetensors and read them "
                "with safetensors.torch.load_file (xlatrain.load_weights)",
            )
        elif not (known and value is True):
            self.add(
                call,
                "torch-load",
                "warning",
                f"torch.load(weights_only={ast.unparse(_kw(call, 'weights_only'))}) unpickles the file: "
                "a checkpoint from anyone else can run code on load",
                "use weights_only=True, or safetensors (xlatrain.load_weights)",
            )

    def loader_role(self, call: ast.Call) -> str | None:
        """'train' or 'eval' from the names around a DataLoader / sampler call, or None."""
        near = " ".join(
            self.assigned_names(call)
            + [ast.unparse(a) for a in call.args[:1]]
            + [ast.unparse(v) for k in ("dataset", "sampler") if (v := _kw(call, k)) is not None]
        )
        for text in (near, self.enclosing_function_name(call)):
            if _EVAL_HINT.search(text):
                return "eval"
            if "train" in text.lower():
                return "train"
        if _const(_kw(call, "shuffle")) is True:
            return "train"
        sampler = _kw(call, "sampler")
        if sampler is not None and _const(_kw(call, "shuffle")) is None:
            return "train" if self.sampler_shuffles(sampler) else None
        return None

    def sampler_shuffles(self, sampler: ast.expr) -> bool:
        """True when ``sampler`` names a DistributedSampler built with shuffle on (its default)."""
        text = ast.unparse(sampler)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and self.call_name(node).endswith("DistributedSampler"):
                if text in self.assigned_names(node) or ast.unparse(node) == text:
                    return _const(_kw(node, "shuffle")) is not False
        return False

    def check_dataloader(self, call: ast.Call) -> None:
        role = self.loader_role(call)
        drop_last = _const(_kw(call, "drop_last"))
        known, size = self.static_value(_arg(call, 1, "batch_size"))
        if role == "train" and drop_last is not True and not (known and size == 1):
            self.add(
                call,
                "ragged-batch",
                "warning",
                "training DataLoader without drop_last=True: the last batch of each epoch is smaller, "
                "and on XLA a new batch shape compiles its own graphs (forward, backward, optimizer "
                "step) - compile time and device memory spent on one batch",
                "DataLoader(..., drop_last=True) (a DistributedSampler's drop_last only evens out "
                "replicas, not batches); xlatrain drops or pads the tail itself",
            )
        if known and isinstance(size, int) and 0 < size < 8 and role != "eval":
            self.add(
                call,
                "small-batch",
                "warning",
                f"batch_size={size} per device: a TPU core's matrix unit is 128 wide (256 on v6e), so "
                "each step pays its fixed cost for a handful of samples; ParallelLoader does not "
                "batch further",
                "use the largest per-device batch that fits (a multiple of 8, ideally of 128) and "
                "scale the learning rate with it",
            )

    def check_samplers(self, calls: list[ast.Call]) -> None:
        samplers = [c for c in calls if self.call_name(c).endswith("DistributedSampler")]
        sets_epoch = any(isinstance(c.func, ast.Attribute) and c.func.attr == "set_epoch" for c in calls)
        for call in samplers:
            shuffles = _const(_kw(call, "shuffle")) is not False
            role = self.loader_role(call)
            if shuffles and not sets_epoch and role != "eval":
                self.add(
                    call,
                    "sampler-set-epoch",
                    "warning",
                    "DistributedSampler shuffles, but sampler.set_epoch() is never called: every epoch "
                    "draws the same order",
                    "call sampler.set_epoch(epoch) at the start of each epoch; xlatrain's sampler "
                    "reshuffles per epoch from the seed itself",
                )
            if (role == "eval" or not shuffles) and _const(_kw(call, "drop_last")) is not True:
                self.add(
                    call,
                    "eval-sampler-padding",
                    "info",
                    "an evaluation DistributedSampler pads each replica's share by repeating samples "
                    "when the dataset does not divide evenly: those samples count twice in the metrics",
                    "let xlatrain evaluate: it pads the last batch and masks the padding out, so "
                    "every sample counts exactly once",
                )

    # ------------------------------------------------------------------ environment

    def env_finding(self, node: ast.AST, name: str, value: ast.AST | None) -> None:
        trap = env_trap(name)
        if trap is None:
            return
        literal = _const(value)
        if trap.flag and isinstance(literal, str) and literal.strip().lower() in ("", "0", "false", "no", "off"):
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
                        self.env_finding(node, _const(target.slice), node.value)

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

    # ------------------------------------------------------------------ tensors and step loops

    def is_loader_expr(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Call):
            if self.is_loader_call(node):
                return True
            fn = self.call_name(node).split(".")[-1]
            if fn in ("enumerate", "tqdm", "zip", "iter", "trange"):
                return any(self.is_loader_expr(a) for a in node.args)
            return False
        if isinstance(node, ast.Name):
            return node.id in self.loader_names or bool(_LOADER_NAME.search(node.id))
        if isinstance(node, ast.Attribute):
            return ast.unparse(node) in self.loader_names or bool(_LOADER_NAME.search(node.attr))
        return False

    def is_step_loop(self, loop: ast.AST) -> bool:
        if isinstance(loop, ast.For) and self.is_loader_expr(loop.iter):
            return True
        if not isinstance(loop, (ast.For, ast.While)):
            return False
        # A loop whose own body (not a nested loop's) runs backward or an optimizer step.
        stack: list[ast.AST] = list(loop.body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.For, ast.While, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "backward" or self.call_name(node).endswith("optimizer_step"):
                    return True
            stack.extend(ast.iter_child_nodes(node))
        return False

    def loop_tensor_targets(self, loop: ast.For) -> list[str]:
        target = loop.target
        it = loop.iter
        # enumerate(loader) yields (index, batch): the index is a Python int
        if isinstance(it, ast.Call) and self.call_name(it).split(".")[-1] == "enumerate":
            if isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) == 2:
                target = target.elts[1]
        return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]

    def tensor_names(self, scope: ast.AST) -> set[str]:
        """Names in ``scope`` that (probably) hold device tensors."""
        if scope in self._tensor_cache:
            return self._tensor_cache[scope]
        names: set[str] = set()
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and scope.name in _TENSOR_ARG_METHODS:
            # forward(self, x) / training_step(self, batch, ...): the arguments are tensors
            names.update(a.arg for a in [*scope.args.posonlyargs, *scope.args.args] if a.arg != "self")
            names.discard("batch_idx")
        body = scope.body if isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)) else [scope]
        nodes = list(_walk(body))
        changed = True
        while changed:  # flow-insensitive: repeat until nothing new is learnt
            changed = False
            for node in nodes:
                new: list[str] = []
                if isinstance(node, ast.For) and self.is_step_loop(node):
                    new = self.loop_tensor_targets(node)
                elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                    if self.is_tensor(node.value, names):
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        new = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                for name in new:
                    if name not in names:
                        names.add(name)
                        changed = True
        self._tensor_cache[scope] = names
        return names

    def is_tensor(self, node: ast.AST, names: set[str]) -> bool:
        if isinstance(node, ast.Name):
            return node.id in names
        if isinstance(node, ast.Attribute):
            return node.attr not in _META_ATTRS and self.is_tensor(node.value, names)
        if isinstance(node, ast.Subscript):
            return self.is_tensor(node.value, names)
        if isinstance(node, ast.BinOp):
            return self.is_tensor(node.left, names) or self.is_tensor(node.right, names)
        if isinstance(node, ast.UnaryOp):
            return self.is_tensor(node.operand, names)
        if isinstance(node, ast.Compare):
            return any(self.is_tensor(n, names) for n in [node.left, *node.comparators])
        if isinstance(node, ast.BoolOp):
            return any(self.is_tensor(v, names) for v in node.values)
        if isinstance(node, ast.IfExp):
            return self.is_tensor(node.body, names) or self.is_tensor(node.orelse, names)
        if isinstance(node, (ast.Tuple, ast.List)):
            return any(self.is_tensor(e, names) for e in node.elts)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                if func.attr in _SYNC_METHODS or func.attr in _META_METHODS:
                    return False
                if self.is_tensor(func.value, names):
                    return True
            name = self.call_name(node)
            if name.startswith("torch.") and not name.startswith(_TORCH_NOT_TENSOR):
                return name.split(".")[-1][:1].islower()
            if name.startswith(_TORCH_TENSOR_PREFIX) or name.startswith(f"{XM}.all_"):
                return True
            if isinstance(func, ast.Name) and func.id not in self.module_classes:
                return (
                    func.id[:1].islower()
                    and bool(_MODEL_CALL_NAME.search(func.id))
                    and not _NOT_MODEL_CALL.match(func.id)
                )
        return False

    def printed_tensor(self, node: ast.AST, names: set[str]) -> bool:
        """True when printing ``node`` formats a device tensor (which waits for it)."""
        if self.is_tensor(node, names):
            return True
        if isinstance(node, ast.JoinedStr):
            return any(
                isinstance(v, ast.FormattedValue) and self.printed_tensor(v.value, names) for v in node.values
            )
        if isinstance(node, ast.Call):
            fn = node.func
            if (isinstance(fn, ast.Name) and fn.id in ("str", "repr", "format")) or (
                isinstance(fn, ast.Attribute) and fn.attr == "format"
            ):
                return any(self.printed_tensor(a, names) for a in [*node.args, *(k.value for k in node.keywords)])
        if isinstance(node, ast.BinOp):
            return self.printed_tensor(node.left, names) or self.printed_tensor(node.right, names)
        if isinstance(node, (ast.Tuple, ast.List)):
            return any(self.printed_tensor(e, names) for e in node.elts)
        return False

    def check_parallel_loader_iter(self, loop: ast.For) -> None:
        it = loop.iter
        while isinstance(it, ast.Call) and self.call_name(it).split(".")[-1] in ("enumerate", "tqdm", "iter") and it.args:
            it = it.args[0]
        direct = isinstance(it, ast.Call) and self.call_name(it) == f"{PL}.ParallelLoader"
        if direct or ast.unparse(it) in self.parallel_loader_names:
            self.add(
                loop.iter,
                "parallel-loader-iter",
                "error",
                f"iterates the ParallelLoader {ast.unparse(it)} itself: a ParallelLoader has no __iter__ "
                "in torch_xla 2.9 (TypeError: object is not iterable)",
                f"iterate {ast.unparse(it)}.per_device_loader(device), or use pl.MpDeviceLoader(loader, "
                "device); with xlatrain pass the DataLoader to Trainer.fit",
            )

    def check_step_loops(self) -> None:
        for loop in (n for n in ast.walk(self.tree) if isinstance(n, ast.For)):
            self.check_parallel_loader_iter(loop)
        loops = [n for n in ast.walk(self.tree) if isinstance(n, (ast.For, ast.While)) and self.is_step_loop(n)]
        inside: set[ast.AST] = set()
        for loop in loops:
            names = self.tensor_names(self.scope_of(loop))
            for node in _walk(loop.body):
                if node in inside:
                    continue  # already checked through an outer step loop
                inside.add(node)
                self.check_in_step(node, names)
        if self.uses_xla and not self.uses_lightning:
            self.check_step_boundary(loops)

    def check_in_step(self, node: ast.AST, names: set[str]) -> None:
        sync_fix = (
            "keep per-step values on the device (sum the loss into a tensor) and read them once per "
            "epoch or every N steps through xm.add_step_closure; xlatrain's Trainer does this and "
            "reads the host only every log_every steps"
        )
        if isinstance(node, ast.Call):
            func = node.func
            name = self.call_name(node)
            if isinstance(func, ast.Attribute) and func.attr in _SYNC_METHODS and not node.args:
                if func.attr == "item" or self.is_tensor(func.value, names):
                    self.add(
                        node,
                        "host-sync",
                        "warning",
                        f"{ast.unparse(node)} inside a per-batch loop: the host waits for the device to finish "
                        "the step and copies the value back (one device-to-host transfer each time)",
                        sync_fix,
                    )
            elif name in ("float", "int", "bool") and node.args and self.is_tensor(node.args[0], names):
                self.add(
                    node,
                    "host-sync",
                    "warning",
                    f"{ast.unparse(node)} inside a per-batch loop reads a device tensor on the host: a sync "
                    "and a device-to-host copy every time",
                    sync_fix,
                )
            elif name in _PRINTS or (isinstance(func, ast.Attribute) and func.attr in ("set_postfix", "write")):
                args = [*node.args, *(k.value for k in node.keywords)]
                if any(self.printed_tensor(a, names) for a in args):
                    self.add(
                        node,
                        "print-tensor",
                        "warning",
                        f"{ast.unparse(func)}() of a device tensor inside a per-batch loop: formatting it "
                        "waits for the device and copies the value to the host",
                        sync_fix,
                    )
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            test = node.test
            if self.is_tensor(test, names):
                self.add(
                    test,
                    "tensor-condition",
                    "warning",
                    f"Python branches on a device tensor ({ast.unparse(test)}) inside a per-batch loop: the "
                    "host must wait for its value every step",
                    "decide on the device (torch.where / masks), or compare once per epoch on values "
                    "read through xm.add_step_closure",
                )

    def check_step_boundary(self, loops: list[ast.AST]) -> None:
        names = {self.call_name(c) for c in ast.walk(self.tree) if isinstance(c, ast.Call)}
        per_device = any(
            isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "per_device_loader"
            for c in ast.walk(self.tree)
        )
        barrier = any(
            isinstance(c, ast.Call)
            and self.call_name(c) == f"{XM}.optimizer_step"
            and _const(_kw(c, "barrier")) is True
            for c in ast.walk(self.tree)
        )
        if names & _STEP_BOUNDARIES or per_device or barrier:
            return
        for loop in loops:
            has_backward = any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
                for n in _walk(loop.body)
            )
            if has_backward:
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
                return

    # ------------------------------------------------------------------ ordering problems

    def check_optimizer_before_move(self, calls: list[ast.Call]) -> None:
        if not self.uses_xla:
            return  # CPU -> CUDA .to() keeps the Parameter objects; only XLA replaces them
        optimizers: list[tuple[ast.Call, str]] = []
        moves: list[tuple[ast.Call, str]] = []
        for call in calls:
            name = self.call_name(call)
            is_optimizer = (name.startswith("torch.optim.") and "lr_scheduler" not in name) or (
                name.split(".")[-1][:1].isupper() and name.split(".")[-1] in _OPTIMIZER_CLASSES
            )
            params = _arg(call, 0, "params")
            if (
                is_optimizer
                and isinstance(params, ast.Call)
                and isinstance(params.func, ast.Attribute)
                and params.func.attr == "parameters"
            ):
                optimizers.append((call, ast.unparse(params.func.value)))
            if isinstance(call.func, ast.Attribute) and call.func.attr in ("to", "cuda") and call.args:
                first = self.qualify(call.args[0]) or ""
                if not first.startswith("torch.") or first in ("torch.device",):  # not .to(torch.float16)
                    moves.append((call, ast.unparse(call.func.value)))
        for opt, model in optimizers:
            opt_scope = self.scope_of(opt)
            for move, moved in moves:
                if moved != model:
                    continue
                move_scope = self.scope_of(move)
                later = (move_scope is opt_scope and move.lineno > opt.lineno) or (
                    isinstance(opt_scope, ast.Module) and not isinstance(move_scope, ast.Module)
                )
                if later:
                    self.add(
                        opt,
                        "optimizer-before-move",
                        "error",
                        f"the optimizer takes {model}.parameters() before {model} moves to the device "
                        f"(line {move.lineno}): on XLA .to(device) replaces every Parameter (measured "
                        "with torch_xla 2.9), so this optimizer keeps updating the CPU copies and the "
                        "model on the device never learns",
                        f"build the optimizer after {model}.to(device); xlatrain's Trainer takes an "
                        "optimizer_fn and builds the optimizer once the model is on the device",
                    )
                    break

    def check_device_before_spawn(self, calls: list[ast.Call]) -> None:
        spawns = [c for c in calls if self.call_name(c) in _SPAWN_CALLS]
        if not spawns:
            return
        for call in calls:
            if self.call_name(call) not in _DEVICE_CALLS:
                continue
            scope = self.scope_of(call)
            # Before a spawn in the same scope, or at import time when the spawn runs from a function.
            runs_first = any(
                (self.scope_of(s) is scope and s.lineno > call.lineno)
                or (isinstance(scope, ast.Module) and not isinstance(self.scope_of(s), ast.Module))
                for s in spawns
            )
            if runs_first:
                self.add(
                    call,
                    "xla-before-spawn",
                    "error",
                    f"{ast.unparse(call.func)}() runs in the parent process before the spawn (line "
                    f"{spawns[0].lineno}): it starts the XLA runtime there, and torch_xla 2.9 then "
                    "refuses to spawn ('Runtime is already initialized. Do not use the XLA device "
                    "before calling xmp.spawn.')",
                    "touch the device only inside the spawned function (device = torch_xla.device() "
                    "there); xlatrain's SPMD mode needs no spawn at all",
                )

    def check_classes(self) -> None:
        for cls in (n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)):
            bases = [self.qualify(b) or "" for b in cls.bases]
            lightning = any(b.split(".")[0] in ("pytorch_lightning", "lightning") or b.endswith("LightningModule") for b in bases)
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "on_post_move_to_device" and lightning:
                    self.add(
                        fn,
                        "removed-api",
                        "warning",
                        "LightningModule.on_post_move_to_device was removed in Lightning 1.7: nothing "
                        "calls it any more",
                        "delete the hook: Lightning >= 1.5 re-ties shared parameters on TPU itself; in a "
                        "plain torch_xla loop tie the weights after model.to(device)",
                    )
            if lightning or not (self.uses_xla and cls.name in self.module_classes):
                continue
            init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            for node in _walk(init.body if init else []):
                if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                    continue
                target, value = node.targets[0], node.value
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(value, ast.Attribute)
                    and target.attr in ("weight", "bias")
                    and value.attr in ("weight", "bias")
                ):
                    self.add(
                        node,
                        "weight-tying",
                        "warning",
                        f"{ast.unparse(target)} = {ast.unparse(value)} ties weights before the model moves: "
                        "on XLA .to(device) copies each module's parameter separately (measured with "
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
                self.add(
                    node,
                    "manual-lr-scaling",
                    "info",
                    f"the learning rate is multiplied by the device count by hand ({ast.unparse(node)})",
                    "TrainConfig(scale_lr=True) scales every learning rate by the number of devices "
                    "once, and the run log states the global batch and learning rate",
                )

    def is_world_size(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Call):
            return self.call_name(node).split(".")[-1] in _WORLD_SIZE_CALLS
        if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
            return bool(_WORLD_SIZE_NAME.search(ast.unparse(node)))
        return False


_OPTIMIZER_CLASSES = {
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "LBFGS",
    "SparseAdam", "ASGD", "Rprop", "Adafactor", "Lamb", "LAMB", "AdaBelief", "Lion",
}
