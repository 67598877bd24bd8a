"""Readers racing the writer (grace period, one re-read), manifest checksums, truncated manifests, and copies of
every blob kind checked and repaired."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks._delta_faults import reader_race
from lightning_accel.checkpoint import read_checkpoint
from lightning_accel.checkpoint.cli import main as ckpt_main
from lightning_accel.checkpoint.store import (
    BLOB_DIR,
    COPY_SUFFIX,
    PENDING_NAME,
    CheckpointCorruptError,
    DeltaStore,
)


def _state(step: int, n: int = 2048) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "state_dict": {"w": torch.randn(n, generator=g), "marker": torch.full((512,), float(step))},
        "global_step": step,
    }


def _blob(d: Path, key: str, suffix: str = "") -> Path:
    return d / BLOB_DIR / key[:2] / (key + suffix)


def _flip(p: Path, at: int = -5) -> None:
    data = bytearray(p.read_bytes())
    data[at] ^= 0xFF
    p.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------------ readers
@pytest.mark.timeout(120)
def test_readers_racing_the_writer_never_see_a_false_error_local(tmp_path: Path) -> None:
    got = reader_race(str(tmp_path / "ck"), reads=400, max_s=40)
    assert got["reads"] >= 100 and got["saves"] >= 3, got
    assert got["false_errors"] == got["mixed"] == got["other_errors"] == 0, got


@pytest.mark.timeout(180)
def test_readers_racing_the_writer_never_see_a_false_error_s3(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = s3_bucket
    got = reader_race(f"s3://{bucket}/ck", storage_options=opts, reads=120, max_s=60, readers=2)
    assert got["reads"] >= 30 and got["saves"] >= 2, got
    assert got["false_errors"] == got["mixed"] == got["other_errors"] == 0, got


def test_a_reader_that_finds_a_blob_gone_rereads_the_replaced_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer (no grace period) replaces last.ckpt between the reader's manifest read and its blob reads: the
    reader finds a blob missing, re-reads the manifest and restores the new version, consistently."""
    writer = DeltaStore(gc_grace_s=0)
    last = tmp_path / "last.ckpt"
    writer.save(_state(1), last)
    reader = DeltaStore()
    real_read = reader.fs.read
    raced = {"done": False}

    def read(url: Any, *args: Any, **kwargs: Any) -> bytes:
        data = real_read(url, *args, **kwargs)
        if str(url) == str(last) and not raced["done"]:
            raced["done"] = True
            writer.save(_state(2), last)  # replaced and collected at once: the version just read is gone
        return data

    monkeypatch.setattr(reader.fs, "read", read)
    got = reader.load(last)
    assert raced["done"] and got["global_step"] == 2 and float(got["state_dict"]["marker"][0]) == 2.0
    writer.close()


def test_a_blob_missing_for_real_or_damaged_names_the_file_and_the_cause(tmp_path: Path) -> None:
    store = DeltaStore()
    store.save(_state(1), tmp_path / "a.ckpt")
    store.close()
    key = json.loads((tmp_path / "a.ckpt").read_bytes())["tensors"]["state_dict/w"]["chain"][0]
    _flip(_blob(tmp_path, key))
    rel = f"{BLOB_DIR}/{key[:2]}/{key}"
    want = rf"blob {key} of tensor `state_dict/w` fails its checksum \(damaged bytes\)"
    with pytest.raises(CheckpointCorruptError, match=want):
        DeltaStore().load(tmp_path / "a.ckpt")
    _blob(tmp_path, key).unlink()
    with pytest.raises(CheckpointCorruptError) as e:
        DeltaStore().load(tmp_path / "a.ckpt")
    msg = str(e.value)
    assert "is missing" in msg and "still lists it" in msg and rel in msg
    assert "outside this plugin" not in msg


