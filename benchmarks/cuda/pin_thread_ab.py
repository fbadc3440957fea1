"""Batches page-locked on the training thread (as before ``_PinThread``) against the pinning thread,
alternating rounds in one process, each against the device-resident step. Its output is section 3
of NVIDIA-H100.log. Run from the repository root: ``python benchmarks/cuda/pin_thread_ab.py``
(``ROUNDS=N``; ``DIAG_DEV=cpu`` for a smoke run on the CPU).
"""
import json, os, sys, tempfile
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "src"))
from benchmarks import gpu_pipeline as gp
from xlatrain.data import shards

Thread = shards._PinThread
class InMain:
    """The earlier behaviour: each batch page-locked on the consumer's thread when asked for."""
    def __init__(self, source, depth=2): self._s = source
    def __iter__(self): return self
    def __next__(self):
        images, targets, valid, skipped = next(self._s)
        return (*shards._host_batch(images, targets, pin=True), valid, skipped)
    def close(self): pass

DEV = os.environ.get("DIAG_DEV", "cuda")
rows = {"main": [], "thread": [], "resident": []}
with tempfile.TemporaryDirectory() as root:
    trainer, parts = gp._recipe(root, gp.RECIPE if DEV == "cuda" else gp.SMOKE, DEV)
    trainer.fit(parts.train_data, parts.val_data, resume="overwrite")
    for r in range(int(os.environ.get("ROUNDS", "4"))):
        for mode in (["main", "thread"] if r % 2 == 0 else ["thread", "main"]):
            shards._PinThread = Thread if mode == "thread" else InMain
            row = trainer.fit(parts.train_data, parts.val_data, resume="overwrite")[-1]
            rep = json.loads((trainer.run_dir / "diagnostics.json").read_text())
            rows[mode].append((row["samples_per_s"], round(rep["input_bound_share"], 4)))
        rows["resident"].append(round(gp._resident(trainer, DEV, gp.STEPS if DEV == "cuda" else 3), 1))
        print("round", r, json.dumps({k: v[-1] for k, v in rows.items()}), flush=True)
out = {k: v for k, v in rows.items()}
out["thread_over_main"] = [round(t[0] / m[0], 3) for t, m in zip(rows["thread"], rows["main"])]
out["thread_over_resident"] = [round(t[0] / x, 3) for t, x in zip(rows["thread"], rows["resident"])]
out["main_over_resident"] = [round(m[0] / x, 3) for m, x in zip(rows["main"], rows["resident"])]
print("summary", json.dumps(out), flush=True)
