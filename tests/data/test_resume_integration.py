"""Trainer-level: a run killed mid-epoch and resumed with ``ckpt_path`` reads exactly that epoch's samples not yet
seen; ``seed_everything`` makes ``GpuAugment(seed=None)`` repeat; a ``cache_dir`` that is a file fails in
``__init__``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_accel.data import CachedDataModule, GpuAugment
from lightning_accel.models import ImageClassifier


class _Seen(ImageClassifier):
    """Records a fingerprint of every training sample it is given, per epoch (no augmentation: deterministic)."""

    def __init__(self) -> None:
        super().__init__(width=8, blocks=(1,))
        self.example_input_array = None
        self.seen: list[tuple[int, float, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        sums = x.flatten(1).sum(1).tolist()
        self.seen += [(self.current_epoch, round(s, 3), int(c)) for s, c in zip(sums, y.tolist(), strict=True)]
        return super().training_step(batch, batch_idx)


class _Kill(L.Callback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            raise RuntimeError("killed")


def _dm(origin: Path, tmp: Path, **kw: Any) -> CachedDataModule:
    kw = {
        "cache_dir": str(tmp / "cache"),
        "ram_dir": str(tmp / "ram"),
        "ram_bytes": "4MiB",
        "image_size": 16,
        "batch_size": 16,
        "num_workers": 0,
        "val_fraction": 0.2,
        **kw,
    }
    return CachedDataModule(str(origin), **kw)


def _trainer(tmp: Path, *callbacks: L.Callback, **kw: Any) -> L.Trainer:
    kw = {
        "max_epochs": 2,
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        **kw,
    }
    return L.Trainer(callbacks=list(callbacks), **kw)


def test_a_run_killed_mid_epoch_resumes_with_the_samples_not_yet_seen(small_digits: Path, tmp_path: Path) -> None:
    full = _Seen()
    _trainer(tmp_path, enable_checkpointing=False).fit(full, datamodule=_dm(small_digits, tmp_path))
    # 160 training samples, batch 16: 10 steps per epoch; a checkpoint at step 13 is 3 batches into epoch 2
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=13, save_top_k=-1)
    first = _Seen()
    with pytest.raises(RuntimeError, match="killed"):
        _trainer(tmp_path, ckpt, _Kill(at_step=15)).fit(first, datamodule=_dm(small_digits, tmp_path))
    path = next((tmp_path / "ckpt").glob("*step=13.ckpt"))
    second = _Seen()
    trainer = _trainer(tmp_path, enable_checkpointing=False)
    with pytest.warns() as record:
        trainer.fit(second, datamodule=_dm(small_digits, tmp_path), ckpt_path=path)
    assert not [w for w in record if "not resumable" in str(w.message)]  # Lightning sees a resumable loader
    assert trainer.global_step == 20
    before = first.seen[: 13 * 16]  # what the killed run had trained on when it saved
    assert before + second.seen == full.seen  # the rest of epoch 2, in the same order, each sample once
    assert len(second.seen) == 7 * 16


def test_a_resumed_run_continues_the_augmentation_stream(small_digits: Path, tmp_path: Path) -> None:
    def dm() -> CachedDataModule:  # random crops, flips and brightness; its own seed
        aug = GpuAugment((0.2,) * 3, (0.3,) * 3, crop_scale=(0.5, 1.0), flip_p=0.5, brightness=0.2, seed=3)
        return _dm(small_digits, tmp_path, train_augment=aug)

    full = _Seen()
    _trainer(tmp_path, enable_checkpointing=False).fit(full, datamodule=dm())
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=13, save_top_k=-1)
    first = _Seen()
    with pytest.raises(RuntimeError, match="killed"):
        _trainer(tmp_path, ckpt, _Kill(at_step=15)).fit(first, datamodule=dm())
    path = next((tmp_path / "ckpt").glob("*step=13.ckpt"))
    assert torch.load(path, weights_only=True)["CachedDataModule"]["train_augment_calls"] == 13
    second = _Seen()
    resumed = dm()
    _trainer(tmp_path, enable_checkpointing=False).fit(second, datamodule=resumed, ckpt_path=path)
    assert first.seen[: 13 * 16] + second.seen == full.seen  # the same samples, augmented alike
    assert resumed.train_augment.calls == 20


class _Metrics(ImageClassifier):
    def __init__(self) -> None:
        super().__init__(width=8, blocks=(1,))
        self.example_input_array = None
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss


def _seeded_run(origin: Path, tmp: Path, seed: int) -> list[float]:
    L.seed_everything(seed, workers=True)
    aug = GpuAugment((0.2,) * 3, (0.3,) * 3, crop_scale=(0.5, 1.0), flip_p=0.5, brightness=0.2)
    model = _Metrics()
    _trainer(tmp, enable_checkpointing=False, max_epochs=1, limit_train_batches=4).fit(
        model, datamodule=_dm(origin, tmp, train_augment=aug)
    )
    return model.losses


def test_seed_everything_reaches_gpu_augment(small_digits: Path, tmp_path: Path) -> None:
    a = _seeded_run(small_digits, tmp_path, 7)
    b = _seeded_run(small_digits, tmp_path, 7)
    c = _seeded_run(small_digits, tmp_path, 8)
    assert a == b  # the same config twice: identical metrics
    assert a != c
    x = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    torch.manual_seed(3)
    p = GpuAugment(crop_scale=(0.5, 1.0))(x, train=True)
    torch.manual_seed(3)
    q = GpuAugment(crop_scale=(0.5, 1.0))(x, train=True)
    torch.manual_seed(4)
    r = GpuAugment(crop_scale=(0.5, 1.0))(x, train=True)
    assert torch.equal(p, q) and not torch.equal(p, r)


def test_a_cache_dir_that_is_a_file_is_refused_in_init(tmp_path: Path) -> None:
    f = tmp_path / "cache"
    f.write_text("not a directory")
    for bad in (f, f / "sub"):
        with pytest.raises(ValueError, match=r"`cache_dir` must be a directory.*is a file.*Pass a directory"):
            CachedDataModule(str(tmp_path), cache_dir=str(bad))


def test_a_run_resumed_from_an_end_of_epoch_checkpoint_trains_the_next_epoch_through_workers(
    small_digits: Path, tmp_path: Path
) -> None:
    """A cold cache on resume (another node, a lost tier) reads through DataLoader workers, which draw the resumed
    epoch's indices before Lightning calls ``set_epoch``: the sampler must already be at the next epoch."""
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    _trainer(tmp_path, ckpt, max_epochs=1).fit(_Seen(), datamodule=_dm(small_digits, tmp_path, num_workers=1))
    path = next((tmp_path / "ckpt").glob("epoch=0-*.ckpt"))
    second = _Seen()
    fresh = tmp_path / "fresh"  # nothing cached: the resumed epoch is cold, read by the worker
    trainer = _trainer(fresh, enable_checkpointing=False)
    trainer.fit(second, datamodule=_dm(small_digits, fresh, num_workers=1), ckpt_path=path)
    assert trainer.global_step == 20
    assert len(second.seen) == 160 and {e for e, _, _ in second.seen} == {1}  # all of epoch 1, nothing skipped


