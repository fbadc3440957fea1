import argparse
import io
import json
import re
import textwrap
from pathlib import Path

import pytest

from xlatrain.diagnostics.cli import add_doctor_parser
from xlatrain.diagnostics.script_check import (
    check_file,
    check_source,
    exit_code,
    is_port_note,
    render_json,
    render_text,
)

FIXTURES = Path(__file__).parent / "fixtures"
TUTORIALS = ["custom_dataset_tutorial.py", "lightning_tpu_docs.py", "resnet_unet_colab.py"]
# Correct scripts shaped like the patterns that fooled (or could fool) a rule: never an error.
CORRECT = sorted(p.name for p in (FIXTURES / "correct").glob("*.py"))
# What a line must report: a trailing "# expect: item, item" comment; an item is code/severity
# for a finding and the bare code for a porting note (port:...).
_ITEM = r"[a-z0-9:-]+(?:/(?:error|warning|info))?"
_EXPECT = re.compile(rf"#\s*expect:\s*({_ITEM}(?:\s*,\s*{_ITEM})*)\s*$")


def expected(path: Path, ports: bool = True) -> set[tuple[int, str, str | None]]:
    out = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = _EXPECT.search(line)
        if match:
            for item in match.group(1).split(","):
                code, _, severity = item.strip().partition("/")
                if ports or not code.startswith("port:"):
                    out.add((number, code, severity or None))
    return out


def reported(findings, ports: bool = True) -> set[tuple[int, str, str | None]]:
    return {
        (f.line, f.code, None if is_port_note(f) else f.severity)
        for f in findings
        if ports or not is_port_note(f)
    }


def found(source: str) -> set[tuple[int, str]]:
    return {(f.line, f.code) for f in check_source(textwrap.dedent(source)) if not is_port_note(f)}


def graded(source: str) -> set[tuple[int, str, str]]:
    return {(f.line, f.code, f.severity) for f in check_source(textwrap.dedent(source)) if not is_port_note(f)}


@pytest.mark.parametrize("name", TUTORIALS)
def test_every_planted_pitfall_is_found_on_its_line_with_its_severity_and_nothing_else(name):
    path = FIXTURES / name
    want = expected(path)
    assert len(want) >= 8, "the fixture lost its markers"
    got = reported(check_file(path))
    assert got == want, f"missing: {sorted(want - got)}\nunexpected: {sorted(got - want)}"


def test_the_tutorial_fixtures_keep_the_true_findings():
    """The findings a tutorial user must see: removed APIs, nprocs=8, per-step .item(),
    XLA_USE_BF16, ragged training batches - each on its line and at full severity."""
    colab = reported(check_file(FIXTURES / "resnet_unet_colab.py"), ports=False)
    assert {
        (52, "removed-api", "error"),
        (104, "spawn-nprocs", "error"),
        (76, "host-sync", "warning"),
        (13, "env-var", "warning"),
        (57, "ragged-batch", "warning"),
        (53, "optimizer-before-move", "error"),
    } <= colab
    custom = reported(check_file(FIXTURES / "custom_dataset_tutorial.py"), ports=False)
    assert {(58, "parallel-loader-iter", "error"), (37, "xla-before-spawn", "error")} <= custom


@pytest.mark.parametrize("name", CORRECT)
def test_a_correct_script_of_a_fooling_shape_gets_no_error(name):
    path = FIXTURES / "correct" / name
    findings = check_file(path)
    errors = [f for f in findings if f.severity == "error"]
    assert errors == [], render_text(name, errors)
    got = reported(findings, ports=False)
    want = expected(path, ports=False)
    assert got == want, f"missing: {sorted(want - got)}\nunexpected: {sorted(got - want)}"


def test_the_clean_script_reports_only_porting_notes():
    findings = check_file(FIXTURES / "clean_script.py")
    assert [f for f in findings if not is_port_note(f)] == [], render_text("clean_script.py", findings)
    assert findings and exit_code(findings) == 0


def test_each_finding_has_a_message_and_a_fix():
    for name in TUTORIALS:
        for f in check_file(FIXTURES / name):
            assert f.severity in ("error", "warning", "info") and f.message and f.fix, f


# ------------------------------------------------------------------ what a name holds


