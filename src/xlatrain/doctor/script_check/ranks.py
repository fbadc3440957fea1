"""Script-check rules: a device value read, or a collective called, on the main process only.

torch_xla tutorials print and save under ``if xm.is_master_ordinal():``. A host read in that
branch (``loss.item()``, ``t.cpu()``, ``print(t)``) is made by one process while the others go on.
On torch_xla it can run the pending graph on that process alone; on TorchTPU every process must
make the same reads in the same order, or the mesh stops there (measured: DESIGN.md, "TorchTPU
traps"). Which runtime the script will meet is not in the file, so this is a porting note.

A collective (xm.rendezvous, xm.mesh_reduce, xm.all_reduce, dist.barrier ...) in that branch waits
for processes that never reach it: with more than one process the run hangs there. That is an
error where the branch runs in a function xmp.spawn starts without nprocs=1, else an info.

A plain ``optimizer.step()`` in the training loop of such a function, with nothing in the file that
reduces gradients, steps each process's copy of the model with its own gradients only.
"""

from __future__ import annotations

import ast
import collections

from xlatrain.doctor.script_check.common import (
    XM,
    XMP,
    _LIBRARIES,
    _OPTIMIZER_CLASSES,
    _PRINTS,
    _SYNC_METHODS,
    _Port,
    _arg,
    _kw,
    _walk,
)

# Calls true on one process only, and calls of a process's index (one process where compared
# equal to a number).
_MAIN_ONLY = {"torch_xla.core.xla_model.is_master_ordinal", "torch_xla.core.xla_model.is_master"}
_INDEX_CALLS = {
    "torch_xla.runtime.global_ordinal", "torch_xla.runtime.local_ordinal", "torch_xla.runtime.process_index",
    "torch_xla.core.xla_model.get_ordinal", "torch_xla.core.xla_model.get_local_ordinal",
    "torch.distributed.get_rank",
}

# Calls every process must make for any of them to return (torch_xla 2.9: rendezvous and
# mesh_reduce go through xla_rendezvous, an XLA collective over every replica; all_reduce & co. are
# in-graph collectives over every replica unless given groups).
_COLLECTIVES = {
    f"{XM}.{n}" for n in ("rendezvous", "xla_rendezvous", "mesh_reduce", "all_reduce", "all_gather", "reduce_scatter",
                          "all_to_all", "collective_permute", "reduce_gradients", "optimizer_step")
} | {
    f"torch.distributed.{n}" for n in ("barrier", "monitored_barrier", "all_reduce", "all_gather", "all_gather_object",
                                       "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
                                       "broadcast_object_list", "reduce", "gather", "gather_object", "scatter",
                                       "scatter_object_list", "all_to_all", "all_to_all_single")
}
# The position of the group / replicas argument of each collective (passed, it may name a subset).
_GROUP_POSITION = {"rendezvous": 2, "xla_rendezvous": 1, "all_reduce": 2, "barrier": 0, "monitored_barrier": 0,
                   "all_gather": 2, "reduce_scatter": 3, "broadcast": 2, "reduce": 3}

# What reduces gradients across processes (or may: a name the rule cannot follow).
_GRAD_REDUCERS = ("DistributedDataParallel", "FullyShardedDataParallel", "ZeroRedundancyOptimizer", "fsdp",
                  "spmd", "register_comm_hook", "register_hook", "register_post_accumulate_grad_hook",
                  "all_reduce", "reduce_gradients", "optimizer_step")
# Collectives that carry no device tensor (a tag, host objects): they cannot reduce gradients.
_NOT_ON_TENSORS = {"rendezvous", "xla_rendezvous", "mesh_reduce", "barrier", "monitored_barrier",
                   "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"}

_PORT_ONE_PROCESS_READ = _Port(
    "port:read-on-every-process",
    "a device value read on one process only stops the mesh there: every process must make "
    "the same host reads in the same order. Read it on every process (v = t.item()), then print or "
    "save it where torch.distributed.get_rank() == 0",
    "the Trainer makes every host read it plans on every process and prints on the main one",
)


