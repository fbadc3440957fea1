"""A DDP step, one gather, then straight to exit (under torchrun), in a group the script made.

Usage: torchrun --nproc-per-node 2 exit_after_gather.py
The race it exercises: a DDP model keeps gloo's group alive to the end, and a worker thread that
drops the gather's tensors once the interpreter is finalizing aborts the process. The group is
the script's own, so the one exit handler xlatrain adds is its wait for idle gloo workers
(backend/processes.py): nothing else (no destroy, no collection) hides the race.
"""

import torch
import torch.distributed as dist
from torch import nn

from xlatrain.backend.processes import Processes

dist.init_process_group("gloo")
processes = Processes("cpu")
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
processes.gather_objects(list(range(100)))
