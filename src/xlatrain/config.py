"""Run configuration: one frozen dataclass per concern, validated when built.

YAML files (and ``--set key=value`` overrides) only serialise these; every check lives in
``__post_init__`` so a config built in Python is checked exactly like one read from a file.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, TypeVar

ACCELERATORS = ("auto", "tpu", "xla", "cuda", "cpu")
TPU_RUNTIMES = ("auto", "torch_tpu", "torch_xla")
XLA_MODES = ("spmd", "multiprocess")
STRATEGIES = ("auto", "single", "ddp", "fsdp")
PRECISIONS = ("32", "bf16", "fp16")
TASKS = ("auto", "classification", "multilabel", "none")
MONITOR_MODES = ("max", "min")
SCHEDULER_INTERVALS = ("auto", "epoch", "step")
NAN_POLICIES = ("stop", "skip_step", "ignore")


# The direction of a monitored metric, known from the last word of its name. Any other name
# needs monitor_mode: guessing (val_mae maximised) would keep the worst weights.
MONITOR_DIRECTIONS = {"loss": "min", "accuracy": "max", "auc": "max"}


def monitor_mode_for(monitor: str) -> str | None:
    """``min`` / ``max`` for a metric whose name ends in a known word, else ``None``.

    Example:
        >>> monitor_mode_for("val_weighted_log_loss"), monitor_mode_for("val_mean_auc"), monitor_mode_for("val_mae")
        ('min', 'max', None)
        >>> monitor_mode_for("val_map50")
        'max'
    """
    word = monitor.rsplit("_", 1)[-1]
    if word.startswith("map") and word[3:].isdigit():  # mean average precision at an IoU: map50, map75
        return "max"
    return MONITOR_DIRECTIONS.get(word)


def _choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not valid: choose one of {', '.join(map(repr, valid))}")


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not valid: it must be an integer >= {minimum}")


def check_int(name: str, value: Any, minimum: int = 1) -> None:
    """An integer key at least ``minimum``, or a ValueError naming it (for recipes' data sections)."""
    _positive_int(name, value, minimum)


def check_fraction(name: str, value: Any) -> None:
    """A number strictly between 0 and 1, or a ValueError naming the key."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{name}={value!r} is not valid: give a fraction between 0 and 1, e.g. 0.2")


def check_nonnegative(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name}={value!r} is not valid: give a number >= 0")


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """Where a run executes.

    Attributes:
        accelerator: ``auto`` (TPU, else CUDA, else CPU), ``tpu``, ``xla`` (torch_xla on whatever
            PJRT device exists, XLA:CPU without a TPU), ``cuda`` or ``cpu``.
        devices: devices to use; ``None`` means all. With ``xla`` on a machine without a TPU this
            is the number of virtual XLA:CPU devices, to rehearse a TPU program on a laptop.
        xla_mode: ``spmd`` (one process, the global batch sharded over a ``data`` mesh axis) or
            ``multiprocess`` (one process per chip, started with ``xlatrain.spawn``).
        compile_cache: keep compiled programs on disk so the next identical run starts without
            compiling: torch_xla's in ``$XLATRAIN_CACHE_DIR`` (default ``~/.cache/xlatrain/xla``),
            TorchTPU's in its sibling ``torch_tpu``.
        tpu_runtime: which runtime drives a TPU: ``auto`` (TorchTPU when it has a TPU device, else
            torch_xla), ``torch_tpu`` or ``torch_xla``.
        strategy: how the model is spread over the devices: ``auto`` (data parallel over what was
            launched: DDP under torchrun, SPMD over a ``data`` mesh on torch_xla, else one
            device), ``single``, ``ddp`` (every device a whole replica) or ``fsdp`` (parameters,
            gradients and optimizer state sharded over the devices: torch's ``fully_shard`` on
            CPU, CUDA and TorchTPU, torch_xla's FSDPv2 over an ``fsdp`` mesh axis). Checkpoints of
            an ``fsdp`` run are sharded and resume at any device count.
        units: the model's repeated blocks, which FSDP shards one at a time and activation
            checkpointing recomputes: class names (from YAML), classes, or ``fn(module) -> bool``.
            Default: every class with two or more parameter-holding instances that is not one of
            torch's own layers (transformer layers, ResNet blocks), outermost first.
        activation_checkpointing: recompute each unit's activations during backward instead of
            keeping them: less memory for about one more forward pass of compute.
        device_memory: what one device holds, to plan for a device other than this one (``"v5e"``,
            ``"tpu-v6e"``, ``"h100"``, ``"16GB"``, ``"80GiB"`` or bytes): the memory check before
            the first step measures against it instead of what the runtime reports. Known devices:
            ``xlatrain.backend.hardware.DEVICE_SPECS``.
    """

    accelerator: str = "auto"
    devices: int | None = None
    xla_mode: str = "spmd"
    compile_cache: bool = True
    tpu_runtime: str = "auto"
    strategy: str = "auto"
    units: Any = None
    activation_checkpointing: bool = False
    device_memory: str | int | None = None

    def __post_init__(self) -> None:
        _choice("accelerator", self.accelerator, ACCELERATORS)
        if self.device_memory is not None:
            from xlatrain.backend.hardware import parse_memory

            parse_memory(self.device_memory)  # a ValueError naming the forms it takes
        _choice("xla_mode", self.xla_mode, XLA_MODES)
        _choice("tpu_runtime", self.tpu_runtime, TPU_RUNTIMES)
        _choice("strategy", self.strategy, STRATEGIES)
        if self.devices is not None:
            _positive_int("devices", self.devices)
        if self.units is not None:
            if self.strategy != "fsdp" and not self.activation_checkpointing:
                raise ValueError(
                    f"units={self.units!r} takes effect only with strategy='fsdp' or activation_checkpointing=True: "
                    "set one of them, or leave units unset"
                )
            if isinstance(self.units, (str, type)):
                object.__setattr__(self, "units", [self.units])
            if isinstance(self.units, list):
                object.__setattr__(self, "units", tuple(self.units))
            if not callable(self.units) and not (
                isinstance(self.units, tuple) and self.units and all(isinstance(u, (str, type)) for u in self.units)
            ):
                raise ValueError(
                    f"units={self.units!r} is not valid: give class names, classes, or a function module -> bool"
                )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How a model is trained and evaluated.

    Attributes:
        epochs: passes over the training data.
        batch_size: samples per device per step; the global batch is this times the number of
            data-parallel devices and is reported at start.
        eval_batch_size: per-device batch for evaluation and prediction (default: batch_size).
        scale_lr: multiply every learning rate by the number of devices (linear scaling rule).
        precision: ``"32"``, ``"bf16"`` (autocast; weights and optimizer state stay float32) or
            ``"fp16"`` (autocast to float16 with a gradient scaler, for GPUs without bfloat16:
            T4, V100, P100; CUDA and CPU only).
        grad_accum_steps: micro-batches per optimizer step. Each micro-batch's loss is divided by
            it, so the step follows the mean of the micro-batches' losses (as Lightning and
            Accelerate do). Where a loss is a mean over tokens and micro-batches hold different
            numbers of them, that weighs a token of a short micro-batch more than one batch of
            them all would; the Hugging Face Trainer divides by the group's token count instead.
        clip_grad_norm: clip the global gradient norm to this value; ``None`` disables clipping.
        log_every: steps (micro-batches) between progress lines; the only per-step-interval host
            reads. Under gradient accumulation a line waits for the optimizer step that ends the
            group, so its loss is over whole groups.
        seed: seeds model init order, sampling and shuffling; each epoch reshuffles from it.
        num_workers: processes that fetch and decode batches beside each training process (the
            DataLoader's workers, or the shard reader's). ``"auto"``: the CPUs this process may use
            (``os.sched_getaffinity``), shared among the training processes on the host
            (``LOCAL_WORLD_SIZE``), less one for the training process itself, and at most the
            batches of an epoch; none for data already in memory (a ``TensorDataset``, a list), or
            whose batch this process makes in under a millisecond (less than taking one from a
            worker costs it; the batches are the same either way). The run's header says what was
            chosen and why; a number is used as given.
        task: ``classification`` (accuracy), ``multilabel`` (per-label AUC), ``none`` (loss only)
            or ``auto`` (from the loss: CrossEntropyLoss / BCEWithLogitsLoss).
        top_k: classification: also report ``val_top{k}_accuracy`` for each ``k`` (``(5,)``: top-5),
            summed on the device and read with the other metrics.
        ema_decay: keep an exponential moving average of the weights, ``ema = decay * ema + (1 -
            decay) * weights`` every ``ema_every`` optimizer steps, on the device (``None``: none).
            It is scored on the validation data beside the live model (``val_ema_...`` columns),
            saved in checkpoints and restored on resume, and written to ``RUN_DIR/ema.safetensors``
            after each epoch; monitoring a ``val_ema_`` column makes ``best.safetensors`` the EMA's.
        ema_every: optimizer steps between EMA updates.
        ema_rule: when the average updates. ``"every"``: after optimizer steps N, 2N, 3N, ... of the
            run (N = ``ema_every``), the first optimizer step's weights starting it. ``"torchvision"``:
            after steps 1, 1 + N, 1 + 2N, ... of each epoch, as torchvision's classification reference
            (``train.py``: ``i % model_ema_steps == 0``) updates its ``ExponentialMovingAverage``.
        ema_warmup_epochs: for the first this many epochs every update copies the weights instead of
            averaging them, and so does the first update after them: averaging starts there
            (torchvision resets its average after each update of its learning-rate warm-up epochs).
        ema_bn_batches: before the EMA weights are scored, recompute the batch-norm statistics they
            go with over this many training batches (``torch.optim.swa_utils.update_bn``'s way: the
            running means and variances as the averages over those batches, in train mode without
            gradients), the live model's statistics put back after. ``0`` (the default) scores the
            EMA weights with the live model's statistics; the run's header says when it is on.
        channels_last: the model's weights and every 4-D floating batch tensor (images) in
            channels-last memory order, which convolutions run faster in on GPUs with tensor cores.
            ``"auto"``: on for a model with 2-D convolutions on CUDA under bf16/fp16 autocast (1.7x
            for a ResNet-34 on an H100), off elsewhere (TPU runtimes choose their own layouts; on
            this project's CPU it measured slower); the header says which.
        monitor: history column that selects the best weights (default from the task).
        monitor_mode: ``max`` or ``min``; may be left out only for a name ending in ``_loss``
            (min), ``_accuracy``, ``_auc`` or ``_map`` and a number, such as ``_map50`` (max).
        scheduler_interval: step the scheduler every ``epoch`` or every optimizer ``step``;
            ``"auto"`` (the default): every step for a two-argument ``scheduler_fn`` that reads
            ``run.total_steps`` or ``run.steps_per_epoch`` (a schedule sized in optimizer steps, as
            Hugging Face's and OneCycleLR are), every epoch otherwise (ReduceLROnPlateau always,
            on the monitored value); the header says which and why.
        early_stop_patience: stop when the monitored value has not improved for this many
            epochs (``None``: train every epoch). A resumed run keeps counting from its best epoch.
        save_best: write ``best.safetensors`` whenever the monitored value improves.
        nan_policy: what a NaN/Inf loss or gradient norm does, found at the next log interval or
            checkpoint (no per-step read): ``stop`` (raise, naming the step range; the last good
            checkpoint stays latest), ``skip_step`` (such steps leave weights and optimizer state
            tensors unchanged, at the cost of a copy of both per step, and with several processes one
            scalar all-reduce per step, so that every process skips alike; under
            ``grad_accum_steps`` all of a skipped step's micro-batches leave the means), ``ignore``.
        diagnostics: gather why-is-it-slow evidence (recompilations and their causes, device
            reads outside the planned ones, CPU fallbacks, compile and input-wait shares) and
            report it at the end of ``fit`` and in ``RUN_DIR/diagnostics.json``.
        strict: make waste after the warm-up an error, at the end of the epoch it happened in: in the
            first epoch, what its findings call waste (a compilation a clean run would not make, device
            reads on every other training step or more); in later epochs, any compilation or
            unplanned device read.
        compile: run the model under ``torch.compile`` (CPU, CUDA, TorchTPU; torch_xla compiles
            every step already): the training and evaluation graphs are compiled separately.
        tensorboard: write TensorBoard event files to ``RUN_DIR/tb`` (training loss, learning
            rate and samples/s per log interval; history columns per epoch; config as hparams).
        profile_steps: ``(start, stop)``: trace those training steps (counted from 1 over the
            run, both included) with torch.profiler, or torch_xla's profiler on XLA, into
            ``RUN_DIR/profile/`` with a short summary; ``None`` traces nothing.
        run_dir: where history, best weights, checkpoints and plots go.
    """

    epochs: int = 1
    batch_size: int = 32
    eval_batch_size: int | None = None
    scale_lr: bool = False
    precision: str | int = "32"
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    log_every: int = 50
    seed: int = 0
    num_workers: int | str = "auto"
    task: str = "auto"
    top_k: tuple[int, ...] = ()
    ema_decay: float | None = None
    ema_every: int = 1
    ema_rule: str = "every"
    ema_warmup_epochs: int = 0
    ema_bn_batches: int = 0
    channels_last: bool | str = "auto"
    monitor: str | None = None
    monitor_mode: str | None = None
    scheduler_interval: str = "auto"
    early_stop_patience: int | None = None
    save_best: bool = True
    nan_policy: str = "stop"
    diagnostics: bool = True
    strict: bool = False
    compile: bool = False
    tensorboard: bool = True
    profile_steps: tuple[int, int] | None = None
    run_dir: str = "runs/default"

    def __post_init__(self) -> None:
        _positive_int("epochs", self.epochs)
        _positive_int("batch_size", self.batch_size)
        if self.eval_batch_size is not None:
            _positive_int("eval_batch_size", self.eval_batch_size)
        _choice("precision", str(self.precision), PRECISIONS)
        if not isinstance(self.precision, str):
            object.__setattr__(self, "precision", str(self.precision))
        _positive_int("grad_accum_steps", self.grad_accum_steps)
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(
                f"clip_grad_norm={self.clip_grad_norm!r} is not valid: use a positive number, "
                "or None to disable clipping"
            )
        _positive_int("log_every", self.log_every)
        if self.num_workers != "auto":
            if isinstance(self.num_workers, str):
                raise ValueError(f"num_workers={self.num_workers!r} is not valid: use 'auto' or a number of processes "
                                 "(0 fetches batches in the training process)")
            _positive_int("num_workers", self.num_workers, minimum=0)
        if self.channels_last not in (True, False, "auto"):
            raise ValueError(f"channels_last={self.channels_last!r} is not valid: use 'auto', True or False")
        _choice("task", self.task, TASKS)
        top_k = (self.top_k,) if isinstance(self.top_k, int) else self.top_k
        if not isinstance(top_k, (tuple, list)) or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in top_k):
            raise ValueError(
                f"top_k={self.top_k!r} is not valid: give the k of each top-k accuracy to report, e.g. top_k=(5,) "
                "for val_top5_accuracy (positive integers)"
            )
        object.__setattr__(self, "top_k", tuple(sorted(set(top_k))))
        if self.ema_decay is not None and not (isinstance(self.ema_decay, (int, float)) and 0 < self.ema_decay < 1):
            raise ValueError(
                f"ema_decay={self.ema_decay!r} is not valid: give the average's decay per update, between 0 and 1 "
                "(0.999 is typical; torchvision's recipe uses 0.99998 per step), or None for no EMA"
            )
        _positive_int("ema_every", self.ema_every)
        _choice("ema_rule", self.ema_rule, ("every", "torchvision"))
        _positive_int("ema_warmup_epochs", self.ema_warmup_epochs, minimum=0)
        _positive_int("ema_bn_batches", self.ema_bn_batches, minimum=0)
        unused = [f"{k}={getattr(self, k)!r}" for k, default in (("ema_every", 1), ("ema_rule", "every"),
                  ("ema_warmup_epochs", 0), ("ema_bn_batches", 0)) if getattr(self, k) != default]
        if self.ema_decay is None and unused:
            raise ValueError(f"{', '.join(unused)} shape an EMA of the weights, and ema_decay is None (no EMA): set "
                             "ema_decay (e.g. 0.999) to keep one, or leave these out")
        if self.monitor_mode is not None:
            _choice("monitor_mode", self.monitor_mode, MONITOR_MODES)
        elif self.monitor is not None and monitor_mode_for(self.monitor) is None:
            import difflib

            known = ["train_loss", *(f"{side}_{kind}" for side in ("val", "val_ema") for kind in ("loss", "accuracy", "mean_auc"))]
            near = difflib.get_close_matches(self.monitor, known, n=1, cutoff=0.7)
            raise ValueError(
                f"monitor={self.monitor!r} needs monitor_mode: say whether a higher value is better "
                f"(monitor_mode='max') or a lower one (monitor_mode='min'); only names ending in "
                f"{', '.join('_' + w for w in MONITOR_DIRECTIONS)} or _map and a number (_map50) have a known direction"
                + (f" (did you mean {near[0]!r}, a column the Trainer writes?)" if near else "")
            )
        _choice("scheduler_interval", self.scheduler_interval, SCHEDULER_INTERVALS)
        if self.early_stop_patience is not None:
            _positive_int("early_stop_patience", self.early_stop_patience)
        _choice("nan_policy", self.nan_policy, NAN_POLICIES)
        if self.profile_steps is not None:
            from xlatrain.diagnostics.profile import check_profile_steps

            object.__setattr__(self, "profile_steps", check_profile_steps(self.profile_steps))
        if not self.run_dir:
            raise ValueError("run_dir is empty: give a directory for history and weights")
        if isinstance(self.run_dir, str) and self.run_dir.startswith("~"):
            # As a shell would: a YAML value or a quoted --set is not expanded, and made a folder named ~.
            object.__setattr__(self, "run_dir", os.path.expanduser(self.run_dir))


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When a run saves resumable state (``RUN_DIR/checkpoints/step-NNNNNNNN/``).

    Attributes:
        every_steps: also save every this many optimizer steps (``None``: only at epoch end).
        at_epoch_end: save after each epoch's validation.
        keep_last: checkpoints kept besides the one holding the best monitored value.
        enabled: ``False`` writes no checkpoints (and a run cannot resume).
    """

    every_steps: int | None = None
    at_epoch_end: bool = True
    keep_last: int = 2
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.every_steps is not None:
            _positive_int("every_steps", self.every_steps)
        _positive_int("keep_last", self.keep_last)


C = TypeVar("C")


def _type_ok(value: Any, annotation: str) -> bool:
    """Check a YAML/CLI value against a field annotation written as a string (``int | None``)."""
    kinds = {"int": int, "float": (int, float), "str": str, "bool": bool, "None": type(None)}
    for part in (p.strip() for p in annotation.split("|")):
        kind = kinds.get(part)
        if kind is None:
            return True  # a type this check does not model; __post_init__ still validates it
        if isinstance(value, bool) and part in ("int", "float"):
            continue  # YAML's `true` is not a number
        if isinstance(value, kind):
            return True
    return False


def from_dict(cls: type[C], values: dict[str, Any], section: str | None = None) -> C:
    """Build a config dataclass from a mapping, checking keys and value types.

    An unknown key is an error naming the valid ones; a value of the wrong type names the key, the
    value and the expected type. Range and choice checks follow in the class's ``__post_init__``.
    """
    where = f"{section}." if section else ""
    if not isinstance(values, dict):
        raise ValueError(f"{section or cls.__name__} must be a mapping of keys to values, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(fields))
    renamed = getattr(cls, "RENAMED", {})  # old key -> its new name and what it means
    for key in unknown:
        if key in renamed:
            raise ValueError(f"{where}{key} was renamed {where}{renamed[key]}: use that key")
    if unknown:
        raise ValueError(
            f"unknown {cls.__name__} key(s) {', '.join(where + k for k in unknown)}: valid keys are "
            f"{', '.join(sorted(fields))}"
        )
    for key, value in values.items():
        annotation = str(fields[key].type)
        if value is None and not _type_ok(value, annotation):
            raise ValueError(f"{where}{key} has no value (YAML's empty or null): give one ({annotation})")
        if not _type_ok(value, annotation):
            raise ValueError(f"{where}{key}={value!r} has the wrong type: expected {annotation}")
    try:
        return cls(**values)
    except ValueError as exc:
        message = str(exc)  # the model, optimizer and schedule sections name their keys in full
        raise ValueError(message if message.startswith(where) else f"{where}{message}") from None


class _DuplicateKey(ValueError):
    """A key given twice in one YAML mapping."""


def _safe_loader() -> Any:
    """PyYAML's safe loader, reading ``2e-3`` as the float it is: PyYAML follows YAML 1.1, whose
    floats need a dot (``2.0e-3``), so a learning rate written the usual way arrived as a string."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be given again
                    continue
                try:
                    key = self.construct_object(key_node, deep=deep)
                    again = key in seen
                except TypeError:  # an unhashable key: PyYAML's own error names it
                    continue
                if again:  # PyYAML keeps the last silently
                    raise _DuplicateKey(f"{key!r} is given twice in one mapping (lines {seen[key].line + 1} and "
                                        f"{key_node.start_mark.line + 1}): keep one")
                seen[key] = key_node.start_mark
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"))
    return Loader


def load_yaml(text: str, source: str = "<config>") -> dict[str, Any]:
    """Parse YAML with the safe loader: plain data only, no tags that construct Python objects."""
    import yaml

    try:
        data = yaml.load(text, Loader=_safe_loader())  # noqa: S506 - a SafeLoader
    except _DuplicateKey as exc:
        raise ValueError(f"{source}: {exc}") from None
    except yaml.constructor.ConstructorError as exc:
        raise ValueError(
            f"{source}: {exc.problem} ({exc.problem_mark}); Python object tags are not allowed in "
            "configs: write plain values"
        ) from None
    except yaml.YAMLError as exc:
        hint = " (YAML indentation must use spaces, not tabs)" if "\t" in text else ""
        raise ValueError(f"{source}: not valid YAML{hint}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


# --- a whole run, as `xlatrain fit CONFIG.yaml` reads it -------------------------------------

OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("none", "step", "cosine", "warmup_cosine")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A model by name (see ``xlatrain.models.MODEL_NAMES``); ``pretrained`` is a local file path."""

    name: str = "small_cnn"
    """A name of ``xlatrain.models.MODEL_NAMES`` (torchvision classifiers such as ``resnet18``,
    ``resnet_unet``, ``small_cnn``), or ``byte_gpt`` in the ``lm`` recipe; a recipe may allow
    fewer."""
    pretrained: bool | str = False
    """The path of a local weights file to start from (nothing is downloaded; ``True`` is an
    error saying so), or ``False``."""
    width: int | None = None  # for resnet_unet / small_cnn / byte_gpt (model width)
    """The model's width, for ``resnet_unet``, ``small_cnn`` and ``byte_gpt``; an error for a
    model that takes none. ``None``: the model's default."""
    blocks: list[int] | None = None  # residual blocks per stage, resnet_unet only
    """Residual blocks per stage, e.g. ``[2, 2, 2, 2]``: ``resnet_unet`` only."""
    layers: int | None = None  # byte_gpt (the lm recipe) only: transformer blocks
    """Transformer blocks: ``byte_gpt`` (the ``lm`` recipe) only."""
    heads: int | None = None  # byte_gpt only: attention heads
    """Attention heads: ``byte_gpt`` only."""
    positions: str | None = None  # byte_gpt only: "rotary" or "learned"
    """``rotary`` or ``learned`` position embeddings: ``byte_gpt`` only."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("model.name is empty: give a model name such as 'resnet18'")
        if self.width is not None:
            _positive_int("model.width", self.width)
        for key in ("layers", "heads"):
            if getattr(self, key) is not None:
                _positive_int(f"model.{key}", getattr(self, key))
        if self.positions is not None:
            _choice("model.positions", self.positions, ("rotary", "learned"))
        if self.blocks is not None:
            if not isinstance(self.blocks, (list, tuple)) or not self.blocks:
                raise ValueError(f"model.blocks={self.blocks!r} is not valid: give residual blocks per stage, e.g. [2, 2, 2, 2]")
            for n in self.blocks:
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ValueError(f"model.blocks={list(self.blocks)!r} is not valid: each stage's residual blocks must be "
                                     "an integer >= 1, e.g. [2, 2, 2, 2]")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer of a config-driven run (``optimizer:``), built once the model is on the device."""

    name: str = "adam"
    """``adam``, ``adamw`` (weight decay on the matrices only: biases and norm weights do not
    decay) or ``sgd``."""
    lr: float = 1e-3
    """The learning rate, positive."""
    weight_decay: float = 0.0
    """Weight decay, 0 or more."""
    momentum: float | None = None  # sgd only (default 0.9)
    """``sgd`` only (``None``: 0.9); an error for the others."""

    def __post_init__(self) -> None:
        _choice("optimizer.name", self.name, OPTIMIZERS)
        if self.momentum is not None and self.name != "sgd":
            raise ValueError(
                f"optimizer.momentum is set but {self.name} takes no momentum (its betas are fixed here): "
                "remove the key (on the command line: --set optimizer.momentum=null), or use optimizer.name: sgd"
            )
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr={self.lr!r} is not valid: use a positive learning rate")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay={self.weight_decay!r} is not valid: use 0 or more")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """LR schedule, stepped per ``trainer.scheduler_interval``: StepLR, a cosine over the whole run, or
    ``warmup_cosine``: a linear warmup over ``warmup_steps`` optimizer steps (the first at
    1/``warmup_steps`` of the rate), then a cosine toward ``min_lr_ratio`` of the rate, reached
    just after the run's last step (stepped every optimizer step)."""

    name: str = "none"
    """``none`` (a constant rate), ``step`` (StepLR), ``cosine`` (cosine annealing toward zero over
    all epochs, or over all optimizer steps with ``trainer.scheduler_interval: step``, reached just
    after the last) or
    ``warmup_cosine`` (stepped every optimizer step: ``trainer.scheduler_interval: step`` or
    ``auto``)."""
    step_size: int | None = None  # step only (default 1)
    """``step`` only: epochs (or optimizer steps, with ``trainer.scheduler_interval: step``) between
    decays (``None``: 1; stepped per optimizer step, it or ``gamma`` must be given)."""
    gamma: float | None = None  # step only (default 0.5)
    """``step`` only: the factor of each decay (``None``: 0.5)."""
    warmup_steps: int | None = None  # warmup_cosine only (default 0)
    """``warmup_cosine`` only: optimizer steps of linear warmup (``None``: 0)."""
    min_lr_ratio: float | None = None  # warmup_cosine only (default 0.1)
    """``warmup_cosine`` only: the floor the cosine falls to, reached just after the last step, as
    a fraction of the peak, 0 to 1 (``None``: 0.1)."""

    def __post_init__(self) -> None:
        _choice("schedule.name", self.name, SCHEDULES)
        uses = {"step": ("step_size", "gamma"), "warmup_cosine": ("warmup_steps", "min_lr_ratio")}
        given = [k for k in ("step_size", "gamma", "warmup_steps", "min_lr_ratio")
                 if getattr(self, k) is not None and k not in uses.get(self.name, ())]
        if given:
            owner = next(name for name, keys in uses.items() if given[0] in keys)
            raise ValueError(
                f"schedule.{given[0]} is set but schedule.name={self.name!r} does not use it: remove the key "
                f"(on the command line: --set schedule.{given[0]}=null), or use schedule.name: {owner}"
            )
        if self.warmup_steps is not None:
            _positive_int("schedule.warmup_steps", self.warmup_steps, minimum=0)
        if self.min_lr_ratio is not None and not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"schedule.min_lr_ratio={self.min_lr_ratio!r} is not valid: give a fraction of the rate, 0 to 1")
        if self.step_size is not None:
            _positive_int("schedule.step_size", self.step_size)
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"schedule.gamma={self.gamma!r} is not valid: use a positive factor")


