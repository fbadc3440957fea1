"""One side of an XLA benchmark, run in a fresh process: ``python -m benchmarks._xla_loop_worker MODE JSON``.

torch_xla's runtime starts once per process and keeps its metrics process-wide, so each side of a
comparison (``tutorial``: a hand-written torch_xla loop as tutorials write it; ``trainer``:
``xlatrain.Trainer``) runs here alone and prints one line ``RESULT <json>`` on stdout. The caller
sets ``PJRT_DEVICE``, ``CPU_NUM_DEVICES`` and ``XLATRAIN_CACHE_DIR`` before this process starts.

JSON options (all optional): ``samples``, ``batch``, ``epochs``, ``width``, ``image``, ``lr``,
``seed``, ``run_dir`` (trainer only).
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from xlatrain.models import SmallCNN

RESULT_PREFIX = "RESULT "
DEFAULTS: dict[str, Any] = {
    "samples": 300,  # with batch 32: nine full batches and a ragged tail of 12
    "batch": 32,
    "epochs": 3,
    "width": 8,
    "image": 32,
    "lr": 1e-3,
    "seed": 0,
}


def _data(opts: dict[str, Any]) -> TensorDataset:
    g = torch.Generator().manual_seed(opts["seed"])
    n, size = opts["samples"], opts["image"]
    x = torch.randn(n, 3, size, size, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (n,), generator=g))


def _model(opts: dict[str, Any]) -> nn.Module:
    torch.manual_seed(opts["seed"])
    return SmallCNN(in_channels=3, num_outputs=10, width=opts["width"])


class _AverageMeter:
    """The running-average helper every TPU tutorial carries."""

    def __init__(self) -> None:
        self.sum, self.count, self.avg = 0.0, 0, 0.0

    def update(self, value: float, n: int) -> None:
        self.sum += value * n
        self.count += n
        self.avg = self.sum / self.count


def _tutorial(opts: dict[str, Any]) -> dict[str, Any]:
    import torch_xla
    import torch_xla.core.xla_model as xm

    from xlatrain.diagnostics import xla_metrics

    device = torch_xla.device()
    model = _model(opts).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=opts["lr"])
    loss_fn = nn.CrossEntropyLoss()
    # drop_last=False, as tutorials leave it: the last batch of each epoch is ragged.
    loader = DataLoader(
        _data(opts), batch_size=opts["batch"], shuffle=True, generator=torch.Generator().manual_seed(opts["seed"])
    )
    epochs: list[dict[str, Any]] = []
    before_all = xla_metrics.snapshot()
    for epoch in range(1, opts["epochs"] + 1):
        model.train()
        meter = _AverageMeter()
        before = xla_metrics.snapshot()
        started, cpu_started = time.perf_counter(), time.process_time()
        steps = samples = 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            xm.optimizer_step(optimizer)
            xm.mark_step()
            meter.update(loss.item(), x.size(0))  # a host read every step
            steps += 1
            samples += x.size(0)
        seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        cost = xla_metrics.diff(before, xla_metrics.snapshot())
        epochs.append(
            {
                "epoch": epoch,
                "seconds": seconds,
                "cpu_s": cpu_s,
                "steps": steps,
                "samples": samples,
                "train_loss": meter.avg,
                "compilations": cost["compile_count"],
                "compile_s": cost["compile_s"],
                "host_transfers": cost["transfer_from_device_count"],
            }
        )
    total = xla_metrics.diff(before_all, xla_metrics.snapshot())
    return {"epochs": epochs, "total": _brief(total)}


def _trainer(opts: dict[str, Any]) -> dict[str, Any]:
    from xlatrain import TrainConfig, Trainer
    from xlatrain.config import BackendConfig, CheckpointConfig
    from xlatrain.diagnostics import xla_metrics

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = opts.get("run_dir") or f"{tmp}/run"
        trainer = Trainer(
            _model(opts),
            nn.CrossEntropyLoss(),
            functools.partial(torch.optim.Adam, lr=opts["lr"]),
            config=TrainConfig(
                epochs=opts["epochs"], batch_size=opts["batch"], seed=opts["seed"], run_dir=run_dir, log_every=10**6
            ),
            # The tutorial saves nothing either; best.safetensors is still written on improvement.
            checkpoint=CheckpointConfig(enabled=False),
            backend=BackendConfig(accelerator="xla", devices=1),
        )
        # Time each training epoch (the loop and its epoch-end read) in wall and process CPU
        # seconds, the same span the tutorial side times; the history's epoch_time_s adds the
        # history file write.
        timings: list[tuple[float, float]] = []
        train_epoch = trainer._train_epoch

        def timed_epoch(*args: Any) -> float:
            wall, cpu = time.perf_counter(), time.process_time()
            loss = train_epoch(*args)
            timings.append((time.perf_counter() - wall, time.process_time() - cpu))
            return loss

        trainer._train_epoch = timed_epoch  # type: ignore[method-assign]
        # Taken only now: the backend has started the persistent cache, which must come first.
        before = xla_metrics.snapshot()
        started = time.perf_counter()
        history = trainer.fit(_data(opts))
        wall = time.perf_counter() - started
        total = xla_metrics.diff(before, xla_metrics.snapshot())
    steps = len(_data(opts)) // opts["batch"]
    epochs = []
    prev_compiles = before["compile_count"]
    prev_transfers = before["transfer_from_device_count"]
    for row, (seconds, cpu_s) in zip(history, timings):
        epochs.append(
            {
                "epoch": row["epoch"],
                "seconds": seconds,
                "cpu_s": cpu_s,
                "epoch_time_s": row["epoch_time_s"],
                "steps": steps,
                "samples": steps * opts["batch"],
                "train_loss": row["train_loss"],
                # Cumulative process counters read at each epoch's end (before best weights are saved).
                "compilations": row["xla_compilations"] - prev_compiles,
                "host_transfers": row["xla_host_transfers"] - prev_transfers,
            }
        )
        prev_compiles, prev_transfers = row["xla_compilations"], row["xla_host_transfers"]
    last = history[-1]
    cache = {k: last[k] for k in ("xla_cache_hits", "xla_cache_misses", "xla_cache_load_failures") if k in last}
    return {
        "epochs": epochs,
        "total": _brief(total),
        "fit_wall_s": wall,
        "compilations_after_epoch_1": int(
            before["compile_count"] + total["compile_count"] - history[0]["xla_compilations"]
        ),
        "cache": cache,
        "compile_cache_dir": trainer.backend.compile_cache_dir,
        "backend": trainer.backend.describe(),
    }


def _brief(cost: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "compile_count", "compile_s", "execute_count", "execute_s", "execute_replicated_count", "execute_replicated_s",
        "transfer_to_device_count", "transfer_from_device_count",
        "persistent_cache_hit", "persistent_cache_miss", "persistent_cache_deserialize_failure",
    )
    out = {k: cost[k] for k in keys}
    out["cpu_fallback_ops"] = cost["cpu_fallback_ops"]
    return out


def main(argv: list[str]) -> None:
    mode = argv[0]
    opts = {**DEFAULTS, **(json.loads(argv[1]) if len(argv) > 1 else {})}
    runners = {"tutorial": _tutorial, "trainer": _trainer}
    if mode not in runners:
        raise SystemExit(f"mode {mode!r} is not one of {', '.join(runners)}")
    import torch_xla.runtime as xr

    started = time.perf_counter()
    result = runners[mode](opts)
    result.update(mode=mode, opts=opts, process_s=time.perf_counter() - started, device_type=xr.device_type())
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
