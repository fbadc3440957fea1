"""The PE recipe at gpu_pipeline's settings with a few steps traced: what the profile summary says
of them (on CUDA: the share of their time the GPU worked, the kernels a step launched and their mean
length, and whether the host set the pace). Run from the repository root:
``python benchmarks/cuda/pe_profile.py`` (``STUDIES=N``, ``STEPS=FIRST,LAST``, 20,25 on CUDA; ``DIAG_DEV=cpu`` for a
smoke run on the CPU, whose trace holds no device work). Prints one JSON line.
"""
import json, os, sys, tempfile
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "src"))
from benchmarks import gpu_pipeline as gp

DEV = os.environ.get("DIAG_DEV", "cuda")
first, last = (int(n) for n in os.environ.get("STEPS", "20,25" if DEV == "cuda" else "2,3").split(","))
overrides = [o for o in (gp.RECIPE if DEV == "cuda" else gp.SMOKE) if not o.startswith("data.num_studies")]
overrides += [f"data.num_studies={os.environ.get('STUDIES', '240') if DEV == 'cuda' else 12}",
              f"trainer.profile_steps=[{first},{last}]"]
with tempfile.TemporaryDirectory() as root:
    trainer, parts = gp._recipe(root, overrides, DEV)
    row = trainer.fit(parts.train_data, parts.val_data, resume="overwrite")[-1]
    summary = json.loads((trainer.run_dir / "profile" / "summary.json").read_text())
print("pe_profile", json.dumps({
    "samples_per_s": row["samples_per_s"], "steps": summary["steps"], "ms_per_step": summary["ms_per_step"],
    "input_wait_share": summary["input_wait_share"], "device": summary.get("device"), "notes": summary["notes"],
    "top_ops": [(o["name"][:60], o["total_ms"], o["calls"]) for o in summary["top_ops"][:8]]}), flush=True)
