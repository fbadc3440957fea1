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
