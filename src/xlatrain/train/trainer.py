"""Trainer: fit / evaluate / predict for one PyTorch model on any Backend.

The loop is written out in full in ``_train_epoch``: one forward, one backward, one optimizer step
per global batch, with nothing read back to the host except through ``runtime.defer`` every
``log_every`` steps and ``runtime.read`` at epoch end. What the device is, the runtime answers;
how the model is spread over devices, the strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from xlatrain.backend import Backend, from_config, select_backend
from xlatrain.backend.base import host_rng_state, set_host_rng_state
from xlatrain.backend.model_state import checkpoint_bytes, has_meta_tensors, weight_bytes
from xlatrain.backend.precision import Precision
from xlatrain.checkpoint import (
    SHARDS_DIR,
    CheckpointError,
    distinct_weights,
    SHARDS_INDEX,
    find_resumable,
    latest_name,
    list_checkpoints,
    prune_checkpoints,
    read_checkpoint,
    write_checkpoint,
    write_sharded_checkpoint,
    write_weights,
)
from xlatrain.config import BackendConfig, CheckpointConfig, TrainConfig, monitor_mode_for
from xlatrain.data.sampling import EvalSampler, PaddedDataset, TrainSampler, UserSampler
from xlatrain.data.source import BatchSource, train_steps_per_epoch
from xlatrain.diagnostics.compile import CompileWatch
from xlatrain.diagnostics.profile import StepTrace
from xlatrain.diagnostics.run import RunDiagnostics
from xlatrain.logs import ensure_console, get_logger
from xlatrain import storage
from xlatrain.storage import lock as run_lock
from xlatrain.progress import IntervalMeter, interactive_terminal
from xlatrain.report import write_history
from xlatrain.tensorboard import TensorBoardLog
from xlatrain.train.batch import BatchLayout, collate, tree_map
from xlatrain.storage.remote_run import RemoteRun, stale_after_s
from xlatrain.train.callbacks import Callbacks
from xlatrain.train.observers import DiagnosticsObserver, Observers, ProgressObserver, TensorBoardObserver, TraceObserver
from xlatrain.train.losses import EvalLoss, loss_terms
from xlatrain.train.metrics import EvalAccumulator, RowCollector, as_float, default_monitor, infer_task
from xlatrain.train import perf
from xlatrain.train.state import (
    Cursor,
    pack_meta,
    pack_whole,
    resume_changes,
    saved_shapes,
    sharded_extra,
    unpack_meta,
    unpack_whole,
)

log = get_logger(__name__)

EMA_KEY = "xlatrain_ema"  # the optimizer state entry holding a parameter's moving average
EMA_WEIGHTS = "ema.safetensors"  # the EMA weights, written after each epoch

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[..., Any]


class ModelParameters:
    """What ``optimizer_fn`` receives: the model's parameters, once on the device.

    Iterating it gives the parameters, as ``torch.optim`` optimizers take them
    (``functools.partial(torch.optim.SGD, lr=0.1)`` works as it always has). It also answers what
    the model answers (``named_parameters()``, ``modules()``, ``named_children()``, ...), so a factory
    can build parameter groups by name, e.g. no weight decay for biases and norms, or call a helper
    written for the model (torchvision's ``set_weight_decay(model, ...)``) on it directly.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.model = module

    def __iter__(self) -> Iterator[torch.nn.Parameter]:
        return iter(self.model.parameters())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class DoesNotFitError(ValueError):
    """The run needs more memory per device than the device holds: refused before its first step,
    with the changes that would fit."""


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm became NaN/Inf under ``nan_policy="stop"``."""


@dataclasses.dataclass(frozen=True)
class RunShape:
    """The length of a run in optimizer steps, after gradient accumulation and devices.

    A ``scheduler_fn`` taking two arguments receives it:
    ``scheduler_fn=lambda opt, run: OneCycleLR(opt, max_lr=0.1, total_steps=run.total_steps)``.
    """

    total_steps: int  # optimizer steps over all epochs
    steps_per_epoch: int  # optimizer steps per epoch
    epochs: int


class Trainer:
    """Trains ``model`` with ``loss_fn`` and an optimizer built on the device.

    Args:
        model: the ``torch.nn.Module`` to train; moved to the device here.
        loss_fn: ``loss_fn(outputs, targets)`` returning a scalar.
        optimizer_fn: builds the optimizer from the parameters *after* they are on the device,
            e.g. ``functools.partial(torch.optim.Adam, lr=1e-3)``; it receives a
            :class:`ModelParameters`, which iterates as the parameters and names them as the model
            does (for parameter groups by name).
        scheduler_fn: optional, builds an LR scheduler from the optimizer.
        config: a :class:`~xlatrain.config.TrainConfig`.
        checkpoint: a :class:`~xlatrain.config.CheckpointConfig` (default: at each epoch end).
        backend: a Backend, a BackendConfig, or an accelerator name (``"auto"``, ``"xla"``, ...).
        accelerator, devices, strategy: where and how to run, as in Lightning, instead of
            ``backend``: ``strategy="fsdp"`` shards parameters, gradients and optimizer state over
            the processes (``"auto"``: data parallel over whatever was launched; ``"single"``,
            ``"ddp"``). :class:`~xlatrain.config.BackendConfig` holds the rest (``units``,
            ``activation_checkpointing``).
        init_weights: for a model built on the ``meta`` device (too large to build on the host),
            ``init_weights(model)`` initialises its weights in place once each device holds its
            part; default: every submodule's ``reset_parameters()``.
        label_names: names of multilabel outputs, used in per-label metric columns.
        metrics_fn: ``metrics_fn(outputs, targets) -> {name: value}`` on the host, over the whole
            evaluation set in dataset order (outputs/targets as the model and dataset give them,
            stacked); its keys join the history as ``val_<name>``.
        collate_fn: makes one training batch from a list of dataset items (mixup/cutmix soft
            targets, say); the dry run and the memory plan use it too. Evaluation stacks items as
            they are. Default: stack each field.
        sampler: the training order, as a sampler over dataset indices shared by every process
            (split over them as the Trainer's own order), or a factory ``sampler(dataset,
            num_replicas=N, rank=r)`` building each process's own (``DistributedSampler``,
            repeated augmentation). See :class:`~xlatrain.data.sampling.UserSampler`.
        batch_transform: ``batch_transform(batch) -> batch`` on each batch once it is on the device
            (training, evaluation, prediction, the dry run): normalisation or augmentation on the
            accelerator, a memory format. It receives the batch as the dataset's items stack
            (``(inputs, targets)`` by default); under XLA it is traced into the step.
        callbacks: objects with any of ``on_fit_start``, ``on_interval``, ``on_epoch_end``,
            ``on_checkpoint``, ``on_fit_end``; see :mod:`xlatrain.train.callbacks`.
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
    counter measures one step. See :mod:`xlatrain.train.perf`.

    Example:
        >>> trainer = Trainer(model, nn.CrossEntropyLoss(), partial(torch.optim.Adam, lr=1e-3),
        ...                   config=TrainConfig(epochs=3, batch_size=32, run_dir="runs/x"))
        >>> history = trainer.fit(train_set, val_set)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer_fn: OptimizerFactory,
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
    ) -> None:
        ensure_console()  # messages from here on (scale_lr, resume) reach a console
        _check_arguments(model, loss_fn, optimizer_fn, scheduler_fn, config, checkpoint, metrics_fn)
        _check_pipeline_arguments(collate_fn, sampler, batch_transform)
        self._collate = collate_fn or collate
        self._batch_transform = batch_transform
        self._sampler = sampler
        self._callbacks = Callbacks(callbacks)
        self._stop_reason: str | None = None
        self._ema_ready = False  # the optimizer's state holds an EMA of every parameter
        self._optimizer_stepped = False  # the optimizer has taken a step (and built its state)
        self.config = cfg = config or TrainConfig()
        self.checkpoint = checkpoint or CheckpointConfig()
        self.layout = BatchLayout(inputs, targets)
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
        self.task = infer_task(loss_fn) if cfg.task == "auto" else cfg.task
        monitor, mode = default_monitor(self.task)
        self.monitor = cfg.monitor or monitor
        # TrainConfig refuses a monitor whose direction is neither given nor known from its name.
        self.monitor_mode = cfg.monitor_mode or (mode if cfg.monitor is None else monitor_mode_for(self.monitor))
        self.loss_fn = loss_fn
        self.label_names = list(label_names) if label_names is not None else None
        self.metrics_fn = metrics_fn
        self._run_config = {k: v for k, v in (run_config or {}).items() if k not in ("trainer", "checkpoint")}
        if has_meta_tensors(model):
            rt.seed_everything(cfg.seed)  # the weights drawn on the devices depend on the seed only
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
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
        if cfg.ema_decay is not None:  # the EMA joins the optimizer's state once it has one
            self.optimizer.register_step_post_hook(lambda *_: setattr(self, "_optimizer_stepped", True))
        if cfg.scale_lr and st.world_size > 1:
            before = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * st.world_size
            self._say(
                f"learning rate scaled x{st.world_size} by device count (scale_lr=True): "
                f"{before[0]:g} -> {self.optimizer.param_groups[0]['lr']:g}"
            )
        # Built after any scaling, so the schedule starts from the scaled rate; one that needs the
        # run's length is built by fit, once the training data is known.
        self._scheduler_fn = scheduler_fn
        self._scheduler_wants_run = scheduler_fn is not None and _required_positional(scheduler_fn) >= 2
        self.scheduler = scheduler_fn(self.optimizer) if scheduler_fn is not None and not self._scheduler_wants_run else None
        self.history: list[dict[str, Any]] = []
        self._eval_loss: EvalLoss | None = None
        self._run_dir = Path(cfg.run_dir)
        self._nonfinite: tuple[int, int, int, int] | None = None  # set by a deferred read
        self._config_record: dict[str, Any] = {}
        self._term_names: list[str] = []  # the loss's named terms, learnt in the dry run
        self._start_loss_sum: float | None = None  # the resumed epoch's loss sum, from the checkpoint
        # Who hears the run's points: the user's callbacks, and while fit runs xlatrain's own
        # observers (progress, TensorBoard, trace, diagnostics) before them.
        self._observers = Observers([], self._callbacks)
        self._lock: run_lock.RunLock | None = None  # held by the main process while fit runs
        self._remote: RemoteRun | None = None  # run_dir on object storage: run_dir is then its local copy
        self._feed: _TrainFeed | None = None
        self._clear_pending = False  # resume="overwrite" clears the earlier run once the checks pass
        self._created_run_dir = False  # this fit made the run directory (removed again if it fails at once)
        self.epochs_trained = 0  # epochs the last fit call trained (0: it found nothing to train)
        self.memory_plan: perf.MemoryPlan | None = None  # what a device needs: measured by fit before the first step
        self.throughput: perf.Throughput | None = None  # model FLOPs and the device's peak: set by fit

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
        return self._remote.url if self._remote is not None else str(self._run_dir)

    def publish(self, *names: str) -> None:
        """Files written into :attr:`run_dir` after ``fit`` (a recipe's ``config.yaml``, a plot)
        go up to the run's object-storage URL too (main process); a local run has nothing to do."""
        if self._remote is not None and self.strategy.is_main and self._remote.lost_to is None:
            for name in names:
                storage.upload(self._run_dir / name, f"{self._remote.url}/{name}")

    @property
    def run_dir(self) -> Path:
        """The directory this run writes to (``config.run_dir``, or a new sibling for resume=False;
        for a ``run_dir`` on object storage, its local working copy: see :attr:`run_location`)."""
        return self._run_dir

    def fit(self, train_data: Any, val_data: Any | None = None, *, resume: bool | str = "auto") -> list[dict[str, Any]]:
        """Train for ``config.epochs`` epochs, validating after each; returns the history rows.

        Writes ``history.csv`` / ``history.json`` after every epoch, ``best.safetensors`` whenever
        the monitored metric improves, and checkpoints per ``checkpoint`` config.

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
        self._open_run_dir(resume)
        try:
            return self._fit(train_data, val_data, resume)
        except BaseException:
            self._remove_unused_run_dir()
            raise
        finally:
            try:
                self._remote_close()
            finally:
                if self._lock is not None:
                    self._lock.release()
                    self._lock = None

    def _fit(self, train_data: Any, val_data: Any | None, resume: bool | str) -> list[dict[str, Any]]:
        cfg, rt, st = self.config, self.runtime, self.strategy
        self.epochs_trained = 0
        self._stop_reason = None
        _check_dataset("train_data", train_data)
        if isinstance(train_data, BatchSource) and (self._sampler is not None or self._collate is not collate):
            raise ValueError(
                f"sampler= and collate_fn= choose and stack a dataset's items, but train_data is a "
                f"{type(train_data).__name__}, which reads and batches its own records: pass a map-style dataset "
                "(one with __getitem__ and __len__), or leave sampler= and collate_fn= out"
            )
        if val_data is not None:
            _check_dataset("val_data", val_data)
        rt.seed_everything(cfg.seed)
        self._feed = feed = _TrainFeed(self, train_data)
        if val_data is None and self.monitor.startswith("val_") and cfg.monitor is None:
            self.monitor, self.monitor_mode = "train_loss", "min"  # nothing validated to monitor
        self._config_record = {
            **self._run_config,
            "trainer": dataclasses.asdict(cfg),
            "checkpoint": dataclasses.asdict(self.checkpoint),
            "run": {"global_batch": self.global_batch_size * cfg.grad_accum_steps, "num_train_samples": len(train_data)},
        }
        self._dry_run(train_data, val_data)
        self._plan(train_data)
        self._clear_earlier_run()
        if self._scheduler_wants_run and self.scheduler is None:
            per_epoch = feed.steps_per_epoch // cfg.grad_accum_steps
            shape = RunShape(total_steps=per_epoch * cfg.epochs, steps_per_epoch=per_epoch, epochs=cfg.epochs)
            self.scheduler = self._scheduler_fn(self.optimizer, shape)
        self._start_loss_sum = None
        cursor, sums = self._resume(resume)
        self.history = cursor.history
        # A resumed run's averages came back with the optimizer's state.
        self._ema_ready = cfg.ema_decay is not None and all(
            EMA_KEY in self.optimizer.state.get(p, {}) for g in self.optimizer.param_groups for p in g["params"])
        if self.checkpoint.enabled and cursor.next_position()[0] <= cfg.epochs:
            self._check_disk_room()
        self._say(
            f"xlatrain: {self.backend.describe()} | global batch {self.global_batch_size * cfg.grad_accum_steps} = "
            f"{cfg.batch_size} per device x {st.world_size} device(s)"
            + (f" x {cfg.grad_accum_steps} accumulation steps" if cfg.grad_accum_steps > 1 else "")
            + f" | {feed.steps_per_epoch // cfg.grad_accum_steps} optimizer steps per epoch"
            + f" | precision {cfg.precision} | run dir "
            + (f"{self._remote.url} (working copy {self.run_dir})" if self._remote is not None else f"{self.run_dir}")
        )
        for note in rt.notes(cfg.compile):
            self._say(f"note: {note}")
        assert self.memory_plan is not None and self.throughput is not None
        self._say(f"memory per device, before the first step: {self.memory_plan.summary()}")
        self._say(self.throughput.summary())
        self._note_sampler_length(feed)
        first_epoch, start_step = cursor.next_position()
        if self._patience_spent(cursor):
            self._say(
                f"this run stopped early after epoch {cursor.epoch} ({self.monitor} last improved in epoch "
                f"{cursor.best_epoch}, early_stop_patience={cfg.early_stop_patience}): nothing to train"
            )
            first_epoch = cfg.epochs + 1
        elif first_epoch > cfg.epochs:
            self._say(
                f"all {cfg.epochs} epoch(s) of this run are done: nothing to train. Raise epochs to train "
                "on, or start over (resume=False; --fresh on the command line)."
            )
        if first_epoch > cfg.epochs:
            return self.history  # a finished run: every file stays as it is
        with contextlib.ExitStack() as run:
            obs = self._observers = self._run_observers(run, cursor, first_epoch)
            stop = run.enter_context(_StopSignals(self._say))
            obs.call("on_fit_start", self)
            for epoch in range(first_epoch, cfg.epochs + 1):
                started = time.perf_counter()
                cursor.epoch, cursor.step, cursor.epoch_done = epoch, start_step, False
                lr = self.optimizer.param_groups[0]["lr"]
                row: dict[str, Any] = {"epoch": epoch, "lr": lr, **self._train_epoch(feed, cursor, sums, stop)}
                if val_data is not None:
                    metrics = self.evaluate(val_data)
                    row.update({f"val_{k}": v for k, v in metrics.items() if k != "num_samples"})
                    if cfg.ema_decay is not None:
                        with self._ema_weights():
                            metrics = self.evaluate(val_data)
                        row.update({f"val_ema_{k}": v for k, v in metrics.items() if k != "num_samples"})
                row["epoch_time_s"] = round(time.perf_counter() - started, 3)
                sums, start_step = self._new_sums(), 0
                self._finish_epoch(row, cursor, sums)
                self.epochs_trained += 1
                if self.epochs_trained == 1:
                    self._report_peak()
                obs.call("on_epoch_end", self, row)
                if self._patience_spent(cursor):
                    self._say(
                        f"early stop: {self.monitor} has not improved for {cfg.early_stop_patience} epoch(s) "
                        f"(best {cursor.best:.4f} in epoch {cursor.best_epoch})"
                    )
                    break
                # One host collective per epoch, and only where a callback could have asked.
                if self._callbacks and epoch < cfg.epochs and st.any_process(self._stop_reason is not None):
                    why = st.gather_objects(self._stop_reason) if st.num_processes > 1 else [self._stop_reason]
                    self._say(f"stopped after epoch {epoch}: {next(r for r in why if r is not None)} (request_stop)")
                    break
            obs.call("on_run_end", self)
        st.barrier()
        obs.call("on_fit_end", self, self.history)
        return self.history

    def _run_observers(self, run: contextlib.ExitStack, cursor: Cursor, first_epoch: int) -> Observers:
        """xlatrain's own observers of this fit, each closed however the run ends (finished,
        preempted, failed): event files flushed, a trace written, the compile watch's callback
        removed; after the run only the user's callbacks are left."""
        cfg, rt, st = self.config, self.runtime, self.strategy
        run.callback(setattr, self, "_observers", Observers([], self._callbacks))
        own: list[Any] = [ProgressObserver(
            interactive=interactive_terminal(st.is_main), log=self._say,
            rate_note=self.throughput.text if self.throughput is not None else None,
        )]
        tb = run.enter_context(
            TensorBoardLog(self.run_dir, enabled=cfg.tensorboard, is_main=st.is_main, start_step=cursor.global_step))
        if tb.enabled:
            own.append(TensorBoardObserver(tb, self._config_record))
        if cfg.profile_steps:
            own.append(TraceObserver(run.enter_context(contextlib.closing(StepTrace(
                self.run_dir, cfg.profile_steps, trace_kind=rt.trace_kind, is_main=st.is_main, platform=rt.platform)))))
        if cfg.diagnostics:
            watch = run.enter_context(CompileWatch().start(first_epoch=first_epoch)) if cfg.compile else None
            diag = RunDiagnostics(rt, st, per_device_batch=cfg.batch_size, strict=cfg.strict,
                                  grad_accum_steps=cfg.grad_accum_steps, compile_watch=watch)
            assert self.memory_plan is not None and self.throughput is not None
            plan, rate = self.memory_plan, self.throughput
            own.append(DiagnosticsObserver(diag, lambda: {"memory": plan.as_dict(), "throughput": rate.as_dict()}))
        return Observers(own, self._callbacks)

    def _finish_epoch(self, row: dict[str, Any], cursor: Cursor, sums: dict[str, torch.Tensor]) -> None:
        """An epoch's bookkeeping, in the order a resume relies on: history and TensorBoard are
        written before the checkpoint that marks the epoch done."""
        cfg, st = self.config, self.strategy
        self._observers.call("on_epoch_row", self, row)
        row.update(self.runtime.runtime_stats())
        if self.scheduler is not None and cfg.scheduler_interval == "epoch":
            self.scheduler.step()
        improved = self._track_best(row, cursor)
        self.history.append(row)
        cursor.epoch_done = True
        if st.is_main:
            with _writing(self.run_dir / "history.json"):
                write_history(self.run_dir, self.history)
        if self._observers.wants("on_epoch_written"):
            self._observers.call("on_epoch_written", self, row, cursor,
                                 cursor.epoch == cfg.epochs or self._patience_spent(cursor))
        if cfg.ema_decay is not None:
            with self._ema_weights(), _writing(self.run_dir / EMA_WEIGHTS):
                self.save_weights(self.run_dir / EMA_WEIGHTS)
        if self.checkpoint.enabled and self.checkpoint.at_epoch_end:
            self._save_checkpoint(cursor, sums)
        self._say(_epoch_line(row, cfg.epochs, self.monitor, improved))

    def evaluate(self, data: Any) -> dict[str, float]:
        """Loss and task metrics over ``data``, every sample counted exactly once."""
        rt, st = self.runtime, self.strategy
        _check_dataset("data", data)
        if self._eval_loss is None:
            self._dry_run(None, data)
        assert self._eval_loss is not None
        batches, layout = self._eval_batches(data)
        batches = self._observers.batches(batches, "eval", 0)
        keep_rows = self.metrics_fn is not None or self.task == "multilabel" or self._eval_loss.per_sample is None
        acc = EvalAccumulator(self.task, rt.device, self._eval_loss, RowCollector(rt, st, layout) if keep_rows else None,
                              top_k=self.config.top_k)
        self.model.eval()
        with torch.no_grad():
            for batch, valid_B in batches:
                args, targets = self.layout.split(self._on_device(batch))
                with self.precision.autocast():
                    outputs = self._forward(*args)
                outputs = as_float(outputs)
                acc.update(outputs, targets, valid_B)
                rt.step_end()
        return acc.compute(rt, st, self.label_names, self.metrics_fn)

    def predict(self, data: Any) -> Any:
        """Model outputs for every item of ``data``, in dataset order, on the host.

        Items may be ``(inputs, targets)`` pairs (targets are ignored), bare inputs, or mappings /
        dataclasses read through the Trainer's ``inputs=`` keys. Models returning several tensors
        (a tuple or dict) get the same structure back, each stacked.
        """
        _check_dataset("data", data)
        batches, layout = self._eval_batches(data)
        rows = RowCollector(self.runtime, self.strategy, layout)
        self.model.eval()
        with torch.no_grad():
            for item, _valid in batches:
                with self.precision.autocast():
                    rows.add(as_float(self._forward(*self.layout.model_args(self._on_device(item)))))
                self.runtime.step_end()
        return rows.result()

    def save_weights(self, path: str | os.PathLike[str]) -> Path | None:
        """Write the model's whole weights to a safetensors file (``xlatrain.load_weights`` reads
        it). Call it on every process: a sharded model is gathered onto the main process, which
        writes the file and returns its path (the others return ``None``)."""
        with self.runtime.planned_transfers():
            whole = self.strategy.whole_weights(self.model, self.runtime.read)
        return write_weights(path, *whole) if whole is not None else None

    def _dry_run(self, train_data: Any | None, val_data: Any | None) -> None:
        """Run the model and loss on one batch before any training, so a batch layout, a loss or a
        task metric that cannot work fails now, with its cause, and not after an epoch.

        The model runs in eval mode without gradients and host random state is put back, so the
        run's numbers are what they would be without it. On XLA nothing executes: the shapes are
        traced only and the traced graph is dropped.
        """
        model = self.model
        was_training = model.training
        host_rng = host_rng_state()
        role, batch = "training", None
        try:
            model.eval()
            with torch.no_grad():
                for role, data in (("training", train_data), ("validation", val_data)):
                    if data is None:
                        continue
                    device = self.runtime.device
                    host_batch = _first_batch(data, collate_fn=self._collate if role == "training" else collate)
                    batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, host_batch)
                    args, targets = self.layout.split(self._on_device(batch))
                    _check_class_targets(self.loss_fn, self.layout.split(host_batch)[1])
                    with self.precision.autocast():
                        outputs = model(*args)
                        _check_class_outputs(self.loss_fn, outputs, self.layout.split(host_batch)[1])
                        with warnings.catch_warnings(record=True) as caught:
                            warnings.simplefilter("always")
                            result = self.loss_fn(outputs, targets)
                    _refuse_broadcast_loss(caught, self.loss_fn)
                    _, terms = loss_terms(result)
                    if role == "training":
                        self._term_names = list(terms)
                    if role == "validation" or self._eval_loss is None:
                        self._eval_loss = EvalLoss.choose(self.loss_fn, as_float(outputs), targets)
                    if role == "validation":
                        _check_task(self.task, outputs, targets, self.config.top_k)
        except ValueError as exc:
            raise ValueError(f"a dry run on one {role} batch, before training: {exc}") from None
        except Exception as exc:  # the user's model or loss failed: keep its own error, say where
            if hasattr(exc, "add_note"):
                exc.add_note(
                    f"xlatrain: raised in a dry run on one {role} batch, before training: loss_fn "
                    f"{self.loss_fn!r}, model {type(self.strategy.unwrap(model)).__name__}, batch {_shapes(batch)}"
                )
            raise
        finally:
            set_host_rng_state(host_rng)
            model.train(was_training)
        if train_data is not None:
            self._check_monitor(val_data)

    def _plan(self, train_data: Any) -> None:
        """Measure what one training step needs of a device and what it computes, before the first
        step (:mod:`xlatrain.train.perf`); refuse a run that cannot fit, naming what would."""
        cfg, rt, st = self.config, self.runtime, self.strategy
        module = st.unwrap(self.model)  # DDP's inner module: no gradient reduction is set up
        samples = min(len(train_data), perf.PROFILE_SAMPLES)
        flops, flops_source, tokens = perf.model_flops(module)

        def loss_of(precision: Precision) -> Callable[[int], torch.Tensor]:
            def run(n: int) -> torch.Tensor:
                host = _first_batch(train_data, rows=n, collate_fn=self._collate)
                args, targets = self.layout.split(
                    self._on_device(tree_map(lambda t: t.to(rt.device) if isinstance(t, torch.Tensor) else t, host)))
                with precision.autocast():
                    return loss_terms(self.loss_fn(module(*args), targets))[0]
            return run

        # Random draws of the measured step (dropout, augmentations; host and device) are undone.
        rng = rt.rng_state()
        try:
            profile = perf.profile_step(module, st.unit_modules, rt.device.type, loss_of(self.precision), samples,
                                        count=flops is None)
        except Exception as exc:  # the user's model or loss failed with gradients on: say where
            if hasattr(exc, "add_note"):
                exc.add_note(
                    f"xlatrain: raised while measuring one training step before training (forward pass with "
                    f"gradients{'' if flops else ' and backward pass'} on {samples} sample(s), model "
                    f"{type(module).__name__}, loss_fn {self.loss_fn!r})"
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
        self.throughput = perf.Throughput(
            flops_per_sample=flops, flops_source=flops_source, tokens_per_sample=tokens,
            peak_per_device=peak[0] if peak else None, peak_source=peak[1] if peak else "not in xlatrain's table",
            devices=st.world_size, dtype=str(compute).removeprefix("torch."),
        )
        state = st.planned_state_bytes(self.model, self.optimizer)
        if cfg.ema_decay is not None and not self._ema_pairs():  # the averages: one more copy of the weights
            state = {**state, "optimizer": state["optimizer"] + state["parameters"]}
        capacity = self.backend.device_memory or rt.memory_capacity()
        self.memory_plan = plan = perf.MemoryPlan(
            parameters=state["parameters"], gradients=state["gradients"], optimizer=state["optimizer"],
            optimizer_source=state["optimizer_source"], activations=profile.activations, batch=cfg.batch_size,
            checkpointed=st.activation_checkpointing, gathered=st.gathered_bytes(self.model, self.precision),
            capacity=capacity[0] if capacity else None,
            capacity_source=capacity[1] if capacity else "the runtime reports no capacity",
        )
        if not st.any_process(plan.fits is False):
            if plan.capacity is not None and plan.total > perf.HEADROOM * plan.capacity:
                self._say(
                    f"memory: the estimate before the first step is {100 * plan.total / plan.capacity:.0f}% of what a "
                    f"device holds ({plan.summary()}); the step's peak is higher, so it may not fit"
                )
            return
        bf16 = None
        if cfg.precision != "bf16":
            bf16 = perf.profile_step(module, st.unit_modules, rt.device.type, loss_of(Precision("bf16", rt.autocast_device)),
                                     samples, count=False).activations
        units = st.unit_modules
        whole = weight_bytes(module)
        plan.fixes = perf.plan_fixes(
            plan, whole_state=int((plan.parameters + plan.gradients + plan.optimizer) * whole / max(plan.parameters, 1)),
            world_size=st.world_size, sharded=st.sharded_state, precision=cfg.precision, bf16_activations=bf16,
            unit_bytes=max((weight_bytes(u) for u in units), default=0),
            root_bytes=whole - sum(weight_bytes(u) for u in units), grad_accum_steps=cfg.grad_accum_steps,
        )
        raise DoesNotFitError(plan.refusal())

    def _report_peak(self) -> None:
        """After the first epoch: the most memory a device held, beside the estimate."""
        peak = self.runtime.memory_peak()
        if peak is None or self.memory_plan is None:
            return
        self.memory_plan.measured_peak = peak
        self._say(
            f"memory per device: measured peak {perf.human_bytes(peak[0])} ({peak[1]}) beside the estimate "
            f"{perf.human_bytes(self.memory_plan.total)} before the first step"
        )

    def _check_monitor(self, val_data: Any | None) -> None:
        """``monitor`` must name a column this run's history will have: known after the dry run
        (the loss's terms, the task's metrics), checked before the first step."""
        prefixes = ["train_"] + (["val_"] if val_data is not None else [])
        columns = {f"{p}{t}" for p in prefixes for t in ("loss", *self._term_names)}
        if val_data is not None and self.task == "classification":
            columns |= {"val_accuracy", *(f"val_top{k}_accuracy" for k in self.config.top_k)}
        if val_data is not None and self.task == "multilabel":
            columns.add("val_mean_auc")
            columns |= {f"val_auc_{name}" for name in self.label_names or ()}
        if self.config.ema_decay is not None:  # the EMA weights are scored as the live ones are
            columns |= {"val_ema_" + c.removeprefix("val_") for c in columns if c.startswith("val_")}
        columns |= {"lr", "epoch_time_s"} | ({"input_bound_share"} if self.config.diagnostics else set())
        unknowable = val_data is not None and (
            (self.metrics_fn is not None and self.monitor.startswith("val_"))
            or (self.task == "multilabel" and self.label_names is None
                and self.monitor.startswith(("val_auc_", "val_ema_auc_")))
        )
        if self.monitor not in columns and not unknowable:
            raise ValueError(
                f"monitor={self.monitor!r} is not a column this run's history will have; it will have "
                f"{', '.join(sorted(columns))}"
                + ("" if val_data is not None else " (no validation data was given, so no val_ columns)")
                + ". Set monitor (trainer.monitor) to one of them, with monitor_mode for a name of your own"
            )

    # ----------------------------------------------------------------------------------------
    def _train_epoch(
        self, feed: _TrainFeed, cursor: Cursor, sums: dict[str, torch.Tensor], stop: _StopSignals
    ) -> dict[str, float]:
        """Train ``cursor.epoch`` from ``cursor.step``; ``sums`` hold the epoch's loss (and terms)
        so far. Returns the epoch's mean loss and terms as history columns (``train_...``)."""
        cfg, rt, st = self.config, self.runtime, self.strategy
        accum, num_steps = cfg.grad_accum_steps, feed.steps_per_epoch
        every = self.checkpoint.every_steps if self.checkpoint.enabled else None
        self.model.train()
        obs = self._observers
        batches = obs.batches(feed.batches(cursor.epoch, cursor.step), "train", cursor.epoch, cursor.step + 1)
        meter = IntervalMeter(cursor.step, samples_per_step=self.global_batch_size, start_loss_sum=self._start_loss_sum)
        started, first_step = time.perf_counter(), cursor.step
        self._start_loss_sum = None  # later epochs start from zero
        step_start, step_end = obs.hooks("on_step_start"), obs.hooks("on_step_end")
        before = (cursor.epoch - 1) * num_steps  # the trace counts over the run
        last_logged, fetch_started, extra = cursor.step, time.perf_counter(), False
        with obs.epoch(self, cursor.epoch, cursor.step, num_steps):  # the bar goes however the epoch ends
            for step, batch in enumerate(batches, start=cursor.step + 1):
                if step > num_steps:
                    extra = True  # a source that gives more batches than it announced: the schedule ends at that count
                    break
                input_wait_s = time.perf_counter() - fetch_started
                for fn in step_start:
                    fn(before + step)
                last_micro = step % accum == 0
                self._train_step(batch, cursor, step, last_micro, sums)
                for fn in step_end:
                    fn(step, before + step, input_wait_s)
                if step % cfg.log_every == 0 and step < num_steps:
                    # A micro step before its optimizer step is plotted at that coming step, so
                    # every point logged after a checkpoint at step T lies after T.
                    tb_step = cursor.global_step + (0 if last_micro else 1)
                    show = self._interval(meter, cursor.epoch, last_logged + 1, step, tb_step)
                    rt.defer(show, [st.all_reduce_mean(sums["loss"]), sums["nonfinite"]])
                    last_logged = step
                if self._nonfinite is not None:
                    self._fail_nonfinite()
                # Agreeing on a stop is a host collective when there are several processes, so it
                # happens at log intervals there; a single process checks every step for free.
                if last_micro and (st.num_processes == 1 or step % cfg.log_every < accum) and st.any_process(stop.requested):
                    self._preempt(cursor, sums, stop)
                if last_micro and every is not None and cursor.global_step % every == 0 and step < num_steps:
                    self._save_checkpoint(cursor, sums)
                fetch_started = time.perf_counter()
        ran = self._count_steps(feed, cursor, num_steps, cursor.step, extra)
        names = [k for k in sums if k != "nonfinite"]
        *totals, bad = rt.read([*(st.all_reduce_mean(sums[k]) for k in names), sums["nonfinite"]])
        self._check_nonfinite(float(bad), cursor.epoch, 1, ran)
        good_steps = max(ran - float(bad) if cfg.nan_policy == "skip_step" else ran, 1)
        row = {"train_" + name.removeprefix("term."): float(total) / good_steps for name, total in zip(names, totals)}
        # Over the epoch's training (its first step's compilation included; validation not).
        rate = (ran - first_step) * self.global_batch_size / max(time.perf_counter() - started, 1e-9)
        figures = self.throughput.figures(rate) if self.throughput is not None else {}
        return {**row, "samples_per_s": round(rate, 2), **{k: float(f"{v:.4g}") for k, v in figures.items()}}

    def _on_device(self, batch: Any) -> Any:
        """A batch on the device as the model gets it: images in channels-last memory order
        (``channels_last``), then the user's ``batch_transform``."""
        if self.config.channels_last:
            batch = tree_map(_channels_last, batch)
        return self._batch_transform(batch) if self._batch_transform is not None else batch

    # --- the exponential moving average of the weights (ema_decay) ---------------------------
    def _ema_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its average) for every parameter the optimizer trains that has one."""
        state = self.optimizer.state
        return [(p, state[p][EMA_KEY]) for group in self.optimizer.param_groups for p in group["params"]
                if EMA_KEY in state.get(p, {})]

    @torch.no_grad()
    def _ema_update(self) -> None:
        """``ema = decay * ema + (1 - decay) * weights`` on the device; the first update copies the
        weights (as torchvision's ``AveragedModel`` does).

        The averages live in the optimizer's state (key ``xlatrain_ema``), beside its moments: they
        are sharded as the parameters are, counted in the memory plan as optimizer state, and
        saved and restored with it by every strategy's checkpoint. The first update waits for the
        optimizer's first step that ran (not one a gradient scaler skipped): an optimizer that
        builds its state at its first step (Adam) would take an entry made before as its state.
        """
        state = self.optimizer.state
        if not self._ema_ready:
            if not self._optimizer_stepped and not any(state.values()):
                return
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if EMA_KEY not in state[p]:
                        state[p][EMA_KEY] = p.detach().clone()
            self._ema_ready = True
            return
        pairs = self._ema_pairs()
        torch._foreach_lerp_([e for _, e in pairs], [p.detach() for p, _ in pairs], 1.0 - self.config.ema_decay)

    @contextlib.contextmanager
    def _ema_weights(self) -> Iterator[None]:
        """The model holds the EMA weights inside (buffers stay the live model's), its own after."""
        pairs = self._ema_pairs()
        with torch.no_grad():
            live = [p.detach().clone() for p, _ in pairs]
            for p, e in pairs:
                p.detach().copy_(e)
        try:
            yield
        finally:
            with torch.no_grad():
                for (p, _), saved in zip(pairs, live):
                    p.detach().copy_(saved)

    def _note_sampler_length(self, feed: _TrainFeed) -> None:
        """A user's sampler whose length is not what it gives: the steps come from what it gives."""
        sampler = feed.sampler
        if not isinstance(sampler, UserSampler):
            return
        says, gives = sampler.announced(), sampler.given()
        if says is not None and says != gives:
            self._say(
                f"note: the sampler's len() is {says} but it gave {gives} indices in epoch 1"
                + (" on this process" if sampler.per_process else "")
                + f": the Trainer runs the {feed.steps_per_epoch} step(s) per epoch those make, and sizes the "
                "schedule by them"
            )

    def _count_steps(self, feed: _TrainFeed, cursor: Cursor, announced: int, step_done: int, extra: bool) -> int:
        """The steps this epoch ran, said beside the announced count where they differ.

        The loss mean and the samples/s are over the steps that ran. Micro-batches of an
        accumulation group the epoch cut short are dropped (their gradients never reach a step).
        """
        if step_done == announced and not extra:
            return announced
        if step_done % self.config.grad_accum_steps:
            self.optimizer.zero_grad(set_to_none=True)
        source = "the sampler" if self._sampler is not None else f"{type(feed.dataset).__name__}.train_batches"
        self._say(
            f"warning: epoch {cursor.epoch} ran {step_done} step(s), but {announced} were announced from the data's "
            f"length: {source} gave {'more' if extra else 'fewer'} batches. The epoch's train_loss is "
            f"the mean over the {step_done} that ran"
            + (f"; the batches after step {announced} were not trained on" if extra else "")
            + "; a schedule sized by run.total_steps assumed the announced count. Give the data a length that "
            "matches what it yields"
        )
        return step_done

    def _train_step(self, batch: Any, cursor: Cursor, step: int, last_micro: bool, sums: dict[str, torch.Tensor]) -> None:
        """One micro-batch: forward, loss, backward, and on the last micro-batch the optimizer step.

        Nothing here reads the device: the loss and its terms are added to ``sums`` on it.
        """
        cfg, rt, st, model, opt = self.config, self.runtime, self.strategy, self.model, self.optimizer
        accum, guard = cfg.grad_accum_steps, cfg.nan_policy == "skip_step"
        args, targets = self.layout.split(self._on_device(batch))
        rt.step_begin(((cfg.seed * 1_000_003 + cursor.epoch) * 1_000_003 + step) % 2**62)
        with contextlib.nullcontext() if last_micro else st.no_sync(model), _in_step(self, cursor, step) as where:
            with self.precision.autocast():
                outputs = self._forward(*args)
                where[0] = "loss"  # described only if it raises: a loss's repr can be long to build
                loss, terms = loss_terms(self.loss_fn(outputs, targets))  # shapes only: no sync
                where[0] = "backward"
            if not loss.requires_grad:  # host metadata: no device read
                raise ValueError(
                    f"loss_fn {self.loss_fn!r} returned a loss that does not depend on the model's parameters (no "
                    "grad_fn), so nothing can be trained: it was detached, turned into a number (.item(), float()) "
                    "and back, or computed from the targets alone. Return the loss tensor computed from the outputs"
                )
            loss_to_step = loss / accum if accum > 1 else loss
            (self.grad_scaler.scale(loss_to_step) if self.grad_scaler is not None else loss_to_step).backward()
        if list(terms) != self._term_names:
            raise ValueError(
                f"loss_fn returned the terms {list(terms)} at epoch {cursor.epoch} step {step} but "
                f"{self._term_names} before: return the same named terms at every step"
            )
        loss = loss.detach().float()
        finite = torch.isfinite(loss)
        if last_micro:
            st.reduce_gradients(opt)
            scaler = self.grad_scaler
            if scaler is not None:
                scaler.unscale_(opt)  # clipping sees the true gradients
            if guard or cfg.clip_grad_norm is not None:
                norm = st.clip_grad_norm(model, cfg.clip_grad_norm or math.inf)
                if scaler is None:  # under fp16 an overflow is the scaler's to skip, not a fault
                    finite = finite & torch.isfinite(norm)
            if scaler is not None:
                # The scaler skips a step whose gradients overflowed (and a NaN loss's), then
                # lowers its scale. Unless the optimizer is fused, it reads on the host whether
                # they did: a planned read, once per optimizer step, as every fp16 loop has it.
                with rt.planned_transfers():
                    scaler.step(opt)
                scaler.update()
            else:
                st.optimizer_step(opt, finite if guard else None)
            opt.zero_grad(set_to_none=True)
            if self.scheduler is not None and cfg.scheduler_interval == "step":
                self.scheduler.step()
            cursor.global_step += 1
            if cfg.ema_decay is not None and (cursor.global_step % cfg.ema_every == 0 or not self._ema_ready):
                self._ema_update()
        for name, value in (("loss", loss), *((f"term.{t}", v.detach().float()) for t, v in terms.items())):
            sums[name] = sums[name] + (torch.where(finite, value, 0.0) if guard else value)
        sums["nonfinite"] = sums["nonfinite"] + (~finite).float()
        rt.step_end()
        cursor.step = step

    # --- checkpoints, resume, preemption, numerical faults ------------------------------------
    def _new_sums(self) -> dict[str, torch.Tensor]:
        # Every running sum exists from the first step, the loss's terms included, so each step
        # of an epoch has the same structure (on XLA, the same graph). Made on the host and sent
        # as data: zeros made on an XLA device would be a small graph of their own to compile.
        names = ["loss", "nonfinite", *(f"term.{t}" for t in self._term_names)]
        return {name: torch.zeros(()).to(self.runtime.device) for name in names}

    def _open_run_dir(self, resume: bool | str) -> None:
        """Pick the run directory, make it and lock it for this run (the main process does; every
        process gets its verdict). ``resume=False`` never writes into an existing run: it picks
        ``run_dir-2``, ``-3``, ...; ``"overwrite"`` clears the earlier run's files once locked."""
        st = self.strategy
        base = Path(self.config.run_dir)
        self._remote = None
        if storage.is_url(self.config.run_dir):
            url = self.config.run_dir.rstrip("/")
            if resume is False and RemoteRun(url).holds_a_run():
                n = 2
                while RemoteRun(f"{url}-{n}").holds_a_run():
                    n += 1
                self._say(f"{url} holds an earlier run; resume=False starts this one in {url}-{n}")
                url = f"{url}-{n}"
            self._remote = RemoteRun(url)
            self._run_dir = self._remote.local
        elif resume is False and _holds_a_run(base):
            n = 2
            while _holds_a_run(base.with_name(f"{base.name}-{n}")):
                n += 1
            self._run_dir = base.with_name(f"{base.name}-{n}")
            self._say(f"{base} holds an earlier run; resume=False starts this one in {self._run_dir}")
        else:
            self._run_dir = base
        error, note = None, None
        # Cleared once the dry run and the memory check passed: a run refused before its first
        # step leaves the earlier one as it was.
        self._clear_pending = resume == "overwrite"
        self._created_run_dir = False
        if st.is_main:
            try:
                self._created_run_dir = not self._run_dir.exists()
                _make_run_dir(self._run_dir)
                self._lock = run_lock.acquire(self._run_dir)
                note = run_lock.stale_note(self._lock)
                if self._remote is not None:
                    note = self._remote_open(resume) or note
            except (run_lock.RunDirError, storage.StorageError) as exc:
                error = str(exc)
                if self._lock is not None:  # refused on the store: the local copy is free again
                    self._lock.release()
                    self._lock = None
        # Every process learns the main process's verdict: a refused run stops everywhere, at once.
        error, note = st.gather_objects((error, note))[0] if st.num_processes > 1 else (error, note)
        if error is not None:
            raise run_lock.RunDirError(error)
        if note:
            self._say(note)

    def _remote_open(self, resume: bool | str) -> str | None:
        """The main process: lock the run on object storage, and bring down what a resume needs."""
        assert self._remote is not None
        note = self._remote.acquire()
        if not self._remote.holds_a_run() and _holds_a_run(self._run_dir):
            # The store is the run's record: a local copy of a run it no longer holds (removed
            # there, or made by another session) is not continued.
            removed = _clear_run(self._run_dir)
            self._say(f"{self._remote.url} holds no run: removed the stale working copy's {', '.join(removed)}")
        if resume not in (False, "overwrite"):
            pulled = self._remote.pull()
            if pulled:
                self._say(f"brought down {len(pulled)} file(s) of {self._remote.url} into its working copy {self._run_dir}")
        return note

    def _remote_close(self) -> None:
        """The main process: the run's last files up, and its lock on object storage removed."""
        if self._remote is None or not self.strategy.is_main:
            return
        try:
            if self._run_dir.is_dir() and self._remote.lost_to is None:
                self._remote.push_files()
        finally:
            self._remote.release()

    def _clear_earlier_run(self) -> None:
        """``resume="overwrite"``: remove the earlier run's files, now that this one can start."""
        if not self._clear_pending:
            return
        self._clear_pending = False
        if self.strategy.is_main:
            if self._remote is not None:
                self._remote.clear()
            removed = _clear_run(self._run_dir)
            if removed:
                self._say(f"resume='overwrite': removed the earlier run's {', '.join(removed)} from {self._run_dir}")
        self.strategy.barrier()

    def _remove_unused_run_dir(self) -> None:
        """A run directory this fit created and that holds nothing but its lock goes again when the
        fit fails before writing anything (a refused run leaves no trace)."""
        if not (self.strategy.is_main and self._created_run_dir and self._lock is not None):
            return
        with contextlib.suppress(OSError):
            if [p.name for p in self._run_dir.iterdir()] == [run_lock.LOCK_FILE]:
                (self._run_dir / run_lock.LOCK_FILE).unlink()
                self._run_dir.rmdir()

    def _resume(self, resume: bool | str) -> tuple[Cursor, dict[str, torch.Tensor]]:
        rt, st = self.runtime, self.strategy
        cursor, sums = Cursor(), self._new_sums()
        if resume in (False, "overwrite"):
            return cursor, sums
        if resume == "auto":
            damaged: list[str] = []
            # On object storage with several processes, each brings the checkpoint it tries into its
            # host's copy first: another host's disk holds none of the main process's files, and
            # the main process's holds none of the parts other hosts wrote.
            fetch = self._remote.ensure_checkpoint if self._remote is not None and st.num_processes > 1 else None
            found = find_resumable(self.run_dir / "checkpoints", group=st, failures=damaged, fetch=fetch)
            if found is None:
                self._refuse_to_retrain(damaged)
                return cursor, sums
            path, tensors, meta = found
        else:
            path, tensors, meta = _explicit_checkpoint(Path(resume), st)
        self._check_resumable(path, tensors, meta)
        if tensors is None:  # a sharded state: each process reads the chunks its layout needs
            st.load_sharded(path / SHARDS_DIR, self.model, self.optimizer, meta["sharded"])
        else:
            weights, optim_state = unpack_whole(tensors, meta)
            st.load_whole(self.model, self.optimizer, weights, optim_state)
        cursor, per_process_sums, rng = unpack_meta(meta, self.scheduler)
        if self.grad_scaler is not None and "grad_scaler" in meta:
            self.grad_scaler.load_state_dict(meta["grad_scaler"])
        if cursor.epoch_done and cursor.best_epoch == cursor.epoch:
            cursor.best_checkpoint = path.name  # saved right after the best epoch: this one
        # What all_reduce_mean(sums["loss"]) reads at the first log interval, known here without a read.
        self._start_loss_sum = sum(p["loss"] for p in per_process_sums) / len(per_process_sums)
        if len(rng) == st.num_processes:
            mine = per_process_sums[st.process_index]
            rt.set_rng_state(rng[st.process_index])
        else:
            mine = _resharded_sums(per_process_sums, st.process_index, st.num_processes)
            # Random streams belong to processes; another process count cannot take them over.
            rt.seed_everything((self.config.seed * 1_000_003 + cursor.global_step) * 1_000_003 + st.process_index)
            self._say(
                f"the checkpoint was written by {len(rng)} process(es) and this run has {st.num_processes}: "
                "model, optimizer, schedule and data order continue exactly; random draws (dropout, "
                "augmentation) continue from a seed of the step, not from the saved streams"
            )
        sums = {k: torch.tensor(v, dtype=torch.float32).to(rt.device) for k, v in mine.items()}
        epoch, step = cursor.next_position()
        self._say(f"resumed from {path}: continuing at epoch {epoch}, step {step} (optimizer step {cursor.global_step})")
        return cursor, sums

    def _check_disk_room(self) -> None:
        """Refuse, before the first step, a run whose disk cannot hold two checkpoints (the newest
        and the one being written), estimated from the model's and optimizer's real tensors."""
        import shutil

        weights, optim = checkpoint_bytes(self.strategy.unwrap(self.model), self.optimizer)
        error = None
        if self.strategy.is_main:
            free = shutil.disk_usage(self.run_dir).free
            need = 2 * (weights + optim)
            if free < need:
                error = (
                    f"the disk holding {self.run_dir} has {_mb(free)} free, and this run needs about {_mb(need)} "
                    f"for two checkpoints (each about {_mb(weights)} of weights and {_mb(optim)} of optimizer "
                    "state; a run keeps the newest while it writes the next). Free at least "
                    f"{_mb(need - free)}, or point trainer.run_dir at a larger disk"
                )
        error = self.strategy.gather_objects(error)[0] if self.strategy.num_processes > 1 else error
        if error is not None:
            raise run_lock.RunDirError(error)

    def _refuse_to_retrain(self, damaged: list[str]) -> None:
        """An earlier run's results are never trained over unasked: when its checkpoints are all
        damaged, or it left results and no checkpoint, stop before anything is written."""
        run_dir = self.run_dir
        ways = (
            "Nothing was changed. To go on: resume from a checkpoint you trust (--resume PATH; "
            "fit(resume=PATH)), start a new run directory (--fresh; resume=False), or start over here, "
            "deleting this run's files (--overwrite; resume='overwrite')."
        )
        if damaged:
            raise run_lock.RunDirError(
                f"{run_dir} holds {len(damaged)} checkpoint(s) and none can be loaded: " + "; ".join(damaged) + ". "
                + ways
            )
        left = [name for name in ("history.json", "best.safetensors") if (run_dir / name).exists()]
        if self.strategy.num_processes > 1:  # the main process's copy decides (another host's holds none of it)
            left = self.strategy.gather_objects(left if self.strategy.is_main else None)[0]
        if left:
            raise run_lock.RunDirError(
                f"{run_dir} holds an earlier run's results ({', '.join(left)}) but no checkpoint to continue it from "
                "(checkpoints were off, or removed); training here would replace them. " + ways
            )

    def _check_resumable(self, path: Path, tensors: dict[str, torch.Tensor] | None, meta: dict[str, Any]) -> None:
        """Refuse, before anything is loaded, a checkpoint this run cannot continue; log what changed."""
        ways_on = (
            "Resume with the old values, or start over: --fresh on the command line, "
            "fit(..., resume=False) in Python (a new run directory; this one is kept)."
        )
        index = json.loads((path / SHARDS_INDEX).read_text()) if tensors is None else None
        saved = saved_shapes(tensors, index, meta.get("model_aliases", {}))
        mine = self.strategy.model_shapes(self.model)
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
        continued, refused = resume_changes(old, self._config_record, epochs_done=done)
        if refused:
            raise ValueError(f"cannot resume from {path}: the run cannot continue under {'; '.join(refused)}. {ways_on}")
        if continued:
            self._say(f"resuming with changed settings: {'; '.join(continued)}")

    def _save_checkpoint(self, cursor: Cursor, sums: dict[str, torch.Tensor]) -> Path | None:
        path = self._write_checkpoint(cursor, sums)
        if self._observers.wants("on_checkpoint"):
            st = self.strategy
            if st.num_processes > 1:  # the main process wrote it: every process hears of it once it is complete
                name = next((n for n in st.gather_objects(path.name if path else None) if n), None)
                path = self.run_dir / "checkpoints" / name if name else None  # under this process's own run dir
            self._observers.call("on_checkpoint", self, path)
        return path

    def _write_checkpoint(self, cursor: Cursor, sums: dict[str, torch.Tensor]) -> Path | None:
        rt, st = self.runtime, self.strategy
        # Every process's generators and running sums, so each continues exactly as it was.
        local = dict(zip(sums, (float(t) for t in rt.read(list(sums.values())))))
        lost = None
        if self._remote is not None and st.is_main and not self._remote.still_held():
            lost = self._remote.lost_to  # another run took the lock over: this one stops before it writes
        per_process = st.gather_objects({"rng": rt.rng_state(), "sums": local, "lost": lost})
        if per_process[0]["lost"] is not None:
            raise run_lock.RunDirError(
                f"{self.run_location}: another run took this one's lock over ({per_process[0]['lost']}), as this run "
                f"had not renewed it for {stale_after_s():,.0f} s (stalled, or cut off from the store). This run "
                "stops without writing there; the other run's checkpoints are its own")
        # A non-finite loss since the last check must not become the latest checkpoint.
        self._check_nonfinite(sum(p["sums"]["nonfinite"] for p in per_process), cursor.epoch, 1, cursor.step)
        meta = pack_meta(
            scheduler=self.scheduler, cursor=cursor, sums_per_process=[p["sums"] for p in per_process],
            rng_states=[p["rng"] for p in per_process], config=self._config_record,
        )
        if self.grad_scaler is not None:  # its scale and growth count (a read of one number)
            meta["grad_scaler"] = self.grad_scaler.state_dict()
        root = self.run_dir / "checkpoints"
        if st.sharded_state:
            # Every process writes its own part; nothing is gathered onto one of them.
            meta["model_aliases"] = distinct_weights(st.unwrap(self.model))[1]  # for `xlatrain export`
            with rt.planned_transfers():
                path = write_sharded_checkpoint(
                    root, cursor.global_step, meta,
                    lambda directory: sharded_extra(st.save_sharded(directory, self.model, self.optimizer)), st,
                    upload_part=self._remote.push_part if self._remote is not None else None,
                )
        else:
            # Every process reads the state (a read on some processes only stalls a TorchTPU
            # mesh); the main one writes it.
            tensors, whole = pack_whole(st.unwrap(self.model), self.optimizer, rt.read)
            if not st.is_main:
                return None
            path = write_checkpoint(root, cursor.global_step, tensors, {**meta, **whole})
        if cursor.epoch_done and cursor.best_epoch == cursor.epoch:
            cursor.best_checkpoint = path.name
        if st.is_main:
            prune_checkpoints(root, self.checkpoint.keep_last, keep={cursor.best_checkpoint} - {None})
            if self._remote is not None:  # complete here: up it goes, then the files it goes with
                from xlatrain.storage.dcp import shard_file

                parts = tuple(f"{SHARDS_DIR}/{shard_file(i)}" for i in range(st.num_processes)) if st.sharded_state else ()
                self._remote.push_checkpoint(path, already_up=parts)  # the parts went up from their writers
                self._remote.push_files()
        return path

    def _preempt(self, cursor: Cursor, sums: dict[str, torch.Tensor], stop: _StopSignals) -> None:
        path = self._save_checkpoint(cursor, sums) if self.checkpoint.enabled else None
        if self.strategy.is_main:
            write_history(self.run_dir, self.history)
        self.strategy.barrier()
        # A process that was not signalled stops because a peer was: every process stops at this
        # same step, and only a Ctrl-C (SIGINT) of this process makes its exit code non-zero.
        name = signal.Signals(stop.signum).name if stop.signum else "a stop requested on another process"
        self._say(
            f"{name}: stopped after epoch {cursor.epoch} step {cursor.step}"
            + (f"; checkpoint {path}" if path else "")
            + ". Run the same command again to resume (resume='auto')."
        )
        raise SystemExit(128 + stop.signum if stop.signum not in (None, signal.SIGTERM) else 0)

    def _check_nonfinite(self, bad: float, epoch: int, first: int, last: int) -> None:
        if bad > 0 and self.config.nan_policy == "stop":
            self._nonfinite = (epoch, first, last, int(bad))
            self._fail_nonfinite()

    def _fail_nonfinite(self) -> None:
        epoch, first, last, count = self._nonfinite or (0, 0, 0, 0)
        latest = latest_name(self.run_dir / "checkpoints")
        raise NonFiniteLossError(
            f"the loss or gradient norm was NaN/Inf in {count} step(s) between steps {first} and "
            f"{last} of epoch {epoch}; nothing after the last good checkpoint was saved "
            f"(latest: {latest or 'none'}). Lower the learning rate, set clip_grad_norm, check the "
            "inputs, or set nan_policy='skip_step'."
        )

    def _patience_spent(self, cursor: Cursor) -> bool:
        """Early stopping: the monitored value has not improved for ``early_stop_patience`` epochs."""
        patience = self.config.early_stop_patience
        return patience is not None and cursor.epoch_done and cursor.epoch - (cursor.best_epoch or 0) >= patience

    def _track_best(self, row: dict[str, Any], cursor: Cursor) -> bool:
        monitor = self.monitor
        if monitor not in row:
            raise ValueError(
                f"monitor={monitor!r} is not a history column; available: {', '.join(row)}. Set monitor "
                "(trainer.monitor) to one of them"
            )
        value, best = row[monitor], cursor.best
        improved = not math.isnan(value) and (
            math.isnan(best) or (value > best if self.monitor_mode == "max" else value < best)
        )
        if improved:
            cursor.best, cursor.best_epoch = value, row["epoch"]
            if self.config.save_best:
                # Under a sharded strategy the weights are gathered onto the main process here.
                # A monitored EMA column makes the EMA weights the best ones.
                ema = self._ema_weights() if monitor.startswith("val_ema_") else contextlib.nullcontext()
                with ema, _writing(self.run_dir / "best.safetensors"):
                    self.save_weights(self.run_dir / "best.safetensors")
        return improved

    def _layout(self, per_device: int) -> dict[str, int]:
        st = self.strategy
        return {
            "loader_batch": per_device * st.devices_per_process,
            "num_processes": st.num_processes,
            "process_index": st.process_index,
        }

    def _data_loader(self, dataset: Any, sampler: Any, collate_fn: Callable[[list[Any]], Any] = collate) -> DataLoader[Any]:
        cfg = self.config
        return DataLoader(
            dataset if isinstance(dataset, (_Items, PaddedDataset)) else _Items(dataset),
            batch_size=sampler.loader_batch,
            sampler=sampler,
            collate_fn=collate_fn,
            num_workers=cfg.num_workers,
            persistent_workers=cfg.num_workers > 0,
            pin_memory=self.runtime.pin_memory,
            generator=torch.Generator().manual_seed(cfg.seed),
        )

    def _eval_batches(self, dataset: Any) -> tuple[Iterable[Any], EvalSampler]:
        """Device batches ``((inputs, targets), valid)`` and the layout they follow."""
        layout = self._layout(self.config.eval_batch_size or self.config.batch_size)
        sampler = EvalSampler(len(dataset), **layout)
        if isinstance(dataset, BatchSource):
            host: Iterable[Any] = dataset.eval_batches(**layout)
        else:
            host = self._data_loader(PaddedDataset(_Items(dataset), len(dataset)), sampler)
        return self.runtime.wrap_loader(host, self.strategy.input_sharding), sampler

    def _interval(
        self, meter: IntervalMeter, epoch: int, first: int, step: int, tb_step: int
    ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """The deferred read of one log interval: its figures to the observers (progress line or
        bar, TensorBoard, callbacks), and the NaN check."""
        lr = self.optimizer.param_groups[0]["lr"]  # now: the read may run steps later
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
            lr = None  # a capturable optimizer keeps it on the device; not worth a read

        def show(mean_loss_sum: torch.Tensor, nonfinite: torch.Tensor) -> None:
            bad = float(nonfinite)
            if bad > 0 and self.config.nan_policy == "stop":
                # Raised by the training loop right after this read, not inside the runtime's callback.
                self._nonfinite = (epoch, first, step, int(bad))
            stats = meter.measure(step, loss_sum=float(mean_loss_sum), nonfinite=bad)
            figures = self.throughput.figures(stats.samples_per_s) if self.throughput is not None else {}
            self._observers.call("on_interval", self, {
                "epoch": epoch, "step": step, "global_step": tb_step, "loss": stats.interval_loss,
                "epoch_loss": stats.epoch_loss, "nonfinite_steps": stats.nonfinite,
                "lr": float(lr) if lr is not None else None, "samples_per_s": stats.samples_per_s, **figures,
            })

        return show

    def _say(self, message: str) -> None:
        if self.strategy.is_main:
            log.info(message)


def _check_arguments(
    model: Any, loss_fn: Any, optimizer_fn: Any, scheduler_fn: Any, config: Any, checkpoint: Any, metrics_fn: Any
) -> None:
    """What the Trainer is handed has the kind it needs, or a TypeError saying what to pass."""
    if not isinstance(model, torch.nn.Module):
        what = "None" if model is None else (
            f"{model!r} is a function" if callable(model) else f"{type(model).__name__}")
        raise TypeError(
            f"model {what}, not a torch.nn.Module: pass the module (an nn.Module subclass, or wrap a function's "
            "layers in one), so that its parameters can be trained and saved"
            if model is not None else
            "model is None: pass the torch.nn.Module to train"
        )
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn {loss_fn!r} is not callable: pass loss_fn(outputs, targets) -> loss, e.g. nn.CrossEntropyLoss()"
        )
    if isinstance(optimizer_fn, torch.optim.Optimizer) or not callable(optimizer_fn):
        what = f"is an optimizer ({type(optimizer_fn).__name__})" if isinstance(optimizer_fn, torch.optim.Optimizer) \
            else f"{optimizer_fn!r} is not callable"
        raise TypeError(
            f"optimizer_fn {what}: pass a factory that builds the optimizer from the parameters once they are on the "
            "device, e.g. functools.partial(torch.optim.SGD, lr=0.1)"
        )
    if scheduler_fn is not None and (
        isinstance(scheduler_fn, torch.optim.lr_scheduler.LRScheduler) or not callable(scheduler_fn)
    ):
        what = "is a scheduler (already built on another optimizer)" if callable(getattr(scheduler_fn, "step", None)) \
            else f"{scheduler_fn!r} is not callable"
        raise TypeError(
            f"scheduler_fn {what}: pass a factory that builds it from the optimizer, e.g. "
            "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3), or lambda opt, run: "
            "OneCycleLR(opt, max_lr=0.1, total_steps=run.total_steps)"
        )
    for name, value, cls in (("config", config, TrainConfig), ("checkpoint", checkpoint, CheckpointConfig)):
        if value is not None and not isinstance(value, cls):
            raise TypeError(
                f"{name} is a {type(value).__name__}, not a {cls.__name__}: pass {cls.__name__}(**your_values)"
            )
    if metrics_fn is not None and not callable(metrics_fn):
        raise TypeError(f"metrics_fn {metrics_fn!r} is not callable: pass metrics_fn(outputs, targets) -> {{name: value}}")


def _check_pipeline_arguments(collate_fn: Any, sampler: Any, batch_transform: Any) -> None:
    """The pipeline's own pieces (``collate_fn``, ``sampler``, ``batch_transform``), as
    :func:`_check_arguments` checks the rest."""
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(
            f"collate_fn={collate_fn!r} is not callable: give a function that makes one batch from a list of "
            "dataset items, e.g. lambda items: mixup(*default_collate(items))"
        )
    if sampler is not None and not (callable(sampler) or hasattr(sampler, "__iter__")):
        raise TypeError(
            f"sampler={sampler!r} is neither a sampler (iterable over dataset indices) nor a factory "
            "sampler(dataset, num_replicas=..., rank=...) building one"
        )
    if batch_transform is not None and not callable(batch_transform):
        raise TypeError(
            f"batch_transform={batch_transform!r} is not callable: give a function of a batch on the device that "
            "returns the batch, e.g. lambda b: (normalize(b[0]), b[1])"
        )


def _check_dataset(name: str, data: Any) -> None:
    if isinstance(data, BatchSource):
        return
    if isinstance(data, (str, bytes)) or not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(
            f"{name} {data!r} is not a dataset: give a map-style Dataset (with __len__ and __getitem__ returning "
            "(inputs, targets)), a list of items, or a BatchSource such as xlatrain's ShardDataset"
        )


def _required_positional(fn: Callable[..., Any]) -> int:
    """Positional parameters of ``fn`` that have no default (``functools.partial`` applied)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


@contextlib.contextmanager
def _in_step(trainer: Trainer, cursor: Cursor, step: int) -> Iterator[list[str]]:
    """An error raised in a training step keeps its traceback and says where: epoch, step, which
    function (the model, the loss, backward) and, for a map-style dataset, the batch's samples."""
    where = ["forward"]
    try:
        yield where
    except Exception as exc:
        if hasattr(exc, "add_note"):
            indices = trainer._feed.sample_indices(cursor.epoch, step) if trainer._feed is not None else None
            what = {"forward": f"the model's forward ({type(trainer.strategy.unwrap(trainer.model)).__name__})",
                    "loss": f"loss_fn {trainer.loss_fn!r}"}.get(where[0], where[0])
            exc.add_note(
                f"xlatrain: raised in {what} at epoch {cursor.epoch} step {step}"
                + (f"; this process's batch holds the dataset's sample indices {indices}" if indices else "")
            )
        raise


def _is_cross_entropy(loss_fn: Any) -> bool:
    inner = getattr(loss_fn, "func", loss_fn)  # functools.partial
    return isinstance(loss_fn, torch.nn.CrossEntropyLoss) or inner is torch.nn.functional.cross_entropy


def _check_class_targets(loss_fn: Any, targets: Any) -> None:
    """Cross-entropy's targets, checked on the host copy of the dry run's batch."""
    if _is_cross_entropy(loss_fn) and isinstance(targets, torch.Tensor) and targets.dtype == torch.bool:
        raise ValueError(
            "CrossEntropyLoss got bool targets: give class indices (targets.long() in the dataset) or class "
            "probabilities (floats of the outputs' shape)"
        )


def _check_class_outputs(loss_fn: Any, outputs: Any, targets: Any) -> None:
    """Cross-entropy's class-index targets against the number of outputs (host copy of the targets)."""
    if not (_is_cross_entropy(loss_fn) and isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return
    if outputs.dim() < 2:
        return
    classes = outputs.shape[1]
    if targets.is_floating_point():
        if tuple(targets.shape) != tuple(outputs.shape):
            raise ValueError(
                f"CrossEntropyLoss got float targets of shape {tuple(targets.shape)}: it takes class indices "
                f"(integers, shape {tuple(outputs.shape[:1]) + tuple(outputs.shape[2:])}) or class probabilities "
                f"(floats, the outputs' shape {tuple(outputs.shape)}). Give class indices with .long() in the dataset, "
                "or probabilities of the outputs' shape"
            )
        return
    ignore = getattr(loss_fn, "ignore_index", -100)
    bad = targets[(targets != ignore) & ((targets < 0) | (targets >= classes))]
    if bad.numel():
        raise ValueError(
            f"the targets hold class index {int(bad[0])}, but the model has {classes} outputs (classes 0..{classes - 1}): "
            f"give the model's last layer one output per class (num_outputs), or map the labels to 0..{classes - 1} "
            "in the dataset"
        )


def _channels_last(t: Any) -> Any:
    """A 4-D floating tensor (images, N x C x H x W) in channels-last memory order; others as they are."""
    if isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point():
        return t.contiguous(memory_format=torch.channels_last)
    return t


def _first_batch(data: Any, rows: int = 2, collate_fn: Callable[[list[Any]], Any] = collate) -> Any:
    """A small batch of ``data`` for the dry run, collated as the loaders collate (training
    batches with the user's ``collate_fn``)."""
    if isinstance(data, BatchSource):
        batch, _valid = next(iter(data.eval_batches(loader_batch=rows, num_processes=1, process_index=0)))
        return batch
    if len(data) == 0:
        raise ValueError("the evaluation set is empty: give at least one sample")
    items = _Items(data)
    return collate_fn([items[i] for i in range(min(rows, len(data)))])


class _Items(Dataset):  # type: ignore[type-arg]
    """A user's dataset whose failing items say which one failed and in whose ``__getitem__``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            item = self.dataset[index]
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"xlatrain: raised by {type(self.dataset).__name__}.__getitem__({index})")
            raise
        if item is None:
            raise ValueError(
                f"{type(self.dataset).__name__}[{index}] returned None: __getitem__ must return an item, an "
                "(inputs, targets) pair by default (or a dict / dataclass read through the Trainer's inputs= and "
                "targets= names)"
            )
        return item


_BROADCAST = re.compile(r"target size \((.*?)\) that is different to the input size \((.*?)\)")


def _refuse_broadcast_loss(caught: list[warnings.WarningMessage], loss_fn: Any) -> None:
    """torch warns, and goes on, when an elementwise loss (MSE, L1, Huber, ...) gets targets of
    another shape than the outputs: it broadcasts them, and every output meets every target. That
    is never what was meant; it is an error here. Other warnings are passed on as they were."""
    for w in caught:
        found = _BROADCAST.search(str(w.message))
        if found is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            continue
        target, output = (tuple(int(n) for n in re.findall(r"\d+", part)) for part in found.groups())
        into = tuple(torch.broadcast_shapes(target, output))
        raise ValueError(
            f"loss_fn {loss_fn!r} got outputs of shape {output} and targets of shape {target}: torch broadcasts "
            f"them to {into}, so every output is compared with every target and the loss is wrong. Give both one "
            f"shape: squeeze the model's outputs (outputs.squeeze(-1) in the model or the loss), or reshape the "
            "targets in the dataset"
        )


def _shapes(batch: Any) -> str:
    leaves = tree_map(lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__, batch)
    return str(leaves)


def _check_task(task: str, outputs: Any, targets: Any, top_k: Sequence[int] = ()) -> None:
    """The task's metrics can be computed from these outputs and targets (shapes and dtypes only)."""
    def shape(x: Any) -> Any:
        return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__

    fix = "set TrainConfig(task='none') to report the loss (and metrics_fn's metrics) only"
    if task == "classification":
        ok = isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.dim() == 2 and (
            (targets.dim() == 1 and not targets.is_floating_point() and targets.shape[0] == outputs.shape[0])
            or (targets.is_floating_point() and targets.shape == outputs.shape and outputs.shape[1] > 1)  # probabilities
        )
        if not ok:
            raise ValueError(
                "task='classification' reports accuracy from [batch, classes] logits and [batch] class indices "
                f"(or class probabilities of the logits' shape), but the model returned {shape(outputs)} and the "
                f"targets are {shape(targets)}: {fix}"
            )
        if top_k and max(top_k) > outputs.shape[1]:
            raise ValueError(
                f"top_k={tuple(top_k)} asks for top-{max(top_k)} accuracy, but the model has {outputs.shape[1]} outputs "
                f"(classes): give ks of at most {outputs.shape[1]}"
            )
    elif task == "multilabel":
        ok = isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.dim() == 2 \
            and outputs.shape == targets.shape
        if not ok:
            raise ValueError(
                "task='multilabel' reports per-label AUC from [batch, labels] logits and targets of the same shape, "
                f"but the model returned {shape(outputs)} and the targets are {shape(targets)}: {fix}"
            )


def _epoch_line(row: dict[str, Any], epochs: int, monitor: str, improved: bool) -> str:
    shown = [f"{k} {v:.4f}" for k, v in row.items() if k.startswith(("train_", "val_")) and "auc_" not in k]
    star = f"  (best {monitor})" if improved else ""
    rate = "".join(f"  {row[k]:,.0f} {unit}" for k, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s"))
                   if k in row)
    rate += f"  MFU {100 * row['mfu']:.1f}%" if "mfu" in row else ""
    return f"epoch {row['epoch']}/{epochs}  " + "  ".join(shown) + f"  {row['epoch_time_s']:.1f}s" + rate + star


# What xlatrain writes into a run directory: what resume="overwrite" removes (nothing else is).
RUN_FILES = ("checkpoints", "history.json", "history.csv", "best.safetensors", "diagnostics.json", "tb", "profile",
             "report", "config.yaml", "model.safetensors", "loss.png")


def _make_run_dir(path: Path) -> None:
    """Create the run directory, with errors that name the path and the fix."""
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            what = "the run directory" if parent == path else f"{parent}, a parent of the run directory,"
            raise run_lock.RunDirError(
                f"{what} is a file, not a directory: give trainer.run_dir (TrainConfig(run_dir=...)) a directory path"
            )
        if parent.exists():
            break
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise run_lock.RunDirError(
            f"cannot create the run directory {path}: {exc.strerror or exc}. Give trainer.run_dir a path "
            "this process can write"
        ) from None
    for sub in ("checkpoints", "tb"):
        if (path / sub).exists() and not (path / sub).is_dir():
            raise run_lock.RunDirError(
                f"{path / sub} is a file, where xlatrain keeps a directory: move it away, or give this run another "
                "directory (--fresh, or trainer.run_dir)"
            )


def _clear_run(path: Path) -> list[str]:
    import shutil

    removed = []
    for name in RUN_FILES:
        target = path / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        else:
            continue
        removed.append(name)
    return removed


def _explicit_checkpoint(path: Path, group: Any) -> tuple[Path, dict[str, torch.Tensor] | None, dict[str, Any]]:
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
    tensors, meta = read_checkpoint(path)
    return path, tensors, meta


def _holds_a_run(path: Path) -> bool:
    return (path / "history.json").exists() or bool(list_checkpoints(path / "checkpoints"))


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A failed write of a run's file (a full disk, lost permissions) as an error that names the
    file, the free space and how to go on; the file written before stays (writes are atomic)."""
    import shutil

    try:
        yield
    except OSError as exc:
        try:
            free = f"; the disk holding it has {_mb(shutil.disk_usage(path.parent).free)} free"
        except OSError:
            free = ""
        latest = latest_name(path.parent / "checkpoints")
        raise CheckpointError(
            f"could not write {path}: {exc.strerror or exc}{free}. Its previous version is intact, and so is the "
            f"latest checkpoint ({latest or 'none yet'}): free disk space (or fix permissions) and run the same "
            "command again to continue from it"
        ) from exc


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _resharded_sums(per_process: list[dict[str, float]], index: int, count: int) -> dict[str, float]:
    """This process's share of running sums saved by another number of processes: every process
    starts from the saved mean (so the mean over processes is unchanged) and process 0 carries the
    non-finite count."""
    names = per_process[0].keys()
    out = {k: sum(p[k] for p in per_process) / len(per_process) for k in names}
    out["nonfinite"] = sum(p["nonfinite"] for p in per_process) if index == 0 else 0.0
    return out


class _StopSignals:
    """SIGTERM / SIGINT ask the loop to stop after the current step; a second one exits at once.

    Only the main thread can install handlers; elsewhere (e.g. a notebook's worker thread) the
    run keeps Python's defaults.
    """

    def __init__(self, say: Callable[[str], None]) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._say = say

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            os._exit(128 + signum)  # files are written atomically: nothing is left torn
        self.signum = signum
        name = signal.Signals(signum).name
        self._say(f"{name}: finishing this step, then saving a checkpoint; a second {name} stops at once")

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _TrainFeed:
    """One epoch of this process's training batches at a time, on the device."""

    def __init__(self, trainer: Trainer, dataset: Any) -> None:
        cfg, st = trainer.config, trainer.strategy
        self._runtime, self._sharding = trainer.runtime, st.input_sharding
        self._layout = trainer._layout(cfg.batch_size)
        self._seed = cfg.seed
        self._step_multiple = cfg.grad_accum_steps
        self.dataset = dataset
        self.sampler: TrainSampler | UserSampler | None = None
        if isinstance(dataset, BatchSource):
            self.steps_per_epoch = train_steps_per_epoch(
                len(dataset), self._layout["loader_batch"], self._layout["num_processes"], cfg.grad_accum_steps
            )
            return
        if trainer._sampler is not None:
            self.sampler = UserSampler(
                trainer._sampler, dataset, seed=cfg.seed, step_multiple=cfg.grad_accum_steps,
                agree=lambda steps: min(st.gather_objects(steps)) if st.num_processes > 1 else steps, **self._layout,
            )
        else:
            self.sampler = TrainSampler(len(dataset), seed=cfg.seed, step_multiple=cfg.grad_accum_steps, **self._layout)
        # The first epoch's steps (a user's sampler may give another count in a later epoch: the
        # Trainer counts the steps each epoch runs).
        self.steps_per_epoch = self.sampler.steps_per_epoch
        # Built once, so DataLoader workers persist across epochs.
        self._loader = trainer._data_loader(dataset, self.sampler, trainer._collate)

    def sample_indices(self, epoch: int, step: int) -> list[int] | None:
        """The dataset indices of this process's batch at ``step`` (from 1) of ``epoch``, where the
        Trainer's sampler chose them (None for a BatchSource, which reads records itself)."""
        if self.sampler is None or self.sampler.epoch != epoch:
            return None
        return self.sampler.step_indices(step)

    def batches(self, epoch: int, start_step: int = 0) -> Iterable[Any]:
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, start_step)
            host: Iterable[Any] = self._loader
        else:
            host = self.dataset.train_batches(
                epoch=epoch, start_step=start_step, seed=self._seed, step_multiple=self._step_multiple, **self._layout
            )
        return self._runtime.wrap_loader(host, self._sharding)
