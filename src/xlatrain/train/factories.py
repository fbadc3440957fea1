"""What the user's factories receive: the optimizer factory gets the model's parameters
(:class:`ModelParameters`), a two-argument scheduler factory the run's length (:class:`RunShape`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

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


@dataclasses.dataclass(frozen=True)
class RunShape:
    """The length of a run in optimizer steps, after gradient accumulation and devices.

    A two-argument ``scheduler_fn`` gets it: ``lambda opt, run: OneCycleLR(opt, 0.1, total_steps=run.total_steps)``;
    a schedule built from ``total_steps`` or ``steps_per_epoch`` steps every optimizer step
    (``scheduler_interval='auto'``). ``trainer.run_shape`` holds it once ``fit`` has begun (a
    callback's ``on_fit_start`` reads it).
    """

    total_steps: int  # optimizer steps over all epochs
    steps_per_epoch: int  # optimizer steps per epoch
    epochs: int

    def __getattribute__(self, name: str) -> Any:
        if name in _LENGTHS and (reads := object.__getattribute__(self, "__dict__").get("_reads")) is not None:
            reads.add(name)  # made_with_run: which lengths a scheduler factory reads
        return object.__getattribute__(self, name)

    def __repr__(self) -> str:  # printing or logging the run reads no length for a schedule
        fields = ", ".join(f"{f.name}={object.__getattribute__(self, f.name)}" for f in dataclasses.fields(self))
        return f"RunShape({fields})"


_LENGTHS = frozenset(("total_steps", "steps_per_epoch", "epochs"))


# The lengths of a run counted in optimizer steps: a schedule made from one steps every optimizer step.
STEP_COUNTS = ("total_steps", "steps_per_epoch")


def made_with_run(make: SchedulerFactory, optimizer: torch.optim.Optimizer, run: RunShape) -> tuple[Any, set[str]]:
    """``make(optimizer, run)``, and which of the run's lengths it read as it built the schedule
    (``scheduler_interval='auto'`` steps a schedule made from a count of optimizer steps every step)."""
    watched, read = dataclasses.replace(run), set()
    object.__setattr__(watched, "_reads", read)
    try:
        return make(optimizer, watched), set(read)
    finally:
        object.__setattr__(watched, "_reads", None)  # later reads (a closure's, at each step) decide nothing
