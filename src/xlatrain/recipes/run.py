"""Run a recipe from a :class:`~xlatrain.config.RunConfig` (what ``xlatrain fit CONFIG.yaml`` does).

A recipe is a module with a ``DataConfig`` dataclass (its ``data:`` section) and
``build(config) -> RecipeParts``. Recipes import the core, never the reverse.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xlatrain.checkpoint import atomic_write_text
from xlatrain.config import OptimizerConfig, RunConfig, ScheduleConfig, dump_yaml, load_yaml
from xlatrain.logs import get_logger
from xlatrain.train.trainer import Trainer

log = get_logger(__name__)

RECIPES = {
    "digits": "xlatrain.recipes.digits",
    "depth_mask": "xlatrain.recipes.depth_mask.recipe",
    "pe_detection": "xlatrain.recipes.pe_detection.recipe",
    "lm": "xlatrain.recipes.lm.recipe",
}


@dataclass
class RecipeParts:
    model: torch.nn.Module
    loss_fn: Callable[..., torch.Tensor]
    train_data: Any
    val_data: Any
    metrics_fn: Callable[[Any, Any], dict[str, float]] | None = None
    label_names: Sequence[str] | None = None


def recipe_module(name: str) -> Any:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}: choose one of {', '.join(sorted(RECIPES))}")
    return importlib.import_module(RECIPES[name])


def build_recipe_model(config: RunConfig, *, num_outputs: int, in_channels: int, names: Sequence[str] | None = None,
                       pretrained_prefix: str | None = None) -> torch.nn.Module:
    """The ``model`` section as a model: every key takes effect or is an error naming it.

    ``width`` and ``blocks`` go to models that take them (``small_cnn``: width; ``resnet_unet``:
    width and blocks); set for another model they are an error, not silently dropped. ``names``
    limits which models the recipe can use. ``pretrained_prefix``: where the recipe wraps the
    model, the name it keeps it under, so that ``model.pretrained`` takes the recipe's own
    ``best.safetensors`` (see :func:`xlatrain.models.build_model`).
    """
    from xlatrain.models import MODEL_NAMES, build_model, model_options

    cfg = config.model
    if names is not None and cfg.name not in names:
        raise ValueError(f"model.name={cfg.name!r}: the {config.recipe} recipe builds {', '.join(names)}")
    for key in ("layers", "heads", "positions"):
        if getattr(cfg, key) is not None:
            raise ValueError(f"model.{key} is set but {cfg.name} has no such option (the lm recipe's byte_gpt takes "
                             "it): remove the key")
    extra = {k: v for k, v in (("width", cfg.width), ("blocks", cfg.blocks)) if v is not None}
    takes = model_options(cfg.name) if cfg.name in MODEL_NAMES else set(extra)
    unused = sorted(set(extra) - takes)
    if unused:
        raise ValueError(
            f"model.{unused[0]} is set but {cfg.name} has no such option: "
            + (f"it takes {', '.join('model.' + t for t in sorted(takes))}; " if takes else "it takes neither width nor blocks; ")
            + "remove the key"
        )
    if "blocks" in extra:
        extra["blocks"] = tuple(extra["blocks"])
    return build_model(cfg.name, num_outputs=num_outputs, in_channels=in_channels, pretrained=cfg.pretrained,
                       pretrained_prefix=pretrained_prefix, **extra)


def optimizer_factory(cfg: OptimizerConfig) -> Callable[..., torch.optim.Optimizer]:
    if cfg.name == "sgd":
        return functools.partial(
            torch.optim.SGD, lr=cfg.lr, momentum=0.9 if cfg.momentum is None else cfg.momentum, weight_decay=cfg.weight_decay
        )
    if cfg.name == "adamw":
        return functools.partial(_adamw_groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return functools.partial(torch.optim.Adam, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _adamw_groups(params: Any, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on the matrices only: biases and norm weights (1-D) decay not, as
    transformer and ResNet recipes do. ``params`` names them (the Trainer hands the model's)."""
    named = list(params.named_parameters()) if hasattr(params, "named_parameters") else [(str(i), p) for i, p in enumerate(params)]
    decay = [p for _, p in named if p.dim() >= 2]
    keep = [p for _, p in named if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


def scheduler_factory(cfg: ScheduleConfig, epochs: int, interval: str = "epoch") -> Callable[..., Any] | None:
    """The schedule ``cfg`` names, stepped every ``interval`` (``trainer.scheduler_interval``):
    a cosine anneals over the run's epochs, or over its optimizer steps when stepped per step."""
    if cfg.name == "step":
        return functools.partial(
            torch.optim.lr_scheduler.StepLR, step_size=cfg.step_size or 1, gamma=0.5 if cfg.gamma is None else cfg.gamma
        )
    if cfg.name == "cosine":
        if interval == "step":
            return _cosine_over_steps
        return functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=epochs)
    if cfg.name == "warmup_cosine":
        return functools.partial(_warmup_cosine, warmup_steps=cfg.warmup_steps or 0,
                                 min_lr_ratio=0.1 if cfg.min_lr_ratio is None else cfg.min_lr_ratio)
    return None


