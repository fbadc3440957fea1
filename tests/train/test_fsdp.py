"""FSDP against the replicated strategies, for real: torch's ``fully_shard`` under torchrun with CPU
processes, torch_xla's SPMD FSDP on virtual XLA:CPU devices, and sharded checkpoints that resume
at another process or device count.

The model (tests/scripts/strategy_fit.py) is three repeated blocks between a tied embedding and
output layer, trained with SGD + momentum so that gradient clipping changes the update (Adam would
undo a rescaled gradient). Tolerance: 1e-5 relative on losses, as for DDP against one process;
measured differences are about 1e-7 (reduction order).
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, job_outputs, run_command

SCRIPT = str(SCRIPTS / "strategy_fit.py")
REL = 1e-5
VOCAB_DIM = 16 * 32  # the script's tied embedding: VOCAB x DIM
# 192 samples, global batch 24 in micro-batches of 12 per process x 2 processes, 2 micro-batches
# per optimizer step: 4 optimizer steps per epoch; a checkpoint every 3 lands mid-epoch 2 (step 6).
COMMON = ["accum=2", "clip=0.5", "every=3", "final=1", "predict=1"]


def _torchrun(n):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    return [torchrun, "--nproc-per-node", str(n), "--master-port", "0", "--standalone"]


def _parse(stdout):
    found = {}
    for line in stdout.splitlines():
        tag, _, payload = line.partition(" ")
        if tag in ("HISTORY", "FACTS", "PREDICT", "MEMORY"):
            assert tag not in found, f"{tag} printed twice (by more than the main process):\n{stdout}"
            found[tag] = json.loads(payload)
    found["stdout"] = stdout
    return found


def _fit(run_dir, accelerator, strategy, epochs, batch, *opts, launcher=(sys.executable,), env=None):
    proc = run_command([*launcher, SCRIPT, str(run_dir), accelerator, strategy, str(epochs), str(batch), *opts],
                       env=env, timeout=600)
    return _parse(proc.stdout)


def _fits(jobs, launcher=(sys.executable,)):
    """Several fits one after another in one launch (strategy_fit.py's ``--then``): ``jobs`` maps a
    name to ``(run_dir, accelerator, strategy, epochs, batch, *opts)``; returns name -> what
    :func:`_fit` returns. Each fit starts from the same seed, as in a process of its own."""
    args = []
    for job in jobs.values():
        args += ["--then", *map(str, job)]
    proc = run_command([*launcher, SCRIPT, *args[1:]], timeout=600)
    outputs = job_outputs(proc.stdout, [str(n) for n in range(len(jobs))])
    return {name: _parse(out) for name, out in zip(jobs, outputs)}


def _same_losses(a, b, rel=REL):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for key in ("train_loss", "val_loss"):
            assert ra[key] == pytest.approx(rb[key], rel=rel), (key, ra, rb)
        assert ra["val_accuracy"] == rb["val_accuracy"]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _same_weights(a, b, rtol=1e-5, atol=1e-6):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=rtol, atol=atol, msg=name)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The module's fits under torchrun with two processes that start from nothing, in one launch
    (a torchrun start, two imports of torch and a rendezvous is most of each fit's time)."""
    root = tmp_path_factory.mktemp("two-processes")
    runs = _fits({
        "ddp": (root / "ddp", "cpu", "ddp", 2, 12, *COMMON),
        "fsdp": (root / "fsdp", "cpu", "fsdp", 2, 12, *COMMON),
        "meta": (root / "meta", "cpu", "fsdp", 2, 12, "meta=1"),
        "ema": (root / "ema-whole", "cpu", "fsdp", 2, 12, "ema=0.8"),
        "ema-split": (root / "ema-split", "cpu", "fsdp", 1, 12, "ema=0.8"),
    }, launcher=_torchrun(2))
    return root, runs


@pytest.fixture(scope="module")
def ddp(two_processes):
    root, runs = two_processes
    return root / "ddp", runs["ddp"]


@pytest.fixture(scope="module")
def fsdp(two_processes):
    root, runs = two_processes
    return root / "fsdp", runs["fsdp"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The module's one-process fits, in one process: the same model built on the host and on the
    meta device, and FSDP in float32, bfloat16 and with activation checkpointing."""
    root = tmp_path_factory.mktemp("one-process")
    runs = _fits({
        "host": (root / "host", "cpu", "single", 1, 24),
        "meta": (root / "meta", "cpu", "single", 1, 24, "meta=1"),
        "meta-fsdp": (root / "meta-fsdp", "cpu", "fsdp", 1, 24, "meta=1"),
        "fsdp": (root / "fsdp", "cpu", "fsdp", 2, 24),
        "bf16": (root / "bf16", "cpu", "fsdp", 2, 24, "precision=bf16", "final=1"),
        "ac": (root / "ac", "cpu", "fsdp", 2, 24, "ac=1"),
    })
    return root, runs


@pytest.mark.multiprocess
def test_fsdp_under_torchrun_trains_the_ddp_trajectory_with_accumulation_and_clipping(ddp, fsdp):
    (_, d), (_, f) = ddp, fsdp
    _same_losses(f["HISTORY"], d["HISTORY"])
    assert f["HISTORY"][-1]["train_loss"] < f["HISTORY"][0]["train_loss"]
    torch.testing.assert_close(torch.tensor(f["PREDICT"]), torch.tensor(d["PREDICT"]), rtol=1e-5, atol=1e-5)
    _same_weights(fsdp[0] / "final.safetensors", ddp[0] / "final.safetensors")
    _same_weights(fsdp[0] / "best.safetensors", ddp[0] / "best.safetensors")
    assert "FSDP over 2 process(es), 3 unit(s) (Block)" in f["stdout"]


@pytest.mark.multiprocess
def test_each_fsdp_process_holds_half_of_the_state_and_each_ddp_process_all_of_it(ddp, fsdp):
    (_, d), (_, f) = ddp, fsdp
    for facts in f["FACTS"]:
        whole = facts["whole_parameters"]
        # Dim 0 of each tensor is split in two; an odd row count puts one extra row on one side.
        assert 0.45 * whole <= facts["holds"]["parameters"] <= 0.55 * whole, facts
        assert facts["holds"]["optimizer"] == facts["holds"]["parameters"]  # one momentum buffer each
        assert facts["parameter_types"] == ["DTensor"] and facts["tied"] and facts["units"] == ["Block"] * 3
    assert sum(x["holds"]["parameters"] for x in f["FACTS"]) == f["FACTS"][0]["whole_parameters"]
    for facts in d["FACTS"]:
        assert facts["holds"]["parameters"] == facts["whole_parameters"] == facts["holds"]["optimizer"]
        assert facts["parameter_types"] == ["Parameter"] and facts["tied"]


def _plan_matches_the_real_state(memory):
    for process in memory:
        plan, real = process["plan"], process["real"]
        assert real["gradients"] > 0 and real["optimizer"] > 0, process
        # Made before the first step (no gradient, no optimizer state yet), equal to the bytes of
        # the tensors that exist once a step has run.
        assert {k: plan[k] for k in real} == real, process
        assert plan["optimizer_source"] == "SGD's state per parameter"


@pytest.mark.multiprocess
def test_the_memory_plan_before_the_first_step_equals_the_real_state_under_ddp_and_fsdp(ddp, fsdp):
    (_, d), (_, f) = ddp, fsdp
    _plan_matches_the_real_state(d["MEMORY"])
    _plan_matches_the_real_state(f["MEMORY"])
    assert f["MEMORY"][0]["plan"]["parameters"] < 0.6 * d["MEMORY"][0]["plan"]["parameters"]
    # FSDP gathers the root's weights (the tied embedding) and two Blocks' for compute; DDP nothing.
    whole = f["FACTS"][0]["whole_parameters"]
    embedding = VOCAB_DIM * 4
    block = (whole - embedding) // 3
    assert f["MEMORY"][0]["plan"]["gathered"] == embedding + 2 * block and d["MEMORY"][0]["plan"]["gathered"] == 0
    for out in (d, f):
        assert "memory per device, before the first step: parameters" in out["stdout"]
        assert "memory: the process's peak resident memory was" in out["stdout"]  # on the CPU: named as such


def _cut_after(run_dir, dest, step):
    """A copy of ``run_dir`` as a run stopped right after the checkpoint at ``step`` left it."""
    shutil.copytree(run_dir, dest)
    for path in (dest / "checkpoints").iterdir():
        if int(path.name.split("-")[1].split(".")[0]) > step:
            shutil.rmtree(path)
    for name in ("final.safetensors", "best.safetensors", "history.json", "history.csv", "diagnostics.json"):
        (dest / name).unlink(missing_ok=True)
    shutil.rmtree(dest / "tb", ignore_errors=True)
    return dest


@pytest.mark.multiprocess
@pytest.mark.parametrize("processes", [1, 4])
def test_a_two_process_fsdp_checkpoint_reshards_to_another_process_count(fsdp, tmp_path, processes):
    run_dir, whole = fsdp
    assert (run_dir / "checkpoints" / "step-00000006" / "shards" / "__1.safetensors").is_file()
    cut = _cut_after(run_dir, tmp_path / "cut", 6)  # mid epoch 2
    launcher = _torchrun(processes) if processes > 1 else (sys.executable,)
    resumed = _fit(cut, "cpu", "fsdp", 2, 24 // processes, *COMMON, launcher=launcher)
    assert "resumed from" in resumed["stdout"] and "continuing at epoch 2, step 4" in resumed["stdout"]
    assert f"written by 2 process(es) and this run has {processes}" in resumed["stdout"]
    _same_losses(resumed["HISTORY"], whole["HISTORY"])
    _same_weights(cut / "final.safetensors", run_dir / "final.safetensors")


@pytest.mark.multiprocess
@pytest.mark.parametrize("processes", [1, 2])
def test_a_ddp_checkpoint_resumes_under_fsdp(ddp, tmp_path, processes):
    # Two processes: each reads the whole checkpoint and the main one sends every tensor's shards,
    # tensor by tensor, in the same order in both (they crashed in gloo where it was the file's).
    run_dir, whole = ddp
    cut = _cut_after(run_dir, tmp_path / "cut", 6)
    launcher = _torchrun(processes) if processes > 1 else (sys.executable,)
    resumed = _fit(cut, "cpu", "fsdp", 2, 24 // processes, *COMMON, launcher=launcher)
    assert f"FSDP over {processes} process(es)" in resumed["stdout"] and "resumed from" in resumed["stdout"]
    _same_losses(resumed["HISTORY"], whole["HISTORY"])
    _same_weights(cut / "final.safetensors", run_dir / "final.safetensors")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    from xlatrain.storage.emulator import LocalGCS

    with LocalGCS(bucket="runs", data_dir=tmp_path_factory.mktemp("gcs")) as server:
        yield server


def _stored(url):
    from xlatrain import storage

    fs, root = storage.filesystem(url)
    return sorted(name[len(root) + 1:] for name in fs.find(root))


def _copy_on(host_dir, url, monkeypatch):
    """The working copy of ``url`` a process whose local files are in ``host_dir`` keeps."""
    from xlatrain.storage.remote_run import local_copy

    monkeypatch.setenv("XLATRAIN_CACHE_DIR", str(host_dir))
    return local_copy(url)


OBJECT_STORE_RUN = ["accum=2", "clip=0.5", "every=3"]


@pytest.mark.multiprocess
@pytest.mark.object_store
def test_ddp_on_two_hosts_checkpoints_to_object_storage_and_two_fresh_hosts_resume(ddp, gcs, tmp_path):
    """Each process on a disk of its own (as on two hosts): a replacement pair of hosts brings the
    checkpoint down on both and trains the uninterrupted run."""
    _, whole = ddp
    url = f"gs://runs/{tmp_path.name}"
    _fit(url, "cpu", "ddp", 1, 12, *OBJECT_STORE_RUN, f"hosts={tmp_path / 'a'}", launcher=_torchrun(2), env=gcs.env)
    assert [n.split("/")[1] for n in _stored(url) if n.endswith("/meta.json")] == ["step-00000003", "step-00000004"]
    resumed = _fit(url, "cpu", "ddp", 2, 12, *OBJECT_STORE_RUN, f"hosts={tmp_path / 'b'}", launcher=_torchrun(2),
                   env=gcs.env)
    assert "continuing at epoch 2, step 0" in resumed["stdout"], resumed["stdout"]
    _same_losses(resumed["HISTORY"], whole["HISTORY"])


@pytest.mark.multiprocess
@pytest.mark.object_store
def test_fsdp_on_two_hosts_of_two_processes_checkpoints_each_part_and_resumes_on_the_same_hosts(
        fsdp, gcs, tmp_path, monkeypatch):
    """Two "hosts" of two processes each write an FSDP run's checkpoints to the store: each part
    goes up from the process that wrote it. The same hosts then resume it with one process each
    (another layout: each reads parts written on the other host), as the uninterrupted run."""
    _, whole = fsdp
    url = f"gs://runs/{tmp_path.name}"
    hosts = tmp_path / "hosts"
    # Process 3 sends its parts late: process 2, on the same host, must leave them to it.
    _fit(url, "cpu", "fsdp", 1, 6, *OBJECT_STORE_RUN, f"hosts={hosts}", "per_host=2", "slow_part=3",
         launcher=_torchrun(4), env=gcs.env)
    stored = set(_stored(url))
    main_copy, other_copy = (_copy_on(hosts / f"host{h}", url, monkeypatch) for h in (0, 1))
    for name in ("step-00000003", "step-00000004"):
        assert {f"checkpoints/{name}/{f}" for f in ("meta.json", "shards/index.json")} <= stored
        assert {f"checkpoints/{name}/shards/__{r}.safetensors" for r in range(4)} <= stored
        # Host 1's parts went up from host 1: the main process's disk never held them.
        assert sorted(p.name for p in (main_copy / "checkpoints" / name / "shards").iterdir()) == [
            "__0.safetensors", "__1.safetensors", "index.json"]
    # Once up, nothing of them is left on host 1's disk (its two processes shared one directory).
    assert (other_copy / "checkpoints").is_dir()
    assert [p for p in (other_copy / "checkpoints").rglob("*")] == []
    resumed = _fit(url, "cpu", "fsdp", 2, 12, *OBJECT_STORE_RUN, f"hosts={hosts}", launcher=_torchrun(2),
                   env=gcs.env)
    assert "written by 4 process(es) and this run has 2" in resumed["stdout"], resumed["stdout"]
    assert "continuing at epoch 2, step 0" in resumed["stdout"]
    _same_losses(resumed["HISTORY"], whole["HISTORY"])


def test_a_model_built_on_the_meta_device_starts_as_the_model_built_on_the_host(one_process):
    _, runs = one_process
    host, meta, fsdp = runs["host"], runs["meta"], runs["meta-fsdp"]
    # Same seed, same reset_parameters() in module order, the tied weight keeping its first
    # owner's (the embedding's) values: the same numbers as building it on the host.
    _same_losses(meta["HISTORY"], host["HISTORY"], rel=0)
    _same_losses(fsdp["HISTORY"], host["HISTORY"])


@pytest.mark.multiprocess
def test_a_meta_device_model_trains_under_fsdp_in_two_processes(two_processes):
    out = two_processes[1]["meta"]
    history = out["HISTORY"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert all(f["tied"] and f["parameter_types"] == ["DTensor"] for f in out["FACTS"])


def test_bf16_under_fsdp_keeps_float32_weights_and_follows_the_float32_run(one_process):
    root, runs = one_process
    fp32, bf16 = runs["fsdp"], runs["bf16"]
    for a, b in zip(bf16["HISTORY"], fp32["HISTORY"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=0.05)
        assert a["train_loss"] != b["train_loss"]  # it did compute in bfloat16
    assert {t.dtype for t in _weights(root / "bf16" / "final.safetensors").values()} == {torch.float32}


def test_activation_checkpointing_keeps_the_trajectory(one_process):
    _, runs = one_process
    plain, checkpointed = runs["fsdp"], runs["ac"]
    assert "activation checkpointing" in checkpointed["stdout"]
    _same_losses(checkpointed["HISTORY"], plain["HISTORY"])


@pytest.mark.multiprocess
def test_the_ema_is_sharded_with_the_optimizer_state_and_comes_back_on_resume(two_processes, tmp_path):
    # Two epochs, and one epoch of the same run (both in the module's launch); a new launch resumes it.
    root, runs = two_processes
    whole = runs["ema"]["HISTORY"]
    split = shutil.copytree(root / "ema-split", tmp_path / "split")
    resumed = _fit(split, "cpu", "fsdp", 2, 12, "ema=0.8", launcher=_torchrun(2))
    assert "resumed from" in resumed["stdout"]
    # The EMA weights of epoch 2 score the same: their averages came back from the sharded checkpoint.
    assert resumed["HISTORY"][-1]["val_ema_loss"] == pytest.approx(whole[-1]["val_ema_loss"], rel=1e-6)
    assert whole[-1]["val_ema_loss"] != whole[-1]["val_loss"]
    _same_weights(split / "ema.safetensors", root / "ema-whole" / "ema.safetensors", rtol=1e-6, atol=1e-7)


def _tied_net():
    import importlib.util

    spec = importlib.util.spec_from_file_location("strategy_fit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TiedNet()


@pytest.mark.multiprocess
def test_export_puts_a_sharded_checkpoint_together_for_inference(fsdp, ddp, tmp_path):
    import xlatrain

    run_dir, _ = fsdp
    out = tmp_path / "model.safetensors"
    proc = run_command([sys.executable, "-m", "xlatrain.cli", "export", str(run_dir), "--out", str(out)])
    assert f"wrote {out}" in proc.stdout and "step-00000008" in proc.stdout
    # The newest checkpoint ends epoch 2: its weights are the final ones, bit for bit.
    _same_weights(out, run_dir / "final.safetensors", rtol=0, atol=0)
    model = _tied_net()
    xlatrain.load_weights(model, out)
    assert model.head.weight is model.embed.weight  # stored once, tied again on load
    # A replicated run's checkpoint exports the same way; the two runs trained alike.
    proc = run_command([sys.executable, "-m", "xlatrain.cli", "export", str(ddp[0])])
    _same_weights(ddp[0] / "model.safetensors", out)


# --- torch_xla: SPMD FSDP on virtual XLA:CPU devices ---------------------------------------------

XLA_ENV = {"PJRT_DEVICE": "CPU"}


@pytest.fixture(scope="module")
def spmd_fsdp(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("spmd-fsdp")
    return run_dir, _fit(run_dir, "xla", "fsdp", 2, 6, "devices=4", *COMMON, env=XLA_ENV)


@pytest.mark.xla
def test_spmd_fsdp_trains_the_spmd_data_trajectory_on_four_devices(spmd_fsdp, tmp_path):
    run_dir, f = spmd_fsdp
    data = _fit(tmp_path, "xla", "ddp", 2, 6, "devices=4", *COMMON, env=XLA_ENV)
    _same_losses(f["HISTORY"], data["HISTORY"])
    _same_weights(run_dir / "final.safetensors", tmp_path / "final.safetensors")
    sharded = f["FACTS"][0]
    # Every parameter and its momentum split over the 4 devices along its largest dimension.
    assert sharded["holds"]["parameters"] == pytest.approx(sharded["whole_parameters"] / 4, rel=0.05)
    assert sharded["holds"]["optimizer"] == sharded["holds"]["parameters"] and sharded["tied"]
    replicated = data["FACTS"][0]
    assert replicated["holds"]["parameters"] == replicated["whole_parameters"]
    assert "SPMD FSDP over an 'fsdp' mesh of 4 device(s)" in f["stdout"]
    _plan_matches_the_real_state(f["MEMORY"])
    _plan_matches_the_real_state(data["MEMORY"])


@pytest.mark.xla
def test_an_spmd_fsdp_checkpoint_from_four_devices_resumes_on_two(spmd_fsdp, tmp_path):
    run_dir, whole = spmd_fsdp
    cut = _cut_after(run_dir, tmp_path / "cut", 6)
    resumed = _fit(cut, "xla", "fsdp", 2, 12, "devices=2", *COMMON, env=XLA_ENV)
    assert "continuing at epoch 2, step 4" in resumed["stdout"]
    _same_losses(resumed["HISTORY"], whole["HISTORY"])
    _same_weights(cut / "final.safetensors", run_dir / "final.safetensors")


BATCH_NORM = """
import functools, json, sys, torch, torchvision, xlatrain
from torch import nn
data = [torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(n)),
                                       torch.randint(0, 2, (n, 4), generator=torch.Generator().manual_seed(n)).float())
        for n in (32, 8)]
