"""A synthetic dataset shaped like RSNA STR pulmonary-embolism detection (the 256 px JPEG version).

Layout and columns match the competition's ``train.csv``::

    root/train/<StudyInstanceUID>/<SeriesInstanceUID>/<SOPInstanceUID>.jpg
    root/train.csv

Exam-level labels are constant within a study and obey the competition's consistency rules:
a study with any ``pe_present_on_image`` slice has ``negative_exam_for_pe = indeterminate = 0``,
exactly one of ``rv_lv_ratio_gte_1`` / ``rv_lv_ratio_lt_1``, at least one of ``central_pe`` /
``leftsided_pe`` / ``rightsided_pe`` and at most one of ``chronic_pe`` / ``acute_and_chronic_pe``;
a study without one has exactly one of ``negative_exam_for_pe`` / ``indeterminate`` and no
PE-type or RV/LV label. Slices are CT-like (body, lungs, heart, vessels, spine, noise) and a
PE-positive slice carries a bright blob on the side its exam labels say, so a model can learn
the image label. Everything is a pure function of ``seed``.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import simplejpeg

from xlatrain.checkpoint import atomic_write_text

ID_COLUMNS = ("StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID")
LABEL_COLUMNS = (
    "pe_present_on_image",
    "negative_exam_for_pe",
    "qa_motion",
    "qa_contrast",
    "flow_artifact",
    "rv_lv_ratio_gte_1",
    "rv_lv_ratio_lt_1",
    "leftsided_pe",
    "chronic_pe",
    "true_filling_defect_not_pe",
    "rightsided_pe",
    "acute_and_chronic_pe",
    "central_pe",
    "indeterminate",
)
CSV_COLUMNS = ID_COLUMNS + LABEL_COLUMNS
# The file-name template `xlatrain pack` needs for this layout.
PATH_COLUMNS = ID_COLUMNS
PATH_SUFFIX = ".jpg"


@dataclass(frozen=True, kw_only=True)
class SyntheticRSNA:
    """Where :func:`generate` put the dataset."""

    root: Path
    image_dir: Path
    csv_path: Path
    num_images: int
    num_studies: int


def generate(
    out_dir: str | os.PathLike[str],
    *,
    num_studies: int = 40,
    slices_per_study: tuple[int, int] = (60, 90),
    image_size: int = 256,
    quality: int = 90,
    seed: int = 0,
    workers: int = 1,
) -> SyntheticRSNA:
    """Write an RSNA-PE-shaped dataset under ``out_dir`` (``train/`` and ``train.csv``).

    Args:
        num_studies: number of exams (one series each).
        slices_per_study: inclusive range of slices per exam, drawn per study.
        image_size: side of the square grayscale slices.
        quality: JPEG quality.
        seed: everything (UIDs, labels, pixels) is a function of it; ``workers`` is not.
        workers: processes generating studies in parallel.

    The image tree is written into a hidden temporary directory and renamed into place, and the
    CSV is written (atomically) last, so a ``train.csv`` never points at a half-written tree.

    Example:
        >>> data = generate("/tmp/rsna", num_studies=4, slices_per_study=(10, 10), image_size=64)
        >>> data.num_images
        40
    """
    if num_studies < 1:
        raise ValueError(f"num_studies={num_studies} is not valid: use 1 or more")
    lo, hi = slices_per_study
    if not 1 <= lo <= hi:
        raise ValueError(f"slices_per_study={slices_per_study} is not valid: use (low, high) with 1 <= low <= high")
    if image_size < 16:
        raise ValueError(f"image_size={image_size} is not valid: use 16 or more pixels")
    if workers < 1:
        raise ValueError(f"workers={workers} is not valid: use 1 or more")
    root = Path(out_dir)
    image_dir, csv_path = root / "train", root / "train.csv"
    for existing in (image_dir, csv_path):
        if existing.exists():
            raise ValueError(f"{existing} already exists: generate into an empty directory, or delete it first")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".train."))
    try:
        jobs = [(staging, seed, i, lo, hi, image_size, quality) for i in range(num_studies)]
        if workers == 1:
            per_study = [_write_study(*job) for job in jobs]
        else:
            with ProcessPoolExecutor(workers) as pool:
                per_study = list(pool.map(_write_study, *zip(*jobs)))
        # One filesystem-wide flush instead of an fsync per image (thousands of small files);
        # the rename below then publishes a tree whose contents are on disk.
        os.sync()
        os.replace(staging, image_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    rows = [row for study in per_study for row in study]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    writer.writerows(rows)
    atomic_write_text(csv_path, text.getvalue())
    return SyntheticRSNA(
        root=root, image_dir=image_dir, csv_path=csv_path, num_images=len(rows), num_studies=num_studies
    )


def _uid(rng: np.random.Generator) -> str:
    # The competition's UIDs are 12 lowercase hex digits.
    return "".join(f"{v:x}" for v in rng.integers(0, 16, 12))


def _exam_labels(rng: np.random.Generator, num_slices: int) -> tuple[dict[str, int], np.ndarray, int]:
    """Exam-level labels, the per-slice PE flags and the blob side (-1 left, 0 central, 1 right)."""
    exam = {name: 0 for name in LABEL_COLUMNS if name != "pe_present_on_image"}
    pe = np.zeros(num_slices, dtype=np.int64)
    kind = rng.random()
    exam["qa_motion"] = int(rng.random() < 0.05)
    exam["flow_artifact"] = int(rng.random() < 0.1)
    exam["true_filling_defect_not_pe"] = int(rng.random() < 0.05)
    if kind < 0.4:  # PE positive: a contiguous run of positive slices
        run = max(1, int(num_slices * rng.uniform(0.2, 0.6)))
        start = int(rng.integers(0, num_slices - run + 1))
        pe[start : start + run] = 1
        exam["rv_lv_ratio_gte_1" if rng.random() < 0.4 else "rv_lv_ratio_lt_1"] = 1
        sides = [int(rng.random() < p) for p in (0.3, 0.6, 0.7)]  # central, left, right
        if not any(sides):
            sides[int(rng.integers(0, 3))] = 1
        exam["central_pe"], exam["leftsided_pe"], exam["rightsided_pe"] = sides
        chronic = rng.random()
        if chronic < 0.1:
            exam["chronic_pe"] = 1
        elif chronic < 0.2:
            exam["acute_and_chronic_pe"] = 1
        side = 0 if sides[0] else (-1 if sides[1] else 1)
    elif kind < 0.95:
        exam["negative_exam_for_pe"] = 1
        side = 0
    else:  # indeterminate exams are mostly poor studies
        exam["indeterminate"] = 1
        exam["qa_contrast" if rng.random() < 0.5 else "qa_motion"] = 1
        side = 0
    return exam, pe, side


def _write_study(
    staging: Path, seed: int, index: int, lo: int, hi: int, size: int, quality: int
) -> list[list[str | int]]:
    rng = np.random.default_rng([seed, index])
    study, series = _uid(rng), _uid(rng)
    num_slices = int(rng.integers(lo, hi + 1))
    exam, pe, side = _exam_labels(rng, num_slices)
    series_dir = staging / study / series
    series_dir.mkdir(parents=True)
    yy, xx = np.mgrid[-1 : 1 : size * 1j, -1 : 1 : size * 1j].astype(np.float32)
    # One noise field per study, shifted per slice: drawing fresh noise per slice costs more
    # than everything else in a slice put together.
    noise = rng.normal(0.0, 0.05, (size, size)).astype(np.float32)
    # CT noise is spatially correlated (reconstruction kernel): a 2x2 box blur mimics it.
    noise = (noise + np.roll(noise, 1, 0) + np.roll(noise, 1, 1) + np.roll(noise, (1, 1), (0, 1))) / 4
    body_a, body_b = rng.uniform(0.8, 0.92), rng.uniform(0.62, 0.72)
    rows: list[list[str | int]] = []
    for z in range(num_slices):
        t = z / max(num_slices - 1, 1)  # 0 = lung apex, 1 = base
        img = np.zeros((size, size), dtype=np.float32)
        img[(xx / body_a) ** 2 + (yy / body_b) ** 2 < 1] = 0.45
        lung_a, lung_b = 0.3 + 0.08 * np.sin(np.pi * t), 0.45 + 0.1 * np.sin(np.pi * t)
        for cx in (-0.42, 0.42):
            img[((xx - cx) / lung_a) ** 2 + ((yy + 0.02) / lung_b) ** 2 < 1] = 0.08
        img[((xx + 0.05) / 0.2) ** 2 + ((yy - 0.05) / 0.22) ** 2 < 1] = 0.55  # heart
        for cx, cy, r in ((0.0, -0.2, 0.07), (-0.15, -0.12, 0.04), (0.15, -0.12, 0.04)):  # vessels
            img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = 0.7
        img[xx**2 + (yy - 0.55) ** 2 < 0.1**2] = 0.75  # vertebra
        # Brighter than anything else in the slice, so even a tiny model can find it.
        if pe[z]:
            r = rng.uniform(0.12, 0.18)
            cx = {-1: -0.38, 0: 0.0, 1: 0.38}[side] + rng.uniform(-0.05, 0.05)
            cy = rng.uniform(-0.3, -0.1)
            img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = 1.0
        img += np.roll(noise, (int(rng.integers(0, size)), int(rng.integers(0, size))), axis=(0, 1))
        pixels = (np.clip(img, 0.0, 1.0) * 255).astype(np.uint8)[:, :, None]
        sop = _uid(rng)
        jpeg = simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="GRAY", colorsubsampling="Gray")
        # Plain writes into the private staging tree: generate() publishes it with one rename.
        (series_dir / f"{sop}.jpg").write_bytes(jpeg)
        rows.append([study, series, sop, int(pe[z])] + [exam[name] for name in LABEL_COLUMNS[1:]])
    return rows
