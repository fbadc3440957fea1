"""Checkpoints, resume, preemption and numerical/disk faults, with real processes and real files."""

import functools
import json
import math
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain
from conftest import SCRIPTS, run_script, script_env
from warm import popen as warm_popen
from xlatrain.checkpoint import CheckpointError, find_resumable, list_checkpoints, read_checkpoint, latest_name

RESUMABLE = str(SCRIPTS / "resumable.py")


def _env():
    return script_env()


def _start(run_dir, epochs=2, every=3, sleep_s=0.01, extra=(), launcher=(sys.executable,), env=None):
    return warm_popen([*launcher, RESUMABLE, str(run_dir), str(epochs), str(every), str(sleep_s), *extra],
                      {**_env(), **(env or {})}, stderr=subprocess.STDOUT)


def _wait_for_line(proc, needle, timeout=60):
    """Read the child's output until a line containing ``needle``; returns the lines read."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no line with {needle!r}:\n{''.join(lines)}")


TIMING = {"epoch_time_s", "warmup_s", "input_bound_share", "samples_per_s", "tokens_per_s", "mfu"}  # wall-clock measurements, different in every run


def _without_timing(history):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in history]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole")
    history = run_script([sys.executable, RESUMABLE, str(run_dir), "2", "3", "0"])
    return history, (run_dir / "final.safetensors").read_bytes()


def test_sigterm_mid_epoch_then_resume_is_bitwise_identical_on_cpu(uninterrupted, tmp_path):
    history, final = uninterrupted
    proc = _start(tmp_path)
    _wait_for_line(proc, "epoch 2 step 2/12")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "SIGTERM: stopped after epoch 2 step" in out and "resume='auto'" in out
    assert not (tmp_path / "final.safetensors").exists()  # it really stopped early
    resumed = run_script([sys.executable, RESUMABLE, str(tmp_path), "2", "3", "0"])
    assert _without_timing(resumed) == _without_timing(history)
    assert (tmp_path / "final.safetensors").read_bytes() == final


def _held_in_a_step(run_dir, gate, every):
    """A run held inside a step's data loading (epoch 1) for as long as ``gate`` exists."""
    proc = _start(run_dir, every=every, sleep_s=0.001, env={"XLATRAIN_TEST_GATE": str(gate)})
    _wait_for_line(proc, "epoch 1 step 1/12")
    gate.touch()  # the next item read waits; a few steps may pass before it does (< 12)
    time.sleep(0.5)
    return proc


def test_one_signal_stops_after_the_step_and_a_second_exits_at_once(tmp_path):
    # One SIGINT: the step finishes, a checkpoint is saved, the run says so and exits 130.
    gate = tmp_path / "gate-one"
    proc = _held_in_a_step(tmp_path / "one", gate, every=100)
    proc.send_signal(signal.SIGINT)
    _wait_for_line(proc, "SIGINT: finishing this step (or validation batch), then saving a checkpoint")
    gate.unlink()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "SIGINT: stopped after epoch 1 step" in out
    assert find_resumable(tmp_path / "one" / "checkpoints") is not None  # the stop saved one
    # A second SIGINT while the step is still running: it exits at once, no save, no message,
    # and the periodic checkpoint written before still loads.
    gate = tmp_path / "gate-two"
    proc = _held_in_a_step(tmp_path / "two", gate, every=1)
    proc.send_signal(signal.SIGINT)
    _wait_for_line(proc, "SIGINT: finishing this step")
    before = list_checkpoints(tmp_path / "two" / "checkpoints")
    time.sleep(1.2)  # a repeat within a second is the same request delivered twice (a launcher's forward)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    gate.unlink()
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "stopped after" not in out, out
    assert before and list_checkpoints(tmp_path / "two" / "checkpoints") == before  # nothing saved
    assert find_resumable(tmp_path / "two" / "checkpoints") is not None
    # SIGINT and then, at once, SIGTERM (torchrun's forward of a Ctrl-C): one request, one save.
    gate = tmp_path / "gate-three"
    proc = _held_in_a_step(tmp_path / "three", gate, every=100)
    proc.send_signal(signal.SIGINT)
    _wait_for_line(proc, "SIGINT: finishing this step")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    gate.unlink()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT and "SIGINT: stopped after epoch 1 step" in out, out
    assert find_resumable(tmp_path / "three" / "checkpoints") is not None


def _kill_job(proc):
    """SIGKILL to the process and everything it started, as when a machine goes away (torchrun
    starts each worker in a session of its own, out of reach of a process-group kill)."""
    import psutil

    try:
        job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in job:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _kill_one(run_dir, every, delay, at_save, extra=(), launcher=(sys.executable,), total=12):
    proc = warm_popen([*launcher, RESUMABLE, str(run_dir), "1", str(every), "0.002", *extra], _env(),
                      stderr=subprocess.STDOUT)
    _wait_for_line(proc, f"step 1/{total}")
    if at_save:  # aim at a save after the first one: wait until it is under way, cut it at random
        root, deadline = run_dir / "checkpoints", time.monotonic() + 20
        while time.monotonic() < deadline and not (list_checkpoints(root) and any(root.glob(".tmp-*/*"))):
            time.sleep(0.0005)
    time.sleep(delay)
    _kill_job(proc)  # no handler runs, a save may be cut anywhere, on every process
    rest, _ = proc.communicate(timeout=30)
    printed = [int(line.split("step ")[1].split("/")[0]) for line in rest.splitlines() if f"/{total}" in line]
    mid_save = any((run_dir / "checkpoints").glob(".tmp-*"))
    found = find_resumable(run_dir / "checkpoints")
    saved = found[2]["cursor"]["global_step"] if found else 0
    return max(printed, default=1) - saved, found is not None, mid_save


