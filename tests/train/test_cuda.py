"""What only a CUDA device runs: channels_last chosen for a conv net under bf16, the fused AdamW the
Trainer picks, the memory plan measured at the real batch, and a fit that trains with all three.
Skipped without CUDA (CI has none); run on a lent GPU with ``pytest -m gpu``."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))


def _data(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 32, 32, generator=g), torch.randint(0, 4, (n,), generator=g))


def test_a_conv_net_under_bf16_trains_channels_last_with_fused_adamw_and_a_measured_plan(tmp_path):
    trainer = xlatrain.Trainer(
        _conv_net(), nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-3),
        config=xlatrain.TrainConfig(epochs=2, batch_size=32, precision="bf16", run_dir=str(tmp_path)),
        accelerator="cuda",
    )
    assert trainer.channels_last is True
    assert trainer.optimizer.defaults.get("fused") is True
    history = trainer.fit(_data(), _data(64))
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    plan = trainer.memory_plan
    assert plan.measured_step is not None and plan.measured_step > 0
    peak = plan.measured_peak[0] if plan.measured_peak else None
    assert peak is not None and abs(plan.total / peak - 1) <= 0.5, (plan.total, peak)


def test_the_dry_run_is_the_measured_forward_and_backward_at_the_real_batch(tmp_path):
    # On CUDA one pass before the first step serves the dry run, the FLOP count, the activations
    # and the memory measurement: two forwards (that one, then the first step's), both of 32 rows.
    model = _conv_net()
    rows: list[int] = []
    model.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    trainer = xlatrain.Trainer(
        model, nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-3),
        config=xlatrain.TrainConfig(epochs=1, batch_size=32, precision="bf16", run_dir=str(tmp_path)), accelerator="cuda",
    )
    at_first_step: list[list[int]] = []
    trainer.optimizer.register_step_post_hook(lambda *_: at_first_step or at_first_step.append(list(rows)))
    trainer.fit(_data(64))
    assert at_first_step == [[32, 32]]
    assert trainer.memory_plan.measured_step > 0 and trainer.throughput.flops_per_sample > 0


def test_a_second_fit_counts_the_optimizer_state_it_already_holds_once(tmp_path):
    # Eight 1024x1024 layers at batch 8: AdamW's state (67 MB) is a large part of the plan, so
    # counting it twice (in the measured pass, where the first fit left it, and again as state)
    # would show.
    from xlatrain.backend.model_state import optimizer_state_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 1024, generator=g), torch.randn(64, 1024, generator=g))
    trainer = xlatrain.Trainer(
        model, nn.MSELoss(), functools.partial(torch.optim.AdamW, lr=1e-4),
        config=xlatrain.TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path)), accelerator="cuda",
    )
    trainer.fit(data)
    first = trainer.memory_plan.total
    trainer.fit(data, resume="overwrite")
    state = optimizer_state_bytes(trainer.optimizer, trainer.runtime.device)
    assert state > 0.2 * first  # cuBLAS workspaces are in the plan too
    assert abs(trainer.memory_plan.total / first - 1) < 0.15, (first, trainer.memory_plan.total, state)


def test_a_factory_that_says_fused_false_keeps_it_and_fp32_stays_contiguous(tmp_path):
    trainer = xlatrain.Trainer(
        _conv_net(), nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-3, fused=False),
        config=xlatrain.TrainConfig(epochs=1, batch_size=32, run_dir=str(tmp_path)), accelerator="cuda",
    )
    assert trainer.channels_last is False
    assert trainer.optimizer.defaults.get("fused") is False
    trainer.fit(_data(64))
