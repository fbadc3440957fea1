"""TensorBoard event files for a run, under ``RUN_DIR/tb/``, from values already on the host.

Every scalar of a run is plotted against one axis, the **optimizer step** (the global step,
counted across epochs), so per-interval training curves and per-epoch validation curves line up:

============================  ==========================  ======================================
tag                           when                        value
============================  ==========================  ======================================
``train/loss``                each log interval           mean training loss since the last one
``train/lr``                  each log interval           learning rate of the first param group
``train/samples_per_s``       each log interval           throughput since the last one
``val/<name>``                each epoch end              history column ``val_<name>``
``diagnostics/<column>``      each epoch end              columns ending ``_share`` or starting
                                                          ``xla_`` (input-bound share, compiles)
``epoch/<column>``            each epoch end              every other numeric history column
                                                          (``epoch/epoch`` maps steps to epochs)
``hparams/<name>``            once, at the end            the final metrics the HPARAMS tab shows
============================  ==========================  ======================================

The run's config goes to the HPARAMS tab (flattened to ``section.key``), in the run's own event
files, not in a sub-run as ``SummaryWriter.add_hparams`` would put it.

Resuming: a run that continues from optimizer step ``T`` (a checkpoint's, or 0) opens its writer
with ``purge_step=T + 1``. TensorBoard then hides every older point at a step after ``T`` (the steps
the crashed run wrote after its last checkpoint, which the resumed run writes again), and keeps
the point at ``T`` itself, which the resumed run does not write again. That is exact only if
every point up to ``T`` was on disk when the checkpoint was taken: each call here flushes, and
the caller logs an epoch (and, at the end, the hparams) before saving the checkpoint of that
step.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from xlatrain.logs import get_logger
from xlatrain.tree import flatten_keys

log = get_logger(__name__)

TB_DIR_NAME = "tb"
_EVENTS_PREFIX = "events.out.tfevents."
# How far behind the newest existing event file the clock may be before a resumed run warns
# instead of waiting: TensorBoard reads a directory's event files in name order, and the name
# starts with the creation second.
_MAX_CLOCK_WAIT_S = 2.0


class TensorBoardLog:
    """Writes a run's scalars and hparams as TensorBoard event files in ``run_dir/tb``.

    Only the main process writes; on the others, or with ``enabled=False``, every method does
    nothing and no directory is created. Every value must already be a host number: a tensor on
    a device raises ``TypeError``, because reading it would stall the device.

    Args:
        run_dir: the run directory; events go to ``run_dir / "tb"``.
        enabled: ``False`` turns every method into a no-op (``TrainConfig(tensorboard=False)``).
        is_main: whether this is the process that writes (rank 0).
        start_step: the optimizer step the run continues from: ``0`` for a fresh start, the
            checkpoint's global step on resume. Where ``run_dir/tb`` already holds events, those
            after this step are hidden, because this run writes them again.

    Example:
        >>> tb = TensorBoardLog("runs/x", enabled=True, is_main=True, start_step=0)
        >>> tb.interval(50, loss=0.71, lr=1e-3, samples_per_s=2150.0)
        >>> tb.epoch(1, 100, {"epoch": 1, "train_loss": 0.69, "val_loss": 0.65, "val_accuracy": 0.8})
        >>> tb.hparams({"trainer": {"lr": 1e-3}}, {"val_loss": 0.65}, step=100)
        >>> tb.close()
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, enabled: bool, is_main: bool, start_step: int) -> None:
        if start_step < 0:
            raise ValueError(f"start_step={start_step} is negative: give the optimizer step the run continues from")
        self.log_dir = Path(run_dir) / TB_DIR_NAME
        self.start_step = start_step
        self._writer: Any = None
        self._last_interval_step: int | None = None
        if not (enabled and is_main):
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch imports it lazily; tensorboard is a separate package
            raise ImportError(
                f"TensorBoard event files need the tensorboard package ({exc}): pip install tensorboard, "
                "or turn them off with TrainConfig(tensorboard=False)"
            ) from None
        earlier = _event_files(self.log_dir)
        if earlier:
            _wait_until_newer_than(earlier)
        # Every writer opens with a restart marker, a fresh run's included: TensorBoard's own
        # server (--load_fast=false) takes the first marker it reads for a start, not a restart,
        # and purges on later ones only.
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=start_step + 1)

    @property
    def enabled(self) -> bool:
        """Whether this process writes events."""
        return self._writer is not None

    def interval(self, step: int, *, loss: float | None, lr: float | None, samples_per_s: float | None,
                 tokens_per_s: float | None = None, mfu: float | None = None) -> None:
        """Log one training interval at optimizer step ``step``; ``None`` values are left out.

        At most one point per step is written (the Trainer ends each interval with an optimizer
        step, so its loss is over whole accumulation groups); a second one for a step is left out.
        """
        if self._writer is None:
            return
        if self._last_interval_step is not None and step <= self._last_interval_step:
            return
        self._last_interval_step = step
        for tag, value in (("train/loss", loss), ("train/lr", lr), ("train/samples_per_s", samples_per_s),
                           ("train/tokens_per_s", tokens_per_s), ("train/mfu", mfu)):
            if value is not None:
                self._writer.add_scalar(tag, _host_float(tag, value), step)
        self._writer.flush()

    def epoch(self, epoch: int, step: int, row: Mapping[str, Any]) -> None:
        """Log one epoch's history row at optimizer step ``step`` (the step the epoch ended on).

        Every numeric column becomes a scalar (see the module docstring for the tags); other
        columns are left out.
        """
        if self._writer is None:
            return
        values = {"epoch": epoch, **row}
        for column, value in values.items():
            if _is_number(value):
                self._writer.add_scalar(epoch_tag(column), _host_float(column, value), step)
        self._writer.flush()

    def hparams(self, config: Mapping[str, Any], final: Mapping[str, Any], *, step: int) -> None:
        """Record the run's config and final metrics for TensorBoard's HPARAMS tab.

        Args:
            config: the run's config, nested sections allowed (flattened to ``section.key``);
                ``None`` values are left out, lists and other values become strings.
            final: the final metrics, e.g. the last epoch's ``val_*`` columns and the best
                monitored value; each is written as the scalar ``hparams/<name>`` at ``step``.
            step: the optimizer step the run ended on.
        """
        if self._writer is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        metrics = {f"hparams/{k}": _host_float(k, v) for k, v in final.items() if _is_number(v)}
        experiment, start, end = hparams_summaries(_flatten(config), metrics)
        for summary in (experiment, start, end):  # the run's own file, not add_hparams' sub-run
            self._writer.file_writer.add_summary(summary, step)
        for tag, value in metrics.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def flush(self) -> None:
        """Put everything written so far on disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; later calls do nothing."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def epoch_tag(column: str) -> str:
    """The TensorBoard tag of a history column: ``val_loss`` -> ``val/loss``, ``input_bound_share``
    -> ``diagnostics/input_bound_share``, ``train_loss`` -> ``epoch/train_loss``."""
    if column.startswith("val_"):
        return "val/" + column[len("val_"):]
    if column.endswith("_share") or column.startswith("xla_"):
        return "diagnostics/" + column
    return "epoch/" + column


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Real):
        return True
    return _is_tensor(value)


def _is_tensor(value: Any) -> bool:
    # Only look for torch when the value could be a tensor: this module must import without it.
    return type(value).__module__.startswith("torch") and hasattr(value, "device")


def _host_float(name: str, value: Any) -> float:
    if _is_tensor(value):
        if value.device.type != "cpu":
            raise TypeError(
                f"{name} is a tensor on {value.device}: TensorBoard takes host numbers only, because reading "
                "a device value here would stall the device; pass the value from the deferred read"
            )
        return float(value)
    return float(value)


def _flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config as hparams take it: dotted keys, no None, lists as JSON, other objects as text."""
    def hparam(value: Any) -> Any:
        if isinstance(value, (bool, str)) or (isinstance(value, numbers.Real) and math.isfinite(value)):
            return value
        return json.dumps(value, default=str) if isinstance(value, (list, tuple)) else str(value)

    return {name: hparam(v) for name, v in flatten_keys(config).items() if v is not None}


def _event_files(log_dir: Path) -> list[Path]:
    if not log_dir.is_dir():
        return []
    return sorted(p for p in log_dir.iterdir() if p.name.startswith(_EVENTS_PREFIX))


def _wait_until_newer_than(files: list[Path]) -> None:
    """Let the clock pass the creation second of the newest event file, so that the new file's
    name (which starts with its creation second) sorts after every older one: readers apply a
    restart's purge only to events they have read before it."""
    newest = max(_created_second(p) for p in files)
    behind = newest + 1 - time.time()
    if behind <= 0:
        return
    if behind > _MAX_CLOCK_WAIT_S:
        log.warning(
            "TensorBoard: this host's clock is %.0f s behind the newest event file in %s; the resumed "
            "curves may show the steps after the checkpoint twice until the clock catches up",
            behind, files[0].parent,
        )
        return
    time.sleep(behind)


def _created_second(path: Path) -> int:
    try:
        return int(path.name[len(_EVENTS_PREFIX):].split(".", 1)[0])
    except ValueError:
        return 0
