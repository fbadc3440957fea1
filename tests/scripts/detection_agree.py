"""DetectionMAP monitored on two processes, each evaluating part of the validation set: each process
writes its last ``val_map50``, the mAP computed over the whole validation set by one
``DetectionMAP`` in this process, and the one over its own rows alone to RUN_DIR/detection-RANK.json.

Usage: torchrun --nproc-per-node 2 detection_agree.py RUN_DIR STRATEGY
"""

import functools
import json
import os
import types
import sys

import torch
from torch import nn

import xlatrain


class Detector(nn.Module):
    """A stand-in detector: each "image" is a vector holding two detections (box, score, label)
    that eval mode returns; train mode returns a loss dict, as torchvision's detectors do."""

    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(4))

    def forward(self, images, targets=None):
        if self.training:
            losses = [(image[:4] + self.shift - target["boxes"][0]).pow(2).mean() for image, target in zip(images, targets)]
            return {"loss_box": torch.stack(losses).mean()}
        return [{"boxes": torch.stack([image[0:4], image[6:10]]), "scores": image[[4, 10]],
                 "labels": image[[5, 11]].long()} for image in images]


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        corner = torch.randint(0, 40, (2,), generator=g).float()
        truth = torch.cat([corner, corner + 20])
        cls = float(torch.randint(1, 3, (1,), generator=g))
        near = truth + torch.randn(4, generator=g) * 4  # overlaps the truth more or less than IoU 0.5
        stray = torch.cat([corner + 50, corner + 60])
        scores = torch.rand(2, generator=g)
        image = torch.cat([near, scores[:1], torch.tensor([cls]), stray, scores[1:], torch.tensor([3.0 - cls])])
        items.append((image, {"boxes": truth[None], "labels": torch.tensor([int(cls)])}))
    return items


def main() -> None:
    run_dir, strategy = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    val = data(11, 2)  # 11 images, 4 per process and step: in the last step process 1 has no real row
    trainer = xlatrain.Trainer(
        Detector(), None, functools.partial(torch.optim.SGD, lr=0.01),
        collate_fn=lambda items: tuple(zip(*items)), metrics_fn=xlatrain.DetectionMAP(),
        config=xlatrain.TrainConfig(epochs=1, batch_size=4, run_dir=run_dir, tensorboard=False, monitor="val_map50"),
        checkpoint=xlatrain.CheckpointConfig(enabled=False), accelerator="cpu", strategy=strategy,
    )
    history = trainer.fit(data(16, 1), val)
    model = trainer.strategy.unwrap(trainer.model).eval()
    whole, own = xlatrain.DetectionMAP(), xlatrain.DetectionMAP()
    images, targets = zip(*val)
    rank = int(os.environ["RANK"])
    with torch.no_grad():
        whole.update(model(list(images)), list(targets))
        # This process's rows: its 4-row block of each 8-row global batch.
        mine = [i for i in range(len(val)) if (i % 8) // 4 == rank]
        own.update(model([images[i] for i in mine]), [targets[i] for i in mine])
    alone = types.SimpleNamespace(num_processes=1)  # what this process saw (without one: the group's)
    joined = own.compute()["map50"]  # compute() by hand joins torch.distributed's group, as before
    with open(f"{run_dir}/detection-{rank}.json", "w") as f:
        json.dump({"map50": history[-1]["val_map50"], "whole": whole.compute(alone)["map50"],
                   "own": own.compute(alone)["map50"], "joined": joined}, f)


if __name__ == "__main__":
    main()
