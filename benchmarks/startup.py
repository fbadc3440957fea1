"""Start-up: the time from building the Trainer to its first optimizer step, against a hand-written
loop's time from building its optimizer and loader to its first step, on the LM benchmark's model.

Both sides start from a freshly built model on the host, built before their clocks start (its
initialisation is the user's, alike on both sides: on a GPU host it took 0.2-0.4 s, varying more
than the whole difference measured), and both clocks include moving it to the device; the sides
alternate, ``ROUNDS`` times. The
Trainer's extra start-up (the dry run, the FLOP count and activation measurement, the memory plan)
is said in steps of the hand loop's steady step time (the median of its next steps): the target is
at most 2 every round. Each round runs the hand loop a second time as an A/A control; where two hand
loops differ by more than 1 step the target is not judged (``target_met`` null). The matmul peak used for MFU is cached per machine, so it is measured once,
in the warm-up, as a second run of a user's would find it. Where CUDA is available the same
comparison runs there too (``cuda`` in the figures; its steps are milliseconds, so the same
start-up work weighs more steps there).
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks.gpu_common import device_name, sync
from benchmarks.lm import BATCH, CLIP, CONTEXT, LR, STEPS, THREADS, WEIGHT_DECAY, _model, _optimizer
from benchmarks.trainer_overhead import with_threads
from xlatrain import CheckpointConfig, TrainConfig, Trainer
from xlatrain.recipes.lm.data import ByteWindows, split_bytes
from xlatrain.recipes.lm.recipe import byte_loss
from xlatrain.recipes.run import _adamw_groups

ROUNDS = 3
STEADY_STEPS = 3
TARGET_STEPS = 2.0


class _FirstStep(Exception):
    """Raised by the optimizer's post-step hook: the Trainer's first step is done."""


def _data() -> ByteWindows:
    train_bytes, _ = split_bytes(5, BATCH * STEPS * CONTEXT + 1, CONTEXT + 1)
    return ByteWindows(train_bytes, CONTEXT)


def _hand(data: ByteWindows, device: str) -> tuple[float, float]:
    """(seconds to the first optimizer step, median seconds of the next steps)."""
    model = _model()
    started = time.perf_counter()
    model = model.to(device)
    opt, schedule = _optimizer(model)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0))
    stamps = []
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        sync(device)
        stamps.append(time.perf_counter())
        if len(stamps) > STEADY_STEPS:
            break
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - started, statistics.median(steps)


def _trainer(data: ByteWindows, run_dir: str, device: str) -> float:
    model = _model()
    started = time.perf_counter()
    trainer = Trainer(
        model, byte_loss, functools.partial(_adamw_groups, lr=LR, weight_decay=WEIGHT_DECAY),
        config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=run_dir, log_every=STEPS + 1, clip_grad_norm=CLIP,
                           task="none", tensorboard=False),
        checkpoint=CheckpointConfig(enabled=False), accelerator=device,
    )
    stamp: dict[str, float] = {}

    def first_step(*_: Any) -> None:
        sync(device)
        stamp["at"] = time.perf_counter()
        raise _FirstStep

    trainer.optimizer.register_step_post_hook(first_step)
    try:
        trainer.fit(data, resume="overwrite")
    except _FirstStep:
        pass
    return stamp["at"] - started


def run() -> dict[str, Any]:
    out = with_threads(functools.partial(_measure, "cpu"), THREADS)
    if torch.cuda.is_available():
        out["cuda"] = _measure("cuda")
    return out


def _measure(device: str) -> dict[str, Any]:
    data = _data()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _hand(data, device), _trainer(data, f"{tmp}/warm", device)  # warm-up: allocator, kernels, the cached matmul peak
        for r in range(ROUNDS):
            if r % 2:
                trainer_s = _trainer(data, f"{tmp}/{r}", device)
                hand_s, step_s = _hand(data, device)
            else:
                hand_s, step_s = _hand(data, device)
                trainer_s = _trainer(data, f"{tmp}/{r}", device)
            again_s, _ = _hand(data, device)  # the A/A control: the same loop twice differs by noise alone
            rows.append({"trainer_s": round(trainer_s, 3), "hand_s": round(hand_s, 3), "step_s": round(step_s, 3),
                         "extra_in_steps": round((trainer_s - hand_s) / step_s, 2),
                         "hand_again_in_steps": round((again_s - hand_s) / step_s, 2)})
    extra = [row["extra_in_steps"] for row in rows]
    noise = max(abs(row["hand_again_in_steps"]) for row in rows)
    return {
        "ratio": statistics.median(extra),
        "extra_in_steps_min_median_max": [min(extra), statistics.median(extra), max(extra)],
        "rounds": rows,
        "model": f"ByteGPT (benchmarks.lm), batch {BATCH}, context {CONTEXT}, float32",
        "device": f"cpu, {THREADS} threads" if device == "cpu" else device_name(device),
        "target": f"Trainer start-up to its first optimizer step <= the hand loop's + {TARGET_STEPS:g} steady steps, "
                  "every round",
        # A round whose hand loop twice differs by more than half the target cannot tell the target
        # (on a loaded machine the Trainer came out 0.9 steps *faster* than the hand loop): not judged.
        "aa_noise_in_steps_max": noise,
        "target_met": (max(extra) <= TARGET_STEPS) if noise <= TARGET_STEPS / 2 else None,
    }