def test_a_parameter_named_like_a_parallel_loader_is_read_from_its_call_sites():
    src = """
        import torch_xla.distributed.parallel_loader as pl

        def train_fn(model, para_loader, device):
            for batch_idx, (inputs, labels) in enumerate(para_loader):
                model(inputs)

        def main(model, loader, device):
            para_loader = pl.ParallelLoader(loader, [device])
            train_fn(model, para_loader.per_device_loader(device), device)
    """
    assert ("parallel-loader-iter" not in {c for _, c in found(src)})
    # the same parameter, handed the ParallelLoader itself by its only caller: certainly a TypeError
    broken = src.replace("para_loader.per_device_loader(device), device)", "para_loader, device)")
    assert (5, "parallel-loader-iter", "error") in graded(broken)
    # one caller of each kind: the check cannot tell which one a run takes
    both = src.rstrip(" ") + "            train_fn(model, para_loader, device)\n"
    assert (5, "parallel-loader-iter", "info") in graded(both)


def test_a_parameter_of_a_function_called_from_elsewhere_is_unknown_so_no_error():
    src = """
        def train_fn(model, para_loader):
            for x, y in para_loader:
                model(x)
    """
    assert found("import torch_xla.distributed.parallel_loader as pl\n" + textwrap.dedent(src)) == set()


def test_the_assignment_that_reaches_the_loop_decides_not_any_assignment_in_the_file():
    src = """
        import torch_xla.distributed.parallel_loader as pl
        def run(loader, device):
            para_loader = pl.ParallelLoader(loader, [device])
            for x in para_loader.per_device_loader(device):
                pass
            para_loader = pl.MpDeviceLoader(loader, device)
            for x in para_loader:
                pass
        def other(loader, device):
            para_loader = pl.ParallelLoader(loader, [device])
            for x in para_loader:
                pass
    """
    codes = graded(src)
    assert (8, "parallel-loader-iter", "error") not in codes
    assert (12, "parallel-loader-iter", "error") in codes


def test_an_assignment_in_one_branch_only_makes_it_possible_not_certain():
    src = """
        import torch_xla.distributed.parallel_loader as pl
        def run(loader, device, fast):
            it = pl.MpDeviceLoader(loader, device)
            if fast:
                it = pl.ParallelLoader(loader, [device])
            for x in it:
                pass
    """
    assert (7, "parallel-loader-iter", "info") in graded(src)


def test_import_aliases_resolve_to_the_same_api():
    src = """
        import torch_xla.core.xla_model
        from torch_xla.core import xla_model
        from torch_xla.core import xla_model as X
        from torch_xla.core.xla_model import get_ordinal
        a = torch_xla.core.xla_model.xrt_world_size()
        b = xla_model.get_ordinal()
        c = X.mark_step()
        d = get_ordinal()
    """
    assert graded(src) == {
        (5, "removed-api", "error"),  # importing a removed name fails at import time already
        (6, "removed-api", "error"),
        (7, "removed-api", "error"),
        (8, "deprecated-api", "info"),
        (9, "removed-api", "error"),
    }


def test_a_name_the_script_binds_itself_is_not_the_torch_xla_api():
    src = """
        from torch_xla.core.xla_model import *
        def get_ordinal():
            return 0
        def train(xm):
            return xm.xrt_world_size()
        n = get_ordinal()
    """
    assert found(src) == set()


def test_star_import_resolves_known_names():
    assert found("from torch_xla.core.xla_model import *\nn = xrt_world_size()\n") == {(2, "removed-api")}


def test_removed_modules():
    src = (
        "import torch_xla.distributed.xla_dist as xd\nfrom torch_xla.experimental import pjrt\n"
        "import torch_xla_py.xla_model as xm\n"
    )
    assert graded(src) == {(1, "removed-api", "error"), (2, "removed-api", "error"), (3, "removed-api", "error")}


def test_a_removed_api_behind_a_guard_is_a_note():
    src = """
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr
        try:
            n = xm.xrt_world_size()
        except AttributeError:
            n = xr.world_size()
        r = xr.global_ordinal() if new_torch_xla else xm.get_ordinal()
        if use_tpu:
            m = xm.xrt_world_size()
    """
    assert graded(src) == {(5, "removed-api", "info"), (8, "removed-api", "info"), (10, "removed-api", "error")}


