"""Training progress for one epoch: a live bar in a terminal, plain lines everywhere else.

In a terminal the main process draws a tqdm bar that moves every step from the host's own step
count (no device value is read for it) and shows the loss and throughput of the last log
interval, which the Trainer hands in from its deferred read. Elsewhere (a log file, CI, a
notebook, every process under torchrun) each log interval is one plain line through the
``xlatrain`` logger, the same line with or without a bar installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from xlatrain.logs import LOGGER_NAME

# Environment variables set for every worker that torchrun (torch.distributed.elastic) starts.
_TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
_FALLBACK_COLUMNS, _FALLBACK_ROWS = 100, 24
# Loss and throughput come before the bar, so a narrow terminal cuts the ETA first, not them.
_BAR_FORMAT = "{desc} step {n_fmt}/{total_fmt}{postfix} |{bar}| [{elapsed}<{remaining}, {rate_fmt}]"


def interactive_terminal(
    is_main: bool,
    *,
    streams: Sequence[Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Whether this process should draw a live progress bar.

    True only on the main process, when stdout and stderr are both terminals (the bar draws on
    stderr, log lines go to stdout: with either one redirected to a file, that file gets plain
    lines), ``TERM`` is not ``dumb``, and the process runs neither under torchrun nor in CI
    (``CI`` set to anything but ``""``, ``0`` or ``false``).

    Args:
        is_main: whether this is the process that reports (rank 0).
        streams: the streams that must be terminals (default: ``sys.stdout`` and ``sys.stderr``).
        environ: the environment to read (default: ``os.environ``).
    """
    env = os.environ if environ is None else environ
    if not is_main:
        return False
    if env.get("CI", "").strip().lower() not in ("", "0", "false"):
        return False
    if any(name in env for name in _TORCHRUN_VARS):
        return False
    if env.get("TERM") == "dumb":
        return False
    return all(_isatty(s) for s in (streams if streams is not None else (sys.stdout, sys.stderr)))


@dataclasses.dataclass(frozen=True)
class IntervalStats:
    """What one log interval measured, for the line, the bar and TensorBoard."""

    step: int  # step within the epoch (1-based) the read was taken at
    epoch_loss: float  # mean training loss over the epoch's steps so far
    interval_loss: float  # mean training loss over the steps since the previous read
    samples_per_s: float | None  # samples since the previous read over the time since then; None in warm-up
    nonfinite: int  # steps of this epoch so far with a NaN/Inf loss or gradient norm (skip_step: steps skipped)
    # 1, or the processes whose non-finite losses ``nonfinite`` sums (each process's at each step)
    nonfinite_over: int = 1
    tokens_per_row: float | None = None  # mean input_ids positions per row over the interval, where counted


class IntervalMeter:
    """One epoch's interval figures, from the loss sums of successive deferred reads.

    Args:
        start_step: the last step already done (non-zero when resuming inside the epoch).
        samples_per_step: samples one step consumes over all devices (the global batch).
        start_sums: the epoch's loss sum and count of non-finite steps at ``start_step`` (from a
            checkpoint, each a mean over processes), so the first interval after a resume measures
            its own mean; ``None`` with ``start_step`` > 0 makes that first interval the epoch
            mean instead. A third number counts steps before ``start_step`` that skip_step
            skipped before a resume under another policy: in no sum, left out of the epoch mean.
        skipped_out: ``nan_policy='skip_step'``: a non-finite step adds nothing to the loss sum,
            and means are over the steps that counted (as the epoch's ``train_loss`` is); NaN
            where none did.
        processes: the processes whose mean non-finite count ``measure`` gets; the count said is
            their total.
    """

    def __init__(self, start_step: int, *, samples_per_step: int, start_sums: tuple[float, ...] | None = None,
                 warm_until: int | None = None, skipped_out: bool = False, processes: int = 1) -> None:
        self._samples_per_step = samples_per_step
        self._last_step = start_step
        self._last_sum, self._last_bad, *skipped = (0.0, 0.0) if start_step == 0 else (start_sums or (None, 0.0))
        self._skipped_before = skipped[0] if skipped else 0.0
        self._last_time = time.perf_counter()
        self.warm_until = start_step if warm_until is None else warm_until  # moves on where the warm-up does
        self._skipped_out, self._processes = skipped_out, processes
        self._last_tokens = 0.0

    def measure(self, step: int, *, loss_sum: float, nonfinite: float, tokens: float | None = None) -> IntervalStats:
        """The interval ending at ``step``: ``loss_sum`` over the epoch's steps 1..``step``, of which
        ``nonfinite`` were non-finite (both means over processes); ``tokens``, where counted, the
        input_ids positions per row summed over this fit's steps of the epoch up to ``step``. An
        interval that holds a warm-up step (compilation, first allocations) has no rate."""
        now = time.perf_counter()
        done = step - self._last_step

        def mean(total: float, steps: float, bad: float) -> float:  # NaN where no step counted: none to average
            counted = steps - (bad if self._skipped_out else 0.0)
            return total / counted if counted > 0 else math.nan

        rate = done * self._samples_per_step / max(now - self._last_time, 1e-9) if self._last_step >= self.warm_until \
            else None
        epoch_loss = mean(loss_sum, step - self._skipped_before, nonfinite)
        interval_loss = mean(loss_sum - self._last_sum, done, nonfinite - self._last_bad) \
            if self._last_sum is not None and done > 0 else epoch_loss
        row_tokens = (tokens - self._last_tokens) / done if tokens is not None and done > 0 else None
        self._last_step, self._last_sum, self._last_time, self._last_bad = step, loss_sum, now, nonfinite
        self._last_tokens = tokens or 0.0
        return IntervalStats(step, epoch_loss, interval_loss, rate, round(nonfinite * self._processes), self._processes,
                             row_tokens)


