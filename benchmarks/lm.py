"""The LM recipe's model in the Trainer against a hand-written nanoGPT-style loop: tokens/s and
model FLOPs utilisation (MFU) against this machine's measured matmul peak.

Same model (ByteGPT, about 19M parameters: width 512, 6 layers, 8 heads, context 256, tied
embedding, rotary positions, ``scaled_dot_product_attention``), same bytes (the standard library's
source), same AdamW with no-decay groups, gradient clipping and warmup + cosine schedule, float32
on the CPU with 2 threads, in this process. Eager: the Trainer, the hand loop and a second copy of
the hand loop (an A/A control: the machine's noise floor). Compiled: ``TrainConfig(compile=True)``
against the hand loop over ``torch.compile(model)``, each compiled before the rounds. A round runs
every side ``PAIRS`` times, the order rotating; its ratio is the median of ratios between epochs
that ran back to back. MFU = samples/s x ``train_flops_per_sample()`` / peak, the peak measured
fresh here (a 2048x2048 float32 matmul, best of repeated timings).
"""

from __future__ import annotations

import functools
import math
import statistics
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks.trainer_overhead import with_threads
from xlatrain import CheckpointConfig, TrainConfig, Trainer
from xlatrain.backend.peak import measured_peak
from xlatrain.recipes.lm.data import ByteWindows, split_bytes
from xlatrain.recipes.lm.model import ByteGPT
from xlatrain.recipes.lm.recipe import byte_loss
from xlatrain.recipes.run import _adamw_groups, _warmup_cosine

CONTEXT, WIDTH, LAYERS, HEADS = 256, 512, 6, 8
BATCH, STEPS = 4, 8
ROUNDS, PAIRS = 3, 2
THREADS = 2
LR, WEIGHT_DECAY, CLIP = 3e-4, 0.1, 1.0


def _model() -> ByteGPT:
    torch.manual_seed(0)
    return ByteGPT(context=CONTEXT, width=WIDTH, layers=LAYERS, heads=HEADS)


def _optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = _adamw_groups(model, lr=LR, weight_decay=WEIGHT_DECAY)
    shape = type("Run", (), {"total_steps": 1000})()
    return opt, _warmup_cosine(opt, shape, warmup_steps=10, min_lr_ratio=0.1)


def _hand_epoch(model: torch.nn.Module, forward: Any, opt: torch.optim.Optimizer, schedule: Any,
                loader: DataLoader[Any]) -> float:
    """One epoch of the hand-written loop (nanoGPT's shape), timed."""
    model.train()
    start = time.perf_counter()
    loss_sum = torch.zeros(())
    for x, y in loader:
        logits = forward(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        loss_sum += loss.detach()
    float(loss_sum)  # the epoch-end read the Trainer also does
    return time.perf_counter() - start


def run() -> dict[str, Any]:
    return with_threads(_measure, THREADS)


def _trainer(run_dir: str, compile: bool) -> Trainer:
    return Trainer(
        _model(), byte_loss, functools.partial(_adamw_groups, lr=LR, weight_decay=WEIGHT_DECAY),
        scheduler_fn=lambda opt, run: _warmup_cosine(opt, type("Run", (), {"total_steps": 1000})(),
                                                     warmup_steps=10, min_lr_ratio=0.1),
        config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=run_dir, log_every=STEPS + 1, clip_grad_norm=CLIP,
                           scheduler_interval="step", task="none", compile=compile, tensorboard=False),
        checkpoint=CheckpointConfig(enabled=False),  # each fit trains a fresh epoch
        accelerator="cpu",
    )


def _rounds(sides: dict[str, Any], ratio_of: tuple[str, str], control: str | None) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in sides}
    ratios, controls = [], []
    names = list(sides)
    for r in range(ROUNDS):
        pairs, control_pairs = [], []
        for k in range(PAIRS):
            shift = (r * PAIRS + k) % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(sides[name]())
            pairs.append(times[ratio_of[0]][-1] / times[ratio_of[1]][-1])
            if control is not None:
                control_pairs.append(times[control][-1] / times[ratio_of[1]][-1])
        ratios.append(statistics.median(pairs))
        if control_pairs:
            controls.append(statistics.median(control_pairs))
    return {"times": times, "ratios": ratios, "controls": controls}


def _spread(values: list[float], digits: int = 4) -> list[float]:
    return [round(min(values), digits), round(statistics.median(values), digits), round(max(values), digits)]


