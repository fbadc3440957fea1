"""Pipelines as users have them: dict items, batch-level and multi-term losses, schedules that
need the run's length, early stopping, and the Trainer's arguments where Lightning users look."""

import dataclasses
import functools
import json
import math
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import xlatrain
from xlatrain import CheckpointConfig, TrainConfig, Trainer


class DictItems(Dataset):
    """``{"image": [1, 8, 8], "mask": [1, 8, 8], "depth": [1, 8, 8]}`` items, fixed by seed."""

    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.image = torch.rand(n, 1, 8, 8, generator=g)
        self.mask = (self.image > 0.5).float()
        self.depth = self.image * 0.5

    def __len__(self):
        return len(self.image)

    def __getitem__(self, i):
        return {"image": self.image[i], "mask": self.mask[i], "depth": self.depth[i]}


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Conv2d(1, 4, 3, padding=1)
        self.mask = nn.Conv2d(4, 1, 1)
        self.depth = nn.Conv2d(4, 1, 1)

    def forward(self, image):
        h = torch.relu(self.body(image))
        return self.mask(h), self.depth(h)


def dice_rmse(outputs, targets):
    """A two-term loss over the whole batch: no per-sample form (Dice and RMSE do not decompose)."""
    mask_logits, depth = outputs
    mask, depth_true = targets
    p = torch.sigmoid(mask_logits)
    dice = 1 - (2 * (p * mask).sum() + 1) / (p.sum() + mask.sum() + 1)
    rmse = torch.sqrt(F.mse_loss(depth, depth_true))
    return {"loss": dice + rmse, "dice": dice, "rmse": rmse}


def _dict_trainer(run_dir, **cfg):
    torch.manual_seed(0)
    cfg = {"epochs": 2, "batch_size": 8, "task": "none", "run_dir": str(run_dir), **cfg}
    return Trainer(
        TwoHeads(), dice_rmse, functools.partial(torch.optim.Adam, lr=1e-2),
        config=TrainConfig(**cfg), inputs="image", targets=("mask", "depth"), accelerator="cpu",
    )


def test_dict_items_and_a_two_term_batch_loss_train_and_log_each_term(tmp_path):
    trainer = _dict_trainer(tmp_path / "run")
    history = trainer.fit(DictItems(64), DictItems(20, seed=1))
    for row in history:
        assert {"train_loss", "train_dice", "train_rmse", "val_loss", "val_dice", "val_rmse"} <= set(row)
        assert row["train_loss"] == pytest.approx(row["train_dice"] + row["train_rmse"], rel=1e-5)
    assert history[1]["train_loss"] < history[0]["train_loss"]
    saved = json.loads((tmp_path / "run" / "history.json").read_text())
    assert saved[-1]["val_dice"] == history[-1]["val_dice"]


def test_a_batch_level_loss_validates_as_one_pass_over_the_whole_set(tmp_path):
    # 20 validation items in batches of 8: the last batch is padded; the padding must not count
    # and the value must be the loss over all 20 at once (RMSE and Dice are not per-sample means).
    trainer = _dict_trainer(tmp_path / "run", epochs=1, batch_size=8)
    trainer.fit(DictItems(32))
    val = DictItems(20, seed=1)
    metrics = trainer.evaluate(val)
    with torch.no_grad():
        model = trainer.model.eval()
        expected = dice_rmse(model(val.image), (val.mask, val.depth))
    for name in ("loss", "dice", "rmse"):
        assert metrics[name] == pytest.approx(float(expected[name]), rel=1e-5), name
    assert metrics["num_samples"] == 20


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    y: torch.Tensor


