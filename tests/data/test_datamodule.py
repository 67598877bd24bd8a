"""``CachedDataModule`` argument checks (every bad value is one line at construction, naming the argument) and its
listing (which origin a saved listing belongs to, what a changed class list says)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.data import CachedDataModule, CachedDataset


def _make(tmp: Path, **kw: Any) -> CachedDataModule:
    kw.setdefault("cache_dir", str(tmp / "cache"))
    return CachedDataModule(str(tmp), **kw)


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"ram_bytes": 1}, r"`ram_bytes` 1 is below the minimum of 1048576 bytes: an LMDB tier needs room"),
        ({"ram_bytes": "100KiB", "image_size": 16}, r"`ram_bytes` '100KiB' \(102400 bytes\) is below the minimum"),
        ({"ram_bytes": "1MiB", "image_size": 512}, r"two 512 px samples \(790528 bytes each\)"),
        ({"ssd_bytes": 4096}, r"`ssd_bytes` 4096 is below the minimum"),
        (
            {"max_concurrency": 0},
            r"`max_concurrency` must be an integer >= 1 and <= 1024, got 0\. It counts origin reads in flight",
        ),
        ({"retries": -1}, r"`retries` must be an integer >= 0 and <= 16, got -1\. .*0 for none"),
        ({"prefetch_batches": -3}, r"`prefetch_batches` must be an integer >= 0, got -3\. .*0 to read only on demand"),
        ({"num_workers": -1}, r"`num_workers` must be an integer >= 0 and <= 256 or None, got -1"),
        ({"shuffle_window": 0}, r"`shuffle_window` must be an integer >= 1 or None, got 0"),
        # trained epoch 0, then the global shuffle's `seed + epoch` overflowed torch's seed in epoch 1; the range is
        # `seed_everything`'s, as for every seed of the package
        (
            {"seed": 2**64 - 1},
            r"^`seed` must be an integer >= 0 and <= 4294967295, got 18446744073709551615\. It seeds the shuffle and "
            r"the train/validation split; any seed `lightning.seed_everything` takes \(0 \.\. 2\*\*32 - 1\) works\.$",
        ),
        ({"seed": -1}, r"^`seed` must be an integer >= 0 and <= 4294967295, got -1\. It seeds"),
        ({"policy": "lru"}, r"`policy` must be 'keep' or 'fifo', got 'lru'"),
        ({"shuffle": "local"}, r"`shuffle` must be one of 'auto', 'global', 'window', got 'local'"),
        (
            {"ssd_bytes": "huge"},
            r"`ssd_bytes` must be a byte count .*, or None for no cap, got 'huge'\. Use 0 to disable",
        ),
    ],
)
def test_bad_budgets_and_reader_settings_fail_at_construction(tmp_path: Path, kw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as e:
        _make(tmp_path, **kw)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) <= 400 and ("0 to disable" in msg or "must be" in msg)


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"max_concurrency": 2.5}, r"`max_concurrency` must be an integer >= 1 and <= 1024, got 2\.5 \(float\)"),
        ({"batch_size": True}, r"`batch_size` must be an integer >= 1, got True \(bool\)"),
        ({"retries": False}, r"`retries` must be an integer >= 0 and <= 16, got False \(bool\)"),
        ({"prefetch_batches": True}, r"`prefetch_batches` must be an integer >= 0, got True \(bool\)"),
        ({"shuffle_window": True}, r"`shuffle_window` must be an integer >= 1 or None, got True \(bool\)"),
        ({"ram_bytes": True}, r"`ram_bytes` must be a byte count .*, got True \(bool\)\. RAM is finite"),
        ({"ram_bytes": None}, r"`ram_bytes` must be a byte count .*, got None \(NoneType\)\. RAM is finite: use 0"),
        ({"stage_bytes": 1.5}, r"`stage_bytes` must be a byte count .*, got 1\.5 \(float\)"),
        ({"val_fraction": "0.1"}, r"`val_fraction` must be a number >= 0 and < 1, got '0\.1' \(str\)"),
        ({"policy": 1}, r"`policy` must be 'keep' or 'fifo', got 1 \(int\)"),
        ({"ram_ttl": True}, r"`ram_ttl` must be a duration .*, got True \(bool\)"),
    ],
)
def test_wrong_types_are_type_errors(tmp_path: Path, kw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern) as e:
        _make(tmp_path, **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        # each was accepted, to fork a million workers, start a million threads or retry for ages
        (
            {"num_workers": 10**6},
            r"^`num_workers` must be an integer >= 0 and <= 256 or None, got 1000000\. Each is a process: use about "
            r"the CPU count, or None for half the CPUs, at most 8\.$",
        ),
        (
            {"warm_num_workers": 257},
            r"^`warm_num_workers` must be an integer >= 0 and <= 256 or None, got 257\. Each is a process: 0 reads",
        ),
        (
            {"max_concurrency": 10**6},
            r"^`max_concurrency` must be an integer >= 1 and <= 1024, got 1000000\. It counts origin reads in flight "
            r"per process, a thread each",
        ),
        (
            {"retries": 17},
            r"^`retries` must be an integer >= 0 and <= 16, got 17\. It counts retries of a transient origin error, "
            r"each wait twice the last from 0\.2 s; 0 for none\.$",
        ),
    ],
)
def test_counts_above_their_bound_fail_at_construction(tmp_path: Path, kw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as e:
        _make(tmp_path, **kw)
    assert "\n" not in str(e.value)


def test_counts_at_their_bound_are_accepted(tmp_path: Path) -> None:
    dm = _make(tmp_path, num_workers=256, warm_num_workers=256, max_concurrency=1024, retries=16)
    assert (dm.num_workers, dm.warm_num_workers, dm.max_concurrency, dm.retries) == (256, 256, 1024, 16)


def test_small_but_workable_budgets_and_zero_are_accepted(tmp_path: Path) -> None:
    dm = _make(tmp_path, ram_bytes="1MiB", ssd_bytes=0, image_size=16, max_concurrency=1, retries=0, prefetch_batches=0)
    assert (dm.ram_bytes, dm.ssd_bytes, dm.max_concurrency, dm.retries, dm.prefetch_batches) == (1 << 20, 0, 1, 0, 0)
    assert _make(tmp_path, ram_bytes=0, ssd_bytes=None).ssd_bytes is None
    assert _make(tmp_path, ram_bytes=1 << 20, decode=lambda b: b).ram_bytes == 1 << 20  # custom decode: size unknown


def test_dataset_refuses_a_negative_prefetch(small_digits: Path, tmp_path: Path) -> None:
    from lightning_accel.data import ImageDecoder, ObjectStore, SampleCache, list_origin

    store = ObjectStore(str(small_digits))
    cache = SampleCache(store, list_origin(store), ImageDecoder(16))
    with pytest.raises(ValueError, match=r"`prefetch_batches` must be an integer >= 0"):
        CachedDataset(cache, prefetch_batches=-1)


def test_a_new_image_size_on_the_same_cache_dir_decodes_again(small_digits: Path, tmp_path: Path) -> None:
    """The decode size is part of every entry's key: the cache never serves a sample of the old size."""
    kw: dict[str, Any] = {"cache_dir": str(tmp_path / "cache"), "ram_dir": str(tmp_path / "ram"), "num_workers": 0}
    for size, fetched in ((16, 8), (24, 8), (16, 0)):  # back at 16 px: the first run's entries, read again
        dm = CachedDataModule(str(small_digits), image_size=size, ram_bytes="4MiB", **kw)
        dm.setup("fit")
        assert dm.train_set is not None
        x, _ = dm.train_set.__getitems__(list(range(8)))
        assert tuple(x.shape) == (8, 3, size, size)
        assert dm.cache_stats["origin_fetches"] == fetched
        dm.teardown("fit")


