"""Packed origins: pack_origin, the index, shard staging (node-wide, POSIX record locks), CRC checks and faults."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.data import (
    CacheDataLoader,
    CachedDataset,
    EpochOrderSampler,
    ImageDecoder,
    Listing,
    LmdbTier,
    ObjectStore,
    OriginError,
    SampleCache,
    list_origin,
    pack_origin,
)
from lightning_accel.data.pack import PACK_INDEX


def _cache(url: str, tmp: Path, opts: dict[str, Any] | None = None, **kw: Any) -> SampleCache:
    store = ObjectStore(url, opts)
    return SampleCache(store, list_origin(store), ImageDecoder(16), ssd=LmdbTier(tmp / "ssd", 64 << 20), **kw)


def _reference(small_digits: Path, idx: list[int]) -> torch.Tensor:
    c = SampleCache(ObjectStore(str(small_digits)), list_origin(ObjectStore(str(small_digits))), ImageDecoder(16))
    return c.load(idx).images


def test_local_pack_round_trip_is_bit_identical(small_digits: Path, tmp_path: Path) -> None:
    listing = pack_origin(str(small_digits), str(tmp_path / "packed"), shard_bytes=20_000)
    tree = list_origin(ObjectStore(str(small_digits)))
    assert listing.keys == tree.keys and listing.labels == tree.labels and listing.classes == tree.classes
    assert listing.pack is not None and len(listing.pack.shards) > 1
    # the shards hold the original bytes, nothing else
    assert sum(listing.pack.shard_sizes) == sum((small_digits / k).stat().st_size for k in tree.keys)
    index = json.loads((tmp_path / "packed" / PACK_INDEX).read_text())
    assert index["format"] == "lightning-accel-pack" and index["version"] == 1
    again = list_origin(ObjectStore(str(tmp_path / "packed")))
    assert again.pack == listing.pack and Listing.from_json(again.to_json()).pack == listing.pack
    c = _cache(str(tmp_path / "packed"), tmp_path)
    idx = [0, 57, 199, 120]
    out = c.load(idx)
    assert torch.equal(out.images, _reference(small_digits, idx))
    assert out.labels.tolist() == [tree.labels[i] for i in idx]
    assert c.stats.as_dict()["bytes_fetched"] == sum(listing.pack.size[i] for i in idx)  # ranged reads, no staging


def test_pack_refuses_to_overwrite_unless_asked(small_digits: Path, tmp_path: Path) -> None:
    dest = str(tmp_path / "packed")
    pack_origin(str(small_digits), dest)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        pack_origin(str(small_digits), dest)
    again = pack_origin(str(small_digits), dest, overwrite=True, shard_bytes=10_000).pack
    assert again is not None and len(again.shards) > 1
    with pytest.raises(ValueError, match="already a packed origin"):
        pack_origin(dest, str(tmp_path / "again"))
    with pytest.raises(
        ValueError,
        match=r"`shard_bytes` must be an integer >= 1 and <= 4294967296, got 0\. It is the target shard size",
    ):
        pack_origin(str(small_digits), str(tmp_path / "x"), shard_bytes=0)
    with pytest.raises(ValueError, match=r"`shard_bytes` must be an integer >= 1 and <= 4294967296, got 8589934592\."):
        pack_origin(str(small_digits), str(tmp_path / "x"), shard_bytes=8 << 30)  # built in memory: refused
    with pytest.raises(TypeError, match=r"`shard_bytes` must be an integer >= 1 and <= 4294967296, got True \(bool\)"):
        pack_origin(str(small_digits), str(tmp_path / "x"), shard_bytes=True)


@pytest.mark.parametrize(
    ("kw", "error", "pattern"),
    [
        (
            {"max_concurrency": 10**6},
            ValueError,
            r"^`max_concurrency` must be an integer >= 1 and <= 1024, got 1000000\. It counts origin reads in flight "
            r"per process",
        ),
        ({"max_concurrency": 0}, ValueError, r"^`max_concurrency` must be an integer >= 1 and <= 1024, got 0\. "),
        # a config's "no" is truthy: it would have replaced the pack
        ({"overwrite": "no"}, TypeError, r"^`overwrite` must be True or False, got 'no' \(str\)\. True replaces"),
        ({"overwrite": 0}, TypeError, r"^`overwrite` must be True or False, got 0 \(int\)\. "),
        ({"shuffle_seed": "7"}, TypeError, r"^`shuffle_seed` must be an integer or None, got '7' \(str\)\. None keeps"),
        ({"shuffle_seed": 1.5}, TypeError, r"^`shuffle_seed` must be an integer or None, got 1\.5 \(float\)\. "),
        ({"shuffle_seed": True}, TypeError, r"^`shuffle_seed` must be an integer or None, got True \(bool\)\. "),
        ({"progress": 3}, TypeError, r"^`progress` must be a callable `progress\(done: int, total: int\)` or None, "),
    ],
)
def test_pack_arguments_are_checked_before_anything_is_touched(
    small_digits: Path, tmp_path: Path, kw: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    dest = tmp_path / "packed"
    pack_origin(str(small_digits), str(dest))
    before = {p.relative_to(dest): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    with pytest.raises(error, match=pattern):
        pack_origin(str(small_digits), str(dest), shard_bytes=10_000, **kw)
    assert {p.relative_to(dest): p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before


def test_bad_indexes_are_refused_with_the_url(small_digits: Path, tmp_path: Path) -> None:
    dest = tmp_path / "packed"
    pack_origin(str(small_digits), str(dest))
    good = json.loads((dest / PACK_INDEX).read_text())

    def listing_with(**change: Any) -> None:
        (dest / PACK_INDEX).write_text(json.dumps({**good, **change}))
        list_origin(ObjectStore(str(dest)))

    with pytest.raises(ValueError, match="escape"):
        listing_with(shards=[{"key": "../../etc/passwd", "bytes": 10}])
    for bad in ("../../../etc/passwd", "/abs/key", "s3://other/key"):  # a sample key leaves the origin too
        keys = [bad, *good["keys"][1:]]
        with pytest.raises(ValueError, match=rf"pack index '.*{PACK_INDEX}' has sample key '{re.escape(bad)}'"):
            listing_with(keys=keys)
    with pytest.raises(ValueError, match=rf"pack index '.*{PACK_INDEX}' has shard key '\.\./x\.bin'"):
        listing_with(shards=[{**good["shards"][0], "key": "../x.bin"}, *good["shards"][1:]])
    with pytest.raises(ValueError, match="outside its shard"):
        listing_with(offset=[10**9] * len(good["offset"]))
    with pytest.raises(ValueError, match="version"):
        listing_with(version=99)
    with pytest.raises(ValueError, match=PACK_INDEX):
        listing_with(size=good["size"][:-1])
    (dest / PACK_INDEX).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        list_origin(ObjectStore(str(dest)))


def test_s3_pack_stages_each_shard_once_across_processes_and_warm_reads_nothing(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    listing = pack_origin(str(small_digits), url, dest_storage_options=opts, shard_bytes=30_000)
    assert listing.pack is not None
    n_shards = len(listing.pack.shards)
    import fsspec

    s3 = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    written = sorted(p.removeprefix(f"{bucket}/packed/") for p in s3.find(f"{bucket}/packed"))
    assert written == [PACK_INDEX, *listing.pack.shards]  # the index is one PUT: no temporary object left behind
    # two caches on one node (two processes' worth of state) sharing the SSD tier and the stage directory
    a = _cache(url, tmp_path, opts)
    b = _cache(url, tmp_path, opts)
    assert a.packed is not None and a.packed.stage_dir == str(tmp_path / "shards")
    assert a.hint(list(range(0, 200, 2))) > 0  # read-ahead stages whole shards on the store's pool
    out_a = a.load(list(range(0, 200, 2)))
    out_b = b.load(list(range(1, 200, 2)))
    assert torch.equal(out_a.images, _reference(small_digits, list(range(0, 200, 2))))
    assert torch.equal(out_b.images, _reference(small_digits, list(range(1, 200, 2))))
    fetched = a.stats.as_dict()["bytes_fetched"] + b.stats.as_dict()["bytes_fetched"]
    assert fetched == sum(listing.pack.shard_sizes)  # every shard once, whichever process staged it
    assert len(list((tmp_path / "shards").glob("*.shard"))) == n_shards
    assert not list((tmp_path / "shards").glob("*.tmp"))  # staged atomically, nothing half-written left
    warm = _cache(url, tmp_path, opts)
    warm.load(list(range(200)))
    s = warm.stats.as_dict()
    assert (s["bytes_fetched"], s["ssd_hits"]) == (0, 200)


def test_staging_a_shard_is_one_get_with_no_head_before_it(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pack index knows each shard's size: a whole-object read made s3fs send a HEAD before every GET."""
    import s3fs

    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    listing = pack_origin(str(small_digits), url, dest_storage_options=opts, shard_bytes=30_000)
    assert listing.pack is not None
    calls: list[str] = []
    call_s3 = s3fs.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(method)
        return await call_s3(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    cache = _cache(url, tmp_path, opts)  # lists the origin and reads the pack index
    calls.clear()
    out = cache.load(list(range(200)))
    assert torch.equal(out.images, _reference(small_digits, list(range(200))))
    shards = {listing.pack.shard[i] for i in range(200)}
    assert calls.count("head_object") == 0, calls
    assert calls.count("get_object") == len(shards), calls


def test_corrupt_staged_shard_is_refetched_and_a_corrupt_origin_names_the_key(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    listing = pack_origin(str(small_digits), url, dest_storage_options=opts)
    assert listing.pack is not None
    c = _cache(url, tmp_path / "one", opts)
    c.load([0])
    (staged,) = (tmp_path / "one" / "shards").glob("*.shard")
    data = bytearray(staged.read_bytes())
    off = listing.pack.offset[5]
    data[off : off + 8] = b"\xff" * 8
    staged.write_bytes(bytes(data))
    assert torch.equal(c.load([5]).images, _reference(small_digits, [5]))
    assert c.packed is not None and c.packed.staged_refetches == 1
    # now the origin's shard itself is damaged (same size): the CRC names the sample
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    fs.pipe_file(f"{bucket}/packed/{listing.pack.shards[0]}", bytes(data))
    c2 = _cache(url, tmp_path / "two", opts)
    with pytest.raises(OriginError, match=rf"{listing.keys[5]}.*CRC-32"):
        c2.load([5])


def test_unwritable_stage_dir_warns_and_reads_samples_by_range(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    listing = pack_origin(str(small_digits), url, dest_storage_options=opts)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    c = _cache(url, tmp_path, opts, stage_dir=blocker / "shards")
    with pytest.warns(RuntimeWarning, match="cannot stage shards"):
        out = c.load([3, 4])
    assert torch.equal(out.images, _reference(small_digits, [3, 4]))
    assert listing.pack is not None
    assert c.stats.as_dict()["bytes_fetched"] == listing.pack.size[3] + listing.pack.size[4]


def test_stage_budget_evicts_oldest_shards(s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    listing = pack_origin(str(small_digits), url, dest_storage_options=opts, shard_bytes=10_000)
    assert listing.pack is not None and len(listing.pack.shards) >= 4
    biggest = max(listing.pack.shard_sizes)
    c = _cache(url, tmp_path, opts, stage_bytes=2 * biggest)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.load(list(range(200)))
    staged = list((tmp_path / "shards").glob("*.shard"))
    assert sum(p.stat().st_size for p in staged) <= 2 * biggest
    assert 1 <= len(staged) < len(listing.pack.shards)


@pytest.mark.parametrize(("ctx", "workers"), [("fork", 2), ("spawn", 1)])
def test_workers_read_a_packed_s3_origin_through_the_loader(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path, ctx: str, workers: int
) -> None:
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    listing = pack_origin(str(small_digits), url, dest_storage_options=opts, shard_bytes=15_000)
    assert listing.pack is not None
    cache = _cache(url, tmp_path, opts)
    ds = CachedDataset(cache)
    sampler = EpochOrderSampler(ds, batch_size=16, seed=0)
    loader = CacheDataLoader(ds, batch_size=16, sampler=sampler, num_workers=workers, multiprocessing_context=ctx)
    seen = sum(len(x) for x, _ in loader)
    assert seen == 200
    s = cache.stats.as_dict()
    # each shard crossed the network once for the whole node (main-process stage-ahead and both workers)
    assert s["bytes_fetched"] == sum(listing.pack.shard_sizes)
    assert s["writes"] == 200 and ds.cached_fraction() == 1.0  # write-behind committed before the epoch ended
    assert os.path.isdir(tmp_path / "shards")


def test_prefetch_with_a_download_already_finished_does_not_deadlock(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    from concurrent.futures import Future

    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    pack_origin(str(small_digits), url, dest_storage_options=opts, shard_bytes=30_000)
    c = _cache(url, tmp_path, opts)

    def run_inline(fn: Any, *args: Any) -> Future:
        f: Future = Future()
        f.set_result(fn(*args))  # done before add_done_callback: the callback runs inline, under the reader's lock
        return f

    c.store.run = run_inline  # type: ignore[method-assign]
    assert c.packed is not None
    assert c.packed.prefetch(list(range(50))) == 50
    assert not c.packed._inflight.get()


def test_data_pack_command(small_digits: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_accel.cli import main as cli_main

    dest = tmp_path / "packed"
    with pytest.raises(SystemExit) as done:
        cli_main(["data", "pack", str(small_digits), str(dest), "--shard-bytes", "20KiB"])
    assert done.value.code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["samples"] == 200 and summary["shards"] > 1
    assert list_origin(ObjectStore(str(dest))).pack is not None
    from lightning_accel.data.cli import main

    assert main(["pack", str(small_digits), str(dest)]) == 1  # exists: refused, names --overwrite (once)
    err = capsys.readouterr().err
    assert "Pass `--overwrite` to replace it" in err and "overwrite=" not in err
    assert main(["pack", str(small_digits), str(tmp_path / "m"), "--manifest", "nope.jsonl"]) == 1
    err = capsys.readouterr().err  # the command's own words for "no manifest", not the Python argument's
    assert "`--manifest`" in err and "manifest=" not in err and "leave out `--manifest`" in err
    assert main(["pack", str(small_digits), str(tmp_path / "x"), "--shard-bytes", "lots"]) == 2
    assert "`--shard-bytes` must be a byte count" in capsys.readouterr().err
    assert main(["pack", str(small_digits), str(tmp_path / "x"), "--shard-bytes", "0"]) == 2
    assert "got '0'. Pass a size such as 16MiB." in capsys.readouterr().err
    # above the in-memory shard bound: a usage error naming the option, before anything is listed or written
    assert main(["pack", str(small_digits), str(tmp_path / "x"), "--shard-bytes", "5GiB"]) == 2
    assert "`--shard-bytes` must be at most 4294967296 bytes" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["pack", str(small_digits), str(tmp_path / "x"), "--storage-options", "[1]"]) == 2
    assert main(["pack", str(tmp_path / "missing"), str(tmp_path / "y")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_empty_and_undecodable_files_are_left_out_with_one_warning(
    small_digits: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from lightning_accel.data.cli import main as data_main

    src = tmp_path / "src"
    shutil.copytree(small_digits, src)
    jpgs = sorted((src / "7").glob("*.jpg"))
    jpgs[0].write_bytes(b"")
    jpgs[1].write_bytes(b"\xff\xd8\xff\xe0 garbage, not a JPEG stream")
    jpgs[2].write_bytes(jpgs[3].read_bytes()[:60])  # truncated
    bad = {f"7/{p.name}" for p in jpgs[:3]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        listing = pack_origin(str(src), str(tmp_path / "packed"))
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "left out 3 of 200 files" in msgs[0] and all(repr(k) in msgs[0] for k in bad)
    assert len(listing) == 197 and not bad & set(listing.keys)
    assert listing.classes == [str(d) for d in range(10)]  # labels do not move
    reread = list_origin(ObjectStore(str(tmp_path / "packed")))
    assert reread.keys == listing.keys and reread.labels == listing.labels
    cache = SampleCache(ObjectStore(str(tmp_path / "packed")), reread, ImageDecoder(16))
    assert cache.load(list(range(len(reread)))).images.shape[0] == 197  # every packed sample decodes
    ref = list_origin(ObjectStore(str(src)))
    good = {k: y for k, y in zip(ref.keys, ref.labels, strict=True) if k not in bad}
    assert dict(zip(reread.keys, reread.labels, strict=True)) == good
    capsys.readouterr()
    assert data_main(["pack", str(src), str(tmp_path / "packed2")]) == 0
    cap = capsys.readouterr()
    warned = [line for line in cap.err.splitlines() if "warning:" in line]
    assert len(warned) == 1 and warned[0].startswith("lightning-accel data: warning: pack_origin: left out 3 of 200")
    assert json.loads(cap.out)["samples"] == 197


def test_a_source_of_only_undecodable_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_bytes(b"")
    with pytest.raises(ValueError, match="none of its 1 files can be decoded"):
        pack_origin(str(tmp_path / "src"), str(tmp_path / "packed"))


def _wait_staged(c: SampleCache) -> None:
    import time

    assert c.packed is not None
    deadline = time.monotonic() + 30
    while c.packed._inflight.get() and time.monotonic() < deadline:
        time.sleep(0.01)


def _packed_on_s3(s3_bucket: tuple[str, dict[str, Any]], small_digits: Path) -> tuple[str, dict[str, Any], Any]:
    """The digits packed into shards of ~10 KB (at least 6) on the test bucket: ``(url, storage options, listing)``."""
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    listing = pack_origin(str(small_digits), url, dest_storage_options=opts, shard_bytes=10_000)
    assert listing.pack is not None and len(listing.pack.shards) >= 6
    return url, opts, listing


def _staging_cache(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path, stage_shards: int
) -> tuple[Any, Any, SampleCache]:
    """``(listing, pack, cache)`` over the packed digits on S3, the stage ``stage_shards`` of the biggest shard."""
    url, opts, listing = _packed_on_s3(s3_bucket, small_digits)
    c = _cache(url, tmp_path, opts, stage_bytes=stage_shards * max(listing.pack.shard_sizes))
    assert c.packed is not None
    return listing, listing.pack, c


def test_a_slow_consumer_never_loses_a_shard_staged_ahead(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    listing, pack, c = _staging_cache(s3_bucket, small_digits, tmp_path, 3)
    assert c.packed is not None
    first = [i for i in range(len(listing)) if pack.shard[i] == 0]
    assert c.packed.prefetch(first) == len(first)  # shard 0 staged ahead for a reader that is slow to come
    _wait_staged(c)
    staged0 = c.packed._path(0)
    os.utime(staged0, (1, 1))  # ...so slow that it is the oldest file of the stage
    others = [i for i in range(len(listing)) if 1 <= pack.shard[i] <= 4]
    c.load(others)  # other readers stage and read 4 more shards: the stage overflows, eviction runs
    assert os.path.exists(staged0)  # spared: no reader has read it yet
    before = c.stats.as_dict()["bytes_fetched"]
    c.load(first)  # the slow reader comes: nothing fetched again
    assert c.stats.as_dict()["bytes_fetched"] == before == sum(pack.shard_sizes[s] for s in range(5))
    assert not list((tmp_path / "shards").glob("*.ahead"))  # read: no longer ahead, eviction may take it


def test_a_shard_a_later_batch_still_needs_survives_eviction_after_the_first_reader_read_it(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    # Two workers of one rank: batch 0 (the first worker's) and batch 1 (the second's) both read shard 0. The first
    # marks its horizon (batch 1 included, whoever reads it), reads batch 0, then stages and reads newer shards
    # before the second has marked anything. Shard 0 must still be staged for batch 1.
    url, opts, listing = _packed_on_s3(s3_bucket, small_digits)
    pack = listing.pack
    biggest = max(pack.shard_sizes)
    first, second = (_cache(url, tmp_path, opts, stage_bytes=3 * biggest) for _ in range(2))
    assert first.packed is not None and second.packed is not None
    shard0 = [i for i in range(len(listing)) if pack.shard[i] == 0]
    half = len(shard0) // 2
    done: set[int] = set()
    assert first.packed.prefetch(shard0[:half]) == half  # the first worker's batch: it stages shard 0
    first.need("a1-1", [(1, shard0[half:])], done.__contains__)  # its horizon: the other worker's batch 1
    _wait_staged(first)
    first.load(shard0[:half])  # read: no longer ahead
    done.add(0)
    first.release_batch("a1-1", 0, shard0[:half])
    staged0 = first.packed._path(0)
    os.utime(staged0, (1, 1))  # the oldest file of the stage
    first.load([i for i in range(len(listing)) if 1 <= pack.shard[i] <= 4])  # the stage overflows, eviction runs
    assert os.path.exists(staged0)  # spared: batch 1 has not been read yet
    second.load(shard0[half:])
    done.add(1)
    second.release_batch("a1-1", 1, shard0[half:])
    assert second.stats.as_dict()["bytes_fetched"] == 0  # nothing fetched twice
    assert not list((tmp_path / "shards").glob("*.need"))  # read: no longer needed, eviction may take it
    # A marker placed for a batch its reader already finished goes at once (the late worker raced the read).
    second.need("a1-1", [(1, shard0[half:])], done.__contains__)
    assert not list((tmp_path / "shards").glob("*.need"))
    # A new order of the same rank removes what the old one left (batches never read: an epoch cut short).
    unread = [i for i in range(len(listing)) if pack.shard[i] == 5]  # marked only while no tier holds a sample
    second.need("a1-1", [(7, unread)], done.__contains__)
    assert len(list((tmp_path / "shards").glob("*.need"))) == 1
    second.need("a1-2", [], done.__contains__)
    assert not list((tmp_path / "shards").glob("*.need"))
    with pytest.raises(ValueError, match="`group` must look like"):
        second.need("../a1-3", [(0, shard0)], done.__contains__)  # a marker name never leaves the stage


def test_a_worker_marks_the_shards_of_the_other_workers_upcoming_batches(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    import lightning_accel.data.dataset as dataset_mod
    from lightning_accel.data import CachedDataset, EpochOrderSampler

    url, opts, listing = _packed_on_s3(s3_bucket, small_digits)
    pack = listing.pack
    c = _cache(url, tmp_path, opts, stage_bytes=3 * max(pack.shard_sizes), prefetch=True)
    ds = CachedDataset(c, prefetch_batches=1)
    bs = sum(1 for s in pack.shard if s == 0) // 2  # batches 0 and 1 both read shard 0
    order = list(EpochOrderSampler(ds, batch_size=bs, shuffle=False))
    stage = tmp_path / "shards"
    monkeypatch.setattr(dataset_mod, "get_worker_info", lambda: types.SimpleNamespace(num_workers=2, id=0))
    assert {p.name.split(".")[-2] for p in stage.glob("*.need")} == {"0", "1", "2", "3"}  # the batches staged ahead
    for p in stage.glob("*.need"):
        p.unlink()  # (to see the horizon alone)
    assert c.packed is not None
    c.packed._needs.get().clear()
    ds.__getitems__(order[:bs])  # worker 0 reads batch 0; its horizon is batches 1 and 2, whoever reads them
    assert {p.name.split(".")[-2] for p in stage.glob("*.need")} == {"1", "2"}
    assert {pack.shard[i] for i in order[bs : 2 * bs]} == {0}
    assert len(list(stage.glob("*.1.need"))) == 1  # shard 0 stays for batch 1 (worker 1's)
    monkeypatch.setattr(dataset_mod, "get_worker_info", lambda: types.SimpleNamespace(num_workers=2, id=1))
    ds.__getitems__(order[bs : 2 * bs])  # worker 1 reads batch 1: done, its markers go
    assert not list(stage.glob("*.1.need")) and int(ds._done[1]) == 1
    assert c.stats.as_dict()["bytes_fetched"] <= sum(pack.shard_sizes[:2])  # shard 0 once (and shard 1 ahead)
    ds.__getitems__(order[bs : 2 * bs])  # batch 1 again: it is done, nothing to release, no error
    ds.__getitems__(order[2 * bs : 3 * bs][::-1])  # not a batch of this order (the last epoch's): no effect
    assert {p.name.split(".")[-2] for p in stage.glob("*.need")} == {"2", "3"}  # the two workers' horizons


def test_batches_that_are_not_the_samplers_turn_marking_off_with_a_warning(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    from lightning_accel.data import CacheDataLoader, CachedDataset, EpochOrderSampler

    listing, pack, c = _staging_cache(s3_bucket, small_digits, tmp_path, 3)
    c.prefetch = True
    ds = CachedDataset(c, prefetch_batches=1)
    sampler = EpochOrderSampler(ds, batch_size=16, shuffle=False)
    CacheDataLoader(ds, batch_size=8, sampler=sampler)
    assert sampler.batch_size == 8  # the loader's batches count
    sampler.batch_size = 16  # a plain DataLoader of 8 over a sampler told 16
    order = list(sampler)
    with pytest.warns(RuntimeWarning, match=r"DataLoader's batches \(8 samples\) are not the sampler's `batch_size`"):
        ds.__getitems__(order[:8])
    ds.__getitems__(order[8:16])  # warned once; nothing marked, nothing left behind
    assert not list((tmp_path / "shards").glob("*.need"))


def test_evictions_that_run_together_delete_only_what_the_stage_needs(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    url, opts, listing = _packed_on_s3(s3_bucket, small_digits)
    pack = listing.pack
    c = _cache(url, tmp_path, opts, stage_bytes=sum(pack.shard_sizes[:4]))
    r = c.packed
    assert r is not None
    (tmp_path / "shards").mkdir()
    for s in range(6):  # six shards staged, oldest first: two too many
        Path(r._path(s)).write_bytes(b"x" * pack.shard_sizes[s])
        os.utime(r._path(s), (s + 1, s + 1))
    scan = r._ahead

    def slow_scan() -> tuple[set[str], int]:
        time.sleep(0.2)  # both evictions have looked before either deletes
        return scan()

    monkeypatch.setattr(r, "_ahead", slow_scan)
    threads = [threading.Thread(target=r._evict, args=(r._path(5),)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.shard")) == sorted(
        Path(r._path(s)).name for s in range(2, 6)
    )  # the two oldest went, and only they


def _dead_pid() -> int:
    """The pid of a process that has exited (free now, as a killed worker's or rank's would be)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def _shard0_cache(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> tuple[Any, SampleCache, list[int]]:
    """``(pack, cache, the samples of shard 0)`` over the packed digits on S3, the default stage."""
    url, opts, listing = _packed_on_s3(s3_bucket, small_digits)
    pack = listing.pack
    assert pack is not None
    c = _cache(url, tmp_path, opts)
    assert c.packed is not None
    return pack, c, [i for i in range(len(listing)) if pack.shard[i] == 0]


def test_needed_markers_of_a_rank_that_died_protect_nothing(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    from lightning_accel.data.pack import _PID_SHIFT, new_publisher_id, order_group

    pack, c, shard0 = _shard0_cache(s3_bucket, small_digits, tmp_path)
    assert c.packed is not None
    c.load(shard0)  # staged, read (no longer ahead)
    gone = order_group(_dead_pid() << _PID_SHIFT | 5, 1)  # a rank killed mid-epoch (its pid is free now)
    c.packed.need(gone, [(3, shard0)], lambda b: False)
    assert c.packed._ahead()[1] == 0  # its marker protects nothing
    here = order_group(new_publisher_id(), 1)  # a live rank's
    c.packed.need(here, [(3, shard0)], lambda b: False)
    assert c.packed._ahead()[1] == pack.shard_sizes[0]


def test_a_read_ahead_marker_of_a_dead_download_is_taken_over(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    pack, c, shard0 = _shard0_cache(s3_bucket, small_digits, tmp_path)
    assert c.packed is not None
    stage = tmp_path / "shards"
    stage.mkdir()
    marker = Path(c.packed._ahead_path(0))
    marker.write_bytes(str(os.getpid()).encode())  # a live reader of the node is downloading it
    assert c.packed.prefetch(shard0) == 0  # left to it
    assert c.packed._ahead()[1] == pack.shard_sizes[0]
    marker.write_bytes(b"")  # being written by its reader: alive as well
    assert c.packed.prefetch(shard0) == 0
    marker.write_bytes(str(_dead_pid()).encode())  # a worker killed mid-download
    assert c.packed._ahead()[1] == 0  # protects nothing
    assert c.packed.prefetch(shard0) == len(shard0)  # taken over: started at once, not after the marker's TTL
    assert marker.read_bytes() == str(os.getpid()).encode()
    _wait_staged(c)
    c.load(shard0)
    assert c.stats.as_dict()["bytes_fetched"] == pack.shard_sizes[0]
    assert not marker.exists()  # read: no longer ahead


def test_a_read_ahead_marker_that_cannot_be_written_still_starts_its_shard(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    pack, c, shard0 = _shard0_cache(s3_bucket, small_digits, tmp_path)
    assert c.packed is not None
    write = os.write
    mine = str(os.getpid()).encode()

    def full_disk(fd: int, data: bytes) -> int:
        if data == mine:  # the marker's pid: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    assert c.packed.prefetch(shard0) == len(shard0)  # no error: the read-ahead goes on
    monkeypatch.setattr(os, "write", write)
    assert Path(c.packed._ahead_path(0)).read_bytes() == b""  # counts as a live download's until its TTL
    _wait_staged(c)
    c.load(shard0)
    assert c.stats.as_dict()["bytes_fetched"] == pack.shard_sizes[0]


def test_a_users_files_beside_the_stage_come_out_byte_identical(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    listing, pack, c = _staging_cache(s3_bucket, small_digits, tmp_path, 2)
    assert c.packed is not None
    stage = tmp_path / "shards"
    stage.mkdir()
    mine = {  # names like the stage's own files, and not
        "notes.txt": b"mine",
        "data.shard": b"a user's shard" * 100,
        "0123456789.shard": b"x" * 50_000,
        "a1.b2-1.3.need": b"",
        "a1.c3-1.0.need": b"named like a marker of the order dropped below",
        "x.ahead": b"keep",
    }
    for name, data in mine.items():
        (stage / name).write_bytes(data)
    os.utime(stage / "data.shard", (1, 1))  # older than anything staged: first in line, were it the stage's
    everything = list(range(len(listing)))
    c.need("c3-1", [(b, everything) for b in range(2)], lambda b: False)
    c.need("c3-2", [], lambda b: False)  # a new order: the old one's markers go
    c.load(everything)  # the stage overflows: eviction runs many times
    with c.reading(("c3-2", 1)):  # a batch's reads, which may wait for room
        c.load(everything[:4])
    c.drop_needs("c3-1")
    assert {n: (stage / n).read_bytes() for n in mine} == mine


def test_the_stage_bound_holds_when_every_staged_shard_is_needed(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    # A global shuffle: every upcoming batch needs most shards. Marked shards are spared only while something
    # else can go; `stage_bytes` stays a bound on disk use.
    listing, pack, c = _staging_cache(s3_bucket, small_digits, tmp_path, 2)
    biggest = max(pack.shard_sizes)
    everything = list(range(len(listing)))
    c.need("b2-1", [(b, everything) for b in range(4)], lambda b: False)
    c.load(everything)
    staged = list((tmp_path / "shards").glob("*.shard"))
    assert sum(p.stat().st_size for p in staged) <= 3 * biggest  # the stage, plus the shard being read
    assert len(list((tmp_path / "shards").glob("*.need"))) == 4 * len(pack.shards)


def test_read_ahead_is_capped_per_node_not_per_process(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    listing = pack_origin(str(small_digits), url, dest_storage_options=opts, shard_bytes=8_000)
    pack = listing.pack
    assert pack is not None and len(pack.shards) >= 8
    biggest = max(pack.shard_sizes)
    # three readers of one node (the main process and two workers), each with its own PackedReader and client
    readers = [_cache(url, tmp_path, opts, stage_bytes=4 * biggest) for _ in range(3)]
    everything = list(range(len(listing)))
    for r in readers:
        assert r.packed is not None
        r.packed.prefetch(everything)
    for r in readers:
        _wait_staged(r)
    staged = list((tmp_path / "shards").glob("*.shard"))
    assert (
        len(staged) >= 1 and sum(p.stat().st_size for p in staged) <= 3 * biggest
    )  # the stage less a shard, node-wide
    assert len(list((tmp_path / "shards").glob("*.ahead"))) == len(staged)


def test_a_shard_evicted_while_a_reader_still_reads_it_is_not_fetched_again(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    listing = pack_origin(str(small_digits), url, dest_storage_options=opts, shard_bytes=10_000)
    pack = listing.pack
    assert pack is not None
    c = _cache(url, tmp_path, opts)
    first = [i for i in range(len(listing)) if pack.shard[i] == 0]
    assert len(first) >= 2
    c.load(first[:1])
    assert c.packed is not None
    os.unlink(c.packed._path(0))  # another reader of the node evicts it between this reader's batches
    c.load(first[1:])
    assert c.stats.as_dict()["bytes_fetched"] == pack.shard_sizes[0]  # read through this reader's map


def test_a_worker_ahead_waits_for_an_earlier_batch_rather_than_evict_its_shard(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    # Two workers of one rank, a stage of two shards. The fast worker has read batches 1 (shard 0) and 3 (shard 1);
    # its batch 5 needs shard 2 while the stage holds only shards that the slow worker's batches 0 and 2 still need.
    # Evicting one of them for batch 5 fetched it again when the slow worker came to it.
    url, opts, listing = _packed_on_s3(s3_bucket, small_digits)
    pack = listing.pack
    slow, fast = (_cache(url, tmp_path, opts, stage_bytes=pack.shard_sizes[0] + pack.shard_sizes[1]) for _ in range(2))
    assert fast.packed is not None
    of = [[i for i in range(len(listing)) if pack.shard[i] == s] for s in range(3)]
    batches = {0: of[0][::2], 1: of[0][1::2], 2: of[1][::2], 3: of[1][1::2], 5: of[2]}
    done: set[int] = set()
    fast.need("a1-1", list(batches.items()), done.__contains__)  # the horizons of both workers

    def read(c: SampleCache, b: int) -> None:
        with c.reading(("a1-1", b)):
            c.load(batches[b])
        done.add(b)
        c.release_batch("a1-1", b, batches[b])

    read(fast, 1)
    read(fast, 3)
    waiting = threading.Event()
    blocked = fast.packed._room_blocked

    def watched(s: int, group: str, batch: int) -> bool:
        if blocked(s, group, batch):
            waiting.set()
            return True
        return False

    monkeypatch.setattr(fast.packed, "_room_blocked", watched)
    ahead = threading.Thread(target=read, args=(fast, 5))
    ahead.start()
    while ahead.is_alive() and not waiting.is_set():  # batch 5 waits (before: it evicted and went on)
        time.sleep(0.01)
    read(slow, 0)  # the slow worker comes
    read(slow, 2)
    ahead.join()
    assert done == set(batches)
    assert slow.stats.as_dict()["bytes_fetched"] == 0  # shards 0 and 1 were still staged
    assert fast.stats.as_dict()["bytes_fetched"] == sum(pack.shard_sizes[:3])  # each shard once
    staged = list((tmp_path / "shards").glob("*.shard"))
    assert sum(p.stat().st_size for p in staged) <= pack.shard_sizes[0] + pack.shard_sizes[1] + max(pack.shard_sizes)
    # Reads outside a batch of an order (read-ahead, a plain load) and later batches' shards never wait.
    assert not fast.packed._room_blocked(3, "a1-1", 0) and not blocked(3, "b2-1", 9)


def test_the_first_batches_keep_their_shards_when_another_worker_reads_them_first(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    import lightning_accel.data.dataset as dataset_mod

    # The sampler stages the first batches' shards ahead. Worker 1 reads batch 1 before worker 0 reads batch 0 (both
    # in shard 0): that read removes shard 0's read-ahead marker, and no worker's horizon covers batch 0. Newer shards
    # then evicted shard 0 before worker 0 read it, and it was fetched twice.
    listing, pack, c = _staging_cache(s3_bucket, small_digits, tmp_path, 4)
    c.prefetch = True
    ds = CachedDataset(c, prefetch_batches=1)
    bs = -(-sum(1 for s in pack.shard if s == 0) // 2)  # batches 0 and 1 read shard 0, no later batch does
    order = list(EpochOrderSampler(ds, batch_size=bs, shuffle=False))  # publishes: the first shards staged ahead
    assert 0 not in {pack.shard[i] for i in order[2 * bs :]}
    _wait_staged(c)
    stage = tmp_path / "shards"
    assert {p.name.split(".")[-2] for p in stage.glob("*.need")} >= {"0", "1"}  # marked by their batches
    monkeypatch.setattr(dataset_mod, "get_worker_info", lambda: types.SimpleNamespace(num_workers=2, id=1))
    ds.__getitems__(order[bs : 2 * bs])  # worker 1's batch 1 first
    assert c.packed is not None
    os.utime(c.packed._path(0), (1, 1))  # the oldest file of the stage
    c.load([i for i in range(len(listing)) if 2 <= pack.shard[i] <= 4])  # newer shards: the stage overflows
    assert os.path.exists(c.packed._path(0))  # spared for batch 0
    c.packed._maps.get().clear()  # worker 0 is another process: no map of shard 0 keeps it readable there
    monkeypatch.setattr(dataset_mod, "get_worker_info", lambda: types.SimpleNamespace(num_workers=2, id=0))
    ds.__getitems__(order[:bs])
    assert c.stats.as_dict()["bytes_fetched"] == sum(pack.shard_sizes[:5])  # each shard once
    assert not list(stage.glob("*.0.need"))  # read: no longer needed


def _hold_lock(path: str, held: Any, done: Any) -> None:
    """In a child process: hold a record lock on ``path`` (a live download of another process) until ``done``."""
    import fcntl

    with open(path, "a+b") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        held.set()
        done.wait(60)


def test_staging_leaves_no_lock_files_and_a_killed_downloads_leftovers_are_swept(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    import multiprocessing as mp

    listing, pack, c = _staging_cache(s3_bucket, small_digits, tmp_path, 2)
    assert c.packed is not None
    stage = tmp_path / "shards"
    c.load(list(range(len(listing))))  # every shard staged, most evicted again
    assert not list(stage.glob("*.lock"))  # a lock file lives only while its lock is held
    names = [os.path.basename(c.packed._path(s)) for s in range(len(pack.shards))]
    # A download killed mid-write (its lock file and half-written temporary file), a live download of another
    # process (its lock held: kept), and a user's files named like the stage's.
    dead_tmp = stage / f".{names[0]}.{'a' * 32}.tmp"
    dead_tmp.write_bytes(b"half a shard")
    (stage / f"{names[0]}.lock").write_bytes(b"")
    (stage / "evict.lock").write_bytes(b"")
    live_tmp = stage / f".{names[1]}.{'b' * 32}.tmp"
    live_tmp.write_bytes(b"being written")
    mine = {
        "notes.lock": b"mine",
        f".{names[2]}.tmp": b"mine too",
        f".data.shard.{'c' * 32}.tmp": b"and mine",
        "0123.shard.lock": b"",
    }
    for name, data in mine.items():
        (stage / name).write_bytes(data)
    ctx = mp.get_context("fork")
    held, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(stage / f"{names[1]}.lock"), held, done))
    holder.start()
    try:
        assert held.wait(30)
        fresh = _cache(c.store.url, tmp_path, c.store.storage_options, stage_bytes=c.packed.stage_bytes)
        assert fresh.packed is not None
        assert not dead_tmp.exists() and not (stage / f"{names[0]}.lock").exists()
        assert not (stage / "evict.lock").exists()
        assert live_tmp.exists() and (stage / f"{names[1]}.lock").exists()  # never a lock a live process holds
    finally:
        done.set()
        holder.join(30)
    assert fresh.packed.sweep() == 2  # its holder is gone: the lock file and the temporary file
    assert not live_tmp.exists() and not (stage / f"{names[1]}.lock").exists()
    assert {n: (stage / n).read_bytes() for n in mine} == mine


def test_needed_markers_of_a_rank_that_died_are_swept(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    from lightning_accel.data.pack import _PID_SHIFT, new_publisher_id, order_group

    pack, c, shard0 = _shard0_cache(s3_bucket, small_digits, tmp_path)
    assert c.packed is not None
    c.load(shard0)
    gone = order_group(_dead_pid() << _PID_SHIFT | 5, 1)  # a rank killed mid-epoch: nothing releases its markers
    here = order_group(new_publisher_id(), 1)
    c.packed.need(gone, [(b, shard0) for b in range(3)], lambda b: False)
    c.packed.need(here, [(3, shard0)], lambda b: False)
    stage = tmp_path / "shards"
    mine = stage / f"{os.path.basename(c.packed._path(0))[:-6]}.notes-1.0.need"  # a user's, named like a marker
    mine.write_bytes(b"mine")
    assert len(list(stage.glob(f"*.{gone}.*.need"))) == 3
    assert c.packed.sweep() == 3
    assert not list(stage.glob(f"*.{gone}.*.need"))
    assert len(list(stage.glob(f"*.{here}.*.need"))) == 1 and mine.read_bytes() == b"mine"  # a live rank's stays
