"""Bad input named with its fix, before work is wasted, and the fix each message suggests works."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from xlatrain import TrainConfig, Trainer
from xlatrain.backend import torchrun_command
from xlatrain.checkpoint import CheckpointError


def _data(n=40, seed=0, classes=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, torch.randint(0, classes, (n,), generator=g))


def _trainer(tmp_path, model=None, loss=None, **kwargs):
    cfg = {"epochs": 1, "batch_size": 4, "run_dir": str(tmp_path), "tensorboard": False, **kwargs.pop("config", {})}
    torch.manual_seed(0)
    return Trainer(model or nn.Linear(4, 2), loss or nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                   config=TrainConfig(**cfg), backend="cpu", **kwargs)


def test_a_tutorial_distributed_sampler_instance_is_refused_and_its_class_trains_every_sample(tmp_path):
    data = _data(200)
    with pytest.raises(ValueError, match=r"DistributedSampler\(num_replicas=8, rank=0\) gives one process's share of "
                                         r"the data, about 25 of 200 samples.*Pass the class or a factory"):
        _trainer(tmp_path / "a", sampler=DistributedSampler(data, num_replicas=8, rank=0)).fit(data)
    seen = []

    class Seen(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            seen.append(i)
            return data[i]

    _trainer(tmp_path / "b", sampler=DistributedSampler, config={"num_workers": 0}).fit(Seen())
    assert set(seen) == set(range(200))  # the fix: every sample, once per epoch (the dry run's first rows aside)


def test_a_collate_or_transform_that_drops_the_targets_is_named_as_the_culprit(tmp_path):
    data = _data()
    inputs_only = lambda items: torch.stack([x for x, _ in items])  # noqa: E731
    with pytest.raises(ValueError, match=r"collate_fn .* made a Tensor, not an \(inputs, targets\) pair"):
        _trainer(tmp_path / "c", collate_fn=inputs_only).fit(data)
    with pytest.raises(ValueError, match=r"batch_transform .* made a Tensor, not an \(inputs, targets\) pair"):
        _trainer(tmp_path / "t", batch_transform=lambda b: b[0] * 2).fit(data)
    # The fix: return both.
    _trainer(tmp_path / "ok", batch_transform=lambda b: (b[0] * 2, b[1])).fit(data)


class _Overflows(nn.Module):
    """A forward that leaves float16's range (its largest value is 65504) but not float32's."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x * 1e5) / 1e5


def test_fp16_overflowing_in_the_forward_says_so_and_bf16_trains(tmp_path):
    # The code cannot tell an overflow from inputs holding NaN/Inf: it says both, and the fixes of each.
    with pytest.raises(FloatingPointError, match=r"precision='fp16': the forward pass made it, for example by "
                                                 r"overflowing float16 .* from inputs that hold NaN/Inf, or in the loss "
                                                 r"itself .* Check the inputs; for an overflow, use precision='bf16'"):
        _trainer(tmp_path / "fp16", model=_Overflows(), config={"precision": "fp16"}).fit(_data())
    history = _trainer(tmp_path / "bf16", model=_Overflows(), config={"precision": "bf16"}).fit(_data())
    assert history[0]["train_loss"] == history[0]["train_loss"]  # finite


class _Flattens(nn.Module):
    def __init__(self, fix=False):
        super().__init__()
        self.conv, self.fix = nn.Conv2d(1, 2, 3, padding=1), fix
        self.head = nn.Linear(2 * 6 * 6, 2)

    def forward(self, x):
        y = self.conv(x).permute(0, 2, 3, 1)  # NHWC view of the conv's output, as some models take it
        return self.head(y.reshape(len(y), -1) if self.fix else y.view(len(y), -1))