KILL_LAYOUTS = {
    # (default trials, arguments after resumable.py's first four, launcher, steps per epoch shown)
    "whole": (20, (), (sys.executable,), 12),
    # FSDP in one process: every save is a sharded one (torch.distributed.checkpoint + commit).
    "sharded": (10, ("cpu", "-", "fsdp"), (sys.executable,), 12),
    # Two processes writing their parts of each save, killed together.
    "sharded, 2 processes": (4, ("cpu", "2", "fsdp"), ("torchrun", "--nproc-per-node", "2", "--standalone"), 6),
}


@pytest.mark.parametrize("layout", list(KILL_LAYOUTS))
def test_kill_9_during_saves_never_loses_a_loadable_checkpoint(tmp_path, layout):
    """Trials run two at a time (one per core); `make stress` runs 200 of each layout."""
    from concurrent.futures import ThreadPoolExecutor

    default, extra, launcher, total = KILL_LAYOUTS[layout]
    if launcher[0] == "torchrun":
        launcher = (shutil.which("torchrun", path=str(Path(sys.executable).parent)), *launcher[1:])
    trials = int(os.environ.get("XLATRAIN_KILL_TRIALS", default))
    every = 2
    rng = random.Random(1234)
    # Odd trials are cut a few milliseconds into a save, even ones anywhere in the run.
    delays = [rng.uniform(0.0, 0.004) if i % 2 else rng.uniform(0.0, 0.4) for i in range(trials)]
    parallel = 1 if len(launcher) > 1 else 2  # two torchrun jobs would put 4 processes on 2 cores
    with ThreadPoolExecutor(parallel) as pool:
        results = list(pool.map(
            lambda i: _kill_one(tmp_path / f"trial{i}", every, delays[i], i % 2 == 1, extra, launcher, total),
            range(trials),
        ))
    lost = [r[0] for r in results]
    mid_save = sum(r[2] for r in results)
    print(f"kill -9 trials ({layout}): {trials}, killed mid-save: {mid_save}, "
          f"resumable: {sum(r[1] for r in results)}, steps lost: max {max(lost)}, mean {sum(lost) / trials:.2f}")
    # A kill can land after step k was trained and printed but before its save finished, so up
    # to `every` steps may be lost; more would mean a checkpoint was lost or unreadable.
    assert max(lost) <= every, lost
    # Where nothing verifies, nothing had been saved yet: the run restarts losing <= every steps.
    assert all(found or lost_steps <= every for lost_steps, found, _ in results)
    # Cut into a later save, the earlier checkpoint is always there and verifies.
    assert all(results[i][1] for i in range(1, trials, 2)), results
    # The test means something only if kills landed inside saves: a temporary directory left
    # behind is a save cut short. About half the aimed trials land there (measured 10 of 20).
    assert mid_save >= 1, "no kill landed mid-save: the trials did not test what they claim"


