"""A Trainer-shaped loop on XLA:CPU, traced through StepTrace or not, printing its losses.

    python profile_xla.py RUN_DIR [START STOP]

Prints ``HISTORY {"losses": [...], "summary": {...} | null}``; the losses are exact float32 values.
"""

import json
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from xlatrain.backend import select_backend
from xlatrain.backend.precision import Precision
from xlatrain.diagnostics.profile import StepTrace

NUM_STEPS = 7


def main() -> None:
    run_dir = sys.argv[1]
    steps = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else None
    backend = select_backend("xla")
    rt, st = backend.runtime, backend.strategy
    rt.seed_everything(0)
    model = st.prepare_model(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.3), nn.Linear(8 * 8 * 8, 3),
    ), Precision("32", rt.autocast_device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    host = [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(NUM_STEPS)]
    trace = StepTrace(run_dir, steps, trace_kind=rt.trace_kind, is_main=st.is_main, platform=rt.platform) if steps else None
    losses = []
    fetched = time.perf_counter()
    for n, (x, y) in enumerate(rt.wrap_loader(host, st.input_sharding), start=1):
        waited = time.perf_counter() - fetched
        if trace is not None:
            trace.before_step(n)
        rt.step_begin(n)  # dropout's device randomness, as the Trainer seeds it
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        rt.step_end()
        if trace is not None:
            trace.after_step(n, input_wait_s=waited)
        fetched = time.perf_counter()
    summary = trace.close() if trace is not None else None
    values = [float(v) for v in rt.read(losses)]
    print("HISTORY " + json.dumps({"losses": values, "summary": summary}))


if __name__ == "__main__":
    main()
