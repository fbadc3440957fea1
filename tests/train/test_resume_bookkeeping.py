"""What a resumed run remembers and refuses: the best checkpoint, the monitor's direction, and a
config that changed since the checkpoint was written."""

import functools
import json
import shutil
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain
from xlatrain import load_weights
from xlatrain.checkpoint import list_checkpoints, read_checkpoint
from xlatrain.config import TrainConfig


def _data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _trainer(run_dir, model=None, lr=0.1, keep_last=1, **cfg):
    torch.manual_seed(0)
    cfg.setdefault("epochs", 1)
    cfg.setdefault("batch_size", 4)
    return xlatrain.Trainer(
        model or nn.Linear(4, 2),
        nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=lr),
        config=xlatrain.TrainConfig(run_dir=str(run_dir), **cfg),
        checkpoint=xlatrain.CheckpointConfig(keep_last=keep_last),
        backend="cpu",
    )


def test_the_best_checkpoint_survives_pruning_after_a_resume(tmp_path):
    # The training loss falls, so under monitor_mode="max" epoch 1 stays the best one throughout.
    first = _trainer(tmp_path, epochs=2, monitor="train_loss", monitor_mode="max")
    first.fit(_data())
    best_dir = list_checkpoints(tmp_path / "checkpoints")[0]
    assert read_checkpoint(best_dir)[1]["cursor"]["epoch"] == 1
    resumed = _trainer(tmp_path, epochs=4, monitor="train_loss", monitor_mode="max")
    history = resumed.fit(_data())
    assert [r["epoch"] for r in history] == [1, 2, 3, 4]
    names = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert best_dir.name in names, names  # kept besides the keep_last=1 newest
    assert len(names) == 2
    # best.safetensors still holds epoch 1's weights: the ones in the kept checkpoint.
    tensors, _ = read_checkpoint(best_dir)
    model = nn.Linear(4, 2)
    load_weights(model, tmp_path / "best.safetensors")
    assert torch.equal(model.weight, tensors["model.weight"])


def test_a_monitor_of_unknown_direction_needs_monitor_mode():
    with pytest.raises(ValueError, match=r"monitor='val_mae' needs monitor_mode: .*'max'.*'min'"):
        TrainConfig(monitor="val_mae")
    assert TrainConfig(monitor="val_mae", monitor_mode="min").monitor_mode == "min"
    TrainConfig(monitor="val_weighted_log_loss")  # direction known from the name: min
    TrainConfig(monitor="val_mean_auc")


def test_a_minimised_custom_metric_keeps_the_lowest_epoch(tmp_path):
    trainer = _trainer(tmp_path, epochs=3, monitor="train_loss", monitor_mode="min")
    history = trainer.fit(_data())
    best = min(history, key=lambda r: r["train_loss"])
    assert trainer.monitor_mode == "min" and best["epoch"] == 3


def test_fewer_epochs_than_done_is_an_error_naming_both_ways_on(tmp_path):
    _trainer(tmp_path, epochs=3).fit(_data())
    with pytest.raises(ValueError, match=r"trainer\.epochs 3 -> 2 \(the checkpoint has finished 3 epoch\(s\)\).*old values.*--fresh.*resume=False"):
        _trainer(tmp_path, epochs=2).fit(_data())


def test_more_epochs_continue_and_say_which_keys_changed(tmp_path, caplog):
    _trainer(tmp_path, epochs=2).fit(_data())
    caplog.set_level("INFO", logger="xlatrain")
    history = _trainer(tmp_path, epochs=3, log_every=7).fit(_data())
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert "resuming with changed settings: trainer.epochs 2 -> 3; trainer.log_every 50 -> 7" in caplog.text


def test_a_finished_run_says_there_is_nothing_to_train(tmp_path, caplog):
    _trainer(tmp_path, epochs=2).fit(_data())
    caplog.set_level("INFO", logger="xlatrain")
    history = _trainer(tmp_path, epochs=2).fit(_data())
    assert len(history) == 2 and "all 2 epoch(s) of this run are done: nothing to train" in caplog.text


