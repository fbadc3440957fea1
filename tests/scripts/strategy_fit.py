"""A small model of repeated blocks, with a tied embedding, trained under a chosen strategy.

Usage: python strategy_fit.py RUN_DIR ACCELERATOR STRATEGY EPOCHS PER_DEVICE_BATCH [key=value ...] [--then JOB ...]
Each ``--then`` starts another job (the same arguments) in the same processes, after the one
before it: one launch of torch, xlatrain and the process group for several fits. Before each job
of such a batch the main process prints ``JOB n``. hosts= and slow_part= (which change the
process's environment and storage) are for a job of its own.
keys: hosts=DIR (each process keeps its local files in DIR/host<n>, as if on a host of its own; per_host=K puts K
processes on each: n = rank // K; slow_part=R: process R sends its checkpoint parts 0.5 s late)  opt=adamw (default SGD with momentum)  accum=N  clip=X  precision=bf16  every=N (checkpoint every N optimizer steps)  meta=1
(build on the meta device)  ac=1 (activation checkpointing)  ema=D (an EMA of the weights with that decay)  predict=1  final=1 (save the final
weights)  devices=N
The main process prints HISTORY (per-epoch rows), FACTS (per process: what it holds), MEMORY (per
process: the memory plan made before the first step and the real state bytes after a backward
pass) and, with predict=1, PREDICT (the validation outputs in dataset order).
"""

import functools
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain

VOCAB, DIM, LENGTH = 16, 32, 6


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TiedNet(nn.Module):
    """Tokens -> embedding -> 3 blocks -> logits through the embedding's weight, mean over positions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h).mean(dim=1)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    return TensorDataset(tokens, tokens[:, 0])


def main() -> None:
    jobs: list[list[str]] = [[]]
    for arg in sys.argv[1:]:
        if arg == "--then":
            jobs.append([])
        else:
            jobs[-1].append(arg)
    for n, job in enumerate(jobs):
        if len(jobs) > 1:
            assert not any(a.startswith(("hosts=", "slow_part=")) for a in job), "hosts= and slow_part= need a job of their own"
            if os.environ.get("RANK", "0") == "0":
                print(f"JOB {n}", flush=True)
        fit(job)


def fit(args: list[str]) -> None:
    run_dir, accelerator, strategy, epochs, batch = args[:5]
    opts = dict(arg.split("=", 1) for arg in args[5:])
    if "hosts" in opts:  # a run directory on object storage: each process's working copy on a disk of its own
        host = int(os.environ.get("RANK", "0")) // int(opts.get("per_host", 1))
        os.environ["XLATRAIN_CACHE_DIR"] = f"{opts['hosts']}/host{host}"
    if opts.get("slow_part") == os.environ.get("RANK", "0"):  # the others of its host are done by then
        import time

        from xlatrain import storage

        upload = storage.upload
        storage.upload = lambda local, url: (time.sleep(0.5) if "/shards/__" in url else None, upload(local, url))[1]
    torch.manual_seed(0)
    if opts.get("meta") == "1":
        with torch.device("meta"):
            model = TiedNet()
    else:
        model = TiedNet()
    trainer = xlatrain.Trainer(
        model,
        nn.CrossEntropyLoss(),
        functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.01) if opts.get("opt") == "adamw"
        else functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        config=xlatrain.TrainConfig(
            epochs=int(epochs), batch_size=int(batch), run_dir=run_dir, log_every=1000,
            grad_accum_steps=int(opts.get("accum", 1)), precision=opts.get("precision", "32"),
            clip_grad_norm=float(opts["clip"]) if "clip" in opts else None,
            ema_decay=float(opts["ema"]) if "ema" in opts else None,
        ),
        checkpoint=xlatrain.CheckpointConfig(every_steps=int(opts["every"]) if "every" in opts else None, keep_last=100),
        backend=xlatrain.BackendConfig(
            accelerator=accelerator, strategy=strategy, devices=int(opts["devices"]) if "devices" in opts else None,
            activation_checkpointing=opts.get("ac") == "1",
        ),
    )
    history = trainer.fit(data(192, 1), data(40, 2))
    st = trainer.strategy
    module = st.unwrap(trainer.model)
    holds = st.state_bytes(trainer.model, trainer.optimizer)
    facts = st.gather_objects({
        "process": st.process_index,
        "strategy": st.name,
        "holds": holds,
        "whole_parameters": sum(t.numel() * t.element_size() for t in {id(p): p for p in module.parameters()}.values()),
        "tied": module.head.weight is module.embed.weight,
        "parameter_types": sorted({type(p).__name__ for p in module.parameters()}),
        "units": getattr(st, "units", []),
    })
    outputs = trainer.predict(data(40, 2)) if opts.get("predict") == "1" else None
    if opts.get("final") == "1":
        trainer.save_weights(f"{run_dir}/final.safetensors")
    # What the memory plan said before the first step, beside the real tensors once a backward
    # pass has made gradients (the Trainer's own steps drop them at once).
    tokens, targets = data(4, 3).tensors
    nn.CrossEntropyLoss()(trainer.model(tokens.to(trainer.runtime.device)), targets.to(trainer.runtime.device)).backward()
    trainer.runtime.step_end()
    plan = trainer.memory_plan.as_dict()
    memory = st.gather_objects({
        "plan": {k: plan[k] for k in ("parameters", "gradients", "optimizer", "optimizer_source", "gathered")},
        "real": st.state_bytes(trainer.model, trainer.optimizer),
    })
    trainer.optimizer.zero_grad(set_to_none=True)
    if st.is_main:
        print("MEMORY " + json.dumps(memory))
        print("HISTORY " + json.dumps(history))
        print("FACTS " + json.dumps(facts))
        if outputs is not None:
            print("PREDICT " + json.dumps(outputs.tolist()))


if __name__ == "__main__":
    main()
