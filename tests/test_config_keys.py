"""Every config key takes effect or is an error that names it: one check per key.

Keys of the recipe sections (``data``, ``model``, ``optimizer``, ``schedule``) pass through recipe
code, where a key can be dropped on the way; each is checked here by building a run's parts with
the key at two values and comparing what was built (datasets, model, optimizer, learning rates),
or by the error that names it. Keys of ``trainer``, ``backend`` and ``checkpoint`` reach the
Trainer as the config object itself; each is checked where its behaviour lives, the test named in
``ELSEWHERE`` (asserted to exist), or by a small fit here. A new key without a check fails
``test_every_key_has_a_check``.
"""

import ast
import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from xlatrain import CheckpointConfig, TrainConfig, Trainer
from xlatrain.config import SECTIONS, apply_overrides, load_yaml, run_config_from_dict
from xlatrain.recipes.run import RECIPES, optimizer_factory, recipe_module, scheduler_factory

TESTS = Path(__file__).resolve().parent

# Keys whose effect is asserted by a test elsewhere (path relative to tests/, test function).
ELSEWHERE = {
    "trainer.epochs": ("train/test_resume_bookkeeping.py", "test_more_epochs_continue_and_say_which_keys_changed"),
    "trainer.batch_size": (
        "recipes/test_fit_cli.py", "test_pe_recipe_runs_unchanged_under_torchrun_with_the_same_global_batch"),
    "trainer.scale_lr": ("train/test_distributed.py", "test_scale_lr_multiplies_the_rate_by_the_process_count_under_torchrun"),
    "trainer.precision": ("train/test_trainer.py", "test_bf16_autocasts_the_forward_and_keeps_fp32_weights"),
    "trainer.grad_accum_steps": ("train/test_trainer.py", "test_grad_accumulation_equals_the_large_batch"),
    "trainer.clip_grad_norm": ("train/test_trainer.py", "test_clipping_bounds_the_update"),
    "trainer.log_every": ("test_tensorboard.py", "test_a_run_gives_each_tag_one_point_per_interval_and_per_epoch"),
    "trainer.seed": ("data/test_shards.py", "test_same_seed_same_order_different_epochs_and_seeds_differ"),
    "trainer.task": ("train/test_trainer.py", "test_multilabel_reports_per_label_auc_and_the_mean"),
    "trainer.monitor": ("train/test_trainer.py", "test_an_unknown_monitor_names_the_columns"),
    "trainer.monitor_mode": ("train/test_resume_bookkeeping.py", "test_a_minimised_custom_metric_keeps_the_lowest_epoch"),
    "trainer.scheduler_interval": ("train/test_trainer.py", "test_step_schedules_and_scale_lr_on_one_device_leave_the_rate"),
    "trainer.top_k": (
        "train/test_user_data_and_callbacks.py",
        "test_top_k_accuracy_is_reported_with_the_others_and_soft_targets_score_as_their_likeliest_class"),
    "trainer.ema_decay": (
        "train/test_user_data_and_callbacks.py",
        "test_the_ema_is_what_its_formula_gives_is_scored_beside_the_model_and_survives_resume"),
    "trainer.ema_every": (
        "train/test_user_data_and_callbacks.py",
        "test_the_ema_is_what_its_formula_gives_is_scored_beside_the_model_and_survives_resume"),
    "trainer.channels_last": (
        "train/test_user_data_and_callbacks.py",
        "test_channels_last_puts_the_model_and_the_image_batches_in_that_memory_order"),
    "trainer.ema_rule": ("train/test_ema_and_callbacks.py", "test_the_torchvision_rule_and_warm_up_give_the_reference_average"),
    "trainer.ema_warmup_epochs": (
        "train/test_ema_and_callbacks.py", "test_the_torchvision_rule_and_warm_up_give_the_reference_average"),
    "trainer.ema_bn_batches": (
        "train/test_ema_and_callbacks.py",
        "test_batch_norm_statistics_recomputed_for_the_ema_weights_score_them_as_update_bn_does"),
    "trainer.early_stop_patience": (
        "train/test_pipelines.py", "test_early_stopping_stops_at_the_expected_epoch_and_a_rerun_trains_nothing"),
    "trainer.save_best": ("train/test_pipelines.py", "test_save_best_false_writes_no_best_weights"),
    "trainer.nan_policy": ("train/test_resume.py", "test_nan_policy_skip_step_leaves_weights_finite_and_counts_the_loss_out"),
    "trainer.strict": ("diagnostics/test_run_diagnostics.py", "test_strict_raises_on_the_bad_loop_only"),
    "trainer.compile": ("train/test_compile.py", "test_a_compiled_fit_matches_the_eager_fit"),
    "trainer.tensorboard": ("test_tensorboard.py", "test_off_or_not_main_writes_nothing"),
    "trainer.profile_steps": ("train/test_observability.py", "test_profile_steps_trace_the_chosen_steps_and_change_no_number"),
    "trainer.run_dir": ("train/test_trainer.py", "test_fit_writes_history_and_best_weights_that_reproduce_the_best_epoch"),
    "backend.accelerator": ("train/test_pipelines.py", "test_accelerator_and_devices_on_the_trainer_match_the_yaml_spelling"),
    "backend.devices": ("train/test_distributed.py", "test_spmd_over_four_xla_cpu_devices_matches_one_cpu_device"),
    "backend.xla_mode": ("train/test_distributed.py", "test_one_process_per_device_mode_matches_one_cpu_device"),
    "backend.strategy": (
        "train/test_fsdp.py", "test_each_fsdp_process_holds_half_of_the_state_and_each_ddp_process_all_of_it"),
    "backend.units": ("backend/test_units.py", "test_activation_checkpointing_and_units_reach_the_model_through_the_config"),
    "backend.activation_checkpointing": (
        "backend/test_units.py", "test_activation_checkpointing_and_units_reach_the_model_through_the_config"),
    "backend.device_memory": (
        "train/test_perf.py", "test_a_model_that_cannot_fit_a_stated_device_is_refused_before_its_first_step"),
    "backend.tpu_runtime": (
        "backend/test_runtimes.py", "test_a_forced_runtime_that_cannot_run_names_what_each_found_and_how_to_install"),
    "checkpoint.every_steps": ("train/test_resume.py", "test_sigterm_mid_epoch_then_resume_is_bitwise_identical_on_cpu"),
    "checkpoint.keep_last": ("train/test_resume_bookkeeping.py", "test_the_best_checkpoint_survives_pruning_after_a_resume"),
    "model.width": ("recipes/test_model_keys.py", "test_width_changes_the_small_cnn_and_blocks_is_refused_for_it"),
    "model.blocks": ("recipes/test_model_keys.py", "test_width_and_blocks_change_the_resnet_unet"),
    "model.pretrained": ("recipes/test_fit_cli.py", "test_pretrained_true_is_refused_with_the_fix"),
}

