"""An EMA that follows the recipes people port (torchvision's update rule and warm-up, batch-norm
statistics recomputed for the average), and callbacks whose changes survive a resume."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

from conftest import SCRIPTS
from test_resume_with_workers import _kill_at
from xlatrain import TrainConfig, Trainer
from conftest import run_script

N, BATCH, EPOCHS = 32, 4, 3


def _data(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def _ema_trainer(tmp_path, **cfg):
    return Trainer(
        _model(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, foreach=False),
        config=TrainConfig(epochs=EPOCHS, batch_size=BATCH, run_dir=str(tmp_path), log_every=1000, tensorboard=False,
                           ema_decay=0.8, ema_every=3, **cfg),
        backend="cpu", sampler=list(range(N)),
    )


def _torchvision_reference(warmup_epochs):
    """torchvision's references/classification/train.py, its EMA lines as they are written."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    data = _data()
    ema, n_averaged = None, 0
    for epoch in range(EPOCHS):
        for i, start in enumerate(range(0, N, BATCH)):
            x, y = data[start:start + BATCH]
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i % 3 == 0:  # model_ema.update_parameters(model)
                weights = {k: p.detach().clone() for k, p in model.named_parameters()}
                ema = weights if n_averaged == 0 else {k: 0.8 * ema[k] + 0.2 * weights[k] for k in weights}
                n_averaged += 1
                if epoch < warmup_epochs:  # reset the ema buffer to keep copying weights during warm-up
                    n_averaged = 0
    return ema


@pytest.mark.parametrize("warmup", [0, 1])
def test_the_torchvision_rule_and_warm_up_give_the_reference_average(tmp_path, warmup):
    _ema_trainer(tmp_path, ema_rule="torchvision", ema_warmup_epochs=warmup).fit(_data())
    saved = load_file(str(tmp_path / "ema.safetensors"))
    expected = _torchvision_reference(warmup)
    for k, v in expected.items():
        torch.testing.assert_close(saved[k], v, rtol=1e-5, atol=1e-6)



class _LateBranch(nn.Module):
    """A branch the model takes from its fourth training step on: no gradient for it before. A
    callback too: training steps are the passes after on_fit_start (the dry run's come before)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.late, self.steps, self.counting = nn.Linear(6, 2), nn.Linear(6, 2), 0, False

    def on_fit_start(self, trainer):
        self.counting = True

    def forward(self, x):
        self.steps += self.counting and self.training and torch.is_grad_enabled()
        return self.trunk(x) + (self.late(x) if self.steps >= 4 else 0)


def test_the_average_of_a_parameter_starts_at_its_own_first_step_under_adam(tmp_path):
    """Adam makes a parameter's moments at its first step with a gradient. The average of a branch
    the model takes later once started at the run's first step, as the only entry of that
    parameter's optimizer state, and Adam then found no moments there (KeyError 'exp_avg')."""
    starts = {}

    class Starts:
        def on_interval(self, trainer, values):
            state = trainer.optimizer.state
            for name, p in trainer.model.named_parameters():
                if "xlatrain_ema" in state.get(p, {}):
                    starts.setdefault(name, values["global_step"])

    model = _LateBranch()
    trainer = Trainer(model, nn.CrossEntropyLoss(), functools.partial(torch.optim.Adam, lr=0.01),
                      config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=str(tmp_path), log_every=1, ema_decay=0.9,
                                         tensorboard=False),
                      backend="cpu", callbacks=[Starts(), model])
    row = trainer.fit(_data())[0]
    assert torch.isfinite(torch.tensor(row["train_loss"]))
    assert starts == {"trunk.weight": 1, "trunk.bias": 1, "late.weight": 4, "late.bias": 4}
    state = trainer.optimizer.state[model.late.weight]
    assert {"exp_avg", "exp_avg_sq", "step", "xlatrain_ema"} <= set(state) and float(state["step"]) == 5


def test_skip_step_at_the_first_step_with_an_ema_waits_for_the_first_step_taken(tmp_path):
    """skip_step drops the state a skipped first step made; the average then waits for the next
    step, rather than becoming the only entry of that state (Adam then raised KeyError 'exp_avg')."""
    from test_resume import _NanAt, _skip_fit

    trainer, row = _skip_fit(tmp_path, _NanAt(1), functools.partial(torch.optim.Adam, lr=0.01), ema_decay=0.9)
    assert row["nonfinite_steps"] == 1
    assert all(torch.isfinite(e).all() for _, e in trainer.ema.pairs()) and len(trainer.ema.pairs()) == 2

