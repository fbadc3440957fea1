"""The script check's misses an audit found: a collective only the main process reaches, a host read
per step inside a function the training loop calls, and a plain optimizer step under xmp.spawn with
nothing that reduces gradients. Each comes with the correct variants, which must stay quiet."""

import textwrap

from xlatrain.diagnostics.script_check import check_source, is_port_note


def graded(source: str) -> set[tuple[int, str, str]]:
    return {(f.line, f.code, f.severity) for f in check_source(textwrap.dedent(source)) if not is_port_note(f)}


def found(source: str, code: str) -> list[tuple[int, str, str]]:
    return sorted((f.line, f.severity, f.message) for f in check_source(textwrap.dedent(source)) if f.code == code)


_SPAWNED = """
import torch
import torch.distributed as dist
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
import torch_xla.distributed.xla_multiprocessing as xmp

def _mp_fn(index, state):
    rank = xr.global_ordinal()
{body}

if __name__ == "__main__":
    xmp.spawn(_mp_fn, args=({{}},){spawn_kw})
"""


def spawned(body: str, spawn_kw: str = "") -> str:
    return _SPAWNED.format(body=textwrap.indent(textwrap.dedent(body).strip("\n"), "    "), spawn_kw=spawn_kw)


# ------------------------------------------------------------------ collectives on one process


def test_a_collective_only_the_main_process_reaches_under_xmp_spawn_is_an_error():
    source = spawned("""
        if xm.is_master_ordinal():
            xm.rendezvous("saved")
        if rank == 0:
            dist.barrier()
        if index == 0:
            xm.mesh_reduce("acc", 1.0, sum)
        if xr.global_ordinal() == 0:
            pass
        else:
            xm.all_reduce(xm.REDUCE_SUM, [torch.zeros(1)])
    """)
    got = found(source, "collective-on-one-process")
    assert [(line, severity) for line, severity, _ in got] == [(12, "error"), (14, "error"), (16, "error"), (20, "error")]
    assert "xm.rendezvous()" in got[0][2] and "xmp.spawn (line 23)" in got[0][2] and "hangs" in got[0][2]
    assert "every process but one" in got[3][2]


def test_a_collective_reached_through_a_function_under_a_rank_test_names_both_lines():
    source = """
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.xla_multiprocessing as xmp

        def sync_all():
            xm.rendezvous("checkpoint")

        def checkpoint(state):
            sync_all()

        def _mp_fn(index):
            if xm.is_master_ordinal():
                checkpoint({})

        xmp.spawn(_mp_fn)
    """
    [(line, severity, message)] = found(source, "collective-on-one-process")
    assert (line, severity) == (13, "error")
    assert "in checkpoint() (line 9) in sync_all() (line 6)" in message


def test_a_collective_under_a_rank_test_without_a_visible_spawn_is_an_info():
    source = """
        import torch.distributed as dist

        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            dist.barrier()
    """
    [(line, severity, message)] = found(source, "collective-on-one-process")
    assert (line, severity) == (6, "info")
    assert "if more than one process runs this" in message


def test_collectives_every_process_makes_and_a_single_process_stay_quiet():
    every_process = spawned("""
        xm.save(state, "model.pt")   # writes on the master only by itself
        xm.rendezvous("saved")
        if xm.is_master_ordinal():
            torch.save({"step": 1}, "meta.pt")
            print("saved")
        if rank == 0 and index >= 0:
            pass
        dist.barrier()
    """)
    assert not found(every_process, "collective-on-one-process")
    one_process = spawned("""
        if xm.is_master_ordinal():
            xm.rendezvous("saved")
    """, spawn_kw=", nprocs=1")
    assert not found(one_process, "collective-on-one-process")
    # a name that is not the process index (a step counter compared to 0) is no rank test
    counter = spawned("""
        step = 0
        if step == 0:
            xm.rendezvous("first")
    """)
    assert not found(counter, "collective-on-one-process")
    # both arms make the same collective: every process meets it (only the one the else lacks is said)
    both = spawned('''
        if xm.is_master_ordinal():
            xm.rendezvous("before_save")
            torch.save({"w": 1}, "w.pt")
            dist.barrier()
        else:
            xm.rendezvous("before_save")
    ''')
    said = found(both, "collective-on-one-process")
    assert len(said) == 1 and "barrier" in said[0][2], said


def test_xm_save_under_a_rank_test_is_no_error_on_torch_xla_2_9():
    # torch_xla 2.9's xm.save does not rendezvous: it syncs the data, and torch.save()s it where
    # is_master_ordinal(local=not global_master) holds. Under a rank test it only reads on one process.
    source = spawned("""
        model = torch.nn.Linear(2, 2).to(torch_xla.device())
        if xm.is_master_ordinal():
            xm.save(model.state_dict(), "model.pt")
    """)
    assert not found(source, "collective-on-one-process")
    notes = [f.message for f in check_source(textwrap.dedent(source)) if f.code == "port:read-on-every-process"]
    assert any(m.startswith("xm.save()") for m in notes)


# ------------------------------------------------------------------ host reads in a function the loop calls

_HELPER_LOOP = """
import torch
import torch.nn as nn
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
from torch.utils.data import DataLoader, TensorDataset

losses = []

def log(loss):
    losses.append(loss.item())

def train_step(model, opt, loss_fn, x, y):
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    xm.optimizer_step(opt)
    {read}
    return loss

device = torch_xla.device()
ds = TensorDataset(torch.randn(1024, 10), torch.randint(0, 2, (1024,)))
loader = pl.MpDeviceLoader(DataLoader(ds, batch_size=128, drop_last=True), device)
model = nn.Linear(10, 2).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = nn.CrossEntropyLoss()
for step, (x, y) in enumerate(loader):
    loss = train_step(model, opt, loss_fn, x, y)
    {call}
"""