class RankRules:
    """A device value read inside a branch only the main process takes."""

    def main_only(self, test: ast.AST) -> bool:
        """True when ``test`` holds on one process only: is_master_ordinal(), or an ordinal == N
        (the ordinal called, or a name the code binds only to one: ``rank = xr.global_ordinal()``,
        the index xmp.spawn passes its function)."""
        if isinstance(test, ast.Call):
            return (self.qualify(test.func) or "") in _MAIN_ONLY
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            left, right = test.left, test.comparators[0]
            for index, other in ((left, right), (right, left)):
                if self.process_index(index) and isinstance(other, ast.Constant) and type(other.value) is int:
                    return True
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            return any(self.main_only(v) for v in test.values)
        return False

    def process_index(self, node: ast.AST, depth: int = 0) -> bool:
        """True when ``node`` certainly holds this process's index."""
        if isinstance(node, ast.Call):
            return (self.qualify(node.func) or "") in _INDEX_CALLS
        if not isinstance(node, ast.Name) or depth > 4:
            return False
        res = self.resolve(node)
        if not res.complete or not res.bindings:
            return False
        for b in res.bindings:
            if b.kind == "param":
                values, _, from_spawn = self.param_args(b)
                if not from_spawn or not all(self.process_index(v, depth + 1) for v in values):
                    return False
            elif not (b.kind == "assign" and not b.path and self.process_index(b.value, depth + 1)):  # type: ignore[arg-type]
                return False
        return True

    def check_reads_on_one_process(self) -> None:
        for branch in (n for n in ast.walk(self.tree) if isinstance(n, ast.If) and self.main_only(n.test)):
            for node in (n for stmt in branch.body for n in ast.walk(stmt)):
                read = self.device_read(node)
                if read is not None:
                    self.add_port(node, f"{read} under `if {ast.unparse(branch.test)}`", _PORT_ONE_PROCESS_READ)

    def check_collectives_on_one_process(self) -> None:
        """A collective in a branch one process takes (or in the ``else`` the others take), directly
        or in a function of the file the branch calls (two levels down)."""
        for branch in (n for n in ast.walk(self.tree) if isinstance(n, ast.If) and self.main_only(n.test)):
            test = ast.unparse(branch.test)
            arms = [[(node, coll, via) for node in _walk(arm) if isinstance(node, ast.Call)
                     for coll, via in self._collectives_reached(node, 2, set())] for arm in (branch.body, branch.orelse)]
            for (mine, other), who in zip(((arms[0], arms[1]), (arms[1], arms[0])),
                                          ("only the process where it holds", "every process but one")):
                # a collective both arms make (the main process's and the others') is met by every process
                unmatched = collections.Counter(self.call_name(coll) for _, coll, _ in other)
                for node, coll, via in mine:
                    if unmatched[self.call_name(coll)] > 0:
                        unmatched[self.call_name(coll)] -= 1
                        continue
                    self._add_one_process_collective(node, coll, via, test, who, branch)

    def _collectives_reached(self, call: ast.Call, depth: int, seen: set[ast.AST]) -> list[tuple[ast.Call, str]]:
        """(collective, how ``call`` reaches it) for ``call`` itself or the collectives in the
        body of a function of the file it calls."""
        if self.call_name(call) in _COLLECTIVES:
            return [(call, "")]
        out: list[tuple[ast.Call, str]] = []
        if depth <= 0:
            return out
        for fn in self.callees(call):
            if fn in seen:
                continue
            seen.add(fn)
            for inner in (n for n in _walk(fn.body) if isinstance(n, ast.Call)):
                for coll, via in self._collectives_reached(inner, depth - 1, seen):
                    out.append((coll, f" in {fn.name}() (line {inner.lineno})" + via))
        return out

    def spawned_by(self, node: ast.AST, depth: int = 3) -> list[tuple[ast.Call, str]]:
        """(xmp.spawn / torch_xla.launch call, how many processes it starts: 'one', 'many', or
        'maybe' where the code does not settle it) for each start that runs the function holding
        ``node``, or one that calls it (``depth`` levels up)."""
        fn = self.enclosing_function(node)
        if fn is None or depth < 0:
            return []
        rec = self.sites(fn)
        out: list[tuple[ast.Call, str]] = []
        for spawn in rec.spawns:
            if self.call_name(spawn) == f"{XMP}.spawn":
                values = self.arg_values(spawn, 2, "nprocs")
                # nprocs=None: one process per local device
                out.append((spawn, "one" if values == {1} else "many" if values is not None and 1 not in values
                            else "maybe"))
            elif self.arg_values(spawn, 3, "debug_single_process", False) == {True}:
                out.append((spawn, "one"))
            else:
                out.append((spawn, "maybe"))  # under torchrun launch calls the function directly
        for site, _ in rec.calls:
            out += self.spawned_by(site, depth - 1)
        return out

    def _add_one_process_collective(self, node: ast.Call, coll: ast.Call, via: str, test: str, who: str,
                                    branch: ast.If) -> None:
        name = self.call_name(coll)
        short = ast.unparse(coll.func)
        spawns = self.spawned_by(branch)
        if spawns and all(how == "one" for _, how in spawns):
            return  # a single process: nobody to wait for
        # a collective over a group of processes may be meant for the branch's processes alone
        grouped = any(k.arg in ("group", "groups", "replicas", "ordinals") for k in coll.keywords) or len(
            coll.args) > _GROUP_POSITION.get(name.split(".")[-1], 99)
        certain = bool(spawns) and all(how == "many" for _, how in spawns) and not grouped
        blocks = (
            "it waits until every process has reached it (torch_xla 2.9: xla_rendezvous, an XLA collective "
            "over every replica)" if name.split(".")[-1] in ("rendezvous", "xla_rendezvous", "mesh_reduce")
            else "every process must make the same collective calls in the same order"
        )
        what = (f"{short}(){via} is a collective, called under `if {test}` by {who}: {blocks}, so the "
                "others never reach it")
        if certain:
            spawn = spawns[0][0]
            severity = "error"
            message = (f"{what}; xmp.spawn (line {spawn.lineno}) starts one process per device, so the run "
                       "hangs there on more than one device")
        else:
            severity = "info"
            unsure = []
            if not spawns or not all(how == "many" for _, how in spawns):
                unsure.append("more than one process runs this (the file does not show how the script is launched)")
            if grouped:
                unsure.append("its group holds a process that does not take this branch")
            message = f"{what}: if {' and '.join(unsure)}, the run hangs there"
        fix = (f"call {short}() on every process, outside the rank test; to save, call xm.save() on every "
               "process (it writes on the master only by itself), or torch.save() of a CPU copy under the "
               "rank test")
        self.add(node, "collective-on-one-process", severity, message, fix)

    def device_read(self, node: ast.AST) -> str | None:
        """What ``node`` reads from the device to the host, where the code shows a device value."""
        if not isinstance(node, ast.Call):
            return None
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _SYNC_METHODS and not node.args and self.is_device(func.value):
            return ast.unparse(node)
        name = self.call_name(node)
        if name == f"{XM}.save" and node.args:
            # torch_xla 2.9 xm.save: _maybe_convert_to_cpu(data) syncs the data's graph (wait=True)
            # and copies it to the host on the process that writes
            return f"{ast.unparse(func)}() (it copies the data to the host)"
        if name in ("float", "int", "bool") and node.args and self.is_device(node.args[0]):
            return ast.unparse(node)
        if name in _PRINTS and any(self.printed(a, self.is_device) for a in [*node.args, *(k.value for k in node.keywords)]):
            return f"{ast.unparse(func)}() of a device tensor"
        return None

    def check_unreduced_gradients(self) -> None:
        """``opt.step()`` of a torch.optim optimizer in a per-batch loop that xmp.spawn runs in
        several processes, where nothing in the file reduces gradients: each replica follows its own
        gradients. An error where each process certainly trains on its own shard (a
        DistributedSampler feeds the loop) and the file shows everything the loop calls; else an info."""
        if self.uses_lightning:
            return
        calls = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)]
        if any(
            (self.call_name(c) in _COLLECTIVES
             and (self.call_name(c).split(".")[-1] not in _NOT_ON_TENSORS or "grad" in ast.unparse(c)))
            or any(r in (self.call_name(c) or ast.unparse(c.func)) for r in _GRAD_REDUCERS)
            for c in calls
        ):
            return
        imports = {
            b.target for s in self.all_tables() for bs in self.table(s).values() for b in bs if b.kind == "import"
        }
        # a module of the project may wrap the model or hook its gradients: the check cannot see it
        unseen = sorted({t for t in imports if t.startswith(".") or t.split(".")[0] not in _LIBRARIES})
        for loop in (n for n in ast.walk(self.tree) if isinstance(n, (ast.For, ast.AsyncFor, ast.While))):
            if self.loop_certainty(loop) != "step":
                continue
            spawns = self.spawned_by(loop)
            if not spawns or all(how == "one" for _, how in spawns):
                continue
            for node in _walk(loop.body):
                opt = self._plain_optimizer_step(node)
                if opt is None:
                    continue
                sharded = isinstance(loop, (ast.For, ast.AsyncFor)) and any(
                    (sampler := self.sampler_of(_arg(dl, 3, "sampler"))) is not None
                    and self.static_values(_kw(sampler, "num_replicas")) != {1}
                    for dl in self.loader_sources(loop.iter)
                )
                opaque = self.opaque_calls(loop) + unseen
                spawn = spawns[0][0]
                what = (
                    f"{ast.unparse(node)} steps this process's copy of the model with its own gradients only: "
                    "nothing in this file reduces gradients across processes (no xm.optimizer_step, "
                    f"xm.reduce_gradients, all_reduce or DistributedDataParallel), and {ast.unparse(spawn.func)} "
                    f"(line {spawn.lineno}) runs this loop in "
                )
                if all(how == "many" for _, how in spawns) and sharded and not opaque:
                    severity = "error"
                    message = (what + "one process per device, each on its own DistributedSampler shard: the "
                               "replicas drift apart from the first step, and each saves or reports only its own")
                else:
                    severity = "info"
                    unknown = f"; the check cannot see inside {', '.join(opaque)}" if opaque else ""
                    message = (what + "one process per device (unless a single device runs it): unless the "
                               f"replicas see the same data from the same start, they drift apart{unknown}")
                self.add(
                    node,
                    "unreduced-gradients",
                    severity,
                    message,
                    f"xm.optimizer_step({opt}) (it all-reduces the gradients, then steps), or "
                    f"xm.reduce_gradients({opt}) before {opt}.step(); xlatrain's Trainer reduces them itself",
                )

    def _plain_optimizer_step(self, node: ast.AST) -> str | None:
        """The name of a torch.optim optimizer the code builds, for ``node`` = its ``.step()``."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step"
                and isinstance(node.func.value, ast.Name)):
            return None
        b = self.resolve(node.func.value).single
        if b is None or b.kind != "assign" or b.path or not isinstance(b.value, ast.Call):
            return None
        name = self.call_name(b.value)
        if name.startswith("torch.optim.") and name.split(".")[-1] in _OPTIMIZER_CLASSES:
            return node.func.value.id
        return None
