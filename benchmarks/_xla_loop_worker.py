"""One side of an XLA benchmark, run in a fresh process: ``python -m benchmarks._xla_loop_worker MODE JSON``.

torch_xla's runtime starts once per process and keeps its metrics process-wide, so each side of a
comparison runs here alone and prints one line ``RESULT <json>`` on stdout. The caller sets
``PJRT_DEVICE``, ``CPU_NUM_DEVICES`` and ``XLATRAIN_CACHE_DIR`` before this process starts.

Modes:

- ``tutorial``: a torch_xla loop as TPU tutorials write it (``.to(device)`` per batch,
  ``xm.optimizer_step``, ``xm.mark_step()``, ``loss.item()`` into an average meter every step).
- ``mnist_example``: the training loop of pytorch/xla's MNIST example (test/test_train_mp_mnist.py):
  its model, NLL loss and SGD with momentum, ``MpDeviceLoader``, ``xm.optimizer_step`` and a
  step closure every ``log_steps`` steps.
- ``trainer``: ``xlatrain.Trainer`` with ``accelerator="xla"`` in ``xla_mode`` (``spmd`` or
  ``multiprocess``), one device.

JSON options (all optional): ``model`` (``smallcnn`` or ``mnist``), ``samples``, ``batch``,
``epochs``, ``width``, ``image``, ``lr``, ``seed``, ``xla_mode`` and ``run_dir`` (trainer only),
``log_steps`` (mnist_example). Every epoch reports its wall and process CPU seconds and what
torch_xla's counters saw in it: compilations, host-to-device transfers (TransferToDeviceTime
samples), device-to-host transfers and graph cuts (the ``MarkStep`` counter).
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.xla_loop import DEFAULTS, RESULT_PREFIX


class MNIST(nn.Module):
    """The model of pytorch/xla's MNIST example: two conv + batch-norm blocks, two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.bn1 = nn.BatchNorm2d(10)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.bn2 = nn.BatchNorm2d(20)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, image_BCHW: torch.Tensor) -> torch.Tensor:
        x = self.bn1(F.relu(F.max_pool2d(self.conv1(image_BCHW), 2)))
        x = self.bn2(F.relu(F.max_pool2d(self.conv2(x), 2)))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


def _data(opts: dict[str, Any]) -> TensorDataset:
    g = torch.Generator().manual_seed(opts["seed"])
    n = opts["samples"]
    shape = (1, 28, 28) if opts["model"] == "mnist" else (3, opts["image"], opts["image"])
    x = torch.randn(n, *shape, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (n,), generator=g))


def _model(opts: dict[str, Any]) -> nn.Module:
    from xlatrain.models import SmallCNN

    torch.manual_seed(opts["seed"])
    if opts["model"] == "mnist":
        return MNIST()
    return SmallCNN(in_channels=3, num_outputs=10, width=opts["width"])


def _loss_fn(opts: dict[str, Any]) -> nn.Module:
    return nn.NLLLoss() if opts["model"] == "mnist" else nn.CrossEntropyLoss()


def _optimizer_fn(opts: dict[str, Any]) -> Callable[..., torch.optim.Optimizer]:
    if opts["model"] == "mnist":
        return functools.partial(torch.optim.SGD, lr=opts["lr"], momentum=opts["momentum"])
    return functools.partial(torch.optim.Adam, lr=opts["lr"])


class _EpochMeter:
    """Wall and process CPU seconds of one epoch, and torch_xla's counters over it."""

    def __init__(self) -> None:
        from xlatrain.diagnostics import xla_metrics

        self._metrics = xla_metrics
        self.rows: list[dict[str, Any]] = []

    def _marks(self) -> int:
        import torch_xla.debug.metrics as met

        return int(met.counter_value("MarkStep") or 0)

    def start(self) -> None:
        self._before, self._cuts = self._metrics.snapshot(), self._marks()
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self, epoch: int, steps: int, samples: int, train_loss: float | None) -> None:
        seconds, cpu_s = time.perf_counter() - self._wall, time.process_time() - self._cpu
        cost = self._metrics.diff(self._before, self._metrics.snapshot())
        self.rows.append(
            {
                "epoch": epoch,
                "seconds": seconds,
                "cpu_s": cpu_s,
                "steps": steps,
                "samples": samples,
                "train_loss": train_loss,
                "compilations": cost["compile_count"],
                "compile_s": cost["compile_s"],
                "host_transfers": cost["transfer_from_device_count"],
                "to_device_transfers": cost["transfer_to_device_count"],
                "graph_cuts": self._marks() - self._cuts,
            }
        )


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

    device = torch_xla.device()
    model = _model(opts).to(device)
    optimizer = _optimizer_fn(opts)(model.parameters())
    loss_fn = _loss_fn(opts)
    # drop_last=False, as tutorials leave it: the last batch of each epoch may be ragged.
    loader = DataLoader(
        _data(opts), batch_size=opts["batch"], shuffle=True, generator=torch.Generator().manual_seed(opts["seed"])
    )
    meter = _EpochMeter()
    for epoch in range(1, opts["epochs"] + 1):
        model.train()
        average = _AverageMeter()
        meter.start()
        steps = samples = 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            xm.optimizer_step(optimizer)
            xm.mark_step()
            average.update(loss.item(), x.size(0))  # a host read every step
            steps += 1
            samples += x.size(0)
        meter.stop(epoch, steps, samples, average.avg)
    return {"epochs": meter.rows}


