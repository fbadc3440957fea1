"""The same training on one CPU process, on XLA:CPU (SPMD and one process per device), and under
torchrun DDP: with the same global batch and seed the loss trajectories agree.

Tolerance: 1e-5 relative on every loss and exact equality of accuracies. Measured differences are
about 1e-7 (float32 reduction order across shards), so 1e-5 catches any sampling or averaging bug
(a single sample in the wrong batch moves the loss by more than 1e-3).
"""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_command, run_script

REL = 1e-5


def _assert_same_trajectory(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for key in ("train_loss", "val_loss"):
            assert ra[key] == pytest.approx(rb[key], rel=REL), (key, ra, rb)
        assert ra["val_accuracy"] == rb["val_accuracy"]


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cpu")
    return run_script([sys.executable, str(SCRIPTS / "trajectory.py"), "cpu", "1", "32", "3", str(run_dir)])


@pytest.mark.xla
def test_spmd_over_four_xla_cpu_devices_matches_one_cpu_device(cpu_reference, tmp_path):
    history = run_script(
        [sys.executable, str(SCRIPTS / "trajectory.py"), "xla", "4", "8", "3", str(tmp_path)],
        env={"PJRT_DEVICE": "CPU"},
    )
    _assert_same_trajectory(history, cpu_reference)
    assert (tmp_path / "best.safetensors").is_file()


@pytest.mark.xla
@pytest.mark.multiprocess
def test_one_process_per_device_mode_matches_one_cpu_device(cpu_reference, tmp_path):
    # torch_xla cannot run collectives between XLA:CPU devices in this mode, so one device.
    proc = run_command([sys.executable, str(SCRIPTS / "spawn_fit.py"), str(tmp_path)], env={"PJRT_DEVICE": "CPU"})
    history = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("HISTORY ")][0][len("HISTORY "):])
    _assert_same_trajectory(history, cpu_reference[:2])
    # The spawned process shows its epoch lines (torch_xla's import configures the root logger at
    # WARNING; that is not a choice to hide them).
    assert "epoch 1/2" in proc.stdout and "epoch 2/2" in proc.stdout, proc.stdout


@pytest.mark.multiprocess
def test_ddp_two_processes_under_torchrun_match_one_process(cpu_reference, tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun is installed with torch"
    history = run_script(
        [torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
         str(SCRIPTS / "trajectory.py"), "cpu", "2", "16", "3", str(tmp_path)],
    )
    _assert_same_trajectory(history, cpu_reference)


@pytest.mark.multiprocess
def test_scale_lr_multiplies_the_rate_by_the_process_count_under_torchrun(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    proc = run_command(
        [torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
         str(SCRIPTS / "trajectory.py"), "cpu", "2", "16", "1", str(tmp_path), "spmd", "scale_lr"],
    )
    history = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("HISTORY ")][0][len("HISTORY "):])
    assert history[0]["lr"] == pytest.approx(0.2)  # 0.1 x 2 processes
    assert proc.stdout.count("learning rate scaled x2 by device count (scale_lr=True): 0.1 -> 0.2") == 1  # rank 0 says it


