"""The training thread's cost per batch on CUDA (page-locking, the side-stream copy, the shard
iterator) and whether the device-resident step is bound by the Python thread launching it (the
time to launch one step against its synchronized time). A probe that wraps xlatrain internals,
written against the shard reader before ``_PinThread``; its output is section 2 of
NVIDIA-H100.log. Run from the repository root: ``python benchmarks/cuda/launch_bound.py``.
"""
import json, os, sys, tempfile, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "src"))
import torch
from torch import nn
from benchmarks import gpu_pipeline as gp
from xlatrain.data import shards
from xlatrain.backend import native

acc = {"pin": [], "copy": [], "source_next": [], "prefetch_next": []}
orig_pin = torch.Tensor.pin_memory
def pin(self, *a, **k):
    t = time.perf_counter(); r = orig_pin(self, *a, **k); acc["pin"].append(time.perf_counter() - t); return r
torch.Tensor.pin_memory = pin
orig_copy = native._DeviceFeed._copy
def copy(self, t):
    s = time.perf_counter(); r = orig_copy(self, t); acc["copy"].append(time.perf_counter() - s); return r
native._DeviceFeed._copy = copy
orig_iterate = shards.ShardDataset._iterate
def iterate(self, tasks, training, generation):
    it = orig_iterate(self, tasks, training, generation)
    while True:
        t = time.perf_counter()
        try: b = next(it)
        except StopIteration: return
        if training: acc["source_next"].append(time.perf_counter() - t)
        yield b
shards.ShardDataset._iterate = iterate
orig_iter = native._CudaPrefetcher.__iter__
def piter(self):
    it = orig_iter(self)
    while True:
        t = time.perf_counter()
        try: b = next(it)
        except StopIteration: return
        acc["prefetch_next"].append(time.perf_counter() - t)
        yield b
native._CudaPrefetcher.__iter__ = piter

def ms(xs):
    xs = sorted(xs[5:]) if len(xs) > 10 else sorted(xs)
    return {"n": len(xs), "p50_ms": round(1e3 * xs[len(xs)//2], 3), "p90_ms": round(1e3 * xs[int(.9*len(xs))], 3), "sum_s": round(sum(xs), 4)} if xs else {}

with tempfile.TemporaryDirectory() as root:
    trainer, parts = gp._recipe(root, gp.RECIPE, "cuda")
    trainer.fit(parts.train_data, parts.val_data, resume="overwrite")
    for r in range(2):
        for v in acc.values(): v.clear()
        row = trainer.fit(parts.train_data, parts.val_data, resume="overwrite")[-1]
        print("breakdown", json.dumps({"samples_per_s": row["samples_per_s"], **{k: ms(v) for k, v in acc.items()}}), flush=True)
    model = trainer.strategy.unwrap(trainer.model); model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    images = torch.randint(0, 255, (64, 1, 256, 256), dtype=torch.uint8, device="cuda").contiguous(memory_format=torch.channels_last)
    targets = torch.rand(64, 10, device="cuda").round(); loss_fn = nn.BCEWithLogitsLoss()
    def step():
        with trainer.precision.autocast():
            loss = loss_fn(model(images).float(), targets)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    for _ in range(5): step()
    torch.cuda.synchronize()
    launch, total = [], []
    for _ in range(30):
        torch.cuda.synchronize(); t = time.perf_counter(); step(); l = time.perf_counter() - t; torch.cuda.synchronize(); launch.append(l); total.append(time.perf_counter() - t)
    print("resident step", json.dumps({"launch_ms_p50": round(1e3 * sorted(launch)[15], 2), "synced_step_ms_p50": round(1e3 * sorted(total)[15], 2)}), flush=True)
    # GPU time alone: a CUDA graph of the step would need static setup; instead time 30 steps queued back to back.
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(30): step()
    l = time.perf_counter() - t; torch.cuda.synchronize(); tt = time.perf_counter() - t
    print("resident 30 queued", json.dumps({"launch_s": round(l, 3), "total_s": round(tt, 3), "img_per_s": round(30 * 64 / tt, 1)}), flush=True)
    x = torch.empty(64, 1, 256, 256, dtype=torch.uint8)
    for _ in range(5): orig_pin(x)
    t = time.perf_counter()
    for _ in range(50): orig_pin(x)
    print("pin 4MB alone ms", round(1e3 * (time.perf_counter() - t) / 50, 3), flush=True)
