"""Models nobody here wrote, trained as their users write them: Hugging Face causal LMs and a
classifier on their own loss with keyword inputs, a timm model with timm's Mixup, EMA and top-5,
a torchvision Faster R-CNN with list targets and two image sizes. Each model is built from a
config (no download) and trained on tiny generated data."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import xlatrain
from conftest import SCRIPTS, run_script, script_env
from xlatrain import TrainConfig, Trainer

try:  # the models extra, installed in .venv by the lock; .venv-xla (which runs only xla tests) has none
    import timm
    import transformers
    from transformers.utils import logging as hf_logging
except ImportError:  # pragma: no cover
    timm = transformers = None
else:
    hf_logging.set_verbosity_error()

pytestmark = pytest.mark.skipif(transformers is None, reason="needs the models extra (transformers, timm)")


def _trainer(model, loss_fn, run_dir, *, lr=3e-3, epochs=2, batch_size=8, **kwargs):
    config = {"epochs": epochs, "batch_size": batch_size, "run_dir": str(run_dir), "log_every": 4,
              "tensorboard": False, **kwargs.pop("config", {})}
    return Trainer(model, loss_fn, functools.partial(torch.optim.AdamW, lr=lr), config=TrainConfig(**config),
                   accelerator="cpu", **kwargs)


def _lm_items(n, seed, length=16, vocab=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, length), generator=g)
    x[:, 1::2] = x[:, ::2]  # every odd token repeats the one before: learnable
    return [{"input_ids": r, "attention_mask": torch.ones(length, dtype=torch.long), "labels": r.clone()} for r in x]


def _own_loss_over(model, items, batch_size):
    """The model's own loss over a set, as a user computes it: per batch, weighted by its rows."""
    model.eval()
    total, rows = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(items), batch_size):
            chunk = items[i:i + batch_size]
            batch = {k: torch.stack([item[k] for item in chunk]) for k in chunk[0]}
            total += float(model(**batch).loss) * len(chunk)
            rows += len(chunk)
    return total / rows


def test_gpt2_trains_on_its_own_loss_with_dict_batches_and_its_weights_load_back(tmp_path):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    train, val = _lm_items(64, 0), _lm_items(20, 1)  # 20 = 2 full batches of 8 and one of 4 (+4 padding rows)
    history = _trainer(model, None, tmp_path / "run", epochs=3).fit(train, val)
    losses = [r["train_loss"] for r in history]
    assert losses[-1] < losses[0] - 0.3, losses
    # val_loss is the model's own loss over the validation set, padding rows left out.
    assert history[-1]["val_loss"] == pytest.approx(_own_loss_over(model, val, 8), rel=1e-5)
    assert "val_accuracy" not in history[-1]  # [N, T, V] logits are not a classification

    # The weights keep the model's own state-dict keys: they load into a fresh model built from
    # the config, and Hugging Face's from_pretrained reads them from a saved directory as its own.
    best = tmp_path / "run" / "best.safetensors"
    fresh = transformers.GPT2LMHeadModel(config)
    xlatrain.load_weights(fresh, best)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    saved = tmp_path / "hf"
    saved.mkdir()
    config.save_pretrained(saved)
    os.link(best, saved / "model.safetensors")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(saved)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_causal_lm_on_a_loss_of_its_own_validates_over_the_whole_set_without_its_attention_cache(tmp_path):
    """A loss that returns one number has no per-sample form: evaluation keeps the outputs to score
    the whole set at once, and a Hugging Face output's cache (a DynamicCache, which no loss reads
    and none can gather) stays out of them."""
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.config.use_cache  # the output carries a cache object

    def lm_loss(outputs, labels):
        logits = outputs.logits
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    val = _lm_items(20, 1)
    history = _trainer(model, lm_loss, tmp_path / "run", epochs=1, inputs=("input_ids", "attention_mask"),
                       targets="labels").fit(_lm_items(32, 0), val)
    model.eval()
    with torch.no_grad():
        batch = {k: torch.stack([item[k] for item in val]) for k in val[0]}
        by_hand = float(lm_loss(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]),
                                batch["labels"]))
    assert history[0]["val_loss"] == pytest.approx(by_hand, rel=1e-5)