def test_get_xla_supported_devices_with_a_device_kind():
    src = "import torch_xla.core.xla_model as xm\nd = xm.get_xla_supported_devices('TPU')\nn = xm.get_xla_supported_devices()\n"
    assert found(src) == {(2, "removed-api")}


@pytest.mark.parametrize(
    "call, severity",
    [
        ("xmp.spawn(fn, args=(), nprocs=8)", "error"),
        ("xmp.spawn(fn, (), 8)", "error"),
        ("xmp.spawn(fn, nprocs=CORES)", "error"),
        ("xmp.spawn(fn, nprocs=FLAGS['cores'])", "error"),
        ("xmp.spawn(fn, nprocs=get_cores())", "info"),
        ("xmp.spawn(fn, nprocs=8 if on_tpu else 1)", "info"),
        ("xmp.spawn(fn, nprocs=RESET)", "info"),
        ("xmp.spawn(fn, nprocs=1)", None),
        ("xmp.spawn(fn, nprocs=None)", None),
        ("xmp.spawn(fn, args=())", None),
        ("xmp.spawn(fn, nprocs=ONE)", None),
    ],
)
def test_spawn_nprocs(call, severity):
    src = (
        "import torch_xla.distributed.xla_multiprocessing as xmp\nCORES = 8\nONE = 1\nFLAGS = {'cores': 8}\n"
        f"RESET = 8\nif small:\n    RESET = 1\n{call}\n"
    )
    findings = [f for f in check_source(src) if not is_port_note(f)]
    assert [(f.code, f.severity) for f in findings] == ([("spawn-nprocs", severity)] if severity else [])


def test_a_global_rebound_in_the_spawned_function_does_not_hide_the_parent_value():
    src = """
        import torch_xla.distributed.xla_multiprocessing as xmp
        FLAGS = {}
        FLAGS['num_cores'] = 8
        def _mp_fn(rank, flags):
            global FLAGS
            FLAGS = flags
        xmp.spawn(_mp_fn, args=(FLAGS,), nprocs=FLAGS['num_cores'], start_method='fork')
    """
    assert (8, "spawn-nprocs", "error") in graded(src)
    # the same rebinding in a function this process calls: the value can change before the spawn
    called = src.replace("        xmp.spawn", "        _mp_fn(0, {})\n        xmp.spawn")
    assert (9, "spawn-nprocs", "info") in graded(called)


@pytest.mark.parametrize(
    "line, severity",
    [
        ("os.environ['XLA_USE_BF16'] = '1'", "warning"),
        ("os.environ['XLA_USE_BF16'] = '0'", None),
        ("os.environ['XLA_USE_BF16'] = flag", "info"),
        ("os.environ['XLA_USE_BF16'] = 1", "error"),
        ("os.environ.setdefault('XLA_USE_BF16', '1')", "warning"),
        ("os.environ.update({'XRT_TPU_CONFIG': 'localservice;0;localhost:51011'})", "warning"),
        ("os.environ.update(TPU_IP_ADDRESS='10.0.0.2')", "warning"),
        ("os.putenv('XLA_DOWNCAST_BF16', '1')", "warning"),
        ("get_ipython().run_line_magic('env', 'XLA_USE_BF16=1')", "warning"),
        ("os.environ['PJRT_DEVICE'] = 'TPU'", None),
    ],
)
def test_environment_variables_set_in_the_script(line, severity):
    got = [(f.line, f.code, f.severity) for f in check_source(f"import os\n{line}\n") if not is_port_note(f)]
    assert got == ([(2, "env-var", severity)] if severity else [])


# ------------------------------------------------------------------ per-batch loops

_DEVICE_LOOP = """
    import torch
    import torch_xla
    import torch_xla.distributed.parallel_loader as pl
    from torch.utils.data import DataLoader

    class Net(torch.nn.Module):
        def forward(self, x):
            return x

    def train(data, best):
        device = torch_xla.device()
        model = Net().to(device)
        criterion = torch.nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (x, y) in enumerate(pl.MpDeviceLoader(DataLoader(data, batch_size=64, drop_last=True), device)):
            out = model(x)
            loss = criterion(out, y)
            loss.backward()
            optimizer.step()
            total = float(loss)
            print(loss)
            print("loss", str(loss))
            if loss < best:
                best = loss
            n = x.shape[0]
            if n > 3:
                pass
            print(f"seen {n}")
            if step % 50 == 0:
                print(loss.item())
        print(loss.item())
"""


