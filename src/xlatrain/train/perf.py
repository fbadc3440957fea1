"""What a run needs and what it gets: memory per device and model FLOPs, measured before the first
step; throughput and model FLOPs utilisation (MFU) while it trains.

Memory (:class:`MemoryPlan`), per device: parameters, gradients and optimizer state as the strategy
holds them (from the real tensors; the optimizer's state from the layout of torch's Adam, AdamW and
SGD, or else one step of it on meta tensors,
:meth:`~xlatrain.backend.base.Strategy.planned_state_bytes`); the activations a training step keeps
for its backward pass, measured: the bytes autograd saves during a forward pass of 2 and of 4
samples of the training data, extended to the batch (:func:`profile_step`; on CUDA one measured
forward and backward pass at the real batch instead); under FSDP, the
weights gathered for compute. Their sum is a lower bound of the step's peak (the runtime's
temporaries, gradients of activations and allocator slack come on top): a sum above the device's
capacity cannot fit, and the run is refused before its first step with the changes that would fit.

FLOPs: the model's own ``train_flops_per_sample()`` where it has one (the LM recipe: 6 per
parameter per token plus attention), else torch's FLOP counter over one forward and backward pass
of up to 4 samples. MFU is model FLOPs per second over the devices' peak FLOP/s in the run's precision;
recomputation (activation checkpointing) is not model FLOPs and does not count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

HEADROOM = 0.9  # an estimate above this share of the capacity is warned about: the peak is higher


def human_bytes(n: float) -> str:
    """``3.3 MB``, ``16.0 GB``: decimal units, as device memory is sold."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def human_flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} FLOP"


# --- measured before the first step --------------------------------------------------------


@dataclass(frozen=True)
class Sized:
    """A figure measured on ``small`` and on ``large`` samples (``at_small``, ``at_large``):
    ``at(n)`` extends it linearly to ``n`` samples (all of it per sample where both are one size)."""

    at_small: int
    at_large: int
    small: int
    large: int

    def at(self, n: int) -> int:
        if self.large == self.small:
            return self.at_large * n // self.large
        per_sample = (self.at_large - self.at_small) / (self.large - self.small)
        return max(round(self.at_small + per_sample * (n - self.small)), 0)


@dataclass(frozen=True)
class Activations:
    """Bytes autograd keeps for the backward pass, measured on a forward pass.

    ``total``: all of it, as the step keeps it without activation checkpointing. With
    checkpointing, a unit keeps only its inputs until its backward recomputes its own: then
    ``outside + unit_inputs + largest_unit``.
    """

    total: Sized
    outside: Sized  # saved outside the units
    unit_inputs: Sized  # the inputs of every unit
    largest_unit: Sized  # saved inside the unit that saves most
    units: int

    def at(self, n: int, checkpointed: bool = False) -> int:
        if checkpointed and self.units:
            return self.outside.at(n) + self.unit_inputs.at(n) + self.largest_unit.at(n)
        return self.total.at(n)


class _SavedTensors:
    """Counts the bytes autograd saves for backward while entered, by unit.

    Each storage counts once (a view and its base share one); parameters and buffers (batch norm's
    running statistics, which its backward reads) are the model's own memory, not counted here.
    """

    def __init__(self, model: torch.nn.Module, units: Sequence[torch.nn.Module], device_type: str) -> None:
        self._model = model
        self._units = list(units)
        self._device_type = device_type
        self.outside = 0
        self.inside = [0] * len(self._units)
        self.inputs = 0
        self._seen: set[int] = set()
        self._seen_inputs: set[int] = set()
        self._current: list[int] = []
        self._keep: list[torch.Tensor] = []  # identities stay unique while counted
        self._buffers = {id(b) for b in model.buffers()}

    def _key(self, t: torch.Tensor) -> tuple[int, int]:
        """``(identity, bytes)`` of the memory behind ``t``."""
        if t.device.type not in ("xla", "meta"):
            with contextlib.suppress(RuntimeError, NotImplementedError):
                storage = t.untyped_storage()
                if storage.data_ptr():
                    return storage.data_ptr(), storage.nbytes()
        # A lazy (XLA) tensor has no storage the host sees: each tensor counts by its size.
        self._keep.append(t)
        return id(t), t.numel() * t.element_size()

    def _add(self, nbytes: int) -> None:
        if self._current:
            self.inside[self._current[-1]] += nbytes
        else:
            self.outside += nbytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or id(base) in self._buffers or t.device.type != self._device_type:
            return t
        key, nbytes = self._key(t)
        if key not in self._seen:
            self._seen.add(key)
            self._add(nbytes)
        return t

    @contextlib.contextmanager
    def counting(self) -> Iterator[_SavedTensors]:
        handles = []

        def enter(index: int) -> Callable[..., None]:
            def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
                self._current.append(index)
                for value in (*args, *kwargs.values()):
                    if isinstance(value, torch.Tensor) and value.device.type == self._device_type:
                        key, nbytes = self._key(value)
                        if key not in self._seen_inputs:
                            self._seen_inputs.add(key)
                            self.inputs += nbytes
            return pre

        def leave(module: torch.nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            self._current.pop()

        for index, unit in enumerate(self._units):
            handles.append(unit.register_forward_pre_hook(enter(index), with_kwargs=True))
            handles.append(unit.register_forward_hook(leave, with_kwargs=True))
        try:
            # What pack returns is kept by the graph: the tensor itself would be a reference cycle
            # through the graph (an op saving its own output) that no collector sees, so every
            # measurement would leak its activations. A detached view of the same memory is not.
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t).detach(), lambda t: t):
                yield self
        finally:
            for handle in handles:
                handle.remove()


