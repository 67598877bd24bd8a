"""End to end: the same model, data and epochs as plain Lightning and as lightning-accel, alternated in one run.

* **plain**: torchvision ``ImageFolder`` + ``DataLoader`` (the project's default workers: half the CPUs, persistent),
  JPEG decode + resize + random crop every epoch on the CPU, ``TorchCheckpointIO``,
  ``ModelCheckpoint(save_top_k=2, save_last=True)`` every epoch, ``strategy="ddp"``.
* **accel**: ``CachedDataModule`` (decode once, then cached tensors) + ``GpuAugment`` (its CPU fallback here),
  ``DeltaCheckpointIO(async_save=True)`` under the same ``ModelCheckpoint``, ``ddp_1bit`` (``compression="auto"``
  when the strategy accepts it), ``PerformanceMonitor``.

Both: 2 CPU processes (gloo), the digits rendered as 224 px JPEGs, resized to ``IMAGE_SIZE`` for a small CNN that a
decoding input pipeline starves, SGD, the same seed. Both arms also carry a ``PerformanceMonitor`` for the bottleneck
verdict and the checkpoint stall (its own overhead: ``benchmarks/monitor_overhead.py``).

Lightning launches the second process by re-running this script; the ranks meet in each ``fit`` in the same order,
and only rank 0 writes the report. ``results``: per-epoch seconds, time to ``val_acc >= 0.9``, final ``val_acc``,
checkpoint stall, verdicts, per arm and run. ``ratios``: ``epoch_time_plain_over_accel`` (median of warm epochs: all
but each fit's first), ``time_to_acc_plain_over_accel``, ``final_acc_accel_minus_plain`` (means over runs).

    python benchmarks/end_to_end.py --quick --out /tmp/bench/end_to_end.json
"""

from __future__ import annotations

import inspect
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/end_to_end.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from benchmarks._harness import StepClock, median, parser, ratio, report
from benchmarks._models import SmallCNN

IMAGE_SIZE = 96  # the model's input; the JPEGs are 224 px and both pipelines resize them
BATCH_SIZE = 16  # per process: 32 per optimizer step, ~56 steps per epoch
TARGET_ACC = 0.9
MEAN, STD = (0.188, 0.188, 0.188), (0.318, 0.318, 0.318)
CROP = (0.85, 1.0)


class TimeToAccuracy(Callback):
    """Every validation's ``val_acc``, and the seconds from the start of training (``clock.started``) to the first
    validation at ``TARGET_ACC``."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.val_acc: list[float] = []
        self.time_to_acc: float | None = None

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        acc = float(trainer.callback_metrics["val_acc"])
        self.val_acc.append(acc)
        if self.time_to_acc is None and acc >= TARGET_ACC and self.clock.started is not None:
            self.time_to_acc = time.perf_counter() - self.clock.started


class PlainDigits(L.LightningDataModule):
    """torchvision ImageFolder + DataLoader: decode, resize and crop every sample every epoch."""

    def __init__(self, root: str, num_workers: int) -> None:
        super().__init__()
        self.root, self.num_workers = root, num_workers

    def setup(self, stage: str) -> None:
        import torchvision.transforms as T
        from torchvision.datasets import ImageFolder

        norm = [T.ToTensor(), T.Normalize(MEAN, STD)]
        train_t = T.Compose([T.RandomResizedCrop(IMAGE_SIZE, scale=CROP, antialias=True), *norm])
        val_t = T.Compose([T.Resize(IMAGE_SIZE, antialias=True), *norm])
        full = ImageFolder(self.root)
        n_val = len(full) // 10
        g = torch.Generator().manual_seed(0)
        perm = torch.randperm(len(full), generator=g).tolist()
        self.train = torch.utils.data.Subset(ImageFolder(self.root, transform=train_t), perm[n_val:])
        self.val = torch.utils.data.Subset(ImageFolder(self.root, transform=val_t), perm[:n_val])

    def _loader(self, ds: Any, shuffle: bool) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            ds,
            batch_size=BATCH_SIZE,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.train, True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.val, False)


def _onebit_strategy() -> Any:
    from lightning_accel.strategies import OneBitDDPStrategy

    # what a user gets without tuning: the defaults, with `compression="auto"` (it times fp32 against 1-bit at the end
    # of warm-up and keeps the faster, so on a loopback link it may keep fp32: the report's compression_decisions)
    kwargs: dict[str, Any] = {}
    if "compression" in inspect.signature(OneBitDDPStrategy.__init__).parameters:
        kwargs["compression"] = "auto"
    return OneBitDDPStrategy(**kwargs), kwargs


def fit(arm: str, run: int, root: Path, epochs: int) -> dict[str, Any]:
    """One fit of ``arm`` (``"plain"`` or ``"accel"``); every rank returns, rank 0's numbers are reported."""
    import lightning_accel as la
    from lightning_accel.data.dataset import default_num_workers

    L.seed_everything(run)
    work = root / f"{arm}{run}"
    monitor = la.PerformanceMonitor(report_path="", verbose=False)
    # the epoch as the user waits for it: training, validation and the checkpoint save (ModelCheckpoint saves in
    # on_validation_end, before on_train_epoch_end)
    clock = StepClock(per="epoch")
    acc = TimeToAccuracy(clock)
    ckpt = ModelCheckpoint(dirpath=str(work / "ckpt"), monitor="val_acc", mode="max", save_top_k=2, save_last=True)
    common: dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor, clock, acc, ckpt],
        default_root_dir=str(work),
    )
    strategy_kwargs: dict[str, Any] = {}
    if arm == "plain":
        dm: Any = PlainDigits(str(root / "digits224"), default_num_workers())
        trainer = L.Trainer(strategy="ddp", **common)
    else:
        dm = la.CachedDataModule(
            str(root / "digits224"),
            cache_dir=str(work / "cache"),
            ram_bytes="256MiB",
            image_size=IMAGE_SIZE,
            batch_size=BATCH_SIZE,
            val_fraction=0.1,
            train_augment=la.GpuAugment(MEAN, STD, crop_scale=CROP, flip_p=0.0),
            mean=MEAN,
            std=STD,
        )
        strategy, strategy_kwargs = _onebit_strategy()
        trainer = L.Trainer(strategy=strategy, plugins=[la.DeltaCheckpointIO(async_save=True)], **common)
    t0 = time.perf_counter()
    trainer.fit(SmallCNN(), datamodule=dm)
    wall = time.perf_counter() - t0
    r = monitor.report
    state = getattr(trainer.strategy, "onebit_state", None)
    decisions = list(state.decisions) if state is not None and hasattr(state, "decisions") else []
    return {
        "epoch_s": [round(x, 3) for x in clock.times],
        "val_acc": [round(x, 4) for x in acc.val_acc],
        "time_to_acc_s": None if acc.time_to_acc is None else round(acc.time_to_acc, 3),
        "final_val_acc": acc.val_acc[-1] if acc.val_acc else float("nan"),
        "fit_s": round(wall, 3),
        "checkpoint_stall_s": round(r.seconds["checkpoint"], 4) if r else None,
        "verdict": r.dominant if r else None,
        "shares": {k: round(v, 3) for k, v in r.shares.items() if v} if r else {},
        "strategy_kwargs": strategy_kwargs,
        "compression_decisions": decisions,  # compression="auto": both measured times and the choice
    }