def _cosine_over_steps(optimizer: torch.optim.Optimizer, run: Any) -> Any:
    """Cosine annealing toward zero over the run's optimizer steps (``run.total_steps``), reached
    just after the last: stepped every step, a period of ``epochs`` would rise and fall again
    within the run."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(run.total_steps, 1))


def _warmup_cosine(optimizer: torch.optim.Optimizer, run: Any, *, warmup_steps: int, min_lr_ratio: float) -> Any:
    """Linear warmup over ``warmup_steps`` optimizer steps (the first at 1/``warmup_steps`` of the
    rate), then a cosine down toward ``min_lr_ratio`` of the rate, reached just after the run's
    last step (``run.total_steps``, known once the data is)."""
    import math

    total = max(run.total_steps, warmup_steps + 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min((step - warmup_steps) / (total - warmup_steps), 1.0)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def run_record(config: RunConfig) -> dict[str, Any]:
    """The config as a checkpoint records it, to compare with a resuming run's.

    ``data`` is the recipe's data config with its defaults filled in, not the section as written:
    a key left at its default has a value too, so a resume that sets it otherwise (``--set
    data.seed=7``, another train/validation split) is compared, and refused, like a key the YAML
    has. Keys of the recipe's ``DataConfig.RESUME_FREE`` (how the data is made or cached, not which
    data it is) are left out. ``defaults`` holds the recipe's defaults: a checkpoint of an older
    xlatrain recorded the section as written, and a key it left out stood at its default then.
    """
    from xlatrain.config import from_dict

    cls = recipe_module(config.recipe).DataConfig
    data = from_dict(cls, config.data, section="data")
    free = set(data.resume_free() if hasattr(data, "resume_free") else getattr(cls, "RESUME_FREE", ()))
    resolved = dataclasses.asdict(data)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING and f.name not in free}
    return {**dataclasses.asdict(config), "data": {k: v for k, v in resolved.items() if k not in free},
            "defaults": {"data": defaults}}


def build_trainer(config: RunConfig) -> tuple[Trainer, RecipeParts]:
    parts = recipe_module(config.recipe).build(config)
    trainer = Trainer(
        parts.model,
        parts.loss_fn,
        optimizer_factory(config.optimizer),
        scheduler_fn=scheduler_factory(config.schedule, config.trainer.epochs, config.trainer.scheduler_interval),
        config=config.trainer,
        checkpoint=config.checkpoint,
        backend=config.backend,
        label_names=parts.label_names,
        metrics_fn=parts.metrics_fn,
        run_config=run_record(config),
        callbacks=[_WriteConfig(config), _WarmupCheck(config.schedule)],
    )
    return trainer, parts


class _WarmupCheck:
    """Says where a schedule's warm-up covers the whole run: its rate rises at every step and
    never anneals (a smoke test's few steps under a long run's warm-up)."""

    def __init__(self, schedule: ScheduleConfig) -> None:
        self.warmup = (schedule.warmup_steps or 0) if schedule.name == "warmup_cosine" else 0

    def on_fit_start(self, trainer: Trainer) -> None:
        total = trainer.run_shape.total_steps if trainer.run_shape is not None else None
        if trainer.is_main and total is not None and self.warmup >= total:
            log.warning(f"warning: schedule.warmup_steps={self.warmup} covers the whole run ({total} optimizer steps): "
                        f"the rate rises at every step, to {100 * total / self.warmup:.3g}% of optimizer.lr, and never "
                        "anneals. Lower schedule.warmup_steps below the run's steps (a few percent of them is usual)")


class _WriteConfig:
    """Leaves the resolved ``config.yaml`` in the run directory as its first epoch starts, so a
    run that is preempted, killed or fails has it too; a finished run's rerun, which trains no
    epoch, leaves its files as they are."""

    def __init__(self, config: RunConfig) -> None:
        self.config, self.written = config, False

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        if not self.written and trainer.is_main:
            atomic_write_text(trainer.run_dir / "config.yaml", dump_yaml(self.config))
            trainer.publish("config.yaml")
        self.written = True


def run(config: RunConfig, resume: bool | str = "auto") -> tuple[Trainer, list[dict[str, Any]]]:
    """Build the recipe and train it; ``config.yaml`` (resolved) lands in the run directory as
    training starts."""
    trainer, parts = build_trainer(config)
    return trainer, trainer.fit(parts.train_data, parts.val_data, resume=resume)


# --- where a command that trains writes, when its user names no directory ---------------------

def launch_processes() -> int:
    """The processes this launch runs as: torchrun's ``WORLD_SIZE``, else 1."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def run_dir_for_launch(
    run_dir: str, *, accelerator: str, devices: int | None, processes: int = 1,
    default: tuple[str, int | None] = ("auto", None),
) -> str:
    """The run directory of a command that trains, for the devices it asks for.

    A recipe's directory (the demo's ``runs/demo``, a config's ``trainer.run_dir``) holds the
    run on its default devices: ``default`` (accelerator, devices), in one process. A command
    that asks for another accelerator or device count, or runs as several processes (torchrun),
    trains with another global batch, which could not resume that run: it gets a directory of its
    own beside it, ``RUN_DIR-ACCELERATOR[-COUNT]`` (COUNT: ``devices``, else the processes), and
    finds it again when run again.

    Example:
        >>> run_dir_for_launch("runs/demo", accelerator="xla", devices=4)
        'runs/demo-xla-4'
        >>> run_dir_for_launch("runs/digits", accelerator="auto", devices=None, processes=2)
        'runs/digits-auto-2'
        >>> run_dir_for_launch("runs/demo", accelerator="auto", devices=None)
        'runs/demo'
    """
    if (accelerator, devices) == default and processes <= 1:
        return run_dir
    count = devices if devices is not None else (processes if processes > 1 else None)
    return f"{run_dir.rstrip('/')}-{accelerator}" + (f"-{count}" if count is not None else "")


