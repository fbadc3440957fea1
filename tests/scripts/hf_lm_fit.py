"""A tiny Hugging Face GPT-2 trained on its own loss (loss_fn=None) with dict batches, as a user
writes it: run_dir epochs strategy sleep_s [compile]. Prints HISTORY (main process)."""

import functools
import json
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import xlatrain

hf_logging.set_verbosity_error()
run_dir, epochs, strategy, sleep_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
compiled = "compile" in sys.argv[5:]
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1 if compiled else 2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                   bos_token_id=0, eos_token_id=0))
g = torch.Generator().manual_seed(0)


def items(n, ragged):
    out = []
    for i in range(n):
        length = (12 if i % 8 == 0 else 6) if ragged else 16  # a batch with a long item pads to 16
        x = torch.randint(0, 64, (length,), generator=g)
        x[1::2] = x[: length // 2 * 2 : 2]
        out.append({"input_ids": x, "labels": x.clone()})
    return out


class Slow:
    """Gives a signal time to arrive mid-epoch."""

    def on_interval(self, trainer, values):
        time.sleep(sleep_s)


ragged = compiled  # compiled runs meet lengths 6 and 12, padded by the collate to 8 or 16 per batch
collate = xlatrain.PadCollate(pad_to_multiple_of=8) if ragged else None
trainer = xlatrain.Trainer(
    model, None, functools.partial(torch.optim.AdamW, lr=3e-3),
    config=xlatrain.TrainConfig(epochs=epochs, batch_size=4, log_every=1, run_dir=run_dir, compile=compiled,
                                tensorboard=False),
    accelerator="cpu", strategy=strategy, collate_fn=collate, callbacks=[Slow()] if sleep_s else None,
)
history = trainer.fit(items(24 if compiled else 48, ragged), items(4 if compiled else 12, ragged))
if trainer.is_main:
    print("HISTORY " + json.dumps(history), flush=True)
