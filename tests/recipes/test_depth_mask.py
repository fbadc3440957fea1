"""Depth-and-mask recipe: synthetic data, the combined loss, Dice/IoU/RMSE, and a short training run."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

import xlatrain
from xlatrain.recipes.depth_mask import (
    DepthMaskDataset,
    DepthMaskLoss,
    build_depth_mask_model,
    depth_mask_metrics,
    dice_iou,
    rmse,
)
from xlatrain.train.losses import EvalLoss


# --- data ---------------------------------------------------------------------------------------
def test_items_have_the_documented_shapes_and_ranges():
    image, (mask, depth) = DepthMaskDataset(4, image_size=32)[2]
    for t in (image, mask, depth):
        assert t.shape == (1, 32, 32) and t.dtype == torch.float32
    assert 0 <= image.min() and image.max() <= 1
    assert set(mask.unique().tolist()) <= {0.0, 1.0} and mask.sum() > 0  # at least one shape
    assert 0 <= depth.min() and depth.max() <= 1
    # Shapes stand in front of the floor: nearer (larger depth) on the mask.
    assert depth[mask > 0].mean() > depth[mask == 0].mean()


def test_items_are_deterministic_per_seed_and_index():
    a, b = DepthMaskDataset(10, image_size=32, seed=1), DepthMaskDataset(10, image_size=32, seed=1)
    for i in (0, 7, 3):  # any access order
        assert torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1][1], b[i][1][1])
    assert not torch.equal(a[0][0], a[1][0])
    assert not torch.equal(a[0][0], DepthMaskDataset(10, image_size=32, seed=2)[0][0])
    assert torch.equal(a[-1][0], a[9][0])


def test_dataset_errors():
    with pytest.raises(IndexError):
        DepthMaskDataset(3, image_size=32)[3]
    with pytest.raises(ValueError, match="num_samples"):
        DepthMaskDataset(0)
    with pytest.raises(ValueError, match="image_size"):
        DepthMaskDataset(4, image_size=4)


# --- loss ---------------------------------------------------------------------------------------
def _hand_batch():
    """Two samples of 2x2 pixels: mask logits 0 (BCE = ln 2 whatever the target), depth predicted 0."""
    logits = torch.zeros(2, 1, 2, 2)
    depth_pred = torch.zeros(2, 1, 2, 2)
    mask = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]], [[[0.0, 0.0], [0.0, 0.0]]]])
    depth = torch.stack([torch.full((1, 2, 2), 0.5), torch.full((1, 2, 2), 1.0)])
    return (logits, depth_pred), (mask, depth)


def test_loss_per_sample_matches_hand_computed_values():
    outputs, targets = _hand_batch()
    loss_fn = DepthMaskLoss(mask_weight=2.0, depth_weight=3.0, reduction="none")
    per_sample = loss_fn(outputs, targets)
    assert per_sample.shape == (2,)
    # 2 * ln 2 + 3 * mean((0 - 0.5)^2) and 2 * ln 2 + 3 * mean((0 - 1)^2)
    expected = torch.tensor([2 * math.log(2) + 3 * 0.25, 2 * math.log(2) + 3 * 1.0])
    torch.testing.assert_close(per_sample, expected)
    torch.testing.assert_close(DepthMaskLoss(2.0, 3.0)(outputs, targets), expected.mean())
    torch.testing.assert_close(DepthMaskLoss(2.0, 3.0, reduction="sum")(outputs, targets), expected.sum())


def test_loss_smooth_l1_and_trainer_evaluation_wrapper():
    outputs, targets = _hand_batch()
    smooth = DepthMaskLoss(mask_weight=0.0, depth_weight=1.0, depth_loss="smooth_l1", smooth_l1_beta=0.1, reduction="none")
    # |error| >= beta: smooth L1 = |error| - beta / 2
    torch.testing.assert_close(smooth(outputs, targets), torch.tensor([0.5 - 0.05, 1.0 - 0.05]))
    # The Trainer's evaluation switches a copy to reduction="none" and expects [B].
    chosen = EvalLoss.choose(DepthMaskLoss(), outputs, targets)
    assert chosen.mode == "per_sample" and chosen.rows(outputs, targets)["loss"].shape == (2,)


def test_loss_errors_name_the_fix():
    with pytest.raises(ValueError, match="reduction"):
        DepthMaskLoss(reduction="batchmean")
    with pytest.raises(ValueError, match="both 0"):
        DepthMaskLoss(0.0, 0.0)
    with pytest.raises(ValueError, match="mask_weight"):
        DepthMaskLoss(-1.0)
    with pytest.raises(ValueError, match="pair"):
        DepthMaskLoss()(torch.zeros(2, 1, 4, 4), (torch.zeros(2, 1, 4, 4), torch.zeros(2, 1, 4, 4)))


# --- metrics ------------------------------------------------------------------------------------
def test_dice_iou_rmse_against_hand_computed_values():
    # Prediction covers pixels {0, 1, 2}; target {1, 2, 3, 4}: intersection 2, |P| + |T| = 7, union 5.
    logits = torch.tensor([3.0, 0.5, 2.0, -1.0, -2.0, -0.1]).reshape(1, 1, 2, 3)
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0.0]).reshape(1, 1, 2, 3)
    depth_pred = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0]).reshape(1, 1, 2, 3)
    depth = torch.tensor([0.0, 0.0, 0.3, 1.0, 0.6, 1.0]).reshape(1, 1, 2, 3)  # squared errors 0.09 + 0.16
    metrics = depth_mask_metrics((logits, depth_pred), (mask, depth))
    assert metrics["dice"] == pytest.approx(4 / 7)
    assert metrics["iou"] == pytest.approx(2 / 5)
    assert metrics["depth_rmse"] == pytest.approx(math.sqrt(0.25 / 6))
    # Logit exactly 0 is probability 0.5: not part of the predicted mask.
    assert depth_mask_metrics((torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2)), (torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 1, 2)))["dice"] == 0.0


def test_metrics_pool_pixels_over_the_set_and_accept_numpy():
    # Image 1 has no shape and none predicted: pooled Dice ignores it instead of scoring 0/0.
    pred = np.zeros((2, 1, 2, 2))
    pred[0, 0, 0, 0] = 1
    true = pred.copy()
    assert dice_iou(pred, true) == (1.0, 1.0)
    assert dice_iou(np.zeros((2, 2)), np.zeros((2, 2))) == (1.0, 1.0)
    assert rmse(np.array([1.0, 3.0]), np.array([0.0, 0.0])) == pytest.approx(math.sqrt(5))
    with pytest.raises(ValueError, match="shapes differ"):
        rmse(np.zeros(3), np.zeros(4))


# --- a short training run -----------------------------------------------------------------------
def test_tiny_resnet_unet_trains_on_cpu(tmp_path):
    torch.manual_seed(0)
    model = build_depth_mask_model(width=8, blocks=(1, 1, 1, 1))
    trainer = xlatrain.Trainer(
        model,
        DepthMaskLoss(mask_weight=1.0, depth_weight=1.0),
        functools.partial(torch.optim.Adam, lr=3e-3),
        config=xlatrain.TrainConfig(task="none", epochs=4, batch_size=16, log_every=100, run_dir=str(tmp_path / "run")),
        checkpoint=xlatrain.CheckpointConfig(enabled=False),
        backend="cpu",
    )
    history = trainer.fit(DepthMaskDataset(64, image_size=32, seed=0))
    losses = [row["train_loss"] for row in history]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0], losses


def test_tiny_resnet_unet_validates_with_host_metrics(tmp_path):
    torch.manual_seed(0)
    trainer = xlatrain.Trainer(
        build_depth_mask_model(width=8, blocks=(1, 1, 1, 1)),
        DepthMaskLoss(),
        functools.partial(torch.optim.Adam, lr=3e-3),
        config=xlatrain.TrainConfig(
            task="none", epochs=2, batch_size=16, log_every=100, monitor="val_depth_rmse", monitor_mode="min", run_dir=str(tmp_path / "run")
        ),
        checkpoint=xlatrain.CheckpointConfig(enabled=False),
        backend="cpu",
        metrics_fn=depth_mask_metrics,
    )
    val_set = DepthMaskDataset(20, image_size=32, seed=1)  # 20 is not a multiple of 16: padded, masked
    history = trainer.fit(DepthMaskDataset(32, image_size=32, seed=0), val_set)
    row = history[-1]
    assert 0 <= row["val_dice"] <= 1 and 0 <= row["val_iou"] <= row["val_dice"] and row["val_depth_rmse"] > 0
    # The hook saw every validation sample once, in order: recomputing from predict() agrees.
    mask_logits, depth = trainer.predict(val_set)
    targets = (torch.stack([val_set[i][1][0] for i in range(20)]), torch.stack([val_set[i][1][1] for i in range(20)]))
    again = depth_mask_metrics((mask_logits, depth), targets)
    assert again["depth_rmse"] == pytest.approx(row["val_depth_rmse"], rel=1e-5)
