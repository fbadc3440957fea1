"""The PE recipe at its defaults on CUDA against the same model on batches already on the GPU.

The recipe (configs/pe_detection.yaml with the accelerator settings its comment names: resnet34,
1x256x256 CT slices, bf16, batch 64) reads shards packed from generated RSNA-shaped data through
the shard reader, with the defaults a user gets: ``num_workers="auto"``, ``channels_last="auto"``.
The other side trains the same network, in the same precision and memory format, on a batch made
once on the GPU: what the device does when it never waits. The sides alternate, the device-resident
loop first and last, and each recipe epoch is held against the mean of the device-resident windows
just before and after it: both steps are bound by the Python thread that launches them, whose pace
drifts over seconds on a shared host (the same device-resident step launched in 16.6-19.2 ms across
one run on an H200, 12.6-19.6 ms across another), and the mean of the windows on either side takes
out a drift that runs steadily across the three, which one window beside it would leave in the
ratio; a jump between two windows it does not. Figures: images/s of the recipe over the device-resident loop (target >= 0.9
every round) and the share of training time the recipe waited for input (target < 10%).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.gpu_common import cuda_missing, device_name, skipped, spread, sync

ROUNDS = int(os.environ.get("XLATRAIN_GPU_PIPELINE_ROUNDS", "3"))
# 240 generated studies give an epoch of 84 steps at batch 64 (1.5 s on an H200); a longer epoch
# (e.g. 480, 168 steps) tells a cost paid once per epoch from one paid every step.
STUDIES = int(os.environ.get("XLATRAIN_GPU_PIPELINE_STUDIES", "240"))
RECIPE = ["model.name=resnet34", "data.image_size=256", "data.stored_size=256", "trainer.precision=bf16",
          "trainer.batch_size=64", "trainer.epochs=1", f"data.num_studies={STUDIES}", "data.slices_per_study=[24,32]",
          "checkpoint.enabled=false"]
SMOKE = ["model.name=small_cnn", "model.width=8", "data.image_size=32", "data.stored_size=48", "trainer.batch_size=4",
         "trainer.epochs=1", "data.num_studies=6", "data.slices_per_study=[4,5]", "data.num_folds=3",
         "data.pack_workers=1", "checkpoint.enabled=false"]


def _recipe(root: str, overrides: list[str], accelerator: str) -> tuple[Any, Any]:
    from xlatrain.config import load_run_config
    from xlatrain.recipes.run import build_trainer

    config = load_run_config(str(Path(__file__).resolve().parent.parent / "configs" / "pe_detection.yaml"),
                             [*overrides, f"data.root={root}/data", f"trainer.run_dir={root}/run",
                              f"backend.accelerator={accelerator}"])
    return build_trainer(config)


def _resident(trainer: Any, device: str, steps: int) -> float:
    """Images/s of the recipe's network on one batch that stays on the device: same precision and
    memory format, the recipe's loss and a fresh Adam built as the Trainer built its own (fused where
    that one is: the comparison is of the feed, not the optimizer), in training mode as the recipe trains (a fit
    ends with validation, in eval mode: batch norm's running statistics and no rotation are another
    step than the recipe's)."""
    model = trainer.strategy.unwrap(trainer.model)
    model.train()
    fused = bool(trainer.optimizer.defaults.get("fused"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, **({"fused": True} if fused else {}))
    batch = trainer.config.batch_size
    images = torch.randint(0, 255, (batch, 1, *trainer._feed.dataset.image_size), dtype=torch.uint8, device=device)
    if trainer.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    targets = torch.rand(batch, 10, device=device).round()
    loss_fn = nn.BCEWithLogitsLoss()

    def step() -> None:
        with trainer.precision.autocast():
            loss = loss_fn(model(images).float(), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return steps * batch / (time.perf_counter() - start)


def run(smoke: bool = False) -> dict[str, Any]:
    if smoke:
        device, overrides, rounds, steps = "cpu", SMOKE, 1, 3
    else:
        missing = cuda_missing()
        if missing:
            return skipped(missing)
        device, overrides, rounds, steps = "cuda", RECIPE, ROUNDS, None
    rows = []
    with tempfile.TemporaryDirectory() as root:
        trainer, parts = _recipe(root, overrides, device)
        trainer.fit(parts.train_data, parts.val_data, resume="overwrite")  # packs, compiles, warms the allocator
        # The device-resident side runs as many steps as the recipe's epoch, so both windows are as long.
        steps = steps or trainer._feed.steps_per_epoch
        resident = [_resident(trainer, device, steps)]
        for _ in range(rounds):
            row = trainer.fit(parts.train_data, parts.val_data, resume="overwrite")[-1]
            report = json.loads((trainer.run_dir / "diagnostics.json").read_text())
            resident.append(_resident(trainer, device, steps))
            around = (resident[-2] + resident[-1]) / 2
            rows.append({"recipe": row["samples_per_s"], "input_wait_share": round(report["input_bound_share"], 4),
                         "resident_before_after": [round(resident[-2], 1), round(resident[-1], 1)],
                         "ratio": round(row["samples_per_s"] / around, 4)})
        workers = trainer._feed.workers_reason if trainer._feed is not None else ""
        header = {"decode_workers": trainer._feed.num_workers if trainer._feed is not None else None,
                  "why": workers, "channels_last": trainer.channels_last}
    ratios = [row["ratio"] for row in rows]
    waits = [row["input_wait_share"] for row in rows]
    return {
        "ratio": statistics.median(ratios),
        "ratio_min_median_max": spread(ratios),
        "input_wait_share_min_median_max": spread(waits),
        "rounds": rows,
        "recipe_defaults_chosen": header,
        "studies": STUDIES if not smoke else None,
        "steps_per_epoch": trainer._feed.steps_per_epoch if trainer._feed is not None else None,
        "device": device_name(device),
        "target": "recipe / device-resident images/s >= 0.9 and input wait < 10%, every round",
        "target_met": device == "cuda" and min(ratios) >= 0.9 and max(waits) < 0.10,
    }