def _mnist_example(opts: dict[str, Any]) -> dict[str, Any]:
    """train_loop_fn of pytorch/xla's MNIST example, without its test loop (the Trainer side
    validates nothing either) and with in-memory data for the downloaded MNIST."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr

    device = torch_xla.device()
    model = _model(opts).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=opts["lr"] * xr.world_size(), momentum=opts["momentum"])
    loss_fn = nn.NLLLoss()
    train_loader = DataLoader(_data(opts), batch_size=opts["batch"], shuffle=True, drop_last=False)
    train_device_loader = pl.MpDeviceLoader(train_loader, device)
    logged: list[float] = []

    def train_update(step: int, loss: torch.Tensor) -> None:
        logged.append(loss.item())  # runs after the step's graph, like the example's print

    meter = _EpochMeter()
    for epoch in range(1, opts["epochs"] + 1):
        meter.start()
        model.train()
        steps = 0
        for step, (data, target) in enumerate(train_device_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()
            xm.optimizer_step(optimizer)
            if step % opts["log_steps"] == 0:
                xm.add_step_closure(train_update, args=(step, loss))
            steps += 1
        meter.stop(epoch, steps, steps * opts["batch"], logged[-1] if logged else None)
    return {"epochs": meter.rows}


def _trainer(opts: dict[str, Any]) -> dict[str, Any]:
    from xlatrain import TrainConfig, Trainer
    from xlatrain.config import BackendConfig, CheckpointConfig
    from xlatrain.train.feed import TrainFeed

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = opts.get("run_dir") or f"{tmp}/run"
        trainer = Trainer(
            _model(opts),
            _loss_fn(opts),
            _optimizer_fn(opts),
            config=TrainConfig(
                epochs=opts["epochs"], batch_size=opts["batch"], seed=opts["seed"], run_dir=run_dir,
                log_every=opts["log_steps"],
            ),
            # The loops it is compared with save nothing either; best.safetensors is still
            # written on improvement, outside the timed span.
            checkpoint=CheckpointConfig(enabled=False),
            backend=BackendConfig(accelerator="xla", devices=1, xla_mode=opts["xla_mode"]),
        )
        # Time each training epoch (the loop and its epoch-end read), the span the other loops
        # time: from the epoch's batches being asked for to its mean loss read. The history's
        # epoch_time_s adds the history file write.
        meter = _EpochMeter()
        steps = len(_data(opts)) // opts["batch"]
        feed_batches, epoch_means = TrainFeed.batches, trainer._epoch_means

        def started_epoch(feed: Any, *args: Any) -> Any:
            meter.start()
            return feed_batches(feed, *args)

        def timed_means(feed: Any, cursor: Any, *args: Any) -> dict[str, float]:
            columns = epoch_means(feed, cursor, *args)
            meter.stop(cursor.epoch, steps, steps * opts["batch"], columns["train_loss"])
            return columns

        TrainFeed.batches = started_epoch  # type: ignore[method-assign]
        trainer._epoch_means = timed_means  # type: ignore[method-assign]
        started = time.perf_counter()
        history = trainer.fit(_data(opts))
        wall = time.perf_counter() - started
    last = history[-1]
    cache = {k: sum(row[k] for row in history) for k in ("xla_cache_hits", "xla_cache_misses", "xla_cache_load_failures")
             if k in last}
    return {
        "epochs": meter.rows,
        "fit_wall_s": wall,
        # Each epoch's own counts (history columns): everything after epoch 1's end, best-weight
        # saves included, counts as after warm-up.
        "compilations_after_epoch_1": int(sum(row["xla_compilations"] for row in history[1:])),
        "cache": cache,
        "compile_cache_dir": trainer.runtime.compile_cache_dir,
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
    runners = {"tutorial": _tutorial, "mnist_example": _mnist_example, "trainer": _trainer}
    if mode not in runners:
        raise SystemExit(f"mode {mode!r} is not one of {', '.join(runners)}")
    from xlatrain.diagnostics import xla_metrics

    if mode == "trainer":
        # The Trainer picks its runtime settings before torch_xla starts: nothing here may
        # start it first. Its metrics are taken from the backend's start on.
        before: dict[str, Any] = {}
    else:
        before = xla_metrics.snapshot()
    started = time.perf_counter()
    result = runners[mode](opts)
    import torch_xla.runtime as xr

    result.update(
        mode=mode, opts=opts, process_s=time.perf_counter() - started, device_type=xr.device_type(),
        total=_brief(xla_metrics.diff(before, xla_metrics.snapshot())),
    )
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