def launch_note(chosen: str, default_dir: str, *, accelerator: str, devices: int | None, processes: int,
                how_to_name: str) -> str:
    """One line saying why a command writes to ``chosen`` and not to ``default_dir``."""
    asked = [f"accelerator={accelerator}"] + ([f"devices={devices}"] if devices is not None else [])
    asked += [f"{processes} processes"] if processes > 1 else []
    # Keyed by what was asked, not what it resolved to: which devices "auto" finds is known only
    # once the backend starts, and a run on another device count (another global batch) could not
    # resume in the default's directory.
    return (f"xlatrain: run dir {chosen}: this command asks for {', '.join(asked)}, and {default_dir} is kept for "
            f"the default request (each request of devices gets a directory of its own: one that trains on "
            f"another device count has another global batch, and could not resume a run of the default's); "
            f"{how_to_name} names another")


def with_launch_run_dir(config: RunConfig, config_path: str, overrides: Sequence[str]) -> tuple[RunConfig, str | None]:
    """``xlatrain fit``'s config with its run directory for the launch (:func:`run_dir_for_launch`).

    The config file's ``trainer.run_dir`` is for the backend the file writes; a command line that
    sets another ``backend.accelerator`` or ``backend.devices``, or a torchrun launch of several
    processes, moves the run beside it. A ``--set trainer.run_dir=...`` is used as it is. Returns
    the config and the line to print where the directory moved (``None`` where it did not).
    """
    if any(item.partition("=")[0].strip() == "trainer.run_dir" for item in overrides):
        return config, None
    written = load_yaml(Path(config_path).read_text(), source=config_path).get("backend") or {}
    default = (written.get("accelerator", "auto"), written.get("devices"))
    backend, processes = config.backend, launch_processes()
    chosen = run_dir_for_launch(config.trainer.run_dir, accelerator=backend.accelerator, devices=backend.devices,
                                processes=processes, default=default)
    if chosen == config.trainer.run_dir:
        return config, None
    note = launch_note(chosen, config.trainer.run_dir, accelerator=backend.accelerator, devices=backend.devices,
                       processes=processes, how_to_name="--set trainer.run_dir=DIR")
    trainer = dataclasses.replace(config.trainer, run_dir=chosen)
    return dataclasses.replace(config, trainer=trainer), note
