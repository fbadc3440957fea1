"""What watches the training loop: xlatrain's own observers and the user's callbacks, named once.

The loop calls :class:`Observers` at each point of a run; the progress display, TensorBoard, the
profiler trace and the run diagnostics are observers like the user's callbacks
(:mod:`xlatrain.train.callbacks`), and hear the same public points with the same host values. They
also hear a few points the public hooks leave out, because these sit inside a step or come before
an epoch's row is final:

- ``batches(batches, phase, epoch, first_step)``: wrap a pass's batch iterator (the diagnostics
  time the input wait); returns the iterator to use;
- ``on_steps_start(trainer, epoch, start_step, num_steps)`` / ``on_steps_stop()``: around one
  epoch's training steps, the stop however the epoch ends (the progress bar);
- ``on_step_start(index)`` / ``on_step_end(step, index, input_wait_s)``: around each training step,
  ``step`` within the epoch, ``index`` over the run (the trace; the bar);
- ``on_state_remade()``: skip_step dropped optimizer state the step just taken had made; the next
  step makes it again (the diagnostics' warm-up runs a step longer);
- ``on_epoch_row(trainer, row)``: add columns to an epoch's row before it is judged and written;
- ``on_epoch_written(trainer, row, cursor, last)``: the row is in ``history.json`` and the epoch's
  checkpoint is not yet written (TensorBoard's epoch point must be on disk before the checkpoint
  that marks the epoch done, or a resume would write it twice);
- ``on_run_end(trainer)``: the epochs ended without an error (the diagnostics report).

Per-step hooks are bound once per epoch, so a step with no trace and no bar calls nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from xlatrain.progress import EpochProgress
from xlatrain.train.callbacks import HOOKS, Callbacks

if TYPE_CHECKING:
    from xlatrain.diagnostics.profile import StepTrace
    from xlatrain.diagnostics.run import RunDiagnostics
    from xlatrain.tensorboard import TensorBoardLog

# Hooks only xlatrain's own observers hear. The public HOOKS the user's callbacks hear as well, after them.
_INTERNAL = ("on_steps_start", "on_steps_stop", "on_step_start", "on_step_end", "on_state_remade", "on_epoch_row",
             "on_epoch_written", "on_run_end")


class Observers:
    """xlatrain's observers (in order) followed by the user's callbacks, each hook bound once."""

    def __init__(self, own: Sequence[Any], user: Callbacks) -> None:
        self._user = user
        self._own = list(own)
        self._bound = {hook: [getattr(o, hook) for o in self._own if callable(getattr(o, hook, None))]
                       for hook in (*HOOKS, *_INTERNAL)}
        self._wrappers = [o.batches for o in self._own if callable(getattr(o, "batches", None))]

    def wants(self, hook: str) -> bool:
        return bool(self._bound[hook]) or (hook in HOOKS and self._user.wants(hook))

    def hooks(self, hook: str) -> list[Callable[..., Any]]:
        """xlatrain's own functions for an internal hook, for a loop to call without a lookup."""
        return self._bound[hook]

    def call(self, hook: str, *args: Any) -> None:
        for fn in self._bound[hook]:
            fn(*args)
        if hook in HOOKS:
            self._user.call(hook, *args)

    def batches(self, batches: Iterable[Any], phase: str, epoch: int, first_step: int = 1) -> Iterable[Any]:
        for wrap in self._wrappers:
            batches = wrap(batches, phase, epoch, first_step)
        return batches

    @contextlib.contextmanager
    def epoch(self, trainer: Any, epoch: int, start_step: int, num_steps: int) -> Iterator[None]:
        self.call("on_steps_start", trainer, epoch, start_step, num_steps)
        try:
            yield
        finally:
            self.call("on_steps_stop")