def test_host_syncs_prints_and_branches_on_device_tensors_inside_a_batch_loop():
    assert graded(_DEVICE_LOOP) == {
        (21, "host-sync", "warning"),
        (22, "print-tensor", "warning"),
        (23, "print-tensor", "warning"),
        (24, "tensor-condition", "warning"),
        (31, "host-sync", "warning"),  # every 50 steps, still in the middle of a step
        (16, "parallel-loader", "info"),
    }


def test_where_the_code_does_not_show_the_device_a_read_is_at_most_a_note():
    src = """
        import torch_xla
        def train(model, loader, optimizer, criterion):
            for x, y in loader:
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                torch_xla.sync()
                print(loss.item())
                total = float(loss)
    """
    assert graded(src) == {(9, "host-sync", "info")}


def test_reads_of_cpu_batches_are_not_device_syncs():
    src = """
        import torch, torch_xla
        from torch.utils.data import DataLoader
        def stats(data):
            total = 0
            for x, y in DataLoader(data, batch_size=64):
                total += y.sum().item()
                print(x.mean())
            return total
    """
    assert found(src) == set()


def test_a_loop_with_backward_is_a_step_loop_even_without_a_loader_name():
    src = """
        import torch, torch_xla
        def run(batches_source, opt):
            model = torch.nn.Linear(4, 2).to(torch_xla.device())
            while True:
                x = next(batches_source)
                loss = model(x).mean()
                loss.backward()
                opt.step()
                torch_xla.sync()
                print(loss.item())
    """
    assert graded(src) == {(11, "host-sync", "warning")}


def test_optimizer_before_move_only_matters_on_xla():
    body = """
        class Net(torch.nn.Module):
            pass
        device = torch_xla.device()
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.to(device)
    """
    assert graded("import torch\nimport torch_xla\n" + textwrap.dedent(body)) == {(8, "optimizer-before-move", "error")}
    cuda = textwrap.dedent(body).replace("torch_xla.device()", "torch.device('cuda')")
    assert found("import torch\n" + cuda) == set()  # CUDA keeps the Parameter objects
    after = "import torch\nimport torch_xla\nmodel = torch.nn.Linear(2, 2).to(torch_xla.device())\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    assert found(after) == set()


def test_an_optimizer_built_at_import_time_and_stepped_after_the_move():
    src = """
        import torch, torch_xla
        import torch_xla.core.xla_model as xm
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        def _mp_fn(index):
            model.to(torch_xla.device())
            xm.optimizer_step(optimizer)
    """
    assert (5, "optimizer-before-move", "error") in graded(src)


def test_device_before_spawn_in_the_same_function():
    src = """
        import torch_xla
        import torch_xla.distributed.xla_multiprocessing as xmp
        def main():
            device = torch_xla.device()
            xmp.spawn(fn)
        def fn(i):
            device = torch_xla.device()
    """
    assert graded(src) == {(5, "xla-before-spawn", "error")}


def test_runtime_started_at_import_before_a_spawn_in_main():
    src = """
        import torch_xla.runtime as xr
        import torch_xla.distributed.xla_multiprocessing as xmp
        NUM = xr.world_size()
        def main():
            xmp.spawn(fn, args=(NUM,))
        def fn(i, n):
            pass
        if __name__ == "__main__":
            main()
    """
    assert graded(src) == {(4, "xla-before-spawn", "error")}
    # main() defined but never called in this file: the spawn may never follow the import
    assert graded(src.replace("            main()", "            pass")) == set()


