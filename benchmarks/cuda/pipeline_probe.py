"""Where the PE recipe's images/s go on CUDA, beside the device-resident loop: the Trainer at its
defaults (15 decode workers on a 16-CPU host) and with 4, a hand loop over the same shard reader
(its pinning thread, a non-blocking copy, the device-resident side's step), and the
device-resident loop, alternating in one process. Per side: images/s over the steps after two of
warm-up, and the training thread's milliseconds per step spent fetching the batch and launching
the step (the step is launch-bound: what that thread spends is what the GPU waits), and the
garbage collections in the window. Prints the host's CPU topology first. Run from the repository
root: ``python benchmarks/cuda/pipeline_probe.py`` (``STUDIES=N``, ``ROUNDS=N``; ``DIAG_DEV=cpu``
for a smoke run on the CPU).
"""
import gc, json, os, statistics, subprocess, sys, tempfile, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "src"))
import torch
from torch import nn
from benchmarks import gpu_pipeline as gp
from benchmarks.gpu_common import sync
from xlatrain.train import trainer as trainer_mod

DEV = os.environ.get("DIAG_DEV", "cuda")
STUDIES = int(os.environ.get("STUDIES", "240"))
ROUNDS = int(os.environ.get("ROUNDS", "4"))
WARM = 2

try:
    topo = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    print("lscpu", json.dumps({k.strip(): v.strip() for k, v in (l.split(":", 1) for l in topo.splitlines() if ":" in l)
                               if k.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket",
                                                "Socket(s)", "NUMA node(s)", "CPU max MHz", "Hypervisor vendor")}), flush=True)
except Exception as exc:  # noqa: BLE001
    print("lscpu", repr(exc), flush=True)
print("affinity", len(os.sched_getaffinity(0)), flush=True)

step_s: list[float] = []
original_step = trainer_mod.Trainer._train_step


def timed_step(self, *args, **kwargs):
    t = time.perf_counter()
    try:
        return original_step(self, *args, **kwargs)
    finally:
        step_s.append(time.perf_counter() - t)


trainer_mod.Trainer._train_step = timed_step
collections: list[int] = []
gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)


def trainer_side(trainer, train, val):
    step_s.clear(); collections.clear()
    row = trainer.fit(train, val, resume="overwrite")[-1]
    rep = json.loads((trainer.run_dir / "diagnostics.json").read_text())
    ep = rep.get("epochs", [{}])[-1] if isinstance(rep.get("epochs"), list) else {}
    steps = len(step_s)
    return {"images_s": row["samples_per_s"], "wait_share": round(rep["input_bound_share"], 4),
            "launch_ms": round(1e3 * statistics.mean(step_s[WARM:]), 2),
            "fetch_ms": round(1e3 * ep.get("input_wait_s", float("nan")) / max(steps, 1), 2),
            "gc": [collections.count(g) for g in range(3)]}


def loop(trainer, batches, steps, batch_rows):
    """The device-resident side's step over ``batches`` (an iterator of device batches, or None for
    the one resident batch); returns images/s after WARM steps and per-step fetch and launch ms."""
    model = trainer.strategy.unwrap(trainer.model)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, **({"fused": True} if trainer.optimizer.defaults.get("fused") else {}))
    loss_fn = nn.BCEWithLogitsLoss()
    size = trainer._feed.dataset.image_size
    resident = torch.randint(0, 255, (batch_rows, 1, *size), dtype=torch.uint8, device=DEV)
    if trainer.channels_last:
        resident = resident.contiguous(memory_format=torch.channels_last)
    resident_targets = torch.rand(batch_rows, 10, device=DEV).round()
    fetch, launch = [], []
    step_s.clear(); collections.clear()
    started = None
    for i in range(steps):
        if i == WARM:
            sync(DEV); started = time.perf_counter(); collections.clear()
        t0 = time.perf_counter()
        if batches is None:
            images, targets = resident, resident_targets
        else:
            host_images, host_targets = next(batches)
            images = host_images.to(DEV, non_blocking=True)
            targets = host_targets.to(DEV, non_blocking=True)
            if trainer.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
        t1 = time.perf_counter()
        with trainer.precision.autocast():
            loss = loss_fn(model(images).float(), targets.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if i >= WARM:
            fetch.append(t1 - t0); launch.append(t2 - t1)
    sync(DEV)
    return {"images_s": round((steps - WARM) * batch_rows / (time.perf_counter() - started), 1),
            "launch_ms": round(1e3 * statistics.mean(launch), 2), "fetch_ms": round(1e3 * statistics.mean(fetch), 2),
            "gc": [collections.count(g) for g in range(3)]}


overrides = [o for o in (gp.RECIPE if DEV == "cuda" else gp.SMOKE) if not o.startswith("data.num_studies")]
overrides.append(f"data.num_studies={STUDIES if DEV == 'cuda' else 6}")
rows: dict[str, list] = {}
with tempfile.TemporaryDirectory() as root:
    t = time.perf_counter()
    trainer, parts = gp._recipe(root, overrides, DEV)
    trainer.fit(parts.train_data, parts.val_data, resume="overwrite")
    print("setup_s", round(time.perf_counter() - t, 1), "steps", trainer._feed.steps_per_epoch,
          "workers", trainer._feed.num_workers, trainer._feed.workers_reason, flush=True)
    steps = trainer._feed.steps_per_epoch
    rows_b = trainer.config.batch_size
    few = parts.train_data.subset(range(len(parts.train_data)), num_workers=4)
    trainer.fit(few, parts.val_data, resume="overwrite")  # starts its workers
    sides = ["trainer", "resident", "hand", "trainer_w4"]
    for r in range(ROUNDS):
        order = sides[r % len(sides):] + sides[:r % len(sides)]
        if r % 2:
            order.reverse()
        for side in order:
            if side == "trainer":
                figures = trainer_side(trainer, parts.train_data, parts.val_data)
            elif side == "trainer_w4":
                figures = trainer_side(trainer, few, parts.val_data)
            elif side == "resident":
                figures = loop(trainer, None, steps, rows_b)
            else:
                batches = parts.train_data.train_batches(loader_batch=rows_b, num_processes=1, process_index=0,
                                                         seed=r, epoch=1)
                figures = loop(trainer, batches, steps, rows_b)
                batches.close()
            rows.setdefault(side, []).append(figures)
            print("round", r, side, json.dumps(figures), flush=True)
summary = {side: {k: [row[k] for row in got] for k in ("images_s", "launch_ms", "fetch_ms")} for side, got in rows.items()}
for side in summary:
    summary[side]["over_resident"] = [round(a / b, 3) for a, b in zip(summary[side]["images_s"], summary["resident"]["images_s"])]
print("summary", json.dumps(summary), flush=True)
