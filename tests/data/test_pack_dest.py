"""Where ``pack_origin`` may write: an empty or missing destination, or a pack of its own; a user's files there are
never overwritten or removed, an overwrite removes the old pack's unused shards, and an interrupted pack leaves no index
and only files the next pack recognises as its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.data import ObjectStore, list_origin, pack_origin
from lightning_accel.data.pack import PACK_INDEX, PACK_JOURNAL


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _tree(src: Path, root: Path, n: int = 40) -> Path:
    """A small ImageFolder tree: the first ``n`` JPEGs of ``src``, in their class folders."""
    for p in sorted(src.rglob("*.jpg"))[:n]:
        (root / p.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, root / p.parent.name / p.name)
    return root


class _Interrupted(Exception):
    pass


def _interrupt_after(groups: int) -> Any:
    """A ``progress`` callback that stops the pack after ``groups`` groups of samples (shards already written), the
    way a killed process would: nothing after it runs."""
    calls = [0]

    def progress(done: int, total: int) -> None:
        calls[0] += 1
        if calls[0] > groups:
            raise _Interrupted

    return progress


def test_a_users_files_in_the_destination_are_never_overwritten(small_digits: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dst"
    (dest / "shards").mkdir(parents=True)
    (dest / "shards" / "000000.bin").write_bytes(b"USER DATA - my own shard file")
    (dest / "notes.txt").write_text("mine")
    before = _files(dest)
    for overwrite in (False, True):
        with pytest.raises(FileExistsError) as e:
            pack_origin(str(small_digits), str(dest), overwrite=overwrite)
        msg = str(e.value)
        assert "\n" not in msg and str(dest) in msg and "'shards/000000.bin'" in msg and "'notes.txt'" in msg
        assert "new or empty folder" in msg
        assert _files(dest) == before  # nothing written, nothing replaced, no index, no journal


def test_an_imagefolder_tree_is_not_turned_into_a_pack(small_digits: Path, tmp_path: Path) -> None:
    tree = _tree(small_digits, tmp_path / "tree", n=10)
    before = _files(tree)
    with pytest.raises(FileExistsError, match=r"holds 10 file\(s\) that no pack wrote"):
        pack_origin(str(small_digits), str(tree), overwrite=True)
    assert _files(tree) == before
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(FileExistsError, match=r"`dest` '.*afile' is a file"):
        pack_origin(str(small_digits), str(tmp_path / "afile"))
    assert (tmp_path / "afile").read_bytes() == b"x"


def test_an_empty_or_missing_destination_is_fine(small_digits: Path, tmp_path: Path) -> None:
    (tmp_path / "empty" / "shards").mkdir(parents=True)  # empty folders hold no file of anyone's
    for dest in (tmp_path / "empty", tmp_path / "missing" / "deeper"):
        listing = pack_origin(str(small_digits), str(dest), shard_bytes=50_000)
        assert listing.pack is not None
        assert set(_files(dest)) == {PACK_INDEX, *listing.pack.shards}  # the journal is gone


def test_overwrite_replaces_only_the_old_packs_files_and_drops_its_unused_shards(
    small_digits: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "dst"
    old = pack_origin(str(small_digits), str(dest), shard_bytes=5_000).pack
    assert old is not None and len(old.shards) > 10
    new = pack_origin(str(small_digits), str(dest), shard_bytes=50_000, overwrite=True).pack
    assert new is not None and len(new.shards) < len(old.shards)
    # the old pack's shards beyond the new count are gone: only the new pack is left
    assert set(_files(dest)) == {PACK_INDEX, *new.shards}
    assert list_origin(ObjectStore(str(dest))).pack == new
    # a file of the user's beside the pack: an overwrite is refused and touches nothing
    (dest / "shards" / "README").write_text("mine")
    before = _files(dest)
    with pytest.raises(FileExistsError, match=r"'shards/README'"):
        pack_origin(str(small_digits), str(dest), overwrite=True)
    assert _files(dest) == before


def test_a_source_that_fails_before_any_shard_leaves_the_old_pack_whole(small_digits: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dst"
    pack_origin(str(small_digits), str(dest), shard_bytes=50_000)
    before = _files(dest)
    (tmp_path / "bad" / "cls").mkdir(parents=True)
    (tmp_path / "bad" / "cls" / "x.jpg").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="none of its 1 files can be decoded"):
        pack_origin(str(tmp_path / "bad"), str(dest), overwrite=True)
    assert _files(dest) == before  # still the old pack, readable, and no journal
    assert list_origin(ObjectStore(str(dest))).pack is not None
    with pytest.raises(ValueError, match="none of its 1 files"):
        pack_origin(str(tmp_path / "bad"), str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()  # nothing written at all


def test_an_unreadable_index_is_not_taken_as_a_list_of_our_files(small_digits: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dst"
    pack_origin(str(small_digits), str(dest), shard_bytes=50_000)
    (dest / PACK_INDEX).write_text('{"format": "something-else", "shards": []}')
    before = _files(dest)
    with pytest.raises(FileExistsError, match=rf"holds '.*{PACK_INDEX}', which cannot be read as a lightning-accel"):
        pack_origin(str(small_digits), str(dest), overwrite=True)
    assert _files(dest) == before


@pytest.mark.parametrize("overwriting", [False, True], ids=["fresh", "overwrite"])
def test_an_interrupted_pack_leaves_no_index_and_the_next_pack_takes_it_over(
    small_digits: Path, tmp_path: Path, overwriting: bool
) -> None:
    dest = tmp_path / "dst"
    old = pack_origin(str(small_digits), str(dest), shard_bytes=3_000).pack if overwriting else None
    with pytest.raises(_Interrupted):
        pack_origin(
            str(small_digits),
            str(dest),
            shard_bytes=9_000,
            max_concurrency=2,
            overwrite=overwriting,
            progress=_interrupt_after(3),
        )
    left = _files(dest)
    assert PACK_INDEX not in left and PACK_JOURNAL in left  # not a pack: a reader never sees part of one
    assert any(k.startswith("shards/") for k in left)
    journal = json.loads(left[PACK_JOURNAL])
    assert {k for k in left if k != PACK_JOURNAL} <= set(journal["keys"])  # every file written is listed first
    with pytest.raises(ValueError, match="is an incomplete pack: .* Run `lightning-accel data pack SOURCE"):
        list_origin(ObjectStore(str(dest)))
    # an interrupted publish of the index leaves its temporary file: recognised as ours too
    (dest / f".{PACK_INDEX}.{'0' * 32}.tmp").write_text("{")
    again = pack_origin(str(small_digits), str(dest), shard_bytes=20_000)  # no `overwrite`: nothing but our files
    assert again.pack is not None
    assert set(_files(dest)) == {PACK_INDEX, *again.pack.shards}
    if old is not None:
        assert len(old.shards) > len(again.pack.shards)  # the first pack's extra shards went too


def test_the_pack_command_refuses_a_users_folder_in_one_line(
    small_digits: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_accel.data.cli import main

    dest = tmp_path / "dst"
    (dest / "shards").mkdir(parents=True)
    (dest / "shards" / "000000.bin").write_bytes(b"USER DATA")
    assert main(["pack", str(small_digits), str(dest), "--overwrite"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "FileExistsError" in err and str(dest) in err
    assert (dest / "shards" / "000000.bin").read_bytes() == b"USER DATA"


def test_s3_destination_keeps_a_users_objects_and_overwrite_drops_unused_shards(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    src = str(_tree(small_digits, tmp_path / "src", n=40))
    fs.pipe_file(f"{bucket}/mine/shards/000000.bin", b"USER DATA")
    with pytest.raises(FileExistsError, match=rf"`dest` 's3://{bucket}/mine' holds 1 file.*'shards/000000\.bin'"):
        pack_origin(src, f"s3://{bucket}/mine", dest_storage_options=opts, overwrite=True)
    assert fs.cat_file(f"{bucket}/mine/shards/000000.bin") == b"USER DATA"
    assert not fs.exists(f"{bucket}/mine/{PACK_JOURNAL}")

    url = f"s3://{bucket}/packed"
    old = pack_origin(src, url, dest_storage_options=opts, shard_bytes=3_000).pack
    new = pack_origin(src, url, dest_storage_options=opts, shard_bytes=30_000, overwrite=True).pack
    assert old is not None and new is not None and len(new.shards) < len(old.shards)
    assert sorted(fs.find(f"{bucket}/packed")) == sorted(f"{bucket}/packed/{k}" for k in [PACK_INDEX, *new.shards])
    fs.pipe_file(f"{bucket}/packed/notes.txt", b"mine")
    with pytest.raises(FileExistsError, match=r"'notes\.txt'"):
        pack_origin(src, url, dest_storage_options=opts, overwrite=True)
    assert fs.cat_file(f"{bucket}/packed/notes.txt") == b"mine"
    assert list_origin(ObjectStore(url, opts)).pack == new


def test_a_destination_inside_the_source_is_refused_before_anything_is_written(
    small_digits: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Packing into a folder of the source made an empty class folder of it: the source no longer listed."""
    from lightning_accel.data.cli import main as data_main

    src = _tree(small_digits, tmp_path / "src")
    before = _files(src)
    for dest in (src / "packed", src, src / "3" / "deeper"):
        with pytest.raises(ValueError, match=r"`dest` .* is inside `source` .*Choose a destination outside"):
            pack_origin(str(src), str(dest))
    (tmp_path / "link").symlink_to(src)  # the same tree through a link
    with pytest.raises(ValueError, match="is inside `source`"):
        pack_origin(str(tmp_path / "link"), str(src / "packed"))
    assert data_main(["pack", str(src), str(src / "packed")]) == 1
    err = capsys.readouterr().err
    assert "DEST " in err and "is inside SOURCE" in err  # the command's own names for its arguments
    assert _files(src) == before and not (src / "packed").exists()
    assert len(list_origin(ObjectStore(str(src))).keys) == 40  # still a data set
    pack_origin(str(src), str(tmp_path / "src-packed"))  # beside it is fine, a name sharing the prefix included
