"""Start-up on CUDA: the `startup` benchmark as it is, again with num_workers=0 (the hand loop's),
and a cProfile of one Trainer start. Its output (before num_workers="auto" left cheap data in the
training process, and before the meta optimizer step ran once per kind of parameter) is section 5 of
NVIDIA-H100.log. Run from the repository root: ``python benchmarks/cuda/startup_probe.py``
(``DIAG_DEV=cpu`` on the CPU).
"""
import cProfile, functools, io, json, os, pstats, sys, tempfile
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "src"))
from benchmarks import startup as s
from xlatrain import TrainConfig
dev = os.environ.get("DIAG_DEV", "cuda")
print("auto", json.dumps(s._measure(dev)), flush=True)
s.TrainConfig = functools.partial(TrainConfig, num_workers=0)
print("workers0", json.dumps(s._measure(dev)), flush=True)
s.TrainConfig = TrainConfig
data = s._data()
with tempfile.TemporaryDirectory() as tmp:
    s._trainer(data, f"{tmp}/w", dev)
    pr = cProfile.Profile(); pr.enable(); t = s._trainer(data, f"{tmp}/x", dev); pr.disable()
    print("profiled trainer start", round(t, 3), flush=True)
    st = io.StringIO(); pstats.Stats(pr, stream=st).sort_stats("cumulative").print_stats(45)
    print("\n".join(l[:160] for l in st.getvalue().splitlines() if l.strip()), flush=True)