def test_unreferenced_blobs_wait_for_the_grace_period_in_the_pending_record(tmp_path: Path) -> None:
    store = DeltaStore(gc_grace_s=0.6)
    store.save(_state(1), tmp_path / "a.ckpt")
    store.save(_state(2), tmp_path / "b.ckpt")
    old = store.open_manifest(tmp_path / "a.ckpt").keys()
    store.remove(tmp_path / "a.ckpt")
    # Still there, recorded as pending: a reader that opened a.ckpt just before finds every blob.
    pending = store.pending_deletions(tmp_path)
    assert set(pending) == old - store.live_keys(str(tmp_path)) and pending
    assert all(_blob(tmp_path, k).exists() for k in pending)
    assert (tmp_path / BLOB_DIR / PENDING_NAME).exists()
    # A fresh writer (the next run) keeps the times of the record: nothing goes before the grace period ends...
    store.close()
    nxt = DeltaStore(gc_grace_s=0.6)
    assert nxt.collect_garbage(tmp_path) == 0
    time.sleep(0.7)
    assert nxt.collect_garbage(tmp_path) == len(pending)  # ... then everything does
    assert not any(_blob(tmp_path, k).exists() for k in pending)
    assert nxt.pending_deletions(tmp_path) == {} and not (tmp_path / BLOB_DIR / PENDING_NAME).exists()
    # A blob referenced again leaves the record.
    nxt.save(_state(3), tmp_path / "c.ckpt")
    nxt.remove(tmp_path / "c.ckpt")
    assert nxt.pending_deletions(tmp_path)
    nxt.forget()
    nxt.save(_state(3), tmp_path / "c.ckpt")  # the same bytes: the same blobs, referenced again
    nxt.collect_garbage(tmp_path)
    assert not set(nxt.pending_deletions(tmp_path)) & nxt.open_manifest(tmp_path / "c.ckpt").keys()
    assert torch.equal(nxt.load(tmp_path / "c.ckpt")["state_dict"]["w"], _state(3)["state_dict"]["w"])
    nxt.close()
    with pytest.raises(ValueError, match="`gc_grace_s` must be"):
        DeltaStore(gc_grace_s=-1)


# ------------------------------------------------------------------------------------------------ manifests
def test_a_manifest_with_another_checkpoints_skeleton_key_is_refused(tmp_path: Path) -> None:
    store = DeltaStore()
    store.save(_state(10), tmp_path / "step10.ckpt")
    store.save(_state(12), tmp_path / "step12.ckpt")
    store.close()
    m10 = json.loads((tmp_path / "step10.ckpt").read_bytes())
    m12 = json.loads((tmp_path / "step12.ckpt").read_bytes())
    assert m10["checksum"] and m10["skeleton"] != m12["skeleton"]
    swapped = dict(m12, skeleton=m10["skeleton"])  # step 12's tensors with step 10's counters
    (tmp_path / "swapped.ckpt").write_text(json.dumps(swapped, separators=(",", ":")))
    with pytest.raises(CheckpointCorruptError, match="swapped.ckpt.*checksum does not match"):
        DeltaStore().load(tmp_path / "swapped.ckpt")
    assert ckpt_main(["verify", str(tmp_path / "swapped.ckpt")]) == 1
    # A manifest from before the checksum existed still loads (its entries are checked by their own mcrc).
    legacy = {k: v for k, v in m12.items() if k != "checksum"}
    (tmp_path / "legacy.ckpt").write_text(json.dumps(legacy, separators=(",", ":")))
    assert DeltaStore().load(tmp_path / "legacy.ckpt")["global_step"] == 12
    # Any changed byte of a checksummed manifest is caught, the time included.
    (tmp_path / "later.ckpt").write_text(json.dumps(dict(m12, created=m12["created"] + 1), separators=(",", ":")))
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        DeltaStore().load(tmp_path / "later.ckpt")


