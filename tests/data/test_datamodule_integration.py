from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_accel.data import CachedDataModule, GpuAugment
from lightning_accel.models import ImageClassifier
from tests.helpers import run_in_processes


class _Checked(ImageClassifier):
    """Asserts what reaches the model: float normalised images, int labels."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        assert x.dtype == torch.float32 and x.shape[1:] == (3, 16, 16) and y.dtype == torch.int64
        assert x.min() < 0  # normalised, not [0, 1] or [0, 255]
        return super().training_step(batch, batch_idx)


def _dm(origin: Path, tmp: Path, **kw: Any) -> CachedDataModule:
    kw = {
        "cache_dir": str(tmp / "cache"),
        "ram_dir": str(tmp / "ram"),
        "ram_bytes": "4MiB",
        "image_size": 16,
        "batch_size": 32,
        "num_workers": 1,
        "val_fraction": 0.2,
        "log_every_n_steps": 2,
        **kw,
    }
    return CachedDataModule(str(origin), **kw)


def _model() -> ImageClassifier:
    m = _Checked(width=8, blocks=(1,))
    m.example_input_array = torch.zeros(2, 3, 16, 16)
    return m


def test_fit_one_process_logs_cache_statistics(small_digits: Path, tmp_path: Path) -> None:
    dm = _dm(
        small_digits,
        tmp_path,
        num_workers=0,  # worker processes are covered in test_dataset.py
        train_augment=GpuAugment((0.2,) * 3, (0.3,) * 3, crop_scale=(0.8, 1.0), flip_p=0.0, brightness=0.1),
        mean=(0.2,) * 3,
        std=(0.3,) * 3,
    )
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="logs")
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=logger,
        enable_progress_bar=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    trainer.fit(_model(), datamodule=dm)
    s = dm.cache_stats
    assert s["origin_fetches"] == 200  # every sample decoded once (160 train + 40 val)
    assert s["ram_hits"] + s["ssd_hits"] >= 200  # epoch 2 and its validation read decoded tensors
    assert s["ram_hits"] > 0  # the misses went to the RAM tier first
    rows = list(csv.DictReader((Path(logger.log_dir) / "metrics.csv").read_text().splitlines()))
    logged = [r for r in rows if r.get("cache/hit_rate")]
    assert logged and "cache/bytes_fetched" in rows[0] and "cache/ssd_hits" in rows[0]
    assert float(logged[-1]["cache/hit_rate"]) > 0
    assert (tmp_path / "cache").is_dir() and list((tmp_path / "cache").glob("listing-*.json"))


def _ddp_rank(rank: int, world: int, origin: str, tmp: str) -> dict[str, Any]:
    import lightning as L

    dm = _dm(Path(origin), Path(tmp), num_workers=0)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(_model(), datamodule=dm)
    return dm.cache_stats


def test_fit_two_processes_share_one_cache_dir(small_digits: Path, tmp_path: Path) -> None:
    stats = run_in_processes(_ddp_rank, 2, (str(small_digits), str(tmp_path)), init_process_group=False, timeout=240)
    # each rank reads its half of 160 train + 40 val samples per epoch, 2 epochs: 200 per rank
    assert [s["requests"] for s in stats] == [200, 200]
    fetched = sum(s["origin_fetches"] for s in stats)
    assert 200 <= fetched <= 210  # ~every sample decoded once on the node (ranks may race on a few)
    assert all(s["ram_hits"] + s["ssd_hits"] >= 90 for s in stats)  # epoch 2 hits, in the shared tiers


def test_cli_yaml_builds_the_module(small_digits: Path, tmp_path: Path) -> None:
    from lightning_accel.cli import AccelCLI

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"""
model:
  class_path: lightning_accel.models.ImageClassifier
data:
  class_path: lightning_accel.data.CachedDataModule
  init_args:
    origin: {small_digits}
    cache_dir: {tmp_path / "cache"}
    ram_bytes: 0
    ssd_bytes: 64MiB
    image_size: 16
    train_augment:
      class_path: lightning_accel.data.GpuAugment
      init_args: {{crop_scale: [0.5, 1.0], flip_p: 0.0}}
