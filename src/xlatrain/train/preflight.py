"""Before the first step: a dry run on one batch of each set, and the plan of what a device needs
and computes. Whatever cannot work fails here, with its cause, and not after an epoch."""

from __future__ import annotations

import contextlib
import difflib
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from xlatrain.backend.base import host_rng_state, set_host_rng_state
from xlatrain.backend.model_state import optimizer_state_bytes, weight_bytes
from xlatrain.backend.precision import Precision
from xlatrain.train import perf
from xlatrain.train.batch import tree_flatten, tree_map
from xlatrain.data.source import BatchSource
from xlatrain.train.checks import (
    check_bce_targets,
    check_class_outputs,
    error_hints,
    check_class_targets,
    check_task,
    PairwiseWatch,
    refuse_broadcast_loss,
    shapes,
)
from xlatrain.data.sampling import EvalSampler
from xlatrain.train.feed import first_batch, loader_layout
from xlatrain.train.losses import EvalLoss
from xlatrain.train.metrics import (
    as_float, check_gatherable, default_monitor, is_streaming, metric_numbers, task_from_shapes, without_caches,
)
from xlatrain.train.model_io import no_grad_message, own_loss_terms

# The Trainer (train/trainer.py) calls these functions with itself; named here without an import,
# so that this module does not import the one that imports it.
Trainer = Any


class DoesNotFitError(ValueError):
    """The run needs more memory per device than the device holds: refused before its first step,
    with the changes that would fit. ``plan`` holds the figures (as ``trainer.memory_plan`` does)."""

    def __init__(self, message: str, plan: perf.MemoryPlan | None = None) -> None:
        super().__init__(message)
        self.plan = plan


def to_device(trainer: Trainer, host_batch: Any) -> Any:
    device = trainer.runtime.device
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, host_batch)


def prepare(trainer: Trainer, train_data: Any, val_data: Any | None) -> tuple[perf.MemoryPlan, perf.Throughput]:
    """Everything before the first step that runs the model: one training batch as the step runs it
    (train mode, gradients on) serves the dry run, the FLOP count and the activation measurement;
    one validation batch goes through evaluation's own path, gathers included. Random state,
    batch-norm statistics and gradients are put back, so the run's numbers are what they would be
    without it. Returns the memory plan and the throughput yardstick."""
    rt, st = trainer.runtime, trainer.strategy
    # The state as the strategy holds it between steps, taken before any forward pass (FSDP keeps
    # its root's weights gathered after one until the backward).
    state = st.planned_state_bytes(trainer.model, trainer.optimizer)
    gathered = st.gathered_bytes(trainer.model, trainer.precision)
    rng, host_rng = rt.rng_state(), host_rng_state()
    names = None  # what metrics_fn returns, from this fit's own validation batch
    trainer._unused_parameters = []  # found again by this fit's dry run (DDP's reducer is told of them)
    try:
        profile, flops, flops_source, tokens, counted = _training_batch(trainer, train_data)
        if val_data is not None:
            names = _validation_batch(trainer, val_data)
    finally:
        rt.set_rng_state(rng)
        set_host_rng_state(host_rng)
    check_monitor(trainer, val_data, names)
    _note_unused_label_names(trainer)
    return plan(trainer, train_data, profile, flops, flops_source, tokens, state, gathered, counted)


def _note_unused_label_names(trainer: Trainer) -> None:
    """``label_names`` name a multilabel task's per-label AUC columns: under another task, say
    that they name nothing rather than drop them silently."""
    if trainer.label_names is not None and trainer.task != "multilabel":
        trainer._say(
            f"note: label_names ({', '.join(map(str, trainer.label_names[:4]))}{', ...' if len(trainer.label_names) > 4 else ''}) "
            f"name a multilabel task's per-label AUC columns (val_auc_<name>); this run's task is {trainer.task!r}, "
            "so they name no column. Set task='multilabel' (trainer.task) if the outputs are independent labels"
        )


def dry_run(trainer: Trainer, train_data: Any | None, val_data: Any | None) -> None:
    """``evaluate`` before any fit: one batch of ``val_data`` through evaluation's path."""
    assert train_data is None
    rt = trainer.runtime
    rng, host_rng = rt.rng_state(), host_rng_state()
    try:
        _validation_batch(trainer, val_data)
    finally:
        rt.set_rng_state(rng)
        set_host_rng_state(host_rng)


