"""The model section of a config: every key changes the model built, or is an error naming it."""

import pytest

from xlatrain.config import apply_overrides, load_yaml, run_config_from_dict
from xlatrain.recipes.run import build_recipe_model


def _config(recipe_yaml, *sets):
    return run_config_from_dict(apply_overrides(load_yaml(open(recipe_yaml).read()), list(sets)))


def _params(model):
    return sum(p.numel() for p in model.parameters())


def test_width_changes_the_small_cnn_and_blocks_is_refused_for_it():
    narrow = build_recipe_model(_config("configs/digits.yaml", "model.width=4"), num_outputs=10, in_channels=1)
    wide = build_recipe_model(_config("configs/digits.yaml", "model.width=16"), num_outputs=10, in_channels=1)
    assert _params(narrow) < _params(wide)
    with pytest.raises(ValueError, match=r"model\.blocks is set but small_cnn has no such option: it takes model\.width"):
        build_recipe_model(_config("configs/digits.yaml", "model.blocks=[1,1,1,1]"), num_outputs=10, in_channels=1)


def test_width_and_blocks_change_the_resnet_unet():
    base = _config("configs/depth_mask.yaml", "model.width=8", "model.blocks=[1,1,1,1]")
    deeper = _config("configs/depth_mask.yaml", "model.width=8", "model.blocks=[2,1,1,1]")
    assert _params(build_recipe_model(base, num_outputs=1, in_channels=1)) < _params(
        build_recipe_model(deeper, num_outputs=1, in_channels=1))


@pytest.mark.parametrize("key", ["model.width=8", "model.blocks=[1,1,1,1]"])
def test_a_torchvision_model_refuses_shape_keys_it_has_not(key):
    with pytest.raises(ValueError, match=r"resnet18 has no such option: it takes neither width nor blocks"):
        build_recipe_model(_config("configs/pe_detection.yaml", key), num_outputs=10, in_channels=1)


def test_a_recipe_refuses_a_model_it_does_not_build():
    from xlatrain.recipes.depth_mask.recipe import build

    with pytest.raises(ValueError, match=r"model\.name='resnet18': the depth_mask recipe builds resnet_unet"):
        build(_config("configs/depth_mask.yaml", "model.name=resnet18", "data.num_train=16", "data.num_val=8"))
