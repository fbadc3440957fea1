"""Trainer: fit / evaluate / predict for one PyTorch model on any Backend.

The loop is written out in full in ``_train_epoch``: one forward, one backward, one optimizer step
per global batch, with nothing read back to the host except through ``backend.defer`` every
``log_every`` steps and ``backend.read`` at epoch end.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from xlatrain.backend import Backend, from_config, select_backend
from xlatrain.checkpoint import save_weights
from xlatrain.config import BackendConfig, TrainConfig
from xlatrain.data.sampling import EvalSampler, PaddedDataset, TrainSampler
from xlatrain.data.source import BatchSource, train_steps_per_epoch
from xlatrain.report import write_history
from xlatrain.train.metrics import EvalAccumulator, default_monitor, infer_task, per_sample_loss

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def _split(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        "each dataset item must be an (inputs, targets) pair; got a batch of type "
        f"{type(batch).__name__}. Wrap the dataset so __getitem__ returns (inputs, targets)."
    )


def _check_scalar(loss: Any) -> None:
    # Shape is known on the host without reading the value: no device sync.
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return a scalar tensor, got {shape}: reduce it inside loss_fn "
            "(reduction='mean', or .mean() over the batch)"
        )


class Trainer:
    """Trains ``model`` with ``loss_fn`` and an optimizer built on the device.

    Args:
        model: the ``torch.nn.Module`` to train; moved to the device here.
        loss_fn: ``loss_fn(outputs, targets)`` returning a scalar.
        optimizer_fn: builds the optimizer from the parameters *after* they are on the device,
            e.g. ``functools.partial(torch.optim.Adam, lr=1e-3)``.
        scheduler_fn: optional, builds an LR scheduler from the optimizer.
        config: a :class:`~xlatrain.config.TrainConfig`.
        backend: a Backend, a BackendConfig, or an accelerator name (``"auto"``, ``"xla"``, ...).
        label_names: names of multilabel outputs, used in per-label metric columns.

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
        backend: Backend | BackendConfig | str = "auto",
        label_names: Sequence[str] | None = None,
    ) -> None:
        self.config = cfg = config or TrainConfig()
        if isinstance(backend, str):
            backend = select_backend(backend)
        elif isinstance(backend, BackendConfig):
            backend = from_config(backend)
        self.backend = be = backend
        self.task = infer_task(loss_fn) if cfg.task == "auto" else cfg.task
        monitor, mode = default_monitor(self.task)
        self.monitor = cfg.monitor or monitor
        self.monitor_mode = cfg.monitor_mode or (mode if cfg.monitor is None else _mode_for(self.monitor))
        self.loss_fn = loss_fn
        self.label_names = list(label_names) if label_names is not None else None
        self.model = be.prepare_model(model)
        self.optimizer = optimizer_fn(be.unwrap(self.model).parameters())
        if cfg.scale_lr and be.world_size > 1:
            before = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * be.world_size
            self._say(
                f"learning rate scaled x{be.world_size} by device count (scale_lr=True): "
                f"{before[0]:g} -> {self.optimizer.param_groups[0]['lr']:g}"
            )
        # Built after any scaling, so the schedule starts from the scaled rate.
        self.scheduler = scheduler_fn(self.optimizer) if scheduler_fn is not None else None
        self.history: list[dict[str, Any]] = []
        self._eval_loss: Callable[[Any, Any], torch.Tensor] | None = None

    # ----------------------------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        return self.config.batch_size * self.backend.world_size

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)

    def fit(self, train_data: Any, val_data: Any | None = None) -> list[dict[str, Any]]:
        """Train for ``config.epochs`` epochs, validating after each; returns the history rows.

        Writes ``history.csv`` / ``history.json`` after every epoch and ``best.safetensors``
        whenever the monitored metric improves.
        """
        cfg, be = self.config, self.backend
        be.seed_everything(cfg.seed)
        train_feed = _TrainFeed(self, train_data)
        monitor = self.monitor
        if val_data is None and monitor.startswith("val_") and self.config.monitor is None:
            monitor, self.monitor_mode = "train_loss", "min"
        if be.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._say(
            f"xlatrain: {be.describe()} | global batch {self.global_batch_size * cfg.grad_accum_steps} = "
            f"{cfg.batch_size} per device x {be.world_size} device(s)"
            + (f" x {cfg.grad_accum_steps} accumulation steps" if cfg.grad_accum_steps > 1 else "")
            + f" | {train_feed.steps_per_epoch // cfg.grad_accum_steps} optimizer steps per epoch"
            + f" | precision {cfg.precision}"
        )
        best = math.nan
        for epoch in range(1, cfg.epochs + 1):
            started = time.perf_counter()
            row: dict[str, Any] = {"epoch": epoch, "lr": self.optimizer.param_groups[0]["lr"]}
            row["train_loss"] = self._train_epoch(train_feed.batches(epoch), epoch, train_feed.steps_per_epoch)
            if val_data is not None:
                metrics = self.evaluate(val_data)
                row.update({f"val_{k}": v for k, v in metrics.items() if k != "num_samples"})
            row["epoch_time_s"] = round(time.perf_counter() - started, 3)
            row.update(be.runtime_stats())
            if self.scheduler is not None and cfg.scheduler_interval == "epoch":
                self.scheduler.step()
            if monitor not in row:
                raise ValueError(
                    f"monitor={monitor!r} is not a history column; available: {', '.join(row)}"
                )
            value = row[monitor]
            improved = not math.isnan(value) and (
                math.isnan(best) or (value > best if self.monitor_mode == "max" else value < best)
            )
            if improved:
                best = value
                if be.is_main:
                    save_weights(be.unwrap(self.model), self.run_dir / "best.safetensors", read=be.read)
            self.history.append(row)
            if be.is_main:
                write_history(self.run_dir, self.history)
            self._say(_epoch_line(row, cfg.epochs, monitor, improved))
        be.barrier()
        return self.history

    def evaluate(self, data: Any) -> dict[str, float]:
        """Loss and task metrics over ``data``, every sample counted exactly once."""
        return self._evaluate(self._eval_batches(data)[0])

    def predict(self, data: Any) -> torch.Tensor:
        """Model outputs for every item of ``data``, in dataset order, on the host.

        Items may be ``(inputs, targets)`` pairs (targets are ignored) or bare inputs.
        """
        be = self.backend
        batches, layout = self._eval_batches(data)
        outputs = []
        self.model.eval()
        with torch.no_grad():
            for item, _valid in batches:
                inputs = item[0] if isinstance(item, (list, tuple)) else item
                with be.autocast(self.config.precision):
                    outputs.append(self.model(inputs).float())
                be.step_end()
        (gathered,) = be.read([be.all_gather(torch.cat(outputs))])
        # Rows arrive grouped by process; put them back in dataset order and drop padding.
        order = torch.cat([layout.indices(p) for p in range(layout.num_processes)])
        real = order < layout.num_samples
        result = torch.empty((layout.num_samples, *gathered.shape[1:]), dtype=gathered.dtype)
        result[order[real]] = gathered[real]
        return result

    # ----------------------------------------------------------------------------------------
    def _train_epoch(self, loader: Iterable[Any], epoch: int, num_steps: int) -> float:
        cfg, be, model, opt = self.config, self.backend, self.model, self.optimizer
        accum = cfg.grad_accum_steps
        model.train()
        loss_sum = torch.zeros((), device=be.device)
        progress = _Progress(self, epoch, num_steps)
        for step, batch in enumerate(loader, start=1):
            inputs, targets = _split(batch)
            last_micro = step % accum == 0
            with contextlib.nullcontext() if last_micro else be.no_sync(model):
                with be.autocast(cfg.precision):
                    outputs = model(inputs)
                    loss = self.loss_fn(outputs, targets)
                _check_scalar(loss)
                (loss / accum if accum > 1 else loss).backward()
            if last_micro:
                be.reduce_gradients(opt)
                if cfg.clip_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if self.scheduler is not None and cfg.scheduler_interval == "step":
                    self.scheduler.step()
            loss_sum = loss_sum + loss.detach().float()
            be.step_end()
            if step % cfg.log_every == 0 and step < num_steps:
                be.defer(progress.report(step), [be.all_reduce_mean(loss_sum)])
        (total,) = be.read([be.all_reduce_mean(loss_sum)])
        return float(total) / num_steps

    def _evaluate(self, loader: Iterable[Any]) -> dict[str, float]:
        be = self.backend
        if self._eval_loss is None:
            self._eval_loss = per_sample_loss(self.loss_fn)
        acc = EvalAccumulator(self.task, be.device)
        self.model.eval()
        with torch.no_grad():
            for batch, valid_B in loader:
                inputs, targets = _split(batch)
                with be.autocast(self.config.precision):
                    outputs = self.model(inputs)
                outputs = outputs.float()
                acc.update(self._eval_loss(outputs, targets), outputs, targets, valid_B)
                be.step_end()
        return acc.compute(be, self.label_names)

    def _layout(self, per_device: int) -> dict[str, int]:
        be = self.backend
        return {
            "loader_batch": per_device * be.devices_per_process,
            "num_processes": be.num_processes,
            "process_index": be.process_index,
        }

    def _data_loader(self, dataset: Any, sampler: Any) -> DataLoader[Any]:
        cfg = self.config
        return DataLoader(
            dataset,
            batch_size=sampler.loader_batch,
            sampler=sampler,
            num_workers=cfg.num_workers,
            persistent_workers=cfg.num_workers > 0,
            pin_memory=self.backend.name == "cuda",
            generator=torch.Generator().manual_seed(cfg.seed),
        )

    def _eval_batches(self, dataset: Any) -> tuple[Iterable[Any], EvalSampler]:
        """Device batches ``((inputs, targets), valid)`` and the layout they follow."""
        layout = self._layout(self.config.eval_batch_size or self.config.batch_size)
        sampler = EvalSampler(len(dataset), **layout)
        if isinstance(dataset, BatchSource):
            host: Iterable[Any] = dataset.eval_batches(**layout)
        else:
            host = self._data_loader(PaddedDataset(dataset, len(dataset)), sampler)
        return self.backend.wrap_loader(host), sampler

    def _say(self, message: str) -> None:
        if self.backend.is_main:
            print(message, flush=True)


