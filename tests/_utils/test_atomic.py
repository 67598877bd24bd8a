from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


@pytest.mark.parametrize("name", ["n" * 230, "é" * 127, "x" * 255])
def test_long_valid_file_names_are_written_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    import re

    from lightning_accel.checkpoint.store import _TMP_RE  # the clean-up must still recognise the temporary file

    p = tmp_path / name
    p.write_bytes(b"old")
    seen: list[str] = []
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        seen.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    atomic_write_bytes(p, b"new")
    assert p.read_bytes() == b"new"
    assert [x.name for x in tmp_path.iterdir()] == [name]
    assert len(os.fsencode(seen[0])) <= 255 and _TMP_RE.match(seen[0])
    assert re.fullmatch(r"\.(.+)\.[0-9a-f]{32}\.tmp", seen[0]).group(1) == name[: len(seen[0]) - 38]  # type: ignore[union-attr]


def test_overwrite_keeps_the_permission_bits(tmp_path: Path) -> None:
    from lightning_accel._utils.atomic import atomic_publish_file

    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    secret.chmod(0o600)
    atomic_write_bytes(secret, b'{"a": 1}')
    assert secret.stat().st_mode & 0o777 == 0o600
    done = tmp_path / "finished.json"
    done.write_text("{}")
    done.chmod(0o644)
    atomic_publish_file(done, secret)  # a finished file renamed into place takes the old file's bits too
    assert secret.stat().st_mode & 0o777 == 0o600
    fresh = tmp_path / "fresh.json"
    atomic_write_bytes(fresh, b"{}")  # a new file: the umask's default, as open() gives
    umask = os.umask(0)
    os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_write_s3(s3_bucket: tuple[str, dict]) -> None:
    import fsspec

    bucket, opts = s3_bucket
    atomic_write_bytes(f"s3://{bucket}/dir/obj", b"payload", storage_options=opts)
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    assert fs.cat_file(f"{bucket}/dir/obj") == b"payload"


def test_publish_bytes_and_a_finished_file_locally(tmp_path: Path) -> None:
    import fsspec

    from lightning_accel._utils.atomic import atomic_publish_file

    target = tmp_path / "out" / "index.json"
    atomic_publish_file(b"one", target)
    atomic_publish_file(b"two", str(target), fs=fsspec.filesystem("file"))  # a local fsspec filesystem: local rules
    assert target.read_bytes() == b"two"
    done = tmp_path / "written-elsewhere.bin"
    done.write_bytes(b"three")
    atomic_publish_file(done, target)  # a finished file is renamed into place, not copied
    assert target.read_bytes() == b"three" and not done.exists()
    atomic_publish_file(b"four", f"file://{target}", durable=False)
    assert target.read_bytes() == b"four"
    assert sorted(x.name for x in target.parent.iterdir()) == ["index.json"]


def test_publish_a_file_from_another_filesystem_copies_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from lightning_accel._utils import atomic

    src = tmp_path / "src.bin"
    src.write_bytes(b"payload")
    real_replace = os.replace

    def cross_device(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
        if Path(a) == src:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", cross_device)
    atomic.atomic_publish_file(src, tmp_path / "dst" / "f.bin")
    assert (tmp_path / "dst" / "f.bin").read_bytes() == b"payload" and not src.exists()
    assert [x.name for x in (tmp_path / "dst").iterdir()] == ["f.bin"]


def test_failed_publish_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_accel._utils.atomic import atomic_publish_file

    p = tmp_path / "f.bin"
    atomic_publish_file(b"old", p)

    def boom(a: object, b: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="No space"):
        atomic_publish_file(b"new", p)
    assert p.read_bytes() == b"old" and [x.name for x in tmp_path.iterdir()] == ["f.bin"]


def _recording(calls: list[str], name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return real(*args, **kwargs)

    return call


def test_publish_s3_is_one_put_under_the_final_name(
    s3_bucket: tuple[str, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    from lightning_accel._utils.atomic import atomic_publish_file

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    calls: list[str] = []
    for name in ("pipe_file", "put_file", "mv", "copy", "rm_file", "rm"):
        monkeypatch.setattr(fs, name, _recording(calls, name, getattr(fs, name)))
    atomic_publish_file(b"payload", f"s3://{bucket}/dir/index.json", fs=fs)
    atomic_publish_file(b"again", f"{bucket}/dir/other.json", fs=fs)  # a path of `fs`, no protocol
    src = tmp_path / "shard.bin"
    src.write_bytes(b"shard bytes")
    atomic_publish_file(src, f"s3://{bucket}/dir/shard.bin", fs=fs)
    assert calls == ["pipe_file", "pipe_file", "put_file"]  # no temporary object, no copy + delete
    assert not src.exists()
    atomic_publish_file(b"by url", f"s3://{bucket}/dir/url.bin", storage_options=opts)
    fs.invalidate_cache()
    assert sorted(fs.ls(f"{bucket}/dir")) == [
        f"{bucket}/dir/{n}" for n in ("index.json", "other.json", "shard.bin", "url.bin")
    ]
    assert (
        fs.cat_file(f"{bucket}/dir/index.json") == b"payload"
        and fs.cat_file(f"{bucket}/dir/shard.bin") == b"shard bytes"
    )
