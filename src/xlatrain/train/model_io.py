"""How a batch feeds the model, and what the Trainer takes from what the model returns.

Two ways to train, chosen by ``loss_fn``:

- **a loss function** (``loss_fn(outputs, targets)``): the model gets the batch's inputs and the
  loss the targets. A pair ``(inputs, targets)`` calls ``model(inputs)``. A mapping or dataclass
  with ``inputs=`` / ``targets=`` names passes each named input **by keyword** where it names a
  parameter of the model's ``forward`` and by position otherwise, so ``inputs=("input_ids",
  "attention_mask")`` reaches a Hugging Face model's ``attention_mask`` (its second positional
  parameter is ``cache``), and ``inputs="image"`` reaches ``forward(self, x)``.
- **the model's own loss** (``loss_fn=None``), as Hugging Face models and torchvision detectors
  compute it: a mapping batch is passed as keyword arguments, ``model(**batch)`` (``inputs=``
  may name the keys to pass); a pair calls ``model(inputs, targets)`` (torchvision's detection
  models). With ``inputs=`` named, the targets (``targets=``, else a ``"labels"`` key) are passed
  too in training and evaluation where ``forward`` names them (``"labels"`` also through its
  ``**kwargs``), and left out in ``predict``. The loss is ``out.loss``, ``out["loss"]``, the first
  element of a tuple, or the tensor returned; a mapping of scalar losses without a ``"loss"`` (a
  detector's) is summed, each term logged under its name. Targets for metrics are ``targets=`` if
  given, else a mapping's ``"labels"``.

Predictions (what task metrics, ``metrics_fn`` and ``predict`` see) are the model's outputs, or
the field ``output_field`` of them (``out.logits`` by default where the model returns one under
its own loss).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from xlatrain.train.batch import BatchLayout, fields_of
from xlatrain.train.losses import loss_terms

OWN_LOSS = None  # loss_fn=None: the model computes its own loss


@dataclasses.dataclass(frozen=True)
class ForwardSignature:
    """The parameters of a model's ``forward`` that can be named, and whether it takes ``**kwargs``."""

    names: tuple[str, ...]
    positional: tuple[str, ...]  # in order, those a positional argument can fill
    var_kwargs: bool
    owner: str

    @classmethod
    def of(cls, module: torch.nn.Module) -> ForwardSignature:
        try:
            params = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        kinds = inspect.Parameter
        return cls(
            names=tuple(p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)),
            positional=tuple(p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)),
            var_kwargs=any(p.kind == kinds.VAR_KEYWORD for p in params),
            owner=f"{type(module).__name__}.forward",
        )


