import csv
import functools
import warnings
import json
import math
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from xlatrain import CheckpointConfig, TrainConfig, Trainer, load_weights
from xlatrain.train.metrics import roc_auc


def _classification(n, seed=0, dim=6, classes=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y % classes)


def _mlp(dim=6, out=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Linear(16, out))


def _trainer(tmp_path, model=None, loss=None, opt=None, **cfg):
    cfg.setdefault("run_dir", str(tmp_path / "run"))
    cfg.setdefault("log_every", 1000)
    return Trainer(
        model if model is not None else _mlp(),
        loss if loss is not None else nn.CrossEntropyLoss(),
        opt or functools.partial(torch.optim.SGD, lr=0.1),
        config=TrainConfig(**cfg),
        backend="cpu",
    )


def test_fit_writes_history_and_best_weights_that_reproduce_the_best_epoch(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    trainer = _trainer(tmp_path, epochs=4, batch_size=16)
    history = trainer.fit(_classification(200), _classification(70, seed=1))
    run = tmp_path / "run"
    with open(run / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]
    assert {"train_loss", "val_loss", "val_accuracy", "lr"} <= set(rows[0])
    assert json.loads((run / "history.json").read_text()) == history
    best = max(history, key=lambda r: r["val_accuracy"])
    fresh = _mlp(seed=123)
    load_weights(fresh, run / "best.safetensors")
    check = _trainer(tmp_path, model=fresh, run_dir=str(tmp_path / "check"), batch_size=16)
    assert check.evaluate(_classification(70, seed=1))["accuracy"] == pytest.approx(best["val_accuracy"])
    out = caplog.text
    assert "global batch 16 = 16 per device x 1 device(s)" in out
    assert out.count("epoch 4/4") == 1


def test_evaluate_counts_each_sample_once_when_batches_do_not_divide(tmp_path):
    data = _classification(37, seed=4)
    trainer = _trainer(tmp_path, batch_size=8)
    metrics = trainer.evaluate(data)
    with torch.no_grad():
        logits = trainer.model(data.tensors[0])
    assert metrics["num_samples"] == 37
    assert metrics["loss"] == pytest.approx(F.cross_entropy(logits, data.tensors[1]).item(), rel=1e-6)
    expected_acc = (logits.argmax(1) == data.tensors[1]).float().mean().item()
    assert metrics["accuracy"] == pytest.approx(expected_acc)


class _Tagger(nn.Module):
    """Per-token logits ``[B, C, T]`` of a ``[B, T, 6]`` input, as a token tagger gives them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        return self.head(x).transpose(1, 2)


def _tokens(n=37, t=7):
    """Token targets with -100 (ignored) at positions that grow with the row: none in the first
    batch of 8, so a check on the first batch alone would not see them."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(n, t, 6, generator=g), torch.randint(0, 5, (n, t), generator=g)
    for i in range(8, n):
        y[i, : i % t + 1] = -100
    return TensorDataset(x, y)


@pytest.mark.parametrize("case", ["ce-weight", "ce-ignored-tokens", "nll-weight-ignored", "functional-ce-ignored",
                                  "kl-batchmean", "mse-sum", "function-weighted"])
def test_the_validation_loss_is_the_loss_over_the_set_as_the_loss_takes_its_mean(tmp_path, case, caplog):
    """Evaluation sums a loss's unreduced values on the device. A weighted cross-entropy, ignored
    targets (-100: padding, a segmentation's void), a "batchmean" or a "sum" were averaged per
    row: val_loss read 1.25 for 2.01, 2.63 for 1.68, 1.15 for 55.2. Each is now what the loss
    gives over the whole set at once, with batches that do not divide it (37 rows in 8s)."""
    caplog.set_level(logging.INFO, logger="xlatrain")
    weight = torch.tensor([1.0, 4.0, 0.25, 2.0, 0.5])

    def weighted(outputs, targets, reduction="mean"):  # a hand-written weighted mean: only the check sees it
        return F.cross_entropy(outputs, targets, weight=weight, reduction=reduction)

    model, data = _Tagger(), _tokens()
    loss_fn = {
        "ce-weight": nn.CrossEntropyLoss(weight=weight), "ce-ignored-tokens": nn.CrossEntropyLoss(),
        "nll-weight-ignored": nn.NLLLoss(weight=weight), "functional-ce-ignored": F.cross_entropy,
        "kl-batchmean": nn.KLDivLoss(reduction="batchmean"), "mse-sum": nn.MSELoss(reduction="sum"),
        "function-weighted": weighted,
    }[case]
    if case in ("ce-weight", "function-weighted"):
        data = TensorDataset(data.tensors[0], data.tensors[1].clamp(min=0))
    if case in ("kl-batchmean", "nll-weight-ignored"):
        model = nn.Sequential(model, nn.LogSoftmax(dim=1))
    if case in ("kl-batchmean", "mse-sum"):
        data = TensorDataset(data.tensors[0], torch.softmax(torch.randn(37, 5, 7, generator=torch.Generator().manual_seed(1)), 1))
    trainer = Trainer(model, loss_fn, functools.partial(torch.optim.SGD, lr=0.1),
                      config=TrainConfig(epochs=1, batch_size=8, task="none", run_dir=str(tmp_path)), backend="cpu")
    metrics = trainer.evaluate(data)
    with torch.no_grad():
        expected = float(loss_fn(model(data.tensors[0]), data.tensors[1]))
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)
    per_sample = trainer._eval_loss.mode == "per_sample"
    assert per_sample == (case != "mse-sum" and case != "function-weighted")
    assert ("do not average to its own value" in caplog.text) == (case == "function-weighted")


