"""Trainer(compile=True) against a hand-written loop that compiles the same model, and both
against the plain eager loop: same model, data, optimizer and seed, on the CPU, in this process.

A second hand-compiled copy runs beside them as an A/A control. Each round runs the sides
``REPEATS`` times, their order rotating; a round's ratio is the median over its repetitions of
ratios between epochs that ran back to back, so slow drift in machine load cancels and one
disturbed epoch does not decide it. The compiled sides are compiled once, before the rounds
(``torch.compile`` with its default backend, inductor, as ``TrainConfig(compile=True)`` uses on
the CPU); the rounds time steady-state epochs only.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.trainer_overhead import BATCH, STEPS, _data, _plain_epoch, with_threads
from xlatrain import CheckpointConfig, TrainConfig, Trainer
from xlatrain.models import SmallCNN

ROUNDS = 5
REPEATS = 4  # each round runs the four sides this many times, the order rotating


def _model() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN(in_channels=1, num_outputs=10, width=32)


def run() -> dict[str, Any]:
    return with_threads(_measure)


def _measure() -> dict[str, Any]:
    data = _data()
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0))
    eager_model, compiled_model = _model(), _model()
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-3)
    compiled_opt = torch.optim.Adam(compiled_model.parameters(), lr=1e-3)
    compiled_forward = torch.compile(compiled_model)
    # A second hand-compiled copy: the same program run twice, whose ratio to the first is the
    # noise floor of this machine for the Trainer's ratio (an A/A control).
    control_model = _model()
    control_opt = torch.optim.Adam(control_model.parameters(), lr=1e-3)
    control_forward = torch.compile(control_model)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(
            _model(), nn.CrossEntropyLoss(), functools.partial(torch.optim.Adam, lr=1e-3),
            config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=run_dir, log_every=10, compile=True,
                               tensorboard=False),
            checkpoint=CheckpointConfig(enabled=False),  # each fit trains a fresh epoch
            accelerator="cpu",
        )
        started = time.perf_counter()
        _plain_epoch(compiled_model, compiled_opt, loader, forward=compiled_forward)  # compiles
        hand_compile_s = time.perf_counter() - started
        started = time.perf_counter()
        trainer.fit(data)  # compiles
        trainer_compile_s = time.perf_counter() - started
        _plain_epoch(control_model, control_opt, loader, forward=control_forward)
        _plain_epoch(eager_model, eager_opt, loader)
        sides: dict[str, list[float]] = {"trainer": [], "hand": [], "control": [], "eager": []}
        run_side = {
            "trainer": lambda: trainer.fit(data, resume="overwrite")[-1]["epoch_time_s"],
            "hand": lambda: _plain_epoch(compiled_model, compiled_opt, loader, forward=compiled_forward),
            "control": lambda: _plain_epoch(control_model, control_opt, loader, forward=control_forward),
            "eager": lambda: _plain_epoch(eager_model, eager_opt, loader),
        }
        names = list(run_side)
        orders = [names[i:] + names[:i] for i in range(len(names))]
        vs_hand, speedup, control = [], [], []
        for r in range(ROUNDS):
            round_vs_hand, round_speedup, round_control = [], [], []
            for k in range(REPEATS):
                for side in orders[(r * REPEATS + k) % len(orders)]:
                    sides[side].append(run_side[side]())
                round_vs_hand.append(sides["trainer"][-1] / sides["hand"][-1])
                round_speedup.append(sides["eager"][-1] / sides["trainer"][-1])
                round_control.append(sides["control"][-1] / sides["hand"][-1])
            # A round's figure is the median of its repetitions: one epoch hit by a burst of
            # other load does not decide it.
            vs_hand.append(statistics.median(round_vs_hand))
            speedup.append(statistics.median(round_speedup))
            control.append(statistics.median(round_control))
    return {
        "ratio": round(statistics.median(vs_hand), 4),
        "ratio_per_round": [round(v, 4) for v in vs_hand],
        "ratio_min_median_max": [round(min(vs_hand), 4), round(statistics.median(vs_hand), 4), round(max(vs_hand), 4)],
        # The same hand-compiled loop on a second model copy over the first: how far two identical
        # programs differ here, round by round.
        "control_ratio_per_round": [round(v, 4) for v in control],
        "control_ratio_min_median_max": [round(min(control), 4), round(statistics.median(control), 4), round(max(control), 4)],
        "speedup_over_eager": round(statistics.median(speedup), 4),
        "speedup_over_eager_min_max": [round(min(speedup), 4), round(max(speedup), 4)],
        "step_ms": {side: round(statistics.median(times) / STEPS * 1e3, 3) for side, times in sides.items()},
        "first_epoch_with_compile_s": {"trainer": round(trainer_compile_s, 2), "hand": round(hand_compile_s, 2)},
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "backend": "inductor",
        "torch": torch.__version__,
        "model": "SmallCNN (digits demo), 1x32x32 input, batch 64, Adam",
        "steps_per_epoch": STEPS,
        "rounds": ROUNDS,
        "repeats_per_round": REPEATS,
        "target": "ratio (Trainer / hand-compiled step time) <= 1.03 in every round",
        "target_met": max(vs_hand) <= 1.03,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
