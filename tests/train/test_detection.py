"""DetectionMAP on several processes: joined through the strategy it is given."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, run_command
from xlatrain.train.detection import DetectionMAP


def _box(x):
    return torch.tensor([[x, x, x + 10.0, x + 10.0]])


class _JsonGather:
    """Two processes whose gather goes through JSON, as torch_xla's rendezvous does: the other
    process saw ``other``."""

    num_processes = 2

    def __init__(self, other):
        self.other = other

    def gather_objects(self, obj):
        return [json.loads(json.dumps(obj)), json.loads(json.dumps(self.other))]


def test_compute_joins_every_process_s_matches_through_the_strategy():
    hit = ([{"boxes": _box(0.0), "scores": torch.tensor([0.9]), "labels": torch.tensor([1])}],
           [{"boxes": _box(0.0), "labels": torch.tensor([1])}])
    miss = ([{"boxes": _box(50.0), "scores": torch.tensor([0.8]), "labels": torch.tensor([2])}],
            [{"boxes": _box(0.0), "labels": torch.tensor([2])}])
    mine, other, both = DetectionMAP(), DetectionMAP(), DetectionMAP()
    mine.update(*hit)
    other.update(*miss)
    both.update(*hit)
    both.update(*miss)
    assert mine.compute() == {"map50": 1.0}  # no strategy and no process group: this process's matches
    # Class keys come back from JSON as strings and still meet: class 1 found, class 2 missed.
    assert mine.compute(_JsonGather((other._detections, other._truths))) == both.compute() == {"map50": 0.5}


@pytest.mark.multiprocess
def test_detection_map_under_torchrun_scores_the_whole_validation_set_on_every_process(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    run_command([torchrun, "--nproc-per-node", "2", "--master-port", "0", "--standalone",
                 str(SCRIPTS / "detection_agree.py"), str(tmp_path), "ddp"], timeout=240)
    ranks = [json.loads((tmp_path / f"detection-{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["map50"] == ranks[1]["map50"] == pytest.approx(ranks[0]["whole"])
    assert ranks[0]["own"] != ranks[0]["whole"] and ranks[1]["own"] != ranks[1]["whole"]  # each saw a part
    # Called by hand without a strategy, compute() joins torch.distributed's default group.
    assert ranks[0]["joined"] == ranks[1]["joined"] == pytest.approx(ranks[0]["whole"])


def test_a_subclass_whose_compute_takes_no_strategy_is_called_as_written(tmp_path):
    import functools

    import xlatrain

    class Renamed(DetectionMAP):
        def compute(self):
            return {"detections_map": super().compute()["map50"]}

    class Detector(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, images, targets=None):
            if self.training:
                return {"loss": self.w * 0 + sum(i.sum() for i in images) * 0 + self.w ** 2}
            return [{"boxes": _box(0.0), "scores": torch.tensor([0.9]), "labels": torch.tensor([1])} for _ in images]

    items = [(torch.zeros(3, 8, 8), {"boxes": _box(0.0), "labels": torch.tensor([1])}) for _ in range(8)]
    trainer = xlatrain.Trainer(Detector(), None, functools.partial(torch.optim.SGD, lr=0.1),
                               collate_fn=lambda batch: tuple(zip(*batch)), metrics_fn=Renamed(),
                               config=xlatrain.TrainConfig(epochs=1, batch_size=4, run_dir=str(tmp_path),
                                                           tensorboard=False), accelerator="cpu")
    assert trainer.fit(items, items)[-1]["val_detections_map"] == 1.0
