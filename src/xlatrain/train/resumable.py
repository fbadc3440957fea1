"""What makes a fit resumable: its checkpoints (every process's state, the main process writes),
continuing from one, and stopping on SIGTERM / SIGINT with a checkpoint of the step it reached."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from xlatrain.backend.base import PLANNED_READ
from xlatrain.backend.model_state import IMPLEMENTATION_KEYS, optimizer_implementation, restore_implementation
from xlatrain.train.checks import required_positional
from xlatrain.train.factories import STEP_COUNTS, made_with_run
from xlatrain.train.ema import drop_averages
from xlatrain.checkpoint import (
    SHARDS_DIR,
    CheckpointError,
    list_checkpoints,
    SHARDS_INDEX,
    distinct_weights,
    find_resumable,
    latest_name,
    prune_checkpoints,
    read_checkpoint,
    write_checkpoint,
    write_sharded_checkpoint,
)
from xlatrain.report import write_history
from xlatrain.storage import lock as run_lock
from xlatrain.storage.remote_run import stale_after_s
from xlatrain.train.state import (
    Cursor,
    as_numbers,
    check_saveable,
    pack_meta,
    pack_whole,
    restore_settings,
    resume_changes,
    saved_shapes,
    settings_tensors,
    sharded_extra,
    unpack_meta,
    unpack_whole,
)

# The Trainer (train/trainer.py) calls these functions with itself; named here without an import,
# so that this module does not import the one that imports it.
Trainer = Any


def resume(trainer: Trainer, resume: bool | str) -> tuple[Cursor, dict[str, torch.Tensor]]:
    """The cursor and running sums this fit continues from (a fresh start's where there is none),
    with the model, optimizer, schedule and random streams restored from the checkpoint."""
    rt, st, run_dir = trainer.runtime, trainer.strategy, trainer._dir
    cursor, sums = Cursor(), trainer._new_sums()
    if trainer.checkpoint.enabled:
        check_saveable(trainer.optimizer, trainer.scheduler)
    run_dir.clear_earlier_run()  # resume='overwrite': once nothing before the first step refused the run
    if resume in (False, "overwrite"):
        return cursor, sums
    if resume == "auto":
        damaged: list[str] = []
        # On object storage with several processes, each brings the checkpoint it tries into its
        # host's copy first: another host's disk holds none of the main process's files, and
        # the main process's holds none of the parts other hosts wrote.
        fetch = run_dir.remote.ensure_checkpoint if run_dir.remote is not None and st.num_processes > 1 else None
        found = find_resumable(run_dir.path / "checkpoints", group=st, failures=damaged, fetch=fetch)
        if found is None:
            run_dir.refuse_to_retrain(damaged)
            return cursor, sums
        path, tensors, meta = found
    else:
        path, tensors, meta = explicit_checkpoint(Path(resume), st)
    _keep_saved_interval(trainer, meta)
    check_resumable(trainer, path, tensors, meta)
    # How the optimizer computes (fused, foreach, ...) is this run's choice, not the checkpoint's:
    # a state saved by a fused CUDA or single-device run also resumes under FSDP, whose sharded
    # parameters have no fused kernel.
    implementation, tensors_kept = optimizer_implementation(trainer.optimizer), settings_tensors(trainer.optimizer)
    if tensors is None:  # a sharded state: each process reads the chunks its layout needs
        st.load_sharded(path / SHARDS_DIR, trainer.model, trainer.optimizer, meta["sharded"])
    else:
        weights, optim_state = unpack_whole(tensors, meta)
        st.load_whole(trainer.model, trainer.optimizer, weights, optim_state)
    restore_implementation(trainer.optimizer, implementation)
    restore_settings(trainer.optimizer, tensors_kept)
    if trainer.ema is None and drop_averages(trainer.optimizer):
        trainer._say("the checkpoint's moving average of the weights is dropped, as this run has no EMA "
                     "(trainer.ema_decay=None): an EMA turned on later starts afresh")
    cursor, per_process_sums, rng = unpack_meta(meta, trainer.scheduler)
    saved = meta.get("config") or {}
    was = saved.get("trainer", saved).get("nan_policy", trainer.config.nan_policy)
    per_process_sums = counted_as(per_process_sums, was, trainer.config.nan_policy)
    if trainer.grad_scaler is not None and "grad_scaler" in meta:
        trainer.grad_scaler.load_state_dict(meta["grad_scaler"])
    if cursor.epoch_done and cursor.best_epoch == cursor.epoch:
        cursor.best_checkpoint = path.name  # saved right after the best epoch: this one
    # What all_reduce_mean(sums["loss"]) reads at the first log interval, known here without a read.
    trainer._start_sums = tuple(sum(p.get(k, 0.0) for p in per_process_sums) / len(per_process_sums)
                                for k in ("loss", "nonfinite", "skipped"))
    if len(rng) == st.num_processes:
        mine = per_process_sums[st.process_index]
        rt.set_rng_state(rng[st.process_index])
    else:
        mine = resharded_sums(per_process_sums, st.process_index, st.num_processes,
                              alike=trainer.config.nan_policy == "skip_step" or st.counting_processes == 1)
        # Random streams belong to processes; another process count cannot take them over.
        rt.seed_everything((trainer.config.seed * 1_000_003 + cursor.global_step) * 1_000_003 + st.process_index)
        trainer._say(
            f"the checkpoint was written by {len(rng)} process(es) and this run has {st.num_processes}: "
            "model, optimizer, schedule and data order continue exactly; random draws (dropout, "
            "augmentation) continue from a seed of the step, not from the saved streams"
        )
    sums = {k: torch.tensor(v, dtype=torch.float32).to(rt.device) for k, v in mine.items()}
    trainer._resumed_from = path  # said once it is known that there is something left to train
    if path.parent == run_dir.path / "checkpoints":
        run_dir.checkpoint = path.name  # what a failed status names for a rerun
    return cursor, sums


def check_resumable(trainer: Trainer, path: Path, tensors: dict[str, torch.Tensor] | None, meta: dict[str, Any]) -> None:
    """Refuse, before anything is loaded, a checkpoint this run cannot continue; log what changed."""
    ways_on = (
        "Resume with the old values, or start over: --fresh on the command line, "
        "fit(..., resume=False) in Python (a new run directory; this one is kept)."
    )
    index = json.loads((path / SHARDS_INDEX).read_text()) if tensors is None else None
    saved = saved_shapes(tensors, index, meta.get("model_aliases", {}))
    mine = trainer.strategy.model_shapes(trainer.model)
    if saved != mine:
        diffs = [f"{n}: {saved.get(n, 'absent')} -> {mine.get(n, 'absent')}" for n in sorted(set(saved) | set(mine))
                 if saved.get(n) != mine.get(n)]
        raise ValueError(
            f"cannot resume from {path}: the model differs from the checkpoint's in {len(diffs)} weight(s) "
            f"(checkpoint -> this model): {'; '.join(diffs[:5])}{' ...' if len(diffs) > 5 else ''}. {ways_on}"
        )
    old = meta.get("config") or {}
    if "trainer" not in old:  # written before the whole run config was recorded
        old = {"trainer": old}
    raw = meta.get("cursor", {})
    done = raw.get("epoch", 1) - (0 if raw.get("epoch_done") else 1)
    continued, refused = resume_changes(old, trainer._config_record, epochs_done=done,
                                        best_recorded=raw.get("best_epoch") is not None)
    if refused:
        raise ValueError(f"cannot resume from {path}: the run cannot continue under {'; '.join(refused)}. "
                         f"{_global_batch_hint(trainer, old)}{ways_on}")
    was, now = old.get("trainer", {}).get("epochs"), trainer.config.epochs
    if trainer.scheduler is not None:
        _check_schedule_length(trainer, path, meta, was, now)
    if continued:
        trainer._say(f"resuming with changed settings: {'; '.join(continued)}")
    saved_groups = (meta.get("optimizer") or meta.get("sharded") or {}).get("param_groups")
    kept = [] if saved_groups is None else \
        changed_optimizer_settings(saved_groups, trainer.optimizer, scheduled=trainer.scheduler is not None)
    if kept:  # a config's optimizer section was compared above; a factory's values are only here
        trainer._say(
            f"the checkpoint's optimizer settings continue, not this run's optimizer factory's: {'; '.join(kept)}. "
            "To train with the new values, start over (fit(..., resume=False): a new run directory), or set them "
            "in a callback's on_fit_start (trainer.optimizer.param_groups)"
        )


def changed_optimizer_settings(saved_groups: list[dict[str, Any]], optimizer: torch.optim.Optimizer,
                               scheduled: bool = False) -> list[str]:
    """What this run's optimizer factory set otherwise than the checkpoint holds, which loading the
    checkpoint puts back over it (``optimizer.lr 0.01 kept (this run: 0.005)``). Only what no
    schedule moves is compared: the base learning rate (a schedule's ``initial_lr``; the rate itself
    where no schedule keeps one), and momentum or betas unless a schedule cycles them. How the
    optimizer computes (fused, foreach, ...) is this run's own choice."""
    groups = optimizer.param_groups
    if len(saved_groups) != len(groups):
        return []  # another grouping of the parameters: the load itself refuses it
    out = []
    for i, (old, new) in enumerate(zip(saved_groups, groups)):
        name = "optimizer." if len(groups) == 1 else f"optimizer group {i} "
        moved = {"initial_lr", *IMPLEMENTATION_KEYS} | ({"momentum", "betas"} if "base_momentum" in new else set())
        if "initial_lr" in old and "initial_lr" in new:
            old, new = {**old, "lr": old["initial_lr"]}, {**new, "lr": new["initial_lr"]}
        elif scheduled or "initial_lr" in old or "initial_lr" in new:
            moved.add("lr")  # a schedule that keeps no base (ReduceLROnPlateau), or one on one side only
        for key in sorted(set(old) & set(new) - moved - {"params"}):  # a key one torch release lacks is no change
            was, now = _plain(old[key]), _plain(new[key])
            if was != now:
                out.append(f"{name}{key} {was} kept (this run: {now})")
    return out


def _plain(value: Any) -> Any:
    """A group's setting as the checkpoint's JSON holds it (tensors as numbers, tuples as lists)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def build_schedule(trainer: Trainer, *, for_fit: bool) -> None:
    """The learning-rate schedule ``scheduler_fn`` makes, kept as ``trainer.scheduler``, and when it
    steps (``trainer.schedule_interval``).

    As the Trainer is built: one taking only the optimizer, built now (a user may read it). As
    each fit begins: one that needs the run's length, built for this fit's; and in a fit after
    another, the schedule the Trainer made is made anew, the rates put back where it began them
    (a checkpoint resumed from then loads its state over it). A schedule a user put in
    ``trainer.scheduler`` in place of the Trainer's stays theirs.
    """
    make = trainer._scheduler_fn
    if not for_fit:
        trainer._scheduler_wants_run = make is not None and required_positional(make) >= 2
        trainer._schedule_fits = 0
        trainer._schedule_reads = set()
        # The rates a schedule starts from, for a fit after another: torch's schedulers keep them as
        # initial_lr, ReduceLROnPlateau does not.
        trainer._first_rates = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
                                for g in trainer.optimizer.param_groups]
        trainer.scheduler = make(trainer.optimizer) if make is not None and not trainer._scheduler_wants_run else None
        trainer._built_scheduler = trainer.scheduler
        return
    trainer._schedule_fits += 1
    again = trainer._schedule_fits > 1
    if make is not None and trainer.scheduler is trainer._built_scheduler and (trainer._scheduler_wants_run or again):
        if again:  # a schedule made from the current rate (a cosine's next) starts from the first one again
            for group, first in zip(trainer.optimizer.param_groups, trainer._first_rates):
                start = group.get("initial_lr", first)
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].copy_(start) if isinstance(start, torch.Tensor) else group["lr"].fill_(start)
                else:
                    group["lr"] = start.clone() if isinstance(start, torch.Tensor) else start
        if trainer._scheduler_wants_run:
            trainer.scheduler, trainer._schedule_reads = made_with_run(make, trainer.optimizer, trainer.run_shape)
        else:
            trainer.scheduler = make(trainer.optimizer)
        trainer._built_scheduler = trainer.scheduler
    if trainer.scheduler is not trainer._built_scheduler:
        trainer._schedule_reads = set()  # put in place of scheduler_fn's: what that read says nothing of it
    _settle_interval(trainer)


def _keep_saved_interval(trainer: Trainer, meta: dict[str, Any]) -> None:
    """Under ``scheduler_interval='auto'`` a resumed run steps its schedule as the checkpoint's run
    did: one that an older xlatrain stepped every epoch (its default then) goes on so, said."""
    saved = ((meta.get("config") or {}).get("trainer") or {}).get("scheduler_interval")
    if trainer.config.scheduler_interval != "auto" or saved not in ("epoch", "step") or saved == trainer.schedule_interval:
        return
    trainer._say(f"the checkpoint's schedule was stepped {_every(saved)}: "
                 f"this run goes on so (scheduler_interval='auto' would have chosen '{trainer.schedule_interval}' for a "
                 f"new run; set scheduler_interval to choose)")
    trainer.schedule_interval = saved
    trainer._config_record["trainer"]["scheduler_interval"] = saved
    if trainer._schedule_note:
        trainer._schedule_note = f"schedule: {type(trainer.scheduler).__name__} stepped {_every(saved)}, as the " \
                                 "checkpoint's run was"


def _settle_interval(trainer: Trainer) -> None:
    """``scheduler_interval='auto'``: every optimizer step for a schedule made from the run's
    length in steps (``run.total_steps``, ``run.steps_per_epoch``), as a Hugging Face or OneCycle
    schedule counts them; every epoch otherwise. The run's recorded config holds the interval
    chosen, so a resume compares what ran. ReduceLROnPlateau steps on the monitored value, once
    an epoch, in the monitor's direction."""
    cfg, scheduler = trainer.config, trainer.scheduler
    chosen = cfg.scheduler_interval
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if chosen == "auto" and plateau:
        chosen, how = "epoch", "every epoch"
    elif chosen == "auto":
        steps = sorted(trainer._schedule_reads & set(STEP_COUNTS))
        chosen = "step" if steps else "epoch"
        why = (f"scheduler_fn read run.{' and run.'.join(steps)}, counts of optimizer steps" if steps else
               "the schedule was put in trainer.scheduler, not made by scheduler_fn"
               if scheduler is not trainer._built_scheduler else
               "scheduler_fn read no count of optimizer steps from the run" if trainer._scheduler_wants_run else
               "scheduler_fn takes only the optimizer")
        how = f"{_every(chosen)} (scheduler_interval='auto': {why}; set scheduler_interval to choose)"
    else:
        how = f"{_every(chosen)} (scheduler_interval={chosen!r})"
    if plateau:
        if chosen == "step":
            raise ValueError(
                "ReduceLROnPlateau lowers the rate when the monitored value stops improving, which xlatrain measures "
                f"once an epoch ({trainer.monitor}); scheduler_interval='step' would step it every optimizer step with "
                "no value to give: leave scheduler_interval at 'auto' or set 'epoch'")
        if scheduler.mode != trainer.monitor_mode:
            raise ValueError(
                f"ReduceLROnPlateau(mode={scheduler.mode!r}) lowers the rate when its value stops "
                f"{'falling' if scheduler.mode == 'min' else 'rising'}, but it is given {trainer.monitor}, which is better "
                f"{'higher' if trainer.monitor_mode == 'max' else 'lower'} (monitor_mode {trainer.monitor_mode!r}): "
                f"build it with mode={trainer.monitor_mode!r}, or set monitor (trainer.monitor) to the value it should follow")
        how += f", on {trainer.monitor}"
    trainer.schedule_interval = chosen
    trainer._config_record["trainer"]["scheduler_interval"] = chosen
    trainer._schedule_note = f"schedule: {type(scheduler).__name__} stepped {how}" if scheduler is not None else None


def _every(interval: str) -> str:
    return "every optimizer step" if interval == "step" else "every epoch"


def _global_batch_hint(trainer: Trainer, old: dict[str, Any]) -> str:
    """The batch size that keeps a checkpoint's global batch on this run's devices, where it changed:
    run.global_batch is made, not set. Accumulation cannot change, so the hint keeps the saved one."""
    cfg, world = trainer.config, trainer.strategy.world_size
    was, now = old.get("run", {}).get("global_batch"), trainer._config_record["run"]["global_batch"]
    if was is None or was == now:
        return ""
    accum = old.get("trainer", {}).get("grad_accum_steps", cfg.grad_accum_steps)
    keep = was / (world * accum)
    with_accum = f" with trainer.grad_accum_steps={accum}" if accum != cfg.grad_accum_steps else ""
    return (f"The global batch is trainer.batch_size x devices x trainer.grad_accum_steps, here {cfg.batch_size} x "
            f"{world} x {cfg.grad_accum_steps} = {now}; " + (
                f"trainer.batch_size={int(keep)}{with_accum} keeps {was} on {world} device(s). " if keep == int(keep)
                else f"no batch size makes {was} on {world} device(s){with_accum}. "))


# Settings of torch's schedulers that hold a length in steps or epochs (a cosine's T_max,
# OneCycleLR's total_steps, LinearLR's total_iters, MultiStepLR's and SequentialLR's milestones,
# the first cycle of warm restarts): where one differs from a schedule built now, it was derived
# from the run's length. Progress (last_epoch, T_cur) and a plateau's counters are not compared.
_LENGTH_KEYS = {"T_max", "total_steps", "total_iters", "milestones", "_milestones", "T_0", "step_size"}


def _lengths_that_differ(fresh: Any, saved: Any, where: str = "") -> list[str]:
    """``key saved -> fresh`` for each length setting that differs, nested schedulers included
    (SequentialLR's and ChainedScheduler's ``_schedulers``)."""
    if isinstance(fresh, list) and isinstance(saved, list) and len(fresh) == len(saved):
        return [line for i, (f, s) in enumerate(zip(fresh, saved))
                for line in _lengths_that_differ(f, s, f"{where}{i}.")]
    if not (isinstance(fresh, dict) and isinstance(saved, dict)):
        return []
    out: list[str] = []
    for key, value in fresh.items():
        if key not in saved:
            continue
        if key in _LENGTH_KEYS:
            if value != saved[key]:
                out.append(f"{where}{key} {saved[key]!r} -> {value!r}")
        else:
            out += _lengths_that_differ(value, saved[key], f"{where}{key}.")
    return out


def _check_schedule_length(trainer: Trainer, path: Path, meta: dict[str, Any], was: int | None, now: int) -> None:
    """More (or fewer) epochs, and a schedule whose saved settings hold the run's length (they
    differ from a schedule built now): restored, it keeps the old length (a cosine reaches its
    floor at the old last epoch and stays there; OneCycleLR raises at its first step past its end).
    A schedule of its own pace (StepLR with a fixed step) goes on; one whose length lives in a
    function (LambdaLR) follows the new length from the step reached, as its function is the one
    built now. With the epochs unchanged, a saved length that differs (a schedule an earlier
    xlatrain built otherwise) goes on as saved, and is said."""
    # Through JSON, as the checkpoint holds it (a tuple reads back as a list).
    fresh = json.loads(json.dumps(as_numbers(trainer.scheduler.state_dict()), default=str))
    differ = _lengths_that_differ(fresh, meta.get("scheduler") or {})
    if not differ:
        return
    if was is None or was == now:
        trainer._say(f"note: the checkpoint's learning-rate schedule holds another length than one built now "
                     f"({type(trainer.scheduler).__name__}'s {', '.join(differ[:3])}); the run goes on with it as "
                     "saved (--fresh, or resume=False, starts a run with the schedule built now)")
        return
    best = trainer.run_dir / "best.safetensors"
    weights = f"{best}" if best.is_file() else f"the weights `xlatrain export {trainer.run_dir}` writes"
    raise ValueError(
        f"cannot resume from {path} with trainer.epochs {was} -> {now}: the learning-rate schedule holds the run's "
        f"length ({type(trainer.scheduler).__name__}'s {', '.join(differ[:3])}), and the checkpoint restores it as it "
        f"was, planned for {was} epochs, not {now} (past its end a cosine stays at its floor; OneCycleLR raises). "
        f"Keep epochs={was} to finish this run, or train on in a new run that starts from its weights "
        f"({weights}): --fresh --set model.pretrained=... on the command line; in Python, load them into the "
        "model and fit(..., resume=False)."
    )


def save_checkpoint(trainer: Trainer, cursor: Cursor, sums: dict[str, torch.Tensor]) -> Path | None:
    """Write a checkpoint of where the run stands (every process takes part); callbacks hear of it
    once it is complete."""
    path = _write(trainer, cursor, sums)
    if trainer._observers.wants("on_checkpoint"):
        st = trainer.strategy
        if st.num_processes > 1:  # the main process wrote it: every process hears of it once it is complete
            name = next((n for n in st.gather_objects(path.name if path else None) if n), None)
            path = trainer.run_dir / "checkpoints" / name if name else None  # under this process's own run dir
        trainer._observers.call("on_checkpoint", trainer, path)
    return path


def _write(trainer: Trainer, cursor: Cursor, sums: dict[str, torch.Tensor]) -> Path | None:
    rt, st, remote = trainer.runtime, trainer.strategy, trainer._dir.remote
    # Every process's generators and running sums, so each continues exactly as it was.
    with torch.profiler.record_function(PLANNED_READ):
        local = dict(zip(sums, (float(t) for t in rt.read(list(sums.values())))))
    lost = None
    if remote is not None and st.is_main and not remote.still_held():
        lost = remote.lost_to  # another run took the lock over: this one stops before it writes
    per_process = st.gather_objects({"rng": rt.rng_state(), "sums": local, "lost": lost})
    if per_process[0]["lost"] is not None:
        raise run_lock.RunDirError(
            f"{trainer.run_location}: another run took this one's lock over ({per_process[0]['lost']}), as this run "
            f"had not renewed it for {stale_after_s():,.0f} s (stalled, or cut off from the store). This run "
            "stops without writing there; the other run's checkpoints are its own")
    # A non-finite loss since the last check must not become the latest checkpoint.
    trainer._check_nonfinite(sum(p["sums"]["nonfinite"] for p in per_process) / len(per_process) * st.counting_processes,
                             cursor.epoch, 1, cursor.step)
    meta = pack_meta(
        scheduler=trainer.scheduler, cursor=cursor, sums_per_process=[p["sums"] for p in per_process],
        rng_states=[p["rng"] for p in per_process], config=trainer._config_record,
    )
    if trainer.grad_scaler is not None:  # its scale and growth count (a read of one number)
        meta["grad_scaler"] = trainer.grad_scaler.state_dict()
    root = trainer.run_dir / "checkpoints"
    if st.sharded_state:
        # Every process writes its own part; nothing is gathered onto one of them.
        meta["model_aliases"] = distinct_weights(st.unwrap(trainer.model))[1]  # for `xlatrain export`
        with rt.planned_transfers():
            path = write_sharded_checkpoint(
                root, cursor.global_step, meta,
                lambda directory: sharded_extra(st.save_sharded(directory, trainer.model, trainer.optimizer)), st,
                upload_part=remote.push_part if remote is not None else None,
            )
    else:
        # Every process reads the state (a read on some processes only stalls a TorchTPU
        # mesh); the main one writes it.
        tensors, whole = pack_whole(st.unwrap(trainer.model), trainer.optimizer, rt.read)
        if not st.is_main:
            return None
        path = write_checkpoint(root, cursor.global_step, tensors, {**meta, **whole})
    if cursor.epoch_done and cursor.best_epoch == cursor.epoch:
        cursor.best_checkpoint = path.name
    if st.is_main:
        prune_checkpoints(root, trainer.checkpoint.keep_last, keep={cursor.best_checkpoint} - {None})
        if remote is not None:  # complete here: up it goes, then the files it goes with
            from xlatrain.storage.dcp import shard_file

            parts = tuple(f"{SHARDS_DIR}/{shard_file(i)}" for i in range(st.num_processes)) if st.sharded_state else ()
            remote.push_checkpoint(path, already_up=parts)  # the parts went up from their writers
            remote.push_files()
    # Where a kill -9 from here on leaves the run (what a rerun continues at), until the next one.
    epoch, step = cursor.next_position()
    trainer._dir.write_status("running", epoch=epoch, step=step, checkpoint=path.name)
    return path


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm became NaN/Inf under ``nan_policy="stop"``."""


def nonfinite_error(precision: str, epoch: int, first: int, last: int, count: int, run_dir: Path,
                    processes: int = 1) -> NonFiniteLossError:
    """What stops a run whose loss went NaN/Inf in ``count`` steps between ``first`` and ``last``
    (on ``processes`` processes: ``count`` losses, each process's at each step counted)."""
    latest = latest_name(run_dir / "checkpoints")
    times = f"in {count} step(s)" if processes == 1 else \
        f"{count} time(s) over {processes} processes (each process's loss at each step counted)"
    if precision == "fp16":
        # Under fp16 the gradient scaler guards the backward pass; a non-finite loss comes from the
        # forward pass: float16 overflowing, or inputs that hold NaN/Inf (the code cannot tell which).
        return NonFiniteLossError(
            f"the loss was NaN/Inf {times} between steps {first} and {last} of epoch {epoch} under "
            "precision='fp16': the forward pass made it, for example by overflowing float16 (its largest value is "
            "65504; the gradient scaler guards only the backward), from inputs that hold NaN/Inf, or in the loss "
            "itself (a batch whose targets are all ignore_index, a ratio with no epsilon). Check the inputs; "
            "for an overflow, use precision='bf16', which has float32's range, where the device has it (A100, L4, "
            "H100 and later; TPUs; CPUs), or precision='32'; nan_policy='skip_step' skips such steps. Nothing after "
            f"the last good checkpoint was saved (latest: {latest or 'none'})."
        )
    return NonFiniteLossError(
        f"the loss or gradient norm was NaN/Inf {times} between steps {first} and "
        f"{last} of epoch {epoch}; nothing after the last good checkpoint was saved "
        f"(latest: {latest or 'none'}). Lower the learning rate, set clip_grad_norm, check the "
        "inputs, or set nan_policy='skip_step'."
    )


def step_schedule(scheduler: Any, *, quiet: bool, monitored: float | None = None) -> None:
    """``scheduler.step()`` at an epoch's end (ReduceLROnPlateau: ``step(monitored)``, the epoch's
    monitored value; none where the row lacks it, which the epoch's end then refuses). ``quiet``:
    this fit ran none of the epoch's steps (it resumed at the last), and torch would warn that the
    schedule stepped before the optimizer and will skip its first value: untrue here, where the
    optimizer stepped before the checkpoint, in the process that wrote it."""
    with warnings.catch_warnings():
        if quiet:
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            if monitored is not None:
                scheduler.step(monitored)
        else:
            scheduler.step()


def preempt(trainer: Trainer, cursor: Cursor, sums: dict[str, torch.Tensor], stop: StopSignals) -> NoReturn:
    """A stop was asked for (on this process or a peer): checkpoint this step, then exit."""
    path = save_checkpoint(trainer, cursor, sums) if trainer.checkpoint.enabled else None
    if trainer.strategy.is_main:
        write_history(trainer.run_dir, trainer.history)
    name = signal.Signals(stop.signum).name if stop.signum else "a stop requested on another process"
    # With checkpoints off nothing can continue: "stopped", so that a requeue on "preempted" does not
    # start the run over from its first step.
    trainer._dir.write_status("preempted" if trainer.checkpoint.enabled else "stopped", signal=name,
                              checkpoint=path.name if path else None, epoch=cursor.epoch, step=cursor.step)
    trainer.strategy.barrier()
    # A process that was not signalled stops because a peer was: every process stops at this
    # same step, and only a Ctrl-C (SIGINT) of this process makes its exit code non-zero.
    trainer._say(f"{name}: stopped after epoch {cursor.epoch} step {cursor.step}" + _how_to_resume(trainer, path))
    raise SystemExit(128 + stop.signum if stop.signum not in (None, signal.SIGTERM) else 0)


def _how_to_resume(trainer: Trainer, path: Path | None) -> str:
    if not trainer.checkpoint.enabled:
        return " without a checkpoint (checkpoints are off): this run cannot be resumed."
    saved = f"; checkpoint {path}" if path else ""  # the main process names it
    resume = trainer._dir.resume
    # resume=RUN_DIR (--resume RUN_DIR) takes the run's newest checkpoint, as 'auto' does.
    if resume == "auto":
        return f"{saved}. Run the same command again to resume (resume='auto')."
    named = isinstance(resume, (str, os.PathLike)) and resume != "overwrite"
    if named and Path(resume).resolve() == trainer.run_dir.resolve():
        return f"{saved}. Run the same command again to resume."
    # The same command again would clear this run (--overwrite), start another beside it
    # (--fresh), or go back to the checkpoint it named (--resume PATH).
    return (f"{saved}. To resume, run with resume='auto' and the run directory {trainer.run_location} (on the "
            "command line: without --fresh, --overwrite or --resume, naming that directory); the same command "
            "again would not continue this run.")


def explicit_checkpoint(path: Path, group: Any) -> tuple[Path, dict[str, torch.Tensor] | None, dict[str, Any]]:
    """The checkpoint ``resume=PATH`` names: a checkpoint directory, or a run directory (its
    newest checkpoint that verifies)."""
    if not path.exists():
        raise run_lock.RunDirError(
            f"resume={str(path)!r}: no such file or directory. Give a checkpoint (RUN_DIR/checkpoints/step-NNNNNNNN) "
            "or a run directory"
        )
    if (path / "checkpoints").is_dir() and not (path / "meta.json").exists():
        damaged: list[str] = []
        found = find_resumable(path / "checkpoints", group=group, failures=damaged)
        if found is None:
            raise run_lock.RunDirError(
                f"resume={str(path)!r}: this run directory holds no checkpoint that loads"
                + (f" ({'; '.join(damaged)})" if damaged else "")
            )
        return found
    if not (path / "meta.json").exists():
        raise run_lock.RunDirError(
            f"resume={str(path)!r} is not a checkpoint (no meta.json in it): give a checkpoint directory "
            "(RUN_DIR/checkpoints/step-NNNNNNNN) or a run directory"
        )
    try:
        tensors, meta = read_checkpoint(path)
    except CheckpointError as exc:
        older = [p.name for p in list_checkpoints(path.parent) if p.name < path.name] if path.parent.name == "checkpoints" else []
        raise CheckpointError(
            f"resume={str(path)!r}: {exc}. Nothing was changed. To go on: resume from "
            + (f"an older checkpoint (--resume {path.parent / older[-1]}; this run directory holds "
               f"{', '.join(older)}), " if older else "")
            + f"the run directory (--resume {path.parent.parent if path.parent.name == 'checkpoints' else path.parent}: "
            "its newest checkpoint that loads), or start fresh (--fresh; fit(resume=False))"
        ) from None
    return path, tensors, meta


def resharded_sums(per_process: list[dict[str, float]], index: int, count: int, *, alike: bool = False) -> dict[str, float]:
    """This process's share of running sums saved by another number of processes: every process
    starts from the saved mean (so the mean over processes is unchanged) and process 0 carries the
    non-finite count, a total over processes; with ``alike`` (``skip_step``, whose steps are skipped
    on every process alike, so each holds the same count) every process carries the saved mean."""
    names = per_process[0].keys()
    out = {k: sum(p[k] for p in per_process) / len(per_process) for k in names}
    if not alike:
        out["nonfinite"] = sum(p["nonfinite"] for p in per_process) if index == 0 else 0.0
    return out


def counted_as(per_process: list[dict[str, float]], was: str, now: str) -> list[dict[str, float]]:
    """Running sums saved under nan_policy ``was``, counted as ``now`` counts them. The steps
    skip_step skipped are in its non-finite count and in no loss sum: under skip_step they stay
    there; under stop and ignore they are kept apart as ``skipped`` (the same on every process), so
    that stop takes only new non-finite steps for a fault and the means leave the skipped ones out."""
    # (skipped, other non-finite) of each process
    split = [(p["nonfinite"], 0.0) if was == "skip_step" else (p.get("skipped", 0.0), p["nonfinite"]) for p in per_process]
    apart = now != "skip_step" and any(skipped for skipped, _ in split)  # every process alike, or none
    out = []
    for p, (skipped, other) in zip(per_process, split):
        sums = {k: v for k, v in p.items() if k != "skipped"}
        sums["nonfinite"] = skipped + other if now == "skip_step" else other
        out.append({**sums, "skipped": skipped} if apart else sums)
    return out


DUPLICATE_S = 1.0  # a second stop signal this soon after the first is the same one delivered twice


class StopSignals:
    """SIGTERM / SIGINT ask the loop to stop after the current step; a second one exits at once
    (one within a second of the first is taken for the same request delivered twice).

    Only the main thread can install handlers; elsewhere (e.g. a notebook's worker thread) the
    run keeps Python's defaults.
    """

    def __init__(self, say: Callable[[str], None], *, saves: bool = True) -> None:
        self.signum: int | None = None
        self._at = 0.0
        self._previous: dict[int, Any] = {}
        self._say = say
        self._saves = saves  # checkpoints are on

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            if time.monotonic() - self._at < DUPLICATE_S:
                # The same request twice: a launcher forwarded what the process group also got
                # (torchrun turns a Ctrl-C's SIGINT into a SIGTERM to each worker).
                return
            # At once, and with this process's workers (data loading, shard decoding): they ignore
            # the signal, and one left behind would hold the terminal or the launcher's pipe.
            for child in multiprocessing.active_children():
                child.kill()
            os._exit(128 + signum)  # files are written atomically: nothing is left torn
        self.signum, self._at = signum, time.monotonic()
        name = signal.Signals(signum).name
        then = "saving a checkpoint" if self._saves else "stopping (checkpoints are off: the run cannot resume)"
        self._say(f"{name}: finishing this step (or validation batch), then {then}; a second {name} stops at once")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
