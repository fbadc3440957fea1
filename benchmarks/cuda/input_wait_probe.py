"""Where the PE recipe's input wait goes on CUDA: each step's wait for its batch, the time the
training thread spent blocked on the decode workers, the workers' start-up, and the device-resident
step in eval and training mode. A probe, not a benchmark entry: it wraps xlatrain internals to time
them. Written against the shard reader that page-locked batches on the training thread (before
``_PinThread``); its output is section 1 of NVIDIA-H100.log. Run from the repository root:
``python benchmarks/cuda/input_wait_probe.py [override ...]`` (``DIAG_DEV=cpu`` for a smoke run).
"""
import json, os, sys, tempfile, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "src"))
import torch
from benchmarks import gpu_pipeline as gp
from xlatrain.data import shards
from xlatrain.diagnostics import run as drun

rec = {"recv": [], "waits": [], "fork": []}
orig_recv, orig_init, orig_timed = shards._Workers._receive, shards._Workers.__init__, drun.RunDiagnostics.timed
def recv(self, w, s):
    t = time.perf_counter(); r = orig_recv(self, w, s); rec["recv"].append(time.perf_counter() - t); return r
def init(self, *a, **k):
    t = time.perf_counter(); orig_init(self, *a, **k); rec["fork"].append(time.perf_counter() - t)
def timed(self, batches, phase, epoch, first_step=1, **k):
    it = iter(orig_timed(self, batches, phase, epoch, first_step=first_step, **k))
    while True:
        t = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            return
        if phase == "train":
            rec["waits"].append(time.perf_counter() - t)
        yield b
shards._Workers._receive, shards._Workers.__init__, drun.RunDiagnostics.timed = recv, init, timed

def summary(xs):
    xs = sorted(xs)
    return {"n": len(xs), "sum": round(sum(xs), 4), "first": None, "p50_ms": round(1e3 * xs[len(xs)//2], 3), "p90_ms": round(1e3 * xs[int(len(xs)*.9)], 3), "max_ms": round(1e3 * xs[-1], 3)} if xs else {}

DEV = os.environ.get("DIAG_DEV", "cuda")
print("cpus", os.cpu_count(), len(os.sched_getaffinity(0)), torch.__version__, torch.cuda.get_device_name() if DEV == "cuda" else "cpu", flush=True)
extra = sys.argv[1:]
with tempfile.TemporaryDirectory() as root:
    trainer, parts = gp._recipe(root, [*(gp.RECIPE if DEV == "cuda" else gp.SMOKE), *extra], DEV)
    trainer.fit(parts.train_data, parts.val_data, resume="overwrite")
    for r in range(3):
        for k in rec: rec[k].clear()
        t0 = time.perf_counter()
        row = trainer.fit(parts.train_data, parts.val_data, resume="overwrite")[-1]
        fit_s = time.perf_counter() - t0
        rep = json.loads((trainer.run_dir / "diagnostics.json").read_text())
        w = list(rec["waits"])
        out = {"round": r, "samples_per_s": row["samples_per_s"], "epoch_time_s": row.get("epoch_time_s"), "fit_s": round(fit_s, 3),
               "warmup_s": row.get("warmup_s"), "share": rep["input_bound_share"], "epochs": rep["epochs"],
               "first_wait_s": round(w[0], 4) if w else None, "waits_after_first": summary(w[1:]), "waits_after_5": summary(w[5:]),
               "recv": summary(rec["recv"]), "fork_s": [round(x, 3) for x in rec["fork"]],
               "workers": trainer._feed.num_workers if trainer._feed else None}
        print("recipe", json.dumps(out), flush=True)
        model = trainer.strategy.unwrap(trainer.model)
        print("model mode after fit: training =", model.training, flush=True)
        model.eval(); ev = gp._resident(trainer, DEV, gp.STEPS if DEV == "cuda" else 3)
        model.train(); tr = gp._resident(trainer, DEV, gp.STEPS if DEV == "cuda" else 3)
        print("resident", json.dumps({"eval_mode": round(ev, 1), "train_mode": round(tr, 1)}), flush=True)