@pytest.mark.parametrize(
    ("kw", "error", "pattern"),
    [
        ({"log_every_n_steps": 0}, ValueError, r"`log_every_n_steps` must be an integer >= 1, got 0\."),
        ({"log_every_n_steps": -5}, ValueError, r"`log_every_n_steps` must be an integer >= 1, got -5\."),
        ({"log_every_n_steps": "10"}, TypeError, r"`log_every_n_steps` must be an integer >= 1, got '10' \(str\)"),
        ({"warm_num_workers": -1}, ValueError, r"`warm_num_workers` must be an integer >= 0 or None, got -1\."),
        ({"warm_num_workers": "0"}, TypeError, r"`warm_num_workers` must be an integer >= 0 or None, got '0' \(str\)"),
        ({"seed": "abc"}, TypeError, r"`seed` must be an integer >= 0 and <= 4294967295, got 'abc' \(str\)"),
        ({"seed": True}, TypeError, r"`seed` must be an integer >= 0 and <= 4294967295, got True \(bool\)"),
        ({"prefetch": "no"}, TypeError, r"`prefetch` must be True or False, got 'no' \(str\)\. None: only for remote"),
        ({"warm_on_prepare": "false"}, TypeError, r"`warm_on_prepare` must be True or False, got 'false' \(str\)"),
        ({"val_origin": ""}, ValueError, r"`val_origin` must be a non-empty path or fsspec URL, got ''\."),
        ({"val_origin": 5}, TypeError, r"`val_origin` must be a non-empty path or fsspec URL, got 5 \(int\)"),
        ({"manifest": 5}, TypeError, r"`manifest` must be a JSONL file under `origin` .* or None, got 5 \(int\)"),
        ({"manifest": " "}, ValueError, r"`manifest` must be a JSONL file under `origin` .* or None, got ' '\."),
        # a key that escapes `origin` failed only in `setup`, on every rank
        (
            {"manifest": "../train.jsonl"},
            ValueError,
            r"^`manifest` must be .*, got '\.\./train\.jsonl'\. Use a relative",
        ),
        (
            {"manifest": "/data/train.jsonl"},
            ValueError,
            r"^`manifest` must be .*, got '/data/train\.jsonl'\. Use a rel",
        ),
        ({"ram_dir": 5}, TypeError, r"`ram_dir` must be a local directory path or None, got 5 \(int\)"),
        ({"cache_dir": 5}, TypeError, r"`cache_dir` must be a local directory path, got 5 \(int\)\. Pass a dir"),
        ({"cache_dir": ""}, ValueError, r"`cache_dir` must be a local directory path, got '' \(str\)"),
        ({"cache_dir": None}, TypeError, r"`cache_dir` must be a local directory path, got None"),
        ({"transform": 5}, TypeError, r"`transform` must be a callable .* or None, got 5 \(int\)"),
        ({"decode": 5}, TypeError, r"`decode` must be a callable `decode\(data: bytes\) -> torch\.Tensor` or None"),
        ({"train_augment": "x"}, TypeError, r"`train_augment` must be a GpuAugment .* or None, got 'x' \(str\)"),
        ({"val_augment": 1}, TypeError, r"`val_augment` must be a GpuAugment .* or None, got 1 \(int\)"),
        ({"storage_options": "x"}, TypeError, r"`storage_options` must be a dict of fsspec options .*got 'x' \(str\)"),
    ],
)
def test_bad_flags_paths_and_callables_fail_at_construction(
    tmp_path: Path, kw: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern) as e:
        _make(tmp_path, **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("val_fraction", "counts"), [(0.01, "40 training and 0 validation"), (0.99, "0 training and 40")]
)
def test_a_split_leaving_either_side_empty_is_refused(tmp_path: Path, val_fraction: float, counts: str) -> None:
    """Never validate on the training samples by accident, nor train on nothing."""
    from lightning_accel.datasets import materialize_digits

    materialize_digits(tmp_path / "digits", size=16, num_images=40)
    dm = CachedDataModule(
        str(tmp_path / "digits"),
        cache_dir=str(tmp_path / "cache"),
        ram_bytes=0,
        image_size=16,
        val_fraction=val_fraction,
    )
    with pytest.raises(ValueError, match=rf"`val_fraction` {val_fraction} splits the 40 samples .* into {counts}") as e:
        dm.setup("fit")
    assert "\n" not in str(e.value) and "`val_origin`" in str(e.value)
    ok = CachedDataModule(
        str(tmp_path / "digits"), cache_dir=str(tmp_path / "cache"), ram_bytes=0, image_size=16, val_fraction=0.05
    )
    ok.setup("fit")
    assert ok.train_set is not None and ok.val_set is not None
    assert (len(ok.train_set), len(ok.val_set)) == (38, 2)
    assert not set(ok.train_set.indices) & set(ok.val_set.indices)