torch.manual_seed(0)
trainer = xlatrain.Trainer(torchvision.models.resnet18(num_classes=4), nn.BCEWithLogitsLoss(),
                           # fused=False on both sides: FSDP's sharded parameters have no fused kernel, and a
                           # fused AdamW drifts ~0.5% from torch's default one over these bf16 steps.
                           functools.partial(torch.optim.AdamW, lr=1e-3, fused=False), strategy=sys.argv[2],
                           config=xlatrain.TrainConfig(epochs=2, batch_size=16, precision="bf16", run_dir=sys.argv[1]))
print("HISTORY " + json.dumps(trainer.fit(*data)))
"""


def test_bf16_fsdp_keeps_batch_norm_in_float32_and_follows_one_device(tmp_path):
    """FSDP gathers parameters in bfloat16; batch norm's float32 running statistics cannot meet a
    bfloat16 weight, so each batch norm is a float32 group of its own (else the first forward fails)."""
    (tmp_path / "bn.py").write_text(BATCH_NORM)
    runs = {s: _run_history(tmp_path, s) for s in ("single", "fsdp")}
    for a, b in zip(runs["fsdp"], runs["single"]):
        for key in ("train_loss", "val_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-3), (key, a, b)


def _run_history(tmp_path, strategy):
    proc = run_command([sys.executable, str(tmp_path / "bn.py"), str(tmp_path / strategy), strategy])
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("HISTORY ")][0][len("HISTORY "):])