# Keys checked in this file: key -> the test function here that changes it.
HERE = {
    "trainer.eval_batch_size": "test_eval_batch_size_sets_the_evaluation_batch",
    "trainer.num_workers": "test_num_workers_starts_loader_workers",
    "trainer.diagnostics": "test_diagnostics_false_writes_no_report",
    "backend.compile_cache": "test_compile_cache_false_sets_no_cache",
    "checkpoint.at_epoch_end": "test_checkpoint_enabled_and_at_epoch_end",
    "checkpoint.enabled": "test_checkpoint_enabled_and_at_epoch_end",
    "model.name": "test_a_recipe_key_changes_what_is_built",
    "optimizer.name": "test_a_recipe_key_changes_what_is_built",
    "optimizer.lr": "test_a_recipe_key_changes_what_is_built",
    "optimizer.weight_decay": "test_a_recipe_key_changes_what_is_built",
    "optimizer.momentum": "test_a_recipe_key_changes_what_is_built",
    "schedule.name": "test_a_recipe_key_changes_what_is_built",
    "schedule.step_size": "test_a_recipe_key_changes_what_is_built",
    "schedule.gamma": "test_a_recipe_key_changes_what_is_built",
    "model.layers": "test_a_recipe_key_changes_what_is_built",
    "model.heads": "test_a_recipe_key_changes_what_is_built",
    "model.positions": "test_a_recipe_key_changes_what_is_built",
    "schedule.warmup_steps": "test_a_recipe_key_changes_what_is_built",
    "schedule.min_lr_ratio": "test_a_recipe_key_changes_what_is_built",
    "optimizer.momentum (adam)": "test_keys_a_choice_does_not_use_are_refused",
    "schedule.step_size (cosine)": "test_keys_a_choice_does_not_use_are_refused",
}

