"""A file changed under the same name is decoded again, never served from the cache: each cache entry's key holds the
sample's content identity (a tree's size and mtime or ETag, recorded in the listing; a pack's CRC-32 and size)."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from lightning_accel.data import ImageDecoder, Listing, LmdbTier, ObjectStore, SampleCache, list_origin, pack_origin
from lightning_accel.data.origin import SampleKeys

_SHADES = {"a/0.bmp": 10, "a/1.bmp": 20, "a/2.bmp": 30, "b/0.bmp": 110, "b/1.bmp": 120, "b/2.bmp": 130}


def _bmp(shade: int) -> bytes:
    """A 16 px image of one grey level: a BMP, so every shade has the same byte size (a change shows only in the
    bytes, not the size)."""
    buf = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), shade, np.uint8)).save(buf, "BMP")
    return buf.getvalue()


def _tree(root: Path) -> Path:
    for key, shade in _SHADES.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(_bmp(shade))
    return root


def _rewrite(path: Path, shade: int) -> None:
    """New bytes, same name and size. The mtime is moved on by a second as well, so the test does not depend on the
    filesystem's timestamp granularity (ext4 and tmpfs keep nanoseconds; others keep less)."""
    before = path.stat()
    path.write_bytes(_bmp(shade))
    assert path.stat().st_size == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))


def _cache(store: ObjectStore, listing: Listing, tmp: Path) -> SampleCache:
    return SampleCache(store, listing, ImageDecoder(16), ssd=LmdbTier(tmp / "ssd", 64 << 20, name="ssd"))


def _shades(cache: SampleCache) -> dict[str, int]:
    """key -> the grey level the cache serves for it."""
    out = cache.load(list(range(len(cache.listing))))
    return {cache.listing.keys[i]: int(out.images[p, 0, 0, 0]) for p, i in enumerate(out.kept)}


def test_a_changed_file_of_a_local_tree_is_decoded_again(tmp_path: Path) -> None:
    origin = _tree(tmp_path / "origin")
    store = ObjectStore(str(origin))
    first = list_origin(store)
    assert first.stamps is not None and len(set(first.stamps)) == len(first)
    assert _shades(_cache(store, first, tmp_path)) == _SHADES
    _rewrite(origin / "a/0.bmp", 222)
    stale = _cache(store, first, tmp_path)  # the old listing names the old file: its entry, as listed then
    assert _shades(stale)["a/0.bmp"] == 10 and stale.stats.as_dict()["origin_fetches"] == 0
    fresh = _cache(store, list_origin(store), tmp_path)  # listed again: the changed file has a new key
    assert _shades(fresh) == {**_SHADES, "a/0.bmp": 222}
    s = fresh.stats.as_dict()
    assert (s["origin_fetches"], s["ssd_hits"]) == (1, len(_SHADES) - 1)  # only the changed file is read


def test_a_changed_target_of_a_symlinked_tree_is_decoded_again(tmp_path: Path) -> None:
    """A tree of links into a shared store: the change is in the file a link points to, not in the link."""
    store_dir = _tree(tmp_path / "store")
    origin = tmp_path / "origin"
    for key in _SHADES:
        (origin / key).parent.mkdir(parents=True, exist_ok=True)
        (origin / key).symlink_to(store_dir / key)
    store = ObjectStore(str(origin))
    assert _shades(_cache(store, list_origin(store), tmp_path)) == _SHADES
    _rewrite(store_dir / "b/0.bmp", 5)
    again = _cache(store, list_origin(store), tmp_path)
    assert _shades(again) == {**_SHADES, "b/0.bmp": 5} and again.stats.as_dict()["origin_fetches"] == 1


def test_the_datamodule_serves_a_changed_file_after_prepare_data(tmp_path: Path) -> None:
    from lightning_accel.data import CachedDataModule

    origin = _tree(tmp_path / "origin")

    def served(**kw: Any) -> tuple[dict[str, int], int]:
        dm = CachedDataModule(
            str(origin), cache_dir=str(tmp_path / "cache"), ram_bytes=0, image_size=16, num_workers=0, **kw
        )
        dm.prepare_data()  # lists the origin again (rank 0 of each node), saved for every rank and worker
        dm.setup("fit")
        assert dm.train_set is not None
        return _shades(dm.train_set.cache), dm.cache_stats["origin_fetches"]

    for kw in ({"val_fraction": 0.0}, {"val_fraction": 0.0, "classes": ["a", "b", "c"]}):  # classes: a remapped listing
        _tree(origin)
        assert served(**kw)[0] == _SHADES
        _rewrite(origin / "b/1.bmp", 77)
        assert served(**kw) == ({**_SHADES, "b/1.bmp": 77}, 1)


