"""`xlatrain report`: one run's report, and several runs compared side by side."""

import functools
import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import TensorDataset

from xlatrain import CheckpointConfig, TrainConfig, Trainer
from xlatrain.cli import main
from xlatrain.diagnostics.profile import StepTrace
from xlatrain.report import read_run_config, write_comparison

CONFIGS = Path(__file__).parents[1] / "configs"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, ((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()) % 3)


def _run(run_dir, lr):
    """Two epochs of a small MLP; the optimizer is recorded as a Python user records it: run_config."""
    torch.manual_seed(0)
    trainer = Trainer(
        nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)),
        nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=lr),
        config=TrainConfig(epochs=2, batch_size=16, log_every=1000, run_dir=str(run_dir)),
        checkpoint=CheckpointConfig(),
        backend="cpu",
        run_config={"optimizer": {"name": "sgd", "lr": lr}},
    )
    return trainer.fit(_data(160, 0), _data(48, 1))


def _assert_drawn(path):
    """The PNG opens and holds curves: axes, grid and text are grey; only the runs' lines are coloured."""
    with Image.open(path) as image:
        image.load()
        assert image.size[0] >= 800
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    coloured = sum(n for n, (r, g, b) in colours if max(r, g, b) - min(r, g, b) > 80)
    assert coloured > 500, f"{path} has no curves ({coloured} coloured pixels)"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    histories = {lr: _run(root / f"lr-{lr}", lr) for lr in (0.2, 0.01)}
    return root, histories


def test_two_runs_overlay_on_shared_axes_with_a_table_naming_the_differing_config_key(two_runs, capsys):
    root, histories = two_runs
    a, b = root / "lr-0.2", root / "lr-0.01"
    assert main(["report", str(a), str(b)]) == 0
    out = a / "report" / "compare"
    assert f"wrote {out}" in capsys.readouterr().out
    for name in ("loss.png", "metric.png", "lr.png", "epoch_time.png"):
        _assert_drawn(out / name)

    record = json.loads((out / "comparison.json").read_text())
    assert record["differing"] == {"optimizer.lr": [0.2, 0.01]}  # run_dir differs too, and is not listed
    labels = [run["label"] for run in record["runs"]]
    assert labels == ["lr-0.2 (optimizer.lr=0.2)", "lr-0.01 (optimizer.lr=0.01)"]
    for run, lr in zip(record["runs"], (0.2, 0.01)):
        history = histories[lr]
        best = max(history, key=lambda r: r["val_accuracy"])
        assert run["monitor"] == "val_accuracy" and run["best"] == best["val_accuracy"] and run["epochs"] == 2
        assert run["total_time_s"] == pytest.approx(sum(r["epoch_time_s"] for r in history), abs=1e-3)
        assert run["config_source"].startswith("checkpoints/step-")

    summary = (out / "summary.md").read_text()
    assert "The runs differ in: `optimizer.lr`." in summary
    assert "| key | lr-0.2 | lr-0.01 |" in summary and "| `optimizer.lr` | 0.2 | 0.01 |" in summary
    assert "| run | epochs | best val_accuracy (max) | best val_loss | last train_loss |" in summary
    best = max(histories[0.2], key=lambda r: r["val_accuracy"])
    assert f"| lr-0.2 (optimizer.lr=0.2) | 2 | {best['val_accuracy']:.4f} (epoch {best['epoch']}) |" in summary


def test_one_run_keeps_its_own_report_with_its_profile_and_out_moves_a_comparison(two_runs, tmp_path):
    root, _ = two_runs
    run = root / "lr-0.2"
    trace = StepTrace(run, (2, 3), trace_kind="torch", is_main=True)
    model, x = nn.Linear(6, 3), torch.randn(16, 6)
    for step in range(1, 4):
        trace.before_step(step)
        model(x).square().mean().backward()
        trace.after_step(step, input_wait_s=0.0)
    trace.close()
    assert main(["report", str(run)]) == 0
    summary = (run / "report" / "summary.md").read_text()
    assert "best epoch" in summary and "## Profile of training steps 2-3 (cpu)" in summary
    assert "lr at the epoch's start 0.2," in summary  # the rate's own digits, named for when it was read
    assert "### Top ops (CPU ops, self time" in summary and "| `aten::addmm` |" in summary
    assert "- trace: `../profile/trace.pt.trace.json`" in summary
    assert main(["report", str(root / "lr-0.01"), str(root / "lr-0.2"), "--out", str(tmp_path / "cmp")]) == 0
    record = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert [r["name"] for r in record["runs"]] == ["lr-0.01", "lr-0.2"]


