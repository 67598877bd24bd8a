"""Garbage collection past a blob that cannot be deleted (a permission, an object store refusing the delete): the
other blobs still go, the blob is retried by every later collection, and the problem is warned once, not at every
save."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaStore, read_checkpoint
from lightning_accel.checkpoint.store import BLOB_DIR


def _state(step: int) -> dict[str, Any]:
    # every tensor changes at every step (a new full snapshot each save): each removal leaves blobs to collect
    return {"state_dict": {"w": torch.full((4096,), float(step)), "b": torch.arange(2048.0) * step}, "step": step}


def _blob_files(d: Path) -> set[str]:
    return {p.name for p in (d / BLOB_DIR).rglob("*") if p.is_file() and len(p.name) == 40}


def _refusing(store: DeltaStore, error: Callable[[str], Exception]) -> list[str]:
    """Make ``store`` unable to delete the first blob it tries to delete (the others go as usual); returns a list
    holding that blob's key once it was tried."""
    stuck: list[str] = []
    real = store.fs.rm

    def rm(url: str | os.PathLike[str]) -> None:
        u = os.fspath(url)
        name = os.path.basename(u)
        if f"{os.sep}{BLOB_DIR}{os.sep}" in u and len(name) == 40 and not stuck:
            stuck.append(name)
        if stuck and name == stuck[0]:
            raise error(u)
        real(url)

    store.fs.rm = rm  # type: ignore[method-assign]
    return stuck


def _rotate(store: DeltaStore, d: Path, steps: range) -> None:
    """``save_top_k=1``: save each step, then remove the one before."""
    for step in steps:
        store.save(_state(step), d / f"step={step}.ckpt")
        if step > steps.start:
            store.remove(d / f"step={step - 1}.ckpt")


def test_an_undeletable_blob_is_warned_once_and_does_not_stop_the_collection(tmp_path: Path) -> None:
    store = DeltaStore(gc_grace_s=0)
    store.save(_state(0), tmp_path / "step=0.ckpt")
    stuck = _refusing(store, lambda u: PermissionError(13, "Permission denied", u))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _rotate(store, tmp_path, range(1, 7))  # 6 saves, 5 removals: each collection meets the blob again
    lines = [str(w.message) for w in rec]
    assert len(stuck) == 1
    assert len(lines) == 1, lines  # once, not at every save and removal
    assert stuck[0] in lines[0] and "PermissionError" in lines[0] and str(tmp_path) in lines[0]
    assert "\n" not in lines[0]
    # every other unreferenced blob went: only the live checkpoint's blobs and the undeletable one are left
    assert _blob_files(tmp_path) == store.live_keys(str(tmp_path)) | {stuck[0]}
    # it stays on the pending-deletions record, so a later collection (of this run or the next) retries it
    assert stuck[0] in store.pending_deletions(tmp_path)
    assert torch.equal(read_checkpoint(tmp_path / "step=6.ckpt")["state_dict"]["w"], torch.full((4096,), 6.0))


def test_the_blob_goes_quietly_once_deletable_and_a_new_failure_is_warned_again(tmp_path: Path) -> None:
    store = DeltaStore(gc_grace_s=0)
    store.save(_state(0), tmp_path / "step=0.ckpt")
    real = store.fs.rm
    stuck = _refusing(store, lambda u: PermissionError(13, "Permission denied", u))
    with pytest.warns(UserWarning, match="Permission denied"):
        _rotate(store, tmp_path, range(1, 3))
    store.fs.rm = real  # type: ignore[method-assign]  # permissions fixed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _rotate(store, tmp_path, range(3, 5))
    assert stuck[0] not in _blob_files(tmp_path)
    assert _blob_files(tmp_path) == store.live_keys(str(tmp_path))
    assert stuck[0] not in store.pending_deletions(tmp_path)
    # the problem was solved: when it comes back, it is news again
    _refusing(store, lambda u: PermissionError(13, "Permission denied", u))
    with pytest.warns(UserWarning, match="Permission denied"):
        _rotate(store, tmp_path, range(5, 7))