class ProgressObserver:
    """The per-epoch progress line or bar (main process; lines when no terminal is attached)."""

    def __init__(self, *, interactive: bool, log: Callable[[str], None],
                 rate_note: Callable[[dict[str, Any]], str] | None) -> None:
        self._interactive, self._log, self._rate_note = interactive, log, rate_note
        self._progress: EpochProgress | None = None
        self.on_step_end: Callable[[int, int, float], None] | None = self._advance if interactive else None

    def on_steps_start(self, trainer: Any, epoch: int, start_step: int, num_steps: int) -> None:
        self._progress = EpochProgress(
            epoch, num_steps, start_step, interactive=self._interactive, log=self._log,
        )

    def _advance(self, step: int, index: int, input_wait_s: float) -> None:
        if self._progress is not None:
            self._progress.advance(step)

    def on_interval(self, trainer: Any, values: dict[str, Any]) -> None:
        # A read that lands after its epoch (CUDA runs pending reads at the epoch-end read) is not
        # shown: the epoch line follows.
        # The epoch's last step is said by the epoch line that follows it.
        if self._progress is not None and self._progress.epoch == values["epoch"] \
                and values["step"] < self._progress.num_steps:
            self._progress.show(values["step"], epoch_loss=values["epoch_loss"],
                                samples_per_s=values["samples_per_s"], nonfinite=values["nonfinite_steps"],
                                nonfinite_over=values.get("nonfinite_over", 1),
                                rate_note=self._rate_note(values) if self._rate_note is not None else "")

    def on_steps_stop(self) -> None:
        if self._progress is not None:
            self._progress.close()


class TensorBoardObserver:
    """Interval points, epoch rows and the run's hparams into ``run_dir/tb`` (main process)."""

    def __init__(self, log: TensorBoardLog, config_record: dict[str, Any]) -> None:
        self._log, self._config = log, config_record

    def on_interval(self, trainer: Any, values: dict[str, Any]) -> None:
        self._log.interval(values["global_step"], loss=values["loss"], lr=values["lr"],
                           samples_per_s=values["samples_per_s"], tokens_per_s=values.get("tokens_per_s"),
                           mfu=values.get("mfu"))

    def on_epoch_written(self, trainer: Any, row: dict[str, Any], cursor: Any, last: bool) -> None:
        best = {f"best_{trainer.monitor}": cursor.best}
        self._log.epoch(cursor.epoch, cursor.global_step, {**row, **best})
        if last:
            final = {k: v for k, v in row.items() if k.startswith(("train_", "val_"))}
            self._log.hparams(self._config, {**final, **best}, step=cursor.global_step)


def untraced_note(config: Any, per_epoch: int, epoch: int, step: int) -> str | None:
    """What to say of a ``profile_steps`` window (steps counted over the run) that a fit of
    ``config.epochs`` epochs of ``per_epoch`` steps, going on from ``epoch``'s step ``step``,
    cannot reach; ``None`` where it reaches at least one of its steps."""
    first, last = config.profile_steps
    total, done = config.epochs * per_epoch, (epoch - 1) * per_epoch + step
    if first > total:
        return (f"note: profile_steps=({first}, {last}) lies past this run's last step, {total} ({config.epochs} "
                f"epoch(s) x {per_epoch} steps): nothing will be traced; name steps from 1 to {total}")
    if last <= done:
        return (f"note: profile_steps=({first}, {last}) ran before this run resumed at step {done + 1}: nothing "
                "will be traced; name later steps")
    return None


class TraceObserver:
    """The profiler trace of the steps ``profile_steps`` names, counted over the run."""

    def __init__(self, trace: StepTrace) -> None:
        self.on_step_start = trace.before_step
        self._after = trace.after_step

    def on_step_end(self, step: int, index: int, input_wait_s: float) -> None:
        self._after(index, input_wait_s)


class DiagnosticsObserver:
    """The run diagnostics: input wait per pass, recompilations, the report at the run's end."""

    def __init__(self, diag: RunDiagnostics, sections: Callable[[], dict[str, Any]]) -> None:
        self._diag, self._sections = diag, sections

    def batches(self, batches: Iterable[Any], phase: str, epoch: int, first_step: int) -> Iterable[Any]:
        return self._diag.timed(batches, phase, epoch, first_step=first_step)

    def on_state_remade(self) -> None:
        self._diag.state_remade()

    def on_epoch_row(self, trainer: Any, row: dict[str, Any]) -> None:
        row["input_bound_share"] = round(self._diag.end_epoch(row["epoch"])["input_bound_share"], 4)

    def on_run_end(self, trainer: Any) -> None:
        self._diag.sections.update(self._sections())
        self._diag.finish(trainer.run_dir, trainer.is_main)
