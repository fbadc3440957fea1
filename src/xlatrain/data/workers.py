"""How many processes fetch and decode batches beside a training process, when asked for ``"auto"``,
and the Python releases whose fork can hang one of them as it starts."""

from __future__ import annotations

import platform
import re

from xlatrain.backend.hardware import cpu_share

MAX_AUTO_WORKERS = 32

# The first release of each CPython series with the fix for gh-112275: before it, a process forked
# while a C++ thread of its parent is entering Python (creating its thread state, as torch.distributed's
# gloo threads do around collectives) can block forever inside os.fork() in the child. 3.12 and later
# have the fix from their first release. Measured on 3.11.7: two gloo processes that fork 2 loader
# workers after each round of all_reduce hung within 3 to 161 rounds; without the collectives, 500
# rounds ran clean.
FORK_FIX = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}


def fork_fix_release(version: str) -> str | None:
    """The release that fixed the fork hang for ``version``'s series, where ``version`` predates it."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)  # "3.11.9rc1": 3, 11, 9
    if match is None:
        return None
    major, minor, micro = (int(g) for g in match.groups())
    fixed = FORK_FIX.get((major, minor))
    return f"{major}.{minor}.{fixed}" if fixed is not None and micro < fixed else None


def fork_hang_note(num_workers: int | None, version: str | None = None) -> str | None:
    """What to know where loader workers fork beside gloo's threads on a Python with the fork hang."""
    version = version or platform.python_version()
    fixed = fork_fix_release(version)
    if not num_workers or fixed is None:
        return None
    from xlatrain.backend.processes import gloo_group_active

    if not gloo_group_active():
        return None
    return (f"Python {version} can hang a loader worker as it forks after gloo collectives (CPython gh-112275, "
            f"fixed in {fixed}): a run that stalls as an epoch or an evaluation starts its {num_workers} worker(s) "
            f"may be this; Python {fixed} or newer, or num_workers=0, avoids it")


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