@pytest.mark.parametrize(
    ("change", "named"),
    [
        # run.global_batch is no key to set: the message says which one keeps it.
        ({"batch_size": 8}, r"run\.global_batch 4 -> 8. The global batch is trainer\.batch_size x devices x "
                            r"trainer\.grad_accum_steps, here 8 x 1 x 1 = 8; trainer\.batch_size=4 keeps 4 on 1 device"),
        ({"seed": 1}, r"trainer\.seed 0 -> 1"),
        ({"grad_accum_steps": 2}, r"trainer\.grad_accum_steps 1 -> 2.*here 4 x 1 x 2 = 8; trainer\.batch_size=4 with "
                                   r"trainer\.grad_accum_steps=1 keeps 4 on 1 device"),
    ],
)
def test_a_setting_the_state_was_built_under_cannot_change(tmp_path, change, named):
    _trainer(tmp_path, epochs=1).fit(_data())
    with pytest.raises(ValueError, match=f"cannot resume .*{named}.*--fresh"):
        _trainer(tmp_path, epochs=2, **change).fit(_data())
    # Refused before anything ran: the history still holds the first run's one epoch.
    assert len(_trainer(tmp_path, epochs=1).fit(_data())) == 1


def test_another_dataset_size_or_model_shape_is_refused(tmp_path):
    _trainer(tmp_path, epochs=1).fit(_data(40))
    with pytest.raises(ValueError, match=r"run\.num_train_samples 40 -> 48"):
        _trainer(tmp_path, epochs=2).fit(_data(48))
    wider = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"the model differs from the checkpoint.s in 6 weight\(s\).*0\.weight: absent -> \(8, 4\)"):
        _trainer(tmp_path, model=wider, epochs=2).fit(_data(40))


def test_a_config_driven_run_refuses_another_optimizer_or_model_setting(tmp_path):
    from xlatrain.config import apply_overrides, load_yaml, run_config_from_dict
    from xlatrain.recipes.run import run

    base = load_yaml(open("configs/digits.yaml").read())
    sets = [f"trainer.run_dir={tmp_path}", "trainer.epochs=1", "model.width=4", "backend.accelerator=cpu"]
    run(run_config_from_dict(apply_overrides(base, sets)))
    changed = run_config_from_dict(apply_overrides(base, [*sets[:1], "trainer.epochs=2", "model.width=4",
                                                          "backend.accelerator=cpu", "optimizer.lr=0.5"]))
    with pytest.raises(ValueError, match=r"optimizer\.lr 0\.00\d+ -> 0\.5"):
        run(changed)


def test_every_trainer_and_checkpoint_setting_has_a_resume_rule():
    import dataclasses

    from xlatrain.config import CheckpointConfig
    from xlatrain.train.state import RESUME_RULES

    fields = {f"trainer.{f.name}" for f in dataclasses.fields(TrainConfig)}
    fields |= {f"checkpoint.{f.name}" for f in dataclasses.fields(CheckpointConfig)}
    assert fields - set(RESUME_RULES) == set(), "classify the new setting in RESUME_RULES"


def _killed(run_dir, when):
    """tests/scripts/killed_fit.py killed at ``when``: its exit status and status.json."""
    import json
    import signal
    import sys

    from conftest import SCRIPTS, run_bounded, script_env

    proc = run_bounded([sys.executable, str(SCRIPTS / "killed_fit.py"), str(run_dir), when], script_env(), 120, warm=True)
    return proc.returncode, json.loads((run_dir / "status.json").read_text()), signal.SIGKILL


