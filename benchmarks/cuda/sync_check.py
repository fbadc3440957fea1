"""Which host reads a Trainer epoch of gpu_lm's 85M case makes on CUDA: the second of two fits
under torch's sync debug mode, each read counted by its xlatrain frames. Run from the repository
root: ``PYTHONPATH=src:. python benchmarks/cuda/sync_check.py``. Section 2 of
NVIDIA-H200-2026-11-28.log is its output (at 9678079: reads before the first step and at the
epoch's end, none in a step)."""
import collections, functools, tempfile, traceback, warnings, torch
import benchmarks.gpu_lm as g
from xlatrain import CheckpointConfig, TrainConfig, Trainer
size = g.SIZES["85m"]
data = g._data(size["batch"], g.STEPS, g.CONTEXT)
seen = collections.Counter()
def show(message, category, filename, lineno, file=None, line=None):
    frames = [f"{f.filename.split('/src/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
              if "xlatrain" in f.filename]
    seen[" <- ".join(frames[::-1][:4]) + " | " + str(message)[:60]] += 1
with tempfile.TemporaryDirectory() as run_dir:
    trainer = Trainer(g._model(size, g.CONTEXT, __import__("os").environ.get("AB_DEV", "cuda")), g._loss, functools.partial(torch.optim.AdamW, lr=g.LR),
        config=TrainConfig(epochs=1, batch_size=size["batch"], precision="bf16", log_every=g.STEPS + 1,
            clip_grad_norm=g.CLIP, run_dir=run_dir, task="none", tensorboard=False, diagnostics=False, save_best=False),
        checkpoint=CheckpointConfig(enabled=False), accelerator=__import__("os").environ.get("AB_DEV", "cuda"))
    trainer.fit(data, resume="overwrite")
    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode(1)
    trainer.fit(data, resume="overwrite")
    torch.cuda.set_sync_debug_mode(0)
for k, n in seen.most_common(40):
    print("SYNC", n, k)
