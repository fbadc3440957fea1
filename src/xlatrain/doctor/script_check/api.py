"""Script-check rules: removed and deprecated torch_xla APIs, spawn's arguments, torch.load of a checkpoint, dynamic shapes, and the porting notes."""

from __future__ import annotations

import ast

from xlatrain.doctor.script_check.common import (
    XM,
    XMP,
    _APIS,
    _Api,
    _CATCHES_ATTRIBUTE,
    _CATCHES_IMPORT,
    _DYNAMIC_SHAPE,
    _PORTS,
    _PORT_IMPORT,
    _REMOVED_MODULES,
    _TENSOR_ARG_METHODS,
    _arg,
    _const,
    _kw,
)


class ApiRules:
    """Removed and deprecated torch_xla APIs, spawn's arguments, torch.load of a checkpoint, dynamic shapes, and the porting notes."""

    def add_api(self, node: ast.AST, api: _Api, prefix: str = "") -> None:
        reason = self.guarded(node, _CATCHES_ATTRIBUTE | _CATCHES_IMPORT) if api.severity == "error" else None
        if reason:
            self.add(
                node,
                api.code,
                "info",
                f"{prefix}{api.message}; {reason}, so it fails only where that branch is still taken",
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
        values = self.arg_values(call, 2, "nprocs")
        fix = (
            "drop nprocs: torch_xla starts one process per local chip itself; or use xlatrain's "
            "default SPMD mode (one process drives every chip)"
        )
        if values is None:
            given = f"nprocs={ast.unparse(nprocs)}" if nprocs is not None else "*args / **kwargs, which may carry nprocs"
            self.add(
                call,
                "spawn-nprocs",
                "info",
                f"xmp.spawn({given}): the check cannot read its value without running the script; "
                "torch_xla 2.9 raises ValueError for anything but 1 or None",
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
                f"xmp.spawn(nprocs={ast.unparse(nprocs) if nprocs is not None else '...'}) is {shown} on some paths (it can also be "
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
