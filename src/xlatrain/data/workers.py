"""How many processes fetch and decode batches beside a training process, when asked for ``"auto"``."""

from __future__ import annotations

from xlatrain.backend.hardware import cpu_share

MAX_AUTO_WORKERS = 32


def auto_workers(batches: int) -> tuple[int, str]:
    """The CPUs this process may use, shared by the training processes on its host, less one for
    the training process itself, and at most ``batches`` (the batches of an epoch); with why."""
    cpus, local = cpu_share()
    share = cpus // local
    n = max(min(share - 1, batches, MAX_AUTO_WORKERS), 0)
    why = f"auto: {cpus} CPU(s) for {local} training process(es) on this host, one left for training"
    if share - 1 > batches:
        why += f", at most the {batches} batch(es) of an epoch"
    return n, why