def test_a_run_killed_before_its_first_checkpoint_is_started_over_by_the_same_command(tmp_path):
    """A kill -9 while the first epoch's end wrote its checkpoint (history and best weights already
    written) left a run the same command refused: 'an earlier run's results ... but no checkpoint',
    and status.json 'running' for ever, so a requeue on 'running' was refused each time."""
    from conftest import SCRIPTS, run_script

    run_dir = tmp_path / "run"
    code, status, kill = _killed(run_dir, "epoch-written")
    assert code == -kill and status["state"] == "running" and status["checkpoints"] is True, (code, status)
    assert (run_dir / "best.safetensors").exists() and not list((run_dir / "checkpoints").glob("step-*"))
    history = run_script([sys.executable, str(SCRIPTS / "killed_fit.py"), str(run_dir), "none"])
    assert [row["epoch"] for row in history] == [1, 2]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    # The same files left by a run that wrote no checkpoints (checkpoints off) are still refused.
    status_file = run_dir / "status.json"
    status_file.write_text(json.dumps({"state": "running", "checkpoints": False}))
    for path in (run_dir / "checkpoints").glob("step-*"):
        shutil.rmtree(path)
    from xlatrain.storage.lock import RunDirError

    with pytest.raises(RunDirError, match="holds an earlier run's results"):
        _trainer(run_dir, epochs=2, batch_size=8).fit(_data(32))


def test_a_run_killed_after_its_last_checkpoint_is_finished_on_the_rerun(tmp_path):
    """A kill in on_fit_end, after every epoch was checkpointed, left status.json 'running'; each
    rerun trained nothing and left it there, so a requeue on 'running' never ended."""
    from conftest import SCRIPTS, run_script

    run_dir = tmp_path / "run"
    code, status, kill = _killed(run_dir, "fit-end")
    assert code == -kill and status["state"] == "running", (code, status)
    (run_dir / ".history.json.abc123.tmp").write_text("[")  # a write a kill cut short
    history = run_script([sys.executable, str(SCRIPTS / "killed_fit.py"), str(run_dir), "none"])
    assert [row["epoch"] for row in history] == [1, 2]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["epochs"] == 2, status
    assert not list(run_dir.glob(".*.tmp"))


def test_a_failed_status_names_the_checkpoint_a_rerun_resumes_from(tmp_path):
    """A process that fails after a checkpoint (a peer killed, the collective broken) wrote
    'failed' without it, where the run resumes from it."""

    class Fail:
        def on_epoch_start(self, trainer, epoch):
            if epoch == 2:
                raise RuntimeError("a peer's collective broke")

    torch.manual_seed(0)
    trainer = xlatrain.Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                               config=xlatrain.TrainConfig(run_dir=str(tmp_path), epochs=2, batch_size=4),
                               backend="cpu", callbacks=[Fail()])
    with pytest.raises(RuntimeError, match="collective broke"):
        trainer.fit(_data())
    status = json.loads((tmp_path / "status.json").read_text())
    newest = max(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert status["state"] == "failed" and status["checkpoint"] == newest, status


def test_a_failure_after_the_last_checkpoint_is_finished_on_the_rerun(tmp_path):
    """'failed' names the checkpoint a rerun resumes from; where that checkpoint holds every epoch,
    the rerun trained nothing and left 'failed', and a requeue that follows it never ended."""

    class FailAtTheEnd:
        def on_epoch_end(self, trainer, row):
            if row["epoch"] == 2:
                raise RuntimeError("after the last checkpoint")

    def trainer(callbacks):
        torch.manual_seed(0)
        return xlatrain.Trainer(nn.Linear(4, 2), nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                                config=xlatrain.TrainConfig(run_dir=str(tmp_path), epochs=2, batch_size=4),
                                backend="cpu", callbacks=callbacks)
    with pytest.raises(RuntimeError, match="after the last checkpoint"):
        trainer([FailAtTheEnd()]).fit(_data())
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "failed"
    assert len(trainer([]).fit(_data())) == 2
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "finished"


def test_several_epochs_of_results_without_a_checkpoint_stay_refused_after_a_kill(tmp_path):
    """The start-over for a run killed in its first checkpoint's write is for one epoch's results:
    a run whose checkpoints come every N steps, past several epochs, keeps them (refused)."""
    from xlatrain.storage.lock import RunDirError

    first = _trainer(tmp_path, epochs=3, batch_size=8)
    first.fit(_data(32))
    for path in (tmp_path / "checkpoints").glob("step-*"):
        shutil.rmtree(path)
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "checkpoints": True}))  # as a kill leaves it
    with pytest.raises(RunDirError, match="holds an earlier run's results"):
        _trainer(tmp_path, epochs=3, batch_size=8).fit(_data(32))
    assert len(json.loads((tmp_path / "history.json").read_text())) == 3