def _training_batch(trainer: Trainer, train_data: Any) -> tuple[perf.StepProfile, float | None, str, int | None,
                                                                tuple[float, bool] | None]:
    """The dry run (see :func:`prepare`): its profile, the model FLOPs per sample and their source,
    the model's own tokens per sample, and, for a batch in the Hugging Face layout where the model
    gives no tokens per sample, its ``input_ids`` positions per row and whether the FLOPs were
    counted on them (:func:`perf.tokens_per_row`)."""
    rt, st, io = trainer.runtime, trainer.strategy, trainer.io
    module = st.unwrap(trainer.model)  # DDP's inner module: no gradient reduction is set up
    samples = min(len(train_data), perf.PROFILE_SAMPLES)
    flops, flops_source, tokens = perf.model_flops(module)
    checked: list[bool] = []
    batch: Any = None

    def loss_of(precision: Precision, check: bool) -> Callable[[int], torch.Tensor]:
        def run(n: int) -> torch.Tensor:
            nonlocal batch
            host = first_batch(train_data, rows=n, collate_fn=trainer._collate)
            batch = trainer._on_device(to_device(trainer, host), training=True)
            targets = io.targets_of(batch)
            first = check and not checked  # the first (smaller) batch the measurement runs
            if first:
                note = io.check_keys(batch)
                if note:
                    trainer._say(note)
                if not io.own_loss:
                    check_class_targets(trainer.loss_fn, targets)  # dtypes only: no device read
            with precision.autocast():
                outputs = io.call(module, batch)
                if first and not io.own_loss:
                    check_class_outputs(trainer.loss_fn, io.field(outputs), io.targets_of(host))
                    check_bce_targets(trainer.loss_fn, io.field(outputs), targets)
                watch = PairwiseWatch(io.field(outputs), targets) if first and not io.own_loss else None
                with warnings.catch_warnings(record=True) as caught, watch or contextlib.nullcontext():
                    warnings.simplefilter("always")
                    loss, terms = io.loss(outputs, targets)
            if first:
                refuse_broadcast_loss(caught, trainer.loss_fn)
                if watch is not None and (note := watch.note(trainer.loss_fn)):
                    trainer._say(note)
                if not loss.requires_grad:
                    raise ValueError(no_grad_message(trainer.loss_fn))
                trainer._term_names = list(terms)
                if trainer.task == "auto":
                    trainer.task = task_from_shapes(io.predictions(outputs), targets, module)
                checked.append(True)
            return loss
        return run

    # Under DDP over several processes the pass includes its backward (counting the FLOPs too):
    # which trainable parameters no gradient reaches is known only after one.
    finds_unused = st.checks_unused_parameters

    def profile(measure: Any = None) -> perf.StepProfile:
        return perf.profile_step(module, st.unit_modules, rt.device.type, loss_of(trainer.precision, True),
                                 trainer.config.batch_size if measure else samples,
                                 count=flops is None or (finds_unused and measure is None), measure=measure)

    measures = _measures(trainer, train_data)
    reached = _GradientsReached(module) if finds_unused else None
    try:
        if measures:
            # One forward and backward at the real batch is the dry run, the FLOP count, the
            # activations and the measured memory (the device's own peak) at once; where it does
            # not fit, the estimate on a few samples decides, with its refusal.
            step = profile(rt.step_memory)
            if step.step_peak is None:
                step = profile()
        else:
            try:
                step = profile()
            except ValueError:
                raise
            except Exception:
                if trainer.config.batch_size <= samples:
                    raise
                # A model written for its batch size (a reshape to it) fails on a few rows: the
                # real batch, which every training step has, decides (and what it raises is the
                # step's own error). Its activations are counted at that batch.
                step = profile(lambda run: run())
    except ValueError as exc:
        raise ValueError(f"a dry run on one training batch, before training: {exc}") from None
    except Exception as exc:  # the user's model or loss failed: keep its own error, say where
        if hasattr(exc, "add_note"):
            for hint in error_hints(exc, trainer):
                exc.add_note(hint)
            exc.add_note(
                f"xlatrain: raised in a dry run on one training batch, before training: {_who(trainer)}, batch "
                f"{shapes(batch)} (a forward pass in train mode with gradients"
                f"{'' if flops and not measures else ' and its backward'}, "
                "as the step runs it)"
            )
        raise
    finally:
        if reached is not None:
            reached.remove()
    if reached is not None:
        # Every process's finding together: DDP is wrapped anew on all of them, or on none.
        trainer._unused_parameters = sorted({n for found in st.gather_objects(reached.missed()) for n in found})
    row_tokens = perf.tokens_per_row(batch) if tokens is None else None
    counted = (row_tokens, flops is None) if row_tokens else None  # the FLOP counter runs on this batch
    if flops is None:
        flops = step.flops_per_sample
        flops_source = "torch's FLOP counter, one forward and backward pass" if flops else \
            "torch's FLOP counter found no matmul or convolution in the step"
    trainer._loss_of = loss_of  # the memory plan's bf16 measurement reuses it
    return step, flops, flops_source, tokens, counted


