"""Callbacks: the user's code at the points of a run, with host values already read.

``Trainer(..., callbacks=[...])`` takes any objects with some of these methods (a missing one is
skipped; no base class is needed):

- ``on_fit_start(trainer)``: once, after the run header, before the first step;
- ``on_epoch_start(trainer, epoch)``: before each epoch's first step, the epoch a resumed run
  continues included, so a change a callback makes for an epoch (freezing a layer from epoch 3,
  say) is made again after a resume;
- ``on_interval(trainer, values)``: every ``log_every`` steps and at each epoch's last step, with
  the interval's figures (``epoch``, ``step``, ``global_step``, ``loss`` (the interval's mean),
  ``epoch_loss`` (the epoch's mean so far), ``nonfinite_steps`` (on several processes, unless
  ``nan_policy='skip_step'``: the non-finite losses of the ``nonfinite_over`` processes summed, each
  process's at each step), ``lr`` (the rate the interval's
  last step used), ``samples_per_s`` and, where counted, ``tokens_per_s`` and ``mfu``) as Python
  numbers: the figures the progress line (its loss is ``epoch_loss``) and TensorBoard (its
  ``train/loss`` is ``loss``) show, which are observers of the same points
  (:mod:`xlatrain.train.observers`). ``samples_per_s`` is ``None`` for an interval that holds
  a warm-up step (the fit's first steps, which compile). It runs when the Trainer's own deferred
  read of the interval arrives, so it adds no device read: never read a tensor of the model in it;
- ``on_epoch_end(trainer, row)``: after each epoch, with its history row (the numbers
  ``history.json`` gets), once the row is written and the epoch's checkpoint saved;
- ``on_checkpoint(trainer, path)``: after a checkpoint is complete on disk;
- ``on_fit_end(trainer, history)``: once, after the last epoch trained (not when a run fails or
  is preempted).

Every process calls them (``trainer.is_main`` is true on one), at the same points. A callback stops
the run with ``trainer.request_stop("why")``: the run ends after the current epoch, as an early stop
does, with that epoch validated, written and checkpointed; a request on any process stops all of
them. Running the same command again resumes, and trains on.

Example, a CSV of one's own and a stop on a condition::

    class CsvLog:
        def __init__(self, path):
            self.path = path

        def on_epoch_end(self, trainer, row):
            if trainer.is_main:
                with open(self.path, "a") as f:
                    f.write(f"{row['epoch']},{row['train_loss']:.4f},{row.get('val_accuracy', '')}\\n")

    class StopAtAccuracy:
        def on_epoch_end(self, trainer, row):
            if row.get("val_accuracy", 0) >= 0.95:
                trainer.request_stop("val_accuracy reached 0.95")

    Trainer(model, loss_fn, optimizer_fn, callbacks=[CsvLog("mine.csv"), StopAtAccuracy()])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

HOOKS = ("on_fit_start", "on_epoch_start", "on_interval", "on_epoch_end", "on_checkpoint", "on_fit_end")


class Callbacks:
    """The user's callbacks, each hook bound once: calling a hook nobody has costs one empty loop."""

    def __init__(self, callbacks: Sequence[Any] | None) -> None:
        if callbacks is not None and not isinstance(callbacks, (list, tuple)):
            callbacks = [callbacks]  # one callback object given bare
        objects = list(callbacks or [])
        for obj in objects:
            # A method named like a hook that is not one (on_epoch_ends) would never be called.
            strays = sorted(name for name in dir(obj) if name.startswith("on_") and name not in HOOKS
                            and callable(getattr(obj, name, None)))
            if strays:
                raise TypeError(
                    f"callbacks: {type(obj).__name__} has {', '.join(strays)}, which the Trainer never calls: the hooks "
                    f"are {', '.join(HOOKS)}. Rename it to the hook meant, or to a name not starting with on_"
                )
            if not any(callable(getattr(obj, hook, None)) for hook in HOOKS):
                raise TypeError(
                    f"callbacks: {obj!r} has none of the methods {', '.join(HOOKS)}; a callback is an object with "
                    "one or more of them, e.g. def on_epoch_end(self, trainer, row): ..."
                )
        self._bound = {hook: [getattr(o, hook) for o in objects if callable(getattr(o, hook, None))] for hook in HOOKS}

    def __bool__(self) -> bool:
        return any(self._bound.values())

    def wants(self, hook: str) -> bool:
        return bool(self._bound[hook])

    def call(self, hook: str, *args: Any) -> None:
        for fn in self._bound[hook]:
            try:
                fn(*args)
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"xlatrain: raised by the callback {getattr(fn, '__qualname__', fn)!s}")
                raise