def test_damaged_or_incomplete_checkpoints_are_skipped_with_a_named_warning(tmp_path, caplog):
    run_script([sys.executable, RESUMABLE, str(tmp_path), "1", "3", "0"])
    root = tmp_path / "checkpoints"
    newest, previous = list_checkpoints(root)[-1], list_checkpoints(root)[-2]
    blob = bytearray((newest / "state.safetensors").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (newest / "state.safetensors").write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="xlatrain"):
        path, _, _ = find_resumable(root)
    assert path == previous
    assert f"{newest.name}: state.safetensors does not match its checksum" in caplog.text
    # Every process of a job finds the same damage and takes the same decision; the main process
    # alone says it (each process said it under torchrun).
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xlatrain"):
        path, _, _ = find_resumable(root, group=_SecondOfTwo(root))
    assert path == previous and "does not match its checksum" not in caplog.text
    (previous / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        read_checkpoint(previous)


class _SecondOfTwo:
    """The second process of a two-process job, in one process: its host gathers give what both
    processes hold, the main process's list of checkpoints first (both read the same directory)."""

    process_index, num_processes, is_main = 1, 2, False

    def __init__(self, root):
        self._listed = [p.name for p in reversed(list_checkpoints(root))]
        self._gathers = 0

    def gather_objects(self, obj):
        self._gathers += 1
        return [self._listed if self._gathers == 1 else obj, obj]  # the first: the main process's list

    def barrier(self):
        pass

    def any_process(self, flag):
        return flag


def _tiny_trainer(run_dir, loss_fn=None, callbacks=(), checkpoint=True, scheduler_fn=None, **cfg):
    torch.manual_seed(0)
    cfg.setdefault("epochs", 1)
    cfg.setdefault("batch_size", 4)
    cfg.setdefault("log_every", 2)
    return xlatrain.Trainer(
        nn.Linear(4, 2),
        loss_fn or nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        config=xlatrain.TrainConfig(run_dir=str(run_dir), **cfg),
        checkpoint=xlatrain.CheckpointConfig(every_steps=1) if checkpoint else xlatrain.CheckpointConfig(enabled=False),
        callbacks=list(callbacks),
        scheduler_fn=scheduler_fn,
        backend="cpu",
    )


def _tiny_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class NanAtStep:
    """Cross-entropy that returns NaN on the given (1-based) training step: a fault at a known step.

    Only calls on a training batch (``batch`` rows, with gradients) count: the Trainer's dry run
    and evaluation (no gradients) and its memory plan (a few samples) are not steps.
    """

    def __init__(self, step, batch=5):
        self.step, self.batch, self.calls = step, batch, 0

    def __call__(self, outputs, targets, reduction="mean"):
        self.calls += torch.is_grad_enabled() and len(targets) == self.batch
        loss = nn.functional.cross_entropy(outputs, targets, reduction=reduction)
        return loss * float("nan") if self.calls == self.step else loss


def test_nan_policy_stop_names_the_steps_and_keeps_the_last_good_checkpoint(tmp_path):
    trainer = _tiny_trainer(tmp_path, NanAtStep(5), batch_size=5)
    with pytest.raises(xlatrain.NonFiniteLossError, match=r"between steps \d+ and \d+ of epoch 1.*latest: step-00000004"):
        trainer.fit(_tiny_data())
    assert latest_name(tmp_path / "checkpoints") == "step-00000004"
    _, meta = read_checkpoint(tmp_path / "checkpoints" / "step-00000004")
    assert meta["cursor"]["step"] == 4


def test_nan_policy_skip_step_leaves_weights_finite_and_counts_the_loss_out(tmp_path):
    heard = []

    class Intervals:
        def on_interval(self, trainer, values):
            heard.append(values)

    trainer = _tiny_trainer(tmp_path, NanAtStep(5), batch_size=5, nan_policy="skip_step", log_every=4,
                            callbacks=[Intervals()])
    history = trainer.fit(_tiny_data())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert math.isfinite(history[0]["train_loss"])  # the mean over the good steps
    assert history[0]["nonfinite_steps"] == 1  # kept with the epoch, and said on its line
    # The progress line, TensorBoard and callbacks take their means over the same steps (the
    # skipped step's loss counted as 0 over all 8 steps read 7/8 of it, and 3/4 in its interval).
    first, last = heard[0], heard[-1]
    assert (first["step"], last["step"], last["nonfinite_steps"]) == (4, 8, 1)
    assert last["epoch_loss"] == pytest.approx(history[0]["train_loss"], rel=1e-6)
    # Steps 5-8 hold 3 that counted: (the loss sum over 7 counted steps - the sum over the first 4) / 3.
    assert last["loss"] == pytest.approx((7 * last["epoch_loss"] - 4 * first["epoch_loss"]) / 3, rel=1e-5)



class _Watched(NanAtStep):
    """NanAtStep that also keeps each training step's finite loss and the weights it ran with."""

    def __init__(self, step, batch=5):
        super().__init__(step, batch)
        self.losses, self.weights = {}, {}

    def __call__(self, outputs, targets, reduction="mean"):
        loss = super().__call__(outputs, targets, reduction)
        if torch.is_grad_enabled() and len(targets) == self.batch:
            self.losses[self.calls] = float(loss)
            self.weights[self.calls] = self.model.weight.detach().clone()
        return loss


@pytest.mark.parametrize("nan_at", [5, 6, 8], ids=["first", "middle", "last"])
def test_skip_step_under_accumulation_skips_the_whole_group_and_counts_none_of_it(tmp_path, nan_at):
    """A NaN in the first, a middle or the last micro-batch of a group of 4: the group's optimizer
    step is skipped and all 4 of its micro-batches are left out of the means, its finite ones
    included (the earlier ones had counted; the last one's finite loss had not, its gradients'
    norm being NaN)."""
    heard = []

    class Intervals:
        def on_interval(self, trainer, values):
            heard.append(values)

    loss_fn = _Watched(nan_at)
    trainer = _tiny_trainer(tmp_path, loss_fn, batch_size=5, nan_policy="skip_step", grad_accum_steps=4, log_every=3,
                            checkpoint=False, callbacks=[Intervals()])
    loss_fn.model = trainer.model
    row = trainer.fit(_tiny_data())[0]
    assert sorted(loss_fn.losses) == list(range(1, 9)) and math.isnan(loss_fn.losses[nan_at])
    assert row["nonfinite_steps"] == 4
    first_group = sum(loss_fn.losses[s] for s in range(1, 5)) / 4
    assert row["train_loss"] == pytest.approx(first_group, rel=1e-6)
    # The reads due at steps 3 and 6 wait for their groups' ends (4, and the epoch's end at 8): the
    # second interval's steps all went with the skipped group, so it has no loss to average.
    assert [(v["step"], v["nonfinite_steps"]) for v in heard] == [(4, 0), (8, 4)]
    assert heard[0]["loss"] == pytest.approx(first_group, rel=1e-6)
    assert math.isnan(heard[1]["loss"]) and heard[1]["epoch_loss"] == pytest.approx(first_group, rel=1e-6)
    # Steps 1-4 moved the weights (the first group's step); steps 5-8 did not (the second's, skipped).
    assert not torch.equal(loss_fn.weights[1], loss_fn.weights[5])
    assert torch.equal(trainer.model.weight.detach(), loss_fn.weights[5])
    # A group whose every loss is finite counts all of its micro-batches: the same run without the NaN.
    clean = _Watched(0)
    trainer = _tiny_trainer(tmp_path / "clean", clean, batch_size=5, nan_policy="skip_step", grad_accum_steps=4,
                            checkpoint=False)
    clean.model = trainer.model
    row = trainer.fit(_tiny_data())[0]
    assert "nonfinite_steps" not in row
    assert row["train_loss"] == pytest.approx(sum(clean.losses.values()) / 8, rel=1e-6)


class _NanAt:
    """Cross-entropy with a NaN at one training step (counted from the run's first step, the dry
    run before it left out), its gradients NaN too or, with ``finite_grads``, finite (a NaN added
    to the loss, detached). Keeps the weights each training step ran with."""

    def __init__(self, step, finite_grads=False):
        self.step, self.finite_grads, self.calls, self.started, self.weights = step, finite_grads, 0, False, {}

    def on_fit_start(self, trainer):  # a callback too: training steps start after the dry run
        self.started, self.model = True, trainer.model

    def __call__(self, outputs, targets, reduction="mean"):
        loss = nn.functional.cross_entropy(outputs, targets, reduction=reduction)
        if not (self.started and torch.is_grad_enabled()):
            return loss
        self.calls += 1
        self.weights[self.calls] = self.model.weight.detach().clone()
        if self.calls != self.step:
            return loss
        return loss + torch.tensor(float("nan")) if self.finite_grads else loss * float("nan")


def _skip_fit(tmp_path, loss_fn, optimizer, **cfg):
    torch.manual_seed(0)
    trainer = xlatrain.Trainer(
        nn.Linear(4, 2), loss_fn, optimizer, callbacks=[loss_fn], backend="cpu",
        config=xlatrain.TrainConfig(run_dir=str(tmp_path), epochs=1, batch_size=5, log_every=100, nan_policy="skip_step",
                                    **cfg),
        checkpoint=xlatrain.CheckpointConfig(enabled=False))
    return trainer, trainer.fit(_tiny_data())[0]


@pytest.mark.parametrize("at", [1, 3], ids=["first-step", "later-step"])
def test_skip_step_leaves_adam_as_it_was_its_step_count_and_first_state_included(tmp_path, at):
    """Adam makes its moments at its first step: made from NaN gradients and kept, they turned
    every later step into NaN (7 of 8 steps skipped, the weights NaN at the end). The state made
    by a skipped step is dropped and made again at the next; and a skipped step later on does not
    advance Adam's step count (its bias correction would run one step ahead for the rest of the run)."""
    loss_fn = _NanAt(at)
    trainer, row = _skip_fit(tmp_path, loss_fn, functools.partial(torch.optim.Adam, lr=0.01))
    assert row["nonfinite_steps"] == 1 and math.isfinite(row["train_loss"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert torch.equal(loss_fn.weights[at + 1], loss_fn.weights[at])  # the skipped step changed nothing
    assert [float(s["step"]) for s in trainer.optimizer.state.values()] == [7.0, 7.0]  # 7 steps taken


@pytest.mark.parametrize(("at", "first_rate"), [(1, 4), (2, 3), (None, 3)], ids=["first-step", "second-step", "none"])
def test_a_skipped_first_step_moves_the_steady_window_a_step_on(tmp_path, at, first_rate):
    """The step after a skipped first step makes Adam's state again, and the step after that is
    the first steady one (on XLA it compiles): the rates start a step later. A skipped step
    whose state was already made moves nothing."""
    loss_fn = _NanAt(at or 0)

    class Rates:
        def __init__(self):
            self.rates = {}

        def on_interval(self, trainer, values):
            self.rates[values["step"]] = values["samples_per_s"]

    rates = Rates()
    torch.manual_seed(0)
    trainer = xlatrain.Trainer(
        nn.Linear(4, 2), loss_fn, functools.partial(torch.optim.Adam, lr=0.01), callbacks=[loss_fn, rates], backend="cpu",
        config=xlatrain.TrainConfig(run_dir=str(tmp_path), epochs=1, batch_size=5, log_every=1, nan_policy="skip_step"),
        checkpoint=xlatrain.CheckpointConfig(enabled=False))
    trainer.fit(_tiny_data())
    assert min(step for step, rate in rates.rates.items() if rate is not None) == first_rate, rates.rates


def test_skip_step_under_fp16_skips_a_nan_loss_whose_gradients_are_finite(tmp_path):
    """Under fp16 the GradScaler skips a step whose gradients overflowed; a NaN loss with finite
    gradients it would take. skip_step keeps its promise there too: the weights stay as they were."""
    loss_fn = _NanAt(3, finite_grads=True)
    trainer, row = _skip_fit(tmp_path, loss_fn, functools.partial(torch.optim.SGD, lr=0.1), precision="fp16")
    assert row["nonfinite_steps"] == 1
    assert torch.equal(loss_fn.weights[4], loss_fn.weights[3])
    assert not torch.equal(loss_fn.weights[3], loss_fn.weights[2])  # the steps around it were taken


def test_sums_resumed_on_another_process_count_keep_the_count_of_skipped_steps():
    """Under skip_step every process skips the same steps and holds the same count, which the run
    says once: resumed on 1 or 4 processes, the mean over processes stays that count. Under stop
    and ignore each process counts its own, and the total (carried by process 0) stays."""
    from xlatrain.train.resumable import resharded_sums

    saved = [{"loss": 4.0, "nonfinite": 3.0}, {"loss": 6.0, "nonfinite": 3.0}]
    for count in (1, 4):
        shares = [resharded_sums(saved, i, count, alike=True) for i in range(count)]
        assert sum(s["nonfinite"] for s in shares) / count == 3.0 and all(s["loss"] == 5.0 for s in shares)
    own = [{"loss": 4.0, "nonfinite": 1.0}, {"loss": 6.0, "nonfinite": 0.0}]
    assert [resharded_sums(own, i, 4)["nonfinite"] for i in range(4)] == [1.0, 0.0, 0.0, 0.0]

def test_steps_skipped_are_kept_apart_under_another_nan_policy_and_counted_again_under_skip_step():
    """The sums a checkpoint holds, as the resuming run's nan_policy counts them: skip_step's count
    is of skipped steps, kept apart under stop and ignore (whose counts are of non-finite steps
    whose loss is in the sum), and counted with theirs again under skip_step."""
    from xlatrain.train.resumable import counted_as

    skipped = [{"loss": 4.0, "nonfinite": 2.0}, {"loss": 6.0, "nonfinite": 2.0}]  # alike under skip_step
    apart = counted_as(skipped, "skip_step", "stop")
    assert apart == [{"loss": 4.0, "nonfinite": 0.0, "skipped": 2.0}, {"loss": 6.0, "nonfinite": 0.0, "skipped": 2.0}]
    later = [{"loss": 5.0, "nonfinite": 1.0, "skipped": 2.0}, {"loss": 7.0, "nonfinite": 0.0, "skipped": 2.0}]
    assert counted_as(later, "ignore", "stop") == later
    assert counted_as(later, "ignore", "skip_step") == [{"loss": 5.0, "nonfinite": 3.0}, {"loss": 7.0, "nonfinite": 2.0}]
    assert counted_as(skipped, "skip_step", "skip_step") == skipped
    assert counted_as([{"loss": 1.0, "nonfinite": 0.0}], "skip_step", "ignore") == [{"loss": 1.0, "nonfinite": 0.0}]


def test_nan_policy_ignore_trains_on_and_reports_nan(tmp_path):
    trainer = _tiny_trainer(tmp_path, NanAtStep(5), batch_size=5, nan_policy="ignore")
    history = trainer.fit(_tiny_data())
    assert history[0]["train_loss"] != history[0]["train_loss"]


class _StopAt:
    """SIGTERM to this process at one interval: the run checkpoints that step and exits."""

    def __init__(self, epoch, step):
        self.at = (epoch, step)

    def on_interval(self, trainer, values):
        if (values["epoch"], values["step"]) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("then", ["stop", "ignore"])
def test_a_step_skipped_before_a_resume_under_another_nan_policy_stays_a_skipped_step(tmp_path, then, caplog):
    """skip_step skipped step 3 of 8 and the run stopped at step 5; resumed under stop or ignore on
    clean data, the skipped step counted in the saved sums was taken for a new NaN (stop raised at
    the first interval; every line said a non-finite step) and ignore divided train_loss by all 8
    steps, though the skipped one's loss is in no sum. Stopped again under the new policy and
    resumed, the run still knows that step was skipped."""
    caplog.set_level(logging.INFO, logger="xlatrain")
    heard = []

    class Intervals:
        def on_interval(self, trainer, values):
            heard.append(values)

    def trainer(run_dir, policy, loss_fn=None, callbacks=()):
        return _tiny_trainer(run_dir, loss_fn, [Intervals(), *callbacks], batch_size=5, log_every=1, nan_policy=policy)

    whole = trainer(tmp_path / "whole", "skip_step", NanAtStep(3)).fit(_tiny_data())[0]
    assert whole["nonfinite_steps"] == 1
    heard.clear()
    with pytest.raises(SystemExit):
        trainer(tmp_path / "cut", "skip_step", NanAtStep(3), [_StopAt(1, 5)]).fit(_tiny_data())
    heard.clear()
    with pytest.raises(SystemExit):  # under stop: no NonFiniteLossError
        trainer(tmp_path / "cut", then, callbacks=[_StopAt(1, 7)]).fit(_tiny_data())
    assert [v["step"] for v in heard] == [6, 7]
    row = trainer(tmp_path / "cut", then).fit(_tiny_data())[0]
    assert [v["step"] for v in heard] == [6, 7, 8] and all(v["nonfinite_steps"] == 0 for v in heard)
    assert "non-finite steps" not in caplog.text.split("stopped after epoch 1 step 5")[1]
    # The means are over the 7 steps that counted, as in the run that never stopped; the epoch says it skipped one.
    assert row["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-6) and row["nonfinite_steps"] == 1
    assert heard[-1]["epoch_loss"] == pytest.approx(whole["train_loss"], rel=1e-6)


def _tensor_lr_fit(run_dir, callbacks=()):
    """Adam with its rate a tensor, as torch's compiled optimizer step takes one, moved every step."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    trainer = xlatrain.Trainer(
        nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.Adam, lr=torch.tensor(0.01)),
        scheduler_fn=functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda n: 0.95 ** n),
        config=xlatrain.TrainConfig(epochs=2, batch_size=8, run_dir=str(run_dir), log_every=1, tensorboard=False,
                                    scheduler_interval="step"),
        checkpoint=xlatrain.CheckpointConfig(every_steps=2), callbacks=list(callbacks), backend="cpu")
    return trainer, trainer.fit(TensorDataset(x, (x[:, 0] > 0).long()))


class _Settings:
    """The rate and the scheduler's base rate as the run starts its first step (after a resume's load)."""

    def on_fit_start(self, trainer):
        self.lr, self.base_lr = trainer.optimizer.param_groups[0]["lr"], trainer.scheduler.base_lrs[0]
        self.lr_value = float(self.lr)


def test_a_tensor_learning_rate_is_checkpointed_and_resumes_as_the_same_tensor(tmp_path):
    whole, history = _tensor_lr_fit(tmp_path / "whole")
    with pytest.raises(SystemExit):
        _tensor_lr_fit(tmp_path / "cut", [_StopAt(2, 3)])
    settings = _Settings()
    resumed, again = _tensor_lr_fit(tmp_path / "cut", [settings])
    assert _without_timing(again) == _without_timing(history)
    assert [r["lr"] for r in history] == pytest.approx([0.01, 0.01 * 0.95 ** 8])
    # Loaded as they were built: tensors, holding the saved step's values (11 optimizer steps done).
    assert isinstance(settings.lr, torch.Tensor) and settings.lr_value == pytest.approx(0.01 * 0.95 ** 11)
    assert isinstance(settings.base_lr, torch.Tensor) and settings.base_lr.item() == pytest.approx(0.01)
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))


def test_a_stop_says_how_to_resume_the_run_it_stopped(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    with pytest.raises(SystemExit):
        _tiny_trainer(tmp_path / "a", log_every=1, callbacks=[_StopAt(1, 3)]).fit(_tiny_data())
    assert "Run the same command again to resume (resume='auto')." in caplog.text
    # After resume='overwrite' (--overwrite), the same command again would clear what was just saved.
    caplog.clear()
    with pytest.raises(SystemExit):
        _tiny_trainer(tmp_path / "a", log_every=1, callbacks=[_StopAt(1, 3)]).fit(_tiny_data(), resume="overwrite")
    assert "same command again to resume" not in caplog.text
    assert f"To resume, run with resume='auto' and the run directory {tmp_path / 'a'} (on the command line: " \
           "without --fresh, --overwrite or --resume, naming that directory)" in caplog.text
    assert _tiny_trainer(tmp_path / "a").fit(_tiny_data())  # and that resumes: it trains what was left
    assert "continuing at epoch 1, step 3" in caplog.text
    # resume=RUN_DIR takes its newest checkpoint, so the same call again does continue.
    caplog.clear()
    with pytest.raises(SystemExit):
        _tiny_trainer(tmp_path / "a", log_every=1, epochs=2, callbacks=[_StopAt(2, 3)]).fit(
            _tiny_data(), resume=str(tmp_path / "a"))
    assert "Run the same command again to resume." in caplog.text
    # Without checkpoints no stop promises one.
    caplog.clear()
    with pytest.raises(SystemExit):
        _tiny_trainer(tmp_path / "off", log_every=1, callbacks=[_StopAt(1, 3)], checkpoint=False).fit(_tiny_data())
    assert "then stopping (checkpoints are off: the run cannot resume)" in caplog.text
    assert "stopped after epoch 1 step 3 without a checkpoint (checkpoints are off)" in caplog.text
    assert "saving a checkpoint" not in caplog.text and "to resume" not in caplog.text.lower().replace("cannot resume", "")


def _one_cycle(optimizer, run):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=run.total_steps)


def _warmup_then_cosine(epochs):
    def build(opt):
        return torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, 0.5, total_iters=1),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs - 1)], milestones=[1])
    return build


@pytest.mark.parametrize("schedule, refused", [
    (lambda epochs: functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=epochs),
     "CosineAnnealingLR's T_max 2 -> 4"),
    (lambda epochs: _one_cycle, "OneCycleLR's total_steps 20 -> 40"),
    (_warmup_then_cosine, "SequentialLR's _schedulers.1.T_max 1 -> 3"),  # the cosine inside
    (lambda epochs: functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1), None),
    # Warm restarts every 5 epochs whatever the run's length: its position (T_cur) is no length.
    (lambda epochs: functools.partial(torch.optim.lr_scheduler.CosineAnnealingWarmRestarts, T_0=5), None),
])
def test_more_epochs_under_a_schedule_sized_for_the_old_length_are_refused_before_anything_loads(
        schedule, refused, tmp_path):
    def trainer(epochs):
        torch.manual_seed(0)
        return xlatrain.Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                                scheduler_fn=schedule(epochs), config=xlatrain.TrainConfig(
                                    epochs=epochs, batch_size=4, run_dir=str(tmp_path), tensorboard=False),
                                backend="cpu")

    trainer(2).fit(_tiny_data())
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".xlatrain.lock"}
    if refused is None:  # a schedule of its own pace goes on
        assert len(trainer(4).fit(_tiny_data())) == 4
        return
    with pytest.raises(ValueError) as err:
        trainer(4).fit(_tiny_data())
    message = str(err.value)
    assert f"with trainer.epochs 2 -> 4: the learning-rate schedule holds the run's length ({refused})" in message
    assert "Keep epochs=2" in message and f"({tmp_path}/best.safetensors): --fresh --set model.pretrained=" in message
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".xlatrain.lock"}
    assert after == before  # nothing trained, nothing written


def test_an_optimizer_setting_changed_before_a_resume_is_said_not_dropped_silently(tmp_path, caplog):
    """A factory changed between runs (another lr or betas) loses to the checkpoint's values, which
    loading puts back: that was unsaid. A schedule's progress (the rate it moved) is no change."""
    def trainer(epochs, **adam):
        torch.manual_seed(0)
        return xlatrain.Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, **adam),
                                scheduler_fn=lambda opt, run: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                config=xlatrain.TrainConfig(epochs=epochs, batch_size=4, run_dir=str(tmp_path),
                                                            tensorboard=False), backend="cpu")

    trainer(1, lr=0.01).fit(_tiny_data())
    with caplog.at_level(logging.INFO, logger="xlatrain"):
        history = trainer(2, lr=0.005, betas=(0.8, 0.999)).fit(_tiny_data())
    assert ("the checkpoint's optimizer settings continue, not this run's optimizer factory's: optimizer.betas "
            "[0.9, 0.999] kept (this run: [0.8, 0.999]); optimizer.lr 0.01 kept (this run: 0.005)") in caplog.text
    assert [round(r["lr"], 6) for r in history] == [0.01, 0.005]  # the checkpoint's schedule went on
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xlatrain"):
        trainer(3, lr=0.01).fit(_tiny_data())  # the same factory: the moved rate is no change
    assert "optimizer settings continue" not in caplog.text


def test_a_schedule_saved_with_another_length_at_the_same_epochs_goes_on_as_saved_and_is_said(tmp_path, caplog):
    """A per-step cosine an earlier xlatrain built over the epoch count (T_max=2) resumed where one
    built now spans the run's steps (T_max=20): the checkpoint's goes on, and the header says so."""
    caplog.set_level(logging.INFO, logger="xlatrain")

    def trainer(t_max, callbacks=()):
        torch.manual_seed(0)
        return xlatrain.Trainer(
            nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
            scheduler_fn=functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=t_max),
            config=xlatrain.TrainConfig(epochs=2, batch_size=4, run_dir=str(tmp_path), tensorboard=False, log_every=1,
                                        scheduler_interval="step"),
            checkpoint=xlatrain.CheckpointConfig(every_steps=1), callbacks=list(callbacks), backend="cpu")

    with pytest.raises(SystemExit):
        trainer(2, [_StopAt(1, 3)]).fit(_tiny_data())
    resumed = trainer(20)
    resumed.fit(_tiny_data())
    assert "the checkpoint's learning-rate schedule holds another length than one built now (CosineAnnealingLR's " \
           "T_max 2 -> 20); the run goes on with it as saved" in caplog.text
    assert resumed.scheduler.T_max == 2


