"""The script check's false alarms an audit found: code that is correct on torch_xla 2.9 must get no
error or warning, and where the code does not settle a question the check says so in an info."""

import textwrap

from xlatrain.diagnostics.script_check import check_source, is_port_note


def graded(source: str) -> set[tuple[int, str, str]]:
    return {(f.line, f.code, f.severity) for f in check_source(textwrap.dedent(source)) if not is_port_note(f)}


def messages(source: str, code: str) -> list[str]:
    return [f.message for f in check_source(textwrap.dedent(source)) if f.code == code]


def test_a_removed_api_as_the_fallback_of_a_try_or_of_getattr_is_an_info():
    source = """
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        try:
            world = xr.world_size()
        except AttributeError:  # torch_xla < 2.1
            world = xm.xrt_world_size()

        try:
            import torch_xla.runtime as rt
        except ImportError:
            import torch_xla.experimental.pjrt as rt

        def world_size():
            fn = getattr(xr, "world_size", None)
            if fn is None:
                return xm.xrt_world_size()
            return fn()

        rank = xm.get_ordinal()
    """
    got = {(line, severity) for line, code, severity in graded(source) if code == "removed-api"}
    assert got == {(8, "info"), (13, "info"), (18, "info"), (21, "error")}  # the last one is not guarded
    assert "fallback of a try/except" in messages(source, "removed-api")[0]


def test_an_optimizer_rebuilt_after_the_move_is_not_an_error():
    head = textwrap.dedent("""
        import torch
        import torch_xla

        model = torch.nn.Linear(10, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.to(torch_xla.device())
    """)
    stepped = textwrap.dedent("""
        for _ in range(10):
            model(torch.randn(8, 10, device=torch_xla.device())).sum().backward()
            opt.step()
            torch_xla.sync()
    """)
    rebuilt = head + "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + stepped
    assert not [c for _, c, _ in graded(rebuilt) if c == "optimizer-before-move"]
    # Rebuilt on one path only: which optimizer the steps use is not settled.
    maybe = head + "if FRESH:\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + stepped
    assert (6, "optimizer-before-move", "info") in graded(maybe)
    assert "bound again on line 9" in messages(maybe, "optimizer-before-move")[0]
    assert (6, "optimizer-before-move", "error") in graded(head + stepped)  # never rebuilt: certain


def test_spawn_nprocs_is_read_through_star_args_and_kwargs_and_unknown_is_an_info():
    spawn = """
        import torch_xla
        import torch_xla.distributed.xla_multiprocessing as xmp

        def _mp_fn(index):
            print(torch_xla.device())

        {before}
        print(torch_xla.devices())
        xmp.spawn({args})
    """

    def at_spawn(before: str, args: str) -> set[tuple[str, str]]:
        return {(c, s) for line, c, s in graded(spawn.format(before=before, args=args)) if c in (
            "xla-before-spawn", "spawn-nprocs")}

    assert at_spawn('SPAWN_KW = {"nprocs": 1, "start_method": "fork"}', "_mp_fn, args=(), **SPAWN_KW") == set()
    assert at_spawn("spawn_args = (_mp_fn, (), 1)", "*spawn_args") == set()
    assert at_spawn("", '_mp_fn, args=(), **{"nprocs": 1}') == set()
    assert at_spawn('kw = {"nprocs": 8}', "_mp_fn, args=(), **kw") == {
        ("spawn-nprocs", "error"), ("xla-before-spawn", "error")}
    # **kwargs / *args the file does not settle: the check cannot tell, and says so.
    assert at_spawn("kw = load_options()", "_mp_fn, args=(), **kw") == {
        ("spawn-nprocs", "info"), ("xla-before-spawn", "info")}
    assert at_spawn("", "_mp_fn, *spawn_args") == {("spawn-nprocs", "info"), ("xla-before-spawn", "info")}
    # nothing hidden and no nprocs: torch_xla's default (every chip) still refuses an initialized runtime
    assert at_spawn("", "_mp_fn, args=()") == {("xla-before-spawn", "error")}


LOOP = """
    import torch
    import torch.nn as nn
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    from torch.utils.data import DataLoader, TensorDataset

    device = torch_xla.device()
    ds = TensorDataset(torch.randn(1024, 10), torch.randint(0, 2, (1024,)))
    loader = pl.MpDeviceLoader(DataLoader(ds, batch_size=128, shuffle=True, drop_last=True), device)
    model = nn.Linear(10, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    prev = None
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
{body}
        loss.backward()
        xm.optimizer_step(opt)
        prev = out
"""


