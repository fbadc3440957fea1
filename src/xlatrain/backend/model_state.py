"""What the strategies share about a model's state: its weights whole or sharded, meta-device
materialisation, the guarded optimizer step, the bytes a device holds, and sharded saves and loads
through ``torch.distributed.checkpoint`` (DCP) with :mod:`xlatrain.storage.dcp`.

A DTensor (what ``fully_shard`` makes of a parameter) is handled by its local shard wherever a
value is computed per device; a plain tensor is its own local part.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from xlatrain.checkpoint import distinct_weights


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds (a DTensor's local shard; a plain tensor itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def full_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Every distinct weight's global shape (a DTensor reports its whole shape)."""
    weights, _ = distinct_weights(module)
    return {name: tuple(t.shape) for name, t in weights.items()}


def has_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(module: torch.nn.Module, device: torch.device, init_fn: Callable[[torch.nn.Module], None] | None) -> None:
    """Give a model built on the ``meta`` device real storage on ``device`` and initialise it.

    ``init_fn(module)`` when given; otherwise every submodule's own ``reset_parameters()`` (what
    each built-in layer runs in its constructor), in module order, a tied weight keeping its
    first owner's values. A submodule that holds meta tensors of its own and has no
    ``reset_parameters`` cannot be initialised that way: an error names it and asks for
    ``init_fn``. Tied weights are kept tied. The values drawn depend on the seed and, under FSDP,
    on the process count (each process draws its own shards).
    """
    if init_fn is None:
        missing = [
            name or type(module).__name__ for name, m in module.named_modules()
            if not hasattr(m, "reset_parameters")
            and any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
        ]
        if missing:
            raise ValueError(
                f"the model was built on the meta device, and {', '.join(missing[:5])} "
                f"{'has' if len(missing) == 1 else 'have'} weights but no reset_parameters() to initialise "
                "them: pass init_weights=fn (fn(model) initialises every weight in place) to the Trainer"
            )
    ties = _ties(module)
    module.to_empty(device=device)
    for m, name, owner, owner_name in ties:
        setattr(m, name, getattr(owner, owner_name))
    with torch.no_grad():
        if init_fn is not None:
            init_fn(module)
            return
        # A tied weight keeps the values its first owner gives it, as when a model is built on
        # the host and the tie assigned afterwards (an output layer's reset would redo the
        # embedding it shares).
        owned = {id(getattr(owner, owner_name)): (owner, owner_name) for _, _, owner, owner_name in ties}
        first_values: dict[int, torch.Tensor] = {}
        for m in module.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
            for name, param in m.named_parameters(recurse=False):
                if owned.get(id(param)) == (m, name) and id(param) not in first_values:
                    first_values[id(param)] = param.detach().clone()
        for owner, owner_name in owned.values():
            param = getattr(owner, owner_name)
            param.copy_(first_values[id(param)])


def _ties(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module, str]]:
    """``(module, name, owner, owner_name)`` for each parameter reachable under a second name."""
    first: dict[int, tuple[torch.nn.Module, str]] = {}
    aliases = []
    for m in module.modules():
        for name, param in m.named_parameters(recurse=False):
            owner = first.setdefault(id(param), (m, name))
            if owner != (m, name):
                aliases.append((m, name, *owner))
    return aliases