class ModelIO:
    """Binds a batch to the model's ``forward`` and takes the loss and predictions from its outputs.

    Args:
        loss_fn: ``loss_fn(outputs, targets)``, or ``None`` for the model's own loss.
        inputs, targets: key names in mapping / dataclass batches (see the module docstring).
        output_field: the field of the model's outputs that metrics and ``predict`` see (and,
            when given with a ``loss_fn``, that the loss gets); ``None``: ``logits`` where the
            model's own loss is used and its outputs have one, else the outputs as they are.
        signature: the model's ``forward``, for keyword binding.
    """

    def __init__(
        self, loss_fn: Callable[[Any, Any], Any] | None, *, inputs: str | Sequence[str] | None,
        targets: str | Sequence[str] | None, output_field: str | None, signature: ForwardSignature,
    ) -> None:
        self.own_loss = loss_fn is None
        self.loss_fn = loss_fn
        self.output_field = output_field
        self.signature = signature
        if self.own_loss:
            for name, keys in (("inputs", inputs), ("targets", targets)):
                if keys is not None and not (isinstance(keys, str) or all(isinstance(k, str) for k in keys)):
                    raise ValueError(f"{name}={keys!r} is not valid: give a key name or a tuple of key names")
            self.layout = None
            self.inputs, self.targets = inputs, targets
        else:
            self.layout = BatchLayout(inputs, targets)
            self.inputs, self.targets = inputs, targets

    # --- calling the model ------------------------------------------------------------------
    def bind(self, batch: Any, *, with_targets: bool = True) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` for ``forward`` from one batch."""
        if self.own_loss:
            fields = fields_of(batch)
            if fields is not None:
                keys = self._passed_keys(fields, with_targets)
                missing = [k for k in keys if k not in fields]
                if missing:
                    raise ValueError(f"inputs={self.inputs!r}: the batch has no key {', '.join(map(repr, missing))}; "
                                     f"its keys are {', '.join(map(repr, fields))}")
                return (), {k: fields[k] for k in keys}
            if isinstance(batch, (list, tuple)) and len(batch) == 2:
                return (batch[0], batch[1]) if with_targets else (batch[0],), {}
            return (batch,), {}
        assert self.layout is not None
        if not self.layout.keyed:
            return (self.layout.model_args(batch) if not with_targets else self.layout.split(batch)[0]), {}
        values = self.layout.model_args(batch)
        names = [self.layout.inputs] if isinstance(self.layout.inputs, str) else list(self.layout.inputs)
        args, kwargs = [], {}
        for name, value in zip(names, values):
            if name in self.signature.names:
                kwargs[name] = value
            else:
                args.append(value)
        return tuple(args), kwargs

    def call(self, forward: Callable[..., Any], batch: Any) -> Any:
        """The model's outputs for one training or evaluation batch; a failing call says how the
        batch's fields were bound to ``forward``'s parameters."""
        args, kwargs = self.bind(batch)
        try:
            return forward(*args, **kwargs)
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"xlatrain: {self.describe_binding(batch)}")
            raise

    def _passed_keys(self, fields: Mapping[str, Any], with_targets: bool = True) -> list[str]:
        """Under the model's own loss, the batch's keys ``forward`` gets: ``inputs=`` (else all), and
        with them, outside ``predict``, the targets the model computes its loss from: those
        ``targets=`` names (else ``"labels"``) that ``forward`` names, or ``"labels"`` through its
        ``**kwargs`` (a key named only for metrics is not passed there)."""
        keys = [self.inputs] if isinstance(self.inputs, str) else list(self.inputs or fields)
        if self.inputs is not None and with_targets:
            named = [self.targets] if isinstance(self.targets, str) else list(self.targets or ["labels"])
            keys += [k for k in named if k in fields and k not in keys
                     and (k in self.signature.names or (k == "labels" and self.signature.var_kwargs))]
        return keys

    def describe_binding(self, batch: Any) -> str:
        """How one batch reaches ``forward``: ``model(input_ids=batch['input_ids'], ...)``, each
        positional argument named by the parameter it fills."""
        fields = fields_of(batch)
        if self.own_loss:
            if fields is not None:
                keys = self._passed_keys(fields)
                return f"called {self.signature.owner}(" + ", ".join(f"{k}=batch[{k!r}]" for k in keys) + ")"
            return f"called {self.signature.owner}(inputs, targets), the pair's two parts by position"
        assert self.layout is not None
        if not self.layout.keyed:
            return f"called {self.signature.owner}(inputs) with the pair's first part"
        names = [self.layout.inputs] if isinstance(self.layout.inputs, str) else list(self.layout.inputs)
        by_position = [n for n in names if n not in self.signature.names]
        parts = [f"{n}=batch[{n!r}]" for n in names if n in self.signature.names]
        slots = list(self.signature.positional)
        bound = [f"batch[{n!r}] -> {slots[i] if i < len(slots) else '*args'}" for i, n in enumerate(by_position)]
        return (f"called {self.signature.owner}(" + ", ".join([f"batch[{n!r}]" for n in by_position] + parts) + ")"
                + (f"; by position: {', '.join(bound)}" if bound else ""))

    def check_keys(self, batch: Any) -> str | None:
        """Under the model's own loss, every key passed must name a parameter of ``forward``:
        refused before the first step, naming the key. Where ``forward`` also takes ``**kwargs``
        the key goes there, and whether the model reads it cannot be told: returns a note."""
        if not self.own_loss or not self.signature.names:
            return None
        fields = fields_of(batch)
        passed = self._passed_keys(fields, with_targets=False) if fields is not None else []  # a target's own key: not said
        unknown = [k for k in passed if k not in self.signature.names]
        if not unknown:
            return None
        keys = ", ".join(map(repr, unknown))
        if self.signature.var_kwargs:
            return (f"note: the batch's key(s) {keys} are not named parameters of {self.signature.owner}; they go to "
                    "its **kwargs, which may ignore them. Pass only the keys the model reads with inputs=(...)")
        raise ValueError(
            f"the batch's key(s) {keys} are not parameters of {self.signature.owner} "
            f"({', '.join(self.signature.names)}): the model's own loss passes the batch by keyword. Name the "
            "keys to pass with inputs=(...), or drop the others from the batch"
        )

    def targets_of(self, batch: Any) -> Any:
        """The loss targets (a loss function's), or what metrics compare predictions with."""
        if not self.own_loss:
            assert self.layout is not None
            return self.layout.split(batch)[1]
        fields = fields_of(batch)
        if fields is not None:
            if self.targets is None:
                return fields.get("labels")
            if isinstance(self.targets, str):
                return fields[self.targets]
            return tuple(fields[k] for k in self.targets)
        if isinstance(batch, (list, tuple)) and len(batch) == 2:
            return batch[1]
        return None

    # --- what the model returned ----------------------------------------------------------
    def loss(self, outputs: Any, targets: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(total, {term: value})`` of one batch."""
        if not self.own_loss:
            assert self.loss_fn is not None
            return loss_terms(self.loss_fn(self.field(outputs), targets))
        return own_loss_terms(outputs, self.signature.owner)

    def field(self, outputs: Any) -> Any:
        """The outputs a loss function gets: ``output_field`` of them where one was named."""
        return _take(outputs, self.output_field) if self.output_field is not None and not self.own_loss else outputs

    def predictions(self, outputs: Any) -> Any:
        """What task metrics, ``metrics_fn`` and ``predict`` see of the outputs (``None``: nothing
        to score, as a causal LM's own loss without logits kept)."""
        if self.output_field is not None:
            return _take(outputs, self.output_field)
        if not self.own_loss:
            return outputs
        logits = _find(outputs, "logits")
        if logits is not None:
            return logits
        if isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
            return None  # the loss alone
        if isinstance(outputs, Mapping) and ("loss" in outputs or _all_scalars(outputs)):
            return None
        return outputs


def own_loss_terms(outputs: Any, owner: str = "the model") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss a model computed itself, and its named terms."""
    found = _find(outputs, "loss")
    if found is not None:
        terms = {}
        if isinstance(outputs, Mapping):
            terms = {str(k): v for k, v in outputs.items()
                     if k != "loss" and isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()}
        return loss_terms({"loss": found, **terms})
    if isinstance(outputs, Mapping) and outputs and _all_scalars(outputs):
        terms = {str(k): v for k, v in outputs.items()}
        return loss_terms({"loss": sum(terms.values()), **terms})
    if isinstance(outputs, tuple) and outputs and isinstance(outputs[0], torch.Tensor) and outputs[0].dim() == 0:
        return loss_terms(outputs[0])
    if isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        return loss_terms(outputs)
    if _has_field(outputs, "loss"):  # a ModelOutput whose loss is None: no labels reached the model
        raise ValueError(
            f"{owner} returned no loss (its 'loss' is None): the model computes its loss only when the batch holds "
            "its labels, e.g. a 'labels' key for a Hugging Face model. Put them in the batch, or give a loss_fn"
        )
    raise ValueError(
        f"loss_fn=None uses the model's own loss, but {owner} returned a {_kind(outputs)}: return the loss as "
        "out.loss, out['loss'], the first element of a tuple, a scalar tensor, or a mapping of scalar losses "
        "(summed); or give a loss_fn(outputs, targets)"
    )


def _has_field(outputs: Any, name: str) -> bool:
    return (isinstance(outputs, Mapping) and name in outputs) or (
        not isinstance(outputs, (torch.Tensor, tuple, list)) and hasattr(outputs, name))


def _find(outputs: Any, name: str) -> Any:
    """``outputs.name`` / ``outputs[name]`` where it holds a tensor, else None."""
    if isinstance(outputs, Mapping):
        value = outputs.get(name)
    elif isinstance(outputs, (torch.Tensor, tuple, list)):
        value = None
    else:
        value = getattr(outputs, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _take(outputs: Any, name: str) -> Any:
    if isinstance(outputs, Mapping) and name in outputs:
        return outputs[name]
    if not isinstance(outputs, (torch.Tensor, tuple, list)) and hasattr(outputs, name):
        return getattr(outputs, name)
    raise ValueError(f"output_field={name!r}: the model's outputs (a {_kind(outputs)}) have no field {name!r}")


def _all_scalars(outputs: Mapping[Any, Any]) -> bool:
    return all(isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point() for v in outputs.values())


def _kind(outputs: Any) -> str:
    if isinstance(outputs, torch.Tensor):
        return f"tensor of shape {tuple(outputs.shape)}"
    if isinstance(outputs, Mapping):
        return f"{type(outputs).__name__} with keys {', '.join(map(repr, outputs))}"
    if isinstance(outputs, (list, tuple)):
        return f"{type(outputs).__name__} of {len(outputs)}"
    return type(outputs).__name__


def no_grad_message(loss_fn: Any) -> str:
    """Why a loss that does not depend on the parameters cannot train, by whose loss it is."""
    if loss_fn is None:
        return ("the model's own loss does not depend on its parameters (no grad_fn), so nothing can be trained: it "
                "was computed under torch.no_grad(), detached, or from the labels alone")
    return (f"loss_fn {loss_fn!r} returned a loss that does not depend on the model's parameters (no grad_fn), so "
            "nothing can be trained: it was detached, turned into a number (.item(), float()) and back, or computed "
            "from the targets alone. Return the loss tensor computed from the outputs")


def settle_loss_lookup(model: torch.nn.Module) -> str | None:
    """Under torch.compile: a Hugging Face model whose forward calls ``self.loss_function`` while
    its class name maps to no loss type (``GPT2LMHeadModel``) gets ``loss_type = "ForCausalLM"``,
    the loss transformers falls back to for it. The fallback logs a warning inside forward, which
    torch.compile cannot trace: the graph split there at every call (a 1-layer GPT-2 on this CPU:
    12 compilations in warm-up where 2 do, epoch 2 at 45 samples/s where 481). The loss is the
    same one. Returns the header's line, or ``None`` where nothing was changed."""
    changed = []
    for module in model.modules():
        prop = inspect.getattr_static(type(module), "loss_function", None)
        fget = getattr(prop, "fget", None)
        forward = getattr(inspect.unwrap(type(module).forward), "__code__", None)
        if fget is None or forward is None or "loss_function" not in forward.co_names \
                or not getattr(fget, "__module__", "").startswith("transformers.") or "_loss_function" in vars(module):
            continue
        known = fget.__globals__.get("LOSS_MAPPING")
        # The property's own fallback, read from its code: nothing is set where it is another one.
        if not isinstance(known, Mapping) or "ForCausalLM" not in known or "ForCausalLM" not in fget.__code__.co_consts:
            continue
        before = getattr(module, "loss_type", None)
        if before not in known:
            module.loss_type = "ForCausalLM"
            changed.append(f"{type(module).__name__}.loss_type {before!r} -> 'ForCausalLM'")
    if not changed:
        return None
    return (f"model: {', '.join(changed)}, the loss transformers falls back to for it: its fallback logs a "
            "warning inside forward, which splits torch.compile's graph at every call (set loss_type yourself "
            "to choose another)")
