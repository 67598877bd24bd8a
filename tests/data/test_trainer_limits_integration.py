"""Trainer limits (``overfit_batches``, ``limit_train_batches``) through ``CachedDataModule`` take the batches a plain
Lightning ``DataLoader`` would, also across a resume and from one fit to the next on the same module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_accel.data.dataset import collate_batch
from lightning_accel.models import ImageClassifier
from tests.data.test_resume_integration import _dm, _Kill


class _Seen(ImageClassifier):
    """Records ``(epoch, labels)`` of every training batch and the labels of every validation batch."""

    def __init__(self) -> None:
        super().__init__(width=8, blocks=(1,))
        self.example_input_array = None
        self.seen: list[tuple[int, list[int]]] = []
        self.val_seen: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch[1].tolist()))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.val_seen.append(batch[1].tolist())
        return super().validation_step(batch, batch_idx)


class _Plain(_Seen):
    """Normalises the uint8 batches of a plain ``DataLoader`` itself (the data module does it for its own)."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return x.float() / 255, y


def _trainer(*callbacks: L.Callback, **kw: Any) -> L.Trainer:
    kw = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        **kw,
    }
    return L.Trainer(callbacks=list(callbacks), **kw)


def _plain_loaders(origin: Path, tmp: Path) -> tuple[DataLoader, DataLoader]:
    dm = _dm(origin, tmp)
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    train = DataLoader(dm.train_set, batch_size=16, shuffle=True, collate_fn=collate_batch)
    return train, DataLoader(dm.val_set, batch_size=16, collate_fn=collate_batch)


# ---- overfit_batches, then a fit without it on the same module -------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_fit_after_an_overfit_fit_on_the_same_module_reads_whole_shuffled_epochs(
    small_digits: Path, tmp_path: Path, num_workers: int
) -> None:
    """Lightning swaps in a ``SequentialSampler`` (a rebuilt loader) under ``overfit_batches``: the overfit fit takes
    the batches a plain ``DataLoader`` gives it, and the module's next fit gets a fresh, shuffled loader."""
    fresh = _Seen()
    _trainer().fit(fresh, datamodule=_dm(small_digits, tmp_path, num_workers=num_workers))
    dm = _dm(small_digits, tmp_path, num_workers=num_workers)
    over = _Seen()
    overfit = {"max_epochs": 2, "overfit_batches": 2, "limit_val_batches": 1.0}
    _trainer(**overfit).fit(over, datamodule=dm)
    # what Lightning does with plain loaders: the first 2 batches of each split in order, every epoch
    train, val = _plain_loaders(small_digits, tmp_path)
    plain = _Plain()
    _trainer(**overfit).fit(plain, train_dataloaders=train, val_dataloaders=val)
    assert over.seen == plain.seen and len(over.seen) == 4
    assert over.val_seen == plain.val_seen and len(over.val_seen) == 4
    again = _Seen()
    _trainer().fit(again, datamodule=dm)
    assert again.seen == fresh.seen and len(again.seen) == 10  # 160 samples, whole and shuffled as a fresh module's


def test_validate_after_an_overfit_fit_reads_the_whole_validation_split(small_digits: Path, tmp_path: Path) -> None:
    dm = _dm(small_digits, tmp_path)
    _trainer(overfit_batches=2).fit(_Seen(), datamodule=dm)
    model = _Seen()
    _trainer(limit_val_batches=1.0).validate(model, datamodule=dm)
    _, val = _plain_loaders(small_digits, tmp_path)
    assert model.val_seen == [b[1].tolist() for b in val] and len(model.val_seen) == 3  # 40 samples