class EpochProgress:
    """One epoch's progress: ``advance`` every step, ``show`` each measured log interval (an
    :class:`IntervalMeter` measures it), ``close``.

    Args:
        epoch: the epoch number shown.
        num_steps: steps in the epoch.
        start_step: the last step already done (non-zero when resuming inside the epoch).
        interactive: draw a bar (see :func:`interactive_terminal`) instead of logging lines.
        log: where plain lines go, e.g. the Trainer's rank-0 ``logger.info``.
        stream: where the bar draws (default: ``sys.stderr``).

    Example:
        >>> meter = IntervalMeter(0, samples_per_step=256)
        >>> with EpochProgress(1, 100, 0, interactive=False, log=print) as p:
        ...     for step in range(1, 101):
        ...         p.advance(step)
        ...         if step % 50 == 0:
        ...             stats = meter.measure(step, loss_sum=0.7 * step, nonfinite=0)
        ...             p.show(step, epoch_loss=stats.epoch_loss, samples_per_s=1000.0, nonfinite=0)
          epoch 1 step 50/100  loss 0.7000  1,000 samples/s
          epoch 1 step 100/100  loss 0.7000  1,000 samples/s
    """

    def __init__(
        self,
        epoch: int,
        num_steps: int,
        start_step: int,
        *,
        interactive: bool,
        log: Callable[[str], None],
        stream: IO[str] | None = None,
    ) -> None:
        self.epoch = epoch
        self.num_steps = num_steps
        self._log = log
        self._stack = contextlib.ExitStack()
        self._bar: Any = None
        self._interactive = interactive
        if interactive:
            # The terminal bar, not tqdm.auto: notebooks get plain lines (their stdout is no tty).
            from tqdm.contrib.logging import logging_redirect_tqdm
            from tqdm.std import tqdm as std_tqdm

            file = stream if stream is not None else sys.stderr
            # A terminal that reports no size (some containers' ptys) would otherwise get no bar:
            # tqdm draws nothing on a screen it computes as -1 rows high.
            sized = _columns(file) > 0
            self._bar = std_tqdm(
                total=num_steps, initial=start_step, desc=f"epoch {epoch}", unit="step", leave=False,
                dynamic_ncols=sized, ncols=None if sized else _FALLBACK_COLUMNS,
                nrows=None if sized else _FALLBACK_ROWS, file=file, bar_format=_BAR_FORMAT,
            )
            self._stack.callback(self._bar.close)
            # Messages logged while the bar is up are written above it instead of through it.
            self._stack.enter_context(logging_redirect_tqdm(loggers=_console_loggers(), tqdm_class=std_tqdm))

    @property
    def interactive(self) -> bool:
        """Whether progress shows as a bar (instead of lines)."""
        return self._interactive

    def advance(self, step: int) -> None:
        """Move the bar to ``step`` (host bookkeeping only; nothing is read from the device). The
        last step is always drawn: the bar stays up through the epoch's end (evaluation, a
        checkpoint), and must not sit at a step before it."""
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)
            if step >= self.num_steps:
                self._bar.refresh()  # update() draws at most every 0.1 s and may skip it

    def show(self, step: int, *, epoch_loss: float, samples_per_s: float | None, nonfinite: int,
             nonfinite_over: int = 1, rate_note: str = "") -> None:
        """Show one measured interval: a line, or the bar's figures (no rate for a warm-up interval).
        ``nonfinite_over`` > 1: ``nonfinite`` counts the non-finite losses of that many processes.
        ``rate_note``: what else the rate means (tokens/s, MFU), shown after it."""
        note = "" if nonfinite <= 0 else f"  ({nonfinite} non-finite steps)" if nonfinite_over == 1 else \
            f"  ({nonfinite} non-finite losses over {nonfinite_over} processes)"
        if samples_per_s is None:
            rate_text = "warm-up (no rate: the first steps, compilations included, are timed apart)"
        else:
            rate_text = f"{format_rate(samples_per_s)} samples/s" + (f", {rate_note}" if rate_note else "")
        if self._interactive:
            # A read that lands after close is not shown: its bar is gone, and the epoch line follows.
            if self._bar is not None:
                self._bar.set_postfix_str(f"loss {epoch_loss:.4f}, {rate_text}{note}", refresh=False)
                self.advance(step)
                self._bar.refresh()
        else:
            self._log(
                f"  epoch {self.epoch} step {step}/{self.num_steps}  loss {epoch_loss:.4f}  {rate_text}{note}"
            )

    def close(self) -> None:
        """Remove the bar and put logging back as it was; a later ``show`` draws no bar."""
        self._stack.close()
        self._bar = None

    def __enter__(self) -> EpochProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def format_rate(value: float) -> str:
    """A rate (or a time) with the digits it has: ``1,874``, ``12.5``, ``0.27`` (never a ``0`` for a small one)."""
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 1:
        return f"{value:.1f}"
    return f"{value:.2g}"


