"""XlaBackend details on real XLA:CPU, each in a fresh process."""

import json
import subprocess
import sys

import pytest

from conftest import SCRIPTS, run_bounded, run_command, script_env
from xlatrain.backend.xla import cpu_runtime_defaults

TIED = """
import torch
from torch import nn
import xlatrain
from xlatrain.backend.precision import Precision
be = xlatrain.select_backend("xla", devices=2)
model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
model[1].weight = model[0].weight
moved = be.strategy.prepare_model(model, Precision("32", "xla"))
assert moved[1].weight is moved[0].weight, "tie lost"
assert len(list(moved.parameters())) == 1
print("TIED OK", moved[0].weight.device)
"""


def _snippet(code, tmp_path):
    """``code`` in a fresh process on XLA:CPU (torch_xla starts once per process)."""
    env = {"PJRT_DEVICE": "CPU", "PATH": "/usr/bin:/bin", "XLATRAIN_CACHE_DIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.xla
def test_tied_weights_stay_tied_after_moving_to_an_xla_device(tmp_path):
    out = _snippet(TIED, tmp_path)
    assert "TIED OK xla" in out.stdout, out.stderr[-3000:]


BF16_NOTE = """
import os, xlatrain
be = xlatrain.select_backend("xla", devices=1)
for value in ("1", "0"):
    os.environ["XLA_USE_BF16"] = value
    print("NOTES", value, be.runtime.notes(False))
"""


@pytest.mark.xla
def test_the_tutorials_bf16_switch_is_named_in_the_run_header(tmp_path):
    # XLA_USE_BF16=1 trains in bf16 while the header said "precision 32" and dtypes read float32.
    out = _snippet(BF16_NOTE, tmp_path)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("NOTES ")]
    assert len(lines) == 2, out.stderr[-3000:]
    assert "XLA_USE_BF16=1 is set" in lines[0] and "trains in bfloat16 whatever its precision says" in lines[0]
    assert "precision='bf16'" in lines[0]
    assert lines[1] == "NOTES 0 []"


