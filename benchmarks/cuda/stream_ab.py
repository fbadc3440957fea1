"""gpu_lm's 85M case (eager, or compiled with AB_COMPILED=1) for each source tree given, in its own
process, against the same hand loop: ``python benchmarks/cuda/stream_ab.py SRC_DIR...`` from the
repository root (this checkout's benchmarks; each SRC_DIR a ``src`` folder, e.g. from
``git archive REV src``). ``AB_SIDE=N`` sets the CUDA feed's old ``SIDE_STREAM_BYTES`` (a tree from
2026-11-27 to 2026-11-28 copied page-locked batches under it on the compute stream; 0 sent every
batch to the side stream); ``AB_DEV=cpu`` runs a tiny model on the CPU. Sections 2 and 3 of
NVIDIA-H200-2026-11-28.log are its output."""
import os, subprocess, sys
code = r'''
import sys, json, torch
import benchmarks.gpu_lm as g
import xlatrain, os
if os.environ.get("AB_SIDE"):
    import xlatrain.backend.native as n; n.SIDE_STREAM_BYTES = int(os.environ["AB_SIDE"])
import os
size = g.SIZES["85m"] if os.environ.get("AB_DEV", "cuda") == "cuda" else dict(width=32, layers=1, heads=2, batch=2)
c = g._case(size, COMPILED, os.environ.get("AB_DEV", "cuda"), g.STEPS, g.ROUNDS, 16 if os.environ.get("AB_DEV") == "cpu" else g.CONTEXT)
print("AB", json.dumps({"src": xlatrain.__file__.split("/src/")[0][-12:], "compiled": COMPILED, "side": os.environ.get("AB_SIDE"),
      "ratio": c["ratio_per_round"], "tok": c["tokens_per_s"]}), flush=True)
'''
compiled = os.environ.get("AB_COMPILED", "0") == "1"
for src in sys.argv[1:]:
    env = dict(os.environ, PYTHONPATH=f"{os.path.abspath(src)}:{os.getcwd()}:{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-c", code.replace("COMPILED", str(compiled))], env=env,
                       capture_output=True, text=True, timeout=120)
    lines = [l for l in r.stdout.splitlines() if l.startswith("AB")]
    print(lines[0] if lines else f"AB {src} failed: {r.stderr[-1500:]}", flush=True)