def test_bad_report_arguments_are_errors_with_the_fix(two_runs, tmp_path, capsys):
    root, _ = two_runs
    assert main(["report", str(root / "lr-0.2"), str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xlatrain: error: no history at") and "nothing a run directory?" in err
    with pytest.raises(ValueError, match="given twice"):
        write_comparison([root / "lr-0.2", root / "lr-0.2" / "."])


def test_runs_from_config_files_are_told_apart_by_every_key_that_differs_and_named_by_path(tmp_path):
    tiny = ["trainer.epochs=2", "data.image_size=16", "trainer.log_every=1000", "backend.accelerator=cpu"]
    for name, sets in (("a", ["optimizer.lr=0.003", "model.width=8"]), ("b", ["optimizer.lr=0.001", "model.width=4"])):
        run_dir = tmp_path / name / "run"
        assert main(["fit", str(CONFIGS / "digits.yaml"), *[f"--set={s}" for s in (*tiny, *sets)],
                     f"--set=trainer.run_dir={run_dir}"]) == 0
    config, source = read_run_config(tmp_path / "a" / "run")
    # config.yaml holds the sections the recipe resolved; the checkpoint adds what the Trainer measured.
    assert source.endswith("+ config.yaml") and config["recipe"] == "digits" and "num_train_samples" in config["run"]

    out = write_comparison([tmp_path / "a" / "run", tmp_path / "b" / "run"])
    record = json.loads((out / "comparison.json").read_text())
    assert record["differing"] == {"model.width": [8, 4], "optimizer.lr": [0.003, 0.001]}
    assert record["runs"][0]["label"] == "a/run (model.width=8, optimizer.lr=0.003)"
    for name in record["plots"]:
        _assert_drawn(out / name)
    assert "| `model.width` | 8 | 4 |" in (out / "summary.md").read_text()

    # A key only one run's config.yaml names (the other took its recipe's default, which its files
    # do not say) is listed apart, not as a difference.
    import yaml

    path = tmp_path / "b" / "run" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    assert config["data"] == {"image_size": 16}
    config["data"] = {}  # b's data section as if nothing had been set: an empty section records nothing
    path.write_text(yaml.safe_dump(config))
    for meta in (tmp_path / "b" / "run" / "checkpoints").glob("*/meta.json"):  # the checkpoints record it too
        record = json.loads(meta.read_text())
        record["config"]["data"] = {}
        record["config"].pop("defaults")  # as an older xlatrain recorded it
        meta.write_text(json.dumps(record))
    out = write_comparison([tmp_path / "a" / "run", tmp_path / "b" / "run"], out_dir=tmp_path / "partly")
    record, summary = json.loads((out / "comparison.json").read_text()), (out / "summary.md").read_text()
    assert record["differing"] == {"model.width": [8, 4], "optimizer.lr": [0.003, 0.001]}
    # a's checkpoint records its data section with the recipe's defaults filled in: each key is a's alone.
    some = record["recorded_by_some"]
    assert some["data.image_size"] == [16, None] and all(k.startswith("data.") and v[1] is None for k, v in some.items())
    assert not any(k.startswith("defaults.") for k in (*record["differing"], *some))
    assert "Recorded by only some runs" in summary and "| `data.image_size` | 16 | not recorded |" in summary
    assert "data.image_size" not in record["runs"][0]["label"]


def test_the_reports_memory_figures_are_the_headers_plan_and_the_estimate_beside_it():
    from xlatrain.report import _memory_and_throughput

    memory = {"parameters": 4_000_000, "gradients": 4_000_000, "optimizer": 8_000_000, "activations": 30_000_000,
              "batch_per_device": 64, "gathered": 0, "estimate": 46_000_000, "capacity": None}
    estimated = _memory_and_throughput({"memory": {**memory, "measured_step": None, "plan": 46_000_000}}, {})
    assert [ln for ln in estimated if "planned" in ln] == []
    assert any(ln.startswith("- memory per device, estimated before the first step: 46.0 MB") for ln in estimated)
    # On CUDA the header's plan is one measured forward and backward plus the optimizer's state.
    measured = _memory_and_throughput({"memory": {**memory, "measured_step": 60_000_000, "plan": 68_000_000}}, {})
    assert measured[3] == ("- memory per device, planned before the first step: 68.0 MB (one forward and backward at "
                           "batch 64 measured 60.0 MB, optimizer state 8.0 MB)")
    assert measured[4].startswith("- memory per device, estimated before the first step: 46.0 MB")


def test_xla_compilations_are_reported_as_each_epochs_own(tmp_path):
    from xlatrain.report import write_history, write_report

    # The history holds each epoch's count: a resumed run's first epoch (here the third) compiles again.
    rows = [{"epoch": e, "train_loss": 1.0 / e, "epoch_time_s": 1.0, "xla_compilations": c}
            for e, c in ((1, 7), (2, 0), (3, 9))]
    write_history(tmp_path, rows)
    summary = (write_report(tmp_path) / "summary.md").read_text()
    assert ("- XLA compilations per epoch: 7, 0, 9 (7 in epoch 1, where the fit started and compiled its graphs; "
            "9 in the other epochs)") in summary


def test_the_compilations_of_a_resumed_runs_first_epoch_are_said_as_its_warm_up(tmp_path):
    from xlatrain.report import write_history, write_report

    # Epoch 2 started a resumed process (its first steps were timed apart): its 7 graphs are that
    # process's warm-up, not recompilations after epoch 1.
    rows = [{"epoch": e, "train_loss": 1.0 / e, "epoch_time_s": 1.0, "xla_compilations": c,
             **({"warmup_s": 1.5} if e in (1, 2) else {})} for e, c in ((1, 7), (2, 7), (3, 0), (4, 0))]
    write_history(tmp_path, rows)
    summary = (write_report(tmp_path) / "summary.md").read_text()
    assert ("- XLA compilations per epoch: 7, 7, 0, 0 (7 in epoch 1 and 7 in epoch 2, where a fit started (the first, "
            "or a resumed one) and compiled its graphs; 0 in the other epochs)") in summary, summary
