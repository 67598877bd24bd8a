from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

from lightning_accel.data.origin import Listing, ObjectStore, OriginError, list_origin


def test_lists_an_imagefolder_like_torchvision(small_digits: Path) -> None:
    from torchvision.datasets import ImageFolder  # type: ignore[import-untyped]

    listing = list_origin(ObjectStore(str(small_digits)))
    ref = ImageFolder(str(small_digits))
    assert listing.classes == ref.classes
    assert [str(small_digits / k) for k in listing.keys] == [p for p, _ in ref.samples]
    assert listing.labels == [y for _, y in ref.samples]


def test_listing_roundtrips_through_its_file(small_digits: Path, tmp_path: Path) -> None:
    listing = list_origin(ObjectStore(f"file://{small_digits}"))
    listing.save(tmp_path / "l.json")
    again = Listing.load(tmp_path / "l.json")
    assert again == listing and again.fingerprint() == listing.fingerprint()


def test_manifest_origin(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"x")
    (tmp_path / "m.jsonl").write_text(json.dumps({"key": "a/x.bin", "label": 2}) + "\n\n")
    listing = list_origin(ObjectStore(str(tmp_path)), manifest="m.jsonl")
    assert (listing.keys, listing.labels, listing.classes) == (["a/x.bin"], [2], ["0", "1", "2"])
    (tmp_path / "bad.jsonl").write_text('{"key": "../etc/passwd", "label": 0}\n')
    with pytest.raises(ValueError, match="escape"):
        list_origin(ObjectStore(str(tmp_path)), manifest="bad.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        list_origin(ObjectStore(str(tmp_path)), manifest="nope.jsonl")


@pytest.mark.parametrize("label", [-1, 3.7, True, "3", None])
def test_a_manifest_label_must_be_an_integer_at_least_0(tmp_path: Path, label: object) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"x")
    lines = [{"key": "a/x.bin", "label": 0}, {"key": "a/x.bin", "label": label}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(ValueError, match=r"`manifest` '.*m\.jsonl' line 2 \(key 'a/x\.bin'\) has label .*>= 0") as e:
        list_origin(ObjectStore(str(tmp_path)), manifest="m.jsonl")
    assert "\n" not in str(e.value)


def test_missing_or_empty_origin_names_the_url(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        list_origin(ObjectStore(str(tmp_path / "missing")))
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    (tmp_path / "empty" / "top.jpg").write_bytes(b"not in a class dir")
    with pytest.raises(ValueError, match=r"empty. holds no files"):
        list_origin(ObjectStore(str(tmp_path / "empty")))


def test_missing_key_is_permanent_and_names_the_url(small_digits: Path) -> None:
    store = ObjectStore(str(small_digits), retries=3, backoff_s=0.0)
    with pytest.raises(OriginError, match=r"0/nope\.jpg.*FileNotFoundError"):
        store.fetch("0/nope.jpg")
    assert store.retried == 0
    with pytest.raises(ValueError, match="escape"):
        store.fetch("../secret")


class _Flaky(AbstractFileSystem):
    """A remote filesystem (``la-flaky-origin://``) over local files: the first ``fail`` reads raise a transient
    error."""

    protocol = "la-flaky-origin"
    fail = 0

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        if _Flaky.fail > 0:
            _Flaky.fail -= 1
            raise ConnectionResetError("connection reset by peer")
        return LocalFileSystem().cat_file(path, start=start, end=end)


def test_transient_errors_are_retried_with_backoff_then_fail_clearly(small_digits: Path) -> None:
    fsspec.register_implementation(_Flaky.protocol, _Flaky, clobber=True)
    store = ObjectStore(f"{_Flaky.protocol}://{small_digits}", retries=2, backoff_s=0.001)
    key = list_origin(ObjectStore(str(small_digits))).keys[0]
    _Flaky.fail = 2
    assert store.fetch(key) == (small_digits / key).read_bytes()
    assert store.retried == 2
    _Flaky.fail = 10
    with pytest.raises(OriginError, match=r"after 3 attempts.*ConnectionResetError"):
        store.fetch(key)


def test_fetch_many_is_concurrent_and_ordered(small_digits: Path) -> None:
    store = ObjectStore(str(small_digits), max_concurrency=4)
    keys = list_origin(store).keys[:20]
    assert store.fetch_many(keys) == [(small_digits / k).read_bytes() for k in keys]
    assert store.bytes_read == sum((small_digits / k).stat().st_size for k in keys)


def test_s3_origin_through_moto(s3_bucket: tuple[str, dict[str, Any]], small_digits: Path) -> None:
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    local = sorted(p for p in small_digits.rglob("*.jpg"))[:12]
    for p in local:
        fs.pipe_file(f"{bucket}/train/{p.parent.name}/{p.name}", p.read_bytes())
    store = ObjectStore(f"s3://{bucket}/train", opts)
    listing = list_origin(store)
    assert len(listing) == 12 and set(listing.classes) <= {str(i) for i in range(10)}
    assert store.fetch(listing.keys[0]) == (small_digits / listing.keys[0]).read_bytes()
    with pytest.raises(OriginError, match=rf"s3://{bucket}/train/0/missing\.jpg"):
        store.fetch("0/missing.jpg")
    with pytest.raises(FileNotFoundError, match=rf"s3://{bucket}/nothing"):
        list_origin(ObjectStore(f"s3://{bucket}/nothing", opts))


def test_s3_keys_that_cannot_be_read_are_left_out_of_the_listing_with_a_warning(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    local = sorted(p for p in small_digits.rglob("*.jpg"))[:6]
    for p in local:
        fs.pipe_file(f"{bucket}/train/{p.parent.name}/{p.name}", p.read_bytes())
    cls = local[0].parent.name
    # names S3 accepts, which no read under the origin does (`::` chains filesystems, a backslash is a separator)
    fs.pipe_file(f"{bucket}/train/{cls}/win\\shot.jpg", local[0].read_bytes())
    fs.pipe_file(f"{bucket}/train/{cls}/a::b.jpg", local[0].read_bytes())
    store = ObjectStore(f"s3://{bucket}/train", opts)
    with pytest.warns(RuntimeWarning, match=r"left out 2 file\(s\) whose keys are not plain relative paths \("):
        listing = list_origin(store)
    assert sorted(listing.keys) == sorted(f"{p.parent.name}/{p.name}" for p in local)
    assert store.fetch_many(listing.keys) == [(small_digits / k).read_bytes() for k in listing.keys]
    # a class folder holding only such files is refused, as an empty one is: dropping it would shift the labels
    fs.pipe_file(f"{bucket}/train/zz/a::b.jpg", local[0].read_bytes())
    with pytest.warns(RuntimeWarning, match="left out 3 file"), pytest.raises(ValueError, match=r"\['zz'\] holding no"):
        list_origin(store)


def test_memory_origin() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/la-test-origin/cat/a.png", b"1")
    fs.pipe_file("/la-test-origin/dog/b.png", b"22")
    listing = list_origin(ObjectStore("memory://la-test-origin"))
    assert (listing.keys, listing.labels) == (["cat/a.png", "dog/b.png"], [0, 1])
    assert ObjectStore("memory://la-test-origin").fetch("dog/b.png") == b"22"


def test_pickles_without_handles_and_a_forked_child_opens_its_own(small_digits: Path) -> None:
    import os
    import pickle
    import sys

    store = ObjectStore(f"file://{small_digits}", max_concurrency=2)
    keys = list_origin(store).keys[:4]
    store.fetch_many(keys)  # the pool and the filesystem exist now
    parent_fs, parent_pool = store.fs, store._pool
    copy = pickle.loads(pickle.dumps(store))
    assert copy.url == store.url and copy.retries == store.retries and copy._pool is None
    assert copy.retried == 0 and copy.bytes_read == 0 and copy.fs is not parent_fs
    assert copy.fetch_many(keys) == store.fetch_many(keys)
    if not hasattr(os, "fork") or sys.platform != "linux":
        return
    pid = os.fork()
    if pid == 0:  # the parent's pool threads do not exist here: a fresh pool and filesystem, same results
        code = 1
        try:
            fresh = store._pool is None and store.fs is not parent_fs
            code = 0 if fresh and store.fetch_many(keys) == [(small_digits / k).read_bytes() for k in keys] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store._pool is parent_pool and store.fs is parent_fs


def test_store_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"`origin` must be a non-empty path or fsspec URL, got ' '"):
        ObjectStore(" ")
    with pytest.raises(TypeError, match=r"`origin` must be a non-empty path or fsspec URL, got 3 \(int\)"):
        ObjectStore(3)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"`max_concurrency` must be an integer >= 1 and <= 1024, got 0\. It counts origin"
    ):
        ObjectStore("/data", max_concurrency=0)
    with pytest.raises(TypeError, match=r"`max_concurrency` must be an integer >= 1 and <= 1024, got True \(bool\)"):
        ObjectStore("/data", max_concurrency=True)


@pytest.mark.parametrize(
    ("kw", "error", "pattern"),
    [
        # a thread each: a million would exhaust the process's threads (CachedDataModule refuses it as well)
        (
            {"max_concurrency": 10**6},
            ValueError,
            r"^`max_concurrency` must be an integer >= 1 and <= 1024, got 1000000\. It counts origin reads in flight "
            r"per process, a thread each \(16 to 64 suit an object store\)\.$",
        ),
        ({"max_concurrency": 0}, ValueError, r"^`max_concurrency` must be an integer >= 1 and <= 1024, got 0\. "),
        ({"max_concurrency": 4.0}, TypeError, r"^`max_concurrency` must be an integer >= 1 and <= 1024, got 4\.0 "),
        (
            {"retries": 10**6},
            ValueError,
            r"^`retries` must be an integer >= 0 and <= 16, got 1000000\. It counts retries of a transient origin",
        ),
        ({"retries": -1}, ValueError, r"^`retries` must be an integer >= 0 and <= 16, got -1\. "),
        ({"backoff_s": float("nan")}, ValueError, r"^`backoff_s` must be a number >= 0 and <= 86400, got nan\. "),
    ],
)
def test_store_counts_are_bounded_like_the_datamodules(
    kw: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        ObjectStore("/data", **kw)
    # the bounds themselves are accepted
    store = ObjectStore("/data", max_concurrency=1024, retries=16)
    assert (store.max_concurrency, store.retries) == (1024, 16)