def test_training_loop_without_a_graph_cut_on_xla():
    src = """
        import torch, torch_xla
        from torch.utils.data import DataLoader
        def fit(data):
            model = torch.nn.Linear(4, 2).to(torch_xla.device())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in DataLoader(data, batch_size=32, drop_last=True):
                model(x).sum().backward()
                opt.step()
    """
    assert graded(src) == {(7, "no-step-boundary", "warning")}
    assert found(src.replace("opt.step()", "opt.step()\n                torch_xla.sync()")) == set()
    # the loop's loader comes from another file: it may be an MpDeviceLoader
    unknown = """
        import torch_xla
        def fit(model, loader, opt):
            for x, y in loader:
                model(x).sum().backward()
                opt.step()
    """
    assert graded(unknown) == {(4, "no-step-boundary", "info")}


def test_torch_load_weights_only():
    src = "import torch\na = torch.load('x.pt')\nb = torch.load('x.pt', weights_only=False)\nc = torch.load('x.pt', weights_only=True)\n"
    assert graded(src) == {(2, "torch-load", "info"), (3, "torch-load", "info")}


def test_data_dependent_shapes_on_xla():
    src = """
        import torch, torch_xla
        class Head(torch.nn.Module):
            def forward(self, x):
                i = x.nonzero()
                j = torch.where(x > 0)
                k = torch.where(x > 0, x, 0)
                return torch.unique(x)
        def prepare(df):
            return df["patient"].unique()
    """
    assert graded(src) == {(5, "dynamic-shape", "info"), (6, "dynamic-shape", "info"), (8, "dynamic-shape", "info")}
    on_device = src + "        model = Head().to(torch_xla.device())\n"
    assert graded(on_device) == {(5, "dynamic-shape", "warning"), (6, "dynamic-shape", "warning"), (8, "dynamic-shape", "warning")}


def test_a_data_dependent_shape_is_a_warning_only_where_it_runs_every_step():
    src = """
        import torch, torch_xla
        import torch_xla.distributed.parallel_loader as pl
        device = torch_xla.device()
        classes = torch.unique(torch.randint(0, 4, (64,), device=device))
        def train(loader, model, opt):
            for x, y in pl.MpDeviceLoader(loader, device):
                kept = x[y.nonzero()]
                model(kept).sum().backward()
                opt.step()
    """
    assert {(line, severity) for line, code, severity in graded(src) if code == "dynamic-shape"} == {
        (5, "info"),
        (8, "warning"),
    }


def test_weight_tying_before_the_move_in_a_plain_module():
    src = """
        import torch_xla
        from torch import nn
        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(100, 16)
                self.head = nn.Linear(16, 100, bias=False)
                self.head.weight = self.embed.weight
    """
    assert graded(src) == {(9, "weight-tying", "info")}
    moved = src + "        model = LM().to(torch_xla.device())\n"
    assert graded(moved) == {(9, "weight-tying", "error")}


def test_ragged_training_batches_follow_the_loader_into_the_loop():
    src = """
        import torch, torch_xla
        import torch_xla.distributed.parallel_loader as pl
        from torch.utils.data import DataLoader
        def train_loop(loader, model, opt):
            for x, y in loader:
                model(x).sum().backward()
                opt.step()
        def main(train_set, val_set):
            device = torch_xla.device()
            model = torch.nn.Linear(4, 2).to(device)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            a = DataLoader(train_set, batch_size=32)
            b = DataLoader(val_set, batch_size=32)
            para = pl.ParallelLoader(a, [device])
            train_loop(para.per_device_loader(device), model, opt)
            for x, y in pl.MpDeviceLoader(b, device):
                model(x)
    """
    codes = graded(src)
    assert (13, "ragged-batch", "warning") in codes
    assert not {c for c in codes if c[0] == 14 and c[1] == "ragged-batch"}


def test_loaders_returned_as_a_tuple_keep_their_places():
    src = """
        import torch, torch_xla
        from torch.utils.data import DataLoader
        def make(a_set, b_set):
            return DataLoader(a_set, batch_size=32), DataLoader(b_set, batch_size=32)
        def main(a_set, b_set):
            model = torch.nn.Linear(4, 2).to(torch_xla.device())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            first, second = make(a_set, b_set)
            for x, y in first:
                model(x).sum().backward()
                opt.step()
                torch_xla.sync()
            for x, y in second:
                model(x)
    """
    ragged = {(line, severity) for line, code, severity in graded(src) if code == "ragged-batch"}
    assert ragged == {(5, "warning")}  # both loaders are on line 5: one finding, for the first