def test_an_unreachable_store_still_stops_the_collection_at_once(tmp_path: Path) -> None:
    """A store that cannot be reached at all (its retries spent) is not tried again for each of the other blobs."""
    from lightning_accel._utils.fs import StorageUnavailableError

    store = DeltaStore(gc_grace_s=0)
    store.save(_state(0), tmp_path / "a.ckpt")
    store.save(_state(1), tmp_path / "b.ckpt")
    tried: list[str] = []
    real = store.fs.rm

    def rm(url: str | os.PathLike[str]) -> None:
        u = os.fspath(url)
        if f"{os.sep}{BLOB_DIR}{os.sep}" not in u:
            return real(url)  # the manifest goes: the store fails right after
        tried.append(u)
        raise StorageUnavailableError("cannot remove: connection refused", url=u, attempts=3)

    store.fs.rm = rm  # type: ignore[method-assign]
    with pytest.warns(UserWarning, match="StorageUnavailableError"):
        store.remove(tmp_path / "a.ckpt")
    assert len(tried) == 1


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_plugin_warns_an_undeletable_blob_once_and_keeps_saving(tmp_path: Path, async_save: bool) -> None:
    io = DeltaCheckpointIO(async_save=async_save, gc_grace_s=0)
    first = tmp_path / "step=0.ckpt"
    io.save_checkpoint(_state(0), first)
    io.wait()
    stuck = _refusing(io.store, lambda u: OSError(30, "Read-only file system", u))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for step in range(1, 6):
            io.save_checkpoint(_state(step), tmp_path / f"step={step}.ckpt")
            io.remove_checkpoint(tmp_path / f"step={step - 1}.ckpt")
        io.wait()
    io.teardown()
    lines = [str(w.message) for w in rec if issubclass(w.category, UserWarning)]
    assert len(lines) == 1 and stuck[0] in lines[0] and "Read-only file system" in lines[0], lines
    assert io.writer_stats.failed == 0
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["step=5.ckpt"]
    assert _blob_files(tmp_path) == DeltaStore().live_keys(str(tmp_path)) | {stuck[0]}


def test_a_damaged_manifest_is_warned_once_while_it_stops_the_collection(tmp_path: Path) -> None:
    """A damaged manifest stops every collection in its directory (what it referenced cannot be told): said once, not
    at every save; once it is removed, the next collection goes ahead and a new damage is warned again."""
    store = DeltaStore(gc_grace_s=0)
    store.save(_state(0), tmp_path / "kept.ckpt")
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes((tmp_path / "kept.ckpt").read_bytes()[:-20] + b"#" * 20)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _rotate(store, tmp_path, range(1, 5))
    lines = [str(w.message) for w in rec]
    assert len(lines) == 1 and "damaged.ckpt" in lines[0] and "\n" not in lines[0], lines
    damaged.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _rotate(store, tmp_path, range(5, 7))
    assert _blob_files(tmp_path) == store.live_keys(str(tmp_path))
    damaged.write_bytes((tmp_path / "kept.ckpt").read_bytes()[:-20] + b"#" * 20)
    with pytest.warns(UserWarning, match="damaged.ckpt"):
        _rotate(store, tmp_path, range(7, 9))


def test_ckpt_gc_counts_the_files_it_could_not_delete_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script running ``ckpt gc`` to get its space back hears that it did not: the summary counts the files under
    ``undeletable`` and the exit code is 1 (the checkpoints themselves are intact)."""
    import json

    from lightning_accel.checkpoint import cli
    from lightning_accel.checkpoint.cli import main as ckpt_main

    store = DeltaStore(gc_grace_s=3600)
    _rotate(store, tmp_path, range(0, 3))  # the removed checkpoints' blobs wait out their grace period
    store.close()  # the run ended: its writer lock is free for `gc`
    (tmp_path / "notes.txt").write_text("mine")
    before = _blob_files(tmp_path)
    made: list[DeltaStore] = []

    class Refusing(DeltaStore):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)
            _refusing(self, lambda u: PermissionError(13, "Permission denied", u))

    monkeypatch.setattr(cli, "DeltaStore", Refusing)
    with pytest.warns(UserWarning, match="Permission denied"):
        assert ckpt_main(["gc", str(tmp_path), "--grace-s", "0"]) == 1
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["undeletable"] == 1 and summary["pending"] == 1
    assert "1 unreferenced file(s)" in err and "\n" not in err.strip()
    assert len(_blob_files(tmp_path)) == len(store.live_keys(str(tmp_path))) + 1 < len(before)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # fixed, the next gc deletes it and says all is well
    monkeypatch.setattr(cli, "DeltaStore", DeltaStore)
    assert ckpt_main(["gc", str(tmp_path), "--grace-s", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["undeletable"] == 0
    assert _blob_files(tmp_path) == store.live_keys(str(tmp_path))
