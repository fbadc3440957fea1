"""Script-check rules: data loaders: ragged training batches, samplers, and which loader feeds the step."""

from __future__ import annotations

import ast
from typing import Any

from xlatrain.doctor.script_check.common import (
    PL,
    XM,
    XMP,
    _DATALOADERS,
    _EVAL_HINT,
    _FUNCS,
    _ITER_WRAPPERS,
    _MAX_DEPTH,
    _PORT_SAMPLER,
    _WORLD_CALLS,
    _arg,
    _const,
    _kw,
    _walk,
)


# Calls that start or join several training processes (each then runs the script's loaders).
_MANY_PROCESSES = (f"{XMP}.spawn", "torch_xla.launch", "torch.multiprocessing.spawn", "torch.multiprocessing.start_processes",
                   "torch.distributed.init_process_group", "torch.nn.parallel.DistributedDataParallel")


def _opaque(call: ast.Call) -> bool:
    """Whether ``**kwargs`` or ``*args`` may carry any argument of ``call``."""
    return any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args)


class LoaderRules:
    """Data loaders: ragged training batches, samplers, and which loader feeds the step."""

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
        opaque = _opaque(call)
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
            elif feeds_training and True in drops:
                self.add(
                    call,
                    "ragged-batch",
                    "info",
                    f"training DataLoader with drop_last={ast.unparse(drop_last)}, which is False on some "
                    f"paths (it can also be True): where it is False, {ragged}",
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
    def check_padding_collates(self, calls: list[ast.Call]) -> None:
        """A collate that pads each batch to its own longest sequence: free on CUDA and the CPU, a
        new compiled graph per length on XLA and TorchTPU."""
        xla = self.uses_xla or self.lightning_on_tpu
        fix = ("pad to a few lengths: DataCollatorWithPadding(tokenizer, pad_to_multiple_of=64) (or "
               "padding='max_length'), xlatrain.PadCollate(pad_to_multiple_of=64) or PadCollate(buckets=(128, 256, 512))")
        for call in calls:
            name = self.call_name(call).rsplit(".", 1)[-1]
            if name == "DataCollatorWithPadding":
                padding = _const(_kw(call, "padding"))
                if _kw(call, "pad_to_multiple_of") is None and padding not in ("max_length",):
                    message = "DataCollatorWithPadding without pad_to_multiple_of pads each batch to its own longest sequence"
                else:
                    continue
            elif name == "PadCollate":
                if _kw(call, "pad_to_multiple_of") is not None or _kw(call, "buckets") is not None:
                    continue
                message = "PadCollate without pad_to_multiple_of or buckets pads each batch to its own longest sequence"
            elif name == "pad_sequence" and self.enclosing_function(call) is not None:
                message = "pad_sequence pads each batch to its own longest sequence"
            else:
                continue
            self.add(call, "ragged-lengths", "warning" if xla else "info",
                     f"{message}: on XLA and TorchTPU every new length compiles a new graph (on CUDA and the CPU it "
                     "costs nothing)", fix)

    def check_unsharded_loaders(self, calls: list[ast.Call]) -> None:
        """A training DataLoader with no sampler in a script that runs several processes: each
        process reads the whole dataset (the tutorials' most common slip). An info: a dataset may
        split itself by rank, which the check cannot see."""
        # spawn(fn, args, nprocs=1) runs one process
        starts = next((c for c in calls if self.call_name(c) in _MANY_PROCESSES and not (
            self.call_name(c).endswith("spawn") and self.arg_values(c, 2, "nprocs") == {1})), None)
        if starts is None:
            return
        train, _ = self.fed_loaders()
        for call in calls:
            if call not in train or self.call_name(call) not in _DATALOADERS or _opaque(call) \
                    or _arg(call, 3, "sampler") is not None or _arg(call, 4, "batch_sampler") is not None:
                continue
            self.add(
                call,
                "unsharded-loader",
                "info",
                f"this DataLoader feeds training with no sampler, in a script that runs several processes "
                f"({ast.unparse(starts.func)}, line {starts.lineno}): unless its dataset splits "
                "itself by rank, every process reads the whole dataset, so an epoch does the work once per "
                "process and a global batch holds each sample that many times",
                "sampler=DistributedSampler(dataset, num_replicas=world_size, rank=rank) (and "
                "sampler.set_epoch(epoch) each epoch); xlatrain's Trainer gives each process its share itself",
            )

    def check_samplers(self, calls: list[ast.Call]) -> None:
        samplers = [c for c in calls if self.call_name(c).endswith("DistributedSampler")]
        # which samplers set_epoch() is called on, where the code ties the call to one; a call it
        # cannot tie (loader.sampler.set_epoch, a parameter) may be on any of them
        set_epochs = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "set_epoch"]
        tied = {c: self.sampler_of(c.func.value) for c in set_epochs}  # type: ignore[attr-defined]
        untied = None in tied.values()
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
            if shuffles == {True} and not untied and call not in tied.values() and role != "eval":
                others = ", ".join(f"{ast.unparse(c.func)}() (line {c.lineno})" for c in tied)  # type: ignore[attr-defined]
                self.add(
                    call,
                    "sampler-set-epoch",
                    "info",
                    "DistributedSampler shuffles, but set_epoch() is never called on it"
                    + (f" (only {others}, on another sampler)" if others else "")
                    + ": every epoch draws the same order",
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