def test_a_snippet_that_leaves_out_its_imports_still_names_torch_dataloader():
    src = """
        import torch_xla.core.xla_model as xm
        def train(model, dataset, opt):
            loader = DataLoader(dataset, batch_size=16, shuffle=True)
            for x, y in loader:
                model(x).sum().backward()
                xm.optimizer_step(opt, barrier=True)
    """
    assert (4, "ragged-batch", "warning") in graded(src)


def test_a_model_moved_in_place_makes_its_outputs_device_tensors():
    src = """
        import torch, torch_xla
        import torch_xla.distributed.parallel_loader as pl
        def train(loader):
            device = torch_xla.device()
            model = torch.nn.Linear(4, 2)
            model.to(device)
            for x in pl.MpDeviceLoader(loader, device):
                loss = model(x).sum()
                loss.backward()
                print(loss.item())
    """
    assert (11, "host-sync", "warning") in graded(src)


@pytest.mark.parametrize(
    "loader, severity",
    [
        ("DataLoader(data, batch_size=32)", "warning"),
        ("DataLoader(data, **loader_kwargs)", "info"),  # drop_last may be in there
        ("DataLoader(data, 32, True, None, None, 0, None, False, True)", None),  # positional drop_last
        ("DataLoader(data, batch_size=32, drop_last=cfg.drop_last)", "info"),
        ("DataLoader(data, batch_sampler=buckets)", None),
        ("DataLoader(data, batch_size=None)", None),
    ],
)
def test_ragged_batch_reads_what_the_dataloader_call_says(loader, severity):
    src = f"""
        import torch, torch_xla
        from torch.utils.data import DataLoader
        def train(data, model, opt, loader_kwargs, cfg, buckets):
            for x, y in {loader}:
                model(x).sum().backward()
                opt.step()
                torch_xla.sync()
    """
    got = {s for line, code, s in graded(src) if code == "ragged-batch"}
    assert got == ({severity} if severity else set())


def test_a_lightning_script_off_tpu_gets_ragged_batches_as_a_note():
    src = """
        import lightning as L
        from torch.utils.data import DataLoader
        class M(L.LightningModule):
            def train_dataloader(self):
                return DataLoader(self.data, batch_size=64, shuffle=True)
        L.Trainer(accelerator=ACCEL).fit(M())
    """
    assert (6, "ragged-batch", "info") in graded(src.replace("ACCEL", '"gpu"'))
    assert (6, "ragged-batch", "warning") in graded(src.replace("ACCEL", '"tpu"'))


def test_manual_lr_scaling_forms():
    src = """
        import torch
        import torch_xla.runtime as xr
        lr = 0.1 * xr.world_size()
        opt = torch.optim.SGD(params, lr=base_lr * world_size)
        steps = 100 * xr.world_size()
    """
    assert found(src) == {(4, "manual-lr-scaling"), (5, "manual-lr-scaling")}


def test_a_value_passed_through_thousands_of_names_is_unsettled_not_a_crash():
    lines = ["import torch, torch_xla", "x0 = torch.zeros(3, device=torch_xla.device())"]
    lines += [f"x{i} = x{i - 1} + 1" for i in range(1, 3000)]
    lines += ["for step in range(10):", "    loss = x2999.sum()", "    loss.backward()", "    print(loss.item())"]
    findings = check_source("\n".join(lines) + "\n")
    assert [(f.code, f.severity) for f in findings if f.line == 3005] == [("host-sync", "info")]


# ------------------------------------------------------------------ porting notes