def test_a_batch_of_undecodable_samples_arrives_empty_so_ranks_keep_equal_counts(tmp_path: Path) -> None:
    """on_decode_error="skip" never drops a batch (DDP needs the same number of batches on every rank): one whose
    samples all fail arrives as (0, C, H, W) images and (0,) labels, which the augmentation passes through."""
    import shutil

    import torch

    from lightning_accel.datasets import materialize_digits

    materialize_digits(tmp_path / "digits", size=16, num_images=10)
    origin = tmp_path / "origin"
    for c in ("a", "b"):
        (origin / c).mkdir(parents=True)
    good = sorted((tmp_path / "digits").rglob("*.jpg"))
    for i in range(2):
        shutil.copy(good[i], origin / "a" / f"{i}.jpg")
        (origin / "b" / f"{i}.jpg").write_bytes(b"not a jpeg")
    dm = CachedDataModule(
        str(origin),
        cache_dir=str(tmp_path / "cache"),
        ram_bytes=0,
        image_size=16,
        num_workers=0,
        batch_size=2,
        val_fraction=0.0,
        on_decode_error="skip",
    )
    dm.setup("validate")
    loader = dm.val_dataloader()
    with pytest.warns(RuntimeWarning, match="skipped 2 undecodable"):
        batches = list(loader)
    assert len(batches) == len(loader) == 2
    (x0, y0), (x1, y1) = batches
    assert tuple(x0.shape) == (2, 3, 16, 16) and y0.tolist() == [0, 0]
    assert tuple(x1.shape) == (0, 3, 16, 16) and tuple(y1.shape) == (0,) and y1.dtype == torch.int64
    assert tuple(dm.val_augment(x1, train=False).shape) == (0, 3, 16, 16)
    assert dm.cache_stats["decode_skipped"] == 2