def test_an_ema_turned_off_at_a_resume_is_dropped_and_one_turned_on_again_starts_afresh(tmp_path, caplog):
    """A fit without an EMA resumed from one with it kept the checkpoint's average in the optimizer's
    state and saved it again; an EMA turned on at a later resume took that stale average up as if
    current, where RESUME_RULES promises that it starts there."""
    from xlatrain.checkpoint import latest_name, read_checkpoint

    def fit(run_dir, epochs, ema_decay):
        trainer = Trainer(_model(), nn.CrossEntropyLoss(), functools.partial(torch.optim.Adam, lr=0.01),
                          config=TrainConfig(epochs=epochs, batch_size=BATCH, run_dir=str(run_dir), log_every=1000,
                                             tensorboard=False, ema_decay=ema_decay),
                          backend="cpu", sampler=list(range(N)))
        trainer.fit(_data())
        return trainer

    caplog.set_level("INFO", logger="xlatrain")
    fit(tmp_path / "on", 1, 0.8)
    assert "moving average of the weights is dropped" not in caplog.text
    off = fit(tmp_path / "on", 2, None)
    assert caplog.text.count("the checkpoint's moving average of the weights is dropped") == 1
    assert not any("xlatrain_ema" in state for state in off.optimizer.state.values())
    checkpoints = tmp_path / "on" / "checkpoints"
    tensors, _ = read_checkpoint(checkpoints / latest_name(checkpoints))
    assert tensors and not any("xlatrain_ema" in name for name in tensors)
    again = fit(tmp_path / "on", 3, 0.8)
    fit(tmp_path / "off", 2, None)
    fresh = fit(tmp_path / "off", 3, 0.8)  # a run whose EMA starts in epoch 3
    assert all(torch.equal(a, b) for a, b in zip(again.model.parameters(), fresh.model.parameters()))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(again.ema.pairs(), fresh.ema.pairs()))


def test_the_disk_check_before_the_first_step_counts_the_ema_copy_of_the_weights(tmp_path, monkeypatch):
    """Before the first step the optimizer holds no state, whose size is then estimated from its
    kind; the EMA's copy of every parameter, saved with that state in each checkpoint, was left
    out, so a disk with room for two checkpoints without it passed the check."""
    import shutil
    from types import SimpleNamespace

    from xlatrain.backend.model_state import checkpoint_bytes
    from xlatrain.storage.lock import RunDirError

    def fit(run_dir, ema_decay):
        Trainer(_model(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=str(run_dir), log_every=1000, tensorboard=False,
                                   ema_decay=ema_decay),
                backend="cpu").fit(_data())

    model = _model()
    weights, momenta = checkpoint_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    averages = sum(p.numel() * p.element_size() for p in model.parameters())
    free = 2 * (weights + momenta) + averages  # two checkpoints without the averages, not with them
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=free))
    fit(tmp_path / "without", None)
    with pytest.raises(RunDirError, match=r"for two checkpoints \(each about .* of weights and .* of optimizer state"):
        fit(tmp_path / "with", 0.8)


