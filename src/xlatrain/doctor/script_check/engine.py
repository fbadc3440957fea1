"""The script check's reading of a script: scopes, bindings, call sites, what each name holds
(device, loader, model...), and the order statements run in."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from xlatrain.doctor.script_check.common import (
    PL,
    SEVERITIES,
    ScriptFinding,
    XM,
    XMP,
    XR,
    _APIS,
    _Binding,
    _COMPREHENSIONS,
    _DATALOADERS,
    _DEVICE_CALLS,
    _FUNCS,
    _HOST_BUILTINS,
    _HOST_MODULES,
    _ITER_WRAPPERS,
    _KEPT_BY_ELEMENT,
    _K_BATCH_CPU,
    _K_BATCH_DEVICE,
    _K_CPU,
    _K_DATALOADER,
    _K_DEVICE,
    _K_DEVICE_LOADER,
    _K_FUNC,
    _K_HOST,
    _K_INSTANCE,
    _K_LOSS,
    _K_MODULE,
    _K_MODULE_XLA,
    _K_ON_XLA,
    _K_OTHER_DEVICE,
    _K_PARALLEL_LOADER,
    _K_TENSOR,
    _K_UNKNOWN,
    _K_XLA_DEVICE,
    _MAX_DEPTH,
    _META_ATTRS,
    _META_METHODS,
    _MODULES,
    _ON_DEVICE,
    _PORTS,
    _PORT_SEP,
    _Port,
    _RUNTIME_CALLS,
    _Resolved,
    _SAME_KIND_METHODS,
    _SCOPES,
    _SIMPLE_BINDERS,
    _Sites,
    _TENSORISH,
    _TORCH_FACTORIES,
    _TORCH_NOT_TENSOR,
    _arg,
    _const,
    _kw,
    _names_in,
    _walk,
)


class Engine:
    """What a name holds, where it is bound, which calls reach it, in what order: the reading of
    the script every rule asks (a rule family is a mixin on top of it, in its own module)."""

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
    def callees(self, call: ast.Call) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
        """The functions of the file ``call`` certainly calls: a name bound only to plain (undecorated)
        defs, or ``self.method``; none where the code does not settle it."""
        func = call.func
        fns: list[ast.AST] = []
        if isinstance(func, ast.Name):
            res = self.resolve(func)
            if not res.complete or not all(b.kind == "def" for b in res.bindings):
                return []
            fns = [b.value for b in res.bindings if b.value is not None]
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            method = self.method(self.enclosing_class(self.enclosing_function(call)), func.attr)
            fns = [method] if method is not None else []
        return [f for f in fns if isinstance(f, _FUNCS) and not f.decorator_list]  # type: ignore[misc]
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
        if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            return {_K_HOST}  # `is` compares identities: it never reads a tensor
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
    def guarded(self, node: ast.AST, catches: set[str]) -> str | None:
        """Why ``node`` may never run where it would fail, or None: it sits in a try body whose
        handler catches one of ``catches``, in an except handler (a fallback), or behind an ``if``
        on hasattr(), getattr(..., default) or a version: code written to survive the failure."""
        cur: ast.AST = node
        parent = self.parents.get(cur)
        while parent is not None and not isinstance(parent, _SCOPES):
            if isinstance(parent, ast.Try) and any(cur is s for s in parent.body):
                for handler in parent.handlers:
                    if handler.type is None:
                        return "it sits in a try body whose except catches the failure"
                    names = {n.id for n in ast.walk(handler.type) if isinstance(n, ast.Name)}
                    names |= {n.attr for n in ast.walk(handler.type) if isinstance(n, ast.Attribute)}
                    if names & catches:
                        return "it sits in a try body whose except catches the failure"
            if isinstance(parent, ast.ExceptHandler):
                return ("it is the fallback of a try/except, run only when the try body fails (on torch_xla "
                        "2.9 the try body runs when it calls what 2.9 has)")
            if isinstance(parent, (ast.If, ast.IfExp, ast.While)) and cur is not parent.test:
                if self._feature_test(parent.test):
                    return "it sits behind a hasattr / getattr / version check"
                # a switch between releases: the other arm calls torch_xla 2.x's replacement
                other = parent.orelse if self._in_arm(cur, parent.body) else parent.body
                for n in _walk(other if isinstance(other, list) else [other]):
                    if isinstance(n, ast.Call) and self.call_name(n).startswith(f"{XR}."):
                        return "the other branch of its if calls torch_xla.runtime"
            cur, parent = parent, self.parents.get(parent)
        return None
    def _feature_test(self, test: ast.AST) -> bool:
        """A test on hasattr(), a version, or getattr(<torch_xla module>, name, ...), directly or
        through a name assigned from it (``fn = getattr(xr, "world_size", None)``, ``if fn is None:``)."""
        text = ast.unparse(test)
        if "hasattr" in text or "version" in text.lower():
            return True
        for n in ast.walk(test):
            values = [n] + ([b.value for b in self.resolve(n).bindings] if isinstance(n, ast.Name) else [])
            for v in values:
                if (
                    isinstance(v, ast.Call)
                    and self.call_name(v) == "getattr"
                    and v.args
                    and (self.qualify(v.args[0]) or "").startswith("torch_xla")
                ):
                    return True
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
    def arg_values(self, call: ast.Call, index: int, name: str, default: Any = None) -> set[Any] | None:
        """Every value ``call`` can pass for parameter ``name`` (position ``index``), ``default``
        when it passes none, reading a tuple given by ``*`` and a dict given by ``**`` where the
        code settles them (``xmp.spawn(fn, **SPAWN_KW)``); None when the code does not say."""
        explicit = _kw(call, name)
        if explicit is not None:
            return self.static_values(explicit)
        positional: list[ast.AST] = []
        for a in call.args:
            if isinstance(a, ast.Starred):
                elts = self._literal_elts(a.value)
                if elts is None:
                    return None if len(positional) <= index else self.static_values(positional[index])
                positional += elts
            else:
                positional.append(a)
        if index < len(positional):
            return self.static_values(positional[index])
        for k in call.keywords:
            if k.arg is not None:
                continue
            if isinstance(k.value, ast.Dict):
                if any(key is None for key in k.value.keys):
                    return None
                given = [v for key, v in zip(k.value.keys, k.value.values) if _const(key) == name]
                if given:
                    return self.static_values(given[0])
            elif isinstance(k.value, ast.Name):
                values = self._dict_item_values(k.value, name, 0, missing=default)
                if values is None or values != {default}:
                    return values
            else:
                return None
        return {default}
    def _literal_elts(self, node: ast.AST) -> list[ast.AST] | None:
        """The elements of a tuple literal, given directly or by a name bound once to it."""
        if isinstance(node, ast.Name):
            b = self.resolve(node).single
            node = b.value if b is not None and b.kind == "assign" and not b.path else None
        if isinstance(node, ast.Tuple) and not any(isinstance(e, ast.Starred) for e in node.elts):
            return list(node.elts)
        return None
    def _dict_item_values(self, base: ast.Name, key: Any, depth: int, missing: Any = ...) -> set[Any] | None:
        """The values of ``base[key]`` for a dict literal ``base`` the code only writes literals
        to; ``missing`` (when given) for a key the literal lacks."""
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
        if missing is not ... and key not in [_const(k) for k in b.value.keys]:
            values.add(missing)
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
        self.check_unsharded_loaders(calls)
        self.check_padding_collates(calls)
        self.check_reads_on_one_process()
        self.check_collectives_on_one_process()
        self.check_unreduced_gradients()
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