def test_each_torch_xla_call_family_gets_its_porting_note():
    src = """
        import os
        os.environ["XLA_USE_BF16"] = "1"
        import torch
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met
        import torch_xla.distributed.parallel_loader as pl
        import torch_xla.distributed.xla_multiprocessing as xmp
        import torch_xla.runtime as xr
        from torch.utils.data.distributed import DistributedSampler
        def _mp_fn(index):
            device = xm.xla_device()
            sampler = DistributedSampler(data, num_replicas=xr.world_size(), rank=xr.global_ordinal())
            loader = pl.MpDeviceLoader(make_loader(sampler), device)
            xm.optimizer_step(opt)
            xm.mark_step()
            xm.master_print("x")
            xm.save(state, "w.pt")
            v = xm.mesh_reduce("v", 1.0, sum)
            xm.add_step_closure(print)
            print(met.metrics_report())
            xm.wait_device_ops()
        xmp.spawn(_mp_fn)
    """
    ports = {(f.line, f.code) for f in check_source(textwrap.dedent(src)) if is_port_note(f)}
    assert ports == {
        (3, "port:bf16"),
        (5, "port:import"),
        (13, "port:device"),
        (14, "port:sampler"),
        (14, "port:world"),
        (15, "port:loader"),
        (16, "port:optimizer-step"),
        (17, "port:sync"),
        (18, "port:print"),
        (19, "port:save"),
        (20, "port:collective"),
        (21, "port:step-closure"),
        (22, "port:metrics"),
        (23, "port:wait"),
        (24, "port:launch"),
    }
    for f in check_source(textwrap.dedent(src)):
        if is_port_note(f):
            assert f.severity == "info" and "on TorchTPU" in f.message and f.fix, f


def test_porting_notes_never_change_the_exit_code():
    findings = check_source("import torch_xla\nimport torch_xla.core.xla_model as xm\nxm.master_print('hi')\nxm.wait_device_ops()\n")
    assert [f for f in findings if not is_port_note(f) and f.severity != "info"] == []
    assert any(is_port_note(f) for f in findings)
    assert exit_code(findings) == 0


def test_porting_notes_render_grouped_after_the_problems():
    findings = check_file(FIXTURES / "resnet_unet_colab.py")
    text = render_text("colab.py", findings)
    body = text.splitlines()
    section = next(i for i, line in enumerate(body) if "porting to TorchTPU" in line)
    problem_lines = [i for i, line in enumerate(body) if re.match(r"colab\.py:\d+:\d+: ", line)]
    assert problem_lines and max(problem_lines) < section  # every real finding comes first
    entries = [line for line in body[section:] if line.startswith("  [port:")]
    codes = [re.match(r"  \[(port:[a-z0-9-]+)\]", line).group(1) for line in entries]
    assert len(codes) == len(set(codes)) == len({f.code for f in findings if is_port_note(f)})
    world = next(line for line in entries if "[port:world]" in line)
    assert "xm.xrt_world_size (lines 52, 56, 58)" in world and "xm.get_ordinal (lines 56, 58, 78)" in world
    assert text.splitlines()[-1].endswith("porting note(s)")


# ------------------------------------------------------------------ input errors and the command line


def test_a_syntax_error_names_the_line_and_the_fix():
    with pytest.raises(ValueError, match=r"nb\.py:2: not valid Python .*nbconvert --to script"):
        check_source("import os\n%env XLA_USE_BF16=1\n", "nb.py")


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"no such file: pass the path of a Python training script"):
        check_file(tmp_path / "nope.py")


def _doctor(*argv):
    parser = argparse.ArgumentParser(prog="xlatrain")
    add_doctor_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *argv])
    out = io.StringIO()
    return args.func(args, out=out), out.getvalue()


def test_cli_script_check_text_and_exit_codes():
    code, text = _doctor(str(FIXTURES / "clean_script.py"))
    assert code == 0 and "no known torch_xla pitfalls found" in text and "porting to TorchTPU" in text
    code, text = _doctor(str(FIXTURES / "custom_dataset_tutorial.py"))
    assert code == 1
    assert re.search(r"custom_dataset_tutorial\.py:\d+:\d+: error \[spawn-nprocs\] xmp\.spawn\(nprocs=8\)", text)


def test_cli_script_check_json_parses():
    paths = [str(FIXTURES / n) for n in ("clean_script.py", "resnet_unet_colab.py")]
    code, text = _doctor("--json", *paths)
    data = json.loads(text)
    assert code == data["exit_code"] == 1
    clean, colab = data["scripts"]
    assert [f for f in clean["findings"] if not f["code"].startswith("port:")] == [] and clean["exit_code"] == 0
    got = {(f["line"], f["code"], None if f["code"].startswith("port:") else f["severity"]) for f in colab["findings"]}
    assert got == expected(FIXTURES / "resnet_unet_colab.py")
    assert json.loads(render_json({})) == {"exit_code": 0, "scripts": []}


