import pytest

from xlatrain.config import BackendConfig, TrainConfig, from_dict


def test_batch_size_below_one_is_rejected_with_the_key_named():
    with pytest.raises(ValueError, match=r"batch_size=0 .*integer >= 1"):
        TrainConfig(batch_size=0)


def test_bool_is_not_an_integer():
    with pytest.raises(ValueError, match="epochs=True"):
        TrainConfig(epochs=True)


def test_bad_choices_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"precision='16' .*'32', 'bf16'"):
        TrainConfig(precision="16")
    with pytest.raises(ValueError, match=r"accelerator='gpu' .*'auto', 'tpu', 'xla', 'cuda', 'cpu'"):
        BackendConfig(accelerator="gpu")


def test_precision_given_as_a_number_is_normalised():
    assert TrainConfig(precision=32).precision == "32"


def test_clip_must_be_positive():
    with pytest.raises(ValueError, match="clip_grad_norm=-1"):
        TrainConfig(clip_grad_norm=-1)


def test_unknown_keys_are_named_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown TrainConfig key\(s\) batchsize: valid keys are .*batch_size"):
        from_dict(TrainConfig, {"batchsize": 3})
    assert from_dict(TrainConfig, {"batch_size": 3}).batch_size == 3


def test_configs_are_frozen():
    cfg = TrainConfig()
    with pytest.raises(AttributeError):
        cfg.epochs = 5  # type: ignore[misc]


# --- YAML: safe loading and clear errors ------------------------------------------------------
from xlatrain.config import CheckpointConfig, load_yaml  # noqa: E402


def test_yaml_unknown_key_wrong_type_and_range_name_key_value_and_choices():
    data = load_yaml("trainer:\n  epochs: 3\n  batchsize: 8\n")
    with pytest.raises(ValueError, match=r"unknown TrainConfig key\(s\) trainer.batchsize: valid keys are .*batch_size"):
        from_dict(TrainConfig, data["trainer"], section="trainer")
    with pytest.raises(ValueError, match=r"trainer.epochs='3' has the wrong type: expected int"):
        from_dict(TrainConfig, {"epochs": "3"}, section="trainer")
    with pytest.raises(ValueError, match=r"trainer.log_every=True has the wrong type"):
        from_dict(TrainConfig, {"log_every": True}, section="trainer")
    with pytest.raises(ValueError, match=r"checkpoint.keep_last=0 is not valid: it must be an integer >= 1"):
        from_dict(CheckpointConfig, {"keep_last": 0}, section="checkpoint")
    assert from_dict(TrainConfig, {"clip_grad_norm": 1}).clip_grad_norm == 1  # an int is a valid float


def test_yaml_with_tabs_is_a_clear_error():
    with pytest.raises(ValueError, match="not valid YAML .*spaces, not tabs"):
        load_yaml("trainer:\n\tepochs: 3\n")


def test_yaml_python_tags_are_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    text = f"trainer: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(ValueError, match="Python object tags are not allowed"):
        load_yaml(text)
    assert not marker.exists()


def test_yaml_with_a_key_given_twice_is_refused_naming_both_lines():
    """PyYAML keeps the last of two keys silently: `epochs: 1` then `epochs: 2` ran 2 epochs."""
    with pytest.raises(ValueError, match=r"run.yaml: 'epochs' is given twice in one mapping \(lines 3 and 4\): keep one"):
        load_yaml("recipe: digits\ntrainer:\n  epochs: 1\n  epochs: 2\n", source="run.yaml")
    assert load_yaml("a:\n  epochs: 1\nb:\n  epochs: 2\n") == {"a": {"epochs": 1}, "b": {"epochs": 2}}  # one per mapping
    # A merge key's keys may be given again: that is what overriding an anchor's values means.
    assert load_yaml("base: &b\n  lr: 1\n  wd: 0\nx:\n  <<: *b\n  lr: 3\n")["x"] == {"lr": 3, "wd": 0}


def test_a_set_under_a_key_that_holds_a_value_names_that_key_and_the_value():
    """`--set trainer=3 --set trainer.epochs=1` blamed the second, valid override as if trainer
    were never a section."""
    from xlatrain.config import ModelConfig, apply_overrides

    with pytest.raises(ValueError, match=r"--set 'trainer.epochs=1': trainer is 3, not a section of keys .*trainer.KEY=VALUE"):
        apply_overrides({}, ["trainer=3", "trainer.epochs=1"])
    assert apply_overrides({"trainer": {"epochs": 2}}, ["trainer.epochs=1"]) == {"trainer": {"epochs": 1}}
    with pytest.raises(ValueError, match=r"^model.blocks=\['a', 'b'\] is not valid: each stage's residual blocks must be an"):
        from_dict(ModelConfig, {"blocks": ["a", "b"]}, section="model")


def test_a_monitor_close_to_a_column_the_trainer_writes_is_named_beside_the_missing_direction():
    """monitor='val_acc' asked only for monitor_mode; the column meant was val_accuracy."""
    with pytest.raises(ValueError, match=r"needs monitor_mode: .*\(did you mean 'val_accuracy', a column the Trainer writes\?\)"):
        TrainConfig(monitor="val_acc")
    with pytest.raises(ValueError, match=r"have a known direction$"):
        TrainConfig(monitor="val_mae")  # a metric of the user's own: nothing to suggest
    with pytest.raises(ValueError, match=r"have a known direction$"):
        TrainConfig(monitor="train_acc")  # an epoch's training columns are its loss and terms: none is meant


def test_yaml_top_level_must_be_a_mapping():
    with pytest.raises(ValueError, match="top level must be a mapping"):
        load_yaml("- 1\n- 2\n")


def test_yaml_reads_a_rate_written_without_a_dot_as_the_float_it_is():
    # YAML 1.1 (PyYAML) wants 2.0e-3; a config file writes 2e-3, as --set does.
    data = load_yaml("optimizer:\n  lr: 2e-3\n  weight_decay: 1E-4\n  eps: 1.0e-8\nrun:\n  name: v1e3\n  tag: '2e-3'\n")
    assert data["optimizer"] == {"lr": 0.002, "weight_decay": 0.0001, "eps": 1e-8}
    assert data["run"] == {"name": "v1e3", "tag": "2e-3"}  # words and quoted strings stay strings


def test_a_run_dir_under_home_is_expanded_as_a_shell_would(monkeypatch, tmp_path):
    # A YAML value or a quoted --set made a folder named "~" in the working directory.
    monkeypatch.setenv("HOME", str(tmp_path))
    assert TrainConfig(run_dir="~/runs/dig").run_dir == str(tmp_path / "runs" / "dig")
    assert TrainConfig(run_dir="runs/~dig").run_dir == "runs/~dig"
