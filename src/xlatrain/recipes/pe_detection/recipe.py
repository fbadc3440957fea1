"""The PE-detection recipe for ``xlatrain fit`` (config: ``configs/pe_detection.yaml``).

Multi-label classification of CT slices shaped like RSNA STR PE: ten sigmoid outputs (the image
label and nine exam-level labels), BCE loss, folds grouped by study, per-label AUC, mean AUC and
the competition's weighted log loss. Without real data the recipe generates a synthetic set with
the same layout and packs it, so the whole path (folder -> shards -> Trainer) runs anywhere.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from xlatrain import storage
from xlatrain.config import from_dict
from xlatrain.recipes.pe_detection.labels import ID_COLUMNS, STUDY_COLUMN, TARGET_NAMES
from xlatrain.logs import get_logger
from xlatrain.recipes.pe_detection.metrics import make_metrics_fn, prior_baseline

log = get_logger(__name__)

SOURCES = ("shards", "folder")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """``root`` holds ``train.csv`` + ``train/`` (RSNA layout); ``shards`` the packed copy.

    Either is created when missing and ``synthetic`` is on (the default): ``num_studies``
    exams of ``slices_per_study`` slices at ``stored_size`` px, from ``seed``. A pack that exists
    is read as it is: those keys must agree with what it was generated from (the recipe records
    it in the pack), or, for a pack that records nothing (``xlatrain pack``), stay at their
    defaults. ``source: folder`` decodes the JPEGs under ``root`` per item, and the model flips
    and rotates the training batches (``hflip``, ``rotate_degrees``) on the device; ``shards``
    and ``cache_dir`` are for ``source: shards`` only.
    """

    root: str = "runs/data/pe_synthetic"
    shards: str | None = None  # default: ROOT/shards; a gs:// URL reads (and packs) on object storage
    cache_dir: str | None = None  # with shards on object storage: keep whole shards here (see ShardOptions)
    source: str = "shards"
    synthetic: bool = True
    num_studies: int = 60
    slices_per_study: list[int] = (16, 24)  # type: ignore[assignment]
    stored_size: int = 256
    image_size: int = 64
    num_folds: int = 5
    fold: int = 0
    seed: int = 0
    pack_workers: int = 2  # processes that generate and pack the data (decoding is trainer.num_workers)
    hflip: float = 0.5
    rotate_degrees: float = 10.0

    # How the data is made and cached, not which data it is: a resumed run may change them (see
    # xlatrain.recipes.run.run_record).
    RESUME_FREE = ("pack_workers", "cache_dir")

    def resume_free(self) -> tuple[str, ...]:
        """RESUME_FREE, and the keys this source does not read (data.shards under the folder
        source, which an older xlatrain took and ignored: a run that set it resumes without it)."""
        return self.RESUME_FREE + (("shards",) if self.source == "folder" else ())
    RENAMED = {"workers": "pack_workers (processes that generate and pack the data; the processes that decode "
                          "batches while training are trainer.num_workers)"}

    def __post_init__(self) -> None:
        from xlatrain.config import check_int, check_nonnegative

        for key in ("num_studies", "stored_size", "image_size", "num_folds"):
            check_int(f"data.{key}", getattr(self, key), minimum=2 if key == "num_folds" else 1)
        check_int("data.pack_workers", self.pack_workers)
        check_int("data.seed", self.seed, minimum=0)
        spread = self.slices_per_study
        if not (isinstance(spread, (list, tuple)) and len(spread) == 2 and all(
                isinstance(n, int) and not isinstance(n, bool) for n in spread) and 1 <= spread[0] <= spread[1]):
            raise ValueError(f"data.slices_per_study={spread!r} is not valid: give the fewest and the most slices of a "
                             "study, [low, high] with 1 <= low <= high, e.g. [16, 24]")
        check_nonnegative("data.rotate_degrees", self.rotate_degrees)
        if not 0 <= self.hflip <= 1:
            raise ValueError(f"data.hflip={self.hflip!r} is not valid: give a probability between 0 and 1")
        if self.source not in SOURCES:
            raise ValueError(f"data.source={self.source!r} is not valid: choose one of {', '.join(SOURCES)}")
        if not 0 <= self.fold < self.num_folds:
            raise ValueError(f"data.fold={self.fold} is not valid: use 0..{self.num_folds - 1}")
        unread = [k for k in ("shards", "cache_dir") if getattr(self, k) is not None]
        if self.source == "folder" and unread:
            raise ValueError(
                f"{' and '.join('data.' + k for k in unread)} would be ignored: data.source=folder reads the JPEGs "
                "under data.root, and data.shards (the pack) and data.cache_dir (a local copy of a pack on object "
                f"storage) are read by data.source=shards only. Remove {'them' if len(unread) > 1 else 'it'}, or use "
                "data.source=shards"
            )

    @property
    def shard_dir(self) -> Path | str:
        if self.shards and storage.is_url(self.shards):
            return self.shards.rstrip("/")
        return Path(self.shards) if self.shards else Path(self.root) / "shards"


def _packed(shard_dir: Path | str) -> bool:
    if isinstance(shard_dir, str):
        return storage.exists(storage.join(shard_dir, "manifest.json"))
    return (shard_dir / "manifest.json").is_file()


def prepare_data(data: DataConfig, timeout_s: float = 1800.0) -> None:
    """Generate the synthetic folder and pack it, when they are not there yet.

    Under torchrun (or any launcher setting LOCAL_RANK) one process per host does it; the others
    wait for the files it finishes last (both are written atomically, so seeing one means done).
    """
    import os
    import time

    root = Path(data.root)

    def done() -> bool:
        return _packed(data.shard_dir) if data.source == "shards" else (root / "train.csv").is_file()

    if data.source == "shards" and data.shards and _packed(data.shard_dir):
        _check_named_pack(data)
        return  # a pack the config names (local or on object storage) is read as it is: no folder needed
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                what = f"{data.shard_dir}/manifest.json" if data.source == "shards" else root / "train.csv"
                raise TimeoutError(f"waited {timeout_s:.0f} s for local rank 0 to write {what}")
            time.sleep(0.5)
        return
    _prepare(data, root)


# What a generated folder was generated from (written beside its train.csv, and into the pack
# made from it).
GENERATED_FROM = "xlatrain-synthetic.json"
GENERATION_KEYS = ("num_studies", "slices_per_study", "stored_size", "seed")


def _generation(data: DataConfig) -> dict[str, Any]:
    return {k: list(v) if k == "slices_per_study" else v for k, v in ((k, getattr(data, k)) for k in GENERATION_KEYS)}


def _check_generated(data: DataConfig, root: Path) -> None:
    """A generated folder made from other ``data.*`` values is an error, not silently reused."""
    import json

    record = root / GENERATED_FROM
    if not data.synthetic or not record.is_file():
        return  # real data (or a folder from before the record): generation keys do not apply
    _compare_generation(data, json.loads(record.read_text()), str(root),
                        f"delete {root} to generate it again, point data.root at another folder, or use the old values")


def _compare_generation(data: DataConfig, made: dict[str, Any], what: str, fix: str) -> None:
    changed = [k for k, v in _generation(data).items() if k in made and made[k] != v]
    if changed:
        raise ValueError(
            f"{what} was generated with "
            + ", ".join(f"data.{k}={made[k]}" for k in changed)
            + "; this config asks for "
            + ", ".join(f"data.{k}={getattr(data, k)}" for k in changed)
            + f": {fix}"
        )


def _check_named_pack(data: DataConfig) -> None:
    """A pack that ``data.shards`` names and that exists is read as it is, so the keys that
    generate a synthetic set must agree with it: with what it records it was generated from, or,
    where it records nothing (a pack of real data, of ``xlatrain pack``, of an older xlatrain),
    be left at their defaults. ``data.seed`` also draws the folds, so it is used either way."""
    import json

    if not data.synthetic:
        return  # real data: generation keys do not apply
    shard_dir = data.shard_dir
    if isinstance(shard_dir, str):
        url = storage.join(shard_dir, GENERATED_FROM)
        made = json.loads(storage.read_bytes(url)) if storage.exists(url) else None
    else:
        records = [shard_dir / GENERATED_FROM]
        if shard_dir.resolve() == (Path(data.root) / "shards").resolve():
            records.append(Path(data.root) / GENERATED_FROM)  # an older xlatrain recorded it beside train.csv only
        found = next((p for p in records if p.is_file()), None)
        made = json.loads(found.read_text()) if found is not None else None
    if made is not None:
        _compare_generation(data, made, f"the pack data.shards names ({shard_dir})",
                            "point data.shards at another pack, or use the old values")
        return
    default = _generation(DataConfig())
    asked = [k for k, v in _generation(data).items() if k != "seed" and v != default[k]]
    if asked:  # it cannot be told whether they agree: said, not refused (a run of an older xlatrain resumes)
        log.info(
            f"note: {', '.join(f'data.{k}={getattr(data, k)}' for k in asked)} are not checked against the pack "
            f"data.shards names ({shard_dir}): it does not record what it was generated from (a pack of xlatrain "
            "pack, or of an older xlatrain), and it is read as it is. They take effect only where data.root is "
            "generated (data.shards left out)"
        )


def _prepare(data: DataConfig, root: Path) -> None:
    import json

    from xlatrain.checkpoint import atomic_write_text
    from xlatrain.data import synthetic_rsna
    from xlatrain.data.pack import pack

    if not (root / "train.csv").is_file():
        if not data.synthetic:
            raise ValueError(f"{root}/train.csv does not exist: point data.root at an RSNA-layout folder")
        log.info(f"generating a synthetic RSNA-shaped dataset in {root} ...")
        lo, hi = data.slices_per_study
        synthetic_rsna.generate(
            root, num_studies=data.num_studies, slices_per_study=(lo, hi), image_size=data.stored_size,
            seed=data.seed, workers=data.pack_workers,
        )
        atomic_write_text(root / GENERATED_FROM, json.dumps(_generation(data)))
    _check_generated(data, root)
    if data.source == "shards" and not _packed(data.shard_dir):
        log.info(f"packing {root} into {data.shard_dir} ...")
        pack(
            root / "train.csv", root / "train", data.shard_dir, path_columns=list(ID_COLUMNS), suffix=".jpg",
            labels=list(TARGET_NAMES), group=STUDY_COLUMN, workers=data.pack_workers, progress=False,
        )
        if (root / GENERATED_FROM).is_file():  # the pack says what it was generated from, wherever it is read
            record = (root / GENERATED_FROM).read_text()
            if isinstance(data.shard_dir, str):
                storage.write_bytes(storage.join(data.shard_dir, GENERATED_FROM), record.encode())
            else:
                atomic_write_text(data.shard_dir / GENERATED_FROM, record)


class FolderDataset(Dataset[Any]):
    """The unpacked folder, one JPEG read and decoded per item (uint8 ``1 x S x S``, 10 float labels).

    It does not augment: under ``data.source=folder`` the recipe's model flips and rotates the
    training batches on the device (:class:`SliceClassifier`).
    """

    def __init__(self, root: str | Path, rows: list[dict[str, str]], image_size: int) -> None:
        self.root = Path(root)
        self.rows = rows
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from xlatrain.data.decode import decode_tensor

        row = self.rows[i]
        path = self.root / "train" / "/".join(row[c] for c in ID_COLUMNS)
        image = decode_tensor(path.with_suffix(".jpg").read_bytes(), size=self.image_size, channels=1)
        return image, torch.tensor([float(row[name]) for name in TARGET_NAMES])


def _read_rows(csv_path: Path) -> list[dict[str, str]]:
    with open(csv_path, newline="") as f:
        return list(csv.DictReader(f))


@dataclass
class Split:
    """One fold: datasets plus, in dataset order, what the metrics and the baseline need."""

    train: Any
    val: Any
    train_labels: np.ndarray  # [N, 10]
    train_studies: np.ndarray
    val_labels: np.ndarray
    val_studies: np.ndarray


def datasets(data: DataConfig, num_workers: int | str = "auto", pin_memory: bool = False, reader_rotates: bool = True) -> Split:
    """Train / validation of fold ``data.fold``, grouped by study (no study on both sides).

    ``num_workers`` (the trainer's setting) is how many processes decode: the shard reader's own
    workers, or the DataLoader's for the folder source. ``pin_memory`` has the shard reader hand
    out page-locked batches (for a CUDA device; the Trainer's DataLoader pins on its own).
    ``reader_rotates=False`` leaves ``data.rotate_degrees`` to the model (on the device).
    """
    from xlatrain.data.shards import Augment, ShardDataset
    from xlatrain.data.splits import group_kfold

    prepare_data(data)
    if data.source == "shards":
        full = ShardDataset(
            data.shard_dir, image_size=data.image_size, channels=1, labels=list(TARGET_NAMES),
            num_workers=num_workers, pin_memory=pin_memory, cache_dir=data.cache_dir,
        )
        groups, labels = full.groups, full.labels
        train_ids, val_ids = group_kfold(groups, num_folds=data.num_folds, fold=data.fold, seed=data.seed)
        augment = Augment(hflip=data.hflip, rotate_degrees=data.rotate_degrees if reader_rotates else 0.0)
        train, val = full.subset(train_ids, augment=augment), full.subset(val_ids)
    else:
        rows = _read_rows(Path(data.root) / "train.csv")
        groups = np.asarray([r[STUDY_COLUMN] for r in rows], dtype=object)
        labels = np.asarray([[float(r[n]) for n in TARGET_NAMES] for r in rows], dtype=np.float64)
        train_ids, val_ids = group_kfold(groups, num_folds=data.num_folds, fold=data.fold, seed=data.seed)
        train = FolderDataset(data.root, [rows[i] for i in train_ids], data.image_size)
        val = FolderDataset(data.root, [rows[i] for i in val_ids], data.image_size)
    return Split(train, val, labels[train_ids], groups[train_ids], labels[val_ids], groups[val_ids])


class SliceClassifier(nn.Module):
    """uint8 slices in, ten logits out: normalisation happens on the device, in the model.

    With ``rotate_degrees``, training batches are rotated here, on the device, by an angle per
    slice drawn uniformly from ``[-rotate_degrees, rotate_degrees]`` (bilinear, corners 0, as the
    shard reader rotates). On a GPU this is where the rotation costs nothing: in the reader it is
    about two thirds of a decode worker's time per slice (PIL's bilinear rotate). Measured on an
    H200 host with 15 workers, the input wait went from 18-23% to 10-12% of a 42-step epoch, and
    from 22-23% to 18-20% of a 168-step one (benchmarks/cuda/NVIDIA-H200.json). With ``hflip``,
    each training slice is then mirrored left to right with that probability (the folder source,
    whose dataset does not augment, has both done here on every device).
    """

    def __init__(self, backbone: nn.Module, rotate_degrees: float = 0.0, hflip: float = 0.0) -> None:
        super().__init__()
        from xlatrain.data.shards import NormalizeInput

        self.normalize = NormalizeInput(mean=[0.25], std=[0.25])
        self.backbone = backbone
        self.rotate_degrees = rotate_degrees
        self.hflip = hflip

    def forward(self, images_B1HW: torch.Tensor) -> torch.Tensor:
        if self.training and self.rotate_degrees:
            images_B1HW = rotate_batch(images_B1HW, self.rotate_degrees)
        if self.training and self.hflip:
            images_B1HW = flip_batch(images_B1HW, self.hflip)
        return self.backbone(self.normalize(images_B1HW))


def flip_batch(images: torch.Tensor, probability: float) -> torch.Tensor:
    """``images`` (B, C, H, W), each mirrored left to right with ``probability``, drawn from the
    device's generator (which the Trainer seeds per step, as for :func:`rotate_batch`)."""
    flip_B = torch.rand(images.shape[0], device=images.device) < probability
    return torch.where(flip_B[:, None, None, None], images.flip(-1), images)


def rotate_batch(images: torch.Tensor, degrees: float) -> torch.Tensor:
    """``images`` (B, C, H, W) each rotated about its centre by its own angle drawn uniformly from
    ``[-degrees, degrees]``, bilinear, corners filled with 0; float32 on the images' device, values
    on their scale. The angles come from the device's generator, which the Trainer seeds per step:
    a resumed run draws the same ones."""
    return rotate_by(images, (torch.rand(images.shape[0], device=images.device) * 2 - 1) * degrees)


def rotate_by(images: torch.Tensor, degrees: torch.Tensor) -> torch.Tensor:
    """``images`` (B, C, H, W) rotated counter-clockwise by ``degrees`` (B,), as PIL's rotate."""
    n, _, h, w = images.shape
    angle = degrees * (math.pi / 180)
    cos, sin, zero = torch.cos(angle), torch.sin(angle), torch.zeros_like(angle)
    # affine_grid works in coordinates normalised per axis: the aspect ratio keeps a rotation one.
    theta = torch.stack([torch.stack([cos, -sin * (h / w), zero], 1), torch.stack([sin * (w / h), cos, zero], 1)], 1)
    grid = nn.functional.affine_grid(theta, [n, images.shape[1], h, w], align_corners=False)
    return nn.functional.grid_sample(images.float(), grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def build(config: Any) -> Any:
    from xlatrain.backend.hardware import find_tpu_chips
    from xlatrain.recipes.run import RecipeParts, build_recipe_model

    # Pinned batches only pay where the run trains on CUDA: accelerator "cuda", or "auto" on a
    # machine whose only accelerator is a CUDA GPU (auto picks a TPU first).
    accelerator = config.backend.accelerator
    on_cuda = accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available() and not find_tpu_chips())
    # On CUDA the slices are rotated by the model, on the GPU (see SliceClassifier); elsewhere by
    # the shard reader (a CPU trains either way on its own cores; TorchTPU and XLA get the batch
    # as the reader made it).
    data = from_dict(DataConfig, config.data, section="data")
    split = datasets(data, num_workers=config.trainer.num_workers, pin_memory=on_cuda, reader_rotates=not on_cuda)
    torch.manual_seed(config.trainer.seed)
    # model.pretrained takes the backbone's own weights, or this recipe's best.safetensors (or
    # `xlatrain export`), which holds the SliceClassifier: the backbone under "backbone.".
    backbone = build_recipe_model(config, num_outputs=len(TARGET_NAMES), in_channels=1, pretrained_prefix="backbone.")
    # The shard reader flips (and, off CUDA, rotates) as it decodes; the folder's dataset does
    # neither, so under data.source=folder the model does both, on the device.
    folder = data.source == "folder"
    return RecipeParts(
        model=SliceClassifier(backbone, rotate_degrees=data.rotate_degrees if on_cuda or folder else 0.0,
                              hflip=data.hflip if folder else 0.0),
        loss_fn=nn.BCEWithLogitsLoss(),
        train_data=split.train,
        val_data=split.val,
        metrics_fn=make_metrics_fn(split.val_studies),
        label_names=list(TARGET_NAMES),
    )


def baseline(config: Any) -> dict[str, float]:
    """The prior-probability baseline on the same validation fold (what a model must beat)."""
    split = datasets(from_dict(DataConfig, config.data, section="data"))
    return prior_baseline(split.train_labels, split.train_studies, split.val_labels, split.val_studies)


__all__ = ["DataConfig", "FolderDataset", "SliceClassifier", "Split", "baseline", "build", "datasets", "prepare_data"]