def test_a_device_value_read_on_the_main_process_only_gets_the_torchtpu_note():
    src = textwrap.dedent("""
        import torch
        import torch.distributed as dist
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        def train(model, loader):
            device = xm.xla_device()
            model = model.to(device)
            total = torch.zeros((), device=device)
            for x, y in loader:
                total += model(x.to(device)).sum().detach()
            if xm.is_master_ordinal():
                print(f"loss {total.item():.3f}")
            if xr.global_ordinal() == 0:
                print(total)
            if 0 == dist.get_rank() and total is not None:
                host = total.cpu()
            value = total.item()
            if xm.is_master_ordinal():
                print(value)
            if xr.global_ordinal() == 1:
                print(total.item())
    """)
    notes = [f for f in check_source(src) if f.code == "port:read-on-every-process"]
    # Inside each branch taken on one process (rank 1's too); not the read made on every process.
    assert [f.line for f in notes] == [14, 16, 18, 23]
    assert "every process must make the same host reads" in notes[0].message
    assert notes[0].severity == "info"


def test_a_padding_collate_without_a_few_lengths_is_flagged_and_one_with_them_is_not():
    source = """
    import torch_xla.core.xla_model as xm
    from torch.nn.utils.rnn import pad_sequence
    from transformers import DataCollatorWithPadding
    import xlatrain
    per_batch = DataCollatorWithPadding(tokenizer)
    multiple = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=64)
    fixed = DataCollatorWithPadding(tokenizer, padding="max_length")
    ours = xlatrain.PadCollate()
    bucketed = xlatrain.PadCollate(buckets=(128, 256))
    def collate(items):
        return pad_sequence([x for x, _ in items], batch_first=True)
    """
    assert {(line, severity) for line, code, severity in graded(source) if code == "ragged-lengths"} == {
        (6, "warning"), (9, "warning"), (12, "warning")}
    # Without XLA in the script, the same lengths cost nothing where it runs: a note, not a warning.
    plain = source.replace("    import torch_xla.core.xla_model as xm\n", "")
    assert {sev for _, code, sev in graded(plain) if code == "ragged-lengths"} == {"info"}


def test_a_training_loader_without_a_sampler_is_named_only_where_several_processes_run():
    body = """
        import torch, torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        def main():
            dist.init_process_group("gloo")
            data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
            loader = DataLoader(data, batch_size=8, drop_last=True{sampler})
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in loader:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
    """
    assert graded(body.format(sampler="")) >= {(8, "unsharded-loader", "info")}
    assert (8, "unsharded-loader") not in found(body.format(sampler=", sampler=DistributedSampler(data)"))
    one_process = body.replace('dist.init_process_group("gloo")', "pass").replace(
        "torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))", "torch.nn.Linear(4, 2)")
    assert (8, "unsharded-loader") not in found(one_process.format(sampler=""))


def test_porting_notes_name_no_torch_tpu_call_that_torchtpu_keeps_for_torch_itself():
    # On torch >= 2.11 TorchTPU raises RuntimeError at torch.tpu.synchronize() / set_device() called
    # from user code, and names the torch.accelerator call to use instead.
    import importlib.util
    import sys

    from conftest import run_bounded, script_env
    from xlatrain.doctor.script_check.common import _PORTS

    src = "import torch_xla.core.xla_model as xm\nxm.mark_step()\nxm.wait_device_ops()\n"
    notes = {f.code: f.message for f in check_source(src) if is_port_note(f)}
    assert "torch.accelerator.synchronize()" in notes["port:sync"], notes["port:sync"]
    assert "torch.accelerator.synchronize()" in notes["port:wait"], notes["port:wait"]
    named = sorted({n for port in _PORTS.values() for n in re.findall(r"torch\.tpu\.(\w+)", port.torch_tpu)})
    if importlib.util.find_spec("torch_tpu") is None:
        return
    code = ("import torch\nprint([n for n in %r if getattr(getattr(torch.tpu, n, None), '__tt_api_stage__', '') "
            "== 'Internal'])" % named)
    proc = run_bounded([sys.executable, "-c", code], script_env({"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}), 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", f"internal to TorchTPU on this torch: {proc.stdout}"
