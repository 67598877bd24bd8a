"""Baseline: plain-Lightning epochs of the quickstart (torchvision ImageFolder + DataLoader, JPEG decode each epoch).

Every later plugin is measured against this. ``results`` has ``epoch_s_median`` (median over the epochs after the
first, which pays for worker start-up) and ``val_acc`` (after the last epoch).

    python benchmarks/quickstart.py --quick --out /tmp/q.json
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/quickstart.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L

from benchmarks._harness import StepClock, median, parser, ratio, report

IMAGE_SIZE = 64
BATCH_SIZE = 64


@dataclass
class BaselineRun:
    """What one quickstart ``fit`` measured."""

    epoch_s: list[float]
    epoch_samples: list[int]
    fit_s: float
    val_acc: float
    num_workers: int


def parse_args() -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="data/digits64", help="where the 64 px digits JPEGs live or are created")
    p.add_argument("--epochs", type=int, default=None, help="default: 3 (quick) or 5 (full)")
    return p.parse_args()


def fit_baseline(data_dir: str, epochs: int) -> BaselineRun:
    """The quickstart as a plain Lightning user runs it: ``DigitsDataModule`` (ImageFolder) + ``ImageClassifier``."""
    from lightning_accel.datasets import DigitsDataModule
    from lightning_accel.models import ImageClassifier

    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(data_dir=data_dir, image_size=IMAGE_SIZE, batch_size=BATCH_SIZE)
    model = ImageClassifier(width=32, lr=3e-3)
    timer = StepClock(per="epoch", count=lambda batch: len(batch[1]))  # seconds and training samples per epoch
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    fit_s = time.perf_counter() - t0
    val_acc = float(trainer.callback_metrics["val_acc"])
    return BaselineRun(timer.times, timer.samples, fit_s, val_acc, dm.num_workers)


def epoch_numbers(run: BaselineRun) -> tuple[dict[str, Any], dict[str, float]]:
    """``results`` and ``ratios`` of the run (later epochs' median; the first pays for worker start-up)."""
    later = run.epoch_s[1:] or run.epoch_s
    results = {
        "epoch_s_median": round(median(later), 4),
        "first_epoch_s": round(run.epoch_s[0], 4),
        "epoch_s_all": [round(t, 4) for t in run.epoch_s],
        "train_samples_per_s": round(run.epoch_samples[-1] / median(later), 1),
        "fit_s": round(run.fit_s, 2),
        "val_acc": round(run.val_acc, 4),
    }
    ratios = {
        "first_epoch_vs_later": ratio(run.epoch_s[0], median(later)),
        "val_acc_vs_target_0_95": ratio(run.val_acc, 0.95),
    }
    return results, ratios


def main() -> None:
    args = parse_args()
    epochs = args.epochs or (3 if args.quick else 5)
    run = fit_baseline(args.data_dir, epochs)
    results, ratios = epoch_numbers(run)
    config = {
        "epochs": epochs,
        "image_size": IMAGE_SIZE,
        "batch_size": BATCH_SIZE,
        "num_workers": run.num_workers,
        "model": "ImageClassifier(width=32)",
        "data": "DigitsDataModule (ImageFolder + DataLoader)",
    }
    report(
        "quickstart",
        quick=args.quick,
        config=config,
        results=results,
        ratios=ratios,
        out=args.out,
        chart={f"epoch {i + 1}": t for i, t in enumerate(run.epoch_s)},
        chart_title="quickstart: seconds per epoch",
    )


if __name__ == "__main__":
    main()
