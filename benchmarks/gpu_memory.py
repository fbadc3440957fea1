"""The memory plan against the measured peak on CUDA: a small CNN, a ResNet-34 and the 1.2B LM.

For each model a Trainer trains one short epoch; the plan it made before the first step (on CUDA:
one forward and backward measured at the real batch, plus the optimizer's state) is compared with
CUDA's peak allocated over the epoch. Target: the plan within 15% of the peak, every model.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import torch
from torch import nn

from benchmarks.gpu_common import cuda_missing, device_name, skipped
from xlatrain import CheckpointConfig, TrainConfig, Trainer

TOLERANCE = 0.15


def _cases(smoke: bool) -> list[dict[str, Any]]:
    import torchvision

    from xlatrain.models import SmallCNN
    from xlatrain.recipes.lm.model import ByteGPT

    if smoke:
        return [{"name": "small cnn", "model": lambda: SmallCNN(in_channels=1, num_outputs=10, width=8),
                 "input": (1, 16, 16), "classes": 10, "batch": 4, "precision": "32"}]
    return [
        {"name": "small cnn, fp32, batch 256", "model": lambda: SmallCNN(in_channels=1, num_outputs=10, width=32),
         "input": (1, 32, 32), "classes": 10, "batch": 256, "precision": "32"},
        {"name": "resnet34, bf16, batch 64, 1x256x256", "input": (1, 256, 256), "classes": 10, "batch": 64,
         "precision": "bf16", "model": lambda: _one_channel(torchvision.models.resnet34(num_classes=10))},
        {"name": "ByteGPT 1.2B (2048x24, context 1024), bf16, batch 8", "lm": True, "batch": 8, "precision": "bf16",
         "model": lambda: ByteGPT(context=1024, width=2048, layers=24, heads=16)},
    ]


def _one_channel(model: nn.Module) -> nn.Module:
    model.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
    return model


def _data(case: dict[str, Any], steps: int) -> Any:
    g = torch.Generator().manual_seed(0)
    n = case["batch"] * steps
    if case.get("lm"):
        tokens = torch.randint(0, 256, (n, 1025), generator=g)
        return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.TensorDataset(torch.randn(n, *case["input"], generator=g),
                                          torch.randint(0, case["classes"], (n,), generator=g))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def run(smoke: bool = False) -> dict[str, Any]:
    device = "cpu" if smoke else "cuda"
    if not smoke and cuda_missing():
        return skipped(cuda_missing() or "")
    rows = []
    for case in _cases(smoke):
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(
                case["model"](), _lm_loss if case.get("lm") else nn.CrossEntropyLoss(),
                functools.partial(torch.optim.AdamW, lr=1e-4),
                config=TrainConfig(epochs=1, batch_size=case["batch"], precision=case["precision"], run_dir=run_dir,
                                   tensorboard=False, task="none", diagnostics=False),
                checkpoint=CheckpointConfig(enabled=False), accelerator=device,
            )
            trainer.fit(_data(case, 2 if smoke else 6))
            plan = trainer.memory_plan
            peak = plan.measured_peak[0] if plan.measured_peak else None
            rows.append({"model": case["name"], "plan_bytes": plan.total, "estimate_bytes": plan.estimate,
                         "measured_step_bytes": plan.measured_step, "peak_bytes": peak,
                         "plan_over_peak": round(plan.total / peak, 3) if peak else None})
        if device == "cuda":
            torch.cuda.empty_cache()
    ratios = [r["plan_over_peak"] for r in rows if r["plan_over_peak"] is not None]
    return {
        "ratio": max(abs(r - 1) for r in ratios) if ratios else None,
        "cases": rows,
        "device": device_name(device),
        "target": f"plan within {TOLERANCE:.0%} of CUDA's measured peak for every model",
        "target_met": bool(ratios) and all(abs(r - 1) <= TOLERANCE for r in ratios) and device == "cuda",
    }