def test_training_and_validation_workers_count_in_their_own_rows(small_digits: Path, tmp_path: Path) -> None:
    """Worker 0 of the training loader and worker 0 of the validation loader run at once (persistent training
    workers): they must not add to one shared-memory row from two processes, which loses counts."""
    dm = CachedDataModule(
        str(small_digits), cache_dir=str(tmp_path / "cache"), ram_bytes=0, image_size=16, batch_size=8, num_workers=1
    )
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    assert (dm.train_set.stats_lane, dm.val_set.stats_lane) == (0, 1)
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        loader.warm_num_workers = None  # read in the worker even once warm
        next(iter(loader))
    rows = [int(i) for i in (dm.stats._t[:, 0] > 0).nonzero().flatten()]  # rows with requests
    assert len([r for r in rows if r > 0]) == 2, rows  # two worker rows, one per loader
    assert dm.cache_stats["requests"] >= 16
    dm.teardown("fit")
    with pytest.raises(ValueError, match=r"`stats_lane` must be an integer >= 0 and <= 3, got 4"):
        CachedDataset(dm.train_set.cache, stats_lane=4)


def _split_keys(dm: CachedDataModule) -> tuple[set[str], set[str]]:
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    keys = dm.train_set.cache.listing.keys
    return {keys[i] for i in dm.train_set.indices}, {keys[i] for i in dm.val_set.indices}