def keep_ties(module: torch.nn.Module, move: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """``move(module)`` with tied weights re-tied afterwards (moving to an XLA device makes a new
    Parameter per name, so a weight reachable under two names would become two)."""
    ties = _ties(module)
    moved = move(module)
    for m, name, owner, owner_name in ties:
        setattr(m, name, getattr(owner, owner_name))
    return moved


def optimizer_step(optimizer: torch.optim.Optimizer, finite: torch.Tensor | None) -> bool:
    """A strategy's ``optimizer_step`` where every process holds its gradients reduced (all of
    them but SPMD's, which adds its placement of the state): ``optimizer.step()``, or with
    ``finite`` given a :func:`guarded_step` (returns whether it dropped state the step made)."""
    try:
        return guarded_step(optimizer, finite)
    except RuntimeError as exc:
        if optimizer.defaults.get("fused") and "sparse" in str(exc):  # a sparse gradient the model made itself
            exc.add_note(f"xlatrain: {type(optimizer).__name__} runs with fused=True (the Trainer's choice where the "
                         "factory chose no implementation), and torch's fused step takes no sparse gradient: pass "
                         "fused=False in the optimizer factory")
        raise


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """A strategy's ``clip_grad_norm`` where the local norm is the global one: every process holds
    the reduced gradients whole (one process, DDP, torch_xla's processes), or the compiler computes
    it over whole tensors (SPMD). FSDP's sharded gradients need their own."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


@torch.no_grad()
def guarded_step(optimizer: torch.optim.Optimizer, finite: torch.Tensor | None,
                 step: Callable[[], Any] | None = None) -> bool:
    """``optimizer.step()`` (or ``step()``, a GradScaler's), just that where ``finite`` is None;
    else a step that leaves parameters and optimizer state unchanged when ``finite`` is false,
    decided on the device: a copy of both per step, step counts included where they live on that
    device (torch's non-fused Adam keeps them on the host beside CUDA or XLA parameters, so a
    skipped step still counts there; Python numbers in a state are not restored). No host read,
    but at a step that creates some parameter's state (the first, for most optimizers): state
    made from non-finite gradients (Adam's moments would hold a NaN for the rest of the run) is
    dropped when ``finite`` is false, read then on the host, and the parameter's next step makes
    it afresh. Returns whether it dropped any: the next step makes that state again, and on XLA
    the steady step's graphs compile one step later than they would have."""
    if finite is None:
        (step or optimizer.step)()
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    fresh = [p for p in params if not optimizer.state.get(p)]
    tensors = [local(p) for p in params]
    tensors += [local(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    tensors = [t for t in tensors if t.device == finite.device]
    before = [t.detach().clone() for t in tensors]
    (step or optimizer.step)()
    for t, old in zip(tensors, before):
        t.copy_(torch.where(finite, t, old))
    created = [p for p in fresh if optimizer.state.get(p)]  # SGD without momentum keeps none
    if not created or bool(finite):
        return False
    for p in created:
        optimizer.state.pop(p, None)
    return True


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes this device holds of parameters, gradients and optimizer state (local shards)."""
    params = {id(p): local(p) for p in model.parameters()}
    out = {
        "parameters": sum(t.numel() * t.element_size() for t in params.values()),
        "gradients": sum(local(p.grad).numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        out["optimizer"] = optimizer_state_bytes(optimizer)
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, device: torch.device | None = None) -> int:
    """Bytes of the state ``optimizer`` holds now, this process's shards, each tensor once; with
    ``device``, only what lives there (torch's default Adam keeps its step counts on the host)."""
    held = {id(v): local(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in held.values() if device is None or t.device == device)


# Tensors of optimizer state per parameter, of the parameter's size, for optimizers whose state
# does not exist yet (before the first step): what each of torch's keeps.
OPTIMIZER_STATE_PER_PARAM = {
    "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Rprop": 2, "ASGD": 1,
    "Adagrad": 1, "SparseAdam": 2,
}


def _optimizer_multiple(optimizer: torch.optim.Optimizer) -> int:
    name = type(optimizer).__name__
    defaults = optimizer.defaults
    if name == "SGD":
        return 1 if defaults.get("momentum") else 0
    if name == "RMSprop":
        return 1 + bool(defaults.get("momentum")) + bool(defaults.get("centered"))
    return OPTIMIZER_STATE_PER_PARAM.get(name, 2)


def weight_bytes(module: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``module``'s distinct parameters whole (a sharded one at its whole size), in
    ``dtype`` or their own."""
    params = {id(p): p for p in module.parameters()}.values()
    return sum(p.numel() * (torch.empty((), dtype=dtype or p.dtype).element_size()) for p in params)


def planned_state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    local_part: Callable[[torch.Tensor], tuple[torch.Size, torch.dtype]], *, count_scalars: bool = True,
) -> dict[str, Any]:
    """Bytes one device will hold of parameters, gradients and optimizer state once a step has
    run, known before it (``local_part(p)``: the shape and dtype of this device's part of ``p``).

    Gradients: one per parameter that trains, shaped as its part. Optimizer state: what the
    optimizer holds if it has stepped; else, for torch's Adam, AdamW and SGD, what their first
    step makes by their settings; else what one step of a copy of it over ``meta`` tensors
    of those shapes creates (no memory, no compute; any ``torch.optim`` optimizer, and others
    built as they are); else, for one that cannot be copied so, its kind's usual count.
    ``optimizer_source`` says which. ``count_scalars=False`` leaves 0-d state out (XLA's count).
    """
    params = list({id(p): p for p in model.parameters()}.values())
    parts = {id(p): local_part(p) for p in params}

    def nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
        return shape.numel() * torch.empty((), dtype=dtype).element_size()

    out: dict[str, Any] = {
        "parameters": sum(nbytes(*parts[id(p)]) for p in params),
        "gradients": sum(nbytes(*parts[id(p)]) for p in params if p.requires_grad),
    }
    if optimizer.state:
        out["optimizer"] = sum(
            nbytes(*local_part(v)) for v in {id(v): v for st in optimizer.state.values() for v in st.values()
                                              if isinstance(v, torch.Tensor) and (count_scalars or v.dim() > 0)}.values()
        )
        out["optimizer_source"] = "its state"
        return out
    try:
        known = _known_state_bytes(optimizer, parts, count_scalars)
        if known is not None:
            out["optimizer"] = known
            out["optimizer_source"] = f"{type(optimizer).__name__}'s state per parameter"
            return out
        out["optimizer"] = _meta_step_bytes(optimizer, parts, count_scalars)
        out["optimizer_source"] = f"one step of {type(optimizer).__name__} on meta tensors"
    except Exception:  # a custom optimizer that cannot be rebuilt or stepped so, or one holding a
        # parameter outside the model (no part known for it): its kind's usual count
        out["optimizer"] = _optimizer_multiple(optimizer) * out["gradients"]
        out["optimizer_source"] = f"estimated: {_optimizer_multiple(optimizer)} tensor(s) per parameter"
    return out


def _known_state_bytes(
    optimizer: torch.optim.Optimizer, parts: dict[int, tuple[torch.Size, torch.dtype]], count_scalars: bool
) -> int | None:
    """The state torch's Adam, AdamW and SGD make at their first step, from each group's settings:
    per parameter that trains, Adam's two moments (three with ``amsgrad``) of its shape and dtype
    and a 0-d step count (float32; float64 under a float64 default dtype, unless fused), SGD's
    momentum buffer where ``momentum`` is set. With a meta step instead, the plan's state count took
    6-10 ms of CUDA start-up on an H200 (0.4-0.6 of a step there); tests hold this count equal to a
    real first step. Other optimizers, subclasses included: None."""
    kind = type(optimizer)
    if kind not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        return None
    default_scalar = 8 if torch.get_default_dtype() == torch.float64 else 4  # bytes of a non-fused step count
    total, seen = 0, set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen or not p.requires_grad:
                continue  # a tied weight is one parameter; a frozen one gets no gradient, so no state
            seen.add(id(p))
            shape, dtype = parts[id(p)]
            size = shape.numel() * dtype.itemsize
            if kind is torch.optim.SGD:
                total += size if group["momentum"] != 0 else 0
                continue
            total += (3 if group["amsgrad"] else 2) * size
            if count_scalars:
                total += 4 if group["fused"] else default_scalar
    return total


def _meta_step_bytes(
    optimizer: torch.optim.Optimizer, parts: dict[int, tuple[torch.Size, torch.dtype]], count_scalars: bool
) -> int:
    # torch.optim's optimizers keep state per parameter, made from the parameter's shape and dtype
    # and the group's settings: one parameter of each kind in a group stands for the others (a
    # transformer's layers repeat theirs), which makes the meta step several times shorter. Meta
    # ops run through Python: the whole step took 70-80 ms, several of a GPU's steps at start-up.
    # Another optimizer may share state between parameters, and steps over all of them.
    per_parameter = type(optimizer).__module__.startswith("torch.optim.")
    copies: dict[int, torch.nn.Parameter] = {}
    stands_for: dict[int, int] = {}  # a copy's id -> how many parameters it counts for
    # Fused and capturable steps keep their state on the parameters' device, which the meta
    # device is not; the state they make has the same size either way.
    device_bound = {"fused": None, "capturable": False}
    groups = []
    for group in optimizer.param_groups:
        members: list[torch.nn.Parameter] = []
        kinds: dict[tuple[Any, ...], torch.nn.Parameter] = {}
        for p in group["params"]:
            if id(p) in copies:
                continue  # a parameter listed twice (a tied weight) is one parameter
            shape, dtype = parts[id(p)]
            kind = (tuple(shape), dtype, p.requires_grad)
            if per_parameter and kind in kinds:
                copies[id(p)] = kinds[kind]
                stands_for[id(kinds[kind])] += 1
                continue
            copy = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=p.requires_grad)
            copy.grad = torch.empty_like(copy) if p.requires_grad else None
            copies[id(p)] = kinds[kind] = copy
            stands_for[id(copy)] = 1
            members.append(copy)
        groups.append({**group, "params": members, **{k: v for k, v in device_bound.items() if k in group}})
    # Each group carries every setting; the constructor gets those of its own that it takes (some
    # optimizers keep more in their defaults than their constructor accepts).
    import inspect

    takes = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in {**optimizer.defaults, **device_bound}.items() if k in takes and k in optimizer.defaults}
    stepped = type(optimizer)([g for g in groups if g["params"]], **defaults)
    with torch.no_grad():
        stepped.step()
    total, seen = 0, set()
    for param, st in stepped.state.items():
        for v in st.values():
            if isinstance(v, torch.Tensor) and id(v) not in seen and (count_scalars or v.dim() > 0):
                seen.add(id(v))
                total += v.numel() * v.element_size() * stands_for.get(id(param), 1)
    return total


def checkpoint_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     copy_key: str | None = None) -> tuple[int, int]:
    """``(weights, optimizer state)``: bytes a checkpoint of the whole model holds (every process's
    part together), from the real tensors; optimizer state not made yet is estimated from its kind.
    ``copy_key``: the optimizer's state holds a copy of each parameter under that key (the
    Trainer's moving average of the weights), counted where it is not made yet."""
    weights, _ = distinct_weights(module)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())  # a DTensor's numel is whole
    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}.values()
    copies = 0 if copy_key is None else \
        sum(p.numel() * p.element_size() for p in params if copy_key not in optimizer.state.get(p, {}))
    if optimizer.state:
        seen: set[int] = set()
        optim_bytes = 0
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and id(v) not in seen:
                    seen.add(id(v))
                    optim_bytes += v.numel() * v.element_size()
    else:
        optim_bytes = _optimizer_multiple(optimizer) * sum(p.numel() * p.element_size() for p in params)
    return weight_bytes, optim_bytes + copies


def whole_weights_read(
    module: torch.nn.Module, read: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]], is_main: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """Distinct weights on the host through the runtime's ``read`` (one planned sync), for the
    main process (``None`` elsewhere).

    Every process reads, though only the main one keeps them: a host read made on some processes
    and not on others stalls a TorchTPU mesh (and a torch_xla job whose pending graph holds a
    collective), where each process must flush the same work.
    """
    from xlatrain.checkpoint import weights_to_host

    weights = weights_to_host(module, read)
    return weights if is_main else None


# --- sharded state through DCP --------------------------------------------------------------


def _split(nested: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``{fqn: {key: value}}`` optimizer state -> (tensors, JSON scalars), same nesting."""
    tensors: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for fqn, per_param in nested.items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(fqn, {})[key] = value
            else:
                scalars.setdefault(fqn, {})[key] = value
    return tensors, scalars


def dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, options: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimizer's state keyed by parameter name, as DCP plans it:
    ``({"model": ..., "optim": ...} tensors, {"param_groups": ..., "scalars": ...} JSON)``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=options) if options else get_state_dict(model, optimizer)
    tensors, scalars = _split(optim_sd.get("state", {}))
    return {"model": model_sd, "optim": tensors}, {"param_groups": optim_sd.get("param_groups", []), "scalars": scalars}


def save_dcp(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, no_dist: bool, planner: Any = None) -> dict[str, Any]:
    """Write this process's part of the state into ``path``; returns the JSON part (every process)."""
    import torch.distributed.checkpoint as dcp

    from xlatrain.storage.dcp import SafeShardWriter

    tensors, extra = dcp_state(model, optimizer)
    kwargs = {"planner": planner} if planner is not None else {}
    with _quiet_dcp():
        dcp.save(tensors, storage_writer=SafeShardWriter(path), no_dist=no_dist, **kwargs)
    return extra


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP's and torch_xla's notices that say nothing to a user: a single-process save that was
    asked for, torch_xla's planner written for an older DCP, its shard indexing idiom."""
    with warnings.catch_warnings():
        for message in ("torch.distributed is disabled", "The function definition for .*Planner",
                        "Using a non-tuple sequence for multidimensional indexing"):
            warnings.filterwarnings("ignore", message=message)
        yield


def load_dcp(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], *, no_dist: bool,
    planner: Any = None,
) -> None:
    """Load a DCP state saved under any layout into ``model`` and ``optimizer`` as they are spread now."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from xlatrain.storage.dcp import SafeShardReader

    tensors, _ = dcp_state(model, optimizer)  # targets shaped as this process holds them
    reader = SafeShardReader(path)
    # Per-parameter optimizer entries the checkpoint holds beyond what the optimizer makes itself
    # (the Trainer's EMA of the weights): targets shaped and sharded as the parameter.
    saved = set(reader.read_metadata().state_dict_metadata)
    for fqn, per_param in tensors["optim"].items():
        prefix = f"optim.{fqn}."
        for key in saved:
            name = key[len(prefix):]
            if key.startswith(prefix) and "." not in name and name not in per_param and fqn in tensors["model"]:
                per_param[name] = torch.empty_like(tensors["model"][fqn])
    kwargs = {"planner": planner} if planner is not None else {}
    with _quiet_dcp():
        dcp.load(tensors, storage_reader=reader, no_dist=no_dist, **kwargs)
    state: dict[str, Any] = {}
    for fqn, per_param in tensors["optim"].items():
        state[fqn] = dict(per_param)
    for fqn, per_param in extra["scalars"].items():
        state.setdefault(fqn, {}).update(per_param)
    set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                   optim_state_dict={"state": state, "param_groups": extra["param_groups"]})


def sharded_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and its submodules that ``fully_shard`` made FSDP modules (none elsewhere)."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _whole_in_name_order(fsdp: list[torch.nn.Module], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` as ``set_state_dict(full_state_dict=True)`` needs them in a sharded model.

    Each FSDP module is resharded first: one that a forward left gathered (the root, after a
    forward that no backward followed) holds the gathered copy in place of its parameters, and
    set_state_dict would take that copy for a whole tensor. set_state_dict then sends each tensor
    out in the order of the mapping (distribute_tensor scatters it from the main process), so
    every process must walk it alike; a safetensors file comes back in a different key order in
    each process (its header is read into a hash map), hence the sorting."""
    for m in fsdp:
        m.reshard()  # type: ignore[operator]
    return {name: weights[name] for name in sorted(weights)}


def load_whole_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Whole weights (by name, every process holding all of them) into ``module`` as it is spread
    now: a sharded (FSDP) model keeps each process's shards, and its next forward gathers them.
    ``strict`` as in ``load_state_dict``."""
    fsdp = sharded_modules(module)
    if not fsdp:
        module.load_state_dict(weights, strict=strict)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if strict:
        # set_state_dict fills a name the mapping lacks with the model's own tensor, so it would
        # not say what is missing: load_state_dict's error, said here.
        missing = [name for name in module.state_dict() if name not in weights]
        if missing:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t"
                               f"Missing key(s) in state_dict: {', '.join(repr(n) for n in missing)}.")
    set_model_state_dict(module, _whole_in_name_order(fsdp, weights),
                         options=StateDictOptions(full_state_dict=True, strict=strict))


def load_whole_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor], optim_state: dict[str, Any]
) -> None:
    """Whole weights and an optimizer ``state_dict`` (keyed by parameter position, as a replicated
    run saves it) into a sharded model: each process keeps the shards it holds."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    name_of = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    order = [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
    weights = _whole_in_name_order(sharded_modules(model), weights)
    # The optimizer's state is sent out as the weights are (see _whole_in_name_order).
    state = {order[int(i)]: dict(sorted(values.items())) for i, values in
             sorted(optim_state["state"].items(), key=lambda item: int(item[0]))}
    groups = [{**g, "params": [order[int(i)] for i in g["params"]]} for g in optim_state["param_groups"]]
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict={"state": state, "param_groups": groups},
                   options=StateDictOptions(full_state_dict=True))


# The devices where each torch optimizer's fused kernel was measured faster than its default
# (foreach): AdamW on an H100 (85M LM, compiled) +5.8% tokens/s; on this project's CPU, over 8M
# float32 parameters, an AdamW step took 13 ms fused against 82-134 ms, an Adagrad step 2.5 ms
# against 7-9 ms. Adagrad on CUDA (a kernel only recent torch releases have) was not measured:
# it keeps torch's default there.
FUSED_DEVICES = {"Adam": ("cuda", "cpu"), "AdamW": ("cuda", "cpu"), "SGD": ("cuda", "cpu"), "Adagrad": ("cpu",)}


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def optimizer_implementation(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's implementation options (``fused``, ``foreach``, ...): what a loaded
    state must not change."""
    return [{k: group[k] for k in IMPLEMENTATION_KEYS if k in group} for group in optimizer.param_groups]


def restore_implementation(optimizer: torch.optim.Optimizer, chosen: list[dict[str, Any]]) -> None:
    """Put back what :func:`optimizer_implementation` read, after a state was loaded over it: an
    option this optimizer was built without is dropped."""
    for group, options in zip(optimizer.param_groups, chosen):
        for key in IMPLEMENTATION_KEYS:
            if key in options:
                group[key] = options[key]
            else:
                group.pop(key, None)


def fused_optimizer(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
) -> tuple[torch.optim.Optimizer, str | None]:
    """The same optimizer with ``fused=True`` where torch has a fused kernel for its parameters'
    device and the factory chose no implementation (``fused`` and ``foreach`` left unset); else the
    optimizer as it was. Returns what to say in the run's header, or None.

    A fused step computes the same update in one kernel per parameter group instead of a few per
    tensor list; rounding may differ in the last bits. Sharded (DTensor) parameters keep the
    default implementation, and so do the weights of ``model``'s sparse embeddings
    (``nn.Embedding(sparse=True)``): no fused kernel takes a sparse gradient. SGD with momentum
    keeps it too (its fused step takes no parameter stepped later than the others).
    """
    import inspect

    cls = type(optimizer)
    try:
        signature = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        signature = {}
    accepts = "fused" in signature
    defaults = optimizer.defaults
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not accepts or defaults.get("fused") is not None or defaults.get("foreach") is not None or not params:
        return optimizer, None
    kernel = next((FUSED_DEVICES[c.__name__] for c in cls.__mro__ if c.__module__.startswith("torch.optim")
                   and c.__name__ in FUSED_DEVICES), ())
    devices = {p.device.type for p in params}
    if len(devices) != 1 or not devices <= set(kernel):
        return optimizer, None
    if defaults.get("differentiable") or defaults.get("capturable") or _stepped(optimizer):
        return optimizer, None
    if issubclass(cls, torch.optim.SGD) and any(g.get("momentum") for g in optimizer.param_groups):
        # torch's fused SGD raises (TypeError) at a step where some parameters have a momentum
        # buffer and others, stepped for the first time, have none yet: a branch whose first
        # gradient comes after the first step, or state skip_step dropped. Its default takes both.
        return optimizer, None
    if any(type(p.data) is not torch.Tensor or not p.is_floating_point() for p in params):
        return optimizer, None  # DTensors (FSDP) and the like keep the default
    sparse = {id(m.weight) for m in (model.modules() if model is not None else ())
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
    if any(id(p) in sparse for p in params):
        return optimizer, None
    groups = [{**group, "fused": True} for group in optimizer.param_groups]
    try:
        fused = cls(groups, **{k: v for k, v in defaults.items() if k in signature and k != "fused"}, fused=True)
    except (RuntimeError, ValueError, TypeError):  # a dtype or option the fused kernel does not take
        return optimizer, None
    return fused, (f"optimizer: {cls.__name__} with fused=True (one fused op over all parameters per step on "
                   f"{devices.pop()}; the factory chose no implementation, and fused=False keeps torch's default)")


def _stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds state from a step (Adagrad makes its sums and a step count of
    0 as it is built; rebuilt, they are made alike)."""
    for state in optimizer.state.values():
        step = state.get("step")
        if step is None or float(step) != 0:
            return True
    return False
