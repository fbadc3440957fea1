"""The PE recipe's folder source: data.hflip and data.rotate_degrees take effect (in the model, on
the device), and the keys only the shard source reads are refused."""

from pathlib import Path

import pytest
import torch

from xlatrain.config import load_run_config
from xlatrain.recipes.pe_detection.recipe import DataConfig, SliceClassifier, build

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "pe_detection.yaml")


@pytest.mark.parametrize("keys", [{"cache_dir": "/tmp/cache"}, {"shards": "runs/x/shards", "cache_dir": "/tmp/cache"}])
def test_the_folder_source_refuses_the_keys_only_the_shard_source_reads(keys):
    with pytest.raises(ValueError, match=r"data\.(shards and data\.)?cache_dir would be ignored: data\.source=folder"):
        DataConfig(source="folder", **keys)
    DataConfig(source="shards", **keys)


def test_the_folder_source_flips_and_rotates_training_batches_in_the_model(tmp_path):
    overrides = ["model.name=small_cnn", "model.width=4", "data.num_studies=4", "data.slices_per_study=[3,4]",
                 "data.num_folds=2", "data.pack_workers=1", "data.stored_size=32", "data.image_size=32",
                 f"data.root={tmp_path}/data", "data.source=folder", "data.hflip=0.3", "data.rotate_degrees=7",
                 "backend.accelerator=cpu"]
    parts = build(load_run_config(CONFIG, overrides))
    assert (parts.model.hflip, parts.model.rotate_degrees) == (0.3, 7.0)
    image, _ = parts.train_data[0]
    assert image.dtype == torch.uint8 and torch.equal(image, parts.train_data[0][0])  # the dataset draws nothing


def test_the_model_flips_training_batches_only_with_its_probability():
    seen = []

    class Backbone(torch.nn.Module):
        def forward(self, x):
            seen.append(x.clone())
            return x.mean((1, 2, 3))

    images = torch.randint(0, 255, (64, 1, 8, 8), dtype=torch.uint8)
    model = SliceClassifier(Backbone(), hflip=0.5)
    torch.manual_seed(0)
    model.train()(images)
    flipped = [torch.equal(seen[0][i], model.normalize(images[i].flip(-1))) for i in range(64)]
    kept = [torch.equal(seen[0][i], model.normalize(images[i])) for i in range(64)]
    assert all(f != k for f, k in zip(flipped, kept)) and 16 < sum(flipped) < 48
    torch.manual_seed(0)
    model(images)
    assert torch.equal(seen[1], seen[0])  # the same seed draws the same flips
    model.hflip = 1.0
    model.eval()(images)
    assert torch.equal(seen[2], model.normalize(images))  # evaluation is never flipped