class _GradientsReached:
    """Which of ``module``'s trainable parameters a backward gave a gradient, by a hook on each
    (the dry run drops the gradients themselves again)."""

    def __init__(self, module: torch.nn.Module) -> None:
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))  # DDP never waits for these
        self.names = {p: n for n, p in module.named_parameters() if p.requires_grad and n not in ignored}
        self.seen: set[torch.nn.Parameter] = set()
        self.hooks = [p.register_post_accumulate_grad_hook(self.seen.add) for p in self.names]

    def missed(self) -> list[str]:
        return [n for p, n in self.names.items() if p not in self.seen]

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def _measures(trainer: Trainer, train_data: Any) -> bool:
    """The dry run is one measured pass at the real batch: where the runtime measures a step's
    memory (CUDA), the set holds a batch, no unit recomputes its activations (the profile counts
    them all, which a checkpointed step does not keep), and the model's forward is no collective
    (FSDP gathers weights: a pass that runs out of memory in one process must not be followed by
    a pass the others do not run)."""
    st = trainer.strategy
    return (trainer.runtime.measures_step_memory and len(train_data) >= trainer.config.batch_size
            and not st.activation_checkpointing and not st.sharded_state)


def _validation_batch(trainer: Trainer, val_data: Any) -> list[str] | None:
    """One validation batch: the eval loss chosen from its outputs, the task's metrics checked,
    then the first rows of the set through ``evaluate``'s own path (padding, gathers, the loss and
    metrics' reduction), so what would fail after an epoch fails now. Returns the names a
    ``metrics_fn`` function returned on those rows (``None``: none known)."""
    io, model = trainer.io, trainer.model
    was_training = model.training
    batch, rows = None, 2
    try:
        model.eval()
        with torch.no_grad():
            full = trainer.config.eval_batch_size or trainer.config.batch_size
            for rows in (2, full):
                # The full batch as evaluation runs it: a set smaller than one is padded with copies.
                host = first_batch(val_data, rows=rows, collate_fn=trainer._eval_collate, pad=rows == full)
                batch = trainer._on_device(to_device(trainer, host), training=False)
                io.check_keys(batch)
                targets = io.targets_of(batch)
                try:
                    with trainer.precision.autocast():
                        outputs = io.call(model, batch)
                    break
                except ValueError:
                    raise
                except Exception:
                    # A model written for its batch size fails on 2 rows; evaluation pads every
                    # batch to the full size, so that decides (as in the training dry run).
                    if rows >= full:
                        raise
            if rows != 2 and io.own_loss:
                _check_trimmed_batches(trainer, val_data)
            predictions = io.predictions(outputs)
            check_gatherable(trainer.metrics_fn, trainer.strategy.num_processes, predictions, targets)
            trainer._eval_loss = _eval_loss(trainer, outputs, predictions, targets)
            if trainer._eval_loss.note:
                trainer._say(trainer._eval_loss.note)
            if trainer._eval_loss.mode == "whole_set" and (note := _whole_set_note(trainer, outputs, targets, val_data)):
                trainer._say(note)
            if trainer.task == "auto":
                trainer.task = task_from_shapes(predictions, targets, trainer.strategy.unwrap(model))
            if trainer.task != "none" or trainer.config.top_k:
                check_task(trainer.task, as_float(predictions), targets, trainer.config.top_k,
                           task_given=trainer.config.task != "auto")
        if not isinstance(val_data, BatchSource):
            # A streaming metric is not fed these rows (it would keep them). A metrics_fn function
            # is called on them for the names it returns, which the monitor is checked against; two
            # rows may not be enough for it, so what it raises or warns is not the run's.
            probe = None if trainer.metrics_fn is None or is_streaming(trainer.metrics_fn) else _NamesOf(trainer.metrics_fn)
            batch = None  # what fails from here failed in evaluation's own path, on these rows
            # The rows the model took above, on every process (each process's block of the set's first
            # global batch): a model written for its batch size gets a full batch on each.
            trainer._evaluate(_Head(val_data, rows * trainer.strategy.num_processes), probe, forward=model)
            return probe.names if probe is not None else None
        return None
    except ValueError as exc:
        raise ValueError(f"a dry run on one validation batch, before training: {exc}") from None
    except Exception as exc:
        if hasattr(exc, "add_note"):
            what = f"batch {shapes(batch)}" if batch is not None else \
                f"the set's first {min(rows, len(val_data))} row(s) through evaluate's own path"
            exc.add_note(f"xlatrain: raised in a dry run on one validation batch, before training: {_who(trainer)}, "
                         f"{what} (eval mode, as evaluation runs it)")
        raise
    finally:
        model.train(was_training)