def test_channels_last_is_named_when_a_view_fails_under_it_and_turning_it_off_trains(tmp_path):
    g = torch.Generator().manual_seed(0)
    images = TensorDataset(torch.randn(16, 1, 6, 6, generator=g), torch.randint(0, 2, (16,), generator=g))
    with pytest.raises(RuntimeError) as raised:
        _trainer(tmp_path / "cl", model=_Flattens(), config={"channels_last": False}).fit(images)
    assert "view size is not compatible" in str(raised.value)
    assert not any("channels_last is on" in n for n in raised.value.__notes__)  # not the cause here: not said
    with pytest.raises(RuntimeError) as raised:
        _trainer(tmp_path / "on", model=nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), _View()),
                 config={"channels_last": True}).fit(images)
    assert any("channels_last is on" in n and "channels_last=False" in n for n in raised.value.__notes__)
    _trainer(tmp_path / "off", model=nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), _View()),
             config={"channels_last": False}).fit(images)  # the fix the note names


class _View(nn.Module):
    def forward(self, x):
        return x.view(len(x), -1)[:, :2]


def test_a_class_index_beyond_the_outputs_mid_training_names_the_sample_and_the_class_count(tmp_path):
    data = _data(40)
    bad = list(data.tensors)
    bad[1] = bad[1].clone()
    bad[1][33] = 5  # not in the dry run's first rows: found while training
    with pytest.raises(IndexError) as raised:
        _trainer(tmp_path, sampler=list(range(40)), config={"num_workers": 0}).fit(TensorDataset(*bad))
    note = next(n for n in raised.value.__notes__ if "class index" in n)
    assert "class index 5 is outside 0..1: the model has 2 outputs; sample 33 of the dataset holds it" in note


def test_an_unreadable_checkpoint_under_resume_names_the_older_one_and_the_fix_works(tmp_path):
    trainer = _trainer(tmp_path, config={"epochs": 2})
    trainer.fit(_data())
    newest = sorted((tmp_path / "checkpoints").iterdir())[-1]
    (newest / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"unreadable meta.json.*Nothing was changed.*an older checkpoint "
                                              r"\(--resume .*step-00000010.*or start fresh \(--fresh"):
        _trainer(tmp_path, config={"epochs": 3}).fit(_data(), resume=str(newest))
    older = sorted((tmp_path / "checkpoints").iterdir())[0]
    history = _trainer(tmp_path, config={"epochs": 3}).fit(_data(), resume=str(older))
    assert [r["epoch"] for r in history] == [1, 2, 3]


def test_the_torchrun_hint_names_xlatrains_own_command_line():
    assert torchrun_command(3, ["/venv/bin/xlatrain", "fit", "configs/lm.yaml", "--set", "backend.devices=3"]) == \
        "torchrun --nproc-per-node 3 -m xlatrain.cli fit configs/lm.yaml --set backend.devices=3"
    assert torchrun_command(2, ["train.py", "--lr", "0.1"]) == "torchrun --nproc-per-node 2 train.py --lr 0.1"


def test_an_unresolvable_storage_host_fails_within_seconds_naming_the_network_and_the_credentials(tmp_path):
    import subprocess
    import sys
    import time

    from conftest import script_env

    code = f"""
import torch, xlatrain
from torch import nn
data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
xlatrain.Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.1), backend="cpu",
                 config=xlatrain.TrainConfig(epochs=1, batch_size=4, run_dir="gs://bucket/run")).fit(data)
"""
    env = script_env({"STORAGE_EMULATOR_HOST": "http://no-such-host.invalid:9", "GOOGLE_APPLICATION_CREDENTIALS": "",
                      "HOME": str(tmp_path), "XLATRAIN_CACHE_DIR": str(tmp_path / "cache")})
    env.pop("GOOGLE_APPLICATION_CREDENTIALS")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 60 and proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "the storage server no-such-host.invalid cannot be found" in last and "no network or no DNS" in last
    assert "STORAGE_EMULATOR_HOST" in last and "no credentials file either" in last
    assert "resumes where it stopped" not in proc.stderr  # nothing had started