def _mode_for(monitor: str) -> str:
    return "min" if "loss" in monitor or "rmse" in monitor or "error" in monitor else "max"


def _epoch_line(row: dict[str, Any], epochs: int, monitor: str, improved: bool) -> str:
    shown = [f"{k} {v:.4f}" for k, v in row.items() if k.startswith(("train_", "val_")) and "auc_" not in k]
    star = f"  (best {monitor})" if improved else ""
    return f"epoch {row['epoch']}/{epochs}  " + "  ".join(shown) + f"  {row['epoch_time_s']:.1f}s" + star


class _Progress:
    """Progress lines built inside deferred reads, so the step loop never waits for the device."""

    def __init__(self, trainer: Trainer, epoch: int, num_steps: int) -> None:
        self._trainer = trainer
        self._epoch = epoch
        self._num_steps = num_steps
        self._last_step = 0
        self._last_time = time.perf_counter()

    def report(self, step: int) -> Callable[[torch.Tensor], None]:
        def show(mean_loss_sum: torch.Tensor) -> None:
            now = time.perf_counter()
            rate = (step - self._last_step) * self._trainer.global_batch_size / max(now - self._last_time, 1e-9)
            self._last_step, self._last_time = step, now
            self._trainer._say(
                f"  epoch {self._epoch} step {step}/{self._num_steps}  "
                f"loss {float(mean_loss_sum) / step:.4f}  {rate:,.0f} samples/s"
            )

        return show


