"""Start-up on CUDA, phase by phase: the `startup` benchmark's Trainer side with a timer around each
piece of work before the first optimizer step (the device synchronized at each boundary, so a
phase is charged for the kernels it queued), beside the hand loop's total. The model's build is
timed apart: the benchmark builds it before either clock starts. Run from the repository root:
``python benchmarks/cuda/startup_phases.py`` (``DIAG_DEV=cpu`` on the CPU). Prints one JSON line
per start: phase -> milliseconds. Section 1 of NVIDIA-H200-2026-11-27.log is its output from before
the build moved out of the clocks.
"""
import functools, json, os, sys, tempfile, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "src"))
from benchmarks import startup as s
from benchmarks.gpu_common import sync
from xlatrain.train import preflight, perf, feed as feed_mod, run_dir, resumable, trainer as trainer_mod
from xlatrain.backend import model_state

dev = os.environ.get("DIAG_DEV", "cuda")
spent: dict[str, float] = {}
marks: dict[str, float] = {}  # when each phase first began and ended: the gaps between them are untimed work
depth = [0]


def timed(owner, name, label=None):
    original = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        sync(dev)
        started = time.perf_counter()
        marks.setdefault(f"{label} first began", started)
        try:
            return original(*args, **kwargs)
        finally:
            sync(dev)
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - started
            marks.setdefault(f"{label} first ended", time.perf_counter())
    setattr(owner, name, wrapper)


for owner, name in [
    (trainer_mod.Trainer, "__init__"), (trainer_mod.Trainer, "_start"), (trainer_mod.Trainer, "_run_observers"),
    (trainer_mod.Trainer, "_epoch_start"), (trainer_mod.Trainer, "_train_step"),
    (run_dir.RunDirectory, "open"), (run_dir.RunDirectory, "write_status"), (run_dir.RunDirectory, "clear_earlier_run"),
    (feed_mod.TrainFeed, "__init__"), (preflight, "prepare"), (preflight, "_training_batch"), (preflight, "plan"),
    (preflight, "_measured_step"), (perf, "profile_step"), (model_state, "planned_state_bytes"), (resumable, "resume"),
    (trainer_mod.Trainer, "fit"), (trainer_mod.Trainer, "_say"), (preflight, "check_monitor"), (perf, "model_flops"),
    (trainer_mod, "RunDiagnostics"), (trainer_mod.Trainer, "_fit"),
]:
    timed(owner, name)
real_model = s._model


def built_model():
    sync(dev)
    t = time.perf_counter()
    m = real_model()
    spent["build model, before the clock"] = spent.get("build model, before the clock", 0.0) + time.perf_counter() - t
    return m


s._model = built_model
def copy_ms():
    """A fresh model's copy to the device alone: the part of both clocks that is the same work."""
    m = real_model()
    sync(dev)
    t = time.perf_counter()
    m.to(dev)
    sync(dev)
    return round(1e3 * (time.perf_counter() - t), 1)


data = s._data()
with tempfile.TemporaryDirectory() as tmp:
    s._hand(data, dev), s._trainer(data, f"{tmp}/w", dev)
    for r in range(3):
        spent.clear(); marks.clear()
        t = s._trainer(data, f"{tmp}/{r}", dev)
        trainer_phases = {k: round(1e3 * v, 1) for k, v in spent.items()}
        zero = marks.get("Trainer.__init__ first began", 0.0)
        trainer_phases["timeline"] = {k: round(1e3 * (v - zero), 1) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}
        spent.clear()
        hand_s, step_s = s._hand(data, dev)
        print("start", json.dumps({"trainer_ms": round(1e3 * t, 1), "hand_ms": round(1e3 * hand_s, 1),
                                   "step_ms": round(1e3 * step_s, 2), "trainer": trainer_phases,
                                   "hand_model_build_ms": round(1e3 * spent.get("build model, before the clock", 0), 1),
                                   "model_to_device_ms": copy_ms()}), flush=True)
