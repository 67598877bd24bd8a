"""The passes a Trainer makes besides whole epochs (the sanity check, ``overfit_batches`` under DDP) read only what
they take, and from the samples a plain ``DataLoader`` would give each rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L

from lightning_accel._utils.compat import index_sampler
from lightning_accel.data import CachedDataModule
from lightning_accel.models import ImageClassifier


def _dm(origin: Path, tmp: Path, **kw: Any) -> CachedDataModule:
    kw = {"num_workers": 0, "batch_size": 8, "val_fraction": 0.5, **kw}
    return CachedDataModule(str(origin), cache_dir=str(tmp / "cache"), ram_dir=str(tmp / "ram"), image_size=16, **kw)


def _model() -> ImageClassifier:
    model = ImageClassifier(width=8, blocks=(1,))
    model.example_input_array = None
    return model


def _trainer(**kw: Any) -> L.Trainer:
    kw = {"max_epochs": 1, "accelerator": "cpu", "devices": 1, **kw}
    return L.Trainer(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw
    )


class _AtSanityEnd(L.Callback):
    """What the validation loader had read, and would read, when the sanity check ends."""

    def __init__(self, dm: CachedDataModule) -> None:
        self.dm = dm
        self.fetches = -1
        self.batches = -1
        self.warm: bool | None = None

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader: Any = trainer.val_dataloaders
        self.fetches = int(self.dm.cache_stats["origin_fetches"])
        self.batches = sum(1 for _ in index_sampler(loader))  # what a pass started now draws its indices from
        self.warm = bool(loader.is_warm)
        trainer.should_stop = True  # only the sanity check is wanted: the fit ends before its first epoch


# ---- the sanity check ------------------------------------------------------------------------------------------------
def test_the_sanity_check_reads_only_the_batches_it_takes(small_digits: Path, tmp_path: Path) -> None:
    """100 validation samples in 13 batches of 8; the sanity check takes 2 of them: 16 samples read from the origin,
    not the 4 batches the main-process read-ahead would have read beyond them."""
    dm = _dm(small_digits, tmp_path)
    probe = _AtSanityEnd(dm)
    _trainer(num_sanity_val_steps=2, callbacks=[probe]).fit(_model(), datamodule=dm)
    assert probe.fetches == 16
    assert probe.batches == 2


def test_the_sanity_check_does_not_decide_the_warm_path(small_digits: Path, tmp_path: Path) -> None:
    """The sanity check's 2 batches cached (an earlier run's) say nothing of the 11 that the validation epochs read:
    the loader stays on its cold path (workers) for them."""
    first = _dm(small_digits, tmp_path, num_workers=1)
    _trainer(num_sanity_val_steps=2, callbacks=[_AtSanityEnd(first)]).fit(_model(), datamodule=first)
    dm = _dm(small_digits, tmp_path, num_workers=1)
    probe = _AtSanityEnd(dm)
    _trainer(num_sanity_val_steps=2, callbacks=[probe]).fit(_model(), datamodule=dm)
    assert probe.fetches == 0  # the 2 batches came from the cache
    assert probe.warm is False


# ---- overfit_batches under DDP ---------------------------------------------------------------------------------------
class _TrainOrder(L.Callback):
    """The dataset positions each training pass draws, as the loader's index sampler yields them."""

    def __init__(self) -> None:
        self.orders: list[list[int]] = []
        self.sampler = ""
        self.warm: list[bool] = []
        self.val_orders: list[list[int]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader: Any = trainer.train_dataloader
        self.sampler = type(loader.sampler).__name__
        self.orders.append([i for b in index_sampler(loader) for i in b][:16])  # the 2 batches the pass takes

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.warm.append(bool(getattr(trainer.train_dataloader, "is_warm", False)))

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader: Any = trainer.val_dataloaders
        self.val_orders.append([i for b in index_sampler(loader) for i in b][:16])


class _FloatModel(ImageClassifier):
    """Normalises the uint8 batches itself (what the data module's ``on_after_batch_transfer`` does)."""

    def __init__(self) -> None:
        super().__init__(width=8, blocks=(1,))
        self.example_input_array = None

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return x.float() / 255, y


def _overfit_rank(
    rank: int, world: int, origin: str, tmp: str, plain: bool
) -> tuple[list[list[int]], list[bool], list[list[int]]]:
    from torch.utils.data import DataLoader

    from lightning_accel.data.dataset import collate_batch

    dm = _dm(Path(origin), Path(tmp), num_workers=1)
    order = _TrainOrder()
    trainer = _trainer(
        max_epochs=3, devices=2, strategy="ddp", overfit_batches=2, num_sanity_val_steps=0, callbacks=[order]
    )
    if plain:  # the same samples in a plain DataLoader: what Lightning itself does with `overfit_batches`
        dm.setup("fit")
        assert dm.train_set is not None and dm.val_set is not None
        train = DataLoader(dm.train_set, batch_size=8, shuffle=True, collate_fn=collate_batch)
        val = DataLoader(dm.val_set, batch_size=8, collate_fn=collate_batch)
        trainer.fit(_FloatModel(), train_dataloaders=train, val_dataloaders=val)
    else:
        trainer.fit(_model(), datamodule=dm)
    return order.orders, order.warm, order.val_orders


def test_overfit_batches_under_ddp_reads_each_rank_its_own_samples_and_goes_warm(
    small_digits: Path, tmp_path: Path
) -> None:
    """Lightning puts a ``SequentialSampler`` in a plain loader for ``overfit_batches`` and, under DDP, a
    ``DistributedSampler`` over it: each rank takes its own fixed 2 batches of each split. The cached loaders (whose
    unshuffled samplers Lightning keeps) read the same, and the training one goes warm once those are cached: its warm
    check looks at the pass's order (over the whole training split, 32 of 100 samples read, it stayed cold for good)."""
    from tests.helpers import run_in_processes

    args = (str(small_digits), str(tmp_path / "plain"), True)
    plain = run_in_processes(_overfit_rank, 2, args, init_process_group=False, timeout=240)
    args = (str(small_digits), str(tmp_path / "cached"), False)
    cached = run_in_processes(_overfit_rank, 2, args, init_process_group=False, timeout=240)
    ((p0, p0_again, _), _, pv0), ((p1, _, _), _, pv1) = plain
    assert p0 == p0_again and not set(p0) & set(p1)  # Lightning: fixed batches, each rank its own samples
    ((c0, c0_again, _), warm0, cv0), ((c1, _, _), warm1, cv1) = cached
    assert (c0, c1) == (p0, p1) and c0_again == c0
    assert warm0 == warm1 == [False, True, True]
    # validation too: each rank its own part of the split, unshuffled, with the cached loader as with a plain one
    assert len(pv0) == 3 and pv0[0] and not set(pv0[0]) & set(pv1[0])
    assert (cv0, cv1) == (pv0, pv1)