class _Seen(nn.Module):
    """A Llama whose forward keeps what each keyword it was given held."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.seen = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        self.seen.append({"attention_mask": attention_mask, "position_ids": position_ids, "labels": labels})
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels)


def test_llama_gets_each_input_by_name_where_position_would_put_the_labels_into_position_ids(tmp_path):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    llama = _Seen(transformers.LlamaForCausalLM(config))
    train = _lm_items(32, 0)
    # Llama's forward is (input_ids, attention_mask, position_ids, ...): by position, the labels
    # named third would land in position_ids. The model's own loss passes each key by name.
    history = _trainer(llama, None, tmp_path / "own", inputs=("input_ids", "attention_mask", "labels"),
                       epochs=1).fit(train)
    assert history[0]["train_loss"] < 4.2
    assert all(s["position_ids"] is None and s["labels"] is not None for s in llama.seen)

    # With a loss function too: keys that name forward's parameters go by name, so the labels
    # named third reach labels, not position_ids.
    llama.seen.clear()

    def shifted(logits, labels):
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    _trainer(llama, shifted, tmp_path / "fn", inputs=("input_ids", "attention_mask", "labels"), targets="labels",
             output_field="logits", epochs=1).fit(train)
    assert all(s["attention_mask"] is not None and s["position_ids"] is None and s["labels"] is not None
               for s in llama.seen)


def test_a_failing_positional_call_says_how_the_fields_were_bound(tmp_path):
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x, scale):
            return self.linear(x) + scale.view(-1, 4)  # a shape error on purpose: it raises

    items = [{"image": torch.randn(4), "factor": torch.tensor(1.0), "y": torch.tensor(i % 2)} for i in range(8)]
    with pytest.raises(RuntimeError) as raised:
        _trainer(TwoInputs(), nn.CrossEntropyLoss(), tmp_path, inputs=("image", "factor"), targets="y").fit(items)
    notes = "\n".join(raised.value.__notes__)
    assert "TwoInputs.forward(batch['image'], batch['factor'])" in notes
    assert "by position: batch['image'] -> x, batch['factor'] -> scale" in notes


def test_a_model_own_loss_with_inputs_named_gets_its_labels_in_training_and_none_in_predict(tmp_path):
    """inputs= named the model's inputs only: the labels never reached it, and the dry run said the batch
    held none; naming them in inputs= then made predict refuse unlabeled items."""
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    trainer = _trainer(model, None, tmp_path, epochs=1, inputs=("input_ids", "attention_mask"))
    history = trainer.fit(_lm_items(16, 0), _lm_items(8, 1))
    assert math.isfinite(history[0]["train_loss"]) and math.isfinite(history[0]["val_loss"])
    unlabeled = [{k: v for k, v in item.items() if k != "labels"} for item in _lm_items(4, 2)]
    assert trainer.predict(unlabeled).shape == (4, 16, 64)  # the logits, with no labels to pass


def test_the_model_own_loss_refuses_a_key_forward_does_not_take_before_training(tmp_path, caplog):
    class Scorer(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def forward(self, x, y):
            return nn.functional.mse_loss(self.linear(x).squeeze(1), y)

    items = [{"x": torch.randn(4), "y": torch.randn(()), "idx": torch.tensor(i)} for i in range(16)]
    with pytest.raises(ValueError, match=r"key\(s\) 'idx' are not parameters of Scorer.forward \(x, y\).*inputs="):
        _trainer(Scorer(), None, tmp_path).fit(items)
    assert not (tmp_path / "history.json").exists()
    # The fix the message names works.
    history = _trainer(Scorer(), None, tmp_path / "fixed", epochs=1, inputs=("x", "y")).fit(items)
    assert len(history) == 1

    # A forward that takes **kwargs (a Hugging Face model's) may read the key or drop it: said, not refused.
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    lm_items = [{**item, "idx": torch.tensor(i)} for i, item in enumerate(_lm_items(16, 0))]
    with caplog.at_level("INFO", logger="xlatrain"):
        _trainer(transformers.GPT2LMHeadModel(config), None, tmp_path / "kw", epochs=1).fit(lm_items)
    assert "'idx' are not named parameters of GPT2LMHeadModel.forward; they go to its **kwargs" in caplog.text


def _ragged_items(n, seed, classes=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        label = int(torch.randint(0, classes, (1,), generator=g))
        length = int(torch.randint(3, 12, (1,), generator=g))
        ids = torch.randint(10, 40, (length,), generator=g)
        ids[0] = 5 + label  # the class is in the first token
        out.append({"input_ids": ids.tolist(), "attention_mask": [1] * length, "labels": label})
    return out


def test_bert_classifier_trains_on_ragged_batches_padded_in_training_and_validation(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"t{i}" for i in range(40)]))
    collator = transformers.DataCollatorWithPadding(transformers.BertTokenizerFast(vocab_file=str(vocab)))
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=45, num_labels=3, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    train, val = _ragged_items(64, 0), _ragged_items(13, 1)
    history = _trainer(model, None, tmp_path / "run", epochs=4, collate_fn=collator).fit(train, val)
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    # The task is read from [N, C] logits and [N] labels: accuracy, monitored by default.
    assert "val_accuracy" in history[-1]
    # Every validation row counted once, padding rows (13 = 8 + 5) left out, each batch padded
    # to its own longest sequence by the collator in validation too.
    model.eval()
    with torch.no_grad():
        batches = [collator(val[i:i + 8]) for i in range(0, len(val), 8)]
        outs = [model(**b) for b in batches]
    hand_loss = sum(float(o.loss) * len(b["labels"]) for o, b in zip(outs, batches)) / len(val)
    hand_accuracy = sum(int((o.logits.argmax(1) == b["labels"]).sum()) for o, b in zip(outs, batches)) / len(val)
    assert history[-1]["val_loss"] == pytest.approx(hand_loss, rel=1e-5)
    assert history[-1]["val_accuracy"] == pytest.approx(hand_accuracy)


def test_a_token_tagger_on_batches_padded_to_their_own_length_gives_its_metrics_and_predictions(tmp_path):
    """Batches padded to 8 and to 16 tokens: joining their outputs raised (sizes 8 and 16) after
    the first epoch had trained, in a metrics_fn's rows and in predict. The narrower ones are
    padded with -100, as the Hugging Face Trainer pads predictions and labels."""
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=50, num_labels=3, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertForTokenClassification(config)
    g = torch.Generator().manual_seed(0)

    def items(lengths):
        ids = [torch.randint(5, 50, (n,), generator=g) for n in lengths]
        return [{"input_ids": i, "labels": i % 3} for i in ids]

    train, val = items([4, 5, 6, 7] * 2), items([3, 4, 5, 6, 12, 13, 14, 15])  # val: batches of 8 and 16 tokens
    collate = xlatrain.PadCollate(pad_to_multiple_of=8, attention_mask="attention_mask")
    seen = []

    def token_accuracy(logits, labels):
        seen.append((tuple(logits.shape), tuple(labels.shape)))
        kept = labels != -100
        return {"token_accuracy": float((logits.argmax(-1)[kept] == labels[kept]).float().mean())}

    trainer = _trainer(model, None, tmp_path / "run", epochs=1, batch_size=4, collate_fn=collate, metrics_fn=token_accuracy)
    row = trainer.fit(train, val)[-1]
    assert seen[-1] == ((8, 16, 3), (8, 16))
    model.eval()
    hits = total = 0
    with torch.no_grad():
        for chunk in (val[:4], val[4:]):
            batch = collate(chunk)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            kept = batch["labels"] != -100
            hits, total = hits + int((logits.argmax(-1)[kept] == batch["labels"][kept]).sum()), total + int(kept.sum())
    assert row["val_token_accuracy"] == pytest.approx(hits / total)
    predicted = trainer.predict(val)
    assert predicted.shape == (8, 16, 3) and bool((predicted[:4, 8:] == -100).all())  # the logits


def test_a_loss_handed_a_models_structured_output_names_output_field_before_training(tmp_path):
    """A cross-entropy given a Hugging Face model's SequenceClassifierOutput raised torch's 'must
    be Tensor' with nothing on the fix; the dry run adds it, and the fix named trains."""
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=50, num_labels=3, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    items = [{"input_ids": torch.randint(5, 50, (8,), generator=g), "labels": torch.tensor(i % 3)} for i in range(16)]
    named = {"inputs": "input_ids", "targets": "labels"}
    with pytest.raises(TypeError) as raised:
        _trainer(model, nn.CrossEntropyLoss(), tmp_path / "a", epochs=1, **named).fit(items)
    assert any("a SequenceClassifierOutput, where it takes a tensor: set output_field" in n for n in raised.value.__notes__)
    assert not (tmp_path / "a" / "history.json").exists()  # before any step
    row = _trainer(model, nn.CrossEntropyLoss(), tmp_path / "b", epochs=1, output_field="logits", **named).fit(items)[-1]
    assert math.isfinite(row["train_loss"])


