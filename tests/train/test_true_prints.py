"""What xlatrain prints is what it says: each line here once said something untrue."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from xlatrain import TrainConfig, Trainer
from xlatrain.progress import EpochProgress, format_rate


def _data(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _trainer(tmp_path, **cfg):
    torch.manual_seed(0)
    return Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                   config=TrainConfig(**{"epochs": 2, "batch_size": 4, "run_dir": str(tmp_path), "log_every": 2,
                                         "tensorboard": False, **cfg}), backend="cpu")


def test_on_the_cpu_the_process_memory_is_named_as_such_not_as_a_device_peak(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    _trainer(tmp_path).fit(_data())
    assert "memory per device: measured peak" not in caplog.text  # a process's RSS is no device's peak
    line = next(ln for ln in caplog.text.splitlines() if "peak resident memory" in ln)
    assert "the process's peak resident memory was" in line and "(Python, torch, the data and the model together)" in line
    assert "the model's own parameters, gradients, optimizer state and activations, as planned before the first step, are" in line


def test_a_small_rate_keeps_its_digits_and_a_warm_up_interval_shows_none():
    assert format_rate(0.27) == "0.27" and format_rate(12.5) == "12.5" and format_rate(1874.4) == "1,874"
    lines = []
    progress = EpochProgress(1, 10, 0, interactive=False, log=lines.append)
    progress.show(2, epoch_loss=0.5, samples_per_s=None, nonfinite=0, rate_note="MFU 0.3%")
    progress.show(4, epoch_loss=0.5, samples_per_s=0.27, nonfinite=0, rate_note="MFU 0.3%")
    assert "warm-up" in lines[0] and "MFU" not in lines[0] and "samples/s" not in lines[0]
    assert "0.27 samples/s" in lines[1] and " 0 samples/s" not in lines[1]


def test_a_finished_run_run_again_says_nothing_to_train_and_does_not_say_it_resumed(tmp_path, caplog):
    _trainer(tmp_path).fit(_data())
    caplog.clear()
    caplog.set_level(logging.INFO, logger="xlatrain")
    _trainer(tmp_path).fit(_data())
    assert "nothing to train" in caplog.text
    assert "resumed from" not in caplog.text and "continuing at epoch 3" not in caplog.text
    # No first step follows, so nothing is said of one: no plan "before the first step", no FLOPs.
    assert "before the first step" not in caplog.text and "model FLOPs" not in caplog.text


def test_a_resumed_run_says_where_it_continues(tmp_path, caplog):
    _trainer(tmp_path, epochs=1).fit(_data())
    caplog.set_level(logging.INFO, logger="xlatrain")
    _trainer(tmp_path, epochs=2).fit(_data())
    assert "continuing at epoch 2, step 0" in caplog.text


def test_top1_accuracy_is_not_a_second_column_for_accuracy(tmp_path):
    row = _trainer(tmp_path, top_k=(1, 2)).fit(_data(), _data(8, 1))[-1]
    assert "val_accuracy" in row and "val_top2_accuracy" in row and "val_top1_accuracy" not in row
    # monitor='val_top1_accuracy' still means top-1 accuracy: the run follows val_accuracy.
    trainer = _trainer(tmp_path / "m", top_k=(1,), monitor="val_top1_accuracy")
    trainer.fit(_data(), _data(8, 1))
    assert trainer.monitor == "val_accuracy"


def test_fsdp_units_are_the_repeated_blocks_not_a_final_norm_standing_alone():
    transformers = pytest.importorskip("transformers")
    from xlatrain.backend.units import find_units

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64))
    units = find_units(model)
    assert [type(u).__name__ for _, u in units] == ["LlamaDecoderLayer"] * 3


class _StopBeforeTheFirstStep:
    def on_fit_start(self, trainer):
        raise RuntimeError("stopped before the first step")


def test_a_whole_set_loss_that_would_keep_gigabytes_on_the_host_is_said_before_the_first_step(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")

    def gap(outputs, targets):  # one number for a batch: no per-sample form
        return (outputs.mean() - targets.mean()) ** 2

    def fit(width, n_val):
        caplog.clear()
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(n_val, 4, generator=g), torch.randn(n_val, 1, generator=g))
        trainer = Trainer(nn.Linear(4, width), gap, functools.partial(torch.optim.SGD, lr=0.1),
                          config=TrainConfig(epochs=1, batch_size=4, run_dir=str(tmp_path / f"w{width}"), task="none",
                                             tensorboard=False), callbacks=[_StopBeforeTheFirstStep()], backend="cpu")
        with pytest.raises(RuntimeError, match="stopped before the first step"):
            trainer.fit(TensorDataset(*data[:8]), data)
        return caplog.text

    # 8,000 rows of 65,536 outputs (and a target), float32: 2.1 GB kept after each epoch.
    said = fit(65536, 8000)
    assert "note: the loss returns one number for a batch (no per-sample form), so evaluation keeps every " \
           "validation row's outputs and targets on the host to score the set at once: about 2.1 GB for these " \
           "8,000 samples" in said
    assert "note: the loss returns one number" not in fit(8, 4000)  # 256 kB: nothing to say