class _StatusAtCheckpoints:
    def __init__(self):
        self.seen = []

    def on_checkpoint(self, trainer, path):
        meta = json.loads((path / "meta.json").read_text())["cursor"]
        self.seen.append((json.loads((trainer.run_dir / "status.json").read_text()), path.name, meta))


def test_status_json_names_the_newest_checkpoint_a_hard_kill_would_leave(tmp_path):
    status = _StatusAtCheckpoints()
    _tiny_trainer(tmp_path, callbacks=[status], epochs=2).fit(_tiny_data())
    assert len(status.seen) == 20  # every step's checkpoint, 10 steps an epoch
    for record, name, cursor in status.seen:  # where a rerun continues: after a finished epoch, the next one
        assert record["state"] == "running" and record["checkpoint"] == name
        continues = (cursor["epoch"] + 1, 0) if cursor["epoch_done"] else (cursor["epoch"], cursor["step"])
        assert (record["epoch"], record["step"]) == continues
    assert [(r["epoch"], r["step"]) for r, _, _ in status.seen[8:11]] == [(1, 9), (2, 0), (2, 1)]
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "finished"


class _Armed(torch.utils.data.Dataset):
    """``_tiny_data``; once armed, reading the next item sends this process a SIGTERM."""

    def __init__(self):
        self.data, self.armed = _tiny_data(), False

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGTERM)
        return self.data[i]