"""
    )
    cli = AccelCLI(args=["--config", str(cfg)], run=False)
    dm = cli.datamodule
    assert isinstance(dm, CachedDataModule) and dm.ssd_bytes == 64 << 20 and dm.train_augment.crop_scale == (0.5, 1.0)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 200


def test_arguments_after_origin_are_keyword_only(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="positional"):
        CachedDataModule(str(tmp_path), str(tmp_path / "cache"))


def test_bad_input_is_reported_with_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`cache_dir` must be a local directory"):
        CachedDataModule("s3://b/x", cache_dir="s3://b/cache")
    with pytest.raises(ValueError, match="`ssd_bytes`.*'huge'"):
        CachedDataModule(str(tmp_path), ssd_bytes="huge")
    with pytest.raises(ValueError, match="`batch_size`"):
        CachedDataModule(str(tmp_path), batch_size=0)
    # a local origin that does not exist is refused when the module is built, not when the Trainer lists it
    with pytest.raises(FileNotFoundError, match="`origin` '.*nowhere' does not exist"):
        CachedDataModule(str(tmp_path / "nowhere"), cache_dir=str(tmp_path / "c"), ram_bytes=0)
    with pytest.raises(FileNotFoundError, match="`val_origin` 'file://.*nowhere' does not exist"):
        CachedDataModule(str(tmp_path), val_origin=f"file://{tmp_path / 'nowhere'}", ram_bytes=0)
    gone = tmp_path / "gone"
    gone.mkdir()
    dm = CachedDataModule(str(gone), cache_dir=str(tmp_path / "c"), ram_bytes=0)
    gone.rmdir()  # removed after the module was built: listing it names it
    with pytest.raises(FileNotFoundError, match="gone"):
        dm.prepare_data()


def test_test_runs_on_the_validation_split_and_says_so(small_digits: Path, tmp_path: Path) -> None:
    dm = _dm(small_digits, tmp_path, num_workers=0)
    dm.prepare_data()
    dm.setup("test")
    with pytest.warns(UserWarning, match="has no test split.*pass it as `val_origin`"):
        loader = dm.test_dataloader()
    assert loader.dataset is dm.val_set


def test_warm_on_prepare_fills_the_ssd_tier_once(small_digits: Path, tmp_path: Path) -> None:
    dm = _dm(small_digits, tmp_path, num_workers=0, ram_bytes=0, warm_on_prepare=True, val_origin=str(small_digits))
    dm.prepare_data()
    s = dm.cache_stats
    assert s["origin_fetches"] == 200 and s["writes"] == 200  # train and val origins are the same files: one pass
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    assert dm.train_set.cached_fraction() == 1.0 and len(dm.train_set) == len(dm.val_set) == 200
    dm.prepare_data()  # already warm: nothing read again
    assert dm.cache_stats["origin_fetches"] == 200


@pytest.mark.parametrize(("prefetch", "expected"), [(None, False), (True, True)])
def test_prefetch_defaults_to_inline_reads_for_a_local_origin(
    small_digits: Path, tmp_path: Path, prefetch: bool | None, expected: bool
) -> None:
    dm = _dm(small_digits, tmp_path, num_workers=0, ram_bytes=0, prefetch=prefetch)
    dm.setup("fit")
    assert dm.train_set is not None and dm.train_set.cache.prefetch is expected
    x, y = dm.train_set.__getitems__([0, 1, 2])
    assert x.shape == (3, 3, 16, 16) and len(y) == 3


def test_skipped_samples_are_reported_per_epoch(small_digits: Path, tmp_path: Path) -> None:
    import shutil
    import warnings

    origin = tmp_path / "origin"
    shutil.copytree(small_digits, origin)
    bad = sorted((origin / "4").glob("*.jpg"))
    bad[0].write_bytes(b"")  # empty
    bad[1].write_bytes(b"not a jpeg")
    dm = _dm(origin, tmp_path, num_workers=1, on_decode_error="skip", val_origin=str(small_digits))
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_model(), datamodule=dm)
    lines = [str(w.message) for w in caught if "undecodable" in str(w.message)]
    # skipped samples are not cached: each training epoch decodes and skips them again, and says so once
    assert [m for m in lines if "in training" in m] == [
        "lightning_accel data: rank 0 skipped 2 undecodable sample(s) in training (epoch 0; 2 in all) because "
        "`on_decode_error='skip'`; fix or remove the files, or pass `on_decode_error='raise'` to stop at the first "
        "one with its key.",
        "lightning_accel data: rank 0 skipped 2 undecodable sample(s) in training (epoch 1; 4 in all) because "
        "`on_decode_error='skip'`; fix or remove the files, or pass `on_decode_error='raise'` to stop at the first "
        "one with its key.",
    ]
    assert len(lines) == 2  # the clean validation origin skipped nothing; teardown had nothing left to report
    assert dm.cache_stats["decode_skipped"] == 4


def _ddp_skip_rank(rank: int, world: int, origin: str, val: str, tmp: str) -> list[str]:
    import warnings

    import lightning as L

    dm = _dm(Path(origin), Path(tmp), num_workers=0, on_decode_error="skip", val_origin=val)
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_model(), datamodule=dm)
    return [str(w.message) for w in caught if "undecodable" in str(w.message)]


def test_skipped_samples_are_reported_under_two_process_ddp(small_digits: Path, tmp_path: Path) -> None:
    import re
    import shutil

    origin = tmp_path / "origin"
    shutil.copytree(small_digits, origin)
    for p in sorted((origin / "5").glob("*.jpg"))[:3]:
        p.write_bytes(b"")
    msgs = run_in_processes(
        _ddp_skip_rank, 2, (str(origin), str(small_digits), str(tmp_path)), init_process_group=False, timeout=240
    )
    counts = []
    for rank, lines in enumerate(msgs):  # only ranks that skipped something speak, each of its own count
        for line in lines:
            m = re.match(rf"lightning_accel data: rank {rank} skipped (\d+) undecodable sample\(s\) in training", line)
            assert m, line
            counts.append(int(m.group(1)))
    assert sum(counts) == 3  # the three empty files, each on the one rank that read it