def _check_trimmed_batches(trainer: Trainer, val_data: Any) -> None:
    """A model that failed on 2 rows and took a full batch, scored on its own loss: evaluation cuts
    the padding rows off a last, partial batch (the loss cannot leave them out), so each such size
    is tried now, where it failed after the first epoch had trained. Every process tries the sizes
    of all (a sharded model's forward is a collective)."""
    st = trainer.strategy
    layout = loader_layout(st, trainer.config.eval_batch_size or trainer.config.batch_size)
    full, sampler = layout["loader_batch"], EvalSampler(len(val_data), **layout)
    counts = {c for p in range(st.num_processes) for c in sampler.valid_counts(p)}
    for rows in sorted({max(c, 1) for c in counts} - {full}):
        host = first_batch(val_data, rows=rows, collate_fn=trainer._eval_collate)
        batch = trainer._on_device(to_device(trainer, host), training=False)
        try:
            with trainer.precision.autocast():
                trainer.io.call(trainer.model, batch)
        except Exception as exc:
            real = "no real row (1 row is kept: every process runs the model)" if rows == 1 and 0 in counts else \
                f"{rows} real row(s)"
            raise ValueError(
                f"the model takes a full batch of {full} rows but failed on {rows} ({type(exc).__name__}: {exc}), and "
                f"the validation set of {len(val_data):,} samples ends with a batch of {real} on "
                f"{'a process' if st.num_processes > 1 else 'it'}. Under the model's own loss evaluation cannot "
                "keep padding rows (the loss would count them), so it cuts them. Pass a loss_fn (padding rows are "
                f"then left out of the loss on the device and every batch keeps {full} rows), or a validation set "
                f"whose length is a multiple of {full * st.num_processes}") from exc


# Host memory a whole-set loss may keep without a word: past it, the header says how much.
WHOLE_SET_SAID_BYTES = 1e9


def _whole_set_note(trainer: Trainer, outputs: Any, targets: Any, val_data: Any) -> str | None:
    """A loss with no per-sample form keeps every validation row's outputs and targets on the host
    to score the set at once (float32, as it scores them): said where that comes to a gigabyte or
    more, from the dry run's rows times the set's length (a language model's logits: rows x tokens
    x vocabulary, 130 GB for 1,000 x 1,024 x 32k)."""
    kept = (without_caches(trainer.io.field(outputs)), targets)  # what evaluation keeps of each row
    leaves = [t for t in tree_flatten(kept)[0] if isinstance(t, torch.Tensor)]
    rows = leaves[0].shape[0] if leaves and leaves[0].dim() else 0
    if not rows:
        return None
    total = sum(t.numel() * 4 for t in leaves) / rows * len(val_data)
    if total < WHOLE_SET_SAID_BYTES:
        return None
    return (f"note: the loss returns one number for a batch (no per-sample form), so evaluation keeps every "
            f"validation row's outputs and targets on the host to score the set at once: about "
            f"{perf.human_bytes(total)} for these {len(val_data):,} samples, after each epoch. A loss_fn that takes "
            "reduction= and returns per-sample values for reduction='none' is averaged on the device instead "
            "(or set output_field to the one output the loss reads)")