def test_rows_of_different_widths_are_joined_padded_with_what_each_dtype_can_hold():
    from xlatrain.train.metrics import padded_cat

    floats = padded_cat([torch.ones(2, 3), torch.zeros(1, 5)])
    assert floats.shape == (3, 5) and floats[:2, 3:].eq(-100).all() and floats[2].eq(0).all()
    assert padded_cat([torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool)]).tolist() == \
        [[True, True, False, False], [True, True, True, True]]
    small = padded_cat([torch.ones(1, 2, dtype=torch.uint8), torch.ones(1, 3, dtype=torch.uint8)])
    assert small.dtype == torch.int64 and small.tolist() == [[1, 1, -100], [1, 1, 1]]  # -100 wrapped to 156 in a uint8


def test_a_metric_object_that_joins_processes_itself_is_told_from_one_that_does_not():
    """On several processes a metric of the user's own is fed every process's rows, unless it
    joins them itself: one whose compute() all-reduces counted every row twice when fed both."""
    import torch.distributed as dist

    from xlatrain.train.detection import DetectionMAP
    from xlatrain.train.metrics import combines_processes

    class Meter:
        def update(self, preds, targets): ...

        def compute(self):
            return {"n": 1.0}

    class Reduced(Meter):
        def compute(self):
            t = torch.ones(1)
            if dist.is_initialized():
                dist.all_reduce(t)
            return {"n": float(t)}

    class Ported(Meter):
        def compute(self):
            import torch_xla.core.xla_model as xm
            return {"n": xm.mesh_reduce("n", 1.0, sum)}

    class Told(Meter):
        combines_processes = True

    assert not combines_processes(Meter())
    assert combines_processes(Reduced()) and combines_processes(Ported()) and combines_processes(Told())
    assert combines_processes(DetectionMAP())
    # Fed every process's rows, a meter needs tensors to gather: a detector's dicts are refused in
    # the dry run, before training, on several processes only, and not where it joins them itself.
    from xlatrain.train.metrics import check_gatherable

    dicts = [{"boxes": torch.zeros(1, 4), "labels": torch.zeros(1)}]
    with pytest.raises(ValueError, match="not tensors of rows.*combines_processes = True"):
        check_gatherable(Meter(), 2, dicts, dicts)
    check_gatherable(Meter(), 1, dicts, dicts)
    check_gatherable(Told(), 2, dicts, dicts)
    check_gatherable(Meter(), 2, torch.zeros(2, 3), torch.zeros(2))


def test_predict_returns_every_row_in_dataset_order(tmp_path):
    data = _classification(29, seed=5)
    trainer = _trainer(tmp_path, batch_size=8)
    preds = trainer.predict(data)
    with torch.no_grad():
        assert torch.allclose(preds, trainer.model(data.tensors[0]), atol=1e-6)
    bare = trainer.predict(data.tensors[0])  # a tensor of inputs is a dataset of bare inputs
    assert torch.allclose(bare, preds)


def test_multilabel_reports_per_label_auc_and_the_mean(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 4, generator=g)
    y = torch.stack([(x[:, 0] > 0), (x[:, 1] + x[:, 2] > 0)], dim=1).float()
    train, val = TensorDataset(x[:80], y[:80]), TensorDataset(x[80:], y[80:])
    trainer = Trainer(
        _mlp(dim=4, out=2),
        nn.BCEWithLogitsLoss(),
        functools.partial(torch.optim.Adam, lr=1e-2),
        config=TrainConfig(epochs=3, batch_size=16, run_dir=str(tmp_path / "ml"), log_every=1000),
        backend="cpu",
        label_names=["pe_present", "central"],
    )
    history = trainer.fit(train, val)
    last = history[-1]
    probs = torch.sigmoid(trainer.predict(val)).numpy()
    for i, name in enumerate(["pe_present", "central"]):
        assert last[f"val_auc_{name}"] == pytest.approx(roc_auc(probs[:, i], y[80:, i].numpy()))
    assert last["val_mean_auc"] == pytest.approx((last["val_auc_pe_present"] + last["val_auc_central"]) / 2)
    assert trainer.monitor == "val_mean_auc"