def test_the_task_of_a_models_own_loss_is_read_from_its_float_labels():
    """Float labels shaped like the logits were all taken for class probabilities: multi-hot rows
    were scored by argmax accuracy, and a regression over several outputs got one too."""
    from xlatrain.train.metrics import task_from_shapes

    logits, g = torch.zeros(6, 4), torch.Generator().manual_seed(0)
    multi_hot = torch.tensor([[1.0, 1.0, 0, 0], [0, 0, 0, 0], [0, 1.0, 0, 1.0]] * 2)
    assert task_from_shapes(logits, multi_hot) == "multilabel"
    assert task_from_shapes(logits, nn.functional.one_hot(torch.arange(6) % 4, 4).float()) == "classification"
    assert task_from_shapes(logits, torch.softmax(torch.randn(6, 4, generator=g), 1)) == "classification"  # mixed
    assert task_from_shapes(logits, torch.randn(6, 4, generator=g)) == "none"
    assert task_from_shapes(logits, torch.arange(6) % 4) == "classification"


@pytest.mark.parametrize("problem", ["multi_label_classification", "regression"])
def test_a_hugging_face_classifier_gets_the_task_its_problem_type_says(tmp_path, problem):
    """A multi-label BERT whose labels have one positive in every row reads as one-hot to the
    labels alone; its problem_type says multi-label (per-label AUC), and a regression's none."""
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=50, num_labels=4, max_position_embeddings=32, problem_type=problem)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)

    def items(n):
        ids = torch.randint(5, 50, (n, 10), generator=g)
        y = nn.functional.one_hot(torch.randint(0, 4, (n,), generator=g), 4).float()
        return [{"input_ids": a, "labels": b} for a, b in zip(ids, y)]

    trainer = _trainer(model, None, tmp_path / "run", epochs=1)
    row = trainer.fit(items(16), items(8))[-1]
    expected = {"multi_label_classification": ("multilabel", "val_mean_auc"), "regression": ("none", "val_loss")}[problem]
    assert (trainer.task, trainer.monitor) == expected and expected[1] in row