class _NamesOf:
    """A metrics_fn called for the names it returns, nothing else: ``names`` stays ``None`` where
    it raised; the columns it gives the dry run are none. What it prints is not held back."""

    def __init__(self, metrics_fn: Any) -> None:
        self.metrics_fn, self.names = metrics_fn, None

    def __repr__(self) -> str:  # evaluation's errors name the user's function
        return repr(self.metrics_fn)

    def __call__(self, outputs: Any, targets: Any) -> dict[str, float]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found = self.metrics_fn(outputs, targets)
        except Exception:  # noqa: BLE001 - two rows may be too few for it: the first validation will tell
            return {}
        if not isinstance(found, Mapping):
            return found  # not a mapping on any rows: evaluation's own error says so now, not after an epoch
        # A value that is no number on any rows (a string, several numbers) is said now, not after an
        # epoch; None may be a figure two rows cannot give (an AUC of one class), left to the set.
        metric_numbers(self.metrics_fn, {k: v for k, v in found.items() if v is not None})
        self.names = [str(k) for k in found]
        return {}


def _eval_loss(trainer: Trainer, outputs: Any, predictions: Any, targets: Any) -> EvalLoss:
    """How evaluation computes the loss: the validation loss function's per-sample form or over the
    whole set; the model's own (per batch, weighted by real rows); or none, for a model whose
    evaluation returns no loss (a detector's detections)."""
    loss_fn = trainer.val_loss_fn or trainer.loss_fn
    if loss_fn is not None:
        scored = as_float(trainer.io.field(outputs)) if trainer.val_loss_fn is None else as_float(predictions)
        return EvalLoss.choose(loss_fn, scored, targets)
    try:
        own_loss_terms(outputs)
    except ValueError:
        return EvalLoss(None, None)  # nothing to report: its metrics come from metrics_fn
    return EvalLoss(None, None, own=own_loss_terms)


def _who(trainer: Trainer) -> str:
    loss = "the model's own loss" if trainer.io.own_loss else f"loss_fn {trainer.loss_fn!r}"
    return f"{loss}, model {type(trainer.strategy.unwrap(trainer.model)).__name__}"


class _Head:
    """The first ``n`` items of a dataset."""

    def __init__(self, data: Any, n: int) -> None:
        self.data, self.n = data, min(n, len(data))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if index >= self.n:
            raise IndexError(index)
        return self.data[index]


def plan(trainer: Trainer, train_data: Any, profile: perf.StepProfile, flops: float | None, flops_source: str,
         tokens: int | None, state: dict[str, Any], gathered: int,
         counted: tuple[float, bool] | None = None) -> tuple[perf.MemoryPlan, perf.Throughput]:
    """What one training step needs of a device and what it computes, from the measured batch
    (:mod:`xlatrain.train.perf`); refuse a run that cannot fit, naming what would."""
    cfg, rt, st = trainer.config, trainer.runtime, trainer.strategy
    module = st.unwrap(trainer.model)
    samples = min(len(train_data), perf.PROFILE_SAMPLES)
    # The matmul dtype the precision runs at: fp16's yardstick is the device's float16 peak.
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision, torch.float32)
    peak = rt.peak_flops(compute)
    throughput = perf.Throughput(
        flops_per_sample=flops, flops_source=flops_source, tokens_per_sample=tokens,
        peak_per_device=peak[0] if peak else None, peak_source=peak[1] if peak else _no_peak(rt.device.type, compute),
        devices=st.world_size, dtype=str(compute).removeprefix("torch."),
        counts_input_ids=counted is not None, flops_at_tokens=counted[0] if counted and counted[1] and flops else None,
    )
    if trainer.ema is not None and not trainer.ema.pairs():  # the averages: one more copy of the weights
        state = {**state, "optimizer": state["optimizer"] + state["parameters"]}
    capacity = trainer.backend.device_memory or rt.memory_capacity()
    memory = perf.MemoryPlan(
        parameters=state["parameters"], gradients=state["gradients"], optimizer=state["optimizer"],
        optimizer_source=state["optimizer_source"], activations=profile.activations, batch=cfg.batch_size,
        checkpointed=st.activation_checkpointing, gathered=gathered,
        capacity=capacity[0] if capacity else None,
        capacity_source=capacity[1] if capacity else "the runtime reports no capacity",
    )
    measured = profile.step_peak if _measures(trainer, train_data) else _measured_step(trainer, train_data, module)
    if measured is not None:
        # A Trainer fitted before holds its optimizer's state already: the measured pass counted
        # it, and the plan adds the state (as the optimizer holds it) once.
        measured -= optimizer_state_bytes(trainer.optimizer, rt.device)
    memory.measured_step = measured
    if not st.any_process(memory.fits is False):
        if memory.capacity is not None and memory.total > perf.HEADROOM * memory.capacity:
            trainer._say(
                f"memory: the estimate before the first step is {100 * memory.total / memory.capacity:.0f}% of what a "
                f"device holds ({memory.summary()}); the step's peak is higher, so it may not fit"
            )
        return memory, throughput
    bf16 = None
    if cfg.precision != "bf16":
        rng, host_rng = rt.rng_state(), host_rng_state()
        try:
            bf16 = perf.profile_step(module, st.unit_modules, rt.device.type,
                                     trainer._loss_of(Precision("bf16", rt.autocast_device), False), samples,
                                     count=False).activations
        finally:
            rt.set_rng_state(rng)
            set_host_rng_state(host_rng)
    units = st.unit_modules
    whole = weight_bytes(module)
    memory.fixes = perf.plan_fixes(
        memory, whole_state=int((memory.parameters + memory.gradients + memory.optimizer) * whole / max(memory.parameters, 1)),
        world_size=st.world_size, sharded=st.sharded_state, precision=cfg.precision, bf16_activations=bf16,
        unit_bytes=max((weight_bytes(u) for u in units), default=0),
        root_bytes=whole - sum(weight_bytes(u) for u in units), grad_accum_steps=cfg.grad_accum_steps,
    )
    trainer.memory_plan = memory  # a caller that catches the refusal reads the figures
    raise DoesNotFitError(memory.refusal(), memory)


