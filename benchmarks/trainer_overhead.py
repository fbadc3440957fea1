"""Trainer step time against a hand-written PyTorch loop: same model, data, optimizer and seed.

Both run on the CPU in this process, epoch by epoch, with a second copy of the plain loop as an
A/A control (its ratio to the first is the machine's noise floor). A round is ``PAIRS``
repetitions of the three sides back to back, the order rotating, and its ratio the median of the
repetitions' time ratios; the figures are min / median / max over rounds, the step times median
epoch times divided by steps.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from xlatrain import CheckpointConfig, TrainConfig, Trainer
from xlatrain.models import SmallCNN

BATCH = 64
STEPS = 20
ROUNDS = 5
PAIRS = 10  # repetitions per round, each side once per repetition
# One compute thread: the second core absorbs the host's own work, which otherwise lands in
# one side's epoch at random (this VM's epoch times drift by several percent with two threads).
THREADS = 1


def _data(steps: int = STEPS) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * steps, 1, 32, 32, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (BATCH * steps,), generator=g))


def _plain_epoch(
    model: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader[Any], forward: Any = None,
    device: str = "cpu",
) -> float:
    """One epoch of the hand-written loop, timed; ``forward`` is the model unless given (e.g.
    the model under ``torch.compile``)."""
    loss_fn = nn.CrossEntropyLoss()
    forward = model if forward is None else forward
    model.train()
    start = time.perf_counter()
    loss_sum = torch.zeros((), device=device)
    for x, y in loader:
        if device != "cpu":
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = loss_fn(forward(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.detach()
    float(loss_sum)  # the epoch-end read the Trainer also does
    return time.perf_counter() - start


def with_threads(measure: Any, count: int = THREADS) -> dict[str, Any]:
    """``measure()`` with ``count`` compute threads, the previous count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return measure()
    finally:
        torch.set_num_threads(threads)


def run() -> dict[str, Any]:
    return with_threads(_measure)


def _measure(device: str = "cpu", rounds: int = ROUNDS, pairs: int = PAIRS, steps: int = STEPS) -> dict[str, Any]:
    data = _data(steps)
    torch.manual_seed(0)
    plain_model = SmallCNN(in_channels=1, num_outputs=10, width=32).to(device)
    plain_opt = torch.optim.Adam(plain_model.parameters(), lr=1e-3)
    # A second plain loop on its own model copy: the same program twice, whose ratio to the first
    # is this machine's noise floor for the Trainer's ratio (an A/A control).
    torch.manual_seed(0)
    control_model = SmallCNN(in_channels=1, num_outputs=10, width=32).to(device)
    control_opt = torch.optim.Adam(control_model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0),
                        pin_memory=device == "cuda")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(
            SmallCNN(in_channels=1, num_outputs=10, width=32),
            nn.CrossEntropyLoss(),
            functools.partial(torch.optim.Adam, lr=1e-3),
            config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=run_dir, log_every=10),
            # Each fit below must train a fresh epoch, not resume the previous one's checkpoint.
            checkpoint=CheckpointConfig(enabled=False),
            backend=device,
        )
        plain, ours, control = [], [], []
        round_ratios, control_ratios = [], []
        _plain_epoch(plain_model, plain_opt, loader, device=device)  # warm-up every side (allocator, kernels)
        _plain_epoch(control_model, control_opt, loader, device=device)
        trainer.fit(data)
        run_side = {
            "plain": lambda: plain.append(_plain_epoch(plain_model, plain_opt, loader, device=device)),
            "trainer": lambda: ours.append(trainer.fit(data, resume="overwrite")[-1]["epoch_time_s"]),
            "control": lambda: control.append(_plain_epoch(control_model, control_opt, loader, device=device)),
        }
        names = list(run_side)
        for r in range(rounds):
            ratios, controls = [], []
            for k in range(pairs):
                # Rotate the order, so no side always runs on a warmer cache.
                shift = (r * pairs + k) % len(names)
                for name in names[shift:] + names[:shift]:
                    run_side[name]()
                # The epochs ran back to back: their ratio cancels slow drift in machine load.
                ratios.append(ours[-1] / plain[-1])
                controls.append(control[-1] / plain[-1])
            # A round's ratio is the median of its repetitions: one epoch hit by a burst of other
            # load does not decide it.
            round_ratios.append(statistics.median(ratios))
            control_ratios.append(statistics.median(controls))
    plain_step = statistics.median(plain) / steps
    ours_step = statistics.median(ours) / steps
    per_round = round_ratios
    return {
        "ratio": round(statistics.median(per_round), 4),
        "ratio_min_median_max": [round(min(per_round), 4), round(statistics.median(per_round), 4), round(max(per_round), 4)],
        "ratio_per_round": [round(r, 4) for r in per_round],
        "ratio_of_medians": round(ours_step / plain_step, 4),
        # The second plain loop over the first, round by round: how far two identical programs
        # differ on this machine.
        "control_ratio_per_round": [round(r, 4) for r in control_ratios],
        "control_ratio_min_median_max": [
            round(min(control_ratios), 4), round(statistics.median(control_ratios), 4), round(max(control_ratios), 4)],
        "trainer_step_ms": round(ours_step * 1e3, 3),
        "plain_step_ms": round(plain_step * 1e3, 3),
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "optimizers": "Trainer: the factory's Adam, fused where torch has a kernel (the Trainer's default); "
                      "plain loop: torch's default Adam",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": "SmallCNN (digits demo), 1x32x32 input, batch 64, Adam",
        "steps_per_epoch": steps,
        "rounds": ROUNDS,
        "repetitions_per_round": PAIRS,
        "target": "ratio (Trainer / plain loop step time): median <= 1.02, every round <= 1.05",
        "target_met": statistics.median(per_round) <= 1.02 and max(per_round) <= 1.05,
    }
