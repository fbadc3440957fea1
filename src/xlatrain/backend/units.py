"""Which submodules of a model are its repeated blocks: the units FSDP shards one by one and
activation checkpointing recomputes.

By default a unit is an instance of a class that occurs at least twice in the model, holds
parameters and is not one of torch's own layers or containers (``Linear``, ``LayerNorm``,
``Sequential``, ...): a transformer's layers, a ResNet's blocks. Only the outermost are taken (a
block's attention and MLP stay inside their block). A user names them instead with a list of
classes (or class names, from YAML) or a function ``fn(module) -> bool``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import torch

UnitPolicy = Union[None, Sequence[Union[type, str]], Callable[[torch.nn.Module], bool]]


def _torch_builtin(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn.")


def _has_params(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def repeated_classes(model: torch.nn.Module) -> set[type]:
    """Classes with two or more parameter-holding instances in ``model``, torch's own layers aside."""
    counts = collections.Counter(
        type(m) for m in model.modules() if m is not model and not _torch_builtin(m) and _has_params(m)
    )
    return {cls for cls, n in counts.items() if n >= 2}


def _outermost(model: torch.nn.Module, match: Callable[[torch.nn.Module], bool]) -> list[tuple[str, torch.nn.Module]]:
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(u + ".") for u, _ in found):
            continue
        if match(module):
            found.append((name, module))
    return found


def _matcher(model: torch.nn.Module, policy: UnitPolicy) -> Callable[[torch.nn.Module], bool]:
    if policy is None:
        classes = repeated_classes(model)
        # A class repeated only inside the blocks (a norm in every transformer layer) is not a block
        # of its own where it also stands once outside them (the final norm): keep the classes
        # that are outermost at least twice.
        outer = collections.Counter(type(m) for _, m in _outermost(model, lambda m: type(m) in classes))
        classes = {cls for cls in classes if outer[cls] >= 2}
        return lambda m: type(m) in classes
    if callable(policy) and not isinstance(policy, type):
        return policy
    if isinstance(policy, (str, type)):
        policy = [policy]
    wanted = list(policy)
    present = {type(m).__name__: type(m) for m in model.modules()}
    names = {w for w in wanted if isinstance(w, str)}
    unknown = sorted(n for n in names if n not in present and not any(f"{c.__module__}.{c.__qualname__}" == n for c in present.values()))
    if unknown:
        raise ValueError(
            f"units names {', '.join(map(repr, unknown))}, which the model does not contain; its module "
            f"classes are {', '.join(sorted(present))}"
        )
    classes = tuple(w for w in wanted if isinstance(w, type))

    def match(m: torch.nn.Module) -> bool:
        cls = type(m)
        return isinstance(m, classes) or cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names

    return match


def find_units(model: torch.nn.Module, policy: UnitPolicy = None) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the outermost submodules ``policy`` picks, in module order."""
    return _outermost(model, _matcher(model, policy))


def apply_activation_checkpointing(
    modules: Sequence[torch.nn.Module], checkpoint: Callable[..., Any] | None = None
) -> None:
    """Recompute each module's forward during backward instead of keeping its activations.

    The module's ``forward`` is wrapped in place, so its parameters keep their names and
    checkpoints their keys. ``checkpoint(fn, *args)`` does the recomputing: by default torch's
    non-reentrant ``torch.utils.checkpoint`` (random state preserved); torch_xla passes its own,
    which keeps the XLA compiler from merging the recomputation back into the forward pass.
    """
    for module in modules:
        wrapped = functools.partial(checkpoint or _checkpointed, module.forward)
        wrapped.xlatrain_checkpointed = True  # type: ignore[attr-defined]
        module.forward = wrapped  # type: ignore[method-assign]


@contextlib.contextmanager
def without_checkpointing(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Inside, each module that :func:`apply_activation_checkpointing` wrapped runs its own
    forward again (keeping its activations), so a measurement sees what each one would keep."""
    wrapped = [(m, m.forward) for m in modules if getattr(m.forward, "xlatrain_checkpointed", False)]
    for module, forward in wrapped:
        module.forward = forward.args[0]  # type: ignore[attr-defined, method-assign]
    try:
        yield
    finally:
        for module, forward in wrapped:
            module.forward = forward  # type: ignore[method-assign]


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