def test_the_validation_split_stays_held_out_when_the_origin_grows(tmp_path: Path) -> None:
    """A split by position moved 19 of the 20 held-out samples into training when one image was added: a run
    continued on the grown origin validated on samples it had trained on."""
    from lightning_accel.datasets import materialize_digits

    origin = tmp_path / "digits"
    materialize_digits(origin, size=16, num_images=200)

    def dm() -> CachedDataModule:
        return CachedDataModule(
            str(origin), cache_dir=str(tmp_path / "cache"), ram_bytes=0, image_size=16, val_fraction=0.1, seed=3
        )

    train, val = _split_keys(dm())
    assert (len(train), len(val)) == (180, 20)
    first = sorted((origin / "0").iterdir())[0]
    for name in ("0/00-added.jpg", "5/00-added.jpg"):  # sorted first: every later position shifts
        (origin / name).write_bytes(first.read_bytes())
    train2, val2 = _split_keys(dm())
    assert (len(train2), len(val2)) == (182, 20)
    assert not val2 & train  # no sample trained on before is validated on now
    assert len(val2 & val) >= 18  # at most the added samples took a held-out place
    assert dm().seed == 3 and _split_keys(dm()) == (train2, val2)  # deterministic


def test_the_default_validation_transform_follows_a_gpu_augment_train_augment(tmp_path: Path) -> None:
    """With only ``train_augment`` given, validation was normalised with ImageNet's statistics at the cached size,
    training with the augment's own at its ``size``: the model was scored on images unlike any it trained on."""
    import torch

    from lightning_accel.data import GpuAugment

    aug = GpuAugment(mean=(0.19,) * 3, std=(0.32,) * 3, size=12, crop_scale=(0.8, 1.0), flip_p=0.0)
    dm = _make(tmp_path, image_size=16, train_augment=aug)
    x = torch.full((2, 3, 16, 16), 51, dtype=torch.uint8)  # 0.2 after scaling
    val = dm.val_augment(x, train=False)
    assert val.shape == (2, 3, 12, 12) and val.shape == aug(x, train=True).shape
    assert torch.allclose(val, torch.full_like(val, (0.2 - 0.19) / 0.32), atol=1e-5)
    assert dm.val_augment is not aug and (dm.val_augment.mean, dm.val_augment.std) == (aug.mean, aug.std)
    with pytest.warns(UserWarning, match=r"`mean` \(0\.5, 0\.5, 0\.5\) differs from `train_augment`'s"):
        _make(tmp_path, image_size=16, train_augment=aug, mean=(0.5,) * 3)
    plain = _make(tmp_path, image_size=16)  # nothing given: ImageNet's, as before
    assert plain.val_augment.mean == (0.485, 0.456, 0.406) and plain.val_augment.size is None


def test_a_pathlib_origin_is_a_local_path(tmp_path: Path) -> None:
    """``cache_dir`` took a ``pathlib.Path``; ``origin`` and ``val_origin`` refused one ("must be a non-empty path")."""
    from lightning_accel.datasets import materialize_digits

    materialize_digits(tmp_path / "d", size=8, num_images=40)
    dm = CachedDataModule(
        origin=tmp_path / "d", val_origin=tmp_path / "d", cache_dir=tmp_path / "c", image_size=8, ram_bytes=0
    )
    assert dm.origin == str(tmp_path / "d") and dm.val_origin == str(tmp_path / "d")
    dm.setup("fit")
    assert dm.train_set is not None and len(dm.train_set) == 40


