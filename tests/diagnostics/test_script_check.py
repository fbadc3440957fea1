import argparse
import io
import json
import re
import textwrap
from pathlib import Path

import pytest

from xlatrain.diagnostics.cli import add_doctor_parser
from xlatrain.diagnostics.script_check import check_file, check_source, exit_code, render_json, render_text

FIXTURES = Path(__file__).parent / "fixtures"
TUTORIALS = ["custom_dataset_tutorial.py", "lightning_tpu_docs.py", "resnet_unet_colab.py"]
# A planted pitfall: a trailing "# expect: code, code" comment on the line that holds it.
_EXPECT = re.compile(r"#\s*expect:\s*([a-z-]+(?:\s*,\s*[a-z-]+)*)\s*$")


def expected(path: Path) -> set[tuple[int, str]]:
    out = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = _EXPECT.search(line)
        if match:
            out |= {(number, code.strip()) for code in match.group(1).split(",")}
    return out


def found(source: str) -> set[tuple[int, str]]:
    return {(f.line, f.code) for f in check_source(textwrap.dedent(source))}


@pytest.mark.parametrize("name", TUTORIALS)
def test_every_planted_pitfall_is_found_on_its_line_and_nothing_else(name):
    path = FIXTURES / name
    want = expected(path)
    assert len(want) >= 5, "the fixture lost its markers"
    got = {(f.line, f.code) for f in check_file(path)}
    assert got == want, f"missing: {sorted(want - got)}\nunexpected: {sorted(got - want)}"


def test_the_clean_script_reports_nothing():
    findings = check_file(FIXTURES / "clean_script.py")
    assert findings == (), render_text("clean_script.py", findings)
    assert exit_code(findings) == 0


def test_each_finding_has_a_message_and_a_fix():
    for name in TUTORIALS:
        for f in check_file(FIXTURES / name):
            assert f.severity in ("error", "warning", "info") and f.message and f.fix, f


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
    assert found(src) == {
        (5, "removed-api"),  # importing a removed name fails at import time already
        (6, "removed-api"),
        (7, "removed-api"),
        (8, "deprecated-api"),
        (9, "removed-api"),
    }


def test_star_import_resolves_known_names():
    assert found("from torch_xla.core.xla_model import *\nn = xrt_world_size()\n") == {(2, "removed-api")}


def test_removed_modules():
    src = "import torch_xla.distributed.xla_dist as xd\nfrom torch_xla.experimental import pjrt\n"
    assert found(src) == {(1, "removed-api"), (2, "removed-api")}


def test_get_xla_supported_devices_with_a_device_kind():
    src = "import torch_xla.core.xla_model as xm\nd = xm.get_xla_supported_devices('TPU')\nn = xm.get_xla_supported_devices()\n"
    assert found(src) == {(2, "removed-api")}


@pytest.mark.parametrize(
    "call, code",
    [
        ("xmp.spawn(fn, args=(), nprocs=8)", "spawn-nprocs"),
        ("xmp.spawn(fn, (), 8)", "spawn-nprocs"),
        ("xmp.spawn(fn, nprocs=CORES)", "spawn-nprocs"),
        ("xmp.spawn(fn, nprocs=FLAGS['cores'])", "spawn-nprocs"),
        ("xmp.spawn(fn, nprocs=get_cores())", "spawn-nprocs"),
        ("xmp.spawn(fn, nprocs=1)", None),
        ("xmp.spawn(fn, nprocs=None)", None),
        ("xmp.spawn(fn, args=())", None),
        ("xmp.spawn(fn, nprocs=ONE)", None),
    ],
)
def test_spawn_nprocs(call, code):
    src = f"import torch_xla.distributed.xla_multiprocessing as xmp\nCORES = 8\nONE = 1\nFLAGS = {{'cores': 8}}\n{call}\n"
    findings = check_source(src)
    assert [f.code for f in findings] == ([code] if code else [])
    if code:
        assert findings[0].severity == ("warning" if "get_cores" in call else "error")