def _flop_formulas() -> dict[Any, Any]:
    """Attention on the CPU runs as an op the FLOP counter has no formula for: give it the one
    the counter uses for the GPU's attention ops (every query against every key, masks aside)."""
    from torch.utils import flop_counter

    def forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return int(flop_counter.sdpa_flop_count(query, key, value))

    def backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return int(flop_counter.sdpa_backward_flop_count(grad_out, query, key, value))

    aten = torch.ops.aten
    formulas = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        formulas[aten._scaled_dot_product_flash_attention_for_cpu] = forward
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = backward
    return formulas


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs torch's counter finds in ``fn()`` (matmuls, convolutions, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_flop_formulas()) as counter:
        fn()
    return int(counter.get_total_flops())


@dataclass(frozen=True)
class StepProfile:
    activations: Activations
    flops_per_sample: float | None  # counted over forward and backward; None where not counted
    rows: int  # samples the FLOPs were counted on
    # With ``measure``: the device's peak bytes over the pass (None: it did not fit).
    step_peak: int | None = None


PROFILE_SAMPLES = 4  # the most samples a measurement runs on (batch norm needs 2 or more)


def profile_step(
    model: torch.nn.Module, units: Sequence[torch.nn.Module], device_type: str,
    loss_of: Callable[[int], torch.Tensor], samples: int, count: bool,
    measure: Callable[[Callable[[], None]], int | None] | None = None,
) -> StepProfile:
    """Measure one training step of ``model`` without taking it.

    ``loss_of(n)`` runs the forward pass and the loss on the first ``n`` samples of the training
    data, which holds ``samples`` (at most :data:`PROFILE_SAMPLES` are used). Activations are
    counted on half of them and on all; with ``count``, the FLOPs of a forward and backward pass
    on all of them too. The model runs as it trains (dropout keeps its masks, batch norm its
    statistics) on copies of its buffers (batch norm's running statistics stay as they were), and
    every gradient made is dropped again, so the run's numbers are what they would be without
    this (the caller puts random state back).

    With ``measure`` (a runtime's ``step_memory``), one forward and backward pass on all
    ``samples`` (the real batch) serves everything: activations counted, FLOPs counted, and the
    device's peak over it measured (``step_peak``; None where it did not fit).
    """
    from xlatrain.backend.units import without_checkpointing

    large = samples if measure is not None else min(samples, PROFILE_SAMPLES)
    small = large if measure is not None else max(large // 2, 1)
    saved = {}
    flops = peak = None
    had_grads = {p: p.grad for p in model.parameters()}
    was_training = model.training
    # The step updates copies of the buffers: the model's own are never written, so no device
    # work is left pending on them (on XLA a write back would join the first step's graph).
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    for module, name, buffer in buffers:
        module._buffers[name] = buffer.detach().clone()
    model.train()
    try:
        with without_checkpointing(units), torch.enable_grad():
            for n in sorted({small, large}):
                counter = _SavedTensors(model, units, device_type)
                if (count or measure is not None) and n == large:
                    def backward() -> None:
                        with counter.counting():
                            loss = loss_of(n)
                        if loss.requires_grad:
                            loss.backward()

                    def step() -> None:
                        nonlocal flops
                        if count:
                            flops = count_flops(backward)
                        else:
                            backward()
                    if measure is None:
                        step()
                    else:
                        peak = measure(step)
                else:
                    with counter.counting():
                        loss_of(n)
                saved[n] = counter
    finally:
        # FSDP registers a module's gathered parameters during its forward and its sharded ones
        # again after; either set may hold a gradient of this step: every one goes back.
        for p in [*had_grads, *model.parameters()]:
            p.grad = had_grads.get(p)
        for module, name, buffer in buffers:
            module._buffers[name] = buffer
        model.train(was_training)

    def sized(pick: Callable[[_SavedTensors], int]) -> Sized:
        return Sized(pick(saved[small]), pick(saved[large]), small, large)

    activations = Activations(
        total=sized(lambda c: c.outside + sum(c.inside)),
        outside=sized(lambda c: c.outside),
        unit_inputs=sized(lambda c: c.inputs),
        largest_unit=sized(lambda c: max(c.inside, default=0)),
        units=len(units),
    )
    return StepProfile(activations, flops / large if flops else None, large, step_peak=peak)


# --- the plan, and the refusal --------------------------------------------------------------


@dataclass(frozen=True)
class Fix:
    change: str  # what to set, as the user sets it
    bytes: int  # per device with that change alone
    fits: bool


@dataclass
class MemoryPlan:
    """One device's memory for a training step, known before the first step (see the module)."""

    parameters: int
    gradients: int
    optimizer: int
    optimizer_source: str
    activations: Activations
    batch: int  # samples per device per micro step
    checkpointed: bool  # the run checkpoints its units' activations
    gathered: int  # FSDP: whole weights a device gathers for compute at once (estimated)
    capacity: int | None
    capacity_source: str
    measured_peak: tuple[int, str] | None = None
    # CUDA: the peak allocated during one forward and backward at the real batch, measured before
    # the first step (weights, gradients, activations, cuDNN workspaces and allocator blocks).
    measured_step: int | None = None
    fixes: list[Fix] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        return self.activations.at(self.batch, self.checkpointed)

    @property
    def estimate(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activation_bytes + self.gathered

    @property
    def total(self) -> int:
        """What a step needs: the measured step plus the optimizer's state where it was measured
        (the state does not exist before the first step), else the estimate."""
        if self.measured_step is not None:
            return self.measured_step + self.optimizer
        return self.estimate

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.total <= self.capacity

    def summary(self, capacity: bool = True) -> str:
        parts = [f"parameters {human_bytes(self.parameters)}", f"gradients {human_bytes(self.gradients)}",
                 f"optimizer state {human_bytes(self.optimizer)}",
                 f"activations {human_bytes(self.activation_bytes)} (batch {self.batch}"
                 + (", units checkpointed" if self.checkpointed and self.activations.units else "") + ")"]
        if self.gathered:
            parts.append(f"gathered weights about {human_bytes(self.gathered)}")
        if self.measured_step is not None:
            parts = [f"one forward and backward at batch {self.batch} measured {human_bytes(self.measured_step)} "
                     "(weights, gradients, activations, workspaces)", f"optimizer state {human_bytes(self.optimizer)}"]
        line = " + ".join(parts) + f" = {human_bytes(self.total)}"
        if capacity and self.capacity is not None:
            line += f" of {human_bytes(self.capacity)} ({self.capacity_source})"
        return line

    def as_dict(self) -> dict[str, Any]:
        out = {
            "parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
            "optimizer_source": self.optimizer_source, "activations": self.activation_bytes,
            "activation_profile": asdict(self.activations), "batch_per_device": self.batch,
            "checkpointed": self.checkpointed, "gathered": self.gathered, "estimate": self.estimate,
            "plan": self.total, "measured_step": self.measured_step,
            "capacity": self.capacity, "capacity_source": self.capacity_source,
        }
        if self.measured_peak is not None:
            out["measured_peak"], out["measured_peak_source"] = self.measured_peak
        if self.fixes:
            out["fixes"] = [asdict(f) for f in self.fixes]
        return out

    def refusal(self) -> str:
        assert self.capacity is not None
        lines = [
            f"this run cannot fit one device: before its first step it already needs {human_bytes(self.total)} per "
            f"device ({self.summary(capacity=False)}), more than the {human_bytes(self.capacity)} the device holds "
            f"({self.capacity_source}); the runtime's temporaries come on top of that. Nothing was trained or written."
        ]
        fitting = [f for f in self.fixes if f.fits]
        if fitting:
            lines.append(f"Any one of these fits, with {100 - 100 * HEADROOM:.0f}% to spare:")
            lines += [f"  - {f.change}: {human_bytes(f.bytes)} per device" for f in fitting]
        others = [f for f in self.fixes if not f.fits]
        if others:
            lines.append(("None of these fits: " if not fitting else "Not enough alone: ")
                         + "; ".join(f"{f.change}: {human_bytes(f.bytes)}" for f in others))
            if not fitting:
                lines.append("Lower the batch size or the model's size, or shard it (strategy='fsdp') over more devices.")
        if not self.fixes:
            lines.append("Lower the batch size or the model's size, or shard it (strategy='fsdp') over more devices.")
        return "\n".join(lines)


def plan_fixes(plan: MemoryPlan, *, whole_state: int, world_size: int, sharded: bool, precision: str,
               bf16_activations: Activations | None, unit_bytes: int, root_bytes: int, grad_accum_steps: int) -> list[Fix]:
    """Changes that bring ``plan`` within :data:`HEADROOM` of its capacity (the estimate is a lower
    bound of the peak), each alone, with the bytes it would need; then, where more than one
    applies, FSDP with all of them together."""
    assert plan.capacity is not None
    cap = int(HEADROOM * plan.capacity)
    fixes: list[Fix] = []
    act = plan.activation_bytes
    # FSDP: the state split over n devices, plus the weights a device gathers (its root's own and
    # two units: the one computing and the next, prefetched).
    gathered = plan.gathered or (root_bytes + 2 * unit_bytes) // (2 if precision == "bf16" else 1)
    counts = [n for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if n > (world_size if sharded else 1)]
    if world_size > 1 and not sharded:
        counts = [world_size] + [n for n in counts if n > world_size]

    def fsdp(activations: int, gathered: int, also: str = "") -> Fix:
        if activations + gathered >= cap:  # what no device count shards away: activations, gathered weights
            return Fix(f"strategy='fsdp' (backend.strategy){also}, at any device count", activations + gathered, False)
        n = next((n for n in counts if whole_state // n + activations + gathered <= cap), counts[-1])
        where = "" if n == world_size and not sharded else f" over {n} devices"
        need = whole_state // n + activations + gathered
        return Fix(f"strategy='fsdp' (backend.strategy){where}{also}", need, need <= cap)

    fixes.append(fsdp(act, gathered))
    if precision != "bf16" and bf16_activations is not None:
        need = plan.total - act + bf16_activations.at(plan.batch, plan.checkpointed)
        fixes.append(Fix("precision='bf16' (trainer.precision)", need, need <= cap))
    if not plan.checkpointed and plan.activations.units:
        need = plan.total - act + plan.activations.at(plan.batch, checkpointed=True)
        fixes.append(Fix("activation_checkpointing=True (backend.activation_checkpointing)", need, need <= cap))
    fixed = plan.total - act
    one, per_sample = plan.activations.at(1, plan.checkpointed), plan.activations.at(2, plan.checkpointed) - plan.activations.at(1, plan.checkpointed)
    if fixed + one <= cap and plan.batch > 1:
        largest = min(plan.batch - 1, 1 + (cap - fixed - one) // per_sample if per_sample > 0 else plan.batch - 1)
        # The same global batch in more, smaller micro steps, where the batch divides so.
        split = next((k for k in range(2, plan.batch + 1) if plan.batch % k == 0 and plan.batch // k <= largest), None)
        if split is not None:
            batch = plan.batch // split
            change = (f"batch_size={batch} with grad_accum_steps={grad_accum_steps * split} (trainer.batch_size, "
                      "trainer.grad_accum_steps: the same global batch)")
        else:
            batch, change = largest, f"batch_size={largest} per device (trainer.batch_size)"
        fixes.append(Fix(change, fixed + plan.activations.at(batch, plan.checkpointed), True))
    # Together: FSDP with bf16 and activation checkpointing, where the run has neither.
    together = bf16_activations if precision != "bf16" and bf16_activations is not None else plan.activations
    extra = [("precision='bf16'", together is not plan.activations),
             ("activation_checkpointing=True", not plan.checkpointed and plan.activations.units > 0)]
    named = [name for name, applies in extra if applies]
    if named:
        both = fsdp(together.at(plan.batch, checkpointed=plan.checkpointed or plan.activations.units > 0),
                    gathered // (2 if together is not plan.activations else 1), " with " + " and ".join(named))
        if both.bytes < fixes[0].bytes:
            fixes.append(both)
    return fixes


# --- while it trains -------------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    """Turns samples/s into tokens/s and MFU for the progress line, history and TensorBoard.

    Tokens per sample are the model's own ``tokens_per_sample`` where it has one; else, for batches
    in the Hugging Face layout (:func:`tokens_per_row`), each step's ``input_ids`` positions per row,
    counted as the loop takes the batch (``counts_input_ids``). FLOPs counted on a batch of
    ``flops_at_tokens`` positions per row scale with the positions of the steps measured, so a run
    whose batches are padded to their own longest sequence is not measured at the dry run's length.
    """

    flops_per_sample: float | None
    flops_source: str
    tokens_per_sample: int | None
    peak_per_device: float | None
    peak_source: str
    devices: int
    dtype: str
    counts_input_ids: bool = False
    flops_at_tokens: float | None = None

    def figures(self, samples_per_s: float, tokens_per_row: float | None = None) -> dict[str, float]:
        """tokens/s and MFU at ``samples_per_s``; ``tokens_per_row``: the mean ``input_ids``
        positions per row over the steps measured, where the loop counts them."""
        out: dict[str, float] = {}
        tokens = self.tokens_per_sample or (tokens_per_row if self.counts_input_ids else None)
        if tokens:
            out["tokens_per_s"] = samples_per_s * tokens
        if self.flops_per_sample and self.peak_per_device:
            flops = self.flops_per_sample
            if self.flops_at_tokens and tokens_per_row:
                flops *= tokens_per_row / self.flops_at_tokens
            out["mfu"] = samples_per_s * flops / (self.peak_per_device * self.devices)
        return out

    def text(self, figures: Mapping[str, Any]) -> str:
        """tokens/s and MFU of :meth:`figures` (or an interval's values holding them), for the
        progress line."""
        parts = [f"{figures['tokens_per_s']:,.0f} tokens/s"] if figures.get("tokens_per_s") is not None else []
        if (mfu := figures.get("mfu")) is not None:
            over = ""
            if mfu > 1:  # no step outruns a true peak: the yardstick or the count is off
                over = (" (above 100%: the measured matmul is below what this model reaches here, so it is not this "
                        "device's peak)" if self.peak_source.startswith("measured") else
                        " (above 100%: the model's FLOPs per sample or the device's peak figure are off)")
            parts.append(f"MFU {100 * mfu:.1f}%{over}")
        return ", ".join(parts)

    def summary(self) -> str:
        tokens = (" | tokens/s: each batch's input_ids positions (padding included), counted as the loop takes it"
                  if self.counts_input_ids and not self.tokens_per_sample else "")
        if not self.flops_per_sample:
            return f"model FLOPs: not counted ({self.flops_source})" + tokens
        at = f" at {self.flops_at_tokens:,.0f} input_ids positions (scaled to each batch's)" if self.flops_at_tokens else ""
        line = f"model FLOPs: {human_flops(self.flops_per_sample)} per sample{at} ({self.flops_source})"
        if self.peak_per_device:
            line += f" | peak {human_flops(self.peak_per_device)}/s {self.dtype} per device ({self.peak_source})"
        else:
            line += f" | no {self.dtype} peak FLOP/s known for this device ({self.peak_source}): no MFU"
        return line + tokens

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tokens_per_row(batch: Any) -> float | None:
    """A batch's ``input_ids`` positions per row, padding included (the positions the model
    computes, as torchtitan and the Hugging Face Trainer count tokens), for a batch in the Hugging
    Face layout: a mapping whose ``input_ids`` is an integer tensor of two or more dimensions.
    ``None`` for any other batch. Reads shapes only, never the device."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2 or ids.dtype.is_floating_point or not ids.shape[0]:
        return None
    return ids.numel() / ids.shape[0]


def model_flops(model: torch.nn.Module) -> tuple[float | None, str, int | None]:
    """The model's own ``train_flops_per_sample()`` and ``tokens_per_sample``, where it has them."""
    own = getattr(model, "train_flops_per_sample", None)
    tokens = getattr(model, "tokens_per_sample", None)
    tokens = int(tokens) if isinstance(tokens, (int, float)) and tokens > 0 else None
    if callable(own):
        return float(own()), f"{type(model).__name__}.train_flops_per_sample()", tokens
    return None, "", tokens