def test_a_manifest_cut_to_any_length_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    store = DeltaStore()
    store.save(_state(1), tmp_path / "a.ckpt")
    store.close()
    data = (tmp_path / "a.ckpt").read_bytes()
    for n in [*range(0, 60), len(data) // 2, len(data) - 1]:
        cut = tmp_path / f"cut{n}.ckpt"
        cut.write_bytes(data[:n])
        with pytest.raises(CheckpointCorruptError, match=f"cut{n}.ckpt"):
            DeltaStore().load(cut)
        with pytest.raises(CheckpointCorruptError):
            read_checkpoint(cut)
    assert "truncated" in _error(lambda: DeltaStore().load(tmp_path / "cut12.ckpt"))
    # The next save of that path replaces the cut manifest (a foreign file would be refused).
    store.save(_state(2), tmp_path / "cut0.ckpt")
    store.save(_state(2), tmp_path / "cut12.ckpt")
    store.close()
    assert DeltaStore().load(tmp_path / "cut12.ckpt")["global_step"] == 2


def _error(fn: Any) -> str:
    try:
        fn()
    except CheckpointCorruptError as e:
        return str(e)
    raise AssertionError("no CheckpointCorruptError")


# ------------------------------------------------------------------------------------------------ copies
def _two_saves(d: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    s0 = _state(0, 8192)
    s1 = {**s0, "state_dict": {**s0["state_dict"], "w": s0["state_dict"]["w"] + 1e-4}, "global_step": 1}
    store = DeltaStore(redundancy=2)
    store.save(s0, d / "a.ckpt")
    store.save(s1, d / "b.ckpt")
    store.close()
    return s0, s1


def test_redundancy_copies_every_blob_kind_and_loads_survive_each_loss(tmp_path: Path) -> None:
    _, s1 = _two_saves(tmp_path)
    m = DeltaStore().open_manifest(tmp_path / "b.ckpt")
    chain = m.tensors["state_dict/w"].chain
    assert len(chain) == 2 and m.copies == 2  # a base and a delta
    assert all(_blob(tmp_path, k, COPY_SUFFIX).read_bytes() == _blob(tmp_path, k).read_bytes() for k in m.keys())  # noqa: SIM118 - a method
    for lost in (chain[1], m.skeleton, chain[0]):  # the delta, the skeleton, the base: each restored from its copy
        _blob(tmp_path, lost).unlink()
        with pytest.warns(UserWarning, match="restored from its second copy"):
            got = DeltaStore().load(tmp_path / "b.ckpt")
        assert torch.equal(got["state_dict"]["w"], s1["state_dict"]["w"]) and got["global_step"] == 1
        assert ckpt_main(["verify", "--repair", str(tmp_path / "b.ckpt")]) == 0
        assert _blob(tmp_path, lost).exists()
    _flip(_blob(tmp_path, chain[1]))  # damaged in place rather than lost
    with pytest.warns(UserWarning, match="restored from its second copy"):
        assert torch.equal(DeltaStore().load(tmp_path / "b.ckpt")["state_dict"]["w"], s1["state_dict"]["w"])


@pytest.mark.parametrize("which", ["base", "delta", "skeleton"])
def test_verify_checks_every_copy_and_repair_recreates_either_twin(
    tmp_path: Path, which: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_saves(tmp_path)
    m = DeltaStore().open_manifest(tmp_path / "b.ckpt")
    chain = m.tensors["state_dict/w"].chain
    key = {"base": chain[0], "delta": chain[1], "skeleton": m.skeleton}[which]
    ckpt = str(tmp_path / "b.ckpt")
    copy = _blob(tmp_path, key, COPY_SUFFIX)
    good = copy.read_bytes()
    # A flipped byte in the copy: the checkpoint loads, but verify reports the lost redundancy.
    _flip(copy)
    with pytest.raises(CheckpointCorruptError, match=rf"second copy of blob {key}.*{COPY_SUFFIX} fails its checksum"):
        DeltaStore().verify(ckpt)
    assert ckpt_main(["verify", ckpt]) == 1
    line = json.loads(capsys.readouterr().out)
    assert line["ok"] is False and "--repair" in line["error"]
    assert ckpt_main(["verify", "--repair", ckpt]) == 0
    assert json.loads(capsys.readouterr().out)["repaired"] == [key + COPY_SUFFIX]
    assert copy.read_bytes() == good and DeltaStore().verify(ckpt)["ok"]
    # A lost copy likewise.
    copy.unlink()
    with pytest.raises(CheckpointCorruptError, match="is missing"):
        DeltaStore().verify(ckpt)
    assert DeltaStore().verify(ckpt, repair=True)["repaired"] == [key + COPY_SUFFIX]
    # A flipped byte in the blob itself: restored from the copy, reported, repaired from the copy.
    _flip(_blob(tmp_path, key))
    with pytest.raises(CheckpointCorruptError, match=rf"blob {key} is damaged"):
        DeltaStore().verify(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert DeltaStore().verify(ckpt, repair=True)["repaired"] == [key]
    assert _blob(tmp_path, key).read_bytes() == good
    summary = DeltaStore().verify(ckpt)
    assert summary["ok"] and summary["copies_checked"] == len(m.keys()) and summary["manifest_checksum"]