@pytest.mark.parametrize(
    "line, hit",
    [
        ("os.environ['XLA_USE_BF16'] = '1'", True),
        ("os.environ['XLA_USE_BF16'] = '0'", False),
        ("os.environ.setdefault('XLA_USE_BF16', '1')", True),
        ("os.environ.update({'XRT_TPU_CONFIG': 'localservice;0;localhost:51011'})", True),
        ("os.environ.update(TPU_IP_ADDRESS='10.0.0.2')", True),
        ("os.putenv('XLA_DOWNCAST_BF16', '1')", True),
        ("get_ipython().run_line_magic('env', 'XLA_USE_BF16=1')", True),
        ("os.environ['PJRT_DEVICE'] = 'TPU'", False),
    ],
)
def test_environment_variables_set_in_the_script(line, hit):
    got = check_source(f"import os\n{line}\n")
    assert [(f.line, f.code) for f in got] == ([(2, "env-var")] if hit else [])


def test_host_syncs_prints_and_branches_inside_a_batch_loop():
    src = """
        import torch
        import torch_xla

        def train(model, loader, optimizer, criterion, best):
            for x, y in loader:
                out = model(x)
                loss = criterion(out, y)
                loss.backward()
                optimizer.step()
                torch_xla.sync()
                total = float(loss)
                print(loss)
                print("loss", str(loss))
                if loss < best:
                    best = loss
                n = x.shape[0]
                if n > 3:
                    pass
                print(f"seen {n}")
            print(loss.item())
    """
    assert found(src) == {
        (12, "host-sync"),
        (13, "print-tensor"),
        (14, "print-tensor"),
        (15, "tensor-condition"),
    }


def test_a_loop_with_backward_is_a_step_loop_even_without_a_loader_name():
    src = """
        import torch_xla
        def run(model, batches_source, opt):
            while True:
                x = next(batches_source)
                loss = model(x).mean()
                loss.backward()
                opt.step()
                torch_xla.sync()
                print(loss.item())
    """
    assert found(src) == {(10, "host-sync")}


def test_optimizer_before_move_only_matters_on_xla():
    body = """
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.to(device)
    """
    assert found("import torch\nimport torch_xla\n" + textwrap.dedent(body)) == {(5, "optimizer-before-move")}
    assert found("import torch\n" + textwrap.dedent(body)) == set()  # CUDA keeps the Parameter objects
    after = "import torch\nimport torch_xla\nmodel = Net().to(device)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    assert found(after) == set()


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
    assert found(src) == {(5, "xla-before-spawn")}


def test_training_loop_without_a_graph_cut_on_xla():
    src = """
        import torch_xla
        def fit(model, loader, opt):
            for x, y in loader:
                model(x).sum().backward()
                opt.step()
    """
    assert found(src) == {(4, "no-step-boundary")}
    assert found(src.replace("opt.step()", "opt.step()\n                torch_xla.sync()")) == set()


def test_torch_load_weights_only():
    src = "import torch\na = torch.load('x.pt')\nb = torch.load('x.pt', weights_only=False)\nc = torch.load('x.pt', weights_only=True)\n"
    got = {(f.line, f.code, f.severity) for f in check_source(src)}
    assert got == {(2, "torch-load", "info"), (3, "torch-load", "warning")}


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
    assert found(src) == {(5, "dynamic-shape"), (6, "dynamic-shape"), (8, "dynamic-shape")}


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
    assert found(src) == {(9, "weight-tying")}


def test_manual_lr_scaling_forms():
    src = """
        import torch
        import torch_xla.runtime as xr
        lr = 0.1 * xr.world_size()
        opt = torch.optim.SGD(params, lr=base_lr * world_size)
        steps = 100 * xr.world_size()
    """
    assert found(src) == {(4, "manual-lr-scaling"), (5, "manual-lr-scaling")}


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
    assert code == 0 and "no known torch_xla pitfalls found" in text
    code, text = _doctor(str(FIXTURES / "custom_dataset_tutorial.py"))
    assert code == 1
    assert re.search(r"custom_dataset_tutorial\.py:\d+:\d+: error \[spawn-nprocs\] xmp\.spawn\(nprocs=8\)", text)


def test_cli_script_check_json_parses():
    paths = [str(FIXTURES / n) for n in ("clean_script.py", "resnet_unet_colab.py")]
    code, text = _doctor("--json", *paths)
    data = json.loads(text)
    assert code == data["exit_code"] == 1
    clean, colab = data["scripts"]
    assert clean["findings"] == [] and clean["exit_code"] == 0
    assert {(f["line"], f["code"]) for f in colab["findings"]} == expected(FIXTURES / "resnet_unet_colab.py")
    assert json.loads(render_json({})) == {"exit_code": 0, "scripts": []}
