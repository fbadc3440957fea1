"""The exponential moving average of the weights (``TrainConfig.ema_decay``).

The averages live in the optimizer's state (key ``xlatrain_ema``), beside its moments: they are
sharded as the parameters are, counted in the memory plan as optimizer state, and saved and
restored with it by every strategy's checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from xlatrain.backend.model_state import local

EMA_KEY = "xlatrain_ema"  # the optimizer state entry holding a parameter's moving average
EMA_WEIGHTS = "ema.safetensors"  # the EMA weights, written after each epoch


class WeightAverage:
    """``ema = decay * ema + (1 - decay) * weights`` on the device at the steps ``rule`` names; the
    first update copies the weights (as torchvision's ``AveragedModel`` does), and so does every
    update of the first ``warmup_epochs`` epochs.

    Rules (``every`` = N): ``"every"`` updates after optimizer steps N, 2N, ... of the run, and after
    the first one (which starts the average); ``"torchvision"`` after steps 1, 1 + N, 1 + 2N, ... of
    each epoch, as torchvision's classification reference does.

    Each parameter's average starts (a copy of its weights) once the optimizer has stepped it:
    when the optimizer holds state for it, or took a step with its gradient and keeps none (SGD
    without momentum). An optimizer that builds a parameter's state at its first step with a
    gradient (Adam) would take an entry made before as its state, and miss its own moments: so a
    parameter with no gradient yet (a branch the model takes later), a step a gradient scaler
    skipped, and state a skipped step made and ``skip_step`` dropped all wait.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, decay: float, every: int, rule: str = "every",
                 warmup_epochs: int = 0, sync: Callable[[], None] = lambda: None) -> None:
        self.optimizer = optimizer
        self._sync = sync  # the runtime's step end: on XLA, each swap of the weights runs as a graph of its own
        self.decay = decay
        self.every = every
        self.rule = rule
        self.warmup_epochs = warmup_epochs
        # At the optimizer's last step: the parameters it had a gradient for, and those it then
        # held state for (skip_step may drop state a skipped step made: see :meth:`_start`).
        self._had_grad: set[int] = set()
        self._held_state: set[int] = set()
        optimizer.register_step_post_hook(self._stepped)
        self.ready = self.restored()  # every parameter has its average

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _stepped(self, *_: Any) -> None:
        if self.ready:  # every average has started: nothing reads these again
            return
        state, params = self.optimizer.state, self._params()
        self._had_grad = {id(p) for p in params if p.grad is not None}
        self._held_state = {id(p) for p in params if state.get(p)}

    def restored(self) -> bool:
        """Whether the optimizer's state holds an average of every parameter (a resumed run's came
        back with it)."""
        state = self.optimizer.state
        return all(EMA_KEY in state.get(p, {}) for p in self._params())

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its average) for every parameter the optimizer trains that has one."""
        state = self.optimizer.state
        return [(p, state[p][EMA_KEY]) for group in self.optimizer.param_groups for p in group["params"]
                if EMA_KEY in state.get(p, {})]

    def after_step(self, global_step: int, epoch_step: int, epoch: int, taken: torch.Tensor | None = None) -> None:
        """Called after each optimizer step: ``global_step`` counts it over the run, ``epoch_step``
        within ``epoch`` (both from 1). ``taken`` (``skip_step``): whether the step was taken, on the
        device; a skipped one leaves the average as it was, as it leaves the optimizer's state."""
        if self.rule == "torchvision":
            due, first_due_of_epoch = (epoch_step - 1) % self.every == 0, epoch_step == 1
        else:
            due = global_step % self.every == 0
            first_due_of_epoch = (global_step - 1) // self.every == (global_step - epoch_step) // self.every
        # The warm-up's reset (torchvision's n_averaged = 0) makes its updates copies, and the first
        # update after it too: averaging starts from there.
        copy = self.warmup_epochs > 0 and (epoch <= self.warmup_epochs
                                           or (epoch == self.warmup_epochs + 1 and first_due_of_epoch))
        if not self.ready:
            self._start()
        if due:
            self.update(copy=copy, taken=taken)

    @torch.no_grad()
    def _start(self) -> None:
        """Start the average of each parameter the optimizer has now stepped (see the class)."""
        state = self.optimizer.state
        for p in self._params():
            mine = state.get(p, {})
            if EMA_KEY in mine:
                continue
            # Held state at the step and holds none now: skip_step dropped what a skipped step made.
            if mine or (id(p) in self._had_grad and id(p) not in self._held_state):
                state[p][EMA_KEY] = p.detach().clone()
        self.ready = self.restored()

    @torch.no_grad()
    def update(self, copy: bool = False, taken: torch.Tensor | None = None) -> None:
        """One averaging step over the parameters whose average has started (``copy``: the
        weights themselves, as in the warm-up epochs), made only where ``taken`` holds, if given."""
        pairs = self.pairs()
        if taken is not None and pairs:
            # Decided on the device: the step's weight times the flag. A skipped step leaves the
            # weights finite and as they were, so a weight of 0 gives the average back exactly. One
            # weight tensor per pair: lerp's single-tensor weight is read on the host (torch_xla).
            rate = taken.float() * (1.0 if copy else 1.0 - self.decay)
            torch._foreach_lerp_([local(e) for _, e in pairs], [local(p.detach()) for p, _ in pairs], [rate] * len(pairs))
        elif copy:
            for p, e in pairs:
                e.copy_(p.detach())
        elif pairs:
            torch._foreach_lerp_([e for _, e in pairs], [p.detach() for p, _ in pairs], 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the EMA weights inside (buffers stay the live model's), its own after.
        Each swap ends at the runtime's step end: on XLA, copies left pending joined whatever graph
        ran next (an evaluation's first batch, a weights file's read), which came out different
        from one epoch to the next and compiled again in every epoch (2 graphs, seen on XLA:CPU)."""
        pairs = self.pairs()
        with torch.no_grad():
            live = [p.detach().clone() for p, _ in pairs]
            for p, e in pairs:
                p.detach().copy_(e)
        self._sync()
        try:
            yield
        finally:
            with torch.no_grad():
                for (p, _), saved in zip(pairs, live):
                    p.detach().copy_(saved)
            self._sync()


def drop_averages(optimizer: torch.optim.Optimizer) -> bool:
    """Remove every parameter's average from the optimizer's state (a run without an EMA resumed
    from one with it: kept, it would ride along in each checkpoint and come back stale when an
    EMA is turned on again); whether there was any."""
    found = False
    for p, entry in list(optimizer.state.items()):
        if EMA_KEY in entry:
            found = True
            del entry[EMA_KEY]
            if not entry:  # SGD without momentum keeps no state of its own
                del optimizer.state[p]
    return found


def ema_summary(cfg: Any, model: torch.nn.Module) -> str:
    """The run header's EMA line, from the run's ``TrainConfig``."""
    return (f"EMA: decay {cfg.ema_decay}, rule {cfg.ema_rule!r} every {cfg.ema_every} step(s)"
            + (f", copying the weights for {cfg.ema_warmup_epochs} warm-up epoch(s)" if cfg.ema_warmup_epochs else "")
            + (f"; batch-norm statistics recomputed over {cfg.ema_bn_batches} training batch(es) before "
               "each EMA evaluation" if cfg.ema_bn_batches and batch_norms(model) else
               f"; note: ema_bn_batches={cfg.ema_bn_batches} does nothing, as the model has no batch-norm "
               "layer with running statistics to recompute (leave it out)" if cfg.ema_bn_batches else ""))


def batch_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's batch-norm layers that keep running statistics: what ``ema_bn_batches`` recomputes."""
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


@contextlib.contextmanager
def recomputed_batch_norm(model: torch.nn.Module, batches: Iterable[Any], forward: Callable[[Any], Any]) -> Iterator[int]:
    """Inside, the model's batch-norm layers hold statistics recomputed for its current weights
    over ``batches`` (``torch.optim.swa_utils.update_bn``'s way: running statistics reset, each
    layer's momentum None so they become plain averages, forward passes in train mode without
    gradients); after, the statistics and momenta they had. Yields the batches used."""
    norms = batch_norms(model)
    if not norms:
        yield 0
        return
    saved = [(m, m.momentum, {n: b.detach().clone() for n, b in m._buffers.items() if b is not None}) for m in norms]
    was_training = model.training
    used = 0
    try:
        for m in norms:
            m.reset_running_stats()
            m.momentum = None
        model.train()
        with torch.no_grad():
            for batch in batches:
                forward(batch)
                used += 1
        model.train(was_training)
        yield used
    finally:
        model.train(was_training)
        with torch.no_grad():
            for m, momentum, buffers in saved:
                m.momentum = momentum
                for n, b in buffers.items():
                    m._buffers[n].copy_(b)
