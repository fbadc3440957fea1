"""The PE recipe's rotation: by the shard reader (PIL, in the decode workers) on a CPU, TorchTPU
or XLA; by the model, on the device, where the run trains on CUDA; the same rotation either way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from xlatrain.recipes.pe_detection.recipe import SliceClassifier, rotate_by


@pytest.mark.parametrize("degrees", [7.0, -25.0])
def test_the_device_rotation_is_the_readers_pil_rotation(degrees):
    image = np.zeros((64, 80), np.uint8)  # not square: the aspect ratio must not skew it
    image[10:30, 20:60], image[40:50, 5:15] = 200, 120
    pil = np.asarray(Image.fromarray(image).rotate(degrees, resample=Image.Resampling.BILINEAR, fillcolor=0))
    ours = rotate_by(torch.from_numpy(image)[None, None], torch.tensor([degrees]))[0, 0].numpy()
    assert np.abs(pil.astype(float) - ours).mean() < 0.1
    other_way = rotate_by(torch.from_numpy(image)[None, None], torch.tensor([-degrees]))[0, 0].numpy()
    assert np.abs(pil.astype(float) - other_way).mean() > 5  # the comparison can tell a wrong direction


def test_the_model_rotates_training_batches_only_and_as_the_seed_says():
    seen = []

    class Backbone(torch.nn.Module):
        def forward(self, x):
            seen.append(x.clone())
            return x.mean((1, 2, 3))

    model = SliceClassifier(Backbone(), rotate_degrees=10.0)
    images = torch.randint(0, 255, (4, 1, 32, 32), dtype=torch.uint8)
    for _ in range(2):
        torch.manual_seed(3)
        model.train()(images)
    model.eval()(images)
    assert torch.equal(seen[0], seen[1])  # the same seed draws the same angles
    assert not torch.allclose(seen[0], seen[2])  # training batches rotated, evaluation's not
    assert torch.allclose(seen[2], (images.float() / 255 - 0.25) / 0.25)


def test_on_cuda_the_recipe_rotates_in_the_model_and_elsewhere_in_the_reader(tmp_path):
    from xlatrain.config import load_run_config
    from xlatrain.recipes.pe_detection.recipe import build

    overrides = ["model.name=small_cnn", "model.width=4", "data.num_studies=4", "data.slices_per_study=[3,4]",
                 "data.num_folds=2", "data.pack_workers=1", "data.stored_size=32", "data.image_size=32",
                 f"data.root={tmp_path}/data"]
    for accelerator, model_rotates in (("cuda", 10.0), ("cpu", 0.0)):
        config = load_run_config(str(Path(__file__).resolve().parents[2] / "configs" / "pe_detection.yaml"), [*overrides, f"backend.accelerator={accelerator}"])
        parts = build(config)
        assert parts.model.rotate_degrees == model_rotates
        assert parts.train_data.options.augment.rotate_degrees == 10.0 - model_rotates
        parts.train_data.close()