def test_timm_mixup_mixes_training_only_with_ema_and_top5(tmp_path):
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy

    g = torch.Generator().manual_seed(0)

    def images(n):
        y = torch.randint(0, 10, (n,), generator=g)
        x = torch.randn(n, 3, 16, 16, generator=g) * 0.5 + y[:, None, None, None] / 5.0
        return torch.utils.data.TensorDataset(x, y)

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=10)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=10)
    mixed = []

    def mix(batch):
        x, y = mixup(*batch)
        mixed.append(tuple(y.shape))
        return x, y

    train, val = images(64), images(20)
    trainer = _trainer(model, SoftTargetCrossEntropy(), tmp_path / "run", epochs=2, train_batch_transform=mix,
                       val_loss_fn=nn.CrossEntropyLoss(), config={"ema_decay": 0.9, "top_k": (1, 5)})
    history = trainer.fit(train, val)
    row = history[-1]
    # Training batches got soft targets: the dry run's two (as the step runs), then 8 steps x 2 epochs.
    assert mixed == [(2, 10), (4, 10)] + [(8, 10)] * 16
    # Validation is not mixed: its loss is plain cross-entropy of the model on the set.
    model.eval()
    with torch.no_grad():
        x, y = val.tensors
        logits = model(x)
    assert row["val_loss"] == pytest.approx(float(nn.functional.cross_entropy(logits, y)), rel=1e-4)
    assert row["val_accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert row["val_top5_accuracy"] == pytest.approx(float((logits.topk(5, 1).indices == y[:, None]).any(1).float().mean()))
    assert "val_top1_accuracy" not in row  # it would repeat val_accuracy
    assert "val_ema_top5_accuracy" in row and "val_ema_loss" in row


def test_top_k_with_a_task_that_cannot_score_it_is_an_error_naming_what_to_set(tmp_path):
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 3))
    trainer = _trainer(nn.Linear(4, 3), nn.MSELoss(), tmp_path, config={"top_k": (1, 5)})
    with pytest.raises(ValueError, match=r"top_k=\(1, 5\).*task='none'.*inferred.*task='classification'.*drop top_k"):
        trainer.fit(data, data)
    assert not (tmp_path / "history.json").exists()