def test_a_step_skip_step_skipped_leaves_the_average_as_it_was(tmp_path):
    """skip_step leaves the weights and the optimizer's state as they were at a skipped step; the
    average, kept in that state, was still updated after it, pulled toward the unchanged weights
    once more (with decay 0.5, halfway)."""
    from test_resume import _NanAt, _tiny_data

    seen = {}

    class Averages:
        def on_interval(self, trainer, values):
            seen[values["global_step"]] = [e.clone() for _, e in trainer.ema.pairs()]

    loss_fn = _NanAt(3)
    torch.manual_seed(0)
    trainer = Trainer(nn.Linear(4, 2), loss_fn, functools.partial(torch.optim.Adam, lr=0.01),
                      config=TrainConfig(epochs=1, batch_size=5, run_dir=str(tmp_path), log_every=1, tensorboard=False,
                                         nan_policy="skip_step", ema_decay=0.5),
                      backend="cpu", callbacks=[loss_fn, Averages()])
    assert trainer.fit(_tiny_data())[0]["nonfinite_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(seen[2], seen[3]))
    # By hand: the first step's weights start the average; each step taken but the skipped third moves it.
    after = {k: loss_fn.weights[k + 1] for k in range(1, 8)} | {8: trainer.model.weight.detach()}
    average = after[1]
    for k in (2, 4, 5, 6, 7, 8):
        average = 0.5 * average + 0.5 * after[k]
    torch.testing.assert_close(trainer.ema.pairs()[0][1], average, rtol=1e-6, atol=1e-7)


def test_batch_norm_statistics_recomputed_for_the_ema_weights_score_them_as_update_bn_does(tmp_path):
    trainer = _ema_trainer(tmp_path, ema_bn_batches=2)
    row = trainer.fit(_data(), _data(12, 1))[-1]
    # By hand: the EMA weights, batch-norm statistics over the first 2 training batches as
    # torch.optim.swa_utils.update_bn computes them, then the validation loss.
    scored = _model()
    scored.load_state_dict({**trainer.model.state_dict(), **load_file(str(tmp_path / "ema.safetensors"))}, strict=False)
    loader = [_data()[i:i + BATCH] for i in range(0, 2 * BATCH, BATCH)]
    torch.optim.swa_utils.update_bn(((x, y) for x, y in loader), scored)
    scored.eval()
    with torch.no_grad():
        vx, vy = _data(12, 1).tensors
        expected = float(nn.functional.cross_entropy(scored(vx), vy))
    assert row["val_ema_loss"] == pytest.approx(expected, rel=1e-5)
    # ... and the live model's statistics are put back: the next epoch trains on them.
    live = trainer.model[1]
    assert not torch.equal(live.running_mean, scored[1].running_mean)


def test_ema_bn_batches_on_a_model_without_batch_norm_is_said_to_do_nothing(tmp_path, caplog):
    """A ViT (layer norms only) with ema_bn_batches=2 had its header say that batch-norm statistics
    were recomputed before each EMA evaluation, where there are none to recompute."""
    caplog.set_level("INFO", logger="xlatrain")
    torch.manual_seed(0)
    no_norm = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))
    Trainer(no_norm, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
            config=TrainConfig(epochs=2, batch_size=BATCH, run_dir=str(tmp_path / "no_norm"), log_every=1000,
                               tensorboard=False, ema_decay=0.8, ema_bn_batches=2),
            backend="cpu").fit(_data(), _data(12, 1))
    assert caplog.text.count("ema_bn_batches=2 does nothing, as the model has no batch-norm layer") == 1
    assert "statistics recomputed" not in caplog.text
    caplog.clear()
    _ema_trainer(tmp_path / "norm", ema_bn_batches=2).fit(_data(), _data(12, 1))
    assert "batch-norm statistics recomputed over 2 training batch(es)" in caplog.text
    assert "does nothing" not in caplog.text


def test_a_freeze_made_in_on_epoch_start_survives_a_kill_and_resume(tmp_path):
    script = str(SCRIPTS / "freeze_fit.py")
    whole = run_script([sys.executable, script, str(tmp_path / "whole")])
    cut = tmp_path / "cut"
    _kill_at([sys.executable, script, str(cut), "0.02"], "epoch 2 step 7/")
    resumed = run_script([sys.executable, script, str(cut)])
    assert [r["train_loss"] for r in resumed] == [r["train_loss"] for r in whole]
    a, b = load_file(str(cut / "final.safetensors")), load_file(str(tmp_path / "whole" / "final.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The first layer stopped moving after epoch 1 in both; the last one trained on.
    first = load_file(str(tmp_path / "whole" / "epoch1.safetensors"))
    assert torch.equal(a["0.weight"], first["0.weight"]) and not torch.equal(a["2.weight"], first["2.weight"])


def test_a_callback_method_named_like_a_hook_that_is_none_is_refused_naming_the_hooks(tmp_path):
    class Typo:
        def on_epoch_ends(self, trainer, row):
            pass

    with pytest.raises(TypeError, match=r"on_epoch_ends, which the Trainer never calls: the hooks are on_fit_start, "
                                        r"on_epoch_start, on_interval, on_epoch_end"):
        _ema_trainer(tmp_path).__class__(_model(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                                         callbacks=[Typo()], backend="cpu")


def test_on_interval_fires_at_each_epoch_last_step_with_the_rate_that_step_used(tmp_path):
    seen = []

    class Rates:
        def on_interval(self, trainer, values):
            seen.append((values["epoch"], values["step"], values["lr"]))

    Trainer(_model(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
            scheduler_fn=functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda s: 1.0 / (s + 1)),
            config=TrainConfig(epochs=2, batch_size=BATCH, run_dir=str(tmp_path), log_every=3, tensorboard=False,
                               scheduler_interval="step"),
            backend="cpu", callbacks=[Rates()]).fit(_data())
    # 8 steps an epoch, logged every 3: steps 3, 6 and the last, 8; the rate each of those steps used.
    assert [(e, s) for e, s, _ in seen] == [(1, 3), (1, 6), (1, 8), (2, 3), (2, 6), (2, 8)]
    for epoch, step, lr in seen:
        assert lr == pytest.approx(0.1 / ((epoch - 1) * 8 + step))