class DataclassItems(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return Sample(x=self.x[i], y=(self.x[i, 0] > 0).long())


def test_dataclass_items_batch_as_the_same_dataclass(tmp_path):
    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append(tuple(x.shape))
            return super().forward(x)

    trainer = Trainer(Probe(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                      config=TrainConfig(epochs=1, batch_size=5, run_dir=str(tmp_path)),
                      inputs="x", targets="y", accelerator="cpu")
    history = trainer.fit(DataclassItems(20), DataclassItems(7))
    assert (5, 4) in seen and 0 <= history[0]["val_accuracy"] <= 1
    assert trainer.predict(DataclassItems(7)).shape == (7, 2)


def test_a_dict_batch_without_keys_names_them_before_training(tmp_path):
    trainer = Trainer(TwoHeads(), dice_rmse, functools.partial(torch.optim.Adam, lr=1e-2),
                      config=TrainConfig(task="none", batch_size=8, run_dir=str(tmp_path)), accelerator="cpu")
    with pytest.raises(ValueError, match=r"dry run on one training batch.*keys 'image', 'mask', 'depth'.*inputs='image'"):
        trainer.fit(DictItems(16))
    with pytest.raises(ValueError, match=r"inputs='img'.*no key 'img'; its keys are 'image', 'mask', 'depth'"):
        Trainer(TwoHeads(), dice_rmse, functools.partial(torch.optim.Adam, lr=1e-2),
                config=TrainConfig(task="none", batch_size=8, run_dir=str(tmp_path)), accelerator="cpu",
                inputs="img", targets="mask").fit(DictItems(16))


def test_a_loss_that_cannot_work_fails_before_the_first_step_naming_what_was_passed(tmp_path):
    calls = []

    def forgot_total(outputs, targets):
        calls.append(torch.is_grad_enabled())
        return {"dice": dice_rmse(outputs, targets)["dice"]}

    trainer = Trainer(TwoHeads(), forgot_total, functools.partial(torch.optim.Adam, lr=1e-2),
                      config=TrainConfig(task="none", batch_size=8, run_dir=str(tmp_path)),
                      inputs="image", targets=("mask", "depth"), accelerator="cpu")
    with pytest.raises(ValueError, match=r"before training: loss_fn returned a mapping with keys 'dice' but no 'loss'"):
        trainer.fit(DictItems(16))
    assert calls == [True]  # one dry-run call, run as the step runs it (gradients on); no training step
    # Cross-entropy over per-pixel class probabilities trains, but accuracy needs [B, C] logits.
    with pytest.raises(ValueError, match=r"validation batch.*task='classification'.*\[batch, classes\].*\(2, 1, 8, 8\).*task='none'"):
        Trainer(nn.Conv2d(1, 1, 1), nn.CrossEntropyLoss(), functools.partial(torch.optim.Adam, lr=1e-2),
                config=TrainConfig(batch_size=8, run_dir=str(tmp_path / "b")),
                inputs="image", targets="mask", accelerator="cpu").fit(DictItems(16), DictItems(8))
    with pytest.raises(TypeError, match=r"cross_entropy_loss\(\)") as raised:
        Trainer(TwoHeads(), nn.CrossEntropyLoss(), functools.partial(torch.optim.Adam, lr=1e-2),
                config=TrainConfig(batch_size=8, run_dir=str(tmp_path / "c")),
                inputs="image", targets="mask", accelerator="cpu").fit(DictItems(16))
    assert "dry run on one training batch, before training: loss_fn CrossEntropyLoss()" in str(raised.value.__notes__)


def _linear_trainer(run_dir, scheduler_fn=None, **cfg):
    torch.manual_seed(0)
    cfg = {"epochs": 3, "batch_size": 4, "run_dir": str(run_dir), **cfg}
    return Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                   scheduler_fn=scheduler_fn, config=TrainConfig(**cfg), accelerator="cpu")


def _xy(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


class RecordingSGD(torch.optim.SGD):
    """SGD that records the learning rate each optimizer step used."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.used = []

    def step(self, closure=None):
        self.used.append(self.param_groups[0]["lr"])
        return super().step(closure)


def test_a_schedule_gets_the_runs_length_after_accumulation(tmp_path, caplog):
    caplog.set_level("INFO", logger="xlatrain")
    shapes = []

    def one_cycle(opt, run):
        shapes.append(run)
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=run.total_steps)

    torch.manual_seed(0)
    trainer = Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(RecordingSGD, lr=0.1),
                      scheduler_fn=one_cycle, accelerator="cpu",
                      config=TrainConfig(epochs=3, batch_size=4, grad_accum_steps=2, scheduler_interval="step",
                                         run_dir=str(tmp_path)))
    trainer.fit(_xy(40))  # 10 micro-batches of 4 -> 5 optimizer steps per epoch
    assert shapes == [xlatrain.RunShape(total_steps=15, steps_per_epoch=5, epochs=3)]
    # The header names both counts: the progress lines count micro-batches.
    assert "5 optimizer steps per epoch (10 micro-batches: the progress lines count these)" in caplog.text
    # Every step used the schedule's own rate, the last one its final value (OneCycleLR raises
    # when stepped more than total_steps times).
    reference = torch.optim.lr_scheduler.OneCycleLR(
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), max_lr=0.5, total_steps=15)
    expected = []
    for _ in range(15):
        expected.append(reference.get_last_lr()[0])
        reference.optimizer.step()
        reference.step()
    assert trainer.optimizer.used == pytest.approx(expected)


def test_early_stopping_stops_at_the_expected_epoch_and_a_rerun_trains_nothing(tmp_path, caplog):
    # The training loss falls every epoch, so under monitor_mode="max" epoch 1 stays best and a
    # patience of 2 stops after epoch 3.
    caplog.set_level("INFO", logger="xlatrain")
    cfg = {"epochs": 10, "monitor": "train_loss", "monitor_mode": "max", "early_stop_patience": 2}
    history = _linear_trainer(tmp_path, **cfg).fit(_xy())
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert "early stop: train_loss has not improved for 2 epoch(s)" in caplog.text
    again = _linear_trainer(tmp_path, **cfg).fit(_xy())
    assert [r["epoch"] for r in again] == [1, 2, 3] and "stopped early after epoch 3" in caplog.text


class _TermAt(torch.utils.data.Dataset):
    """``_xy()``, sending this process SIGTERM when its ``at``-th item is read."""

    def __init__(self, at):
        self.base, self.reads, self.at = _xy(), 0, at

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.base[i]


def test_early_stopping_resumes_after_a_sigterm_and_stops_where_an_uninterrupted_run_does(tmp_path):
    # Items are read in this process (num_workers=0): the dataset signals the process that reads it.
    cfg = {"epochs": 10, "monitor": "train_loss", "monitor_mode": "max", "early_stop_patience": 2, "num_workers": 0}
    whole = _linear_trainer(tmp_path / "whole", **cfg).fit(_xy())
    # 10 steps of 4 items per epoch: read 60 falls in epoch 2, after epoch 1 made its best.
    with pytest.raises(SystemExit) as stop:
        _linear_trainer(tmp_path / "cut", **cfg).fit(_TermAt(60))
    assert stop.value.code == 0
    cut = json.loads((tmp_path / "cut" / "history.json").read_text())
    assert [r["epoch"] for r in cut] == [1]  # stopped inside epoch 2
    resumed = _linear_trainer(tmp_path / "cut", **cfg).fit(_xy())
    assert [r["epoch"] for r in resumed] == [r["epoch"] for r in whole] == [1, 2, 3]
    assert [r["train_loss"] for r in resumed] == [r["train_loss"] for r in whole]


def test_save_best_false_writes_no_best_weights(tmp_path):
    _linear_trainer(tmp_path, epochs=2, save_best=False).fit(_xy(), _xy(12, seed=1))
    assert not (tmp_path / "best.safetensors").exists() and (tmp_path / "history.json").exists()


def test_accelerator_and_devices_on_the_trainer_match_the_yaml_spelling(tmp_path):
    trainer = Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                      accelerator="cpu", devices=1, config=TrainConfig(run_dir=str(tmp_path)))
    assert trainer.runtime.kind == "cpu" and trainer.strategy.world_size == 1
    with pytest.raises(ValueError, match=r"backend='cpu' and accelerator=/devices=/strategy= both say where to run"):
        Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                backend="cpu", accelerator="cpu")
    with pytest.raises(ValueError, match=r"devices=2 with accelerator='cpu' means 2 processes.*torchrun --nproc-per-node 2"):
        Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                accelerator="cpu", devices=2)
