"""The ``fsdp`` benchmark's job, run by torchrun with 2 CPU processes (see benchmarks/fsdp.py).

Same model (repeated blocks), data, optimizer and seed on every side:
- trainer: ``Trainer(strategy="fsdp")``, one epoch per ``fit``;
- plain: a hand-written ``fully_shard`` loop (each block a unit, then the root), the loop the
  torch FSDP2 tutorial writes;
- control: a second copy of the plain loop, whose ratio to the first is the noise floor.
Memory: the bytes each process holds of parameters, gradients and AdamW state after a step's
backward, under the hand-written FSDP loop and under DDP.
Rank 0 prints ``RESULT {json}``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from xlatrain import BackendConfig, CheckpointConfig, TrainConfig, Trainer  # noqa: E402

DIM, BLOCKS, CLASSES = 384, 6, 10
BATCH = 32  # per process
STEPS = 16
ROUNDS = int(os.environ.get("XLATRAIN_BENCH_ROUNDS", "5"))
PAIRS = 7


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _data(world: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = BATCH * world * STEPS
    return torch.utils.data.TensorDataset(torch.randn(n, DIM, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def _hand_fsdp(mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _plain_epoch(model, opt, batches) -> float:
    """One epoch of the hand-written loop over this process's part of the data."""
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    start = time.perf_counter()
    loss_sum = torch.zeros(())
    for x, y in batches:
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum)  # the epoch-end reduce the Trainer also does
    float(loss_sum)
    return time.perf_counter() - start


def _held_bytes(model, opt, x, y) -> int:
    """Parameters + gradients + optimizer state this process holds after a step's backward."""
    from xlatrain.backend.model_state import state_bytes

    for _ in range(2):  # the second backward finds the optimizer state made by the first step
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        if _ == 0:
            opt.step()
    return sum(state_bytes(getattr(model, "module", model), opt).values())


def main() -> None:
    torch.set_num_threads(1)  # two processes on two cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= world:
        # One core per process, threads included: the scheduler moving a process (and its gloo
        # threads) between cores shows up as noise of several percent in either side's epochs.
        os.sched_setaffinity(0, {cores[rank]})
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    data = _data(world)
    # The hand-written loop reads its data as such loops do: a DataLoader over a DistributedSampler.
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    batches = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)

    # Built plain, Trainer, control: the order models are built in moves their step times by a
    # few percent here (where their memory lands); the Trainer sits between the two hand-written
    # copies, and the A/A control shows what building order alone does.
    plain = _hand_fsdp(mesh)
    run_dir = [tempfile.mkdtemp(prefix="xlatrain-bench-fsdp-") if rank == 0 else None]
    dist.broadcast_object_list(run_dir)  # one run directory for the job
    try:
        trainer = Trainer(
            _net(), nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-3),
            config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=run_dir[0], log_every=1000, diagnostics=False,
                               tensorboard=False, save_best=False),
            checkpoint=CheckpointConfig(enabled=False),
            backend=BackendConfig(accelerator="cpu", strategy="fsdp"),
        )
        control = _hand_fsdp(mesh)
        times: dict[str, list[float]] = {"plain": [], "trainer": [], "control": []}
        sides = {
            "plain": lambda: times["plain"].append(_plain_epoch(*plain, batches)),
            "trainer": lambda: times["trainer"].append(trainer.fit(data, resume="overwrite")[-1]["epoch_time_s"]),
            "control": lambda: times["control"].append(_plain_epoch(*control, batches)),
        }
        for side in sides.values():  # warm-up: allocator, kernels, the Trainer's first fit
            side()
        for side in times.values():
            side.clear()
        names = list(sides)
        rounds, controls = [], []
        for r in range(ROUNDS):
            pairs, aa = [], []
            for k in range(PAIRS):
                shift = (r * PAIRS + k) % len(names)  # the same rotation on every process
                for name in names[shift:] + names[:shift]:
                    sides[name]()
                pairs.append(times["trainer"][-1] / times["plain"][-1])
                aa.append(times["control"][-1] / times["plain"][-1])
            rounds.append(statistics.median(pairs))
            controls.append(statistics.median(aa))
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(run_dir[0], ignore_errors=True)

    x, y = next(iter(batches))
    fsdp_bytes = _held_bytes(*_hand_fsdp(mesh), x, y)
    ddp_model = nn.parallel.DistributedDataParallel(_net())
    ddp_bytes = _held_bytes(ddp_model, torch.optim.AdamW(ddp_model.parameters(), lr=1e-3), x, y)
    params = sum(p.numel() for p in _net().parameters())
    if rank == 0:
        def spread(values):
            return [round(min(values), 4), round(statistics.median(values), 4), round(max(values), 4)]

        print("RESULT " + json.dumps({
            "ratio": round(statistics.median(rounds), 4),
            "ratio_min_median_max": spread(rounds),
            "ratio_per_round": [round(v, 4) for v in rounds],
            "control_ratio_min_median_max": spread(controls),
            "control_ratio_per_round": [round(v, 4) for v in controls],
            "trainer_step_ms": round(statistics.median(times["trainer"]) / STEPS * 1e3, 2),
            "plain_step_ms": round(statistics.median(times["plain"]) / STEPS * 1e3, 2),
            "memory_ratio": round(fsdp_bytes / ddp_bytes, 4),
            "fsdp_bytes_per_process": fsdp_bytes,
            "ddp_bytes_per_process": ddp_bytes,
            "parameters": params,
            "processes": world,
            "model": f"{BLOCKS} blocks (LayerNorm, Linear {DIM}->{4 * DIM}, GELU, Linear {4 * DIM}->{DIM}) + head, "
                     f"AdamW, batch {BATCH} per process",
            "steps_per_epoch": STEPS,
            "rounds": ROUNDS,
            "repetitions_per_round": PAIRS,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
