"""A detection metric small enough to read: mean average precision at one IoU threshold.

:class:`DetectionMAP` is a streaming metric (``update`` per batch, ``compute`` at the end), the
shape torchmetrics' metrics have, so either goes to ``Trainer(metrics_fn=...)``: the Trainer feeds
it each evaluation batch's real rows (padding left out). Predictions and targets are torchvision's
detection format, one dict per image: ``{"boxes": [N, 4] (x1, y1, x2, y2), "scores": [N],
"labels": [N]}`` and ``{"boxes": [M, 4], "labels": [M]}``.

Average precision is computed per class as the area under the precision-recall curve with every
recall point counted (VOC 2010 and later), detections matched greedily by score to the unmatched
ground-truth box of their class with the highest IoU at or above the threshold; the mean is over
classes that have ground truth. It is not COCO's mAP@[.5:.95] (torchmetrics'
``MeanAveragePrecision`` computes that, with pycocotools installed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from xlatrain.backend.processes import gather_in_group

if TYPE_CHECKING:
    from xlatrain.backend.base import Strategy


class DetectionMAP:
    """Mean average precision at IoU ``iou_threshold`` over classes, as ``{"map50": value}``
    (the key follows the threshold: ``map75`` at 0.75).

    Example:
        >>> metric = DetectionMAP()
        >>> box = torch.tensor([[0.0, 0.0, 10.0, 10.0]])
        >>> metric.update([{"boxes": box, "scores": torch.tensor([0.9]), "labels": torch.tensor([1])}],
        ...               [{"boxes": box, "labels": torch.tensor([1])}])
        >>> metric.compute()
        {'map50': 1.0}
    """

    combines_processes = True  # compute(strategy) gathers every process's matches (_merged)

    def __init__(self, iou_threshold: float = 0.5) -> None:
        if not 0.0 < iou_threshold <= 1.0:
            raise ValueError(f"iou_threshold={iou_threshold!r} is not valid: give an IoU in (0, 1], e.g. 0.5")
        self.iou_threshold = iou_threshold
        self.reset()

    def reset(self) -> None:
        self._detections: dict[int, list[tuple[float, bool]]] = {}  # class -> (score, true positive)
        self._truths: dict[int, int] = {}  # class -> ground-truth boxes

    def update(self, predictions: Sequence[Mapping[str, torch.Tensor]], targets: Sequence[Mapping[str, torch.Tensor]]) -> None:
        if len(predictions) != len(targets):
            raise ValueError(f"DetectionMAP.update got {len(predictions)} predictions for {len(targets)} targets: "
                             "give one dict per image of each")
        for pred, truth in zip(predictions, targets):
            boxes, scores, labels = (pred[k].detach().float().cpu() for k in ("boxes", "scores", "labels"))
            true_boxes, true_labels = truth["boxes"].detach().float().cpu(), truth["labels"].detach().cpu()
            for cls in true_labels.tolist():
                self._truths[int(cls)] = self._truths.get(int(cls), 0) + 1
            taken = torch.zeros(len(true_boxes), dtype=torch.bool)
            ious = box_iou(boxes, true_boxes) if len(boxes) and len(true_boxes) else torch.zeros(len(boxes), len(true_boxes))
            for i in torch.argsort(scores, descending=True).tolist():
                cls = int(labels[i])
                candidates = (true_labels == cls) & ~taken
                hit = False
                if candidates.any():
                    overlap = torch.where(candidates, ious[i], torch.tensor(-1.0))
                    best = int(torch.argmax(overlap))
                    if overlap[best] >= self.iou_threshold:
                        taken[best] = hit = True
                self._detections.setdefault(cls, []).append((float(scores[i]), hit))

    def compute(self, strategy: Strategy | None = None) -> dict[str, float]:
        """mAP over what every process saw: of ``strategy`` (the Trainer passes its own), else of
        torch.distributed's default group where one runs."""
        detections, truths = self._merged(strategy)
        aps = [_average_precision(detections.get(cls, []), n) for cls, n in sorted(truths.items()) if n > 0]
        key = f"map{round(self.iou_threshold * 100)}"
        return {key: float(sum(aps) / len(aps)) if aps else float("nan")}

    def _merged(self, strategy: Strategy | None) -> tuple[dict[int, list[tuple[float, bool]]], dict[int, int]]:
        """Every process's matches (a host gather where the strategy runs several processes)."""
        mine = (self._detections, self._truths)
        parts = strategy.gather_objects(mine) if strategy is not None and strategy.num_processes > 1 else \
            gather_in_group(mine) if strategy is None else None
        if parts is None:
            return mine
        detections: dict[int, list[tuple[float, bool]]] = {}
        truths: dict[int, int] = {}
        # int(cls): a gather through JSON (torch_xla's) gives the class keys back as strings.
        for dets, counts in parts:
            for cls, found in dets.items():
                detections.setdefault(int(cls), []).extend(found)
            for cls, n in counts.items():
                truths[int(cls)] = truths.get(int(cls), 0) + n
        return detections, truths


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of every box of ``a`` ([N, 4], x1 y1 x2 y2) with every box of ``b`` ([M, 4]): [N, M]."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    top_left = torch.maximum(a[:, None, :2], b[None, :, :2])
    bottom_right = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(dim=2)
    union = area_a[:, None] + area_b[None, :] - inter
    return torch.where(union > 0, inter / union, torch.zeros_like(inter))


def _average_precision(detections: list[tuple[float, bool]], num_truths: int) -> float:
    if not detections:
        return 0.0
    ordered = sorted(detections, key=lambda d: -d[0])
    hits = torch.tensor([hit for _, hit in ordered], dtype=torch.float64)
    tp = torch.cumsum(hits, 0)
    precision = tp / torch.arange(1, len(ordered) + 1, dtype=torch.float64)
    recall = tp / num_truths
    # The precision envelope (each point the best precision at its recall or beyond), summed over
    # the recall steps.
    envelope = torch.flip(torch.cummax(torch.flip(precision, [0]), 0).values, [0])
    steps = torch.diff(torch.cat([torch.zeros(1, dtype=torch.float64), recall]))
    return float((steps * envelope).sum())