# ---- limit_train_batches across a mid-epoch resume -------------------------------------------------------------------
def _resumed_epoch(fit: Any, tmp: Path, limit: int) -> tuple[_Seen, L.Trainer]:
    """Train ``fit`` (``fit(trainer, ckpt_path) -> model``) to step 3 with a checkpoint at step 2, then resume."""
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(RuntimeError, match="killed"):
        fit(_trainer(ckpt, _Kill(at_step=3), enable_checkpointing=True, limit_train_batches=limit), None)
    trainer = _trainer(limit_train_batches=limit)
    return fit(trainer, next((tmp / "ckpt").glob("*step=2.ckpt"))), trainer


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_resume_mid_epoch_under_limit_train_batches_takes_only_the_batches_left(
    small_digits: Path, tmp_path: Path, num_workers: int
) -> None:
    """A checkpoint 2 batches into an epoch limited to 5: the resumed epoch takes the 3 left, as Lightning does with a
    plain ``DataLoader`` (whose resumed epoch starts over; the cached loader's continues where the checkpoint was)."""

    def plain(trainer: L.Trainer, ckpt: Path | None) -> _Seen:
        train, _ = _plain_loaders(small_digits, tmp_path)
        trainer.fit(model := _Plain(), train_dataloaders=train, ckpt_path=ckpt)
        return model

    def cached(trainer: L.Trainer, ckpt: Path | None) -> _Seen:
        trainer.fit(model := _Seen(), datamodule=_dm(small_digits, tmp_path, num_workers=num_workers), ckpt_path=ckpt)
        return model

    full = cached(_trainer(limit_train_batches=5), None)
    p, pt = _resumed_epoch(plain, tmp_path / "plain", limit=5)
    c, ct = _resumed_epoch(cached, tmp_path / "cached", limit=5)
    assert len(p.seen) == 3 and pt.global_step == 5  # Lightning: the 5 - 2 batches left of the epoch
    assert len(c.seen) == len(p.seen) and ct.global_step == pt.global_step
    assert c.seen == full.seen[2:5]  # and the cached loader's are the uninterrupted epoch's batches 3 to 5


# ---- reload_dataloaders_every_n_epochs across a mid-epoch resume ----------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_resumed_run_that_reloads_its_loaders_every_epoch_reads_the_later_epochs_whole(
    small_digits: Path, tmp_path: Path, num_workers: int
) -> None:
    """The loader rebuilt for the epoch after the resumed one starts that epoch whole, in the uninterrupted order."""

    def fit(trainer: L.Trainer, ckpt: Path | None) -> _Seen:
        dm = _dm(small_digits, tmp_path, num_workers=num_workers)
        trainer.fit(model := _Seen(), datamodule=dm, ckpt_path=ckpt)
        return model

    reload = {"max_epochs": 3, "reload_dataloaders_every_n_epochs": 1}
    full = fit(_trainer(**reload), None)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=13, save_top_k=-1)
    with pytest.raises(RuntimeError, match="killed"):
        fit(_trainer(ckpt, _Kill(at_step=15), enable_checkpointing=True, **reload), None)
    second = fit(_trainer(**reload), next((tmp_path / "ckpt").glob("*step=13.ckpt")))
    assert second.seen == full.seen[13:] and len(second.seen) == 17  # 7 batches of epoch 1, then epoch 2 whole


# ---- overfit_batches: no shuffling warning, and a mid-epoch resume ---------------------------------------------------
def test_overfit_batches_does_not_report_the_unshuffled_loaders_as_shuffling(
    small_digits: Path, tmp_path: Path
) -> None:
    """Lightning warns that a loader shuffles when its sampler is not a ``SequentialSampler``: the cached loaders of an
    overfit fit read their fixed first batches (as it would make them) and are not reported."""
    import warnings

    model, dm = _Seen(), _dm(small_digits, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(max_epochs=2, overfit_batches=2, limit_val_batches=1.0).fit(model, datamodule=dm)
    said = [str(w.message) for w in caught if "requested to overfit" in str(w.message)]
    assert said == []
    train, val = _plain_loaders(small_digits, tmp_path)
    first = [b[1].tolist() for b in DataLoader(train.dataset, batch_size=16, collate_fn=collate_batch)][:2]
    assert [s for _, s in model.seen] == first * 2  # the first 2 batches in order, every epoch
    assert model.val_seen == [b[1].tolist() for b in val][:2] * 2


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_resume_mid_epoch_under_overfit_batches_takes_the_uninterrupted_batches(
    small_digits: Path, tmp_path: Path, num_workers: int
) -> None:
    """A checkpoint 2 batches into an epoch of 4 overfit batches: the resumed epoch takes batches 3 and 4, then the
    next epoch its 4 again, as the uninterrupted fit does (the position saved is that of the order actually read)."""

    def fit(trainer: L.Trainer, ckpt: Path | None) -> _Seen:
        trainer.fit(model := _Seen(), datamodule=_dm(small_digits, tmp_path, num_workers=num_workers), ckpt_path=ckpt)
        return model

    overfit = {"max_epochs": 2, "overfit_batches": 4}
    full = fit(_trainer(**overfit), None)
    assert len(full.seen) == 8 and [s for _, s in full.seen[:4]] == [s for _, s in full.seen[4:]]
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(RuntimeError, match="killed"):
        fit(_trainer(ckpt, _Kill(at_step=3), enable_checkpointing=True, **overfit), None)
    trainer = _trainer(**overfit)
    resumed = fit(trainer, next((tmp_path / "ckpt").glob("*step=2.ckpt")))
    assert resumed.seen == full.seen[2:] and trainer.global_step == 8