def prepare(root: Path, num_images: int) -> None:
    """Render the 224 px digits (idempotent) and clear the previous run's checkpoints and caches."""
    from lightning_accel.datasets import materialize_digits

    materialize_digits(root / "digits224", size=224, num_images=num_images)
    for old in [*root.glob("plain*"), *root.glob("accel*")]:
        shutil.rmtree(old, ignore_errors=True)


def run_arms(root: Path, epochs: int, runs: int) -> dict[str, list[dict[str, Any]]]:
    """plain, accel, accel, plain, ...: machine drift is spread over both arms."""
    per: dict[str, list[dict[str, Any]]] = {"plain": [], "accel": []}
    for run in range(runs):
        for arm in ("plain", "accel") if run % 2 == 0 else ("accel", "plain"):
            per[arm].append(fit(arm, run, root, epochs))
    return per


def summarise(per: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, float]]:
    """Results per arm and the contract's ratios (warm epochs: all but each fit's first)."""

    def warm(arm: str) -> float:
        return median([s for r in per[arm] for s in r["epoch_s"][1:]])

    def tta(arm: str) -> float:
        vals = [r["time_to_acc_s"] for r in per[arm]]
        return statistics.mean(v for v in vals if v is not None) if all(v is not None for v in vals) else float("inf")

    def final(arm: str) -> float:
        return statistics.mean(r["final_val_acc"] for r in per[arm])

    results = {
        "plain": per["plain"],
        "accel": per["accel"],
        "warm_epoch_s_median": {"plain": warm("plain"), "accel": warm("accel")},
        "time_to_acc_s_mean": {"plain": tta("plain"), "accel": tta("accel")},
        "final_val_acc_mean": {"plain": round(final("plain"), 4), "accel": round(final("accel"), 4)},
        "checkpoint_stall_s_mean": {
            a: round(statistics.mean(r["checkpoint_stall_s"] or 0.0 for r in per[a]), 4) for a in per
        },
        "verdicts": {a: [r["verdict"] for r in per[a]] for a in per},
    }
    ratios = {
        "epoch_time_plain_over_accel": ratio(warm("plain"), warm("accel")),
        "time_to_acc_plain_over_accel": ratio(tta("plain"), tta("accel")),
        "final_acc_accel_minus_plain": round(final("accel") - final("plain"), 4),
    }
    return results, ratios


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    quick = args.quick
    epochs, runs, num_images = (5, 2, 2000) if quick else (8, 3, 4000)
    root = Path(os.environ.get("E2E_ROOT", "/tmp/lightning_accel_e2e"))
    rank0 = "LOCAL_RANK" not in os.environ  # the process Lightning relaunches has LOCAL_RANK set
    if rank0:
        prepare(root, num_images)
    torch.set_num_threads(1)  # 2 processes (+ workers) on 2 cores
    per = run_arms(root, epochs, runs)
    if not rank0:
        return
    results, ratios = summarise(per)
    config = {
        "epochs": epochs,
        "runs_per_arm": runs,
        "num_images": num_images,
        "jpeg_px": 224,
        "image_size": IMAGE_SIZE,
        "batch_size_per_process": BATCH_SIZE,
        "processes": 2,
        "target_acc": TARGET_ACC,
        "optimizer": "SGD(lr=0.01, momentum=0.9), cosine to 0 per step",
    }
    report("end_to_end", quick=quick, config=config, results=results, ratios=ratios, out=args.out)


if __name__ == "__main__":
    main()
