"""A user's sampler and collate_fn, the steps an epoch really ran, and callbacks."""

import dataclasses
import functools
import logging
import math

import pytest
import torch
from torch import nn
from torch.utils.data import RandomSampler, Sampler, TensorDataset

from xlatrain import CheckpointConfig, TrainConfig, Trainer
from xlatrain.train.batch import collate

N, DIM, CLASSES, BATCH = 48, 6, 3, 8


def _data(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def _trainer(tmp_path, name="run", loss=None, epochs=2, checkpoint=None, **kwargs):
    return Trainer(
        _model(), loss or nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        config=TrainConfig(epochs=epochs, batch_size=BATCH, run_dir=str(tmp_path / name), log_every=2,
                           diagnostics=False, tensorboard=False),
        checkpoint=checkpoint, backend="cpu", **kwargs,
    )


class ListSampler(Sampler):
    """Yields a fixed list of indices per epoch (``orders[epoch]``, by set_epoch), and says a length."""

    def __init__(self, orders, says):
        self.orders, self.says, self.epoch = orders, says, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(self.orders[min(self.epoch, len(self.orders) - 1)])

    def __len__(self):
        return self.says


def _hand_losses(orders, epochs, collate=None, optimizer_fn=None):
    """The loop a user writes: the same model, optimizer and batches, in the sampler's order."""
    model = _model()
    opt = optimizer_fn(model) if optimizer_fn else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = _data()
    per_epoch = []
    for epoch in range(epochs):
        order = orders[min(epoch, len(orders) - 1)]
        losses = []
        for start in range(0, len(order) // BATCH * BATCH, BATCH):
            x, y = (collate or (lambda items: tuple(torch.stack(c) for c in zip(*items))))(
                [data[i] for i in order[start:start + BATCH]])
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        per_epoch.append(sum(losses) / len(losses))
    return per_epoch


def test_a_sampler_sets_the_order_and_the_steps_and_a_shorter_epoch_is_said_with_its_true_mean(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    # Epoch 1: 40 indices (5 steps), in an order of the sampler's own; epoch 2: 24 (3 steps).
    # len() says 48 samples: 6 steps, which neither epoch gives.
    first = [(7 * i) % N for i in range(40)]
    second = list(range(N - 1, N - 25, -1))
    history = _trainer(tmp_path, sampler=ListSampler([first, second], says=N)).fit(_data())
    expected = _hand_losses([first, second], 2)
    assert [row["train_loss"] for row in history] == pytest.approx(expected, rel=1e-5)
    out = caplog.text
    assert "5 optimizer steps per epoch" in out
    assert "the sampler's len() is 48 but it gave 40 indices in epoch 1" in out
    assert "epoch 2 ran 3 step(s), but 5 were announced" in out
    assert "epoch 1 ran" not in out


def test_the_samples_a_users_sampler_leaves_out_of_full_steps_are_said(tmp_path, caplog):
    """WeightedRandomSampler(num_samples=30) with batches of 4 and 3 micro-batches a step trained 24
    of its 30 draws, unsaid (the Trainer's own sampler says its leftovers)."""
    caplog.set_level(logging.INFO, logger="xlatrain")
    sampler = torch.utils.data.WeightedRandomSampler(torch.ones(N), num_samples=30)
    trainer = Trainer(_model(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), sampler=sampler,
                      config=TrainConfig(epochs=1, batch_size=4, grad_accum_steps=3, run_dir=str(tmp_path),
                                         tensorboard=False), backend="cpu")
    trainer.fit(_data())
    assert "note: the sampler's 30 indices in epoch 1 make 6 full batches of 4, so that every step has the same shape " \
           "and every optimizer step its 3 micro-batches: the 6 after them are not trained on in that epoch" in caplog.text
    assert "len() is" not in caplog.text  # its length says what it gives
    assert "never trained on" not in caplog.text  # a random draw: other samples each epoch
    # A SequentialSampler gives the same order every epoch: its tail is never trained on at all.
    caplog.clear()
    trainer = Trainer(_model(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                      sampler=torch.utils.data.SequentialSampler(range(30)),
                      config=TrainConfig(epochs=1, batch_size=4, grad_accum_steps=3, run_dir=str(tmp_path / "seq"),
                                         tensorboard=False), backend="cpu")
    trainer.fit(_data())
    assert "the 6 after them are not trained on in that epoch (SequentialSampler gives the same order every epoch: " \
           "those 6 are never trained on)" in caplog.text


def test_a_later_epoch_of_a_sampler_that_gives_more_is_said_with_the_count_it_gave(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    first, more = list(range(40)), list(range(N)) + list(range(16))  # 5 steps, then 64 indices: 8 steps
    history = _trainer(tmp_path, sampler=ListSampler([first, more], says=40)).fit(_data())
    assert [row["train_loss"] for row in history] == pytest.approx(_hand_losses([first, more[:40]], 2), rel=1e-5)
    assert "epoch 2 ran the 5 step(s) announced from the data's length, but the sampler gave 8 batches: the " \
           "batches after step 5 were not trained on" in caplog.text


def test_an_unseeded_random_sampler_gives_the_same_epochs_again_and_resumes_mid_epoch_exactly(tmp_path):
    # RandomSampler draws from torch's global generator: the Trainer seeds it per epoch, so two
    # runs read the same orders, and a run resumed from a mid-epoch checkpoint ends as the whole run.
    every = CheckpointConfig(every_steps=2, keep_last=100)
    whole = _trainer(tmp_path, "whole", sampler=RandomSampler(_data()), checkpoint=every).fit(_data())
    again = _trainer(tmp_path, "again", sampler=RandomSampler(_data())).fit(_data())
    assert [r["train_loss"] for r in again] == [r["train_loss"] for r in whole]
    mid = sorted((tmp_path / "whole" / "checkpoints").glob("step-*"))[3]  # step 8: epoch 2, step 2 of 6
    resumed = _trainer(tmp_path, "resumed", sampler=RandomSampler(_data())).fit(_data(), resume=str(mid))
    assert resumed[-1]["train_loss"] == pytest.approx(whole[-1]["train_loss"], rel=1e-6)
    # And not the order the Trainer uses without a sampler.
    plain = _trainer(tmp_path, "plain").fit(_data())
    assert plain[0]["train_loss"] != whole[0]["train_loss"]


def test_a_sampler_factory_builds_this_process_sampler(tmp_path):
    built = []

    def factory(dataset, num_replicas, rank):
        built.append((len(dataset), num_replicas, rank))
        return torch.utils.data.DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)

    _trainer(tmp_path, sampler=factory, epochs=1).fit(_data())
    assert built == [(N, 1, 0)]
    with pytest.raises(ValueError, match="gave index 99 in epoch 1, outside the training set's 0..47"):
        _trainer(tmp_path, "bad", sampler=[0, 1, 99] * 8).fit(_data())


def test_collate_fn_makes_the_training_batches_and_the_dry_run_goes_through_it(tmp_path):
    seen = []

    def soft(items):  # label smoothing in the collate, as mixup/cutmix make soft N x C targets
        x = torch.stack([i[0] for i in items])
        y = nn.functional.one_hot(torch.stack([i[1] for i in items]), CLASSES).float() * 0.8 + 0.2 / CLASSES
        return x, y

    def loss(outputs, targets):
        seen.append((tuple(targets.shape), targets.dtype))
        return nn.functional.cross_entropy(outputs, targets)

    order = list(range(N))
    # A collate that changes the targets is for training only: evaluation stacks items as they are.
    history = _trainer(tmp_path, loss=loss, collate_fn=soft, eval_collate_fn=collate, sampler=order).fit(
        _data(), _data(16, seed=1))
    # Training saw soft targets (the dry run's 2 rows first), validation the dataset's class indices.
    assert seen[0] == ((2, CLASSES), torch.float32)
    assert ((BATCH, CLASSES), torch.float32) in seen and ((2,), torch.int64) in seen

    # The loop a user writes, with the same collate: the same losses.
    assert [r["train_loss"] for r in history] == pytest.approx(_hand_losses([order], 2, collate=soft), rel=1e-5)

    def wrong(items):  # targets of another length than the outputs: caught before any step
        x, y = soft(items)
        return x, y[:, :2]

    with pytest.raises(ValueError, match="dry run on one training batch"):
        _trainer(tmp_path, "wrong", collate_fn=wrong).fit(_data())
    assert not (tmp_path / "wrong" / "history.json").exists()


class Recorder:
    def __init__(self):
        self.calls = []

    def on_fit_start(self, trainer):
        self.calls.append(("fit_start", trainer.is_main))

    def on_interval(self, trainer, values):
        self.calls.append(("interval", values))

    def on_epoch_end(self, trainer, row):
        self.calls.append(("epoch_end", dict(row)))

    def on_checkpoint(self, trainer, path):
        self.calls.append(("checkpoint", path, path.exists()))

    def on_fit_end(self, trainer, history):
        self.calls.append(("fit_end", len(history)))


class StopAfter:
    """Only one hook: the others are skipped."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, trainer, row):
        if row["epoch"] == self.epoch:
            trainer.request_stop(f"enough after epoch {self.epoch}")


def test_callbacks_hear_each_point_of_the_run_with_host_values_and_can_stop_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    rec = Recorder()
    trainer = _trainer(tmp_path, epochs=5, callbacks=[rec, StopAfter(2)])
    history = trainer.fit(_data(), _data(16, seed=1))
    assert len(history) == 2
    assert "stopped after epoch 2: enough after epoch 2 (request_stop)" in caplog.text
    kinds = [c[0] for c in rec.calls]
    assert kinds[0] == "fit_start" and rec.calls[0][1] is True and kinds[-1] == "fit_end"
    assert rec.calls[-1] == ("fit_end", 2)
    # Per epoch of 6 steps logged every 2: intervals at steps 2, 4 and the last, 6 (heard from the
    # epoch-end read), then the epoch's checkpoint and its end, whose row is the history's.
    assert kinds[1:-1] == ["interval", "interval", "interval", "checkpoint", "epoch_end"] * 2
    intervals = [c[1] for c in rec.calls if c[0] == "interval"]
    assert [(v["epoch"], v["step"]) for v in intervals] == [(1, 2), (1, 4), (1, 6), (2, 2), (2, 4), (2, 6)]
    for v in intervals:
        assert all(isinstance(v[k], float) for k in ("loss", "lr")), v
    # The fit's first interval holds its warm-up steps: no rate; every later one has one.
    assert intervals[0]["samples_per_s"] is None and all(isinstance(v["samples_per_s"], float) for v in intervals[1:])
    assert [c[1] for c in rec.calls if c[0] == "epoch_end"] == history
    checkpoints = [c for c in rec.calls if c[0] == "checkpoint"]
    assert all(exists for _, _, exists in checkpoints)
    assert [p.name for _, p, _ in checkpoints] == ["step-00000006", "step-00000012"]
    # The stopped run resumes, and trains on to its last epoch.
    more = _trainer(tmp_path, epochs=5).fit(_data(), _data(16, seed=1))
    assert [r["epoch"] for r in more] == [1, 2, 3, 4, 5]


def test_progress_tensorboard_and_callbacks_show_the_same_interval_figures(tmp_path, caplog):
    """xlatrain's own observers hear the points the user's callbacks hear, with the same values:
    the progress line's loss is the callback's epoch_loss, TensorBoard's point its interval loss."""
    from tensorboard.backend.event_processing import event_accumulator

    caplog.set_level(logging.INFO, logger="xlatrain")
    rec = Recorder()
    trainer = _trainer(tmp_path, epochs=2, callbacks=[rec])
    trainer.config = dataclasses.replace(trainer.config, tensorboard=True)
    trainer.fit(_data())
    intervals = [c[1] for c in rec.calls if c[0] == "interval"]
    assert len(intervals) == 6
    for v in intervals:
        if v["step"] < 6:  # the epoch's last interval is said by its epoch line
            assert f"epoch {v['epoch']} step {v['step']}/6  loss {v['epoch_loss']:.4f}" in caplog.text
        assert v["nonfinite_steps"] == 0
    # The epoch mean so far and the interval's own mean differ after the first interval.
    assert intervals[1]["epoch_loss"] != pytest.approx(intervals[1]["loss"])
    acc = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    points = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert points == [(v["global_step"], pytest.approx(v["loss"], rel=1e-6)) for v in intervals]


class _FailsFromEpoch:
    """A dataset whose items raise once epoch ``epoch`` starts (a callback tells it), at its
    ``after``-th item of that epoch."""

    def __init__(self, data, epoch, after):
        self.data, self.epoch, self.after, self.now, self.read = data, epoch, after, 0, 0

    def on_epoch_start(self, trainer, epoch):
        self.now, self.read = epoch, 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        if self.now == self.epoch:
            self.read += 1
            if self.read > self.after:
                raise KeyError(f"scan_{index:04d}.png")
        return self.data[index]


def test_an_item_that_fails_in_training_says_its_epoch_and_step(tmp_path):
    # runs.md: an error raised in the dataset adds which sample, batch, epoch and step
    data = _FailsFromEpoch(_data(), epoch=2, after=2 * BATCH)  # the third batch of epoch 2
    trainer = _trainer(tmp_path, callbacks=[data])
    with pytest.raises(KeyError) as caught:
        trainer.fit(data)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "raised while loading the training batch of epoch 2 step 3" in notes, notes
    assert "raised by _FailsFromEpoch.__getitem__(" in notes, notes


class _FixedBatch(nn.Module):
    """A model written for its batch size (state sized by it, an RNN-tutorial habit)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, CLASSES)
        self.register_buffer("h0", torch.zeros(BATCH, DIM))

    def forward(self, x):
        return self.fc(x.view(BATCH, -1) + self.h0)


def test_a_model_written_for_its_batch_size_passes_the_checks_before_training(tmp_path):
    # Training batches are full and evaluation pads each batch to its size, so it trains and is
    # scored; the dry runs failed it on 2 and 4 rows, calling that "one training batch".
    trainer = Trainer(_FixedBatch(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                      config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=str(tmp_path / "run"), tensorboard=False),
                      backend="cpu")
    row = trainer.fit(_data(), _data(13, seed=1))[-1]
    assert row["train_loss"] > 0 and 0 <= row["val_accuracy"] <= 1
    # A validation set smaller than one batch is padded to a full one, in the dry run as in evaluation.
    trainer = Trainer(_FixedBatch(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                      config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=str(tmp_path / "small"), tensorboard=False),
                      backend="cpu")
    assert 0 <= trainer.fit(_data(), _data(5, seed=2))[-1]["val_accuracy"] <= 1


class _FixedBatchOwnLoss(_FixedBatch):
    def forward(self, x, y):
        return {"loss": nn.functional.cross_entropy(super().forward(x), y)}


def test_a_model_written_for_its_batch_size_on_its_own_loss_with_a_partial_last_batch_is_refused_before_training(tmp_path):
    # Its own loss cannot leave padding rows out, so evaluation cuts them: a last batch of 5 rows
    # failed at the first evaluation, after epoch 1 had trained.
    def fit(model, loss_fn, val):
        trainer = Trainer(model, loss_fn, functools.partial(torch.optim.SGD, lr=0.1),
                          config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=str(tmp_path / "run"),
                                             tensorboard=False), backend="cpu")
        return trainer.fit(_data(), val)

    with pytest.raises(ValueError, match=rf"takes a full batch of {BATCH} rows but failed on 5 .*ends with a batch of 5 "
                                         rf"real row\(s\).*Pass a loss_fn.*multiple of {BATCH}") as caught:
        fit(_FixedBatchOwnLoss(), None, _data(BATCH + 5, seed=1))
    assert "before training" in str(caught.value)
    assert not (tmp_path / "run" / "history.json").exists()
    # The fixes it names work: a set of whole batches, or a loss_fn (padding rows masked, not cut).
    assert fit(_FixedBatchOwnLoss(), None, _data(2 * BATCH, seed=1))[-1]["val_loss"] > 0
    assert fit(_FixedBatch(), nn.CrossEntropyLoss(), _data(BATCH + 5, seed=1))[-1]["val_loss"] > 0


@pytest.mark.multiprocess
def test_under_torchrun_a_model_written_for_its_batch_size_is_checked_on_every_process(tmp_path):
    # The validation dry run gave the set's first batch to process 0 alone, so process 1 ran the
    # model on 1 padding row and failed, even for a set of whole batches.
    import shutil
    import sys
    from pathlib import Path

    from conftest import SCRIPTS, run_bounded, script_env

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    for n, ok in ((32, True), (24, False)):
        proc = run_bounded([torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
                            str(SCRIPTS / "fixed_batch_fit.py"), str(n), str(tmp_path / str(n))], script_env(), 240)
        assert (proc.returncode == 0) is ok, proc.stdout + proc.stderr[-3000:]
        lines = [(tmp_path / f"{n}-{rank}.txt").read_text() for rank in (0, 1)]
        assert all(ln.startswith("OK ") is ok for ln in lines), lines
        if not ok:
            assert all("ends with a batch of no real row" in ln and "multiple of 16" in ln for ln in lines), lines


def test_a_callback_without_any_hook_is_refused_at_once(tmp_path):
    with pytest.raises(TypeError, match="has none of the methods on_fit_start"):
        _trainer(tmp_path, callbacks=[object()])


# --- under torchrun: a shared order split over processes, and per-process samplers -----------

def _sampler_fit(tmp_path, name, mode, batch, processes):
    import json
    import shutil
    import sys
    from pathlib import Path

    from conftest import SCRIPTS, job_outputs, run_command

    launcher = [sys.executable] if processes == 1 else [
        shutil.which("torchrun", path=str(Path(sys.executable).parent)),
        "--nproc-per-node", str(processes), "--master-port", "0", "--standalone"]
    proc = run_command([*launcher, str(SCRIPTS / "sampler_fit.py"), str(tmp_path / name), mode, str(batch)], timeout=300)

    def parse(out):
        found = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("HISTORY ", "READ ")))
        return json.loads(found["HISTORY"]), json.loads(found["READ"])

    if "," not in mode:
        return parse(proc.stdout)
    # Several modes in one launch: each one's lines follow its "JOB MODE" line.
    modes = mode.split(",")
    return dict(zip(modes, map(parse, job_outputs(proc.stdout, modes))))


@pytest.mark.multiprocess
def test_under_ddp_a_shared_order_is_split_over_processes_and_per_process_samplers_agree_on_the_steps(tmp_path):
    order = [(37 * i) % 64 for i in range(64)][::-1]
    alone, _ = _sampler_fit(tmp_path, "alone", "shared", 16, 1)
    # The three two-process fits in one torchrun launch.
    fits = _sampler_fit(tmp_path, "two", "shared,factory,uneven", 8, 2)
    two, reads = fits["shared"]
    # The same global batches in the same order: two processes train as one does.
    assert [r["train_loss"] for r in two] == pytest.approx([r["train_loss"] for r in alone], rel=1e-5)
    for rank, read in enumerate(reads):  # the last 2 epochs x 4 steps x 8 are the training reads
        mine = [i for step in range(4) for i in order[step * 16 + rank * 8: step * 16 + rank * 8 + 8]]
        assert read[-64:] == mine * 2
    # DistributedSampler built for each process: each reads its own indices.
    _, reads = fits["factory"]
    for rank, read in enumerate(reads):
        assert read[-64:] == list(range(rank, 64, 2)) * 2
    # Rank 1's sampler gives 16 indices, rank 0's 24: both run 2 steps an epoch, and nothing waits.
    history, reads = fits["uneven"]
    assert len(history) == 2
    assert reads[0][-32:] == list(range(0, 32, 2)) * 2
    assert reads[1][-32:] == list(range(1, 32, 2)) * 2


# --- top-k accuracy and soft targets ---------------------------------------------------------

def test_top_k_accuracy_is_reported_with_the_others_and_soft_targets_score_as_their_likeliest_class(tmp_path):
    classes, n = 6, 40
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, DIM, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    torch.manual_seed(0)
    model = nn.Linear(DIM, classes)  # untrained: top-1 is low, top-k higher
    trainer = Trainer(model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.0),
                      config=TrainConfig(batch_size=BATCH, run_dir=str(tmp_path / "r"), top_k=(3, 6)), backend="cpu")
    metrics = trainer.evaluate(TensorDataset(x, y))
    with torch.no_grad():
        ranked = model(x).topk(3, dim=1).indices
    assert metrics["accuracy"] == pytest.approx(float((ranked[:, 0] == y).float().mean()))
    assert metrics["top3_accuracy"] == pytest.approx(float((ranked == y[:, None]).any(1).float().mean()))
    assert metrics["top6_accuracy"] == 1.0  # every class is among all six
    assert metrics["accuracy"] <= metrics["top3_accuracy"] < 1.0
    # The same set with class probabilities as targets: scored against their likeliest class.
    soft = nn.functional.one_hot(y, classes).float() * 0.7 + 0.3 / classes
    again = trainer.evaluate(TensorDataset(x, soft))
    assert again["accuracy"] == metrics["accuracy"] and again["top3_accuracy"] == metrics["top3_accuracy"]
    with pytest.raises(ValueError, match="top_k=\\(3, 7\\) asks for top-7 accuracy, but the model has 6 outputs"):
        Trainer(nn.Linear(DIM, classes), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.0),
                config=TrainConfig(batch_size=BATCH, run_dir=str(tmp_path / "r7"), top_k=(3, 7)),
                backend="cpu").fit(TensorDataset(x, y), TensorDataset(x, y))
    with pytest.raises(ValueError, match="top_k=0 is not valid"):
        TrainConfig(top_k=0)


def test_soft_targets_reach_metrics_as_their_likeliest_class_and_multi_hot_ones_under_classification_are_refused(tmp_path):
    # Accuracy counts a probability row's likeliest class, and so do the metrics after it: a
    # torchmetrics classifier takes class indices (given the probabilities, it failed after epoch 1).
    classes = 4
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, DIM, generator=g), torch.randint(0, classes, (32,), generator=g)
    soft = nn.functional.one_hot(y, classes).float() * 0.8 + 0.2 / classes
    seen = []

    def metrics_fn(outputs, targets):
        seen.append(targets)
        return {"hits": float((outputs.argmax(dim=1) == targets).float().mean())}

    trainer = Trainer(nn.Linear(DIM, classes), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.0),
                      config=TrainConfig(batch_size=BATCH, task="classification", run_dir=str(tmp_path / "soft")),
                      backend="cpu", metrics_fn=metrics_fn)
    metrics = trainer.evaluate(TensorDataset(x, soft))
    assert torch.equal(seen[-1], y) and metrics["hits"] == metrics["accuracy"]
    # Several labels a row: accuracy over one class cannot score them, and said before training.
    multi_hot = (torch.rand(32, classes, generator=g) > 0.5).float()
    multi_hot[:2] = torch.tensor([[1.0, 1, 0, 0], [0, 0, 0, 0]])  # the dry run's rows: not one-hot
    trainer = Trainer(nn.Linear(DIM, classes), nn.BCEWithLogitsLoss(), functools.partial(torch.optim.SGD, lr=0.0),
                      config=TrainConfig(batch_size=BATCH, task="classification", run_dir=str(tmp_path / "multi")),
                      backend="cpu")
    with pytest.raises(ValueError, match=r"task='classification' was set, but the targets \(\d+, 4\) are multi-hot.*"
                                         r"set task='multilabel'"):
        trainer.fit(TensorDataset(x, multi_hot), TensorDataset(x, multi_hot))
    assert not (tmp_path / "multi" / "history.json").exists()


def test_accuracy_and_top_k_leave_out_targets_a_cross_entropy_ignores_as_the_loss_does(tmp_path):
    # Rows whose target is -100 (CrossEntropyLoss's ignore_index, a Hugging Face label mask) are left
    # out of val_loss; they were counted as wrong in val_accuracy (4/37 where 4/29 is right).
    classes, n = 5, 37  # batches of 8: the last has 5 rows, and padding rows on the device
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, DIM, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    ignored = torch.tensor([0, 3, 9, 16, 17, 30, 33, 36])  # 8 of 37, three of them in the partial last batch
    y[ignored] = -100
    kept = y != -100
    seen = []

    def metrics_fn(outputs, targets):
        seen.append(targets)
        return {"rows": float(len(targets))}

    torch.manual_seed(0)
    model = nn.Linear(DIM, classes)
    trainer = Trainer(model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                      config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=str(tmp_path / "r"), top_k=(2,),
                                         diagnostics=False, tensorboard=False),
                      backend="cpu", metrics_fn=metrics_fn)
    history = trainer.fit(TensorDataset(x, y.clamp(min=0)), TensorDataset(x, y))
    with torch.no_grad():
        logits = model(x)
    ranked = logits.topk(2, dim=1).indices
    by_hand = float((ranked[kept, 0] == y[kept]).float().mean())
    top2_by_hand = float((ranked[kept] == y[kept, None]).any(1).float().mean())
    assert history[-1]["val_accuracy"] == pytest.approx(by_hand)
    assert history[-1]["val_top2_accuracy"] == pytest.approx(top2_by_hand)
    assert history[-1]["val_loss"] == pytest.approx(float(nn.functional.cross_entropy(logits, y)), rel=1e-5)
    metrics = trainer.evaluate(TensorDataset(x, y))
    assert metrics["accuracy"] == pytest.approx(by_hand) and metrics["top2_accuracy"] == pytest.approx(top2_by_hand)
    assert metrics["num_samples"] == n  # every real row is a sample; only accuracy's count leaves some out
    assert torch.equal(seen[-1], y)  # metrics_fn gets the targets as the dataset has them, -100s too
    # Every target ignored: no row to score, and accuracy says so rather than 0.
    every = trainer.evaluate(TensorDataset(x, torch.full((n,), -100)))
    assert math.isnan(every["accuracy"]) and math.isnan(every["top2_accuracy"])


# --- an EMA of the weights ---------------------------------------------------------------------

def _ema_trainer(tmp_path, name, checkpoint=None, epochs=2, **cfg):
    return Trainer(
        _model(), nn.CrossEntropyLoss(), functools.partial(torch.optim.Adam, lr=0.01),
        config=TrainConfig(epochs=epochs, batch_size=BATCH, run_dir=str(tmp_path / name), log_every=1000,
                           ema_decay=0.9, ema_every=2, tensorboard=False, **cfg),
        checkpoint=checkpoint, backend="cpu", sampler=list(range(N)),
    )


def test_the_ema_is_what_its_formula_gives_is_scored_beside_the_model_and_survives_resume(tmp_path):
    from xlatrain import load_weights
    from safetensors.torch import load_file

    every = CheckpointConfig(every_steps=1, keep_last=100)
    history = _ema_trainer(tmp_path, "whole", checkpoint=every).fit(_data(), _data(16, seed=1))
    # By hand: the same steps; the first optimizer step's weights start the average, then every
    # 2nd step ema = 0.9 ema + 0.1 w.
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data, ema, step = _data(), None, 0
    for _ in range(2):
        for start in range(0, N, BATCH):
            x, y = (torch.stack(c) for c in zip(*[data[i] for i in range(start, start + BATCH)]))
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            w = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if ema is None:
                ema = w
            elif step % 2 == 0:
                ema = {k: 0.9 * ema[k] + 0.1 * w[k] for k in w}
    saved = load_file(str(tmp_path / "whole" / "ema.safetensors"))
    assert saved.keys() == ema.keys()
    for k in ema:
        torch.testing.assert_close(saved[k], ema[k], rtol=1e-5, atol=1e-6)
        assert not torch.equal(saved[k], model.state_dict()[k])  # the average, not the last weights
    # Scored beside the live model: val_ema_loss is the EMA weights' loss on the validation set.
    row = history[-1]
    assert {"val_loss", "val_accuracy", "val_ema_loss", "val_ema_accuracy"} <= set(row)
    scored = _model()
    load_weights(scored, tmp_path / "whole" / "ema.safetensors")
    with torch.no_grad():
        vx, vy = _data(16, seed=1).tensors
        assert row["val_ema_loss"] == pytest.approx(float(nn.functional.cross_entropy(scored(vx), vy)), rel=1e-5)
    # Resumed from a checkpoint mid-epoch 2 (step 9 of 12): the same average at the end.
    mid = tmp_path / "whole" / "checkpoints" / "step-00000009"
    _ema_trainer(tmp_path, "resumed").fit(_data(), _data(16, seed=1), resume=str(mid))
    resumed = load_file(str(tmp_path / "resumed" / "ema.safetensors"))
    for k in ema:
        torch.testing.assert_close(resumed[k], saved[k], rtol=1e-6, atol=1e-7)


def test_monitoring_an_ema_column_makes_the_best_weights_the_ema(tmp_path):
    from safetensors.torch import load_file

    _ema_trainer(tmp_path, "m", epochs=1, monitor="val_ema_loss").fit(_data(), _data(16, seed=1))
    best = load_file(str(tmp_path / "m" / "best.safetensors"))
    ema = load_file(str(tmp_path / "m" / "ema.safetensors"))
    assert all(torch.equal(best[k], ema[k]) for k in ema)
    with pytest.raises(ValueError, match="ema_decay=1.5 is not valid"):
        TrainConfig(ema_decay=1.5)


# --- float16 with a gradient scaler ------------------------------------------------------------

def _fp16_trainer(tmp_path, name, epochs, precision="fp16"):
    # A summed loss: its gradients, times the scaler's first scale (65536), overflow float16.
    return Trainer(
        _model(), nn.CrossEntropyLoss(reduction="sum"), functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9),
        config=TrainConfig(epochs=epochs, batch_size=BATCH, run_dir=str(tmp_path / name), log_every=1000,
                           precision=precision, tensorboard=False),
        backend="cpu",
    )


def test_fp16_scales_the_loss_skips_overflowed_steps_and_resumes_with_its_scale(tmp_path):
    import json

    trainer = _fp16_trainer(tmp_path, "whole", 2)
    history = trainer.fit(_data(), _data(16, seed=1))
    fp32 = _fp16_trainer(tmp_path, "fp32", 2, precision="32").fit(_data(), _data(16, seed=1))
    # Computed in float16 (not the float32 run's numbers), trained all the same, weights float32.
    assert history[0]["train_loss"] != fp32[0]["train_loss"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    # MFU's yardstick is the float16 peak: none on a CPU (no fast float16 kernels), not float32's.
    assert trainer.throughput.dtype == "float16" and trainer.throughput.peak_per_device is None
    assert "mfu" not in history[0]
    # The scaler ran: the first steps' scaled gradients overflowed float16, so it lowered its
    # scale from 65536 (a float32 loop would never skip them) and saved it with the checkpoint.
    scale = trainer.grad_scaler.get_scale()
    assert scale < 65536.0
    saved = json.loads((tmp_path / "whole" / "checkpoints" / "step-00000012" / "meta.json").read_text())
    assert saved["grad_scaler"]["scale"] == scale
    # Stopped after epoch 1 and resumed: the scale comes back, and epoch 2 is the same.
    _fp16_trainer(tmp_path, "split", 1).fit(_data(), _data(16, seed=1))
    resumed = _fp16_trainer(tmp_path, "split", 2)
    again = resumed.fit(_data(), _data(16, seed=1))
    assert again[-1]["train_loss"] == history[-1]["train_loss"]
    assert resumed.grad_scaler.get_scale() == scale


# --- batches on the device: a user's transform, channels-last memory order ---------------------

def test_batch_transform_reaches_every_batch_on_the_device(tmp_path):
    calls = []

    def double(batch):  # normalisation on the accelerator
        calls.append(batch[0].device.type)
        return batch[0] * 2, batch[1]

    data, val = _data(), _data(16, seed=1)
    moved = TensorDataset(data.tensors[0] * 2, data.tensors[1])
    moved_val = TensorDataset(val.tensors[0] * 2, val.tensors[1])
    trainer = _trainer(tmp_path, "t", batch_transform=double)
    history = trainer.fit(data, val)
    plain = _trainer(tmp_path, "p")
    expected = plain.fit(moved, moved_val)
    for a, b in zip(history, expected):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-6)
    assert torch.allclose(trainer.predict(val), plain.predict(moved_val), rtol=1e-6, atol=1e-7)
    assert set(calls) == {"cpu"} and len(calls) > 2 * (N // BATCH)


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, CLASSES)
        self.formats = set()

    def forward(self, x):
        self.formats.add(x.is_contiguous(memory_format=torch.channels_last))
        return self.head(self.conv(x).mean(dim=(2, 3)))


def test_channels_last_puts_the_model_and_the_image_batches_in_that_memory_order(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    g = torch.Generator().manual_seed(0)
    images = TensorDataset(torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, CLASSES, (32,), generator=g))
    runs = {}
    for fmt in (False, True):
        model = Probe()
        trainer = Trainer(model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                          config=TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path / str(fmt)), channels_last=fmt,
                                             tensorboard=False), backend="cpu")
        runs[fmt] = trainer.fit(images, images)
        assert model.formats == {fmt}
        assert model.conv.weight.is_contiguous(memory_format=torch.channels_last) == fmt
        assert f"channels_last {'on' if fmt else 'off'} (as configured)" in caplog.text  # the header says which
    assert runs[True][0]["train_loss"] == pytest.approx(runs[False][0]["train_loss"], rel=1e-5)



@pytest.mark.multiprocess
@pytest.mark.parametrize("accum", [1, 2])
def test_skip_step_skips_on_every_process_when_one_finds_its_loss_non_finite(tmp_path, accum):
    """Rank 1 alone has a NaN loss (its gradients finite): the step is skipped on both processes,
    so their weights stay equal, and the skipped step is counted once, not once per process."""
    import json
    import shutil
    import sys
    from pathlib import Path

    from conftest import SCRIPTS, run_command

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    run_command([torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
                 str(SCRIPTS / "skip_agree.py"), str(tmp_path), str(accum)], timeout=300)
    ranks = [json.loads((tmp_path / f"skip-{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["row"]["nonfinite_steps"] == accum  # one optimizer step: its micro-batches, once
    assert ranks[0]["row"]["train_loss"] == ranks[1]["row"]["train_loss"] < float("inf")


@pytest.mark.multiprocess
def test_a_stop_on_several_processes_counts_losses_not_steps(tmp_path):
    """nan_policy='stop' with rank 1's loss NaN at one step: each process's count is summed, so
    the error says how many losses over how many processes, where it said '2 step(s)' for the
    same step seen by two processes, more steps than the range could hold."""
    import shutil
    import sys
    from pathlib import Path

    from conftest import SCRIPTS, run_command

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    run_command([torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
                 str(SCRIPTS / "skip_agree.py"), str(tmp_path), "1", "stop"], timeout=300)
    messages = [(tmp_path / f"stop-{rank}.txt").read_text() for rank in (0, 1)]
    assert messages[0] == messages[1]
    assert "NaN/Inf 1 time(s) over 2 processes (each process's loss at each step counted)" in messages[0], messages[0]

@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_process_makes_the_same_host_reads(tmp_path, strategy):
    # On TorchTPU a host read made by some processes and not others deadlocks the mesh: each read
    # the Trainer plans (progress, epoch sums, checkpoints, best weights, EMA, evaluation,
    # prediction) is made on every process, in the same order.
    import json
    import shutil
    import sys
    from pathlib import Path

    from conftest import SCRIPTS, run_command

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    run_command([torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
                 str(SCRIPTS / "reads_per_rank.py"), str(tmp_path), strategy], timeout=300)
    reads = [json.loads((tmp_path / f"reads-{rank}.json").read_text()) for rank in (0, 1)]
    assert len(reads[0]) > 20 and any("defer" in r for r in reads[0])
    assert reads[0] == reads[1]


@pytest.mark.xla
def test_under_spmd_a_shared_order_gives_the_global_batches_of_one_cpu_process(tmp_path):
    import json
    import sys

    from conftest import SCRIPTS, run_command

    def fit(name, batch, *where, env=None):
        proc = run_command([sys.executable, str(SCRIPTS / "sampler_fit.py"), str(tmp_path / name), "shared", str(batch),
                            *where], env=env, timeout=600)
        found = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("HISTORY ", "READ ")))
        return json.loads(found["HISTORY"]), json.loads(found["READ"])

    spmd, reads = fit("spmd", 4, "xla", env={"PJRT_DEVICE": "CPU"})  # 4 devices x 4 = global batch 16
    cpu, _ = fit("cpu", 16)
    assert [r["train_loss"] for r in spmd] == pytest.approx([r["train_loss"] for r in cpu], rel=1e-4)
    order = [(37 * i) % 64 for i in range(64)][::-1]
    assert reads[0][-128:] == order * 2  # one process reads every global batch, in the sampler's order


def test_an_ema_waits_for_the_first_step_the_scaler_did_not_skip(tmp_path):
    # fp16 with a summed loss: the first steps overflow and the scaler skips them, so Adam has no
    # state yet; the average must not be the first entry in it (Adam would take it for its own).
    trainer = Trainer(
        _model(), nn.CrossEntropyLoss(reduction="sum"), functools.partial(torch.optim.Adam, lr=0.01),
        config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=str(tmp_path / "r"), precision="fp16", ema_decay=0.9,
                           tensorboard=False), backend="cpu",
    )
    history = trainer.fit(_data(), _data(16, seed=1))
    assert trainer.grad_scaler.get_scale() < 65536.0  # steps were skipped
    state = next(iter(trainer.optimizer.state.values()))
    assert {"step", "exp_avg", "exp_avg_sq", "xlatrain_ema"} <= set(state)
    assert history[0]["val_ema_loss"] != history[0]["val_loss"]


def _no_decay_for_biases(params):
    """torchvision's recipe (--bias-weight-decay 0): biases in a group of their own without weight
    decay, found by name on what the factory is given."""
    decay = [p for name, p in params.named_parameters() if not name.endswith("bias")]
    no_decay = [p for name, p in params.named_parameters() if name.endswith("bias")]
    return torch.optim.SGD([{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}],
                           lr=0.1, momentum=0.9)


def test_the_optimizer_factory_builds_groups_by_name_and_the_no_decay_group_steps_without_decay(tmp_path):
    order = [(5 * i) % N for i in range(N)]
    trainer = Trainer(
        _model(), nn.CrossEntropyLoss(), _no_decay_for_biases,
        config=TrainConfig(epochs=2, batch_size=BATCH, run_dir=str(tmp_path / "run"), diagnostics=False,
                           tensorboard=False),
        backend="cpu", sampler=ListSampler([order], says=N))
    history = trainer.fit(_data())
    decay, no_decay = trainer.optimizer.param_groups
    named = dict(trainer.strategy.unwrap(trainer.model).named_parameters())
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.5
    assert {id(p) for p in no_decay["params"]} == {id(p) for n, p in named.items() if n.endswith("bias")}
    assert {id(p) for p in decay["params"]} == {id(p) for n, p in named.items() if n.endswith("weight")}
    # The groups reach the steps: the losses are the hand loop's with the same groups, not those
    # of one group that decays everything.
    expected = _hand_losses([order], 2, optimizer_fn=_no_decay_for_biases)
    assert [row["train_loss"] for row in history] == pytest.approx(expected, rel=1e-5)
    everything = _hand_losses([order], 2, optimizer_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9,
                                                                                  weight_decay=0.5))
    assert history[1]["train_loss"] != pytest.approx(everything[1], rel=1e-4)


class CountedSource:
    """A BatchSource whose epochs yield ``yields`` batches of BATCH rows, whatever its length says."""

    def __init__(self, yields):
        self.yields, self.data, self.asked = yields, _data(), []

    def __len__(self):
        return N  # announces N // BATCH = 6 steps

    def batches(self, epoch):
        order = [(7 * i + epoch) % N for i in range(N)] * 2
        return [order[k * BATCH:(k + 1) * BATCH] for k in range(self.yields)]

    def train_batches(self, *, loader_batch, num_processes, process_index, seed, epoch, start_step=0, step_multiple=1):
        self.asked.append(epoch)
        for rows in self.batches(epoch)[start_step:]:
            yield tuple(torch.stack(c) for c in zip(*[self.data[i] for i in rows]))

    def eval_batches(self, *, loader_batch, num_processes, process_index):  # one process: N is whole batches
        for start in range(0, N, loader_batch):
            rows = [self.data[i] for i in range(start, start + loader_batch)]
            yield tuple(torch.stack(c) for c in zip(*rows)), torch.ones(loader_batch, dtype=torch.bool)


@pytest.mark.parametrize("yields", [4, 8])
def test_a_batch_source_that_yields_another_count_than_announced_is_said_and_its_loss_mean_is_over_what_ran(
        tmp_path, caplog, yields):
    caplog.set_level(logging.INFO, logger="xlatrain")
    source = CountedSource(yields)
    history = _trainer(tmp_path, epochs=1).fit(source)
    ran = min(yields, 6)  # batches past the announced 6 are not trained on
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for rows in source.batches(source.asked[-1])[:ran]:  # the epoch the Trainer trained
        x, y = (torch.stack(c) for c in zip(*[source.data[i] for i in rows]))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert history[0]["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    said = "epoch 1 ran 4 step(s), but 6 were announced from the data's length: CountedSource.train_batches gave " \
           "fewer batches" if yields < 6 else "epoch 1 ran the 6 step(s) announced from the data's length, but " \
           "CountedSource.train_batches gave more than 6 batches: the batches after step 6 were not trained on"
    assert said in caplog.text