def _measure() -> dict[str, Any]:
    train_bytes, _ = split_bytes(5, BATCH * STEPS * CONTEXT + 1, CONTEXT + 1)
    data = ByteWindows(train_bytes, CONTEXT)
    assert len(data) == BATCH * STEPS
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0))
    flops = _model().train_flops_per_sample()
    peak_before, _ = measured_peak(torch.device("cpu"), torch.float32, lambda t: None, "cpu", cache=False)
    samples = BATCH * STEPS
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as run_dir:
        # --- eager -----------------------------------------------------------------------------
        hand_model, control_model = _model(), _model()
        hand_opt, hand_schedule = _optimizer(hand_model)
        control_opt, control_schedule = _optimizer(control_model)
        trainer = _trainer(run_dir, compile=False)
        sides = {
            "trainer": lambda: trainer.fit(data, resume="overwrite")[-1]["epoch_time_s"],
            "hand": lambda: _hand_epoch(hand_model, hand_model, hand_opt, hand_schedule, loader),
            "control": lambda: _hand_epoch(control_model, control_model, control_opt, control_schedule, loader),
        }
        for side in sides.values():  # warm-up: allocator, kernels
            side()
        eager = _rounds(sides, ("trainer", "hand"), "control")
        trainer_mfu = trainer.history[-1]["mfu"]
        # --- compiled --------------------------------------------------------------------------
        compiled_model = _model()
        compiled_opt, compiled_schedule = _optimizer(compiled_model)
        compiled_forward = torch.compile(compiled_model)
        compiled_trainer = _trainer(run_dir + "/compiled", compile=True)
        compile_sides = {
            "trainer": lambda: compiled_trainer.fit(data, resume="overwrite")[-1]["epoch_time_s"],
            "hand": lambda: _hand_epoch(compiled_model, compiled_forward, compiled_opt, compiled_schedule, loader),
        }
        first = {name: side() for name, side in compile_sides.items()}  # compiles
        compiled = _rounds(compile_sides, ("trainer", "hand"), None)
    peak_after, _ = measured_peak(torch.device("cpu"), torch.float32, lambda t: None, "cpu", cache=False)
    peak = max(peak_before, peak_after)

    def figures(result: dict[str, Any]) -> dict[str, Any]:
        per_side = {}
        for name, times in result["times"].items():
            rates = [samples / t for t in times]
            per_side[name] = {
                "tokens_per_s": _spread([r * CONTEXT for r in rates], 1),
                "mfu": _spread([r * flops / peak for r in rates]),
            }
        # Throughput ratio: the hand loop's epoch time over the Trainer's (>= 0.95 is the goal).
        to_hand = [1 / r for r in result["ratios"]]
        block = {
            "ratio_to_hand_per_round": [round(r, 4) for r in to_hand],
            "ratio_to_hand_min_median_max": _spread(to_hand),
            "sides": per_side,
        }
        if result["controls"]:
            controls = [1 / r for r in result["controls"]]
            block["control_ratio_per_round"] = [round(r, 4) for r in controls]
            block["control_ratio_min_median_max"] = _spread(controls)
        return block

    out["eager"] = figures(eager)
    out["compiled"] = figures(compiled)
    out["compiled"]["first_epoch_with_compile_s"] = {k: round(v, 1) for k, v in first.items()}
    trainer_tokens = out["eager"]["sides"]["trainer"]["tokens_per_s"]
    out.update({
        "ratio_to_hand": out["eager"]["ratio_to_hand_min_median_max"][1],
        "tokens_per_s": trainer_tokens[1],
        "mfu": out["eager"]["sides"]["trainer"]["mfu"][1],
        "mfu_compiled": out["compiled"]["sides"]["trainer"]["mfu"][1],
        "ratio_to_hand_compiled": out["compiled"]["ratio_to_hand_min_median_max"][1],
        "trainer_reported_mfu_last_epoch": trainer_mfu,
        "peak_gflops": round(peak / 1e9, 1),
        "peak_gflops_before_after": [round(peak_before / 1e9, 1), round(peak_after / 1e9, 1)],
        "flops_per_sample": flops,
        "parameters": _model().num_parameters(),
        "model": f"ByteGPT width {WIDTH}, {LAYERS} layers, {HEADS} heads, context {CONTEXT}, tied, rotary; AdamW "
                 f"(no decay on 1-D), clip {CLIP}, warmup+cosine; batch {BATCH}, {STEPS} steps per epoch, float32",
        "device": f"cpu, {THREADS} threads",
        "rounds": ROUNDS,
        "repetitions_per_round": PAIRS,
        "target": "Trainer MFU >= 0.6 and Trainer/hand tokens/s >= 0.95 in every round, eager and compiled",
    })
    out["target_met"] = bool(
        min(out["eager"]["sides"]["trainer"]["mfu"]) >= 0.6 and min(out["eager"]["ratio_to_hand_per_round"]) >= 0.95
        and min(out["compiled"]["sides"]["trainer"]["mfu"]) >= 0.6
        and min(out["compiled"]["ratio_to_hand_per_round"]) >= 0.95
    )
    assert math.isfinite(out["mfu"])
    return out