class _TrainFeed:
    """One epoch of this process's training batches at a time, on the device."""

    def __init__(self, trainer: Trainer, dataset: Any) -> None:
        cfg = trainer.config
        self._backend = trainer.backend
        self._dataset = dataset
        self._layout = trainer._layout(cfg.batch_size)
        self._seed = cfg.seed
        self._step_multiple = cfg.grad_accum_steps
        self.steps_per_epoch = train_steps_per_epoch(
            len(dataset), self._layout["loader_batch"], self._layout["num_processes"], cfg.grad_accum_steps
        )
        self._sampler: TrainSampler | None = None
        if not isinstance(dataset, BatchSource):
            self._sampler = TrainSampler(len(dataset), seed=cfg.seed, step_multiple=cfg.grad_accum_steps, **self._layout)
            # Built once, so DataLoader workers persist across epochs.
            self._loader = trainer._data_loader(dataset, self._sampler)

    def batches(self, epoch: int, start_step: int = 0) -> Iterable[Any]:
        if self._sampler is not None:
            self._sampler.set_epoch(epoch, start_step)
            host: Iterable[Any] = self._loader
        else:
            host = self._dataset.train_batches(
                epoch=epoch, start_step=start_step, seed=self._seed, step_multiple=self._step_multiple, **self._layout
            )
        return self._backend.wrap_loader(host)