def helper_loop(read: str = 'print("loss", loss.item())', call: str = "log(loss)") -> str:
    return _HELPER_LOOP.format(read=read.replace("\n", "\n    "), call=call.replace("\n", "\n    "))


def test_a_host_read_in_a_function_the_step_loop_calls_is_a_warning_naming_both_lines():
    got = found(helper_loop(), "host-sync")
    assert [(line, severity) for line, severity, _ in got] == [(12, "warning"), (19, "warning")]
    assert "in log() (line 12), which the per-batch loop calls every step (line 30)" in got[0][2]
    assert "in train_step() (line 19), which the per-batch loop calls every step (line 29)" in got[1][2]


def test_a_host_read_in_a_called_function_every_n_steps_keeps_the_every_n_grading():
    at_call_site = found(helper_loop(call="if step % 50 == 0:\n    log(loss)"), "host-sync")
    assert (12, "warning") in {(line, severity) for line, severity, _ in at_call_site}
    assert any("every few steps (under `if step % 50 == 0`)" in m for line, _, m in at_call_site if line == 12)
    inside = found(helper_loop(read='if int(torch.randint(0, 9, (1,))) % 10 == 0:\n    print(loss.item())'),
                   "host-sync")
    assert any("every few steps" in m and "train_step()" in m for _, _, m in inside)


def test_functions_the_step_loop_does_not_call_or_that_read_host_values_stay_quiet():
    source = """
        import torch
        import torch_xla
        import torch_xla.distributed.parallel_loader as pl
        from torch.utils.data import DataLoader, TensorDataset

        def report(values):
            print(sum(v.item() for v in values))

        def count(n):
            return torch.tensor(n).item()

        device = torch_xla.device()
        loader = pl.MpDeviceLoader(DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=8, drop_last=True), device)
        seen = 0
        for (x,) in loader:
            seen += count(x.shape[0])
        report([torch.zeros(1)])
    """
    assert not {g for g in graded(source) if g[1] in ("host-sync", "print-tensor")}


# ------------------------------------------------------------------ gradients nobody reduces

_MP_TRAIN = """
import torch
import torch.nn as nn
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.xla_multiprocessing as xmp
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
{imports}

def _mp_fn(index):
    device = torch_xla.device()
    ds = TensorDataset(torch.randn(1024, 10), torch.randint(0, 2, (1024,)))
    sampler = {sampler}
    loader = pl.MpDeviceLoader(DataLoader(ds, batch_size=128, sampler=sampler, drop_last=True), device)
    model = nn.Linear(10, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in loader:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        {step}

if __name__ == "__main__":
    xmp.spawn(_mp_fn, args=(){spawn_kw})
"""
_SHARDED = "DistributedSampler(ds, num_replicas=xr.world_size(), rank=xr.global_ordinal())"


def mp_train(step: str = "opt.step()", sampler: str = _SHARDED, spawn_kw: str = "", imports: str = "") -> str:
    return _MP_TRAIN.format(step=step.replace("\n", "\n        "), sampler=sampler, spawn_kw=spawn_kw, imports=imports)


def test_a_plain_optimizer_step_on_sharded_data_under_xmp_spawn_is_an_error():
    [(line, severity, message)] = found(mp_train(), "unreduced-gradients")
    assert (line, severity) == (25, "error")
    assert "opt.step()" in message and "xmp.spawn (line 28)" in message and "drift apart" in message


def test_a_plain_optimizer_step_the_check_cannot_settle_is_an_info():
    unsharded = found(mp_train(sampler="None"), "unreduced-gradients")
    assert [(line, severity) for line, severity, _ in unsharded] == [(25, "info")]
    project = found(mp_train(imports="from mytrain import wrap_model"), "unreduced-gradients")
    assert [(line, severity) for line, severity, _ in project] == [(25, "info")]
    assert "mytrain.wrap_model" in project[0][2]


def test_an_optimizer_step_whose_gradients_are_reduced_or_a_single_process_stays_quiet():
    quiet = [
        mp_train(step="xm.optimizer_step(opt)"),
        mp_train(step="xm.reduce_gradients(opt)\nopt.step()"),
        mp_train(step="[xm.all_reduce(xm.REDUCE_SUM, [p.grad]) for p in model.parameters()]\nopt.step()"),
        mp_train(spawn_kw=", nprocs=1"),
        mp_train(imports="from torch.nn.parallel import DistributedDataParallel as DDP", step="DDP(model)\nopt.step()"),
    ]
    for source in quiet:
        assert not found(source, "unreduced-gradients"), source


def test_a_collective_over_a_group_under_a_rank_test_is_only_an_info():
    source = spawned("""
        if rank == 0:
            dist.barrier(group=state["masters"])
    """)
    [(line, severity, message)] = found(source, "collective-on-one-process")
    assert (line, severity) == (12, "info")
    assert "if its group holds a process that does not take this branch" in message


def test_a_function_the_loop_calls_twice_is_reported_once_graded_by_its_ungated_call():
    got = found(helper_loop(call="if step % 50 == 0:\n    log(loss)\nlog(loss)"), "host-sync")
    assert [(line, severity) for line, severity, _ in got if line == 12] == [(12, "warning")]
    assert "every step (line 32)" in next(m for line, _, m in got if line == 12)
