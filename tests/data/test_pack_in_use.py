"""A pack that a running process reads is never replaced under it, and a pack whose writing did not finish is refused
when read, with one line naming the fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_accel.data import ObjectStore, list_origin, pack_origin
from lightning_accel.data.cli import main
from lightning_accel.data.lifecycle import mapping_pids
from lightning_accel.data.pack import PACK_INDEX, PACK_JOURNAL

# A reader of the pack in its own process, as a fit's main process or DataLoader worker: it reads one sample, says
# so, waits for a line on stdin, then reads every sample again (all must still match the index it listed). Then (one
# process start serves both checks) it packs SOURCE into the pack it read and kills itself (SIGKILL) once a shard of
# the new pack is written.
_READER = textwrap.dedent(
    """
    import os, signal, sys, tempfile
    from lightning_accel.data import ObjectStore, list_origin, pack_origin
    from lightning_accel.data.pack import PackedReader

    store = ObjectStore(sys.argv[1])
    listing = list_origin(store)
    reader = PackedReader(store, listing.pack, tempfile.mkdtemp())
    reader.read(0, listing.keys[0])
    print("ready", flush=True)
    sys.stdin.readline()
    for i, key in enumerate(listing.keys):
        reader.read(i, key)
    print("read", len(listing.keys), flush=True)
    del reader
    kill = lambda done, total: os.kill(os.getpid(), signal.SIGKILL)
    pack_origin(sys.argv[2], sys.argv[1], shard_bytes=3_000, overwrite=True, progress=kill)
    """
)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_overwrite_refuses_a_pack_another_process_is_reading_and_a_killed_pack_is_refused_when_read(
    small_digits: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "packed"
    pack_origin(str(small_digits), str(dest), shard_bytes=5_000)
    before = _files(dest)
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(dest), str(small_digits)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "ready"
        assert main(["pack", str(small_digits), str(dest), "--overwrite", "--shard-bytes", "9000"]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert str(dest) in err and f"pid {reader.pid}" in err and "nothing was removed" in err
        assert "Stop that process" in err
        assert _files(dest) == before  # the old pack, whole
        out, _ = reader.communicate("go\n", timeout=120)
        assert out.strip() == "read 200"  # read to the end, every CRC-32 matching
        assert reader.returncode == -signal.SIGKILL  # then killed while packing again
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    # killed mid-write: no index, so not a pack; reading it says what to do in one line
    left = _files(dest)
    assert PACK_INDEX not in left and PACK_JOURNAL in left
    with pytest.raises(ValueError) as e:
        list_origin(ObjectStore(str(dest)))
    assert "\n" not in str(e.value) and "is an incomplete pack" in str(e.value) and str(dest) in str(e.value)
    # the reader is gone: the same command completes the pack
    assert main(["pack", str(small_digits), str(dest), "--overwrite", "--shard-bytes", "9000"]) == 0
    assert list_origin(ObjectStore(str(dest))).pack is not None


def test_a_pack_interrupted_mid_write_is_refused_when_read(small_digits: Path, tmp_path: Path) -> None:
    dest = tmp_path / "packed"
    pack_origin(str(small_digits), str(dest), shard_bytes=3_000)

    def ctrl_c(done: int, total: int) -> None:
        # a shard is written: the journal is there, and mapped, so another process's pack refuses this one
        assert os.getpid() in (mapping_pids(str(dest)) or [os.getpid()])
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack_origin(str(small_digits), str(dest), shard_bytes=3_000, overwrite=True, progress=ctrl_c)
    left = _files(dest)
    assert PACK_INDEX not in left and PACK_JOURNAL in left
    with pytest.raises(ValueError) as e:
        list_origin(ObjectStore(str(dest)))
    msg = str(e.value)
    assert "\n" not in msg and str(dest) in msg and "incomplete pack" in msg and "lightning-accel data pack" in msg


def test_the_pack_command_interrupted_says_so_in_one_line(
    small_digits: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_accel.data import cli

    def ctrl_c(done: int, total: int) -> None:
        raise KeyboardInterrupt

    def interrupted(*args: object, **kwargs: object) -> object:
        return pack_origin(*args, **{**kwargs, "shard_bytes": 3_000, "progress": ctrl_c})  # type: ignore[arg-type]

    dest = tmp_path / "packed"
    monkeypatch.setattr(cli, "pack_origin", interrupted)
    assert main(["pack", str(small_digits), str(dest)]) == 130
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "interrupted" in err and str(dest) in err and "Run the same command" in err
    with pytest.raises(ValueError, match="is an incomplete pack"):
        list_origin(ObjectStore(str(dest)))
    monkeypatch.undo()
    assert main(["pack", str(small_digits), str(dest)]) == 0  # the rerun takes the destination over
    assert list_origin(ObjectStore(str(dest))).pack is not None


def test_a_second_pack_into_a_destination_being_written_is_refused(small_digits: Path, tmp_path: Path) -> None:
    dest = tmp_path / "packed"
    pack_origin(str(small_digits), str(dest), shard_bytes=5_000)
    # a writer in another process: it holds the journal of a pack being written mapped, as pack_origin does
    (dest / PACK_JOURNAL).write_text('{"format": "lightning-accel-pack-writing", "keys": []}')
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
            "print('ready', flush=True); sys.stdin.readline()",
            str(dest / PACK_JOURNAL),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        before = _files(dest)
        with pytest.raises(OSError, match=rf"is a pack in use: pid {holder.pid} "):
            pack_origin(str(small_digits), str(dest), overwrite=True)
        assert _files(dest) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_reader_whose_pack_was_replaced_says_so(
    small_digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_accel.data import OriginError
    from lightning_accel.data import pack as pack_module
    from lightning_accel.data.pack import PackedReader

    dest = tmp_path / "packed"
    pack_origin(str(small_digits), str(dest), shard_bytes=5_000)
    store = ObjectStore(str(dest))
    listing = list_origin(store)
    assert listing.pack is not None
    reader = PackedReader(store, listing.pack, str(tmp_path / "stage"))
    reader.read(0, listing.keys[0])
    # replaced under the reader where no process can be seen reading it (another user's process, whose maps cannot be
    # read, or a remote pack; here this process's reader, hidden from the check): the reads fail, and say why, not
    # that the pack is corrupt
    monkeypatch.setattr(pack_module, "_readers_here", lambda root: [])
    pack_origin(str(small_digits), str(dest), shard_bytes=9_000, shuffle_seed=1, overwrite=True)
    for i in (len(listing) - 1, 1):  # a shard the new pack no longer has, then bytes moved within one it rewrote
        with pytest.raises(OriginError) as e:
            reader.read(i, listing.keys[i])
        msg = str(e.value)
        assert "\n" not in msg and "was replaced after it was listed" in msg and "Restart the run" in msg, msg