class WarmupClock:
    """Where an epoch's steady window starts: after the first ``warm`` steps of a fit (where
    compilation and first allocations happen), timed when the device has run them (the runtime's
    deferred read), so steady rates leave them out."""

    def __init__(self, first_step: int, warm: int, started: float) -> None:
        self.mark_step = first_step + warm
        self.started = started
        self.marked: float | None = None if warm else started

    def mark(self, *_: Any) -> None:
        self.marked = time.perf_counter()

    def window_start(self, steps_done: int, first_step: int) -> int:
        """The last step before the window :meth:`rate` measures: the warm-up's last, or
        ``first_step`` where the epoch has no steady steps."""
        return self.mark_step if self.marked is not None and steps_done > self.mark_step else first_step

    def rate(self, steps_done: int, samples_per_step: int, first_step: int) -> tuple[float, float | None]:
        """(samples/s over the steady window, or over the whole epoch where it has no steady
        steps; the warm-up seconds left out, or None)."""
        now = time.perf_counter()
        if self.marked is not None and steps_done > self.mark_step:
            rate = (steps_done - self.mark_step) * samples_per_step / max(now - self.marked, 1e-9)
            return rate, (self.marked - self.started) if self.marked != self.started else None
        return (steps_done - first_step) * samples_per_step / max(now - self.started, 1e-9), None


def _columns(stream: Any) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # closed, detached or not a file at all
        return False


def _console_loggers() -> list[logging.Logger]:
    """The loggers whose terminal handlers must write around the bar.

    Only loggers that have such a handler: the redirect gives every logger it is handed a
    handler, which would print a message a second time on a logger that propagates it anyway.
    """
    def on_console(handler: logging.Handler) -> bool:
        return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)

    candidates = (logging.getLogger(LOGGER_NAME), logging.getLogger())
    return [lg for lg in candidates if any(on_console(h) for h in lg.handlers)]


def epoch_line(row: Mapping[str, Any], epochs: int, monitor: str, improved: bool) -> str:
    """The line that ends an epoch: its losses and metrics, time, rates and MFU."""
    shown = [f"{k} {v:.4f}" for k, v in row.items() if k.startswith(("train_", "val_")) and "auc_" not in k]
    star = f"  (best {monitor})" if improved else ""
    value = row.get(monitor)
    if isinstance(value, float) and math.isnan(value):  # an AUC of a label with one class in the set, say
        star = f"  ({monitor} is NaN: not judged, so no best weights from this epoch)"
    # The rates are the training steps' (validation has none), the time the epoch's whole.
    rate = "".join(f"  {'training ' if not i else ''}{format_rate(row[k])} {unit}" for i, (k, unit) in enumerate(
        (k, unit) for k, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")) if k in row))
    rate += f"  MFU {100 * row['mfu']:.1f}%" if "mfu" in row else ""
    # Rates leave the fit's first steps out: their time (compiling, first allocations) is said apart.
    warm = f" (first steps {format_rate(row['warmup_s'])}s, left out of the rates)" if "warmup_s" in row else ""
    whole = " with validation" if any(k.startswith("val_") for k in row) else ""
    n = row.get("nonfinite_steps", 0)
    skipped = f"  ({n} step{'s' if n != 1 else ''} with a NaN/Inf loss or gradient norm, skipped)" if n else ""
    return (f"epoch {row['epoch']}/{epochs}  " + "  ".join(shown) + f"  {row['epoch_time_s']:.1f}s{whole}{warm}"
            + rate + skipped + star)