def test_loss_terms_in_another_order_are_the_same_terms(tmp_path):
    calls = []

    def terms(outputs, targets):
        a, b = outputs.pow(2).mean(), (outputs - targets).abs().mean()
        calls.append(1)
        return {"loss": a + b, "a": a, "b": b} if len(calls) % 2 else {"b": b, "loss": a + b, "a": a}

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    history = _trainer(nn.Linear(4, 2), terms, tmp_path, epochs=1).fit(data)
    assert {"train_a", "train_b"} <= set(history[0])


class _Watched(nn.Module):
    """Batch norm, dropout, and a record of each call's mode and running mean."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
        self.calls = []

    def forward(self, x):
        self.calls.append((self.training, torch.is_grad_enabled(), self.net[1].running_mean.clone()))
        return self.net(x)


def test_the_dry_run_runs_training_as_the_step_does_and_puts_back_what_it_changed(tmp_path):
    torch.manual_seed(0)
    model = _Watched()
    initial = model.net[1].running_mean.clone()
    data = torch.utils.data.TensorDataset(torch.randn(32, 4) + 3.0, torch.randint(0, 2, (32,)))
    trainer = _trainer(model, nn.CrossEntropyLoss(), tmp_path / "a", epochs=1)
    trainer.fit(data)
    dry = [c for c in model.calls[:2]]
    assert all(training and grad for training, grad, _ in dry)  # train mode, gradients on
    first_step = model.calls[2]
    assert torch.equal(first_step[2], initial)  # batch-norm statistics put back before the first step

    # Random state is put back too: the same run without callbacks' noise trains the same numbers.
    torch.manual_seed(0)
    again = _Watched()
    history = _trainer(again, nn.CrossEntropyLoss(), tmp_path / "b", epochs=1).fit(data)
    assert history[0]["train_loss"] == trainer.history[0]["train_loss"]


def test_what_evaluation_would_fail_on_after_an_epoch_fails_before_the_first_step(tmp_path):
    class ScalarOut(nn.Module):  # an adapter returning the loss itself, as a user once wrote one
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x):
            return self.linear(x).pow(2).mean()

    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    with pytest.raises(Exception, match="validation batch"):
        _trainer(ScalarOut(), lambda out, target: out, tmp_path, epochs=1).fit(data, data)
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def _detector():
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.ops import MultiScaleRoIAlign

    backbone = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, 2, 1), nn.ReLU())
    backbone.out_channels = 16
    return FasterRCNN(backbone, num_classes=2, min_size=64, max_size=96,
                      rpn_anchor_generator=AnchorGenerator(((16, 24, 32),), ((1.0,),)),
                      box_roi_pool=MultiScaleRoIAlign(["0"], 7, 2), representation_size=64,
                      rpn_pre_nms_top_n_train=100, rpn_post_nms_top_n_train=50, rpn_pre_nms_top_n_test=50,
                      rpn_post_nms_top_n_test=20, box_batch_size_per_image=32, box_detections_per_img=10)


def _boxes(n, seed):
    """Images of two sizes, each with one bright square and its box."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        h, w = (64, 80) if i % 2 else (80, 64)
        image = torch.rand(3, h, w, generator=g) * 0.1
        x0, y0 = int(torch.randint(0, w - 30, (1,), generator=g)), int(torch.randint(0, h - 30, (1,), generator=g))
        image[:, y0:y0 + 24, x0:x0 + 24] += 0.8
        target = {"boxes": torch.tensor([[x0, y0, x0 + 24, y0 + 24]], dtype=torch.float32), "labels": torch.tensor([1])}
        out.append((image, target))
    return out