def test_a_repacked_origin_serves_the_changed_file(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    packed = str(tmp_path / "packed")
    pack_origin(str(src), packed, shard_bytes=2_000)
    store = ObjectStore(packed)
    assert _shades(_cache(store, list_origin(store), tmp_path)) == _SHADES
    _rewrite(src / "a/2.bmp", 99)
    pack_origin(str(src), packed, shard_bytes=2_000, overwrite=True)  # what docs/data.md says to do
    again = _cache(store, list_origin(store), tmp_path)
    assert _shades(again) == {**_SHADES, "a/2.bmp": 99}
    assert again.stats.as_dict()["origin_fetches"] == 1


def test_a_changed_object_of_an_s3_tree_is_decoded_again(s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    for key, shade in _SHADES.items():
        fs.pipe_file(f"{bucket}/train/{key}", _bmp(shade))
    store = ObjectStore(f"s3://{bucket}/train", opts)
    first = list_origin(store)
    etag = fs.info(f"{bucket}/train/a/1.bmp")["ETag"].strip('"')
    assert first.stamps is not None and etag in first.stamps[first.keys.index("a/1.bmp")]  # from the listing
    assert _shades(_cache(store, first, tmp_path)) == _SHADES
    fs.pipe_file(f"{bucket}/train/a/1.bmp", _bmp(66))  # same key, same size, new bytes
    again = _cache(store, list_origin(store), tmp_path)
    assert _shades(again) == {**_SHADES, "a/1.bmp": 66}
    assert again.stats.as_dict()["origin_fetches"] == 1


def test_a_changed_file_of_a_manifest_is_decoded_again(tmp_path: Path) -> None:
    origin = _tree(tmp_path / "origin")
    lines = [{"key": k, "label": i % 2} for i, k in enumerate(_SHADES)]
    (origin / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    store = ObjectStore(str(origin))
    assert _shades(_cache(store, list_origin(store, manifest="m.jsonl"), tmp_path)) == _SHADES
    _rewrite(origin / "b/2.bmp", 3)
    again = _cache(store, list_origin(store, manifest="m.jsonl"), tmp_path)
    assert _shades(again) == {**_SHADES, "b/2.bmp": 3} and again.stats.as_dict()["origin_fetches"] == 1


def test_a_manifest_key_that_escapes_names_the_manifest_and_the_line(tmp_path: Path) -> None:
    origin = _tree(tmp_path / "origin")
    (origin / "m.jsonl").write_text('{"key": "a/0.bmp", "label": 0}\n\n{"key": "../outside.bmp", "label": 1}\n')
    with pytest.raises(ValueError, match=r"`manifest` '.*m\.jsonl' line 3 has key '\.\./outside\.bmp'.*escape") as e:
        list_origin(ObjectStore(str(origin)), manifest="m.jsonl")
    assert "\n" not in str(e.value)


def test_keys_are_made_once_and_are_the_same_in_every_process(tmp_path: Path) -> None:
    origin = _tree(tmp_path / "origin")
    store = ObjectStore(str(origin))
    c = _cache(store, list_origin(store), tmp_path)
    n = len(c)
    keys = c.keys_of(range(n))
    assert c.key(3) is keys[3]  # one list, made once: a read indexes it
    assert len(set(keys)) == n and all(k.startswith(f"{c.namespace}/".encode()) for k in keys)
    copy = pickle.loads(pickle.dumps(c))  # a spawned worker's copy makes its own, from the same listing
    assert copy._keys is None and copy.keys_of(range(n)) == keys
    saved = tmp_path / "listing.json"
    c.listing.save(saved)  # what every rank and worker reads
    assert _cache(store, Listing.load(saved), tmp_path).keys_of(range(n)) == keys


def test_the_content_identity_travels_with_the_keys(tmp_path: Path) -> None:
    from lightning_accel.data.datamodule import map_classes

    listing = list_origin(ObjectStore(str(_tree(tmp_path / "origin"))))
    assert isinstance(listing.keys, SampleKeys) and listing.stamps is not None
    relabelled = Listing(listing.origin, listing.keys, [1 - y for y in listing.labels], listing.classes)
    assert relabelled.stamps == listing.stamps  # rebuilt from its keys: the same identities
    assert map_classes(listing, ["a", "b", "c"], name="origin", manifest=False).stamps == listing.stamps
    assert Listing.from_json(listing.to_json()).stamps == listing.stamps
    assert Listing(listing.origin, list(listing.keys), listing.labels).stamps is None  # a plain list carries none
    old = json.loads(listing.to_json())
    del old["stamps"]  # a listing file written before identities were recorded
    assert Listing.from_json(json.dumps(old)).stamps is None
    assert listing.fingerprint() != Listing.from_json(json.dumps(old)).fingerprint()
    with pytest.raises(ValueError, match=r"`stamps` must hold one content identity per key: got 1 for 2 keys"):
        SampleKeys(["a/x", "b/y"], ["1"])