def _killed_after_step_3(origin: Path, tmp_path: Path) -> tuple[_Seen, Path]:
    """A fit in batches of 16 checkpointed at step 3 and killed at step 4: the model it trained and that checkpoint."""
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    first = _Seen()
    with pytest.raises(RuntimeError, match="killed"):
        _trainer(tmp_path, ckpt, _Kill(at_step=4), max_epochs=1).fit(first, datamodule=_dm(origin, tmp_path))
    return first, next((tmp_path / "ckpt").glob("*step=3.ckpt"))


@pytest.mark.parametrize("new_batch", [20, 12])
def test_a_run_resumed_mid_epoch_with_another_batch_size_reads_every_remaining_sample(
    small_digits: Path, tmp_path: Path, new_batch: int
) -> None:
    """The Trainer counts the checkpoint's batches (of 16) as done and stops the epoch at ``len(loader)`` batches of
    the new size: the loader's length must leave room for every remaining sample (the last partial batch of 20 was
    never asked for)."""
    first, path = _killed_after_step_3(small_digits, tmp_path)
    second = _Seen()
    trainer = _trainer(tmp_path, enable_checkpointing=False, max_epochs=2)
    trainer.fit(second, datamodule=_dm(small_digits, tmp_path, batch_size=new_batch), ckpt_path=path)
    before = [s[1:] for s in first.seen[: 3 * 16]]
    after = [s[1:] for s in second.seen if s[0] == 0]
    assert len(before) + len(after) == 160  # epoch 0: each of the 160 training samples once
    assert len(set(before) | set(after)) == len(set(s[1:] for s in first.seen + second.seen if s[0] == 0))
    assert sorted(s[1:] for s in second.seen if s[0] == 1) == sorted(before + after)  # epoch 1 whole, same samples
    assert trainer.global_step == 3 + -(-(160 - 48) // new_batch) + -(-160 // new_batch)


class _SeenBatches(_Seen):
    """Also records the size of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.sizes.append((self.current_epoch, len(batch[1])))
        return super().training_step(batch, batch_idx)


def test_a_run_resumed_with_another_batch_size_never_trains_a_batchnorm_model_on_one_sample(
    small_digits: Path, tmp_path: Path
) -> None:
    """A whole epoch of 160 samples in batches of 37 ends in 12, but the 112 left after 3 checkpointed batches of 16
    end in a batch of one sample, on which a BatchNorm model cannot train (a ResNet whose feature map is down to 1x1
    crashes): the resumed epoch ends one sample early instead, as a whole epoch would."""
    first, path = _killed_after_step_3(small_digits, tmp_path)
    second = _SeenBatches()
    trainer = _trainer(tmp_path, enable_checkpointing=False, max_epochs=2)
    trainer.fit(second, datamodule=_dm(small_digits, tmp_path, batch_size=37), ckpt_path=path)
    assert [n for e, n in second.sizes if e == 0] == [37, 37, 37]  # 111 of the 112 left; no batch of one
    assert [n for e, n in second.sizes if e == 1] == [37, 37, 37, 37, 12]  # the next epoch whole
    before = [s[1:] for s in first.seen[: 3 * 16]]
    after = [s[1:] for s in second.seen if s[0] == 0]
    assert len(set(before + after)) == len(before) + len(after) == 159  # each sample at most once


class _EpochEnds(L.Callback):
    """Records, in order, the ends of training epochs beside the data module's undecodable-sample warnings."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.events.append(f"epoch {trainer.current_epoch} ended")


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_resumed_epoch_reports_its_skipped_samples_when_it_ends(
    small_digits: Path, tmp_path: Path, num_workers: int
) -> None:
    import shutil
    import warnings

    origin = tmp_path / "origin"
    shutil.copytree(small_digits, origin)
    for p in sorted((origin / "4").glob("*.jpg"))[:8]:
        p.write_bytes(b"")  # undecodable; some of them fall in the part of epoch 1 left after the checkpoint

    def dm() -> CachedDataModule:
        return _dm(origin, tmp_path, num_workers=num_workers, on_decode_error="skip")

    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=13, save_top_k=-1)
    _trainer(tmp_path, ckpt, max_steps=13).fit(_Seen(), datamodule=dm())
    path = next((tmp_path / "ckpt").glob("*step=13.ckpt"))
    events: list[str] = []

    def record(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        if "undecodable" in str(message):
            events.append(str(message))

    with warnings.catch_warnings():  # restores `showwarning` on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record  # in the order they come, beside the epoch ends
        _trainer(tmp_path, _EpochEnds(events), enable_checkpointing=False).fit(_Seen(), datamodule=dm(), ckpt_path=path)
    assert len(events) == 2, events
    assert events[1] == "epoch 1 ended"  # reported as the resumed epoch ends, not at teardown
    assert events[0].startswith("lightning_accel data: rank 0 skipped ")
    assert " undecodable sample(s) in training (epoch 1; " in events[0]


def test_a_fit_after_a_resumed_fit_starts_its_first_epoch_whole(small_digits: Path, tmp_path: Path) -> None:
    full = _Seen()
    _trainer(tmp_path, max_epochs=1, enable_checkpointing=False).fit(full, datamodule=_dm(small_digits, tmp_path))
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    _trainer(tmp_path, ckpt, max_steps=3).fit(_Seen(), datamodule=_dm(small_digits, tmp_path))
    dm = _dm(small_digits, tmp_path)
    resumed = _Seen()
    # the resumed fit ends with the epoch it resumed: no batch of a later epoch reaches the module
    _trainer(tmp_path, max_epochs=1, enable_checkpointing=False).fit(
        resumed, datamodule=dm, ckpt_path=next((tmp_path / "ckpt").glob("*step=3.ckpt"))
    )
    assert len(resumed.seen) == 7 * 16
    # the same module in a new fit without `ckpt_path`: the checkpoint's position is not applied again
    again = _Seen()
    _trainer(tmp_path, max_epochs=1, enable_checkpointing=False).fit(again, datamodule=dm)
    assert again.seen == full.seen


def test_a_fit_after_validating_a_mid_epoch_checkpoint_starts_its_first_epoch_whole(
    small_digits: Path, tmp_path: Path
) -> None:
    """``validate`` (like ``test`` and ``predict``) with ``ckpt_path`` restores the datamodule's state too; the
    checkpoint's training position must not carry over into a later ``fit`` without ``ckpt_path``."""
    full = _Seen()
    _trainer(tmp_path, max_epochs=1, enable_checkpointing=False).fit(full, datamodule=_dm(small_digits, tmp_path))
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    aug = {"train_augment": GpuAugment(crop_scale=(0.5, 1.0), seed=3)}
    _trainer(tmp_path, ckpt, max_steps=3).fit(_Seen(), datamodule=_dm(small_digits, tmp_path, **aug))
    assert aug["train_augment"].calls == 3
    dm = _dm(small_digits, tmp_path)
    _trainer(tmp_path, limit_val_batches=1).validate(
        _Seen(), datamodule=dm, ckpt_path=next((tmp_path / "ckpt").glob("*step=3.ckpt"))
    )
    again = _Seen()
    _trainer(tmp_path, max_epochs=1, enable_checkpointing=False).fit(again, datamodule=dm)
    assert again.seen == full.seen  # every sample of epoch 0, in the same order (48 were skipped before)
    dm = _dm(small_digits, tmp_path, train_augment=GpuAugment(crop_scale=(0.5, 1.0), seed=3))
    _trainer(tmp_path, limit_val_batches=1).validate(
        _Seen(), datamodule=dm, ckpt_path=next((tmp_path / "ckpt").glob("*step=3.ckpt"))
    )
    assert dm.train_augment.calls == 0  # the augmentation stream is not moved by a validation either


def test_a_run_resumed_after_an_epoch_cut_short_by_limit_train_batches_reads_the_next_epochs_order(
    small_digits: Path, tmp_path: Path
) -> None:
    """``limit_train_batches`` ends each epoch before its order does; the end-of-epoch checkpoint must resume at the
    next epoch. Before, it read as mid-epoch, and the resumed epoch (its indices drawn by a DataLoader worker before
    Lightning's ``set_epoch``) trained on the rest of the previous epoch's order."""
    limited = {"limit_train_batches": 3, "enable_checkpointing": False}
    full = _Seen()
    _trainer(tmp_path, **limited).fit(full, datamodule=_dm(small_digits, tmp_path, num_workers=1))
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    first = _dm(small_digits, tmp_path, num_workers=1)
    _trainer(tmp_path, ckpt, max_epochs=1, limit_train_batches=3).fit(_Seen(), datamodule=first)
    assert first.state_dict()["train_sampler"]["consumed"] >= 160  # the epoch is over, though 48 were read
    resumed = _Seen()
    _trainer(tmp_path, **limited).fit(
        resumed, datamodule=_dm(small_digits, tmp_path, num_workers=1), ckpt_path=next((tmp_path / "ckpt").glob("*"))
    )
    assert resumed.seen == [s for s in full.seen if s[0] == 1] and len(resumed.seen) == 48


def test_an_end_of_epoch_checkpoint_resumes_under_another_seed_with_a_warning_about_the_split(
    small_digits: Path, tmp_path: Path
) -> None:
    """The refusal of another seed says to resume from an end-of-epoch checkpoint: that must work, and say that the
    held-out split follows the seed too."""
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    _trainer(tmp_path, ckpt, max_epochs=1).fit(_Seen(), datamodule=_dm(small_digits, tmp_path))
    resumed = _Seen()
    with pytest.warns(UserWarning, match=r"trained with `seed` 0, this module has 1: the seed also picks the 0\.2"):
        _trainer(tmp_path, enable_checkpointing=False).fit(
            resumed, datamodule=_dm(small_digits, tmp_path, seed=1), ckpt_path=next((tmp_path / "ckpt").glob("*"))
        )
    assert len(resumed.seen) == 160 and {s[0] for s in resumed.seen} == {1}  # epoch 1, whole