def test_label_names_under_a_classification_task_are_said_to_name_nothing(tmp_path, caplog):
    """label_names name a multilabel task's AUC columns: a run whose task turns out to be
    classification says so before its first step, and one that is multilabel says nothing."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g)

    def fit(loss, targets, name, names=("a", "b", "c")):
        Trainer(_mlp(dim=4, out=3), loss, functools.partial(torch.optim.SGD, lr=0.1),
                config=TrainConfig(epochs=1, batch_size=16, run_dir=str(tmp_path / name)), backend="cpu",
                label_names=names).fit(TensorDataset(x, targets))

    with caplog.at_level(logging.INFO, logger="xlatrain"):
        fit(nn.CrossEntropyLoss(), y, "classification")
    note = [r.getMessage() for r in caplog.records if r.getMessage().startswith("note: label_names")]
    assert note == ["note: label_names (a, b, c) name a multilabel task's per-label AUC columns (val_auc_<name>); "
                    "this run's task is 'classification', so they name no column. Set task='multilabel' "
                    "(trainer.task) if the outputs are independent labels"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xlatrain"):
        fit(nn.CrossEntropyLoss(), y, "numbers", names=[0, 1, 2])  # names as the multilabel columns take them
    assert any(r.getMessage().startswith("note: label_names (0, 1, 2) name") for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xlatrain"):
        fit(nn.BCEWithLogitsLoss(), nn.functional.one_hot(y, 3).float(), "multilabel")
    assert not [r for r in caplog.records if r.getMessage().startswith("note: label_names")]

def test_roc_auc_matches_the_pairwise_definition_with_ties():
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.4, 0.4]).numpy()
    labels = torch.tensor([0, 0, 1, 1, 1, 0]).numpy()
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = [(p > n) + 0.5 * (p == n) for p in pos for n in neg]
    assert roc_auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs))


def test_grad_accumulation_equals_the_large_batch(tmp_path):
    data = _classification(64)
    big = _trainer(tmp_path, model=_mlp(), batch_size=16, run_dir=str(tmp_path / "a"), seed=3)
    small = _trainer(tmp_path, model=_mlp(), batch_size=8, grad_accum_steps=2, run_dir=str(tmp_path / "b"), seed=3)
    big.fit(data)
    small.fit(data)
    for p, q in zip(big.model.parameters(), small.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_clipping_bounds_the_update(tmp_path):
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, model=model, opt=functools.partial(torch.optim.SGD, lr=1.0), batch_size=64, clip_grad_norm=1e-3)
    trainer.fit(_classification(64))  # exactly one optimizer step
    delta = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert 0 < delta <= 1e-3 + 1e-7


def test_bf16_autocasts_the_forward_and_keeps_fp32_weights(tmp_path):
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _mlp()

        def forward(self, x):
            out = self.body(x)
            seen.append(out.dtype)
            return out

    trainer = _trainer(tmp_path, model=Probe(), batch_size=16, precision="bf16")
    history = trainer.fit(_classification(64))
    assert seen and all(d == torch.bfloat16 for d in seen)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert math.isfinite(history[0]["train_loss"])


def test_a_non_scalar_loss_is_a_clear_error(tmp_path):
    trainer = _trainer(tmp_path, loss=nn.CrossEntropyLoss(reduction="none"), batch_size=8)
    with pytest.raises(ValueError, match=r"dry run on one training batch, before training: loss_fn must return a scalar 'loss', got shape \(2,\)"):
        trainer.fit(_classification(32))
    assert not (tmp_path / "run" / "history.json").exists()  # nothing trained


def test_a_dataset_smaller_than_one_global_batch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="training set has 10 samples, fewer than one optimizer step"):
        _trainer(tmp_path, batch_size=16).fit(_classification(10))


def test_items_that_are_not_pairs_are_a_clear_error(tmp_path):
    x = torch.randn(32, 6)
    with pytest.raises(ValueError, match=r"must be an \(inputs, targets\) pair"):
        _trainer(tmp_path, batch_size=8).fit(TensorDataset(x, x, x))


def test_an_unknown_monitor_names_the_columns(tmp_path):
    trainer = _trainer(tmp_path, batch_size=8, monitor="val_f1", monitor_mode="max")
    with pytest.raises(ValueError, match=r"monitor='val_f1' is not a column this run's history will have; it will "
                                         r"have .*val_accuracy.*val_loss.*Set monitor"):
        trainer.fit(_classification(32), _classification(10))
    # Refused before the first step: nothing was trained or written.
    assert not (tmp_path / "run" / "history.json").exists() and not list(tmp_path.glob("run/checkpoints/*"))


def test_a_monitor_only_metrics_fn_can_name_is_said_before_training_and_checked_after_the_first_validation(
        tmp_path, caplog, recwarn):
    caplog.set_level(logging.INFO, logger="xlatrain")

    def metrics_fn(outputs, targets):
        if len(targets) < 3:
            warnings.warn("too few rows for a score")  # the dry run's two rows: not the run's warning
        return {"f1": 0.5}

    def fit(monitor, run=None):
        caplog.clear()
        trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), metrics_fn=metrics_fn,
                          config=TrainConfig(epochs=2, batch_size=8, run_dir=str(tmp_path / (run or monitor)),
                                             monitor=monitor, monitor_mode="max", early_stop_patience=1),
                          backend="cpu")
        return trainer.fit(_classification(32), _classification(10))

    # metrics_fn runs on two validation rows before training: its names are known then.
    assert len(fit("val_f1")) == 2 and "note: monitor=" not in caplog.text
    with pytest.raises(ValueError, match=r"monitor='val_f2' is not a history column; available: .*val_f1.* \(did you "
                                         r"mean 'val_f1'\?\)\. Epoch 1 is written and checkpointed: set monitor"):
        fit("val_f2")
    note = next(r for r in caplog.records if r.getMessage().startswith("note: monitor='val_f2' (did you mean 'val_f1'?)"))
    header = next(r for r in caplog.records if r.getMessage().startswith("model FLOPs"))
    assert caplog.records.index(note) < caplog.records.index(header)  # said with the header, before the first step
    assert "metrics_fn returned f1 on two validation rows" in note.getMessage()
    assert "val_accuracy" in note.getMessage() and "stops the run there" in note.getMessage()
    assert not [w for w in recwarn if "too few rows" in str(w.message)]
    # The epoch it stopped after is kept: the corrected monitor resumes there (no best was judged yet),
    # and patience counts from the first epoch it judged.
    history = fit("val_f1", run="val_f2")
    assert [r["epoch"] for r in history] == [1, 2] and "continuing at epoch 2" in caplog.text
    assert "resuming with changed settings: trainer.monitor 'val_f2' -> 'val_f1'" in caplog.text
    # Once a best was judged by a monitor, it stays.
    with pytest.raises(ValueError, match=r"trainer\.monitor 'val_f1' -> 'val_accuracy'"):
        fit("val_accuracy", run="val_f2")
    # Without a checkpoint at the epoch's end, no resume is promised.
    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), metrics_fn=metrics_fn,
                      config=TrainConfig(epochs=2, batch_size=8, run_dir=str(tmp_path / "nockpt"), monitor="val_f2",
                                         monitor_mode="max"),
                      checkpoint=CheckpointConfig(at_epoch_end=False), backend="cpu")
    with pytest.raises(ValueError, match=r"epoch 1 is in the history, but no checkpoint holds its end") as err:
        trainer.fit(_classification(32), _classification(10))
    assert "resume" not in str(err.value)

    def raising(outputs, targets):
        if len(targets) < 3:
            raise ValueError("needs both classes")
        return {"f1": 0.5}

    caplog.clear()
    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), metrics_fn=raising,
                      config=TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path / "raising"), monitor="val_f1",
                                         monitor_mode="max"), backend="cpu")
    # What it raised on the dry run's two rows is not the run's.
    assert trainer.fit(_classification(32), _classification(10))[-1]["val_f1"] == 0.5
    assert "note: monitor='val_f1' is to come from metrics_fn, which gave no names on two validation rows " \
           "(it raised there); the history's columns are known once the first validation" in caplog.text


def test_metrics_fn_names_are_each_fits_own_and_a_non_mapping_is_refused_before_training(tmp_path):
    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                      metrics_fn=lambda outputs, targets: {"f1": 0.5},
                      config=TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path / "a"), monitor="val_f1",
                                         monitor_mode="max"), backend="cpu")
    trainer.fit(_classification(32), _classification(10))
    # The same Trainer without validation data: the names an earlier fit learned make no val_ column.
    with pytest.raises(ValueError, match=r"monitor='val_f1' is not a column .*no validation data was given"):
        trainer.fit(_classification(32), resume="overwrite")

    listing = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                      metrics_fn=lambda outputs, targets: [0.5],
                      config=TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path / "b")), backend="cpu")
    with pytest.raises(TypeError, match=r"metrics_fn <function .*<lambda>.* returned a list, not a mapping"):
        listing.fit(_classification(32), _classification(10))
    assert not (tmp_path / "b" / "history.json").exists()  # refused in the dry run, before the first step

    # A value of several numbers (a per-class tensor) is refused there too, not after an epoch.
    per_class = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.Adam, lr=0.1),
                        metrics_fn=lambda outputs, targets: {"recall": torch.ones(3), "f1": 0.5},
                        config=TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path / "c")), backend="cpu")
    with pytest.raises(TypeError, match=r"returned a Tensor of shape \(3,\) for 'recall'"):
        per_class.fit(_classification(32), _classification(10))
    assert not per_class.optimizer.state  # no step was taken

    # None on the dry run's two rows (an AUC of a fold with one class) waits for the whole set.
    def auc_or_none(outputs, targets):
        return {"auc": None if len(targets) < 3 else 0.5}

    later = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), metrics_fn=auc_or_none,
                    config=TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path / "d")), backend="cpu")
    assert later.fit(_classification(32), _classification(10))[-1]["val_auc"] == 0.5


def test_functional_losses_with_a_reduction_argument_evaluate(tmp_path):
    trainer = _trainer(tmp_path, loss=F.cross_entropy, batch_size=8)
    assert trainer.task == "classification"
    assert trainer.evaluate(_classification(10))["num_samples"] == 10


def test_step_schedules_and_scale_lr_on_one_device_leave_the_rate(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    model = _mlp()
    trainer = Trainer(
        model,
        nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
        config=TrainConfig(epochs=1, batch_size=8, scale_lr=True, scheduler_interval="step", run_dir=str(tmp_path / "s")),
        backend="cpu",
    )
    trainer.fit(_classification(32))  # 4 optimizer steps
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    assert "scaled" not in caplog.text


def test_tuple_outputs_and_a_host_metrics_fn_see_every_row_in_order(tmp_path):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 1)

        def forward(self, x):
            return self.a(x), self.b(x)

    def loss_fn(outputs, targets, reduction="mean"):
        ce = F.cross_entropy(outputs[0], targets, reduction=reduction)
        reg = F.mse_loss(outputs[1].squeeze(1), targets.float(), reduction=reduction)
        return ce + reg

    seen = {}

    def metrics_fn(outputs, targets):
        seen["outputs"], seen["targets"] = outputs, targets
        return {"mae": (outputs[1].squeeze(1) - targets.float()).abs().mean()}

    data = _classification(29, seed=6)
    torch.manual_seed(0)
    trainer = Trainer(TwoHeads(), loss_fn, functools.partial(torch.optim.SGD, lr=0.05),
                      config=TrainConfig(epochs=2, batch_size=8, task="none", run_dir=str(tmp_path / "t")),
                      backend="cpu", metrics_fn=metrics_fn)
    history = trainer.fit(data, data)
    assert torch.equal(seen["targets"], data.tensors[1])  # dataset order, padding dropped
    with torch.no_grad():
        expected = trainer.model(data.tensors[0])
    assert torch.allclose(seen["outputs"][1], expected[1], atol=1e-6)
    assert history[-1]["val_mae"] == pytest.approx((expected[1].squeeze(1) - data.tensors[1].float()).abs().mean().item(), rel=1e-5)
    preds = trainer.predict(data)
    assert isinstance(preds, tuple) and preds[0].shape == (29, 3)


def test_samples_an_epoch_leaves_out_to_keep_its_batches_full_are_said(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    _trainer(tmp_path / "ragged", batch_size=8).fit(_classification(37))
    assert ("note: each epoch trains 4 full batches of 8, 32 of the 37 samples, so that every step has the same "
            "shape: the 5 at the end of its shuffled order, different ones each epoch, wait for another epoch") in caplog.text
    caplog.clear()
    _trainer(tmp_path / "whole", batch_size=8).fit(_classification(32))
    assert "full batches of" not in caplog.text


def test_a_hand_written_loss_that_broadcasts_outputs_against_targets_is_said_before_training(tmp_path, caplog):
    # outputs (N, 1) against targets (N,): (o - t) is (N, N), so each output meets every target.
    # torch warns only inside its own losses; this one is the user's.
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, generator=g))
    caplog.set_level(logging.INFO, logger="xlatrain")
    _trainer(tmp_path / "a", model=nn.Linear(6, 1), loss=lambda o, t: ((o - t) ** 2).mean(), epochs=1,
             batch_size=8, task="none").fit(data)
    notes = [r.getMessage() for r in caplog.records if "by broadcasting" in r.getMessage()]
    assert len(notes) == 1 and "of shapes (2, 1) and (2,), into (2, 2)" in notes[0] and "squeeze(-1)" in notes[0]
    # Row by row, as meant: nothing said.
    caplog.clear()
    _trainer(tmp_path / "b", model=nn.Linear(6, 1), loss=lambda o, t: ((o.squeeze(-1) - t) ** 2).mean(), epochs=1,
             batch_size=8, task="none").fit(data)
    assert "by broadcasting" not in caplog.text


class _PerClassRecall:
    """A streaming metric in torchmetrics' shape (update / compute / reset) whose result holds a
    per-class vector, as average=None gives, and a confusion matrix."""

    def __init__(self, classes=3):
        self.classes = classes
        self.reset()

    def reset(self):
        self.matrix = torch.zeros(self.classes, self.classes)

    def update(self, outputs, targets):
        for t, p in zip(targets.tolist(), outputs.argmax(-1).tolist()):
            self.matrix[t, p] += 1

    def compute(self):
        recall = self.matrix.diag() / self.matrix.sum(1).clamp(min=1)
        return {"recall": recall, "mean_recall": recall.mean(), "confusion": self.matrix.clone()}


def test_a_streaming_metrics_per_class_vector_becomes_columns_and_a_matrix_is_said_left_out(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    metric = _PerClassRecall()
    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), metrics_fn=metric,
                      config=TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path / "s")), backend="cpu")
    last = trainer.fit(_classification(32), _classification(30, seed=1))[-1]
    recall = [last[f"val_recall_{i}"] for i in range(3)]
    assert last["val_mean_recall"] == pytest.approx(sum(recall) / 3)
    assert not any(k.startswith("val_confusion") for k in last)
    assert "'confusion' is a float32 tensor of shape (3, 3), which is no history column: left out" in caplog.text


def test_a_cross_entropy_subclass_that_converts_its_targets_trains_on_int32_labels(tmp_path):
    # Only torch's own loss refuses int32 class indices; a subclass may convert them, and does here.
    class CastingCE(nn.CrossEntropyLoss):
        def forward(self, outputs, targets):
            return super().forward(outputs, targets.long())

    x, y = _classification(32)[:]
    history = _trainer(tmp_path, loss=CastingCE(), epochs=1, batch_size=8).fit(TensorDataset(x, y.int()))
    assert len(history) == 1


def test_per_class_columns_are_named_by_the_class_ids_a_metric_lists():
    from xlatrain.train.metrics import _metric_values

    class MeanAveragePrecision:  # torchmetrics' result shape with class_metrics=True
        pass

    found = {"map": torch.tensor(0.5), "classes": torch.tensor([1, 3, 7], dtype=torch.int32),
             "map_per_class": torch.tensor([0.1, 0.2, 0.3])}
    got = _metric_values(MeanAveragePrecision(), found)
    assert got == pytest.approx({"map": 0.5, "map_per_class_1": 0.1, "map_per_class_3": 0.2, "map_per_class_7": 0.3})


def _chained(opt):  # a ChainedScheduler has no last_epoch of its own
    return torch.optim.lr_scheduler.ChainedScheduler([torch.optim.lr_scheduler.LinearLR(opt, 0.5, total_iters=2),
                                                      torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)])


@pytest.mark.parametrize("kind", ["run-length-per-step", "epoch-cosine", "chained", "tensor-rate"])
def test_a_second_fit_on_one_trainer_starts_its_schedule_anew(tmp_path, kind):
    """The finished schedule was reused: OneCycleLR raised past its end once the earlier run's
    files were removed, and a cosine started the new run at its floor (rates 0, 0.025, 0.075)."""
    schedule = {
        "run-length-per-step": lambda opt, run: torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=run.total_steps),
        "epoch-cosine": functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=3),
        "chained": _chained, "tensor-rate": functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=3),
    }[kind]
    lr = torch.tensor(0.1) if kind == "tensor-rate" else 0.1
    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=lr), scheduler_fn=schedule,
                      config=TrainConfig(epochs=3, batch_size=8, run_dir=str(tmp_path), tensorboard=False,
                                         scheduler_interval="step" if kind.endswith("per-step") else "epoch"),
                      backend="cpu")
    first = [row["lr"] for row in trainer.fit(_classification(16))]
    again = [row["lr"] for row in trainer.fit(_classification(16), resume="overwrite")]
    assert again == pytest.approx(first, rel=1e-6) and len(set(first)) == 3


def test_a_schedule_a_user_put_in_place_of_the_trainers_stays_theirs(tmp_path):
    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                      scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1),
                      config=TrainConfig(epochs=2, batch_size=8, run_dir=str(tmp_path), tensorboard=False), backend="cpu")
    trainer.fit(_classification(16))
    mine = trainer.scheduler = torch.optim.lr_scheduler.ConstantLR(trainer.optimizer, factor=1.0, total_iters=0)
    trainer.fit(_classification(16), resume="overwrite")
    assert trainer.scheduler is mine


def test_predict_on_bare_inputs_runs_the_batch_transform_as_on_pairs(tmp_path):
    """A bare-input batch skipped batch_transform (normalisation on the device): predictions were
    made on raw inputs, unsaid."""
    x = torch.randn(10, 6)
    mean = x.mean(0)
    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                      batch_transform=lambda b: ((b[0] - mean) * 10, b[1]),
                      config=TrainConfig(batch_size=4, run_dir=str(tmp_path)), backend="cpu")
    with torch.no_grad():
        expected = trainer.model((x - mean) * 10)
    assert torch.allclose(trainer.predict(x), expected, atol=1e-6)
    assert torch.allclose(trainer.predict(list(zip(x, torch.zeros(10, dtype=torch.long)))), expected, atol=1e-6)


def test_early_stopping_counts_patience_from_the_first_epoch_its_monitor_judged(tmp_path, caplog):
    """A monitor that is NaN (an AUC over a fold whose labels have one class) judges nothing: the run
    stopped after epoch 1 saying 'best nan in epoch None'."""
    caplog.set_level(logging.INFO, logger="xlatrain")
    values = iter([float("nan"), float("nan"), 0.5, 0.4, 0.3])

    def score(outputs, targets):  # by epoch, over the whole validation set (the dry run reads 2 rows)
        return {"score": next(values) if len(targets) == 8 else 0.0}

    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), metrics_fn=score,
                      config=TrainConfig(epochs=5, batch_size=4, early_stop_patience=1, monitor="val_score",
                                         monitor_mode="max", run_dir=str(tmp_path), log_every=1000), backend="cpu")
    history = trainer.fit(_classification(16), _classification(8, seed=1))
    assert [row["epoch"] for row in history] == [1, 2, 3, 4]  # judged from epoch 3 (best), not improved in 4
    assert "early stop: val_score has not improved for 1 epoch(s) (best 0.5000 in epoch 3)" in caplog.text
    assert "best nan" not in caplog.text


@pytest.mark.parametrize("kind", ["total_steps", "steps_per_epoch", "epochs", "optimizer only", "explicit epoch"])
def test_auto_steps_a_schedule_sized_in_optimizer_steps_every_step_and_says_so(tmp_path, caplog, kind):
    """scheduler_interval defaulted to 'epoch': the RunShape docstring's own OneCycleLR over
    run.total_steps, and Hugging Face's warmup cosine, were stepped once an epoch, unsaid (4
    epochs of 6 steps: the rate rose 0.004 -> 0.05 and never reached max_lr 0.1)."""
    caplog.set_level(logging.INFO, logger="xlatrain")
    schedule = {
        "total_steps": lambda opt, run: torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=run.total_steps),
        "steps_per_epoch": lambda opt, run: torch.optim.lr_scheduler.OneCycleLR(
            opt, 0.1, epochs=run.epochs, steps_per_epoch=run.steps_per_epoch),
        "epochs": lambda opt, run: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=run.epochs),
        "optimizer only": functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1),
        "explicit epoch": lambda opt, run: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=run.total_steps),
    }[kind]
    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), scheduler_fn=schedule,
                      config=TrainConfig(epochs=4, batch_size=8, run_dir=str(tmp_path), tensorboard=False,
                                         **({"scheduler_interval": "epoch"} if kind == "explicit epoch" else {})),
                      backend="cpu")
    trainer.fit(_classification(48))
    per_step = kind in ("total_steps", "steps_per_epoch")
    assert trainer.schedule_interval == ("step" if per_step else "epoch")
    assert trainer.scheduler.last_epoch == (24 if per_step else 4)  # 6 optimizer steps an epoch
    line = next(ln for ln in caplog.text.splitlines() if " schedule: " in ln)
    assert ("every optimizer step" if per_step else "every epoch") in line, line
    if kind == "total_steps":
        assert "read run.total_steps, counts of optimizer steps" in line, line
    elif kind == "explicit epoch":  # a choice the user made stays theirs
        assert "(scheduler_interval='epoch')" in line, line
    # The checkpoint records the interval that ran: a resume compares it.
    meta = max((tmp_path / "checkpoints").glob("*/meta.json"))
    assert json.loads(meta.read_text())["config"]["trainer"]["scheduler_interval"] == trainer.schedule_interval


def test_reduce_lr_on_plateau_steps_on_the_monitored_value_each_epoch(tmp_path, caplog):
    """ReduceLROnPlateau.step() needs the metric: it failed with a TypeError after the first
    epoch had trained and validated."""
    caplog.set_level(logging.INFO, logger="xlatrain")
    plateau = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, mode="min", patience=0, factor=0.5, eps=0)
    data = _classification(32)
    # A rate too small to move the loss: every epoch after the first fails to improve it.
    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=1e-9), scheduler_fn=plateau,
                      config=TrainConfig(epochs=3, batch_size=8, run_dir=str(tmp_path / "a"), tensorboard=False,
                                         monitor="val_loss"), backend="cpu")
    history = trainer.fit(data, data)
    assert [r["lr"] for r in history] == pytest.approx([1e-9, 1e-9, 5e-10])
    assert "schedule: ReduceLROnPlateau stepped every epoch, on val_loss" in caplog.text
    # Its direction against the monitor's, and a per-step interval, are refused before training.
    for cfg, match in (({}, r"ReduceLROnPlateau\(mode='min'\) .* val_accuracy, which is better higher .* mode='max'"),
                       ({"monitor": "val_loss", "scheduler_interval": "step"}, r"scheduler_interval='step' .* 'epoch'")):
        model = _mlp()
        before = [p.detach().clone() for p in model.parameters()]
        trainer = Trainer(model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), scheduler_fn=plateau,
                          config=TrainConfig(epochs=2, batch_size=8, run_dir=str(tmp_path / "b"), tensorboard=False, **cfg),
                          backend="cpu")
        with pytest.raises(ValueError, match=match):
            trainer.fit(data, data)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert not (tmp_path / "b" / "history.json").exists()


def test_under_auto_a_resumed_run_steps_its_schedule_as_the_checkpoints_run_did(tmp_path, caplog):
    """A run an older xlatrain stepped every epoch (its default then) with a schedule sized in
    steps was refused on resume ('scheduler_interval epoch -> step') though the user set nothing."""
    caplog.set_level(logging.INFO, logger="xlatrain")

    class StopAfterOne:
        def on_epoch_end(self, trainer, row):
            trainer.request_stop("the test")

    def trainer(**cfg):
        return Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                       scheduler_fn=lambda opt, run: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=run.total_steps),
                       config=TrainConfig(epochs=2, batch_size=8, run_dir=str(tmp_path), tensorboard=False, **cfg),
                       backend="cpu", callbacks=[StopAfterOne()] if cfg else [])
    trainer(scheduler_interval="epoch").fit(_classification(32))
    resumed = trainer()
    history = resumed.fit(_classification(32))
    assert [row["epoch"] for row in history] == [1, 2] and resumed.schedule_interval == "epoch"
    assert resumed.scheduler.last_epoch == 2  # once an epoch, as before
    assert "the checkpoint's schedule was stepped every epoch: this run goes on so" in caplog.text


def test_a_schedule_put_in_place_of_scheduler_fns_is_stepped_every_epoch_under_auto(tmp_path, caplog):
    """A second fit kept what the first fit's factory read: a StepLR a user put in trainer.scheduler
    was stepped every optimizer step, 'because scheduler_fn read run.total_steps'."""
    caplog.set_level(logging.INFO, logger="xlatrain")
    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                      scheduler_fn=lambda opt, run: torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=run.total_steps),
                      config=TrainConfig(epochs=2, batch_size=8, run_dir=str(tmp_path), tensorboard=False), backend="cpu")
    trainer.fit(_classification(32))
    assert trainer.schedule_interval == "step"
    mine = trainer.scheduler = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=1)
    caplog.clear()
    trainer.fit(_classification(32), resume="overwrite")
    assert trainer.scheduler is mine and trainer.schedule_interval == "epoch" and mine.last_epoch == 2
    assert "the schedule was put in trainer.scheduler, not made by scheduler_fn" in caplog.text


def test_printing_the_run_in_a_scheduler_factory_reads_no_length(tmp_path):
    """print(run) read every field: a cosine over run.epochs was then stepped every optimizer step."""
    def factory(opt, run):
        print(run)
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=run.epochs)

    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), scheduler_fn=factory,
                      config=TrainConfig(epochs=2, batch_size=8, run_dir=str(tmp_path), tensorboard=False), backend="cpu")
    trainer.fit(_classification(32))
    assert trainer.schedule_interval == "epoch"


def test_reduce_lr_on_plateau_starts_a_second_fit_at_the_first_rate(tmp_path):
    plateau = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0, factor=0.5, eps=0)
    trainer = Trainer(_mlp(), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=1e-9), scheduler_fn=plateau,
                      config=TrainConfig(epochs=3, batch_size=8, run_dir=str(tmp_path), tensorboard=False,
                                         monitor="train_loss"), backend="cpu")
    first = [r["lr"] for r in trainer.fit(_classification(32))]
    again = [r["lr"] for r in trainer.fit(_classification(32), resume="overwrite")]
    assert first == pytest.approx([1e-9, 1e-9, 5e-10]) and again == pytest.approx(first), (first, again)