def _no_peak(device_type: str, dtype: torch.dtype) -> str:
    """Why a device has no peak FLOP/s to hold the run's rate against."""
    if device_type == "cpu" and dtype == torch.float16:
        return "not measured: a CPU has no fast float16 matmul, and timing one takes seconds"
    return "not in xlatrain's table"


def _measured_step(trainer: Trainer, train_data: Any, module: torch.nn.Module) -> int | None:
    """Where the runtime measures it (CUDA): the peak of one forward and backward at the real
    per-device batch, gradients dropped and random state put back; None elsewhere or when it does
    not fit (the estimate then decides, with its refusal)."""
    rt, cfg = trainer.runtime, trainer.config
    if len(train_data) < cfg.batch_size:
        return None

    def step() -> None:
        host = first_batch(train_data, rows=cfg.batch_size, collate_fn=trainer._collate)
        batch = trainer._on_device(to_device(trainer, host), training=True)
        with trainer.precision.autocast():
            loss, _ = trainer.io.loss(trainer.io.call(module, batch), trainer.io.targets_of(batch))
        loss.backward()

    grads = {p: p.grad for p in module.parameters()}
    buffers = [(m, n, b) for m in module.modules() for n, b in m._buffers.items() if b is not None]
    for m, n, b in buffers:
        m._buffers[n] = b.detach().clone()
    rng, host_rng = rt.rng_state(), host_rng_state()
    try:
        return rt.step_memory(step)
    finally:
        for p, g in grads.items():
            p.grad = g
        for m, n, b in buffers:
            m._buffers[n] = b
        rt.set_rng_state(rng)
        set_host_rng_state(host_rng)


