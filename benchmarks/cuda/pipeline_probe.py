"""Where the PE recipe's images/s go on CUDA, beside the device-resident loop, alternating in one
process: the Trainer at its defaults (each batch copied on a side stream, one batch ahead); a
hand loop over the same shard reader (its pinning thread, a non-blocking copy, the
device-resident side's step); the device-resident step while the reader's
batches are taken and dropped (``reader_idle``: what the reader's threads and processes cost the
launching thread, no copy); and the device-resident loop. Per side: images/s over the steps after
two of warm-up, held against the mean of the device-resident windows before and after it; the
training thread's milliseconds per step fetching the batch and launching the step (the step is
launch-bound: what that thread spends the GPU waits), after the warm-up; and the garbage
collections in the window. Prints the host's CPU topology first. Run from the repository root:
``python benchmarks/cuda/pipeline_probe.py`` (``STUDIES=N``, ``ROUNDS=N``; ``DIAG_DEV=cpu`` for a
smoke run on the CPU). Sections 6 and 9 of NVIDIA-H200-2026-11-27.log are earlier versions' output:
in section 9 ``plain`` copied on the compute stream (the Trainer's default from then until
2026-11-28, when the side stream came back: benchmarks/cuda/NVIDIA-H200-2026-11-28.log); section 6
compared 15 and 4 decode workers.
"""
import gc, json, os, statistics, subprocess, sys, tempfile, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "src"))
import torch
from torch import nn
from benchmarks import gpu_pipeline as gp
from benchmarks.gpu_common import sync
from xlatrain.backend import native
from xlatrain.train import trainer as trainer_mod

DEV = os.environ.get("DIAG_DEV", "cuda")
STUDIES = int(os.environ.get("STUDIES", "240"))
ROUNDS = int(os.environ.get("ROUNDS", "5"))
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
fetch_s: list[float] = []
original_step = trainer_mod.Trainer._train_step


def timed_step(self, *args, **kwargs):
    t = time.perf_counter()
    try:
        return original_step(self, *args, **kwargs)
    finally:
        step_s.append(time.perf_counter() - t)


trainer_mod.Trainer._train_step = timed_step


def timed_feed(kind):
    """``kind`` (a device feed class) with each batch's fetch timed on the training thread."""
    class Timed(kind):
        def __iter__(self):
            it = super().__iter__()
            while True:
                t = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                fetch_s.append(time.perf_counter() - t)
                yield batch
    return Timed


timed = timed_feed(native._CudaPrefetcher)
native._CudaPrefetcher = timed  # what the runtime wraps a CUDA loader in
collections: list[int] = []
gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)


def trainer_side(trainer, train, val):
    step_s.clear(); fetch_s.clear(); collections.clear()
    row = trainer.fit(train, val, resume="overwrite")[-1]
    rep = json.loads((trainer.run_dir / "diagnostics.json").read_text())
    return {"images_s": row["samples_per_s"], "wait_share": round(rep["input_bound_share"], 4),
            "launch_ms": round(1e3 * statistics.mean(step_s[WARM:]), 2),
            # None on the CPU, where the runtime hands the loader's batches over as they are
            "fetch_ms": round(1e3 * statistics.mean(fetch_s[WARM:]), 3) if len(fetch_s) > WARM else None,
            "first_fetch_ms": round(1e3 * fetch_s[0], 1) if fetch_s else None,
            "gc": [collections.count(g) for g in range(3)]}


def loop(trainer, batches, steps, batch_rows, use=True):
    """The device-resident side's step, over ``batches`` (the reader's pass; ``use=False``: each
    taken and dropped, the step on the resident batch) or on the one resident batch (None)."""
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
    collections.clear()
    started = None
    for i in range(steps):
        if i == WARM:
            sync(DEV); started = time.perf_counter(); collections.clear()
        t0 = time.perf_counter()
        images, targets = resident, resident_targets
        if batches is not None:
            host_images, host_targets = next(batches)
            if use:
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
            "launch_ms": round(1e3 * statistics.mean(launch), 2), "fetch_ms": round(1e3 * statistics.mean(fetch), 3),
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

    def reader(r):
        return parts.train_data.train_batches(loader_batch=rows_b, num_processes=1, process_index=0, seed=r, epoch=1)

    sides = ["trainer", "hand", "reader_idle"]
    resident = [loop(trainer, None, steps, rows_b)]
    for r in range(ROUNDS):
        order = sides[r % len(sides):] + sides[:r % len(sides)]
        for side in order:
            if side == "trainer":
                figures = trainer_side(trainer, parts.train_data, parts.val_data)
            else:
                batches = reader(r)
                figures = loop(trainer, batches, steps, rows_b, use=side == "hand")
                batches.close()
            resident.append(loop(trainer, None, steps, rows_b))
            figures["over_resident"] = round(figures["images_s"] / ((resident[-2]["images_s"] + resident[-1]["images_s"]) / 2), 3)
            rows.setdefault(side, []).append(figures)
            print("round", r, side, json.dumps(figures), "resident", json.dumps(resident[-1]), flush=True)
summary = {side: {k: [row[k] for row in got] for k in ("over_resident", "images_s", "launch_ms", "fetch_ms")}
           for side, got in rows.items()}
summary["resident"] = {k: [row[k] for row in resident] for k in ("images_s", "launch_ms")}
for side in rows:
    got = summary[side]["over_resident"]
    summary[side]["over_resident_min_median_max"] = [min(got), statistics.median(got), max(got)]
print("summary", json.dumps(summary), flush=True)