def test_a_torchvision_faster_rcnn_trains_with_list_targets_and_two_image_sizes(tmp_path):
    torch.manual_seed(0)
    model = _detector()
    trainer = Trainer(model, None, functools.partial(torch.optim.SGD, lr=0.02, momentum=0.9),
                      collate_fn=lambda items: tuple(zip(*items)), metrics_fn=xlatrain.DetectionMAP(),
                      config=TrainConfig(epochs=3, batch_size=4, run_dir=str(tmp_path), monitor="val_map50",
                                         tensorboard=False),
                      accelerator="cpu")
    history = trainer.fit(_boxes(16, 0), _boxes(6, 1))
    row = history[-1]
    # The detector's loss dict: summed, each term a column; detections scored by mAP@0.5.
    assert {"train_loss_classifier", "train_loss_box_reg", "train_loss_objectness", "train_loss_rpn_box_reg"} <= set(row)
    assert row["train_loss"] == pytest.approx(sum(row[k] for k in row if k.startswith("train_loss_")), rel=1e-5)
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert 0.0 <= row["val_map50"] <= 1.0 and "val_loss" not in row  # eval mode returns detections, not losses
    report = json.loads((tmp_path / "diagnostics.json").read_text())
    assert any("distinct in train" in note for note in report["notes"])  # two image sizes: said


def test_detection_map_scores_matches_at_the_iou_threshold():
    metric = xlatrain.DetectionMAP()
    truth = [{"boxes": torch.tensor([[0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0]]), "labels": torch.tensor([1, 1])}]
    found = [{"boxes": torch.tensor([[0.0, 0.0, 10.0, 10.0], [50.0, 50.0, 60.0, 60.0], [21.0, 21.0, 31.0, 31.0]]),
              "scores": torch.tensor([0.9, 0.8, 0.7]), "labels": torch.tensor([1, 1, 1])}]
    metric.update(found, truth)
    # Ranked: hit (P 1, R .5), miss, hit (P 2/3, R 1): AP = .5 * 1 + .5 * 2/3.
    assert metric.compute()["map50"] == pytest.approx(0.5 + 0.5 * 2 / 3)
    strict = xlatrain.DetectionMAP(iou_threshold=0.9)
    strict.update(found, truth)
    assert strict.compute()["map90"] == pytest.approx(0.5)  # the shifted box no longer matches


HF_LM_FIT = str(SCRIPTS / "hf_lm_fit.py")