def test_stage_bytes_none_is_no_cap_and_comes_through_a_config_file(small_digits: Path, tmp_path: Path) -> None:
    import sys

    from jsonargparse import ArgumentParser

    from lightning_accel.data import pack_origin

    packed = tmp_path / "packed"
    pack_origin(str(small_digits), str(packed))
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(CachedDataModule, "data")
    cfg = parser.parse_args(["--data.origin", str(packed), "--data.stage_bytes", "null"])  # `stage_bytes: null`
    dm = parser.instantiate_classes(cfg).data
    assert dm.stage_bytes is None
    dm = CachedDataModule(str(packed), cache_dir=str(tmp_path / "cache"), ram_bytes=0, num_workers=0, stage_bytes=None)
    dm.setup("fit")
    assert dm.train_set is not None and dm.train_set.cache.packed is not None
    assert dm.train_set.cache.packed.stage_bytes == sys.maxsize  # every staged shard stays


@pytest.mark.parametrize("packed", [False, True])
def test_a_file_name_that_is_not_utf8_is_listed_cached_and_packed(
    small_digits: Path, tmp_path: Path, packed: bool
) -> None:
    """A local file named in another encoding (``caf\xe9.jpg`` in Latin-1): Python spells its byte as a lone
    surrogate, and encoding that key failed ``prepare_data`` with a UnicodeEncodeError naming no file."""
    import os

    from lightning_accel.data import pack_origin

    origin = tmp_path / "origin"
    shutil.copytree(small_digits, origin)
    odd = os.path.join(os.fsencode(origin / "3"), b"caf\xe9.jpg")
    shutil.copyfile(sorted((origin / "3").glob("*.jpg"))[0], odd)
    if packed:
        pack_origin(str(origin), str(tmp_path / "packed"))
    root = tmp_path / "packed" if packed else origin
    kw = {"cache_dir": str(tmp_path / "cache"), "ram_bytes": 0, "image_size": 16, "num_workers": 0, "val_fraction": 0.5}
    for run in range(2):  # the second run reads every sample from the cache
        dm = CachedDataModule(str(root), **kw)
        dm.prepare_data()
        dm.setup("fit")
        assert dm.train_set is not None and dm.val_set is not None
        assert "3/caf\udce9.jpg" in dm.train_set.cache.listing.keys
        sizes = [len(ds.__getitems__(list(range(len(ds))))[0]) for ds in (dm.train_set, dm.val_set)]
        assert sum(sizes) == 201
        assert dm.cache_stats["origin_fetches"] == (201 if run == 0 else 0)