SECTIONS = {
    "model": ModelConfig,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "trainer": TrainConfig,
    "backend": BackendConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one run needs; ``data`` is checked by the recipe's own data config."""

    recipe: str
    """The recipe that builds model and data: ``digits``, ``depth_mask``, ``pe_detection`` or
    ``lm``."""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The ``data:`` section, as written: the recipe's own data config checks its keys."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The ``model:`` section."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    """The ``optimizer:`` section."""
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    """The ``schedule:`` section."""
    trainer: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """The ``trainer:`` section."""
    backend: BackendConfig = dataclasses.field(default_factory=BackendConfig)
    """The ``backend:`` section."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """The ``checkpoint:`` section."""


def _parse_value(text: str) -> Any:
    """A ``--set`` value as YAML would read it (``3`` -> 3, ``true`` -> True, ``1e-3`` -> 0.001)."""
    import yaml

    value = yaml.load(text, Loader=_safe_loader())  # noqa: S506 - a SafeLoader
    if isinstance(value, str):
        try:
            return float(value)  # inf, nan
        except ValueError:
            return value
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to a parsed config mapping (returns a new mapping)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r} is not valid: write section.key=value, e.g. trainer.epochs=3")
        *path, leaf = key.split(".")
        node = out
        for depth, part in enumerate(path):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                where = ".".join(path[: depth + 1])
                raise ValueError(f"--set {item!r}: {where} is {node!r}, not a section of keys (an earlier --set or the "
                                 f"config gave it that value): set its keys instead, e.g. {where}.KEY=VALUE")
        node[leaf] = _parse_value(raw)
    return out


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    valid = ("recipe", "data", *SECTIONS)
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ValueError(f"unknown config section(s) {', '.join(unknown)}: valid sections are {', '.join(valid)}")
    if "recipe" not in data:
        raise ValueError("the config has no 'recipe': name one, e.g. recipe: pe_detection")
    data_section = data.get("data") or {}
    if not isinstance(data_section, dict):
        raise ValueError(f"data must be a mapping, got {data_section!r}")
    sections = {name: from_dict(cls, data.get(name) or {}, section=name) for name, cls in SECTIONS.items()}
    if sections["schedule"].name == "warmup_cosine" and sections["trainer"].scheduler_interval == "epoch":
        raise ValueError(
            "schedule.name=warmup_cosine counts optimizer steps: set trainer.scheduler_interval: step (or auto) "
            f"(it is {sections['trainer'].scheduler_interval!r})"
        )
    schedule, interval = sections["schedule"], sections["trainer"].scheduler_interval
    if schedule.name == "none" and interval not in ("auto", "epoch"):  # refused before the recipe builds anything
        raise ValueError(f"trainer.scheduler_interval: {interval} says when a learning-rate schedule steps, and "
                         "schedule.name is none: name one (step, cosine, warmup_cosine), or leave the interval out")
    if schedule.name == "step" and interval == "step" and schedule.step_size is None and schedule.gamma is None:
        raise ValueError(
            "schedule.name=step with trainer.scheduler_interval: step decays the rate every schedule.step_size "
            "optimizer steps, and the defaults (1 step, gamma 0.5) would halve it at every step: set "
            "schedule.step_size (in optimizer steps, e.g. the steps of an epoch) or schedule.gamma (e.g. 0.999), or "
            "trainer.scheduler_interval: epoch")
    return RunConfig(recipe=str(data["recipe"]), data=dict(data_section), **sections)


def load_run_config(path: str, overrides: list[str] | None = None) -> RunConfig:
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{path} is a directory, not a config file: give the path of a YAML config, e.g. configs/digits.yaml")
    if not p.is_file():
        raise ValueError(f"config file {path} does not exist: give the path of a YAML config, e.g. configs/digits.yaml")
    return run_config_from_dict(apply_overrides(load_yaml(p.read_text(), source=str(p)), overrides or []))


def dump_yaml(config: RunConfig) -> str:
    import yaml

    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)