def check_monitor(trainer: Trainer, val_data: Any | None, names: list[str] | None = None) -> None:
    """``monitor`` must name a column this run's history will have: known after the dry run
    (the loss's terms, the task's metrics, ``names`` that metrics_fn returned there), checked
    before the first step."""
    cfg = trainer.config
    if cfg.monitor is None:  # the task's default, now that the dry run told the task
        trainer.monitor, trainer.monitor_mode = default_monitor(trainer.task)
        if val_data is None and trainer.monitor.startswith("val_"):
            trainer.monitor, trainer.monitor_mode = "train_loss", "min"  # nothing validated to monitor
        elif trainer.monitor == "val_loss" and trainer._eval_loss is not None and trainer._eval_loss.mode == "none":
            trainer.monitor, trainer.monitor_mode = "train_loss", "min"
            trainer._say("note: the model returns no loss in evaluation (eval mode), so there is no val_loss: the best "
                         "weights follow train_loss. Set monitor (trainer.monitor) to a metric of metrics_fn's")
    columns = {f"train_{t}" for t in ("loss", *trainer._term_names)}
    if val_data is not None and (trainer._eval_loss is None or trainer._eval_loss.mode != "none"):
        columns |= {f"val_{t}" for t in ("loss", *trainer._term_names)}
    if val_data is not None and trainer.task == "classification":
        columns |= {"val_accuracy", *(f"val_top{k}_accuracy" for k in cfg.top_k if k > 1)}
        if trainer.monitor in ("val_top1_accuracy", "val_ema_top1_accuracy"):  # top-1 is accuracy
            trainer.monitor = trainer.monitor.replace("top1_accuracy", "accuracy")
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
    if names is not None:  # what metrics_fn returned on two validation rows
        returned = {f"val_{n}" for n in names}
        columns |= returned | ({"val_ema_" + c.removeprefix("val_") for c in returned} if cfg.ema_decay is not None else set())
    if monitor not in columns and unknowable:
        if names is not None:
            said = (f"{_did_you_mean(monitor, columns)}: metrics_fn returned {', '.join(sorted(names)) or 'no metric'} "
                    f"on two validation rows, so the columns known before training are {', '.join(sorted(columns))}")
        elif trainer.metrics_fn is not None and (is_streaming(trainer.metrics_fn) or isinstance(val_data, BatchSource)):
            said = " is to come from metrics_fn, which is not run before training here"
        elif trainer.metrics_fn is not None:  # it raised on two rows (an AUC needs both classes): nothing is amiss
            said = " is to come from metrics_fn, which gave no names on two validation rows (it raised there)"
        else:
            said = " is to be a label's AUC (val_auc_<index>: the labels are not named)"
        trainer._say(
            f"note: monitor={monitor!r}{said}; the history's columns are known once the first validation, after "
            "epoch 1, has run, and a monitor not among them stops the run there, with the epoch saved"
        )
    if monitor not in columns and not unknowable:
        raise ValueError(
            f"monitor={monitor!r} is not a column this run's history will have{_did_you_mean(monitor, columns)}; it "
            f"will have {', '.join(sorted(columns))}"
            + ("" if val_data is not None else " (no validation data was given, so no val_ columns)")
            + ". Set monitor (trainer.monitor) to one of them, with monitor_mode for a name of your own"
        )


def missing_monitor(trainer: Trainer, row: dict[str, Any], cursor: Any) -> ValueError:
    """The error for a monitor an epoch's history row lacks, raised once that epoch is written and
    checkpointed: where no best was recorded yet, the corrected monitor resumes from it."""
    monitor = trainer.monitor
    said = f"monitor={monitor!r} is not a history column; available: {', '.join(row)}{_did_you_mean(monitor, row)}"
    if not math.isnan(cursor.best):
        return ValueError(
            f"{said}. It was one in epoch {cursor.best_epoch} (the best so far): a metrics_fn that returns it "
            "every epoch lets the run go on")
    if not (trainer.checkpoint.enabled and trainer.checkpoint.at_epoch_end):
        return ValueError(f"{said}. Set monitor (trainer.monitor) to one of them; epoch {row['epoch']} is in the "
                          "history, but no checkpoint holds its end, so a rerun repeats what followed the last one")
    return ValueError(
        f"{said}. Epoch {row['epoch']} is written and checkpointed: set monitor (trainer.monitor) to one of them and "
        "resume (resume='auto'); no best was recorded under the old monitor, so the new one takes over from here")


def _did_you_mean(name: str, columns: Any) -> str:
    close = difflib.get_close_matches(name, list(columns), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def report_peak(trainer: Trainer) -> None:
    """After the first epoch: the most memory a device held, beside the estimate."""
    peak = trainer.runtime.memory_peak()
    if peak is None or trainer.memory_plan is None:
        return
    plan = trainer.memory_plan
    plan.measured_peak = peak
    if peak[1].startswith("the process's"):  # the CPU: everything the process holds, not a device's memory
        trainer._say(
            f"memory: the process's peak resident memory was {perf.human_bytes(peak[0])} (Python, torch, the data and "
            f"the model together); the model's own parameters, gradients, optimizer state and activations, as "
            f"planned before the first step, are {perf.human_bytes(plan.total)} of it"
        )
        return
    trainer._say(
        f"memory per device: measured peak {perf.human_bytes(peak[0])} ({peak[1]}) beside the plan "
        f"{perf.human_bytes(plan.total)} made before the first step"
    )