def test_a_listing_that_cannot_be_saved_is_not_replaced_by_an_earlier_runs_file(
    small_digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at ``prepare_data``: ``setup`` (every rank) read the previous run's listing file instead, so a
    file added since was left out and a file rewritten since was served its old cached entry."""
    import errno
    import os
    import time

    import torch

    from lightning_accel.data import ImageDecoder
    from lightning_accel.data.origin import Listing

    origin = tmp_path / "origin"
    shutil.copytree(small_digits, origin)
    kw = {"cache_dir": str(tmp_path / "cache"), "ram_bytes": 0, "image_size": 16, "num_workers": 0, "val_fraction": 0}
    dm = CachedDataModule(str(origin), **kw)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_set is not None
    dm.train_set.__getitems__(list(range(len(dm.train_set))))  # every sample cached under this listing
    rewritten, other = sorted((origin / "3").glob("*.jpg"))[0], sorted((origin / "7").glob("*.jpg"))[0]
    shutil.copyfile(other, rewritten)  # new content under the same name
    os.utime(rewritten, (time.time() + 10, time.time() + 10))
    shutil.copyfile(other, origin / "3" / "added.jpg")

    def disk_full(self: Listing, path: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(Listing, "save", disk_full)
    dm = CachedDataModule(str(origin), **kw)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_set is not None
    keys = dm.train_set.cache.listing.keys
    assert len(dm.train_set) == 201 and "3/added.jpg" in keys
    pos = dm.train_set.indices.index(keys.index(str(rewritten.relative_to(origin))))
    x, _ = dm.train_set.__getitems__([pos])
    assert torch.equal(x[0], ImageDecoder(16)(other.read_bytes()))  # the new content, not the cached old one


def test_a_decoder_and_a_transform_come_through_a_config_file(small_digits: Path, tmp_path: Path) -> None:
    """LightningCLI YAML names objects by ``class_path``: an ``ImageDecoder`` (its ``draft``/``device`` are only
    reachable there) and a torchvision transform were refused as not returning tensors."""
    import torch
    from jsonargparse import ArgumentParser

    from lightning_accel.data import ImageDecoder

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(CachedDataModule, "data")
    decode = '{"class_path": "lightning_accel.data.ImageDecoder", "init_args": {"size": 12, "draft": true}}'
    flip = '{"class_path": "torchvision.transforms.v2.RandomHorizontalFlip", "init_args": {"p": 1.0}}'
    args = ["--data.origin", str(small_digits), "--data.cache_dir", str(tmp_path / "cache"), "--data.ram_bytes", "0"]
    cfg = parser.parse_args([*args, "--data.decode", decode, "--data.transform", flip, "--data.num_workers", "0"])
    dm = parser.instantiate_classes(cfg).data
    assert isinstance(dm.decode, ImageDecoder) and dm.decode.size == 12 and dm.decode.draft
    assert isinstance(dm.transform, torch.nn.Module)
    dm.setup("fit")
    assert dm.train_set is not None
    x, _ = dm.train_set.__getitems__([0, 1])
    key = dm.train_set.cache.listing.keys[dm.train_set.indices[0]]
    plain = ImageDecoder(12, draft=True)((small_digits / key).read_bytes())
    assert torch.equal(x[0], plain.flip(-1))  # decoded by the configured decoder, then flipped by the transform


@pytest.mark.parametrize(
    ("options", "where"),
    [
        ({1: "x", "key": "secret-value"}, r"got a key 1 \(int\)\. "),
        (
            {"client_kwargs": {("endpoint",): "http://h"}},
            r"got a key \('endpoint',\) \(tuple\) in `\w+\['client_kwargs'\]`\. ",
        ),
    ],
)
def test_storage_options_with_non_string_keys_fail_at_construction(
    small_digits: Path, tmp_path: Path, options: dict[Any, Any], where: str
) -> None:
    from lightning_accel.data import ObjectStore, pack_origin

    calls = [
        ("storage_options", lambda: _make(tmp_path, storage_options=options)),
        ("storage_options", lambda: ObjectStore("s3://bucket/train", options)),
        ("storage_options", lambda: pack_origin(str(small_digits), str(tmp_path / "p"), storage_options=options)),
        (
            "dest_storage_options",
            lambda: pack_origin(str(small_digits), str(tmp_path / "p"), dest_storage_options=options),
        ),
    ]
    for name, call in calls:
        with pytest.raises(TypeError, match=rf"^`{name}` must be a dict of fsspec options with string keys .*{where}"):
            call()
    with pytest.raises(TypeError) as e:
        _make(tmp_path, storage_options=options)
    assert "secret-value" not in str(e.value) and "\n" not in str(e.value)  # credentials stay out of the message
    assert not (tmp_path / "p").exists()  # refused before anything was written


def _tree(root: Path, classes: range) -> Path:
    from lightning_accel.datasets import materialize_digits

    materialize_digits(root, size=16, num_images=30)
    for c in set(range(10)) - set(classes):
        shutil.rmtree(root / str(c))
    return root


def test_a_relative_origin_in_two_working_directories_keeps_its_own_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs sharing `cache_dir`, each started in its own directory with ``origin="data"``: each lists its own."""
    a, b = tmp_path / "a", tmp_path / "b"
    _tree(a / "data", range(10))
    _tree(b / "data", range(5))
    shared = str(tmp_path / "cache")
    monkeypatch.chdir(a)
    dm_a = CachedDataModule("data", cache_dir=shared, image_size=16, num_workers=0, ram_bytes=0)
    dm_a.prepare_data()
    monkeypatch.chdir(b)
    dm_b = CachedDataModule("data", cache_dir=shared, image_size=16, num_workers=0, ram_bytes=0)
    dm_b.prepare_data()  # lists b/data while job a is between its prepare_data and its setup
    monkeypatch.chdir(a)
    dm_a.setup("fit")
    assert dm_a.classes == [str(c) for c in range(10)]
    assert dm_a.train_set is not None and dm_a.train_set.cache.listing.origin == str(a / "data")
    monkeypatch.chdir(b)
    dm_b.setup("fit")
    assert dm_b.classes == [str(c) for c in range(5)]


def test_a_class_folder_removed_between_fits_is_named(tmp_path: Path) -> None:
    origin = _tree(tmp_path / "data", range(10))
    dm = CachedDataModule(str(origin), cache_dir=str(tmp_path / "cache"), image_size=16, num_workers=0, ram_bytes=0)
    dm.prepare_data()
    dm.setup("fit")
    shutil.rmtree(origin / "9")
    with pytest.raises(
        ValueError, match=r"now has 9 classes, not the 10 fixed before \(missing \['9'\], new \[\]\)\. Restore the"
    ):
        dm.prepare_data()  # a second fit lists the origin again


def test_image_size_is_checked_even_with_a_decode_of_its_own(tmp_path: Path) -> None:
    from lightning_accel.data import ImageDecoder

    with pytest.raises(TypeError, match=r"^`image_size` must be an integer >= 1 or None, got '224' \(str\)\. None"):
        _make(tmp_path, decode=ImageDecoder(16), image_size="224")
    assert _make(tmp_path, decode=ImageDecoder(16), image_size=None).decode.size == 16  # type: ignore[attr-defined]


def test_one_s3_url_on_two_endpoints_keeps_two_listings(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    """Two jobs sharing `cache_dir` read `s3://<bucket>/train` from two endpoints holding different objects: each
    lists its own (the listing file was named after the URL alone, so the second job read the first one's)."""
    import socket
    import subprocess
    import sys
    import time

    import fsspec

    from tests.conftest import s3_storage_options
    from tests.helpers import free_port

    bucket, opts_a = s3_bucket
    port = free_port()
    # in a process of its own: moto's servers in one process share one backend, so they would hold the same objects
    serve = f"from moto.server import ThreadedMotoServer as S; S(ip_address='127.0.0.1', port={port}).start()"
    other = subprocess.Popen([sys.executable, "-c", f"{serve}; import time; time.sleep(300)"])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the second S3 endpoint did not start"
                time.sleep(0.1)
        opts_b = s3_storage_options(f"http://127.0.0.1:{port}")
        images = sorted(small_digits.rglob("*.jpg"))
        for opts, classes in ((opts_a, {"0", "1", "2"}), (opts_b, {"3", "4"})):
            fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
            if not fs.exists(bucket):
                fs.mkdir(bucket)
            for p in [p for c in sorted(classes) for p in [p for p in images if p.parent.name == c][:4]]:
                fs.pipe_file(f"{bucket}/train/{p.parent.name}/{p.name}", p.read_bytes())
        shared = str(tmp_path / "cache")
        made = [
            CachedDataModule(
                f"s3://{bucket}/train", cache_dir=shared, storage_options=opts, image_size=16, num_workers=0,
                ram_bytes=0, val_fraction=0.0,
            )
            for opts in (opts_a, opts_b)
        ]  # fmt: skip
        for dm in made:
            dm.prepare_data()
        for dm in made:
            dm.setup("fit")
        assert made[0].classes == ["0", "1", "2"]
        assert made[1].classes == ["3", "4"]
    finally:
        other.kill()
        other.wait()