def in_loop(*lines: str) -> str:
    return LOOP.format(body="\n".join("        " + line for line in lines))


def test_identity_comparisons_never_read_a_tensor():
    got = graded(in_loop(
        "if prev is not None and out is prev:", "    pass",
        "if loss is None:", "    continue",
        "assert x is not None",
    ))
    assert not [c for _, c, _ in got if c == "tensor-condition"]
    assert (20, "tensor-condition", "warning") in graded(in_loop("if loss > 0:", "    pass"))  # a value: a read


def test_metadata_reads_are_not_device_reads():
    got = graded(in_loop(
        *(f"if {test}:\n            pass" for test in (
            "x.nelement() == 0", "x.numel() == 0", "x.dim() != 2", "x.ndim != 2", "x.is_floating_point()",
            "x.requires_grad", "not x.is_cuda", "x.size(0) != 128", "x.shape[0] != 128", "x.dtype != torch.float32",
        )),
        "if step == 0:",
        "    print('graph node:', loss.grad_fn, 'on', x.device, 'shape', tuple(x.shape), x.size())",
    ))
    assert not [c for _, c, _ in got if c in ("tensor-condition", "print-tensor", "host-sync")]
    assert (20, "print-tensor", "warning") in graded(in_loop("print(loss)"))


def test_drop_last_false_on_some_paths_is_an_info():
    source = """
        import torch_xla
        import torch_xla.distributed.parallel_loader as pl
        from torch.utils.data import DataLoader

        def make_loader(ds, train):
            return DataLoader(ds, batch_size=64, shuffle=train, drop_last={drop_last})

        for x, y in pl.MpDeviceLoader(make_loader(ds, True), torch_xla.device()):
            model(x).sum().backward()
    """
    got = graded(source.format(drop_last="True if train else False"))
    assert (7, "ragged-batch", "info") in got
    assert "False on some paths" in messages(source.format(drop_last="True if train else False"), "ragged-batch")[0]
    assert (7, "ragged-batch", "warning") in graded(source.format(drop_last="False"))


def test_a_barrier_given_by_position_or_by_a_constant_cuts_the_graph():
    source = """
        import torch
        import torch_xla
        import torch_xla.core.xla_model as xm
        from torch.utils.data import DataLoader

        BARRIER = True
        device = torch_xla.device()
        loader = DataLoader(ds, batch_size=128, shuffle=True, drop_last=True)
        model = torch.nn.Linear(10, 2).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            model(x).sum().backward()
            xm.optimizer_step({args})
    """

    def boundary(args: str) -> set[str]:
        return {s for _, c, s in graded(source.format(args=args)) if c == "no-step-boundary"}

    assert boundary("opt, True") == set()
    assert boundary("opt, barrier=BARRIER") == set()
    assert boundary("opt") == {"warning"}
    assert boundary("opt, barrier=False") == {"warning"}
    assert boundary("opt, barrier=args.barrier") == {"info"}  # not settled by the file


def test_set_epoch_on_the_validation_sampler_does_not_count_for_the_training_sampler():
    source = """
        import torch_xla.runtime as xr
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        def train(ds, val, model, opt):
            train_sampler = DistributedSampler(ds, num_replicas=xr.world_size(), rank=xr.global_ordinal())
            val_sampler = DistributedSampler(val, num_replicas=xr.world_size(), rank=xr.global_ordinal(), shuffle=False)
            train_loader = DataLoader(ds, batch_size=128, sampler=train_sampler, drop_last=True)
            for epoch in range(3):
                {which}.set_epoch(epoch)
                for x, y in train_loader:
                    model(x).sum().backward()
                    opt.step()
    """
    missed = [(line, s) for line, c, s in graded(source.format(which="val_sampler")) if c == "sampler-set-epoch"]
    assert missed == [(7, "info")]
    assert "only val_sampler.set_epoch() (line 11)" in messages(source.format(which="val_sampler"), "sampler-set-epoch")[0]
    assert not [c for _, c, _ in graded(source.format(which="train_sampler")) if c == "sampler-set-epoch"]
    # a call the check cannot tie to one sampler may be on the training one: nothing said
    assert not [c for _, c, _ in graded(source.format(which="train_loader.sampler")) if c == "sampler-set-epoch"]
