"""Script-check rules: inside the training loop: host reads every step, iterating a ParallelLoader, and the step boundary."""

from __future__ import annotations

import ast
from typing import Any

from xlatrain.doctor.script_check.common import (
    XM,
    _ITER_WRAPPERS,
    _K_DATALOADER,
    _K_DEVICE_LOADER,
    _K_HOST,
    _K_PARALLEL_LOADER,
    _K_TENSOR,
    _LIBRARIES,
    _LOADER_NAME,
    _PRINTS,
    _STEP_BOUNDARIES,
    _SYNC_METHODS,
    _walk,
)


class StepLoopRules:
    """Inside the training loop: host reads every step, iterating a ParallelLoader, and the step boundary."""

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
        # a function of the file the loop calls runs once per batch too (two levels down); each
        # function is reported once per loop, from its first call there that runs every step
        checked: dict[ast.AST, set[ast.AST]] = {}
        calls = [(n, lc) for n, lc in owner.items() if isinstance(n, ast.Call)]
        for node, (loop, certainty) in sorted(calls, key=lambda c: self.every_n(c[0], c[1][0]) is not None):
            self.check_helpers_in_step(node, node, loop, certainty, 2, checked.setdefault(loop, set()), owner)
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
    def check_helpers_in_step(self, call: ast.Call, site: ast.Call, loop: ast.AST, certainty: str, depth: int,
                              seen: set[ast.AST], owner: dict[ast.AST, tuple[ast.AST, str]]) -> None:
        """The step checks on the body of each function of the file ``call`` certainly calls
        (``site`` is the call in the loop that leads there)."""
        if depth <= 0:
            return
        for fn in self.callees(call):
            if fn in seen:
                continue
            seen.add(fn)
            for node in _walk(fn.body):
                if node not in owner:  # a loop of its own inside the function is checked as one
                    self.check_in_step(node, loop, certainty, (fn, site))
                if isinstance(node, ast.Call):
                    self.check_helpers_in_step(node, site, loop, certainty, depth - 1, seen, owner)
    def check_in_step(self, node: ast.AST, loop: ast.AST, certainty: str,
                      via: tuple[ast.AST, ast.Call] | None = None) -> None:
        """``via``: (the function of the file holding ``node``, the call in ``loop`` that reaches it)."""
        if not isinstance(node, (ast.Call, ast.If, ast.While, ast.IfExp, ast.Assert)):
            return
        sync_fix = (
            "keep per-step values on the device (sum the loss into a tensor) and read them once per "
            "epoch or every N steps through xm.add_step_closure; xlatrain's Trainer does this and "
            "reads the host only every log_every steps"
        )
        if via is None:
            every = self.every_n(node, loop)
            place = "inside a per-batch loop"
        else:
            fn, site = via
            every = self.every_n(site, loop) or self.every_n(node, fn)
            place = (f"in {fn.name}() (line {node.lineno}), which the per-batch loop calls every step "  # type: ignore[attr-defined]
                     f"(line {site.lineno})")

        def certain(subject: str) -> tuple[str, str]:
            if certainty == "step" and every is None:
                return "warning", f"{subject} {place}"
            if certainty == "step":
                # still mid-step: each read stops the host until the device has computed the value
                at = "" if via is None else f" {place.replace(' every step', '')}"
                return "warning", f"{subject}{at} every few steps (under `if {every}`)"
            if via is None:
                return "info", f"{subject} inside a loop that looks per-batch (if it runs once per batch)"
            return "info", f"{subject} {place.replace('per-batch loop', 'loop that looks per-batch')} (if it runs once per batch)"

        def unsure(subject: str, value: ast.AST) -> str:
            return (
                f"{subject} {place}, on {ast.unparse(value)}, which the code does not "
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
                        f"{ast.unparse(func)}() of a tensor {place}: if it is on the "
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
        # optimizer_step(optimizer, barrier=False, ...): barrier=True cuts the graph
        barriers = {c: self.arg_values(c, 1, "barrier", False) for c in calls if self.call_name(c) == f"{XM}.optimizer_step"}
        if names & _STEP_BOUNDARIES or per_device or {True} in barriers.values():
            return
        maybe = [f"{ast.unparse(c)} (whether barrier is True)" for c, v in barriers.items() if v is None or True in v]
        for loop in loops:
            if not self.runs_step(loop):
                continue
            unseen = self.opaque_calls(loop) + maybe
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
