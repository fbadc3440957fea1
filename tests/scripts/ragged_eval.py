"""Validation and predict on two processes whose batches are padded to different lengths: in each
step process 0 reads 3-token items and process 1 10-token items, so a collate padding to a multiple
of 4 gives them 4 and 12 tokens. Each process then computes the token accuracy and the logits of
the whole validation set by hand with the trained weights; the main process writes both beside what
the Trainer's metrics_fn and predict gave to RUN_DIR/ragged.json.

Usage: torchrun --nproc-per-node 2 ragged_eval.py RUN_DIR
"""

import functools
import json
import os
import sys

import torch
from torch import nn

import xlatrain


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.embed(ids))  # [B, L, 3]


def token_loss(logits, labels):
    return nn.functional.cross_entropy(logits.transpose(1, 2), labels)  # -100 is ignored


def main() -> None:
    run_dir = sys.argv[1]
    g = torch.Generator().manual_seed(0)

    def item(n):
        ids = torch.randint(1, 20, (n,), generator=g)
        return ids, ids % 3

    train = [item(n) for n in [3, 5, 7, 9] * 4]
    # Batches of 4 per process: in each step of 8 items, process 0 reads the first 4, process 1 the next 4.
    val = [item(3 if i % 8 < 4 else 10) for i in range(20)]
    seen = []

    def token_accuracy(logits, labels):
        seen.append([list(logits.shape), list(labels.shape)])
        kept = labels != -100
        return {"token_accuracy": float((logits.argmax(-1)[kept] == labels[kept]).float().mean())}

    torch.manual_seed(0)
    trainer = xlatrain.Trainer(
        Tagger(), token_loss, functools.partial(torch.optim.SGD, lr=0.1), metrics_fn=token_accuracy,
        collate_fn=xlatrain.PadCollate(pad_to_multiple_of=4),
        config=xlatrain.TrainConfig(epochs=1, batch_size=4, run_dir=run_dir, tensorboard=False),
        checkpoint=xlatrain.CheckpointConfig(enabled=False), accelerator="cpu", strategy="ddp",
    )
    row = trainer.fit(train, val)[-1]
    predicted = trainer.predict(val)
    model = trainer.model
    model.eval()
    hits = total = 0
    error = 0.0
    with torch.no_grad():
        for i, (ids, labels) in enumerate(val):
            logits = model(ids[None])[0]
            hits, total = hits + int((logits.argmax(-1) == labels).sum()), total + len(labels)
            error = max(error, float((predicted[i, :len(ids)] - logits).abs().max()))
    # Process 0's batches hold 3-token items padded to 4: what predict adds beyond is -100.
    short = [i for i, (ids, _) in enumerate(val) if len(ids) == 3]
    if os.environ["RANK"] == "0":
        with open(f"{run_dir}/ragged.json", "w") as f:
            json.dump({"metric": row["val_token_accuracy"], "hand": hits / total, "seen": seen,
                       "predicted_shape": list(predicted.shape),
                       "predict_error": error,
                       "padded_with_-100": bool((predicted[short, 4:] == -100).all())}, f)


if __name__ == "__main__":
    main()