# Recipe data keys: recipe -> key -> the test here.
DATA_KEYS = {
    "lm": {k: "test_a_recipe_key_changes_what_is_built" for k in ("context", "val_percent", "max_train_bytes", "max_val_bytes")},
    "digits": {k: "test_a_recipe_key_changes_what_is_built" for k in ("image_size", "val_fraction", "seed")},
    "depth_mask": {
        k: "test_a_recipe_key_changes_what_is_built"
        for k in ("num_train", "num_val", "image_size", "seed", "mask_weight", "depth_weight")
    },
    "pe_detection": {
        **{k: "test_a_recipe_key_changes_what_is_built" for k in (
            "num_studies", "slices_per_study", "stored_size", "image_size", "num_folds", "fold", "seed", "hflip",
            "rotate_degrees", "source")},
        **{k: "test_pe_generation_keys_are_not_silently_reused" for k in (
            "num_studies", "slices_per_study", "stored_size", "seed")},
        "root": "test_pe_data_lands_where_root_and_shards_say",
        "shards": "test_pe_data_lands_where_root_and_shards_say",
        "synthetic": "test_pe_synthetic_false_needs_real_data",
        "pack_workers": "test_pe_workers_change_speed_not_data",
        "cache_dir": "test_pe_cache_dir_keeps_the_shards_read_from_object_storage",
    },
}


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_every_key_has_a_check():
    here = _functions(Path(__file__))
    keys = {f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    covered = set(ELSEWHERE) | {k for k in HERE if " " not in k}
    assert keys - covered == set(), "config keys without a check: add one here or name the test in ELSEWHERE"
    assert covered - keys == set(), "checks for keys that no longer exist"
    for key, (path, name) in ELSEWHERE.items():
        assert name in _functions(TESTS / path), f"{key}: {path}::{name} does not exist"
    for key, name in HERE.items():
        assert name in here, f"{key}: {name} is not in this file"
    for recipe in RECIPES:
        data_cls = recipe_module(recipe).DataConfig
        fields = {f.name for f in dataclasses.fields(data_cls)}
        assert fields == set(DATA_KEYS[recipe]), f"{recipe}: data keys and their checks differ"
        assert set(DATA_KEYS[recipe].values()) <= here


# --- recipe sections: build twice, compare --------------------------------------------------

PE_BASE = (
    "data.num_studies=6", "data.slices_per_study=[4,5]", "data.stored_size=48", "data.image_size=32",
    "data.num_folds=3", "data.pack_workers=1", "trainer.num_workers=0",
)
BASE = {"digits": (), "depth_mask": ("data.num_train=8", "data.num_val=4", "data.image_size=32", "model.width=8",
                                     "model.blocks=[1,1,1,1]"), "pe_detection": PE_BASE,
        "lm": ("data.max_train_bytes=20000", "data.max_val_bytes=5000", "data.context=32", "model.width=32",
               "model.layers=1", "model.heads=2", "schedule.warmup_steps=2")}
CONFIG = {"digits": "configs/digits.yaml", "depth_mask": "configs/depth_mask.yaml", "pe_detection": "configs/pe_detection.yaml",
          "lm": "configs/lm.yaml"}


def _config(recipe, *sets):
    return run_config_from_dict(apply_overrides(load_yaml(Path(CONFIG[recipe]).read_text()), [*BASE[recipe], *sets]))


def _digest(t):
    if isinstance(t, (tuple, list)):
        return "".join(_digest(x) for x in t)
    if isinstance(t, dict):
        return "".join(_digest(t[k]) for k in sorted(t))
    return hashlib.sha1(torch.as_tensor(t).float().contiguous().numpy().tobytes()).hexdigest()[:12]


def _first_train_batch(data):
    from xlatrain.data.source import BatchSource

    if isinstance(data, BatchSource):
        return next(iter(data.train_batches(
            loader_batch=4, num_processes=1, process_index=0, seed=0, epoch=0)))
    return data[0]


def _built(recipe, root, *sets):
    """What a config builds, as comparable values: data, model, loss, optimizer and its rates."""
    config = _config(recipe, f"data.root={root}" if recipe == "pe_detection" else "trainer.seed=0", *sets)
    parts = recipe_module(recipe).build(config)
    train_x, train_y = _first_train_batch(parts.train_data)
    val_item = parts.val_data[0] if not hasattr(parts.val_data, "eval_batches") else next(
        iter(parts.val_data.eval_batches(loader_batch=4, num_processes=1, process_index=0)))[0]
    optimizer = optimizer_factory(config.optimizer)(parts.model.parameters())
    make_schedule = scheduler_factory(config.schedule, config.trainer.epochs)
    if config.schedule.name == "warmup_cosine":  # it needs the run's length in optimizer steps
        from xlatrain import RunShape

        schedule = make_schedule(optimizer, RunShape(total_steps=8, steps_per_epoch=8, epochs=1))
    else:
        schedule = make_schedule(optimizer) if make_schedule else None
    rates = []
    for _ in range(4):
        rates.append(round(optimizer.param_groups[0]["lr"], 8))
        if schedule is not None:
            optimizer.step()
            schedule.step()
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    for data in (parts.train_data, parts.val_data):  # no reader left fetching once a test's storage is gone
        if hasattr(data, "close"):
            data.close()
    out = {
        "sizes": (len(parts.train_data), len(parts.val_data)),
        "train": (tuple(train_x.shape), _digest(train_x), _digest(train_y)),
        "val": _digest(val_item[0]) + _digest(val_item[1]),
        "model": (type(parts.model).__name__, [tuple(p.shape) for p in parts.model.parameters()]),
        "optimizer": (type(optimizer).__name__, json.dumps(group, sort_keys=True, default=str)),
        "rates": rates,
    }
    if recipe == "lm":  # heads change no parameter's shape, but what the model computes
        out["output"] = _digest(parts.model(train_x[None]).detach())
    if recipe == "depth_mask":
        torch.manual_seed(0)
        outputs = parts.model(train_x[None])
        targets = tuple(t[None] for t in train_y) if isinstance(train_y, (tuple, list)) else train_y[None]
        out["loss"] = round(float(torch.as_tensor(_total(parts.loss_fn(outputs, targets))).mean()), 6)
    return out


def _total(loss):
    return loss["loss"] if isinstance(loss, dict) else loss


CHANGES = [
    # (recipe, key=value A, key=value B)
    ("digits", "data.image_size=32", "data.image_size=16"),
    ("digits", "data.val_fraction=0.2", "data.val_fraction=0.3"),
    ("digits", "data.seed=0", "data.seed=1"),
    ("digits", "model.name=small_cnn", "model.name=resnet18"),
    ("digits", "optimizer.name=adam", "optimizer.name=sgd"),
    ("digits", "optimizer.lr=0.001", "optimizer.lr=0.01"),
    ("digits", "optimizer.weight_decay=0", "optimizer.weight_decay=0.1"),
    ("digits", "optimizer.momentum=0.9", "optimizer.momentum=0.5"),  # with optimizer.name=sgd, below
    ("digits", "schedule.name=none", "schedule.name=cosine"),
    ("digits", "schedule.step_size=1", "schedule.step_size=2"),
    ("digits", "schedule.gamma=0.5", "schedule.gamma=0.1"),
    ("depth_mask", "data.num_train=8", "data.num_train=12"),
    ("depth_mask", "data.num_val=4", "data.num_val=6"),
    ("depth_mask", "data.image_size=32", "data.image_size=64"),
    ("depth_mask", "data.seed=0", "data.seed=1"),
    ("depth_mask", "data.mask_weight=1.0", "data.mask_weight=2.0"),
    ("depth_mask", "data.depth_weight=1.0", "data.depth_weight=2.0"),
    ("pe_detection", "data.num_studies=6", "data.num_studies=7"),
    ("pe_detection", "data.slices_per_study=[4,5]", "data.slices_per_study=[5,6]"),
    ("pe_detection", "data.stored_size=48", "data.stored_size=40"),
    ("pe_detection", "data.seed=0", "data.seed=1"),
    ("pe_detection", "data.image_size=32", "data.image_size=24"),
    ("pe_detection", "data.num_folds=3", "data.num_folds=2"),
    ("pe_detection", "data.fold=0", "data.fold=1"),
    ("pe_detection", "data.hflip=0.0", "data.hflip=1.0"),
    ("pe_detection", "data.rotate_degrees=0", "data.rotate_degrees=30"),
    ("pe_detection", "data.source=shards", "data.source=folder"),
    ("lm", "data.context=32", "data.context=48"),
    ("lm", "data.val_percent=5", "data.val_percent=50"),
    ("lm", "data.max_train_bytes=20000", "data.max_train_bytes=24000"),
    ("lm", "data.max_val_bytes=5000", "data.max_val_bytes=6000"),
    ("lm", "model.layers=1", "model.layers=2"),
    ("lm", "model.heads=2", "model.heads=4"),
    ("lm", "model.positions=rotary", "model.positions=learned"),
    ("lm", "schedule.warmup_steps=2", "schedule.warmup_steps=3"),
    ("lm", "schedule.min_lr_ratio=0.1", "schedule.min_lr_ratio=0.5"),
]
NEEDS = {  # settings a change needs so that the key applies at all
    # digits.yaml sets step_size and gamma, which only a step schedule takes
    "schedule.name": ("schedule.step_size=null", "schedule.gamma=null"),
    "schedule.gamma": ("schedule.name=step", "schedule.step_size=1"),
    # digits.yaml sets model.width, which resnet18 does not take
    "model.name": ("model.width=null",),
    "optimizer.momentum": ("optimizer.name=sgd",),
    "schedule.step_size": ("schedule.name=step",),
}
# Generation keys make another dataset: each side generates its own folder.
OWN_ROOT = {"data.num_studies", "data.slices_per_study", "data.stored_size", "data.seed"}


@pytest.mark.parametrize("recipe,a,b", CHANGES, ids=[f"{r}:{a.split('=')[0]}" for r, a, _ in CHANGES])
def test_a_recipe_key_changes_what_is_built(recipe, a, b, tmp_path):
    key = a.split("=")[0]
    extra = NEEDS.get(key, ())
    if recipe == "pe_detection" and key in ("data.hflip", "data.rotate_degrees"):
        extra = ("data.hflip=0.0", "data.rotate_degrees=0")  # one augmentation at a time
    root_a = tmp_path / "a"
    root_b = tmp_path / "b" if key in OWN_ROOT else root_a
    built_a = _built(recipe, root_a, *extra, a)
    built_b = _built(recipe, root_b, *extra, b)
    assert built_a != built_b, f"{key} changed nothing that was built"


def test_keys_a_choice_does_not_use_are_refused():
    with pytest.raises(ValueError, match=r"optimizer\.momentum is set but adam takes no momentum.*optimizer\.name: sgd"):
        _config("digits", "optimizer.name=adam", "optimizer.momentum=0.5")
    with pytest.raises(ValueError, match=r"schedule\.step_size is set but schedule\.name='cosine' does not use it"):
        _config("digits", "schedule.name=cosine", "schedule.step_size=2")
    with pytest.raises(ValueError, match=r"^schedule\.gamma is set but schedule\.name='none'"):
        _config("digits", "schedule.name=none", "schedule.step_size=null", "schedule.gamma=0.1")


@pytest.mark.parametrize("value", ["5", "[4,6,8]", "[a,b]", "[6,4]"])
def test_pe_slices_per_study_of_another_shape_is_refused_as_the_config_is_read(value):
    """A number, three values or words reached the generator: a TypeError traceback, or a message
    naming no key, once generation began."""
    from xlatrain.config import from_dict

    config = _config("pe_detection", f"data.slices_per_study={value}")
    with pytest.raises(ValueError, match=r"^data.slices_per_study=.* is not valid: give the fewest and the most"):
        from_dict(recipe_module("pe_detection").DataConfig, config.data, section="data")


def test_a_cosine_stepped_every_optimizer_step_anneals_once_over_the_whole_run(tmp_path):
    """Per step, a period of ``epochs`` steps rose and fell again every few steps (a sawtooth)."""
    from xlatrain.recipes.run import build_trainer

    config = _config("depth_mask", "schedule.name=cosine", "trainer.scheduler_interval=step", "trainer.epochs=3",
                     "trainer.batch_size=4", "trainer.log_every=1", "trainer.tensorboard=false",
                     f"trainer.run_dir={tmp_path / 'run'}")
    trainer, parts = build_trainer(config)
    rates = []  # the rate each optimizer step used
    trainer.optimizer.register_step_post_hook(lambda opt, *_: rates.append(opt.param_groups[0]["lr"]))
    trainer.fit(parts.train_data, parts.val_data)
    assert len(rates) == 6  # 8 samples in batches of 4, 3 epochs
    assert all(b < a for a, b in zip(rates, rates[1:])), rates  # falling at every step, never rising again
    assert trainer.scheduler.T_max == 6 and trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_a_warmup_that_covers_the_whole_run_is_said(tmp_path, caplog):
    import logging

    from xlatrain.recipes.run import build_trainer

    caplog.set_level(logging.INFO, logger="xlatrain")
    for warmup, run in ((100000, "long"), (2, "short")):
        config = _config("lm", f"schedule.warmup_steps={warmup}", "trainer.epochs=1", "trainer.tensorboard=false",
                         f"trainer.run_dir={tmp_path / run}")
        trainer, parts = build_trainer(config)
        trainer.fit(parts.train_data, parts.val_data)
        total = trainer.run_shape.total_steps
        said = f"schedule.warmup_steps={warmup} covers the whole run ({total} optimizer steps): the rate rises at " \
               f"every step, to {100 * total / warmup:.3g}% of optimizer.lr, and never anneals"
        assert (said in caplog.text) is (warmup >= total), (warmup, total)
        if warmup >= total:  # a share that reads as one, not "0%"
            assert re.search(r"to 0\.0\d+% of optimizer\.lr", caplog.text), caplog.text
        caplog.clear()


def test_a_step_interval_with_no_schedule_is_refused_as_the_config_is_read():
    with pytest.raises(ValueError, match=r"trainer\.scheduler_interval: step .* schedule\.name is none: name one"):
        _config("digits", "schedule.name=none", "schedule.step_size=null", "schedule.gamma=null",
                "trainer.scheduler_interval=step")


def test_a_step_schedule_stepped_every_optimizer_step_needs_its_step_size():
    with pytest.raises(ValueError, match=r"would halve it at every step: set schedule\.step_size .* or schedule\.gamma"):
        _config("digits", "schedule.name=step", "schedule.step_size=null", "schedule.gamma=null",
                "trainer.scheduler_interval=step")
    assert _config("digits", "schedule.name=step", "schedule.step_size=100", "schedule.gamma=null",
                   "trainer.scheduler_interval=step")
    # A decay by gamma at every step is a schedule of its own (exponential), not the slip refused.
    assert _config("digits", "schedule.name=step", "schedule.step_size=null", "schedule.gamma=0.999",
                   "trainer.scheduler_interval=step")


def test_pe_generation_keys_are_not_silently_reused(tmp_path):
    """A folder generated from other values is an error naming them, never data of another shape."""
    _built("pe_detection", tmp_path, "data.num_studies=6")
    for change, old in (("data.num_studies=7", "data.num_studies=6"), ("data.seed=3", "data.seed=0"),
                        ("data.stored_size=40", "data.stored_size=48"),
                        ("data.slices_per_study=[5,6]", "data.slices_per_study=[4, 5]")):
        pattern = f"was generated with {re.escape(old)}; this config asks for {re.escape(change.split('=')[0])}="
        with pytest.raises(ValueError, match=pattern + ".*delete .* to generate it again"):
            _built("pe_detection", tmp_path, change)


def test_pe_data_lands_where_root_and_shards_say(tmp_path):
    _built("pe_detection", tmp_path / "data", f"data.shards={tmp_path / 'packed'}")
    assert (tmp_path / "data" / "train.csv").is_file()
    assert (tmp_path / "packed" / "manifest.json").is_file()
    assert not (tmp_path / "data" / "shards").exists()


def test_pe_synthetic_false_needs_real_data(tmp_path):
    with pytest.raises(ValueError, match=r"train\.csv does not exist: point data\.root at an RSNA-layout folder"):
        _built("pe_detection", tmp_path / "empty", "data.synthetic=false")
    assert not (tmp_path / "empty" / "train.csv").exists()


def test_pe_workers_change_speed_not_data(tmp_path):
    """``data.pack_workers`` is how many processes generate and pack: the files are the same either way."""
    _built("pe_detection", tmp_path / "one", "data.pack_workers=1")
    _built("pe_detection", tmp_path / "two", "data.pack_workers=2")
    for name in ("train.csv", "shards/manifest.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


@pytest.mark.object_store
def test_pe_cache_dir_keeps_the_shards_read_from_object_storage(tmp_path):
    from xlatrain.storage.emulator import LocalGCS

    with LocalGCS(bucket="keys"):
        cached = _built("pe_detection", tmp_path / "data", "data.shards=gs://keys/pe",
                        f"data.cache_dir={tmp_path / 'cache'}")
        direct = _built("pe_detection", tmp_path / "data", "data.shards=gs://keys/pe")
    assert cached == direct  # the same data either way
    assert any((tmp_path / "cache").rglob("*.xshard")) and not (tmp_path / "data" / "shards").exists()


# --- trainer / backend / checkpoint keys without a test of their own elsewhere ----------------


class _Recorded(nn.Module):
    """A linear model that records the batch sizes it saw in evaluation."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.eval_rows = []

    def forward(self, x):
        if not self.training:
            self.eval_rows.append(x.shape[0])
        return self.linear(x)


def _pairs(n=40):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def _fit(tmp_path, model=None, train=None, checkpoint=None, **cfg):
    cfg = {"epochs": 2, "batch_size": 8, "log_every": 100, "run_dir": str(tmp_path / "run"), **cfg}
    trainer = Trainer(
        model or _Recorded(), nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.1),
        config=TrainConfig(**cfg), checkpoint=checkpoint or CheckpointConfig(), backend="cpu",
    )
    trainer.fit(train or _pairs(), _pairs(20))
    return trainer


def test_eval_batch_size_sets_the_evaluation_batch(tmp_path):
    default, own = _Recorded(), _Recorded()
    _fit(tmp_path / "a", model=default, epochs=1)
    _fit(tmp_path / "b", model=own, epochs=1, eval_batch_size=5)
    # 20 validation rows: three batches of the training batch size (the last one padded), or four
    # of 5. The dry run before training adds a batch of 2 rows of its own to each, and one
    # evaluation batch (its first rows, padded to a whole batch, through evaluation's own path).
    assert default.eval_rows.count(8) == 3 + 1 and 5 not in default.eval_rows
    assert own.eval_rows.count(5) == 4 + 1 and 8 not in own.eval_rows


class _WhoLoads(Dataset):
    """Leaves a file named after the process that loaded each item (any start method)."""

    def __init__(self, base, folder):
        self.base, self.folder = base, folder

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        (self.folder / str(os.getpid())).touch()
        return self.base[i]


def test_num_workers_starts_loader_workers(tmp_path):
    for workers in (0, 2):
        seen = tmp_path / f"pids-{workers}"
        seen.mkdir()
        _fit(tmp_path / str(workers), train=_WhoLoads(_pairs(), seen), epochs=1, num_workers=workers)
        others = {p.name for p in seen.iterdir()} - {str(os.getpid())}
        # the dry run before training reads one batch in this process; the epoch, the workers
        assert len(others) == workers


def test_num_workers_reaches_the_pe_shard_reader(tmp_path):
    """The PE recipe's shard reader decodes in ``trainer.num_workers`` processes of its own."""
    import multiprocessing

    for workers in (0, 2):
        config = _config("pe_detection", f"data.root={tmp_path}", f"trainer.num_workers={workers}")
        train = recipe_module("pe_detection").build(config).train_data
        assert train.options.num_workers == workers
        before = set(multiprocessing.active_children())
        next(iter(train.train_batches(loader_batch=4, num_processes=1, process_index=0, seed=0, epoch=0)))
        started = [p for p in set(multiprocessing.active_children()) - before if p.name.startswith("xlatrain-shards")]
        assert len(started) == workers
        train.close()


def test_diagnostics_false_writes_no_report(tmp_path):
    _fit(tmp_path / "on", epochs=1)
    _fit(tmp_path / "off", epochs=1, diagnostics=False)
    assert (tmp_path / "on" / "run" / "diagnostics.json").is_file()
    assert not (tmp_path / "off" / "run" / "diagnostics.json").exists()


def test_compile_cache_false_sets_no_cache(tmp_path):
    from xlatrain.backend.hardware import torch_tpu_cache_env

    env_on, env_off = {"XLATRAIN_CACHE_DIR": str(tmp_path)}, {"XLATRAIN_CACHE_DIR": str(tmp_path)}
    torch_tpu_cache_env(True, env_on)
    torch_tpu_cache_env(False, env_off)
    assert env_on["TORCH_TPU_TIER2_COMPILATION_CACHE"] == "xlatrain"
    assert env_on["TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"] == str(tmp_path.parent / "torch_tpu")
    assert env_off["TORCH_TPU_TIER2_COMPILATION_CACHE"] == "disabled"
    assert "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT" not in env_off


def test_checkpoint_enabled_and_at_epoch_end(tmp_path):
    def saved(name, **ckpt):
        _fit(tmp_path / name, checkpoint=CheckpointConfig(**ckpt))
        folder = tmp_path / name / "run" / "checkpoints"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    assert len(saved("default")) == 2  # one per epoch (5 steps each)
    assert saved("steps_only", at_epoch_end=False, every_steps=4) == ["step-00000004", "step-00000008"]
    assert saved("off", enabled=False) == []