class _ArmAt:
    def __init__(self, data, epoch, step):
        self.data, self.at = data, (epoch, step)

    def on_interval(self, trainer, values):
        if (values["epoch"], values["step"]) == self.at:
            self.data.armed = True


def test_a_run_stopped_at_its_epochs_last_step_resumes_into_validation_without_false_figures(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    data = _Armed()
    schedule = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    with pytest.raises(SystemExit):  # the last batch's read brings the signal: the stop comes after step 10 of 10
        _tiny_trainer(tmp_path, log_every=1, epochs=2, callbacks=[_ArmAt(data, 1, 9)], scheduler_fn=schedule).fit(data)
    assert "stopped after epoch 1 step 10" in caplog.text
    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning that the schedule stepped before the optimizer
        history = _tiny_trainer(tmp_path, log_every=1, epochs=2, scheduler_fn=schedule).fit(_tiny_data())
    assert "continuing at epoch 1, step 10" in caplog.text
    assert "samples_per_s" not in history[0] and history[1]["samples_per_s"] > 0  # no 0 samples/s for no steps
    assert [r["lr"] for r in history] == [0.1, 0.05]
    line = next(ln for ln in caplog.text.splitlines() if "epoch 1/2" in ln)
    assert "samples/s" not in line and "MFU" not in line


def test_a_stop_during_validation_ends_it_there_and_the_resumed_run_validates_the_epoch(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlatrain")
    whole = _tiny_trainer(tmp_path / "whole", epochs=2).fit(_tiny_data(), _tiny_data())
    caplog.clear()
    val = _Armed()
    seen = _StatusAtCheckpoints()
    with pytest.raises(SystemExit):  # the signal comes with the first validation batch's read
        _tiny_trainer(tmp_path / "cut", log_every=1, epochs=2, callbacks=[_ArmAt(val, 1, 10), seen],
                      eval_batch_size=4).fit(_tiny_data(), val)
    assert "stopped after epoch 1 step 10" in caplog.text and "epoch 1/2" not in caplog.text  # not validated
    assert seen.seen[-1][2]["step"] == 10 and not seen.seen[-1][2]["epoch_done"]
    caplog.clear()
    resumed = _tiny_trainer(tmp_path / "cut", epochs=2).fit(_tiny_data(), _tiny_data())
    assert "continuing at epoch 1, step 10" in caplog.text
    assert _without_timing(resumed) == _without_timing(whole)


def test_a_run_resumed_mid_epoch_records_the_rate_its_epoch_began_with(tmp_path):
    def stepped(run_dir, callbacks=()):
        torch.manual_seed(0)
        return xlatrain.Trainer(
            nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
            scheduler_fn=functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda n: 0.9 ** n),
            config=xlatrain.TrainConfig(epochs=2, batch_size=4, run_dir=str(run_dir), log_every=1, tensorboard=False,
                                        scheduler_interval="step"),
            checkpoint=xlatrain.CheckpointConfig(every_steps=1), callbacks=list(callbacks), backend="cpu")

    whole = stepped(tmp_path / "whole").fit(_tiny_data())
    assert [r["lr"] for r in whole] == pytest.approx([0.1, 0.1 * 0.9 ** 10])
    with pytest.raises(SystemExit):
        stepped(tmp_path / "cut", [_StopAt(2, 3)]).fit(_tiny_data())
    resumed = stepped(tmp_path / "cut").fit(_tiny_data())  # at step 3 the rate was 0.1 * 0.9 ** 13
    assert [r["lr"] for r in resumed] == pytest.approx([r["lr"] for r in whole])


def test_resume_false_starts_a_new_run_directory_and_keeps_the_old_one(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _tiny_trainer(run_dir).fit(_tiny_data())
    before = (run_dir / "history.json").read_bytes()
    trainer = _tiny_trainer(run_dir)
    trainer.fit(_tiny_data(), resume=False)
    assert trainer.run_dir == tmp_path / "run-2"
    assert (run_dir / "history.json").read_bytes() == before
    assert (tmp_path / "run-2" / "history.json").exists()


def test_resume_from_an_explicit_path_and_auto_after_the_end(tmp_path):
    run_dir = tmp_path / "run"
    first = _tiny_trainer(run_dir, epochs=2)
    first.fit(_tiny_data())
    ckpt = list_checkpoints(run_dir / "checkpoints")[0]
    again = _tiny_trainer(tmp_path / "other", epochs=2)
    history = again.fit(_tiny_data(), resume=str(ckpt))
    assert [r["epoch"] for r in history] == [1, 2]
    done = _tiny_trainer(run_dir, epochs=2)
    assert done.fit(_tiny_data()) == json.loads((run_dir / "history.json").read_text())


def test_a_failed_save_leaves_the_previous_checkpoint_latest_and_no_temporaries(tmp_path):
    # A real failing write: RLIMIT_FSIZE makes the kernel refuse the write past a size (EFBIG).
    code = f"""
import resource, signal, sys
sys.path.insert(0, {str(SCRIPTS)!r})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
import torch
from tiny_run import tiny
trainer, data = tiny({str(tmp_path)!r})
trainer.fit(data)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
from xlatrain.checkpoint import CheckpointError
from xlatrain.train.resumable import save_checkpoint
from xlatrain.train.state import Cursor
try:
    save_checkpoint(trainer, Cursor(epoch=1, step=10, global_step=99), trainer._new_sums())
except CheckpointError as exc:
    print("ERROR", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert "ERROR could not save checkpoint" in out.stdout, out.stdout + out.stderr
    assert "File too large" in out.stdout and "the latest checkpoint is still step-00000010" in out.stdout
    root = tmp_path / "checkpoints"
    assert latest_name(root) == "step-00000010"
    assert not list(root.glob(".tmp-*"))
    read_checkpoint(root / "step-00000010")  # still verifies


def _interrupt_and_resume(tmp_path, launcher, extra, env, after_line, under_torchrun=False, start_env=None):
    """SIGTERM a run at ``after_line`` (lines, in order), check it stopped cleanly, run it again to the end."""
    proc = _start(tmp_path, every=1, sleep_s=0.02, extra=extra, launcher=launcher, env={**(env or {}), **(start_env or {})})
    for line in [after_line] if isinstance(after_line, str) else after_line:
        _wait_for_line(proc, line, timeout=180)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    if under_torchrun:
        # torchrun forwards SIGTERM to its workers, waits for them, then exits 1 by its own design
        # (SignalException); a worker that failed would show up as a ChildFailedError.
        assert "ChildFailedError" not in out, out
    else:
        assert proc.returncode == 0, out
    stops = [line for line in out.splitlines() if "SIGTERM: stopped after" in line]
    assert len(stops) == 1, out  # printed by rank 0 only, once
    assert not (tmp_path / "final.safetensors").exists()
    cmd = [*launcher, RESUMABLE, str(tmp_path), "2", "1", "0", *extra]
    return stops[0], run_script(cmd, env=env, timeout=300)


def _assert_close(a, b, rel):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for key in ("train_loss", "val_loss"):
            assert ra[key] == pytest.approx(rb[key], rel=rel), (key, ra, rb)
        assert ra["val_accuracy"] == rb["val_accuracy"] and ra["lr"] == rb["lr"]


@pytest.mark.xla
def test_sigterm_then_resume_on_xla_cpu_spmd_matches_an_uninterrupted_run(tmp_path):
    """Tolerance 1e-6 relative: XLA:CPU compiles the same graphs in both runs (measured: identical)."""
    env, extra = {"PJRT_DEVICE": "CPU"}, ("xla", "4")
    whole = run_script([sys.executable, RESUMABLE, str(tmp_path / "whole"), "2", "1", "0", *extra], env=env)
    stop, resumed = _interrupt_and_resume(tmp_path / "cut", (sys.executable,), extra, env, "epoch 2 step 1/3")
    assert "epoch 2 step 1" in stop or "epoch 2 step 2" in stop
    _assert_close(resumed, whole, rel=1e-6)


@pytest.mark.xla
def test_a_stop_during_validation_on_xla_cpu_ends_it_at_a_batch_and_the_resumed_run_validates_the_epoch(tmp_path):
    """One XLA device: 12 steps an epoch, 20 validation items in batches of 8 (0.2 s an item).
    The stop is noticed at the next validation batch, the checkpoint is the epoch's last step,
    and the resumed run validates epoch 1 and trains epoch 2 as a run left alone does."""
    env, extra = {"PJRT_DEVICE": "CPU"}, ("xla", "1")
    whole = run_script([sys.executable, RESUMABLE, str(tmp_path / "whole"), "2", "1", "0", *extra], env=env)
    stop, resumed = _interrupt_and_resume(tmp_path / "cut", (sys.executable,), extra, env,
                                          ["epoch 1 step 11/12", "VALIDATION ITEM"],
                                          start_env={"XLATRAIN_TEST_VAL_SLEEP": "0.2"})
    assert "stopped after epoch 1 step 12;" in stop
    _assert_close(resumed, whole, rel=1e-6)


@pytest.mark.multiprocess
def test_sigterm_under_torchrun_stops_every_rank_at_one_step_and_resumes_exactly(uninterrupted, tmp_path):
    import shutil

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    launcher = (torchrun, "--nproc-per-node", "2", "--standalone")
    extra = ("cpu", "2")
    # Same global batch as one process: 2 processes x 4 per device would differ, so compare with
    # a torchrun run left alone.
    whole_dir = tmp_path / "whole"
    whole = run_script([*launcher, RESUMABLE, str(whole_dir), "2", "1", "0", *extra])
    stop, resumed = _interrupt_and_resume(tmp_path / "cut", launcher, extra, None, "epoch 1 step 4/", under_torchrun=True)
    assert _without_timing(resumed) == _without_timing(whole)
    assert (tmp_path / "cut" / "final.safetensors").read_bytes() == (whole_dir / "final.safetensors").read_bytes()
    # Stopped during validation (an item read after the epoch's steps; 0.2 s an item, 1.6 s a batch),
    # both ranks agree at a batch, and the epoch's last step is the checkpoint; the resumed run
    # validates the epoch.
    stop, resumed = _interrupt_and_resume(tmp_path / "in-val", launcher, extra, None,
                                          ["epoch 1 step 5/6", "VALIDATION ITEM"], under_torchrun=True,
                                          start_env={"XLATRAIN_TEST_VAL_SLEEP": "0.2"})
    assert "stopped after epoch 1 step 6;" in stop
    assert _without_timing(resumed) == _without_timing(whole)
    assert (tmp_path / "in-val" / "final.safetensors").read_bytes() == (whole_dir / "final.safetensors").read_bytes()


def test_a_stop_signal_with_checkpoints_off_is_stopped_not_preempted_and_the_same_command_starts_over(tmp_path):
    # status.json said "preempted" (requeue) with no checkpoint, and the rerun was refused for
    # results that were an empty history.
    with pytest.raises(SystemExit):
        _tiny_trainer(tmp_path, checkpoint=False, callbacks=[_StopAt(1, 4)], epochs=2).fit(_tiny_data())
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "stopped" and status["checkpoint"] is None, status
    assert json.loads((tmp_path / "history.json").read_text()) == []
    history = _tiny_trainer(tmp_path, checkpoint=False, epochs=2).fit(_tiny_data())
    assert len(history) == 2
    # Once an epoch is written, its results are not trained over unasked.
    with pytest.raises(xlatrain.storage.lock.RunDirError, match=r"holds an earlier run's results \(history.json"):
        _tiny_trainer(tmp_path, checkpoint=False, epochs=3).fit(_tiny_data())