@pytest.mark.multiprocess
def test_gpt2_under_torchrun_fsdp_stops_on_sigterm_and_resumes_the_uninterrupted_run(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    launcher = (torchrun, "--nproc-per-node", "2", "--standalone")
    whole = run_script([*launcher, HF_LM_FIT, str(tmp_path / "whole"), "2", "fsdp", "0"])
    cut = tmp_path / "cut"
    proc = subprocess.Popen([*launcher, HF_LM_FIT, str(cut), "2", "fsdp", "0.05"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=script_env(), stdin=subprocess.DEVNULL)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "epoch 1 step 3/" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(seen) + proc.communicate(timeout=300)[0]
    assert "SIGTERM: stopped after epoch 1 step" in out, out
    assert (cut / "checkpoints").is_dir() and not (cut / "history.json").exists() or "epoch 1/2" not in out
    resumed = run_script([*launcher, HF_LM_FIT, str(cut), "2", "fsdp", "0"])
    for a, b in zip(resumed, whole):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)


def test_gpt2_under_torch_compile_reports_the_shapes_it_compiled(tmp_path):
    run_script([sys.executable, HF_LM_FIT, str(tmp_path), "1", "single", "0", "compile"], timeout=600)
    report = json.loads((tmp_path / "diagnostics.json").read_text())
    events = report["torch_compile"]["events"]
    # Lengths 6 and 12 padded to 8 and 16: the sequence dimension's change is named with both sizes.
    shapes = [e["guard_failed"] for e in events if e["guard_failed"] and "size mismatch at index 1" in e["guard_failed"]]
    assert any("expected 16, actual 8" in g or "expected 8, actual 16" in g for g in shapes), events
    assert any("2 distinct in train" in note for note in report["notes"]), report["notes"]
    # GPT2LMHeadModel's class name maps to no transformers loss type: its loss_function logged a
    # warning inside forward at every trace, splitting the graph (12 compilations in warm-up, not 2).
    # The Trainer sets the loss type transformers falls back to, and nothing splits.
    assert not [f["title"] for f in report["findings"] if f["code"] == "graph-break"], report["findings"]


def test_a_hugging_face_models_loss_type_is_settled_under_compile_only_where_transformers_would_fall_back():
    from xlatrain.train.model_io import settle_loss_lookup

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                                                n_positions=32, bos_token_id=0, eos_token_id=0))
    assert gpt2.loss_type is None
    note = settle_loss_lookup(gpt2)
    assert gpt2.loss_type == "ForCausalLM" and "GPT2LMHeadModel.loss_type None -> 'ForCausalLM'" in note
    assert gpt2.loss_function is transformers.loss.loss_utils.LOSS_MAPPING["ForCausalLM"]  # the fallback's own loss
    bert = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=64)
    classifier = transformers.BertForSequenceClassification(transformers.BertConfig(**bert))
    assert settle_loss_lookup(classifier) is None and classifier.loss_type == "ForSequenceClassification"
    # One whose forward never calls loss_function, and one whose loss the user set, keep theirs.
    pretraining = transformers.BertForPreTraining(transformers.BertConfig(**bert))
    assert settle_loss_lookup(pretraining) is None and pretraining.loss_type is None
    gpt2 = transformers.GPT2LMHeadModel(gpt2.config)
    gpt2.loss_function = nn.functional.cross_entropy
    assert settle_loss_lookup(gpt2) is None and gpt2.loss_type is None
    # The Trainer settles it under compile=True on the model's own loss only: with a loss_fn the
    # model gets no labels and never calls its loss_function.
    for loss_fn, compiled, settled in ((None, True, "ForCausalLM"), (nn.CrossEntropyLoss(), True, None), (None, False, None)):
        gpt2 = transformers.GPT2LMHeadModel(gpt2.config)
        Trainer(gpt2, loss_fn, torch.optim.SGD, config=TrainConfig(compile=compiled), accelerator="cpu")
        assert gpt2.loss_type == settled, (loss_fn, compiled)


