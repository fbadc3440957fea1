"""Throughput that means what it says: rates and MFU leave out the first steps of a fit, where
torch.compile (or XLA, or TorchTPU) compiles, and the time those steps took is said beside them."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch import nn

import xlatrain


class _Rates:
    def __init__(self):
        self.values = []

    def on_interval(self, trainer, values):
        self.values.append(values)


class _Paced(nn.Module):
    """A step of a steady 20 ms (a sleep outside the compiled graph): the rates measured are then
    the accounting's, not this machine's noise."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        time.sleep(0.02)
        return self.net(x)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine, threads that spin waiting for each other
    make a tiny step's time swing by an order of magnitude."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_compiled_epoch_reports_the_steady_rate_not_one_diluted_by_compilation(tmp_path, one_thread):
    # A compilation of its own: another test of this process that compiled _Paced would leave
    # graphs this model's guards accept, and inductor's caches on disk would serve the rest; the
    # epoch would then hold no compilation to leave out.
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _compiled_epoch(tmp_path)


def _compiled_epoch(tmp_path):
    torch.manual_seed(0)
    model = _Paced()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64 * 20, 256, generator=g), torch.randint(0, 10, (64 * 20,), generator=g))
    rates = _Rates()
    trainer = xlatrain.Trainer(
        model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.01),
        # log_every=2: the first interval is the warm-up's two steps, so the later intervals cover
        # exactly the steady window the epoch's rate is measured over (on a loaded machine, a
        # window that differs by a few steps differs in rate by more than the accounting does).
        config=xlatrain.TrainConfig(epochs=1, batch_size=64, compile=True, log_every=2, run_dir=str(tmp_path),
                                    tensorboard=False),
        accelerator="cpu", callbacks=[rates],
    )
    row = trainer.fit(data)[0]
    # The warm-up interval has no rate; the later ones do, and the steady window is what they add up to.
    assert rates.values[0]["samples_per_s"] is None and "mfu" not in rates.values[0]
    steady = [v for v in rates.values if v["samples_per_s"] is not None]
    samples = sum(2 * 64 for _ in steady)
    window_rate = samples / sum(2 * 64 / v["samples_per_s"] for v in steady)
    assert abs(row["samples_per_s"] / window_rate - 1) < 0.10, (row, window_rate)
    window_mfu = trainer.throughput.figures(window_rate)["mfu"]
    assert abs(row["mfu"] / window_mfu - 1) < 0.10
    # The compilation is in the epoch's time and not in its rate: a rate over the whole epoch would
    # be well below the steady one (a third of it with a cold compile cache; the C++ kernels
    # compiled by an earlier test of this process still cost half a second here), and the
    # warm-up said beside the rate and the steady steps at that rate add up to the epoch.
    whole_epoch_rate = 20 * 64 / row["epoch_time_s"]
    assert whole_epoch_rate < 0.75 * row["samples_per_s"], (whole_epoch_rate, row)
    steady_s = (20 - 2) * 64 / row["samples_per_s"]
    assert abs(row["warmup_s"] + steady_s - row["epoch_time_s"]) < 0.1 * row["epoch_time_s"], row


def test_under_accumulation_the_warm_up_lasts_two_optimizer_steps(tmp_path):
    # A step's graphs (XLA, torch.compile) differ until the second optimizer step, which is micro
    # step 4 with two micro-batches per step: the rates start after it.
    rates = _Rates()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8 * 10, 256, generator=g), torch.randint(0, 10, (8 * 10,), generator=g))
    trainer = xlatrain.Trainer(
        nn.Sequential(nn.Linear(256, 10)), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.01),
        config=xlatrain.TrainConfig(epochs=1, batch_size=8, grad_accum_steps=2, log_every=2, run_dir=str(tmp_path),
                                    tensorboard=False),
        accelerator="cpu", callbacks=[rates],
    )
    trainer.fit(data)
    assert [v["samples_per_s"] is None for v in rates.values] == [True, True, False, False, False]  # steps 2, 4, .., 10


@pytest.mark.parametrize("log_every", [1, 2, 4])
def test_under_accumulation_each_interval_is_whole_optimizer_steps(tmp_path, log_every):
    """An interval ended at any micro-batch: with 3 micro-batches a step, log_every=1 plotted the
    first micro-batch's loss at optimizer step 1 (1.382 where the step's mean was 1.318), and
    log_every=2 averaged micro-batches of two different steps."""
    losses, recording = [], []

    def loss_fn(outputs, targets):
        loss = nn.functional.cross_entropy(outputs, targets)
        if recording:
            losses.append(float(loss))
        return loss

    class Start:
        def on_fit_start(self, trainer):
            recording.append(True)  # after the dry run

    rates = _Rates()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8 * 12, 6, generator=g), torch.randint(0, 3, (8 * 12,), generator=g))
    trainer = xlatrain.Trainer(
        nn.Linear(6, 3), loss_fn, functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(epochs=1, batch_size=8, grad_accum_steps=3, log_every=log_every,
                                    run_dir=str(tmp_path), tensorboard=False),
        accelerator="cpu", callbacks=[rates, Start()],
    )
    trainer.fit(data)
    assert len(losses) == 12
    ends = [v["step"] for v in rates.values]
    assert all(step % 3 == 0 for step in ends), ends
    assert [v["global_step"] for v in rates.values] == [step // 3 for step in ends]
    first = 0
    for v in rates.values:
        assert v["loss"] == pytest.approx(sum(losses[first:v["step"]]) / (v["step"] - first), rel=1e-5), (ends, v)
        first = v["step"]
