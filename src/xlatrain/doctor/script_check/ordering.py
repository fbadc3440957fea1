"""Script-check rules: what must come before what: the optimizer after the model moves, the device after spawn."""

from __future__ import annotations

import ast

from xlatrain.doctor.script_check.common import (
    XM,
    XMP,
    _K_MODULE,
    _K_OTHER_DEVICE,
    _K_XLA_DEVICE,
    _OPTIMIZER_CLASSES,
    _RUNTIME_CALLS,
    _arg,
    _walk,
)


class OrderRules:
    """What must come before what: the optimizer after the model moves, the device after spawn."""

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
                rebuilt = self._rebound_after(opt, move)
                if rebuilt is True:
                    break  # the name gets a new optimizer after the move: that is the one stepped
                certain = target == _K_XLA_DEVICE and rebuilt is None
                where = "the XLA device" if target == _K_XLA_DEVICE else ast.unparse(move.args[0]) if move.args else "the device"
                unsure = "" if target == _K_XLA_DEVICE else ", which the check cannot place"
                then = "" if target == _K_XLA_DEVICE else f"if {where} is an XLA device, "
                again = "" if rebuilt is None else (
                    f"; {self.parents[opt].targets[0].id} is bound again on line {rebuilt.lineno}, where "  # type: ignore[attr-defined]
                    "the check cannot tell which optimizer the steps use"
                )
                self.add(
                    opt,
                    "optimizer-before-move",
                    "error" if certain else "info",
                    f"the optimizer takes {model.id}.parameters() before {model.id} moves to {where} "
                    f"(line {move.lineno}){unsure}: on XLA .to(device) replaces every Parameter (measured "
                    f"with torch_xla 2.9), so {then}this optimizer keeps updating the CPU copies and the "
                    f"model on the device never learns{again}",
                    f"build the optimizer after {model.id}.to(device); xlatrain's Trainer takes an "
                    "optimizer_fn and builds the optimizer once the model is on the device",
                )
                break
    def _rebound_after(self, opt: ast.Call, move: ast.Call) -> ast.AST | bool | None:
        """For ``name = Optimizer(...)`` before ``move``: True when a later statement of the move's
        block binds ``name`` again (the optimizer stepped from there on is a new one), the first
        other binding of ``name`` after the move when there is one (the old one may still be
        stepped), else None."""
        holder = self.parents.get(opt)
        if not (isinstance(holder, ast.Assign) and len(holder.targets) == 1 and isinstance(holder.targets[0], ast.Name)):
            return None
        stmt = self.stmt_of(move)
        later = [
            b.stmt for b in self.table(self.scope_of(opt)).get(holder.targets[0].id, [])
            if b.stmt is not None and b.stmt is not holder and b.stmt.lineno > move.lineno  # type: ignore[attr-defined]
        ]
        if not later:
            return None
        if stmt in self.slot and self.unconditional(move, stmt):
            parent, field, idx = self.slot[stmt]
            if any(s in later for s in getattr(parent, field)[idx + 1 :] if isinstance(s, ast.Assign)):
                return True
        return later[0]
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
                values = self.arg_values(call, 2, "nprocs")
                if values != {1}:
                    spawns.append((call, values is not None and 1 not in values))
            elif name == "torch_xla.launch":
                if self.arg_values(call, 3, "debug_single_process", False) != {True}:
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
