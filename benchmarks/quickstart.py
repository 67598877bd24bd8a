"""Baseline: plain-Lightning epochs of the quickstart (torchvision ImageFolder + DataLoader, JPEG decode each epoch).

Every later plugin is measured against this. ``results`` has ``epoch_s_median`` (median over the epochs after the
first, which pays for worker start-up) and ``val_acc`` (after the last epoch).

    python benchmarks/quickstart.py --quick --out /tmp/q.json
"""

from __future__ import annotations

import time

from _harness import median, parser, ratio, report


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="data/digits64", help="where the 64 px digits JPEGs live or are created")
    p.add_argument("--epochs", type=int, default=None, help="default: 3 (quick) or 5 (full)")
    args = p.parse_args()
    epochs = args.epochs or (3 if args.quick else 5)

    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_accel.datasets import DigitsDataModule
    from lightning_accel.models import ImageClassifier

    class EpochTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.samples: list[int] = []

        def on_train_epoch_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            self._t0, self._n = time.perf_counter(), 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self._n += len(batch[1])

        def on_train_epoch_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            self.times.append(time.perf_counter() - self._t0)
            self.samples.append(self._n)

    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(data_dir=args.data_dir, image_size=64, batch_size=64)
    model = ImageClassifier(width=32, lr=3e-3)
    timer = EpochTimer()
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
    later = timer.times[1:] or timer.times
    results = {
        "epoch_s_median": round(median(later), 4),
        "first_epoch_s": round(timer.times[0], 4),
        "epoch_s_all": [round(t, 4) for t in timer.times],
        "train_samples_per_s": round(timer.samples[-1] / median(later), 1),
        "fit_s": round(fit_s, 2),
        "val_acc": round(val_acc, 4),
    }
    ratios = {
        "first_epoch_vs_later": ratio(timer.times[0], median(later)),
        "val_acc_vs_target_0_95": ratio(val_acc, 0.95),
    }
    config = {
        "epochs": epochs,
        "image_size": 64,
        "batch_size": 64,
        "num_workers": dm.num_workers,
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
        chart={f"epoch {i + 1}": t for i, t in enumerate(timer.times)},
        chart_title="quickstart: seconds per epoch",
    )


if __name__ == "__main__":
    main()
