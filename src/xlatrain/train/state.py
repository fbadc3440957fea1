"""Everything a run needs to continue exactly: packed into tensors + JSON, and back.

Tensors (model, optimizer state) go to safetensors, whole or, under a sharded strategy, in parts
(the strategy saves and loads those); the rest (optimizer hyper-parameters, scheduler, RNG states
and running loss sums of every process, the cursor, history, config, versions) to JSON. Nothing
is pickled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from xlatrain.backend.model_state import load_whole_weights
from xlatrain.checkpoint import distinct_weights, read_weights
from xlatrain.tree import flatten_keys

FORMAT_VERSION = 1


@dataclass
class Cursor:
    """Where a run stands: ``step`` micro-batches of ``epoch`` are done (``epoch_done``: all of it,
    validation and history row included), and where its best monitored value is."""

    epoch: int = 1
    step: int = 0
    global_step: int = 0  # optimizer steps since the start of the run
    epoch_done: bool = False
    best: float = math.nan
    best_epoch: int | None = None
    best_checkpoint: str | None = None  # the checkpoint saved at the end of best_epoch, kept by pruning
    epoch_lr: float | None = None  # the learning rate as ``epoch`` began: its history row's "lr"
    unjudged_until: int = 0  # epochs up to this one lacked the monitored column: patience counts after it
    history: list[dict[str, Any]] = field(default_factory=list)

    def next_position(self) -> tuple[int, int]:
        """(epoch, step) the training loop continues from."""
        return (self.epoch + 1, 0) if self.epoch_done else (self.epoch, self.step)


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("xlatrain", "torch_xla"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def _jsonable(name: str, value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        where, kind = _unsaveable(value)
        raise ValueError(
            f"{name}: {where or 'the value'} is a {kind}, which a checkpoint cannot hold (settings are "
            "saved as JSON: numbers, one-number tensors, strings, lists; checkpoints never pickle). Give the "
            "optimizer or scheduler one of those there, or save no checkpoints (CheckpointConfig(enabled=False))."
        ) from None
    return value


def as_numbers(value: Any) -> Any:
    """``value`` (parameter groups, a scheduler's state) with each one-number tensor as the Python
    number it holds (float, int or bool, as its dtype is), through dicts, lists and tuples, for JSON.

    ``lr=torch.tensor(0.01)`` is how torch's compiled optimizer step takes a rate that a scheduler
    changes without recompiling (the scheduler's ``base_lrs`` are tensors then too);
    :func:`with_tensors` gives a loaded state its tensors back.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()  # at a checkpoint (or once before the first step), never in a step
    if isinstance(value, dict):
        return {k: as_numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(as_numbers(v) for v in value)
    return value


def settings_tensors(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings that hold tensors, kept before a state is loaded over them."""
    return [{k: v for k, v in group.items() if k != "params" and _holds_tensor(v)} for group in optimizer.param_groups]


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)


def restore_settings(optimizer: torch.optim.Optimizer, kept: list[dict[str, Any]]) -> None:
    """The loaded numbers, put into the tensors :func:`settings_tensors` kept, in their places."""
    for group, tensors in zip(optimizer.param_groups, kept):
        group.update(with_tensors(tensors, group))


def with_tensors(current: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    """``loaded`` with its numbers written into ``current``'s tensors at the same keys, and those
    tensors in their places: a scheduler that writes the rate into the tensor in place keeps doing
    so, and a compiled step sees the tensor it was compiled for. Saved, they were numbers."""
    return {k: _filled(current[k], v) if k in current and _holds_tensor(current[k]) else v for k, v in loaded.items()}


def _filled(kept: Any, loaded: Any) -> Any:
    if isinstance(kept, torch.Tensor):
        with torch.no_grad():
            kept.fill_(loaded)
        return kept
    if isinstance(kept, (list, tuple)) and isinstance(loaded, (list, tuple)) and len(kept) == len(loaded):
        return type(kept)(_filled(k, v) for k, v in zip(kept, loaded))
    if isinstance(kept, dict) and isinstance(loaded, dict):
        return with_tensors(kept, loaded)
    return loaded


def _unsaveable(value: Any, where: str = "") -> tuple[str, str]:
    """Where in ``value`` the first thing JSON cannot hold is (``"[0]['lr']"``), and its type."""
    if isinstance(value, dict):
        odd = [k for k in value if not (k is None or isinstance(k, (bool, int, float, str)))]
        if odd:
            return f"{where}[{odd[0]!r}] (a key)", type(odd[0]).__name__
        items: Any = ((f"[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    elif value is None or isinstance(value, (bool, int, float, str)):
        return "", ""
    else:
        return where, type(value).__name__
    for key, item in items:
        found = _unsaveable(item, where + key)
        if found[1]:
            return found
    return "", ""


def check_saveable(optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """Refuse, before the first step, an optimizer or scheduler whose settings no checkpoint can
    hold: otherwise the run would stop at its first checkpoint, with that much training lost."""
    _jsonable("optimizer param_groups", as_numbers(optimizer.state_dict()["param_groups"]))
    if scheduler is not None:
        _jsonable("scheduler state", as_numbers(scheduler.state_dict()))


def pack_meta(
    *,
    scheduler: Any,
    sums_per_process: list[dict[str, float]],
    cursor: Cursor,
    rng_states: list[dict[str, Any]],
    config: dict[str, Any],
) -> dict[str, Any]:
    """The JSON part every checkpoint has, however its tensors are stored."""
    meta = {
        "format": FORMAT_VERSION,
        "cursor": {k: v for k, v in dataclasses.asdict(cursor).items() if k != "history"},
        "history": cursor.history,
        "scheduler": _jsonable("scheduler state", as_numbers(scheduler.state_dict())) if scheduler is not None else None,
        "rng": rng_states,
        # Each process's running sums of the epoch (float32 values, exact as JSON floats).
        "sums": sums_per_process,
        # What the run was started with, compared with the resuming run's (see resume_changes).
        "config": config,
        "versions": _versions(),
    }
    if math.isnan(cursor.best):
        meta["cursor"]["best"] = None
    return meta


def pack_whole(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, read: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A whole state (every process holds all of it): tensors for safetensors, and their JSON part.

    ``read`` brings every device tensor to the host in one planned sync.
    """
    opt_state = optimizer.state_dict()
    device_tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in opt_state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                device_tensors[f"optim.{index}.{key}"] = value.detach()
            else:
                scalars.setdefault(str(index), {})[key] = value
    # One read for weights and optimizer state together.
    weights, aliases = distinct_weights(model)
    names = list(weights) + list(device_tensors)
    host = read(list(weights.values()) + list(device_tensors.values()))
    tensors = {(f"model.{n}" if i < len(weights) else n): t.contiguous() for i, (n, t) in enumerate(zip(names, host))}
    return tensors, {
        "model_aliases": aliases,
        "optimizer": {
            "param_groups": _jsonable("optimizer param_groups", as_numbers(opt_state["param_groups"])),
            "scalars": _jsonable("optimizer state", scalars),
        },
    }


def sharded_extra(extra: dict[str, Any]) -> dict[str, Any]:
    """The JSON part of a sharded state (optimizer hyper-parameters and scalars), checked."""
    return {"param_groups": _jsonable("optimizer param_groups", as_numbers(extra["param_groups"])),
            "scalars": _jsonable("optimizer state", extra["scalars"])}


def unpack_whole(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A whole state's model weights (ties restored) and optimizer ``state_dict``."""
    weights = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    for alias, kept in meta["model_aliases"].items():
        weights[alias] = weights[kept]
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for index, values in meta["optimizer"]["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    return weights, {"state": state, "param_groups": meta["optimizer"]["param_groups"]}


def unpack_meta(meta: dict[str, Any], scheduler: Any) -> tuple[Cursor, list[dict[str, float]], list[dict[str, Any]]]:
    """Load the scheduler; returns the cursor, per-process running sums and RNG states."""
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint format {meta.get('format')!r} is not supported (expected {FORMAT_VERSION})")
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(with_tensors(scheduler.state_dict(), meta["scheduler"]))
    raw = dict(meta["cursor"])
    raw["best"] = math.nan if raw.get("best") is None else raw["best"]
    cursor = Cursor(**raw, history=list(meta["history"]))
    return cursor, list(meta["sums"]), list(meta["rng"])


def saved_shapes(
    tensors: dict[str, torch.Tensor] | None, index: dict[str, Any] | None, aliases: dict[str, str]
) -> dict[str, tuple[int, ...]]:
    """The shapes of the model's distinct weights as a checkpoint holds them (whole tensors, or a
    shards index, which lists a tied weight under each of its names)."""
    if tensors is not None:
        found = {k[len("model."):]: tuple(t.shape) for k, t in tensors.items() if k.startswith("model.")}
    else:
        assert index is not None
        found = {k[len("model."):]: tuple(t["size"]) for k, t in index["tensors"].items() if k.startswith("model.")}
    return {k: v for k, v in found.items() if k not in aliases}


# How each setting may differ when a run resumes from a checkpoint. "continue": the run goes on
# under the new value and the log names the change. "error": the saved state was built under the
# old value (the batch, the sample order, the optimizer and schedule, what "best" means), so
# going on would silently mix two runs ("until a best is recorded": what "best" means may change
# while no epoch has been judged by it). Every TrainConfig and CheckpointConfig field is listed.
RESUME_RULES: dict[str, str] = {
    "trainer.epochs": "at least the epochs done",
    "trainer.batch_size": "continue",  # run.global_batch must hold: another device count may resume
    "trainer.eval_batch_size": "continue",
    "trainer.scale_lr": "error",
    "trainer.precision": "continue",
    "trainer.grad_accum_steps": "error",
    "trainer.clip_grad_norm": "continue",
    "trainer.log_every": "continue",
    "trainer.seed": "error",
    "trainer.num_workers": "continue",
    "trainer.task": "error",
    "trainer.top_k": "continue",  # columns added or left out from here on
    "trainer.ema_decay": "continue",  # the average goes on with the new decay (or starts here)
    "trainer.ema_every": "continue",
    "trainer.ema_rule": "continue",
    "trainer.ema_warmup_epochs": "continue",
    "trainer.ema_bn_batches": "continue",  # how the average is scored, not what it is
    "trainer.channels_last": "continue",  # a memory order: the same numbers
    "trainer.monitor": "until a best is recorded",  # before that, nothing was judged by it
    "trainer.monitor_mode": "until a best is recorded",
    "trainer.scheduler_interval": "error",
    "trainer.early_stop_patience": "continue",
    "trainer.save_best": "continue",
    "trainer.nan_policy": "continue",
    "trainer.diagnostics": "continue",
    "trainer.strict": "continue",
    "trainer.compile": "continue",
    "trainer.tensorboard": "continue",
    "trainer.profile_steps": "continue",
    "trainer.run_dir": "continue",
    "checkpoint.every_steps": "continue",
    "checkpoint.at_epoch_end": "continue",
    "checkpoint.keep_last": "continue",
    "checkpoint.enabled": "continue",
    "backend.compile_cache": "continue",
    # Where and how the run is spread: the state is device-independent and a sharded checkpoint
    # reshards, so another device count, runtime or strategy continues the same run (the global
    # batch, checked below, keeps the data order and the losses).
    "backend.accelerator": "continue",
    "backend.devices": "continue",
    "backend.xla_mode": "continue",
    "backend.tpu_runtime": "continue",
    "backend.strategy": "continue",
    "backend.units": "continue",
    "backend.activation_checkpointing": "continue",
    # The shape of the run itself, recorded by the Trainer.
    "run.global_batch": "error",
    "run.num_train_samples": "error",
}
# Sections of a config-driven run (``xlatrain fit``) whose every key must match: the model is
# rebuilt from them, the optimizer and schedule state come back from the checkpoint (a new
# learning rate would be ignored), and the data define what the cursor points into.
STRICT_SECTIONS = ("model", "optimizer", "schedule", "data", "backend")


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    """Keys of the Trainer's sections and of the recipe sections compared key by key; any other
    top-level mapping is compared whole."""
    sections = ("trainer", "checkpoint", "run", *STRICT_SECTIONS)
    return flatten_keys(config, lambda name, value: "." in name or name in sections)


def resume_changes(old: dict[str, Any], new: dict[str, Any], epochs_done: int,
                   best_recorded: bool = True) -> tuple[list[str], list[str]]:
    """Compare the checkpoint's config with the resuming run's: ``(continued, refused)`` lines.

    Each line is ``key old -> new``; ``refused`` ones say why the run cannot go on under them.
    ``new["defaults"]`` (per section, the value of each key left at its default) stands in for a
    key that ``old`` leaves out of a section it records: an older xlatrain recorded a recipe's
    ``data`` section as written, without the keys left at their defaults.
    """
    # The new config as the checkpoint holds it: through JSON (a tuple reads back as a list).
    new = json.loads(json.dumps(new, default=str))
    defaults = _flatten({k: v for k, v in (new.pop("defaults", None) or {}).items() if isinstance(old.get(k), dict)})
    before = _flatten({k: v for k, v in old.items() if k != "defaults"})
    after = _flatten(new)
    continued, refused = [], []
    for key in sorted(set(before) | set(after)):
        was, now = before.get(key, defaults.get(key)), after.get(key)
        if was == now or (key not in before and key not in defaults) or key not in after:
            continue  # a key one side does not record (an older checkpoint, no run config) is not compared
        rule = RESUME_RULES.get(key, "error" if key.split(".")[0] in STRICT_SECTIONS else "continue")
        line = f"{key} {was!r} -> {now!r}"
        if rule == "until a best is recorded":
            rule = "error" if best_recorded else "continue"
        if rule == "continue":
            continued.append(line)
        elif rule == "at least the epochs done":
            (continued if isinstance(now, int) and now >= epochs_done else refused).append(
                line + ("" if isinstance(now, int) and now >= epochs_done else f" (the checkpoint has finished {epochs_done} epoch(s))")
            )
        else:
            refused.append(line)
    return continued, refused


def load_weights(module: torch.nn.Module, path: str | os.PathLike[str], strict: bool = True) -> None:
    """Load weights saved by :func:`xlatrain.save_weights` (or a run's ``best.safetensors``,
    ``ema.safetensors``, ``xlatrain export``) into ``module``, in place, ties preserved.

    A model the Trainer sharded (``strategy="fsdp"``) takes them too: every process reads the
    whole file and keeps its own shards. ``strict`` as in ``load_state_dict``.
    """
    load_whole_weights(module, read_weights(path), strict)