def test_a_torchmetrics_metric_is_fed_each_batch_real_rows_and_computed_once(tmp_path):
    torchmetrics = pytest.importorskip("torchmetrics")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(60, 6, generator=g), torch.randint(0, 3, (60,), generator=g)
    train, val = torch.utils.data.TensorDataset(x[:40], y[:40]), torch.utils.data.TensorDataset(x[40:], y[40:])
    metric = torchmetrics.classification.MulticlassF1Score(num_classes=3, average="macro")
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    history = _trainer(model, nn.CrossEntropyLoss(), tmp_path, epochs=1, batch_size=8, metrics_fn=metric).fit(train, val)
    # 20 validation rows in batches of 8: the last batch's 4 padding rows never reach the metric.
    model.eval()
    with torch.no_grad():
        expected = torchmetrics.functional.classification.multiclass_f1_score(model(x[40:]), y[40:], 3, average="macro")
    assert history[0]["val_multiclass_f1_score"] == pytest.approx(float(expected), rel=1e-6)


def _padded(items):
    """A Hugging Face style collate: each batch padded to its own longest sequence."""
    longest = max(len(item["input_ids"]) for item in items)

    def pad(t, value):
        return torch.cat([t, torch.full((longest - len(t),), value, dtype=t.dtype)])
    return {"input_ids": torch.stack([pad(i["input_ids"], 0) for i in items]),
            "attention_mask": torch.stack([pad(torch.ones_like(i["input_ids"]), 0) for i in items]),
            "labels": torch.stack([pad(i["input_ids"], -100) for i in items])}


def test_a_causal_lm_gets_tokens_per_second_from_its_input_ids_and_mfu_at_each_batchs_length(tmp_path, caplog):
    """A Hugging Face causal LM says no tokens per sample: tokens/s counts each training batch's
    input_ids positions (padding included) as the loop takes it, and the FLOPs counted on the dry
    run's batch scale to each batch's length, so batches padded to their own longest sequence are
    not all measured at the first one's length."""
    import logging

    caplog.set_level(logging.INFO, logger="xlatrain")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    items = [{"input_ids": torch.randint(1, 64, (int(n),), generator=g)}
             for n in torch.randint(4, 29, (96,), generator=g)]
    lengths = []  # each training forward's padded length
    model.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]) if m.training else None, with_kwargs=True)
    trainer = _trainer(model, None, tmp_path / "run", collate_fn=_padded, config={"num_workers": 0, "log_every": 3})
    history = trainer.fit(items)
    assert "tokens/s: each batch's input_ids positions (padding included)" in caplog.text
    assert "input_ids positions (scaled to each batch's)" in caplog.text
    # Epoch 2 has no warm-up: its window is all 12 of its steps, the last 12 forwards.
    per_row = [r["tokens_per_s"] / r["samples_per_s"] for r in history]
    assert per_row[1] == pytest.approx(sum(lengths[-12:]) / 12, rel=2e-3), (per_row, lengths[-12:])
    # MFU follows the tokens, not the samples: the FLOPs per sample the dry run counted at its
    # batch's length, scaled to the window's mean length.
    rate = trainer.throughput
    counted_at = rate.flops_at_tokens
    from xlatrain.train.perf import PROFILE_SAMPLES  # the dry run's rows: the first ones, padded together
    assert counted_at == max(len(item["input_ids"]) for item in items[:PROFILE_SAMPLES]) and abs(per_row[1] / counted_at - 1) > 0.05, (counted_at, per_row)
    for r, row_tokens in zip(history, per_row):
        by_tokens = r["samples_per_s"] * rate.flops_per_sample * row_tokens / counted_at / rate.peak_per_device
        assert r["mfu"] == pytest.approx(by_tokens, rel=2e-3), (r, by_tokens)
    # The progress lines say tokens/s too.
    assert any("tokens/s" in line and "step" in line for line in caplog.text.splitlines())
