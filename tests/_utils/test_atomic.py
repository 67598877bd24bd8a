from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_accel._utils import atomic_write_bytes, atomic_write_text
from lightning_accel._utils.atomic import is_local_url, strip_file_scheme


def test_atomic_write_replaces_and_leaves_no_tmp(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "f.bin"
    atomic_write_bytes(p, b"one")
    atomic_write_bytes(p, b"two")
    assert p.read_bytes() == b"two"
    assert [x.name for x in p.parent.iterdir()] == ["f.bin"]


def test_atomic_write_file_url(tmp_path: Path) -> None:
    atomic_write_text(f"file://{tmp_path}/a.txt", "héllo")
    assert (tmp_path / "a.txt").read_text("utf-8") == "héllo"
    assert is_local_url(f"file://{tmp_path}") and not is_local_url("s3://b/k")
    assert strip_file_scheme("file:///x/y") == "/x/y"


def test_failed_write_keeps_old_file_and_cleans_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "f.bin"
    atomic_write_bytes(p, b"old")

    def boom(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="No space"):
        atomic_write_bytes(p, b"new")
    assert p.read_bytes() == b"old"
    assert [x.name for x in tmp_path.iterdir()] == ["f.bin"]


def test_atomic_write_s3(s3_bucket: tuple[str, dict]) -> None:
    import fsspec

    bucket, opts = s3_bucket
    atomic_write_bytes(f"s3://{bucket}/dir/obj", b"payload", storage_options=opts)
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    assert fs.cat_file(f"{bucket}/dir/obj") == b"payload"
