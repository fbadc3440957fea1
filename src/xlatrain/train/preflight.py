"""Before the first step: a dry run on one batch of each set, and the plan of what a device needs
and computes. Whatever cannot work fails here, with its cause, and not after an epoch."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from xlatrain.backend.base import host_rng_state, set_host_rng_state
from xlatrain.backend.model_state import weight_bytes
from xlatrain.backend.precision import Precision
from xlatrain.train import perf
from xlatrain.train.batch import collate, tree_map
from xlatrain.train.checks import (
    check_class_outputs,
    check_class_targets,
    check_task,
    refuse_broadcast_loss,
    shapes,
)
from xlatrain.train.feed import first_batch
from xlatrain.train.losses import EvalLoss, loss_terms
from xlatrain.train.metrics import as_float

if TYPE_CHECKING:
    from xlatrain.train.trainer import Trainer


class DoesNotFitError(ValueError):
    """The run needs more memory per device than the device holds: refused before its first step,
    with the changes that would fit."""


def to_device(trainer: Trainer, host_batch: Any) -> Any:
    device = trainer.runtime.device
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, host_batch)


def dry_run(trainer: Trainer, train_data: Any | None, val_data: Any | None) -> None:
    """Run the model and loss on one batch before any training, so a batch layout, a loss or a
    task metric that cannot work fails now, with its cause, and not after an epoch.

    The model runs in eval mode without gradients and host random state is put back, so the
    run's numbers are what they would be without it. On XLA nothing executes: the shapes are
    traced only and the traced graph is dropped.
    """
    model, loss_fn = trainer.model, trainer.loss_fn
    was_training = model.training
    host_rng = host_rng_state()
    role, batch = "training", None
    try:
        model.eval()
        with torch.no_grad():
            for role, data in (("training", train_data), ("validation", val_data)):
                if data is None:
                    continue
                host_batch = first_batch(data, collate_fn=trainer._collate if role == "training" else collate)
                batch = to_device(trainer, host_batch)
                args, targets = trainer.layout.split(trainer._on_device(batch))
                check_class_targets(loss_fn, trainer.layout.split(host_batch)[1])
                with trainer.precision.autocast():
                    outputs = model(*args)
                    check_class_outputs(loss_fn, outputs, trainer.layout.split(host_batch)[1])
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        result = loss_fn(outputs, targets)
                refuse_broadcast_loss(caught, loss_fn)
                _, terms = loss_terms(result)
                if role == "training":
                    trainer._term_names = list(terms)
                if role == "validation" or trainer._eval_loss is None:
                    trainer._eval_loss = EvalLoss.choose(loss_fn, as_float(outputs), targets)
                if role == "validation":
                    check_task(trainer.task, outputs, targets, trainer.config.top_k)
    except ValueError as exc:
        raise ValueError(f"a dry run on one {role} batch, before training: {exc}") from None
    except Exception as exc:  # the user's model or loss failed: keep its own error, say where
        if hasattr(exc, "add_note"):
            exc.add_note(
                f"xlatrain: raised in a dry run on one {role} batch, before training: loss_fn "
                f"{loss_fn!r}, model {type(trainer.strategy.unwrap(model)).__name__}, batch {shapes(batch)}"
            )
        raise
    finally:
        set_host_rng_state(host_rng)
        model.train(was_training)
    if train_data is not None:
        check_monitor(trainer, val_data)


def plan(trainer: Trainer, train_data: Any) -> tuple[perf.MemoryPlan, perf.Throughput]:
    """Measure what one training step needs of a device and what it computes, before the first
    step (:mod:`xlatrain.train.perf`); refuse a run that cannot fit, naming what would."""
    cfg, rt, st = trainer.config, trainer.runtime, trainer.strategy
    module = st.unwrap(trainer.model)  # DDP's inner module: no gradient reduction is set up
    samples = min(len(train_data), perf.PROFILE_SAMPLES)
    flops, flops_source, tokens = perf.model_flops(module)

    def loss_of(precision: Precision) -> Callable[[int], torch.Tensor]:
        def run(n: int) -> torch.Tensor:
            host = first_batch(train_data, rows=n, collate_fn=trainer._collate)
            args, targets = trainer.layout.split(trainer._on_device(to_device(trainer, host)))
            with precision.autocast():
                return loss_terms(trainer.loss_fn(module(*args), targets))[0]
        return run

    # Random draws of the measured step (dropout, augmentations; host and device) are undone.
    rng = rt.rng_state()
    try:
        profile = perf.profile_step(module, st.unit_modules, rt.device.type, loss_of(trainer.precision), samples,
                                    count=flops is None)
    except Exception as exc:  # the user's model or loss failed with gradients on: say where
        if hasattr(exc, "add_note"):
            exc.add_note(
                f"xlatrain: raised while measuring one training step before training (forward pass with "
                f"gradients{'' if flops else ' and backward pass'} on {samples} sample(s), model "
                f"{type(module).__name__}, loss_fn {trainer.loss_fn!r})"
            )
        raise
    finally:
        rt.set_rng_state(rng)
    if flops is None:
        flops = profile.flops_per_sample
        flops_source = "torch's FLOP counter, one forward and backward pass" if flops else \
            "torch's FLOP counter found no matmul or convolution in the step"
    # The matmul dtype the precision runs at: fp16's yardstick is the device's float16 peak.
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision, torch.float32)
    peak = rt.peak_flops(compute)
    throughput = perf.Throughput(
        flops_per_sample=flops, flops_source=flops_source, tokens_per_sample=tokens,
        peak_per_device=peak[0] if peak else None, peak_source=peak[1] if peak else "not in xlatrain's table",
        devices=st.world_size, dtype=str(compute).removeprefix("torch."),
    )
    state = st.planned_state_bytes(trainer.model, trainer.optimizer)
    if trainer.ema is not None and not trainer.ema.pairs():  # the averages: one more copy of the weights
        state = {**state, "optimizer": state["optimizer"] + state["parameters"]}
    capacity = trainer.backend.device_memory or rt.memory_capacity()
    memory = perf.MemoryPlan(
        parameters=state["parameters"], gradients=state["gradients"], optimizer=state["optimizer"],
        optimizer_source=state["optimizer_source"], activations=profile.activations, batch=cfg.batch_size,
        checkpointed=st.activation_checkpointing, gathered=st.gathered_bytes(trainer.model, trainer.precision),
        capacity=capacity[0] if capacity else None,
        capacity_source=capacity[1] if capacity else "the runtime reports no capacity",
    )
    if not st.any_process(memory.fits is False):
        if memory.capacity is not None and memory.total > perf.HEADROOM * memory.capacity:
            trainer._say(
                f"memory: the estimate before the first step is {100 * memory.total / memory.capacity:.0f}% of what a "
                f"device holds ({memory.summary()}); the step's peak is higher, so it may not fit"
            )
        return memory, throughput
    bf16 = None
    if cfg.precision != "bf16":
        bf16 = perf.profile_step(module, st.unit_modules, rt.device.type, loss_of(Precision("bf16", rt.autocast_device)),
                                 samples, count=False).activations
    units = st.unit_modules
    whole = weight_bytes(module)
    memory.fixes = perf.plan_fixes(
        memory, whole_state=int((memory.parameters + memory.gradients + memory.optimizer) * whole / max(memory.parameters, 1)),
        world_size=st.world_size, sharded=st.sharded_state, precision=cfg.precision, bf16_activations=bf16,
        unit_bytes=max((weight_bytes(u) for u in units), default=0),
        root_bytes=whole - sum(weight_bytes(u) for u in units), grad_accum_steps=cfg.grad_accum_steps,
    )
    raise DoesNotFitError(memory.refusal())


def check_monitor(trainer: Trainer, val_data: Any | None) -> None:
    """``monitor`` must name a column this run's history will have: known after the dry run
    (the loss's terms, the task's metrics), checked before the first step."""
    cfg = trainer.config
    prefixes = ["train_"] + (["val_"] if val_data is not None else [])
    columns = {f"{p}{t}" for p in prefixes for t in ("loss", *trainer._term_names)}
    if val_data is not None and trainer.task == "classification":
        columns |= {"val_accuracy", *(f"val_top{k}_accuracy" for k in cfg.top_k)}
    if val_data is not None and trainer.task == "multilabel":
        columns.add("val_mean_auc")
        columns |= {f"val_auc_{name}" for name in trainer.label_names or ()}
    if cfg.ema_decay is not None:  # the EMA weights are scored as the live ones are
        columns |= {"val_ema_" + c.removeprefix("val_") for c in columns if c.startswith("val_")}
    columns |= {"lr", "epoch_time_s"} | ({"input_bound_share"} if cfg.diagnostics else set())
    monitor = trainer.monitor
    unknowable = val_data is not None and (
        (trainer.metrics_fn is not None and monitor.startswith("val_"))
        or (trainer.task == "multilabel" and trainer.label_names is None
            and monitor.startswith(("val_auc_", "val_ema_auc_")))
    )
    if monitor not in columns and not unknowable:
        raise ValueError(
            f"monitor={monitor!r} is not a column this run's history will have; it will have "
            f"{', '.join(sorted(columns))}"
            + ("" if val_data is not None else " (no validation data was given, so no val_ columns)")
            + ". Set monitor (trainer.monitor) to one of them, with monitor_mode for a name of your own"
        )


def report_peak(trainer: Trainer) -> None:
    """After the first epoch: the most memory a device held, beside the estimate."""
    peak = trainer.runtime.memory_peak()
    if peak is None or trainer.memory_plan is None:
        return
    trainer.memory_plan.measured_peak = peak
    trainer._say(
        f"memory per device: measured peak {perf.human_bytes(peak[0])} ({peak[1]}) beside the estimate "
        f"{perf.human_bytes(trainer.memory_plan.total)} before the first step"
    )
