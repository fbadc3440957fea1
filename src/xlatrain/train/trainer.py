"""Trainer: fit / evaluate / predict for one PyTorch model on any Backend.

The loop is written out in full in ``Trainer._fit``: one forward, one backward, one optimizer step
per global batch, with nothing read back to the host except through ``runtime.defer`` every
``log_every`` steps and ``runtime.read`` at epoch end, but for planned reads that a setting asks
for: fp16's gradient scaler, once per optimizer step, and ``skip_step`` where a step makes the
optimizer's state. What the device is, the runtime answers;
how the model is spread over devices, the strategy. Around the loop, each in a module of its own:
the argument checks (:mod:`~xlatrain.train.checks`), the run directory's bookkeeping
(:mod:`~xlatrain.train.run_dir`), the dry run and memory plan before the first step
(:mod:`~xlatrain.train.preflight`), the feed of batches (:mod:`~xlatrain.train.feed`), checkpoints,
resume and preemption (:mod:`~xlatrain.train.resumable`) and the weights' moving average
(:mod:`~xlatrain.train.ema`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from xlatrain.backend import Backend, from_config, select_backend
from xlatrain.backend.base import PLANNED_READ
from xlatrain.backend.model_state import fused_optimizer, guarded_step, has_meta_tensors
from xlatrain.backend.precision import Precision
from xlatrain.checkpoint import write_weights
from xlatrain.config import BackendConfig, CheckpointConfig, TrainConfig, monitor_mode_for
from xlatrain.data.source import BatchSource
from xlatrain.data.workers import fork_hang_note
from xlatrain.diagnostics.compile import CompileWatch
from xlatrain.diagnostics.profile import StepTrace
from xlatrain.diagnostics.run import RunDiagnostics
from xlatrain.logs import ensure_console, get_logger
from xlatrain.progress import IntervalMeter, WarmupClock, epoch_line, interactive_terminal
from xlatrain.report import write_history
from xlatrain.tensorboard import TensorBoardLog
from xlatrain.train import perf, preflight, resumable
from xlatrain.train.batch import collate, tree_map
from xlatrain.train.callbacks import Callbacks
from xlatrain.train.checks import check_arguments, check_dataset, check_pipeline_arguments, failure_status, in_step
from xlatrain.train.ema import EMA_KEY, EMA_WEIGHTS, WeightAverage, ema_summary, recomputed_batch_norm
from xlatrain.train.factories import ModelParameters, OptimizerFactory, RunShape, SchedulerFactory
from xlatrain.train.feed import TrainFeed, channels_last_choice, eval_batches, follow_num_workers, to_channels_last
from xlatrain.train.losses import EvalLoss, SkippedGroup, add_to_sums, new_sums
from xlatrain.train.metrics import EvalAccumulator, RowCollector, as_float, default_monitor, infer_task
from xlatrain.train.model_io import ForwardSignature, ModelIO, no_grad_message, settle_loss_lookup
from xlatrain.train.observers import (DiagnosticsObserver, Observers, ProgressObserver, TensorBoardObserver,
                                      TraceObserver, untraced_note)
from xlatrain.train.preflight import DoesNotFitError
from xlatrain.train.resumable import NonFiniteLossError, StopSignals, nonfinite_error
from xlatrain.train.run_dir import RunDirectory, writing
from xlatrain.train.state import Cursor

__all__ = ["DoesNotFitError", "EMA_KEY", "EMA_WEIGHTS", "ModelParameters", "NonFiniteLossError", "RunShape", "Trainer"]

log = get_logger(__name__)

# The fit's first optimizer steps compile (XLA, torch.compile, TorchTPU) and allocate (the first
# creates the optimizer's state): rates leave them out, with all their micro-batches.
WARMUP_STEPS = 2

class Trainer:
    """Trains ``model`` with ``loss_fn`` and an optimizer built on the device.

    Args:
        model: the ``torch.nn.Module`` to train; moved to the device here.
        loss_fn: ``loss_fn(outputs, targets)`` returning a scalar (or a mapping of named terms with
            the total under ``"loss"``); ``None`` trains on the model's own loss, as Hugging Face
            models and torchvision detectors compute it: a mapping batch is passed by keyword,
            ``model(**batch)``, and the loss taken from ``out.loss`` (see
            :mod:`xlatrain.train.model_io`).
        optimizer_fn: builds the optimizer from the parameters *after* they are on the device,
            e.g. ``functools.partial(torch.optim.Adam, lr=1e-3)``; it receives a
            :class:`ModelParameters`, which iterates as the parameters and names them as the model
            does (for parameter groups by name).
        scheduler_fn: optional, builds an LR scheduler from the optimizer.
        config: a :class:`~xlatrain.config.TrainConfig`.
        checkpoint: a :class:`~xlatrain.config.CheckpointConfig` (default: at each epoch end).
        backend: a Backend, a BackendConfig, or an accelerator name (``"auto"``, ``"xla"``, ...).
        accelerator: where to run, as in Lightning, instead of ``backend``: ``"auto"``, ``"tpu"``,
            ``"xla"``, ``"cuda"``, ``"cpu"``. :class:`~xlatrain.config.BackendConfig` holds the
            rest (``units``, ``activation_checkpointing``).
        devices: how many devices, instead of ``backend`` (``None``: all; with ``"xla"`` and no
            TPU, the number of virtual XLA:CPU devices).
        strategy: how to spread the work, instead of ``backend``: ``strategy="fsdp"`` shards
            parameters, gradients and optimizer state over the processes (``"auto"``: data
            parallel over whatever was launched; ``"single"``, ``"ddp"``).
        init_weights: for a model built on the ``meta`` device (too large to build on the host),
            ``init_weights(model)`` initialises its weights in place once each device holds its
            part; default: every submodule's ``reset_parameters()``.
        label_names: names of multilabel outputs, used in per-label metric columns.
        metrics_fn: ``metrics_fn(outputs, targets) -> {name: value}`` on the host, over the whole
            evaluation set in dataset order (outputs/targets as the model and dataset give them,
            stacked); its keys join the history as ``val_<name>``. Before the first step it is
            also called once on the dry run's few validation rows, to learn its names (and refuse
            a ``monitor`` it does not return): a function with side effects sees that call.
        collate_fn: makes one batch from a list of dataset items (a padding collate, mixup/cutmix
            soft targets); the dry run and the memory plan use it too. Default: stack each field.
        eval_collate_fn: makes one evaluation (and prediction) batch; default ``collate_fn``.
            Padding rows that fill the last batch are masked out of every metric.
        inputs: key name(s) of the model's inputs in mapping or dataclass batches; see
            :mod:`xlatrain.train.model_io` for how they are passed.
        targets: key name(s) of the loss targets in mapping or dataclass batches.
        output_field: the field of the model's outputs that metrics, ``metrics_fn`` and
            ``predict`` see (and, with a ``loss_fn``, that the loss gets), e.g. ``"logits"``.
        val_loss_fn: the loss evaluation reports, where it differs from training's (timm trains
            mixed-up soft targets with ``SoftTargetCrossEntropy`` and validates with
            ``CrossEntropyLoss``); default ``loss_fn``.
        sampler: the training order, as a sampler over dataset indices shared by every process
            (split over them as the Trainer's own order), or a factory ``sampler(dataset,
            num_replicas=N, rank=r)`` building each process's own (``DistributedSampler``,
            repeated augmentation). See :class:`~xlatrain.data.sampling.UserSampler`.
        batch_transform: ``batch_transform(batch) -> batch`` on each batch once it is on the device
            (training, evaluation, prediction, the dry run): normalisation on the accelerator, a
            memory format. It gets the batch as the dataset's items stack (``(inputs, targets)`` by
            default; bare inputs to ``predict`` as ``(inputs, None)``); under XLA it is traced into the step.
        train_batch_transform: the same on training batches only, after ``batch_transform``:
            random augmentation that must not touch evaluation (timm's ``Mixup``).
        callbacks: objects with any of ``on_fit_start``, ``on_epoch_start``, ``on_interval``,
            ``on_epoch_end``, ``on_checkpoint``, ``on_fit_end``; see :mod:`xlatrain.train.callbacks`.
        run_config: the resolved config of a config-driven run (``xlatrain fit``: sections
            ``model``, ``optimizer``, ``schedule``, ``data``, ``backend``), kept in checkpoints so
            that a resumed run whose model, optimizer, schedule or data differ stops with the
            keys named instead of silently mixing two runs.

    Before the first step ``fit`` measures what a device needs (``trainer.memory_plan``: parameters,
    gradients, optimizer state, activations for the batch) and refuses, with the changes that would
    fit, a run that cannot fit the device (``BackendConfig(device_memory=...)`` plans for another
    one); while it trains it reports samples/s, tokens/s and model FLOPs utilisation
    (``trainer.throughput``). A model may say its own FLOPs and tokens per sample with a method
    ``train_flops_per_sample()`` and an attribute ``tokens_per_sample``; otherwise torch's FLOP
    counter measures one step, and batches in the Hugging Face layout (a mapping with an integer
    ``input_ids``) give tokens/s from each batch's ``input_ids`` positions, padding included. See
    :mod:`xlatrain.train.perf`.

    Example:
        >>> trainer = Trainer(model, nn.CrossEntropyLoss(), partial(torch.optim.Adam, lr=1e-3),
        ...                   config=TrainConfig(epochs=3, batch_size=32, run_dir="runs/x"))
        >>> history = trainer.fit(train_set, val_set)
    """

    def __init__(
        self, model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None, optimizer_fn: OptimizerFactory,
        *,
        scheduler_fn: SchedulerFactory | None = None,
        config: TrainConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
        backend: Backend | BackendConfig | str = "auto",
        label_names: Sequence[str] | None = None,
        metrics_fn: Callable[[Any, Any], dict[str, float]] | None = None,
        run_config: dict[str, Any] | None = None,
        accelerator: str | None = None,
        devices: int | None = None,
        strategy: str | None = None,
        init_weights: Callable[[torch.nn.Module], None] | None = None,
        inputs: str | Sequence[str] | None = None,
        targets: str | Sequence[str] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        sampler: Any = None,
        callbacks: Sequence[Any] | None = None,
        batch_transform: Callable[[Any], Any] | None = None,
        train_batch_transform: Callable[[Any], Any] | None = None,
        eval_collate_fn: Callable[[list[Any]], Any] | None = None,
        output_field: str | None = None,
        val_loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> None:
        ensure_console()  # messages from here on (scale_lr, resume) reach a console
        check_arguments(model, loss_fn, optimizer_fn, scheduler_fn, config, checkpoint, metrics_fn, val_loss_fn)
        check_pipeline_arguments(collate_fn, sampler, batch_transform, train_batch_transform, eval_collate_fn)
        self._collate = collate_fn or collate
        self._eval_collate = eval_collate_fn or self._collate
        self._batch_transform = batch_transform
        self._train_batch_transform = train_batch_transform
        self._sampler = sampler
        self._callbacks = Callbacks(callbacks)
        self._stop_reason: str | None = None
        self._stop_eval: Callable[[int], bool] | None = None  # fit's validation: a stop signal at batch i
        self.config = cfg = config or TrainConfig()
        self.checkpoint = checkpoint or CheckpointConfig()
        self.io = ModelIO(loss_fn, inputs=inputs, targets=targets, output_field=output_field,
                          signature=ForwardSignature.of(model))
        if accelerator is not None or devices is not None or strategy is not None:
            if not (isinstance(backend, str) and backend == "auto"):
                raise ValueError(
                    f"backend={backend!r} and accelerator=/devices=/strategy= both say where to run: give one, e.g. "
                    "Trainer(..., accelerator='xla', devices=4) or Trainer(..., backend=BackendConfig(accelerator='xla', devices=4))"
                )
            backend = BackendConfig(accelerator=accelerator or "auto", devices=devices, strategy=strategy or "auto")
        if isinstance(backend, str):
            backend = select_backend(backend)
        elif isinstance(backend, BackendConfig):
            backend = from_config(backend)
        self.backend = backend
        self.runtime, self.strategy = rt, st = backend.runtime, backend.strategy
        self.precision = Precision(cfg.precision, rt.autocast_device)
        if cfg.precision == "fp16" and not rt.fp16:
            raise ValueError(
                f"precision='fp16' needs float16 autocast with a gradient scaler, which {rt.describe()} does not run: "
                "TPUs compute in bfloat16, so use precision='bf16' (no scaler needed)"
            )
        if cfg.precision == "fp16" and st.sharded_state:
            raise ValueError(
                f"precision='fp16' under strategy={st.name!r} is not supported: its gradients are sharded, which "
                "torch.amp.GradScaler does not unscale. Use precision='bf16' where the GPU has bfloat16 (A100, L4, "
                "H100 and later), or strategy='ddp'"
            )
        # float16's gradient scaler (torch.amp.GradScaler), whose state is saved in checkpoints.
        self.grad_scaler = torch.amp.GradScaler(rt.device.type) if cfg.precision == "fp16" else None
        scoring = val_loss_fn or loss_fn
        # Under the model's own loss the task is told by the dry run's outputs and targets.
        self.task = cfg.task if cfg.task != "auto" else infer_task(scoring) if scoring is not None else "auto"
        monitor, mode = default_monitor(self.task)
        self.monitor = cfg.monitor or monitor
        # TrainConfig refuses a monitor whose direction is neither given nor known from its name.
        self.monitor_mode = cfg.monitor_mode or (mode if cfg.monitor is None else monitor_mode_for(self.monitor))
        self.loss_fn = loss_fn
        self.val_loss_fn = val_loss_fn
        self.label_names = list(label_names) if label_names is not None else None
        self.metrics_fn = metrics_fn
        self._run_config = {k: v for k, v in (run_config or {}).items() if k not in ("trainer", "checkpoint")}
        if has_meta_tensors(model):
            rt.seed_everything(cfg.seed)  # the weights drawn on the devices depend on the seed only
        self.channels_last, self._channels_last_note = channels_last_choice(cfg.channels_last, model, rt, cfg.precision)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self._model_note = settle_loss_lookup(model) if cfg.compile and loss_fn is None else None
        self.model = st.prepare_model(model, self.precision, init_weights)
        # Training and evaluation run through this; under torch.compile each mode (train with
        # gradients, eval without) gets its own graph.
        self._forward = rt.compile(self.model) if cfg.compile else self.model
        self.optimizer = optimizer_fn(ModelParameters(st.unwrap(self.model)))
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer_fn returned a {type(self.optimizer).__name__}, not a torch.optim.Optimizer: it must build "
                "the optimizer from the parameters it is given, e.g. functools.partial(torch.optim.AdamW, lr=1e-3)"
            )
        # fp16's gradient scaler unscales before clipping; fused steps with a scaler measured wrong on the CPU.
        self.optimizer, self._optimizer_note = fused_optimizer(self.optimizer, self.model) if cfg.precision != "fp16" \
            else (self.optimizer, None)
        # The weights' moving average joins the optimizer's state once it has one.
        self.ema = WeightAverage(self.optimizer, cfg.ema_decay, cfg.ema_every, cfg.ema_rule, cfg.ema_warmup_epochs,
                                 sync=rt.step_end) if cfg.ema_decay is not None else None
        if cfg.scale_lr and st.world_size > 1:
            before = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * st.world_size
            self._say(
                f"learning rate scaled x{st.world_size} by device count (scale_lr=True): "
                f"{before[0]:g} -> {self.optimizer.param_groups[0]['lr']:g}"
            )
        # Built after any scaling (it starts from the scaled rate); one that needs the run's length, by fit.
        self._scheduler_fn = scheduler_fn
        # when the schedule steps: scheduler_interval, or what 'auto' chooses as each fit builds it
        self.schedule_interval = "epoch" if cfg.scheduler_interval == "auto" else cfg.scheduler_interval
        self._schedule_note: str | None = None
        resumable.build_schedule(self, for_fit=False)
        self.history: list[dict[str, Any]] = []
        self._step_lr: Any = None  # the learning rate the last training step used
        self._resumed_from: Path | None = None  # the checkpoint this fit continues (set by resume)
        self._eval_loss: EvalLoss | None = None
        self._unused_parameters: list[str] = []  # trainable parameters the dry run's backward gave no gradient
        self._dir = RunDirectory(cfg.run_dir, self.strategy, self._say)  # chosen and locked by fit
        self._nonfinite: tuple[int, int, int, int] | None = None  # set by a deferred read
        self._group: SkippedGroup | None = None  # skip_step's accumulation group under way
        self._config_record: dict[str, Any] = {}
        self._term_names: list[str] = []  # the loss's named terms, learnt in the dry run
        self._start_sums: tuple[float, ...] | None = None  # the resumed epoch's loss sum, NaN count and skipped steps
        # Who hears the run's points: the user's callbacks, and while fit runs xlatrain's own
        # observers (progress, TensorBoard, trace, diagnostics) before them.
        self._observers = Observers([], self._callbacks)
        self._feed: TrainFeed | None = None
        self.epochs_trained = 0  # epochs the last fit call trained (0: it found nothing to train)
        self.memory_plan: perf.MemoryPlan | None = None  # what a device needs: measured by fit before the first step
        self.throughput: perf.Throughput | None = None  # model FLOPs and the device's peak: set by fit
        self.run_shape: RunShape | None = None  # the run's length in optimizer steps: set by fit

    # ----------------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """True on the one process that writes the run's files and prints (every process on its own)."""
        return self.strategy.is_main

    def request_stop(self, reason: str = "a callback asked to stop") -> None:
        """End the run after the current epoch (validated, written and checkpointed), on every
        process. Call it from a callback (any process's request counts); the Trainer looks for
        requests once per epoch, and only when it was given callbacks."""
        self._stop_reason = reason

    @property
    def global_batch_size(self) -> int:
        return self.config.batch_size * self.strategy.world_size

    @property
    def run_location(self) -> str:
        """Where the run is kept: its URL when ``run_dir`` is on object storage, else ``run_dir``."""
        return self._dir.location

    def publish(self, *names: str) -> None:
        """Files written into :attr:`run_dir` after ``fit`` (a recipe's ``config.yaml``, a plot)
        go up to the run's object-storage URL too (main process); a local run has nothing to do."""
        self._dir.publish(*names)

    @property
    def run_dir(self) -> Path:
        """The directory this run writes to (``config.run_dir``, or a new sibling for resume=False;
        for a ``run_dir`` on object storage, its local working copy: see :attr:`run_location`)."""
        return self._dir.path

    def fit(self, train_data: Any, val_data: Any | None = None, *, resume: bool | str = "auto") -> list[dict[str, Any]]:
        """Train for ``config.epochs`` epochs, validating after each; returns the history rows.

        Writes ``history.csv`` / ``history.json`` after every epoch, ``best.safetensors`` whenever
        the monitored metric improves, and checkpoints per ``checkpoint`` config. A row's ``lr`` is
        the rate the epoch's first step used (a per-step schedule moves on within the epoch), and
        its ``epoch_time_s`` the epoch's time in this fit (a resumed epoch's from the resume).

        Only one run writes a run directory at a time (``RUN_DIR/.xlatrain.lock``): a second one is
        refused at once, naming the first.

        Args:
            resume: ``"auto"`` continues from the newest checkpoint in ``run_dir`` that verifies (a
                fresh start in a directory without an earlier run; an error, changing nothing,
                where the earlier run's checkpoints are all damaged or it left results without
                one); a path (a checkpoint, or a run directory: its newest checkpoint) continues
                from there; ``False`` starts fresh, in a new run directory if ``run_dir`` already
                holds a run; ``"overwrite"`` deletes the earlier run's files in ``run_dir`` and
                starts fresh there.
        """
        ensure_console()
        if not (resume in (False, "auto", "overwrite") or isinstance(resume, (str, os.PathLike))):
            raise ValueError(
                f"resume={resume!r} is not valid: use 'auto', False, 'overwrite', or the path of a checkpoint "
                "or run directory"
            )
        self._dir = RunDirectory(self.config.run_dir, self.strategy, self._say)
        self._dir.open(resume)
        failed = True
        try:
            history = self._fit(train_data, val_data, resume)
            failed = False
            self._dir.write_status("finished", epochs=len(history))
            return history
        except Exception as exc:
            self._dir.write_status("failed", error=failure_status(exc))  # a peer's failure: says so, and where
            raise
        finally:
            if self._feed is not None:
                self._feed.close()
            self._dir.close(failed)

    def _fit(self, train_data: Any, val_data: Any | None, resume: bool | str) -> list[dict[str, Any]]:
        """The loop: for each epoch, for each batch, one step; a deferred read every ``log_every``
        steps; checkpoints; then validation and the epoch's bookkeeping."""
        cfg, rt, st = self.config, self.runtime, self.strategy
        feed, cursor, sums = self._start(train_data, val_data, resume)
        first_epoch, start_step = cursor.next_position()
        if first_epoch > cfg.epochs or self._patience_spent(cursor):
            self._dir.settle_finished()
            return self.history  # a finished run: every file stays as it is (but a stale "running")
        every, accum = self.checkpoint.every_steps if self.checkpoint.enabled else None, cfg.grad_accum_steps
        self._dir.write_status("running", epoch=first_epoch, step=start_step, checkpoints=self.checkpoint.enabled)
        with contextlib.ExitStack() as run:
            obs = self._observers = self._run_observers(run, cursor, first_epoch)
            stop = run.enter_context(StopSignals(self._say, saves=self.checkpoint.enabled))
            obs.call("on_fit_start", self)
            for epoch in range(first_epoch, cfg.epochs + 1):
                if not start_step or cursor.epoch_lr is None:  # resumed mid-epoch, a schedule may have moved on
                    cursor.epoch_lr = float(self.optimizer.param_groups[0]["lr"])
                cursor.epoch, cursor.step, cursor.epoch_done = epoch, start_step, False
                lr, num_steps = cursor.epoch_lr, feed.steps_per_epoch
                obs.call("on_epoch_start", self, epoch)  # every epoch, a resumed one included
                ep = self._epoch_start(feed, epoch, start_step, warm=WARMUP_STEPS * accum if epoch == first_epoch else 0)
                extra = False
                with obs.epoch(self, epoch, start_step, num_steps):  # the bar goes however the epoch ends
                    fetch_started = time.perf_counter()
                    for step, batch in enumerate(ep.batches, start=start_step + 1):
                        if step > num_steps:
                            extra = True  # a source that gives more batches than it announced
                            break
                        input_wait_s = time.perf_counter() - fetch_started
                        if ep.counts_tokens:  # shapes only: no device read
                            ep.tokens += perf.tokens_per_row(batch) or 0.0
                        for fn in ep.step_start:
                            fn(ep.before + step)
                        last_micro = step % accum == 0
                        if self._train_step(batch, cursor, step, last_micro, sums):  # state made again next step
                            obs.call("on_state_remade")
                            if step <= ep.clock.mark_step:  # the steady window starts a step later
                                ep.clock.mark_step = ep.meter.warm_until = step + WARMUP_STEPS * accum
                        for fn in ep.step_end:
                            fn(step, ep.before + step, input_wait_s)
                        if step == ep.clock.mark_step:  # the warm-up steps are done once the device ran them
                            rt.defer(ep.clock.mark, [])
                            ep.tokens_at_mark = ep.tokens
                        # An interval ends with an optimizer step (the first at or after each
                        # log_every-th micro-batch): its loss is the mean of whole accumulation
                        # groups, plotted at the step they made.
                        if last_micro and step // cfg.log_every != (step - accum) // cfg.log_every and step < num_steps:
                            show = self._interval(ep.meter, epoch, ep.last_logged + 1, step, cursor.global_step, ep)
                            rt.defer(show, [st.all_reduce_mean(sums["loss"]), st.all_reduce_mean(sums["nonfinite"])])
                            ep.last_logged = step
                        if self._nonfinite is not None:
                            self._fail_nonfinite()
                        # Agreeing on a stop is a host collective when there are several processes,
                        # so it happens at log intervals there; one process checks every step.
                        if last_micro and (st.num_processes == 1 or step % cfg.log_every < accum) \
                                and st.any_process(stop.requested):
                            resumable.preempt(self, cursor, sums, stop)
                        if last_micro and every is not None and cursor.global_step % every == 0 and step < num_steps:
                            resumable.save_checkpoint(self, cursor, sums)
                        fetch_started = time.perf_counter()
                row = {"epoch": epoch, "lr": lr, **self._epoch_means(feed, cursor, sums, start_step, ep, extra)}
                if val_data is not None:
                    row.update(self._validate(val_data, stop, cursor, sums))
                row["epoch_time_s"] = round(time.perf_counter() - ep.clock.started, 3)
                stepped, sums, start_step = start_step < num_steps, self._new_sums(), 0  # stepped: some steps ran here
                self._finish_epoch(row, cursor, sums, stepped)
                if self._should_stop(cursor, epoch):
                    break
            obs.call("on_run_end", self)
        st.barrier()
        obs.call("on_fit_end", self, self.history)
        return self.history

    def _start(self, train_data: Any, val_data: Any | None, resume: bool | str) -> tuple[TrainFeed, Cursor, dict[str, torch.Tensor]]:
        """Everything before the first step: the data checked, a dry run, the memory plan, the
        schedule (anew for a fit after another), the checkpoint resumed from, and the run's header."""
        cfg, rt, st = self.config, self.runtime, self.strategy
        self.epochs_trained = 0
        self._stop_reason = None
        rt.reset_memory_peak()  # the fit's peak, not what the process held before
        check_dataset("train_data", train_data)
        if isinstance(train_data, BatchSource) and (self._sampler is not None or self._collate is not collate):
            raise ValueError(
                f"sampler= and collate_fn= choose and stack a dataset's items, but train_data is a "
                f"{type(train_data).__name__}, which reads and batches its own records: pass a map-style dataset "
                "(one with __getitem__ and __len__), or leave sampler= and collate_fn= out"
            )
        if val_data is not None:
            check_dataset("val_data", val_data)
        follow_num_workers(cfg.num_workers, train_data=train_data, val_data=val_data)  # a shard reader's decode workers
        rt.seed_everything(cfg.seed)
        self._feed = feed = TrainFeed(cfg, rt, st, train_data, sampler=self._sampler, collate_fn=self._collate)
        self._config_record = {
            **self._run_config,
            "trainer": dataclasses.asdict(cfg),
            "checkpoint": dataclasses.asdict(self.checkpoint),
            "run": {"global_batch": self.global_batch_size * cfg.grad_accum_steps, "num_train_samples": len(train_data)},
        }
        self.memory_plan, self.throughput = preflight.prepare(self, train_data, val_data)
        # Parameters the dry run's backward left without a gradient: DDP is told not to wait for them.
        if self._unused_parameters and (model := st.allow_unused_parameters(self.model, self._unused_parameters)) is not self.model:
            self.model, self._forward = model, rt.compile(model) if cfg.compile else model
        per_epoch = feed.steps_per_epoch // cfg.grad_accum_steps
        self.run_shape = RunShape(total_steps=per_epoch * cfg.epochs, steps_per_epoch=per_epoch, epochs=cfg.epochs)
        resumable.build_schedule(self, for_fit=True)
        self._start_sums, self._resumed_from = None, None
        cursor, sums = resumable.resume(self, resume)
        self.history = cursor.history
        if self.ema is not None:  # a resumed run's averages came back with the optimizer's state
            self.ema.ready = self.ema.restored()
        if self.checkpoint.enabled and cursor.next_position()[0] <= cfg.epochs:
            self._dir.check_disk_room(st.unwrap(self.model), self.optimizer, EMA_KEY if self.ema is not None else None)
        self._say(
            f"xlatrain: {self.backend.describe()} | global batch {self.global_batch_size * cfg.grad_accum_steps} = "
            f"{cfg.batch_size} per device x {st.world_size} device(s)"
            + (f" x {cfg.grad_accum_steps} accumulation steps" if cfg.grad_accum_steps > 1 else "")
            + f" | {feed.steps_per_epoch // cfg.grad_accum_steps} optimizer steps per epoch" + (
                f" ({feed.steps_per_epoch} micro-batches: the progress lines count these)" if cfg.grad_accum_steps > 1 else "")
            + f" | precision {cfg.precision} | run dir "
            + (f"{self._dir.remote.url} (working copy {self.run_dir})" if self._dir.remote is not None else f"{self.run_dir}")
        )
        if self._patience_spent(cursor) or cursor.next_position()[0] > cfg.epochs:
            self._say(f"this run stopped early after epoch {cursor.epoch} ({self.monitor} last improved in epoch "
                      f"{cursor.best_epoch}, early_stop_patience={cfg.early_stop_patience}): nothing to train"
                      if self._patience_spent(cursor) else
                      f"all {cfg.epochs} epoch(s) of this run are done: nothing to train. Raise epochs to train on, "
                      "or start over (resume=False or 'overwrite'; --fresh or --overwrite on the command line).")
            return feed, cursor, sums  # nothing runs, so the lines about the steps to come are left out
        for note in rt.notes(cfg.compile):
            self._say(f"note: {note}")
        feeding = [f"{feed.num_workers} decode worker(s) ({feed.workers_reason})"] if feed.num_workers is not None else []
        self._say(" | ".join(["input: " + (feeding[0] if feeding else "batches from " + type(train_data).__name__),
                              *([self._channels_last_note] if self._channels_last_note else [])]))
        if fork_note := fork_hang_note(feed.num_workers):
            self._say(f"note: {fork_note}")
        for note in (self._model_note, self._optimizer_note, self._schedule_note):
            if note:
                self._say(note)
        if self.ema is not None:
            self._say(ema_summary(cfg, self.model))
        self._say(f"memory per device, before the first step: {self.memory_plan.summary()}")
        self._say(self.throughput.summary())
        if note := feed.length_note():
            self._say(note)
        if self._resumed_from is not None:
            epoch, step = cursor.next_position()
            self._say(f"resumed from {self._resumed_from}: continuing at epoch {epoch}, step {step} (optimizer step "
                      f"{cursor.global_step})")
        return feed, cursor, sums

    def _run_observers(self, run: contextlib.ExitStack, cursor: Cursor, first_epoch: int) -> Observers:
        """xlatrain's own observers of this fit, each closed however the run ends (finished,
        preempted, failed): event files flushed, a trace written, the compile watch's callback
        removed; after the run only the user's callbacks are left."""
        cfg, rt, st = self.config, self.runtime, self.strategy
        run.callback(setattr, self, "_observers", Observers([], self._callbacks))
        own: list[Any] = [ProgressObserver(interactive=interactive_terminal(st.is_main), log=self._say,
                                           rate_note=self.throughput.text if self.throughput is not None else None)]
        tb = run.enter_context(
            TensorBoardLog(self.run_dir, enabled=cfg.tensorboard, is_main=st.is_main, start_step=cursor.global_step))
        if tb.enabled:
            own.append(TensorBoardObserver(tb, self._config_record))
        if cfg.profile_steps and (note := untraced_note(cfg, self._feed.steps_per_epoch, *cursor.next_position())):
            self._say(note)  # before the first step: a trace asked for is not left out silently
        if cfg.profile_steps:
            trace = StepTrace(self.run_dir, cfg.profile_steps, trace_kind=rt.trace_kind, is_main=st.is_main,
                              platform=rt.platform, compiled=cfg.compile)
            own.append(TraceObserver(run.enter_context(contextlib.closing(trace))))
        if cfg.diagnostics:
            watch = run.enter_context(CompileWatch().start(first_epoch=first_epoch)) if cfg.compile else None
            diag = RunDiagnostics(rt, st, per_device_batch=cfg.batch_size, strict=cfg.strict,
                                  grad_accum_steps=cfg.grad_accum_steps, compile_watch=watch,
                                  workers=self._feed.worker_room)
            assert self.memory_plan is not None and self.throughput is not None
            plan, rate = self.memory_plan, self.throughput
            own.append(DiagnosticsObserver(diag, lambda: {"memory": plan.as_dict(), "throughput": rate.as_dict()}))
        return Observers(own, self._callbacks)

    def _epoch_start(self, feed: TrainFeed, epoch: int, start_step: int, warm: int) -> SimpleNamespace:
        """What one epoch's loop needs: its batches, the step hooks bound once, the interval meter
        and the clock of its steady window (the first ``warm`` steps left out of its rates)."""
        self.model.train()
        if warm:  # the fit's first epoch: its runtime counters start here, after the checks before it
            self._stats_mark = self.runtime.runtime_stats()
        obs = self._observers
        clock = WarmupClock(start_step, min(warm, max(feed.steps_per_epoch - start_step - 1, 0)), time.perf_counter())
        skip = self.config.nan_policy == "skip_step"  # its steps are skipped on every process alike: counted once
        meter = IntervalMeter(start_step, samples_per_step=self.global_batch_size, start_sums=self._start_sums,
                              warm_until=clock.mark_step, skipped_out=skip, processes=1 if skip else self.strategy.counting_processes)
        self._start_sums = None  # later epochs start from zero
        return SimpleNamespace(
            batches=obs.batches(feed.batches(epoch, start_step), "train", epoch, start_step + 1), meter=meter,
            clock=clock, step_start=obs.hooks("on_step_start"), step_end=obs.hooks("on_step_end"),
            before=(epoch - 1) * feed.steps_per_epoch,  # the trace counts over the run
            last_logged=start_step,
            # input_ids positions per row, summed over the epoch's steps in this fit (perf.Throughput)
            counts_tokens=self.throughput is not None and self.throughput.counts_input_ids, tokens=0.0, tokens_at_mark=0.0,
        )

    def _epoch_means(self, feed: TrainFeed, cursor: Cursor, sums: dict[str, torch.Tensor], first_step: int,
                     ep: SimpleNamespace, extra: bool) -> dict[str, float]:
        """The epoch's mean loss and terms as history columns (``train_...``), read once, and its
        rates over the steady window (the fit's first steps, which compile, left out). The epoch's
        last interval is heard from the same read."""
        clock = ep.clock
        cfg, rt, st = self.config, self.runtime, self.strategy
        ran, warning = feed.steps_that_ran(cursor.epoch, cursor.step, extra, user_sampler=self._sampler is not None)
        if warning:
            if ran % cfg.grad_accum_steps:  # an accumulation group cut short: its gradients never reach a step
                self.optimizer.zero_grad(set_to_none=True)
            self._say(warning)
        # "skipped": steps skip_step skipped before a resume under another nan_policy (resumable.counted_as)
        with torch.profiler.record_function(PLANNED_READ):
            read = {k: float(t) for k, t in zip(sums, rt.read([st.all_reduce_mean(t) for t in sums.values()]))}
        bad, skipped = read.pop("nonfinite"), float(read.pop("skipped", 0.0))
        if ep.last_logged < ran and ran > first_step:
            self._interval(ep.meter, cursor.epoch, ep.last_logged + 1, ran, cursor.global_step, ep)(read["loss"], bad)
        self._check_nonfinite(float(bad) * st.counting_processes, cursor.epoch, 1, ran)  # every process's, in all
        skipped = float(bad) if cfg.nan_policy == "skip_step" else skipped  # alike everywhere
        good = ran - skipped if skipped or cfg.nan_policy == "skip_step" else max(ran, 1)  # NaN if none counted
        row = {"train_" + n.removeprefix("term."): float(t) / good if good > 0 else math.nan for n, t in read.items()}
        row.update({"nonfinite_steps": round(skipped)} if skipped else {})
        if ran <= first_step:  # resumed at the epoch's end: none of its steps ran in this fit, no rate to give
            return row
        rate, warmup_s = clock.rate(ran, self.global_batch_size, first_step)
        start = clock.window_start(ran, first_step)  # the steady window's input_ids positions per row, where counted
        row_tokens = (ep.tokens - (ep.tokens_at_mark if start > first_step else 0.0)) / (ran - start) if ep.counts_tokens else None
        figures = self.throughput.figures(rate, row_tokens) if self.throughput is not None else {}
        return {**row, "samples_per_s": float(f"{rate:.4g}"), **{k: float(f"{v:.4g}") for k, v in figures.items()},
                **({"warmup_s": round(warmup_s, 3)} if warmup_s is not None else {})}

    def _validate(self, val_data: Any, stop: StopSignals, cursor: Cursor, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """The epoch's validation columns (``val_...``), and the EMA weights' (``val_ema_...``). A stop
        signal ends it at the next batch (a long one would outlast a scheduler's grace period): the
        checkpoint holds the epoch's last step, and the resumed run validates the epoch."""
        st, every = self.strategy, self.config.log_every  # processes agree at log intervals, as in training
        self._stop_eval = (lambda index: stop.requested) if st.num_processes == 1 else \
            (lambda index: index % every == every - 1 and st.any_process(stop.requested))
        try:
            columns = {f"val_{k}": v for k, v in self.evaluate(val_data).items() if k != "num_samples"}
            if self.ema is not None:
                with self.ema.swapped_in(), self._ema_statistics():
                    metrics = self.evaluate(val_data)
                columns.update({f"val_ema_{k}": v for k, v in metrics.items() if k != "num_samples"})
        except _StopInValidation:
            resumable.preempt(self, cursor, sums, stop)
        finally:
            self._stop_eval = None
        return columns

    def _ema_statistics(self) -> contextlib.AbstractContextManager[Any]:
        """``ema_bn_batches``: batch-norm statistics recomputed for the EMA weights over the first
        training batches (unaugmented, as evaluation reads them), the live ones put back after."""
        count = self.config.ema_bn_batches
        if not count or self._feed is None:
            return contextlib.nullcontext()
        rows = min(count * self.config.batch_size, len(self._feed.dataset))
        batches, _ = eval_batches(self.config, self.runtime, self.strategy, preflight._Head(self._feed.dataset, rows),
                                  self._eval_collate)
        return recomputed_batch_norm(self.model, (self._on_device(b, training=False) for b, _ in batches),
                                     lambda batch: self.io.call(self._forward, batch))

    def _finish_epoch(self, row: dict[str, Any], cursor: Cursor, sums: dict[str, torch.Tensor], stepped: bool) -> None:
        """An epoch's bookkeeping, in the order a resume relies on: history and TensorBoard are
        written before the checkpoint that marks the epoch done; callbacks hear of it last."""
        cfg, st = self.config, self.strategy
        self._observers.call("on_epoch_row", self, row)
        now = self.runtime.runtime_stats()  # process totals: the row gets the epoch's share
        row.update({key: value - self._stats_mark.get(key, 0) for key, value in now.items()})
        self._stats_mark = now
        if self.scheduler is not None and self.schedule_interval == "epoch":
            resumable.step_schedule(self.scheduler, quiet=not stepped, monitored=row.get(self.monitor))
        improved = self._track_best(row, cursor)
        self.history.append(row)
        cursor.epoch_done = True
        if st.is_main:
            with writing(self.run_dir / "history.json"):
                write_history(self.run_dir, self.history)
        if self._observers.wants("on_epoch_written"):
            self._observers.call("on_epoch_written", self, row, cursor,
                                 cursor.epoch == cfg.epochs or self._patience_spent(cursor))
        if self.ema is not None:
            with self.ema.swapped_in(), writing(self.run_dir / EMA_WEIGHTS):
                self.save_weights(self.run_dir / EMA_WEIGHTS)
        if self.checkpoint.enabled and self.checkpoint.at_epoch_end:
            resumable.save_checkpoint(self, cursor, sums)
        self._say(epoch_line(row, cfg.epochs, self.monitor, bool(improved)))
        if improved is None:
            raise preflight.missing_monitor(self, row, cursor)
        self.epochs_trained += 1
        if self.epochs_trained == 1:
            preflight.report_peak(self)
        self._observers.call("on_epoch_end", self, row)

    def _should_stop(self, cursor: Cursor, epoch: int) -> bool:
        """Early stopping, or a callback's request_stop on any process, after ``epoch``."""
        cfg, st = self.config, self.strategy
        if self._patience_spent(cursor):
            self._say(
                f"early stop: {self.monitor} has not improved for {cfg.early_stop_patience} epoch(s) "
                f"(best {cursor.best:.4f} in epoch {cursor.best_epoch})"
            )
            return True
        # One host collective per epoch, and only where a callback could have asked.
        if self._callbacks and epoch < cfg.epochs and st.any_process(self._stop_reason is not None):
            why = st.gather_objects(self._stop_reason) if st.num_processes > 1 else [self._stop_reason]
            self._say(f"stopped after epoch {epoch}: {next(r for r in why if r is not None)} (request_stop)")
            return True
        return False

    # ----------------------------------------------------------------------------------------
    def evaluate(self, data: Any) -> dict[str, float]:
        """Loss and task metrics over ``data``, every sample counted exactly once."""
        check_dataset("data", data)
        follow_num_workers(self.config.num_workers, data=data)
        if self._eval_loss is None:
            preflight.dry_run(self, None, data)
        return self._evaluate(data, self.metrics_fn)

    def _evaluate(self, data: Any, metrics_fn: Any, forward: Callable[..., Any] | None = None) -> dict[str, float]:
        """``evaluate``'s pass over ``data``; the dry run gives the eager ``forward`` (nothing is
        compiled before the first step)."""
        rt, st = self.runtime, self.strategy
        forward = forward or self._forward
        batches, layout = eval_batches(self.config, rt, st, data, self._eval_collate)
        batches = self._observers.batches(batches, "eval", 0)
        acc = EvalAccumulator(self.task, rt, st, layout, self._eval_loss, self.io, top_k=self.config.top_k,
                              metrics_fn=metrics_fn)
        self.model.eval()
        with torch.no_grad():
            for index, (batch, valid_B) in enumerate(batches):
                if self._stop_eval is not None and self._stop_eval(index):
                    raise _StopInValidation
                batch, valid_B, real = acc.trim(index, batch, valid_B)  # the model's own loss: padding rows cut
                batch = self._on_device(batch, training=False)
                with self.precision.autocast():
                    outputs = self.io.call(forward, batch)
                acc.update(outputs, self.io.targets_of(batch), valid_B, real)
                rt.step_end()
        return acc.compute(rt, st, self.label_names, metrics_fn)

    def predict(self, data: Any) -> Any:
        """Model outputs for every item of ``data``, in dataset order, on the host.

        Items may be ``(inputs, targets)`` pairs (targets are ignored), bare inputs, or mappings /
        dataclasses read through the Trainer's ``inputs=`` keys. Models returning several tensors
        (a tuple or dict) get the same structure back, each stacked; ``output_field`` picks one
        field of them (``logits`` by default under the model's own loss).
        """
        check_dataset("data", data)
        follow_num_workers(self.config.num_workers, data=data)
        batches, layout = eval_batches(self.config, self.runtime, self.strategy, data, self._eval_collate)
        rows = RowCollector(self.runtime, self.strategy, layout)
        self.model.eval()
        with torch.no_grad():
            for item, _valid in batches:
                args, kwargs = self.io.bind(self._on_device(item, training=False), with_targets=False)
                with self.precision.autocast():
                    rows.add(as_float(self.io.predictions(self._forward(*args, **kwargs))))
                self.runtime.step_end()
        return rows.result()

    def save_weights(self, path: str | os.PathLike[str]) -> Path | None:
        """Write the model's whole weights to a safetensors file (``xlatrain.load_weights`` reads
        it). Call it on every process: a sharded model is gathered onto the main process, which
        writes the file and returns its path (the others return ``None``)."""
        with self.runtime.planned_transfers():
            whole = self.strategy.whole_weights(self.model, self.runtime.read)
        return write_weights(path, *whole) if whole is not None else None

    # --- one step --------------------------------------------------------------------------
    def _train_step(self, batch: Any, cursor: Cursor, step: int, last_micro: bool, sums: dict[str, torch.Tensor]) -> bool:
        """One micro-batch: forward, loss, backward, and on the last micro-batch the optimizer step.
        Nothing here reads the device (but skip_step's read where state is made): the loss and its
        terms are added to ``sums`` on it. True where skip_step dropped state the step made."""
        cfg, rt, st, model, opt = self.config, self.runtime, self.strategy, self.model, self.optimizer
        accum, guard = cfg.grad_accum_steps, cfg.nan_policy == "skip_step"
        batch = self._on_device(batch, training=True)
        targets = self.io.targets_of(batch)
        self._step_lr = opt.param_groups[0]["lr"]
        rt.step_begin(((cfg.seed * 1_000_003 + cursor.epoch) * 1_000_003 + step) % 2**62)
        with contextlib.nullcontext() if last_micro else st.no_sync(model), in_step(self, cursor, step) as where:
            with self.precision.autocast():
                outputs = self.io.call(self._forward, batch)
                where[:] = ["loss", outputs, targets]  # described only if it raises: a loss's repr can be long
                loss, terms = self.io.loss(outputs, targets)  # shapes only: no sync
                where[0] = "backward"
            if not loss.requires_grad:  # host metadata: no device read
                raise ValueError(no_grad_message(self.loss_fn))
            loss_to_step = loss / accum if accum > 1 else loss
            (self.grad_scaler.scale(loss_to_step) if self.grad_scaler is not None else loss_to_step).backward()
        if set(terms) != set(self._term_names):  # the same names; their order may change
            raise ValueError(
                f"the loss's terms were {sorted(terms)} at epoch {cursor.epoch} step {step} but "
                f"{sorted(self._term_names)} before: return the same named terms at every step"
            )
        loss = loss.detach().float()
        finite = torch.isfinite(loss)
        group = self._group = (self._group or SkippedGroup(sums, accum)) if guard and accum > 1 else None
        if last_micro:
            st.reduce_gradients(opt)
            scaler, remade = self.grad_scaler, False
            if scaler is not None:
                scaler.unscale_(opt)  # clipping sees the true gradients
            if guard or cfg.clip_grad_norm is not None:
                norm = st.clip_grad_norm(model, cfg.clip_grad_norm or math.inf)
                if scaler is None:  # under fp16 an overflow is the scaler's to skip, not a fault
                    finite = finite & torch.isfinite(norm)
            if guard:  # every process skips alike: replicas that stepped apart would drift
                finite = st.all_reduce_mean((~(group.step_taken(sums, finite) if group else finite)).float()) == 0
            if scaler is not None:
                # The scaler skips a step whose gradients overflowed (and a NaN loss's), then
                # lowers its scale. Unless the optimizer is fused, it reads on the host whether
                # they did: a planned read, once per optimizer step, as every fp16 loop has it.
                with rt.planned_transfers():
                    remade = guarded_step(opt, finite if guard else None, lambda: scaler.step(opt))
                scaler.update()
            else:
                with rt.planned_transfers() if guard else contextlib.nullcontext():  # skip_step reads once (guarded_step)
                    remade = st.optimizer_step(opt, finite if guard else None)
            opt.zero_grad(set_to_none=True)
            if self.scheduler is not None and self.schedule_interval == "step":
                self.scheduler.step()
            cursor.global_step += 1
            if self.ema is not None:
                self.ema.after_step(cursor.global_step, step // accum, cursor.epoch, finite if guard else None)
        values = {"loss": loss, **{f"term.{t}": v.detach().float() for t, v in terms.items()}}
        add_to_sums(sums, values, finite, skip=guard, group=group, last_micro=last_micro)
        rt.step_end()
        cursor.step = step
        return last_micro and remade

    def _on_device(self, batch: Any, *, training: bool) -> Any:
        """A batch on the device as the model gets it: channels-last images (``channels_last``), then
        ``batch_transform`` (and in training ``train_batch_transform``), which see bare inputs to
        ``predict`` as ``(inputs, None)``. A transform that returns nothing is named as the culprit."""
        if self.channels_last:
            batch = tree_map(to_channels_last, batch)
        pairs = not self.io.own_loss and self.io.layout is not None and not self.io.layout.keyed
        bare = pairs and not training and not _is_pair(batch) and self._batch_transform is not None
        batch, maker = (batch, None) if bare else batch, ("collate_fn", self._collate if training else self._eval_collate)
        for name, transform in (("batch_transform", self._batch_transform),
                                ("train_batch_transform", self._train_batch_transform if training else None)):
            if transform is not None:
                if pairs and not _is_pair(batch):
                    break  # the batch was no pair before this transform: named below
                maker = (name, transform)
                batch = transform(batch)
                if batch is None:
                    raise ValueError(f"{name} {transform!r} returned None: it must return the batch it was given, "
                                     "transformed (e.g. return inputs, targets)")
        if pairs and not _is_pair(batch) and maker[1] is not collate:
            raise ValueError(
                f"{maker[0]} {maker[1]!r} made a {type(batch).__name__}, not an (inputs, targets) pair: return both "
                "(e.g. return inputs, targets), or give the Trainer inputs=/targets= names for a mapping"
            )
        return batch[0] if bare else batch

    def _new_sums(self) -> dict[str, torch.Tensor]:
        self._group = None  # skip_step's accumulation group: a new one with the new sums
        return new_sums(self._term_names, self.runtime.device)

    def _interval(self, meter: IntervalMeter, epoch: int, first: int, step: int,
                  tb_step: int, ep: SimpleNamespace) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """The deferred read of one log interval: its figures to the observers (progress line or
        bar, TensorBoard, callbacks), and the NaN check."""
        lr = self._step_lr  # the rate the interval's last step used (a schedule has moved it on since)
        tokens = ep.tokens if ep.counts_tokens else None  # as of ``step``: the read lands later
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
            lr = None  # a capturable optimizer keeps it on the device; not worth a read

        def show(mean_loss_sum: torch.Tensor | float, nonfinite: torch.Tensor | float) -> None:
            with torch.profiler.record_function(PLANNED_READ):  # a step trace tells these from the user's reads
                bad, loss_sum = float(nonfinite), float(mean_loss_sum)  # means over processes
            if bad > 0 and self.config.nan_policy == "stop":
                # Raised by the training loop right after this read, not inside the runtime's callback.
                self._nonfinite = (epoch, first, step, round(bad * self.strategy.counting_processes))
            stats = meter.measure(step, loss_sum=loss_sum, nonfinite=bad, tokens=tokens)
            rate = stats.samples_per_s
            figures = self.throughput.figures(rate, stats.tokens_per_row) if self.throughput is not None and rate is not None \
                else {}
            self._observers.call("on_interval", self, {
                "epoch": epoch, "step": step, "global_step": tb_step, "loss": stats.interval_loss,
                "epoch_loss": stats.epoch_loss, "nonfinite_steps": stats.nonfinite, "nonfinite_over": stats.nonfinite_over,
                "lr": float(lr) if lr is not None else None, "samples_per_s": stats.samples_per_s, **figures,
            })

        return show

    # --- what the loop says and decides --------------------------------------------------------
    def _check_nonfinite(self, bad: float, epoch: int, first: int, last: int) -> None:
        if bad > 0 and self.config.nan_policy == "stop":
            self._nonfinite = (epoch, first, last, round(bad))  # as the interval's read counts it
            self._fail_nonfinite()

    def _fail_nonfinite(self) -> None:
        raise nonfinite_error(self.config.precision, *(self._nonfinite or (0, 0, 0, 0)), self.run_dir,
                              processes=self.strategy.counting_processes)

    def _patience_spent(self, cursor: Cursor) -> bool:
        """Early stopping: the monitored value has not improved for ``early_stop_patience`` epochs."""
        patience, since = self.config.early_stop_patience, max(cursor.best_epoch or 0, cursor.unjudged_until)
        return patience is not None and cursor.epoch_done and cursor.epoch - since >= patience

    def _track_best(self, row: dict[str, Any], cursor: Cursor) -> bool | None:
        monitor = self.monitor
        if monitor not in row:
            cursor.unjudged_until = row["epoch"]  # said once the epoch is saved (preflight.missing_monitor)
            return None
        value, best = row[monitor], cursor.best
        if math.isnan(value) and cursor.best_epoch is None:  # nothing judged yet: patience counts from a judged epoch
            cursor.unjudged_until = row["epoch"]
        improved = not math.isnan(value) and (
            math.isnan(best) or (value > best if self.monitor_mode == "max" else value < best)
        )
        if improved:
            cursor.best, cursor.best_epoch = value, row["epoch"]
            if self.config.save_best:
                # Under a sharded strategy the weights are gathered onto the main process here.
                # A monitored EMA column makes the EMA weights the best ones.
                ema = self.ema.swapped_in() if self.ema is not None and monitor.startswith("val_ema_") \
                    else contextlib.nullcontext()
                with ema, writing(self.run_dir / "best.safetensors"):
                    self.save_weights(self.run_dir / "best.safetensors")
        return improved

    def _say(self, message: str) -> None:
        if self.strategy.is_main:
            log.info(message)


class _StopInValidation(Exception):
    """A stop signal arrived while a fit validated (``Trainer._validate`` checkpoints and stops)."""


def _is_pair(batch: Any) -> bool:
    return isinstance(batch, (list, tuple)) and len(batch) == 2