MULTIPROCESS_COUNT = """
import xlatrain
try:
    xlatrain.select_backend("xla", devices=2, xla_mode="multiprocess")
except ValueError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.xla
def test_a_device_count_in_the_multiprocess_mode_points_to_the_launch_not_to_a_setting(tmp_path):
    # One process per device: the count is the launch's, and on XLA:CPU that mode hangs past one
    # device, so the fix is spawn or SPMD, not CPU_NUM_DEVICES.
    out = _snippet(MULTIPROCESS_COUNT, tmp_path)
    refused = out.stdout.partition("REFUSED ")[2]
    assert "devices=2 with xla_mode='multiprocess', but this process is one of 1 CPU process(es)" in refused, out.stderr[-3000:]
    assert "use devices=1 or None" in refused and "xlatrain.spawn(fn, args)" in refused and "xla_mode='spmd'" in refused
    assert "CPU_NUM_DEVICES" not in refused and "collectives between processes there hang" in refused


@pytest.fixture(scope="module")
def cached_runs(tmp_path_factory):
    """compile_count.py (SPMD over 4 devices) three times with one compile cache: ``a`` writes it,
    ``b`` and ``c`` read it (``c`` asks for XLA's warnings with TF_CPP_MIN_LOG_LEVEL=1). Two tests
    read these runs: one process start of torch_xla and its compilations is most of each."""
    tmp = tmp_path_factory.mktemp("cached")
    env = script_env({"PJRT_DEVICE": "CPU", "XLATRAIN_CACHE_DIR": str(tmp / "cache")})
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    runs = {}
    for run, extra in (("a", {}), ("b", {}), ("c", {"TF_CPP_MIN_LOG_LEVEL": "1"})):
        proc = run_bounded([sys.executable, str(SCRIPTS / "compile_count.py"), str(tmp / run)], {**env, **extra}, 300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        [history] = [ln[len("HISTORY "):] for ln in proc.stdout.splitlines() if ln.startswith("HISTORY ")]
        runs[run] = (json.loads(history), proc.stderr)
    return tmp / "cache", runs


@pytest.mark.xla
def test_the_compile_cache_is_written_and_the_second_run_reports_what_it_got(cached_runs):
    cache, runs = cached_runs
    (first, _), (second, _) = runs["a"], runs["b"]
    compiled = sum(row["xla_compilations"] for row in first)  # each epoch's own count
    assert sum(row["xla_cache_misses"] for row in first) == compiled > 0 and any(cache.iterdir())
    # Every graph of the second run was looked up in the cache: a hit on TPU/GPU; on XLA:CPU
    # torch_xla 2.9 cannot deserialize its own entries, and the history says so.
    got = sum(row["xla_cache_hits"] + row["xla_cache_load_failures"] for row in second)
    assert got == compiled and sum(row["xla_cache_misses"] for row in second) == 0


PEAK = """
import json, torch
import xlatrain
from xlatrain.backend.peak import measured_peak
be = xlatrain.select_backend("xla", devices=2)
xla, source = be.runtime.peak_flops(torch.float32)
cpu, _ = measured_peak(torch.device("cpu"), torch.float32, lambda t: None, "cpu", cache=False)
print("PEAK " + json.dumps({"xla": xla, "cpu": cpu, "source": source}))
"""


@pytest.mark.xla
def test_the_xla_cpu_peak_is_the_rate_the_cores_compute_at_not_the_rate_of_dispatch(tmp_path):
    """MFU on XLA:CPU is measured against a timed matmul: it must be timed to its end. Timed to its
    dispatch (what torch_xla's unlazy returns after) it read ~1,500x the rate of the same cores
    under eager torch, and every run printed MFU 0.0%."""
    proc = run_command([sys.executable, "-c", PEAK], env={"PJRT_DEVICE": "CPU", "XLATRAIN_CACHE_DIR": str(tmp_path / "xla")})
    peak = json.loads(proc.stdout.split("PEAK ", 1)[1])
    assert "shared by 2 virtual device(s)" in peak["source"]
    # One device's share of what XLA's threads reach, against eager torch on this process's
    # threads (one under the tests): the same cores, within a small factor.
    assert peak["cpu"] / 20 < peak["xla"] < peak["cpu"] * 20, peak
    assert json.loads((tmp_path / "peak_flops.json").read_text())  # measured once, then kept


LOADER = """
import json
import torch
import torch_xla
import torch_xla.debug.metrics as met
import xlatrain

be = xlatrain.select_backend("xla", devices=2)
host = [({"a": torch.full((4, 3), float(i)), "b": (torch.arange(4) + i,)}, torch.ones(4) * i) for i in range(5)]
torch_xla.sync()
cuts = met.counter_value("MarkStep") or 0
got = []
for inputs, targets in be.runtime.wrap_loader(host, be.strategy.input_sharding):
    got.append((inputs, targets))
cuts = (met.counter_value("MarkStep") or 0) - cuts
first, targets = got[0]
spec = torch_xla._XLAC._get_xla_sharding_spec(first["a"])


def failing():
    yield host[0]
    raise ValueError("item 7 is corrupt")


try:
    for _ in be.runtime.wrap_loader(failing(), be.strategy.input_sharding):
        pass
    error = None
except ValueError as exc:
    error = str(exc)


import threading
made_on_main = []


def recording():
    for i in range(3):
        made_on_main.append(threading.current_thread() is threading.main_thread())
        yield torch.full((4,), float(i))


consumed = [b.cpu().tolist() for b in be.runtime.wrap_loader(recording(), be.strategy.input_sharding)]
empty = list(be.runtime.wrap_loader([], be.strategy.input_sharding))
print("RESULT " + json.dumps({
    "made_on_main": made_on_main, "consumed": consumed, "empty": len(empty),
    "cuts": cuts, "batches": len(got), "structure": [type(b).__name__ for b in (got[0], first, first["b"])],
    "device": first["a"].device.type, "spec": spec,
    "values": all(torch.equal(x["a"].cpu(), h[0]["a"]) and torch.equal(x["b"][0].cpu(), h[0]["b"][0])
                  and torch.equal(y.cpu(), h[1]) for (x, y), h in zip(got, host)),
    "error": error, "aliasing": __import__("os").environ.get("XLA_ENABLE_PARAM_ALIASING"),
}))
"""


def _result(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.xla
def test_the_device_loader_keeps_batches_whole_sharded_and_leaves_graph_cuts_to_the_step(tmp_path):
    got = _result(run_command([sys.executable, "-c", LOADER], env={"PJRT_DEVICE": "CPU"}))
    assert got["batches"] == 5 and got["values"] and got["device"] == "xla"
    assert got["structure"] == ["tuple", "dict", "tuple"]  # torch_xla's own loader returns lists
    assert "devices=[2,1]" in got["spec"]  # dim 0 split over the two devices of the data axis
    # One cut before the first batch and one when the data runs out, none per batch: the
    # Trainer's step_end cuts each step, and a second cut would wait for the step to finish.
    assert got["cuts"] <= 2
    # A failing dataset fails the epoch instead of ending it early as if the data had run out.
    assert got["error"] == "item 7 is corrupt"
    assert got["aliasing"] == "0"
    # The first batch is made on the calling thread (a loader forks its worker processes there,
    # with the device idle), the rest in torch_xla's loader thread; nothing is lost or reordered.
    assert got["made_on_main"] == [True, False, False]
    assert got["consumed"] == [[0.0] * 4, [1.0] * 4, [2.0] * 4] and got["empty"] == 0


STEPS = """
import functools, json, sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
import torch_xla.debug.metrics as met
import xlatrain
from xlatrain.diagnostics import xla_metrics

mode, dropout = sys.argv[1], sys.argv[2] == "dropout"
torch.manual_seed(0)
layers = [nn.Linear(8, 32), nn.ReLU()] + ([nn.Dropout(0.3)] if dropout else []) + [nn.Linear(32, 2)]
trainer = xlatrain.Trainer(
    nn.Sequential(*layers), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    config=xlatrain.TrainConfig(epochs=3, batch_size=8, log_every=5, run_dir=sys.argv[3]),
    checkpoint=xlatrain.CheckpointConfig(enabled=False),
    backend=xlatrain.BackendConfig(accelerator="xla", devices=1, xla_mode=mode),
)
from xlatrain.train.feed import TrainFeed
rows, epoch_batches, epoch_means = [], TrainFeed.batches, trainer._epoch_means
start = {}


def batches(feed, *args):  # an epoch's training starts: its batches are asked for
    start["metrics"], start["cuts"] = xla_metrics.snapshot(), met.counter_value("MarkStep") or 0
    return epoch_batches(feed, *args)


def counted(*args):  # and ends with its epoch-end read
    out = epoch_means(*args)
    cost = xla_metrics.diff(start["metrics"], xla_metrics.snapshot())
    rows.append({"uploads": cost["transfer_to_device_count"], "cuts": (met.counter_value("MarkStep") or 0) - start["cuts"],
                 "compiles": cost["compile_count"]})
    return out


TrainFeed.batches = batches
trainer._epoch_means = counted
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 8, generator=g)
trainer.fit(TensorDataset(x, (x[:, 0] > 0).long()))
print("RESULT " + json.dumps(rows))
"""


@pytest.mark.xla
@pytest.mark.parametrize("mode", ["spmd", "multiprocess"])
def test_a_training_step_uploads_its_batch_and_torch_xla_seed_only_and_cuts_the_graph_once(tmp_path, mode):
    """96 samples in batches of 8: 12 steps an epoch. SGD with momentum has no per-step scalar
    to upload, so what goes to the device is the batch and, with dropout, the one random seed
    torch_xla uploads for every graph that draws random numbers (the Trainer's per-step re-seed
    only chooses its value)."""
    steps = 12
    # Under SPMD torch_xla uploads each batch tensor on its own; otherwise up to 8 batches at once.
    batch_uploads = 2 * steps if mode == "spmd" else -(-steps // 8)
    for model in ("plain", "dropout"):
        cmd = [sys.executable, "-c", STEPS, mode, model, str(tmp_path / f"{model}-{mode}")]
        rows = _result(run_command(cmd, env={"PJRT_DEVICE": "CPU"}))
        seeds = steps if model == "dropout" else 0
        for row in rows[1:]:  # epoch 1 uploads the model and compiles
            assert row["uploads"] == batch_uploads + seeds, (model, rows)
            # One cut per step, plus one before the first batch, one at the end of the data and
            # the epoch-end read: a loader that also cut at every batch would double it.
            assert row["cuts"] <= steps + 3, (model, rows)


def test_xla_cpu_defaults_fill_only_what_the_user_left_unset():
    env: dict[str, str] = {}
    cpu_runtime_defaults(env, torch_xla_imported=False)
    assert env == {"XLA_ENABLE_PARAM_ALIASING": "0", "TF_CPP_MIN_LOG_LEVEL": "2"}
    mine = {"XLA_ENABLE_PARAM_ALIASING": "1", "TF_CPP_MIN_LOG_LEVEL": "0"}
    cpu_runtime_defaults(mine, torch_xla_imported=False)
    assert mine == {"XLA_ENABLE_PARAM_ALIASING": "1", "TF_CPP_MIN_LOG_LEVEL": "0"}
    # Once torch_xla is imported it has set its own log level: whose choice it was is unknown.
    late = {"TF_CPP_MIN_LOG_LEVEL": "1"}
    cpu_runtime_defaults(late, torch_xla_imported=True)
    assert late == {"TF_CPP_MIN_LOG_LEVEL": "1", "XLA_ENABLE_PARAM_ALIASING": "0"}


@pytest.mark.xla
def test_xla_cpu_runs_keep_the_console_free_of_repeated_runtime_warnings_unless_asked(cached_runs):
    """SPMD over 4 devices, three times with one cache: XLA warns of GSPMD's deprecation at every
    compilation and, in the runs after the first, torch_xla fails to load each cached graph."""
    _, runs = cached_runs
    quiet = runs["a"][1] + runs["b"][1]
    assert "GSPMD" not in quiet and "Failed to deserialize" not in quiet, quiet[-3000:]
    asked = runs["c"][1]
    assert "GSPMD sharding propagation is going to be deprecated" in asked
    assert "Failed to deserialize executable" in asked


DROPOUT = """
import functools, json, sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
import xlatrain

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 2))
trainer = xlatrain.Trainer(
    model, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
    config=xlatrain.TrainConfig(epochs=2, batch_size=8, log_every=4, run_dir=sys.argv[2]),
    checkpoint=xlatrain.CheckpointConfig(every_steps=int(sys.argv[1])) if sys.argv[1] != "0"
    else xlatrain.CheckpointConfig(enabled=False),
    backend=xlatrain.BackendConfig(accelerator="xla", devices=1, xla_mode="multiprocess"),
)
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 8, generator=g)
history = trainer.fit(TensorDataset(x, (x[:, 0] > 0).int()))  # int32 labels: torch_xla takes them
print("RESULT " + json.dumps([row["train_loss"] for row in history]))
"""


@pytest.mark.xla
def test_dropout_masks_depend_on_the_step_not_on_how_often_the_host_synced(tmp_path):
    """Checkpoints every 3 steps read the device (each read a graph cut, and torch_xla moves its
    random seed on at every cut), none in the other run: the masks, hence the losses, must not
    change. Resuming mid-epoch relies on the same property (tests/train/test_resume.py)."""
    losses = [
        _result(run_command([sys.executable, "-c", DROPOUT, every, str(tmp_path / every)], env={"PJRT_DEVICE": "CPU"}))
        for every in ("0", "3")
    ]
    assert losses[0] == losses[1]


FP16 = """
import functools, torch
from torch import nn
import xlatrain
try:
    xlatrain.Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                     config=xlatrain.TrainConfig(precision="fp16"), accelerator="xla", devices=2)
except ValueError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.xla
def test_fp16_is_refused_on_xla_with_bf16_named(tmp_path):
    env = {"PJRT_DEVICE": "CPU", "PATH": "/usr/bin:/bin", "XLATRAIN_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", FP16], capture_output=True, text=True, timeout=180, env=env)
    assert "REFUSED precision='fp16'" in out.stdout and "use precision='bf16'" in out.stdout, out.stderr[-3000:]