@pytest.mark.multiprocess
def test_processes_whose_batches_are_padded_to_different_lengths_give_every_row_to_metrics_and_predict(tmp_path):
    """In each validation step process 0 holds 4-token batches and process 1 12-token ones: the
    gather that joins them raised in gloo after training. The narrower are padded with -100, as
    batches of different lengths on one process are."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    run_command([torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
                 str(SCRIPTS / "ragged_eval.py"), str(tmp_path)])
    out = json.loads((tmp_path / "ragged.json").read_text())
    assert out["seen"][-1] == [[20, 12, 3], [20, 12]]  # every row once, at the widest length
    assert out["metric"] == pytest.approx(out["hand"], rel=1e-6)
    assert out["predicted_shape"] == [20, 12, 3] and out["predict_error"] < 1e-5 and out["padded_with_-100"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_metric_object_of_the_users_own_sees_every_processs_rows(tmp_path, strategy):
    """A running-mean meter with no torch.distributed in it, monitored with early stopping: each
    process computed it on its own rows, so rank 0 stopped while rank 1 went on (DDP hung in the
    next collective, FSDP aborted in gloo). Every process now feeds it every process's real rows."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    proc = run_command([torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
                        str(SCRIPTS / "streaming_agree.py"), str(tmp_path), strategy], timeout=240)
    assert (proc.stdout + proc.stderr).count("'counts' is a int64 tensor of shape (2, 2)") == 1  # said once
    ranks = [json.loads((tmp_path / f"streaming-{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]
    assert ranks[0]["rows"] == 37  # every validation row once, the padding left out
    assert ranks[0]["ce"] == pytest.approx(ranks[0]["hand"], rel=1e-5)
    assert ranks[0]["epochs"] == 3  # early stopping decided alike on both


@pytest.mark.xla
@pytest.mark.parametrize("task", ["classification", "multilabel"])
def test_xla_compilations_do_not_grow_after_the_first_epoch(tmp_path, task):
    # multilabel reads every validation row to the host for AUC: reading a batch-sharded tensor
    # would compile a new gather program per read unless it is replicated inside the step.
    history = run_script(
        [sys.executable, str(SCRIPTS / "compile_count.py"), str(tmp_path), task], env={"PJRT_DEVICE": "CPU"}
    )
    compiles = [row["xla_compilations"] for row in history]  # each epoch's own
    assert compiles[0] > 0 and compiles[1:] == [0, 0], compiles
    # Host reads are planned, not per step: the same handful every epoch (progress, epoch loss,
    # validation sums, best weights), far fewer than the 6 train + 10 eval steps per epoch.
    transfers = [row["xla_host_transfers"] for row in history[1:]]
    assert transfers[0] == transfers[1] <= (8 if task == "classification" else 12), transfers
    # The per-epoch StepLR schedule changed the rate without a recompile.
    assert [row["lr"] for row in history] == [0.01, 0.005, 0.0025]


@pytest.mark.multiprocess
@pytest.mark.parametrize("made_by", ["xlatrain", "user"])
def test_the_process_group_is_destroyed_before_exit_only_when_xlatrain_made_it(made_by, tmp_path):
    # Left to interpreter shutdown, gloo's threads can abort a process that trained successfully.
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    args = [torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
            str(SCRIPTS / "group_at_exit.py"), str(tmp_path)]
    proc = run_command(args + (["user_group"] if made_by == "user" else []))
    seen = sorted(re.findall(r"GROUP AT EXIT rank \d+ initialized=\w+", proc.stdout))
    still_up = made_by == "user"  # a group the user made is the user's to destroy
    assert seen == [f"GROUP AT EXIT rank {r} initialized={still_up}" for r in (0, 1)], proc.stdout


@pytest.mark.multiprocess
def test_ddp_jobs_that_gather_and_exit_at_once_never_abort_at_exit():
    """A rare race (5 aborts in 80 such jobs without xlatrain's wait at exit), so it runs only when
    asked: XLATRAIN_EXIT_TRIALS=N runs N jobs, four at a time (make stress runs 80)."""
    import os
    import subprocess

    from conftest import script_env

    trials = int(os.environ.get("XLATRAIN_EXIT_TRIALS", "0"))
    if trials <= 0:
        pytest.skip("a rare race: XLATRAIN_EXIT_TRIALS=N runs N jobs (make stress)")
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    args = [torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone", str(SCRIPTS / "exit_after_gather.py")]
    failed = []
    for start in range(0, trials, 4):
        jobs = [subprocess.Popen(args, env=script_env({}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 stdin=subprocess.DEVNULL) for _ in range(min(4, trials - start))]
        for job in jobs:
            out = job.communicate(timeout=300)[0]
            if job.returncode != 0:
                failed.append(out[:2500])  # an abort's "terminate called ..." comes first
    assert not failed, f"{len(failed)} of {trials} jobs failed; the first:\n{failed[0]}"


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _node(torchrun, port, script_args, env=None):
    """One torchrun "node" of a two-node job on this host (c10d rendezvous on localhost:port)."""
    import subprocess

    from conftest import script_env

    return subprocess.Popen(
        [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"xlatrain-{port}", *script_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
        # A worker that dies of a signal shows where each of its threads was.
        env=script_env({"PYTHONFAULTHANDLER": "1", **(env or {})}),
    )


def _finish(nodes, timeout=300, settle_s=30):
    """Each node's output once all have ended. Once one has failed, the others get ``settle_s``
    (a torchrun whose peer failed waits out its exit barrier) and are then killed; past
    ``timeout`` with none failed they are killed and the outputs shown."""
    import threading
    import time

    outs = [""] * len(nodes)

    def drain(k):  # read as they write, so that a full pipe never holds a node up
        outs[k] = nodes[k].communicate()[0]

    readers = [threading.Thread(target=drain, args=(k,), daemon=True) for k in range(len(nodes))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    failed = False
    while any(n.poll() is None for n in nodes):
        if not failed and any(n.returncode not in (None, 0) for n in nodes):
            failed, deadline = True, min(deadline, time.monotonic() + settle_s)
        if time.monotonic() > deadline:
            for n in nodes:
                n.kill()
            break
        time.sleep(0.2)
    for reader in readers:
        reader.join(timeout=60)
    if not failed and any(n.returncode == -9 for n in nodes):
        raise AssertionError(f"still running after {timeout} s:\n" + "\n---- next node ----\n".join(
            out[-6000:] for out in outs))
    return outs


@pytest.mark.multiprocess
def test_two_torchrun_nodes_train_the_one_process_trajectory(cpu_reference, tmp_path):
    """The multi-node launch that GPU clusters and TorchTPU pods use, two nodes on this host."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    port = _free_port()
    args = [str(SCRIPTS / "trajectory.py"), "cpu", "2", "16", "3", str(tmp_path)]
    nodes = [_node(torchrun, port, args) for _ in range(2)]
    outs = _finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0], outs
    lines = [ln for out in outs for ln in out.splitlines() if ln.startswith("HISTORY ")]
    assert len(lines) == 1, outs  # printed by rank 0, on whichever node it landed
    _assert_same_trajectory(json.loads(lines[0][len("HISTORY "):]), cpu_reference)


@pytest.mark.multiprocess
def test_sigterm_to_one_node_stops_both_at_one_step_with_a_checkpoint(tmp_path):
    import selectors
    import signal
    import time

    from xlatrain.checkpoint import find_resumable

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    port = _free_port()
    args = [str(SCRIPTS / "resumable.py"), str(tmp_path), "2", "100", "0.02", "cpu", "2"]
    # LOGLEVEL=INFO: torchrun then says when its workers finished successfully.
    nodes = [_node(torchrun, port, args, env={"LOGLEVEL": "INFO"}) for _ in range(2)]
    sel = selectors.DefaultSelector()
    for i, n in enumerate(nodes):
        sel.register(n.stdout, selectors.EVENT_READ, i)
    buffers = ["", ""]

    def read_until(*needles, node=None, timeout=180):
        """The node and the needle of the first line (of that node, if given) holding one of them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for key, _ in sel.select(timeout=1):
                line = key.fileobj.readline()
                buffers[key.data] += line
                found = [needle for needle in needles if needle in line]
                if found and node in (None, key.data):
                    return key.data, found[0]
        raise AssertionError(f"none of {needles!r} in:\n{buffers[0]}\n----\n{buffers[1]}")

    main, _ = read_until("epoch 1 step 3/")  # rank 0's node prints; training is under way
    nodes[1 - main].send_signal(signal.SIGTERM)  # the other node only: rank 0 learns of it from its peer
    read_until("stopped after epoch", node=main)  # printed once the checkpoint is written
    # The unsignalled worker exits 0; its torchrun then waits at its exit barrier for the
    # signalled agent, which never arrives (torchrun's own 300 s timeout), so it is ended here.
    # When the signalled node hosted torchrun's rendezvous store, the surviving torchrun loses
    # the store instead, stops its worker and exits by itself: a torchrun outcome, let finish.
    _, outcome = read_until("worker group successfully finished", "RendezvousConnectionError", node=main)
    if outcome == "RendezvousConnectionError":
        buffers[main] += nodes[main].communicate(timeout=120)[0]
    for n in nodes:
        if n.poll() is None:
            n.kill()
            n.communicate(timeout=60)
    stop_line = [ln for ln in buffers[main].splitlines() if "stopped after epoch" in ln][0]
    assert "a stop requested on another process: stopped after epoch 1 step" in stop_line
    assert sum("stopped after epoch" in b for b in buffers) == 1  # said once, by rank 0
    path, _, meta = find_resumable(tmp_path / "checkpoints")
    assert f"step {meta['cursor']['step']};" in stop_line and len(meta["rng"]) == 2  # both ranks, that step
    assert not (tmp_path / "final.safetensors").exists()
    # Both nodes again: the run continues from that checkpoint to the end.
    port = _free_port()
    again = [_node(torchrun, port, [str(SCRIPTS / "resumable.py"), str(tmp_path), "2", "100", "0", "cpu", "2"])
             for _ in range(2)]
    outs = _finish(again)
    shown = "\n---- node 2 ----\n".join(out[-6000:] for out in outs)
    assert any(f"resumed from {path}" in out for out in outs) and (tmp_path / "final.safetensors").exists(), shown
    assert sum("HISTORY " in out for out in outs) == 1, shown  # rank 0 trained every remaining step
    # Every worker exits 0: the process group is destroyed and collected before interpreter
    # shutdown, so no gloo thread is left to abort the process after training.
    assert [n.returncode for n in again] == [0, 0], shown


# --- dict items with a two-term loss, and a per-step schedule, across the backends ----------
#
# The loss (tests/scripts/pipeline_trajectory.py) has no per-sample form: it trains on each
# process's batch and validates once over the whole set. Its two terms are means over the batch's
# pixels, so the mean over processes of each process's loss (DDP) equals the loss over the global
# batch (SPMD, one process) and the three trajectories agree to float32 reduction order.
PIPELINE = str(SCRIPTS / "pipeline_trajectory.py")
PIPELINE_KEYS = ("train_loss", "train_bce", "train_mse", "val_loss", "val_bce", "val_mse")


def _pipeline(args, env=None, launcher=(sys.executable,)):
    proc = run_command([*launcher, PIPELINE, *args], env=env)
    found = {}
    for tag in ("HISTORY", "LAST_LR"):
        found[tag] = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith(tag + " ")][0][len(tag) + 1:])
    return found["HISTORY"], found["LAST_LR"]


@pytest.fixture(scope="module")
def pipeline_cpu(tmp_path_factory):
    return _pipeline(["cpu", "1", "16", "3", str(tmp_path_factory.mktemp("pipe-cpu"))])


def _assert_same_terms(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for key in PIPELINE_KEYS:
            assert ra[key] == pytest.approx(rb[key], rel=REL), (key, ra, rb)


@pytest.mark.xla
def test_dict_items_and_a_two_term_loss_train_alike_on_four_xla_cpu_devices(pipeline_cpu, tmp_path):
    history, _ = _pipeline(["xla", "4", "4", "3", str(tmp_path)], env={"PJRT_DEVICE": "CPU"})
    _assert_same_terms(history, pipeline_cpu[0])


@pytest.mark.multiprocess
def test_dict_items_and_a_two_term_loss_train_alike_under_torchrun(pipeline_cpu, tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    history, _ = _pipeline(["cpu", "2", "8", "3", str(tmp_path)],
                           launcher=(torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone"))
    _assert_same_terms(history, pipeline_cpu[0])


@pytest.mark.xla
def test_one_cycle_per_step_never_recompiles_on_xla_and_ends_at_its_own_rate(tmp_path):
    import torch

    history, last = _pipeline(["xla", "4", "4", "3", str(tmp_path), "onecycle"], env={"PJRT_DEVICE": "CPU"})
    compiles = [row["xla_compilations"] for row in history]
    assert compiles[1:] == [0, 0], compiles  # nothing compiled after the first epoch
    diagnostics = json.loads((tmp_path / "diagnostics.json").read_text())
    assert diagnostics["clean"], diagnostics["findings"]
    # 128 samples / global batch 16 = 8 optimizer steps per epoch, 24 in all.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05, momentum=0.9)
    reference = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=24)
    for _ in range(24):
        opt.step()
        reference.step()
    assert last["scheduler_steps"] == 24
    assert last["final_lr"] == pytest.approx(reference.get_last_lr()[0])
