"""A local pack is never replaced under a reader of this same process, and two packs into one destination started at
once never both write: the second is refused in one line, and the first one's pack is whole."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_accel.data import ObjectStore, list_origin, pack_origin
from lightning_accel.data.pack import PACK_INDEX, PACK_JOURNAL, PACK_LOCK, PackedReader, PackInUseError


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _reader(dest: Path, stage: Path) -> tuple[PackedReader, list[str]]:
    store = ObjectStore(str(dest))
    listing = list_origin(store)
    assert listing.pack is not None
    return PackedReader(store, listing.pack, str(stage)), listing.keys


def test_overwrite_refuses_a_pack_a_reader_of_this_process_still_reads(small_digits: Path, tmp_path: Path) -> None:
    dest = tmp_path / "packed"
    pack_origin(str(small_digits), str(dest), shard_bytes=5_000)
    before = _files(dest)
    reader, keys = _reader(dest, tmp_path / "stage")
    reader.read(0, keys[0])
    with pytest.raises(PackInUseError) as e:
        pack_origin(str(small_digits), str(dest), shard_bytes=9_000, overwrite=True)
    msg = str(e.value)
    assert "\n" not in msg and str(dest) in msg and "1 PackedReader(s)" in msg and "nothing was removed" in msg, msg
    assert "close()" in msg
    assert _files(dest) == before  # the old pack, whole, and no lock file left behind
    assert [reader.read(i, k) for i, k in enumerate(keys)]  # every CRC-32 still matches
    # a copy made for a DataLoader worker (pickled) reads the pack too
    copy = pickle.loads(pickle.dumps(reader))
    reader.close()
    reader.close()  # idempotent
    with pytest.raises(PackInUseError, match="1 PackedReader"):
        pack_origin(str(small_digits), str(dest), shard_bytes=9_000, overwrite=True)
    copy.close()
    pack_origin(str(small_digits), str(dest), shard_bytes=9_000, overwrite=True)  # closed readers do not count
    assert _files(dest) != before


def test_a_dropped_reader_does_not_count_even_inside_a_reference_cycle(small_digits: Path, tmp_path: Path) -> None:
    dest = tmp_path / "packed"
    pack_origin(str(small_digits), str(dest), shard_bytes=5_000)
    gc.disable()  # the cycle below is collected by pack_origin, not by an automatic collection in between
    try:
        reader, keys = _reader(dest, tmp_path / "stage")
        holder = {"reader": reader}
        holder["self"] = holder  # a data module and its cache refer to each other the same way
        reader.read(0, keys[0])
        del reader, holder
        pack_origin(str(small_digits), str(dest), shard_bytes=9_000, overwrite=True)
    finally:
        gc.enable()
    assert list_origin(ObjectStore(str(dest))).pack is not None


# Packs SOURCE into DEST (overwrite) once BARRIER exists. Mapping the journal is slowed down, which widens the window
# between a pack's in-use check and the moment its journal shows as mapped to other processes.
_PACKER = textwrap.dedent(
    """
    import os, sys, time
    from lightning_accel.data import pack as P

    hold = P._hold
    P._hold = lambda path: (time.sleep(1.0), hold(path))[1]
    print("ready", flush=True)
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.001)
    try:
        P.pack_origin(sys.argv[1], sys.argv[2], shard_bytes=3_000, overwrite=True)
    except P.PackInUseError as e:
        print("refused", e, flush=True)
    else:
        print("packed", flush=True)
    """
)


def test_two_packs_started_at_once_into_one_destination_one_is_refused(small_digits: Path, tmp_path: Path) -> None:
    dest = tmp_path / "packed"
    pack_origin(str(small_digits), str(dest), shard_bytes=5_000)
    barrier = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PACKER, str(small_digits), str(dest), str(barrier)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        barrier.touch()  # both released at once
        outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sorted((o.split() or ["crashed"])[0] for o in outs) == ["packed", "refused"], outs
    (refused,) = [o for o in outs if o.startswith("refused")]
    winner = procs[[o.startswith("packed") for o in outs].index(True)]
    assert "\n" not in refused and str(dest) in refused and "nothing was removed" in refused, refused
    assert f"pid {winner.pid} is writing a pack there" in refused or "another process is writing" in refused, refused
    # the winner's pack is whole: every sample reads back with its CRC-32 and equals the source's bytes
    left = _files(dest)
    assert PACK_JOURNAL not in left and PACK_LOCK not in left
    reader, keys = _reader(dest, tmp_path / "stage")
    for i, key in enumerate(keys):
        assert reader.read(i, key) == (small_digits / key).read_bytes()
    reader.close()


def test_a_lock_file_left_by_a_killed_pack_is_taken_over(small_digits: Path, tmp_path: Path) -> None:
    dest = tmp_path / "packed"
    pack_origin(str(small_digits), str(dest), shard_bytes=5_000)
    (dest / PACK_LOCK).write_text("12345")  # no process holds its lock: a pack killed before it removed it
    assert list_origin(ObjectStore(str(dest))).pack is not None  # still a pack
    pack_origin(str(small_digits), str(dest), shard_bytes=9_000, overwrite=True)
    left = _files(dest)
    assert PACK_LOCK not in left and PACK_INDEX in left


def test_a_pack_whose_source_fails_leaves_no_destination_folder(tmp_path: Path) -> None:
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_bytes(b"not a jpeg")
    dest = tmp_path / "new" / "deeper" / "packed"
    with pytest.raises(ValueError, match="none of its 1 files can be decoded"):
        pack_origin(str(tmp_path / "src"), str(dest))
    assert not (tmp_path / "new").exists()


def test_an_interrupted_pack_does_not_keep_the_destination_looking_in_use(small_digits: Path, tmp_path: Path) -> None:
    from lightning_accel.data.lifecycle import mapping_pids

    dest = tmp_path / "packed"

    def ctrl_c(done: int, total: int) -> None:
        raise KeyboardInterrupt

    # the exception is kept alive, with its traceback and frames, as a notebook keeps the last one
    with pytest.raises(KeyboardInterrupt) as interrupted:
        pack_origin(str(small_digits), str(dest), shard_bytes=3_000, progress=ctrl_c)
    assert PACK_JOURNAL in _files(dest) and PACK_LOCK not in _files(dest)
    # nothing of this process still holds the journal: a pack run from another process is not refused with our pid
    assert os.getpid() not in (mapping_pids(str(dest)) or [])
    assert interrupted.value is not None


def test_a_data_module_built_on_a_pack_in_this_process_holds_it_until_dropped(
    small_digits: Path, tmp_path: Path
) -> None:
    from lightning_accel.data import CachedDataModule

    packed = tmp_path / "packed"
    pack_origin(str(small_digits), str(packed), shard_bytes=5_000)
    dm = CachedDataModule(str(packed), cache_dir=str(tmp_path / "cache"), ram_bytes=0, num_workers=0)
    dm.setup("fit")
    with pytest.raises(PackInUseError, match="PackedReader"):
        pack_origin(str(small_digits), str(packed), shard_bytes=9_000, overwrite=True)
    del dm  # what the refusal says to do
    pack_origin(str(small_digits), str(packed), shard_bytes=9_000, overwrite=True)


def test_a_destination_a_pack_was_killed_in_before_its_first_shard_says_so_when_read(tmp_path: Path) -> None:
    dest = tmp_path / "packed"
    dest.mkdir()
    (dest / PACK_LOCK).write_text("12345")  # all such a pack leaves
    with pytest.raises(ValueError) as e:
        list_origin(ObjectStore(str(dest)))
    msg = str(e.value)
    assert "\n" not in msg and "is an incomplete pack" in msg and PACK_LOCK in msg and "data pack" in msg, msg
