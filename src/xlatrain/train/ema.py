"""The exponential moving average of the weights (``TrainConfig.ema_decay``).

The averages live in the optimizer's state (key ``xlatrain_ema``), beside its moments: they are
sharded as the parameters are, counted in the memory plan as optimizer state, and saved and
restored with it by every strategy's checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

EMA_KEY = "xlatrain_ema"  # the optimizer state entry holding a parameter's moving average
EMA_WEIGHTS = "ema.safetensors"  # the EMA weights, written after each epoch


class WeightAverage:
    """``ema = decay * ema + (1 - decay) * weights`` on the device every ``every`` optimizer steps;
    the first update copies the weights (as torchvision's ``AveragedModel`` does).

    The first update waits for the optimizer's first step that ran (not one a gradient scaler
    skipped): an optimizer that builds its state at its first step (Adam) would take an entry made
    before as its state.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, decay: float, every: int) -> None:
        self.optimizer = optimizer
        self.decay = decay
        self.every = every
        self._stepped = False  # the optimizer has taken a step (and built its state)
        optimizer.register_step_post_hook(lambda *_: setattr(self, "_stepped", True))
        self.ready = self.restored()

    def restored(self) -> bool:
        """Whether the optimizer's state holds an average of every parameter (a resumed run's came
        back with it)."""
        state = self.optimizer.state
        return all(EMA_KEY in state.get(p, {}) for g in self.optimizer.param_groups for p in g["params"])

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its average) for every parameter the optimizer trains that has one."""
        state = self.optimizer.state
        return [(p, state[p][EMA_KEY]) for group in self.optimizer.param_groups for p in group["params"]
                if EMA_KEY in state.get(p, {})]

    def after_step(self, global_step: int) -> None:
        """Called after each optimizer step (``global_step`` counts it)."""
        if global_step % self.every == 0 or not self.ready:
            self.update()

    @torch.no_grad()
    def update(self) -> None:
        state = self.optimizer.state
        if not self.ready:
            if not self._stepped and not any(state.values()):
                return
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if EMA_KEY not in state[p]:
                        state[p][EMA_KEY] = p.detach().clone()
            self.ready = True
            return
        pairs = self.pairs()
        torch._foreach_lerp_([e for _, e in pairs], [p.detach() for p, _ in pairs], 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the EMA weights inside (buffers stay the live model's), its own after."""
        pairs = self.pairs()
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
