"""A killed run's untracked checkpoints: removed when the next run resumes (``DeltaModelCheckpoint``), kept with
``keep_orphans=True``, removed by hand with ``ckpt gc``; never a file this plugin did not write."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint, resolve_ckpt_path
from lightning_accel.checkpoint.cli import main as ckpt_main
from lightning_accel.checkpoint.store import BLOB_DIR, DeltaStore
from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader


def _callback(dirpath: Any, filename: str = "{step}", **kw: Any) -> DeltaModelCheckpoint:
    return DeltaModelCheckpoint(
        dirpath=dirpath,
        filename=filename,
        every_n_train_steps=1,
        save_top_k=2,
        save_last=True,
        monitor="step",
        mode="max",
        **kw,
    )


def _fit(tmp_path: Path, ckpt: Path, max_steps: int, resume: bool, **kw: Any) -> DeltaModelCheckpoint:
    cb = _callback(ckpt, **kw)
    io = DeltaCheckpointIO()
    io.store.gc_grace_s = 0.0  # no concurrent readers here: collect at once, so the blob sets can be compared
    trainer = ckpt_trainer(tmp_path, [io], [cb], max_steps=max_steps, max_epochs=None, limit_val_batches=0)
    trainer.fit(CheckpointModel(), tiny_loader(), ckpt_path="last" if resume else None)
    return cb


def _plant(ckpt: Path) -> dict[str, Path]:
    """What a killed run leaves (an older and a newer untracked manifest) and files the plugin did not write."""
    store = DeltaStore(gc_grace_s=0.0)
    older = ckpt / "step=1.ckpt"  # removed by ModelCheckpoint long ago: a removal the killed run never made
    shutil.copy(ckpt / "step=5.ckpt", older)
    manifest = json.loads(older.read_bytes())
    assert manifest["created"] < json.loads((ckpt / "last.ckpt").read_bytes())["created"]
    newer = ckpt / "step=9.ckpt"  # saved after the last last.ckpt, then killed
    store.save({"state_dict": {"w": torch.randn(4096)}, "global_step": 9}, newer)
    versioned = ckpt / "step=9-v1.ckpt"
    store.save({"state_dict": {"w": torch.randn(4096)}, "global_step": 9}, versioned)
    manual = ckpt / "manual.ckpt"  # a manifest, but not a name this callback makes
    store.save({"state_dict": {"w": torch.randn(64)}}, manual)
    store.close()
    notes = ckpt / "notes.txt"
    notes.write_text("mine")
    plain = ckpt / "step=3.ckpt"  # a torch.save file named like a step checkpoint: not the plugin's
    torch.save({"w": torch.ones(3)}, plain)
    blob_like = ckpt / "step=5.ckpt.bak"  # a user's backup copy of a manifest: not a checkpoint name
    shutil.copy(ckpt / "step=5.ckpt", blob_like)
    return {
        "older": older,
        "newer": newer,
        "versioned": versioned,
        "manual": manual,
        "notes": notes,
        "plain": plain,
        "bak": blob_like,
    }


#: Files of the planted set that the plugin did not write: they must come out byte-identical.
USER_FILES = ("notes", "plain", "bak")


def _user_bytes(planted: dict[str, Path]) -> dict[str, bytes]:
    return {what: planted[what].read_bytes() for what in USER_FILES}


def _blobs(ckpt: Path) -> set[str]:
    return {p.name.removesuffix(".copy") for p in (ckpt / BLOB_DIR).rglob("*") if p.is_file() and len(p.name) >= 40}


def test_a_resumed_run_removes_what_a_killed_run_left_and_nothing_else(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _fit(tmp_path, ckpt, 6, resume=False)
    assert sorted(p.name for p in ckpt.glob("*.ckpt")) == ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]
    planted = _plant(ckpt)
    user = _user_bytes(planted)
    with pytest.warns(UserWarning, match=r"Removing 3 checkpoints .* \(resumed from last.ckpt\).*keep_orphans=True"):
        cb = _fit(tmp_path, ckpt, 8, resume=True)
    assert sorted(Path(p).name for p in cb.orphans) == ["step=1.ckpt", "step=9-v1.ckpt", "step=9.ckpt"]
    for what in ("older", "newer", "versioned"):
        assert not planted[what].exists(), what
    for what in ("manual", "notes", "plain", "bak"):
        assert planted[what].exists(), what  # never a file the callback did not make
    assert _user_bytes(planted) == user  # byte-identical
    assert sorted(p.name for p in ckpt.glob("step=*.ckpt")) == ["step=3.ckpt", "step=7.ckpt", "step=8.ckpt"]
    store = DeltaStore(gc_grace_s=0.0)
    for name in ("last.ckpt", "step=7.ckpt", "step=8.ckpt", "manual.ckpt"):
        assert store.verify(ckpt / name)["ok"]
    store.collect_garbage(ckpt)
    store.close()
    assert _blobs(ckpt) == store.live_keys(str(ckpt))  # the removed checkpoints' blobs went with them


def test_keep_orphans_keeps_them_with_a_warning_and_a_fresh_run_touches_nothing(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _fit(tmp_path, ckpt, 6, resume=False)
    planted = _plant(ckpt)
    user = _user_bytes(planted)
    with pytest.warns(UserWarning, match=r"3 checkpoints .* not tracked by ModelCheckpoint.*ckpt gc"):
        cb = _fit(tmp_path, ckpt, 7, resume=True, keep_orphans=True)
    assert len(cb.orphans) == 3 and all(p.exists() for p in planted.values())
    # A run that does not resume restores no tracking state: it removes nothing.
    cb = _fit(tmp_path, tmp_path / "ckpt", 2, resume=False)
    assert cb.orphans == [] and all(p.exists() for p in planted.values())
    assert _user_bytes(planted) == user
    with pytest.raises(TypeError, match="`keep_orphans` must be"):
        DeltaModelCheckpoint(dirpath=ckpt, keep_orphans="yes")  # type: ignore[arg-type]


def test_ckpt_gc_lists_then_removes_untracked_manifests_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    _fit(tmp_path, ckpt, 6, resume=False)
    planted = _plant(ckpt)
    user = _user_bytes(planted)
    from lightning_accel.cli import main as lightning_accel_main

    with pytest.raises(SystemExit) as done_by_cli:  # `lightning-accel ckpt gc`: the same command
        lightning_accel_main(["ckpt", "gc", str(ckpt), "--dry-run"])
    assert done_by_cli.value.code == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["dry_run"] and listed["removed"] == []
    assert sorted(listed["untracked"]) == ["manual.ckpt", "step=1.ckpt", "step=9-v1.ckpt", "step=9.ckpt"]
    assert sorted(listed["tracked"]) == ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]
    assert all(p.exists() for p in planted.values())
    # Refused while a run writes the directory.
    writer = DeltaStore()
    writer.claim(str(ckpt))
    assert ckpt_main(["gc", str(ckpt), "--grace-s", "0"]) == 1
    assert "is being written" in capsys.readouterr().err
    writer.close()
    assert ckpt_main(["gc", str(ckpt), "--grace-s", "0"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert sorted(done["removed"]) == sorted(listed["untracked"]) and done["blobs_deleted"] > 0
    assert done["pending"] == 0
    for what in ("notes", "plain", "bak"):
        assert planted[what].exists(), what
    assert _user_bytes(planted) == user
    store = DeltaStore()
    assert _blobs(ckpt) == store.live_keys(str(ckpt))
    for name in ("last.ckpt", "step=5.ckpt", "step=6.ckpt"):
        assert store.verify(ckpt / name)["ok"]
    # Without a last checkpoint nothing says what is tracked: no checkpoint is removed.
    (ckpt / "last.ckpt").unlink()
    assert ckpt_main(["gc", str(ckpt)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["removed"] == [] and "no last" in out["note"]


@pytest.mark.timeout(300)
def test_a_resumed_run_on_s3_removes_a_killed_runs_checkpoint_and_so_does_gc(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    bucket, opts = s3_bucket
    dirpath = f"s3://{bucket}/run/ckpt"

    def fit(max_steps: int) -> tuple[DeltaModelCheckpoint, Any]:
        cb = _callback(dirpath)
        io = DeltaCheckpointIO(storage_options=opts)
        io.store.gc_grace_s = 0.0
        trainer = ckpt_trainer(tmp_path, [io], [cb], max_steps=max_steps, max_epochs=None, limit_val_batches=0)
        trainer.fit(CheckpointModel(), tiny_loader(), ckpt_path=resolve_ckpt_path(trainer, "last"))
        return cb, io

    fit(4)
    store = DeltaStore(storage_options=opts)
    store.save({"state_dict": {"w": torch.randn(4096)}, "global_step": 9}, f"{dirpath}/step=9.ckpt")
    store.fs.write(f"{dirpath}/notes.txt", b"mine")
    store.close()
    with pytest.warns(UserWarning, match="Removing 1 checkpoint in"):
        cb, _ = fit(6)
    names = sorted(store.fs.list_files(dirpath))
    assert names == ["last.ckpt", "notes.txt", "step=5.ckpt", "step=6.ckpt"], names
    assert cb.orphans == [f"{dirpath}/step=9.ckpt"]
    # By hand, on the bucket too.
    store.save({"state_dict": {"w": torch.randn(4096)}, "global_step": 9}, f"{dirpath}/step=9.ckpt")
    store.close()
    assert ckpt_main(["gc", dirpath, "--grace-s", "0", "--storage-options", json.dumps(opts)]) == 0
    assert sorted(store.fs.list_files(dirpath)) == names
    assert store.pending_deletions(dirpath) == {}


def test_keep_every_checkpoint_without_a_monitor_survives_a_resume_and_gc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `save_top_k=-1` with no `monitor`: Lightning's state lists only the newest checkpoint, yet every one is kept.
    ckpt = tmp_path / "ckpt"

    def fit(max_steps: int, resume: bool) -> DeltaModelCheckpoint:
        cb = DeltaModelCheckpoint(dirpath=ckpt, filename="{step}", every_n_train_steps=1, save_top_k=-1, save_last=True)
        io = DeltaCheckpointIO()
        trainer = ckpt_trainer(tmp_path, [io], [cb], max_steps=max_steps, max_epochs=None, limit_val_batches=0)
        trainer.fit(CheckpointModel(), tiny_loader(), ckpt_path="last" if resume else None)
        return cb

    fit(3, resume=False)
    kept = ["step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]
    assert sorted(p.name for p in ckpt.glob("step=*.ckpt")) == kept
    assert ckpt_main(["gc", str(ckpt), "--dry-run"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["untracked"] == [] and "save_top_k=-1" in listed["note"]
    newer = ckpt / "step=9.ckpt"  # a killed run's save after its last last.ckpt: the resumed run saves it again
    store = DeltaStore()
    store.save({"state_dict": {"w": torch.randn(64)}, "global_step": 9}, newer)
    store.close()
    cb = fit(5, resume=True)
    assert [Path(p).name for p in cb.orphans] == ["step=9.ckpt"]
    assert sorted(p.name for p in ckpt.glob("step=*.ckpt")) == [*kept, "step=4.ckpt", "step=5.ckpt"]
    # Lightning's own ModelCheckpoint without a monitor records no `save_top_k`: `ckpt gc` cannot tell what it
    # keeps, so it removes nothing.
    plain_dir = tmp_path / "plain"
    cb2 = ModelCheckpoint(dirpath=plain_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1, save_last=True)
    trainer = ckpt_trainer(tmp_path, [DeltaCheckpointIO()], [cb2], max_steps=2, max_epochs=None, limit_val_batches=0)
    trainer.fit(CheckpointModel(), tiny_loader())
    assert ckpt_main(["gc", str(plain_dir)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["removed"] == [] and "no monitor" in out["note"]
    assert sorted(p.name for p in plain_dir.glob("step=*.ckpt")) == ["step=1.ckpt", "step=2.ckpt"]


def test_a_later_callbacks_save_of_the_last_step_survives_gc_and_a_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Callbacks save in order: the first writes `last.ckpt` (taking every callback's state), then the second saves
    # its newest best of the same step, which that state cannot list. It is a finished run's checkpoint to keep.
    ckpt = tmp_path / "ckpt"

    def fit(max_steps: int, resume: bool) -> tuple[DeltaModelCheckpoint, DeltaModelCheckpoint]:
        first = _callback(ckpt)
        best = DeltaModelCheckpoint(
            dirpath=ckpt, filename="best-{step}", every_n_train_steps=2, save_top_k=1, monitor="step", mode="max"
        )
        io = DeltaCheckpointIO()
        io.store.gc_grace_s = 0.0
        trainer = ckpt_trainer(tmp_path, [io], [first, best], max_steps=max_steps, max_epochs=None, limit_val_batches=0)
        trainer.fit(CheckpointModel(), tiny_loader(), ckpt_path="last" if resume else None)
        return first, best

    _, best = fit(4, resume=False)
    assert Path(best.best_model_path).name == "best-step=4.ckpt"
    names = sorted(p.name for p in ckpt.glob("*.ckpt"))
    assert names == ["best-step=4.ckpt", "last.ckpt", "step=3.ckpt", "step=4.ckpt"]
    assert ckpt_main(["gc", str(ckpt), "--grace-s", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["untracked"] == [] and out["removed"] == []
    assert sorted(p.name for p in ckpt.glob("*.ckpt")) == names
    # A killed run's save of a later step is still a leftover.
    store = DeltaStore(gc_grace_s=0.0)
    store.save({"state_dict": {"w": torch.randn(64)}, "global_step": 5}, ckpt / "best-step=5.ckpt")
    store.close()
    assert ckpt_main(["gc", str(ckpt), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["untracked"] == ["best-step=5.ckpt"]
    first, best = fit(5, resume=True)
    assert [Path(p).name for p in best.orphans] == ["best-step=5.ckpt"] and first.orphans == []
    assert (ckpt / "best-step=4.ckpt").exists()
    assert DeltaStore().verify(ckpt / "best-step=4.ckpt")["ok"]


def test_a_resume_keeps_a_users_copy_of_a_manifest_whose_name_only_starts_like_a_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _fit(tmp_path, ckpt, 6, resume=False)
    copies = [ckpt / "step=5-keep.ckpt", ckpt / "step=5.best.ckpt"]  # kept out of the rotation by hand
    for copy in copies:
        shutil.copy(ckpt / "step=5.ckpt", copy)
    older = ckpt / "step=1-v1.ckpt"  # a name the callback makes: a removal a killed run never made
    shutil.copy(ckpt / "step=5.ckpt", older)
    with pytest.warns(UserWarning, match=r"Removing 1 checkpoint in"):
        cb = _fit(tmp_path, ckpt, 8, resume=True)
    assert [Path(p).name for p in cb.orphans] == ["step=1-v1.ckpt"] and not older.exists()
    for copy in copies:
        assert copy.exists(), copy.name
        assert DeltaStore().verify(copy)["ok"]


def _fit_into_subdirectories(tmp_path: Path, ckpt: Path, max_steps: int, resume: bool) -> DeltaModelCheckpoint:
    """A fit whose ``filename`` holds a ``/``: each checkpoint goes to a subdirectory of its own (``step=5/w.ckpt``),
    as ``{epoch}-{val/loss:.2f}`` does."""
    cb = _callback(ckpt, filename="{step}/w")
    io = DeltaCheckpointIO()
    io.store.gc_grace_s = 0.0
    trainer = ckpt_trainer(tmp_path, [io], [cb], max_steps=max_steps, max_epochs=None, limit_val_batches=0)
    trainer.fit(CheckpointModel(), tiny_loader(), ckpt_path="last" if resume else None)
    return cb


def _plant_in_subdirectories(ckpt: Path) -> dict[str, Path]:
    """A killed run's checkpoints in subdirectories (with their blob stores), beside files the plugin did not write."""
    shutil.copytree(ckpt / "step=5", ckpt / "step=0")  # removed long ago: a removal the killed run never made
    shutil.copytree(ckpt / "step=5", ckpt / "step=9")
    (ckpt / "step=9" / "notes.txt").write_text("mine")  # a user's file beside a leftover checkpoint
    (ckpt / "mine").mkdir()  # a user's folder, no blob store: a manifest copied there is the user's
    shutil.copy(ckpt / "step=5" / "w.ckpt", ckpt / "mine" / "w.ckpt")
    return {
        "older": ckpt / "step=0" / "w.ckpt",
        "newer": ckpt / "step=9" / "w.ckpt",
        "notes": ckpt / "step=9" / "notes.txt",
        "copy": ckpt / "mine" / "w.ckpt",
    }


def test_gc_removes_a_killed_runs_checkpoints_in_subdirectories_and_the_folders_it_empties(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `ckpt gc` looked at the files directly in DIR only: a `filename` with a `/` left its untracked checkpoints for
    # good, and a subdirectory a killed run left with only its blob store kept it
    ckpt = tmp_path / "ckpt"
    _fit_into_subdirectories(tmp_path, ckpt, 6, resume=False)
    # the fit itself removed the subdirectories `save_top_k` emptied (their blob store was all that was left)
    assert sorted(p.name for p in ckpt.iterdir()) == [BLOB_DIR, "last.ckpt", "step=5", "step=6"]
    planted = _plant_in_subdirectories(ckpt)
    copy = planted["copy"].read_bytes()
    # refused while a live run writes one of the subdirectories: nothing removed, nothing emptied
    writer = DeltaStore()
    writer.claim(str(ckpt / "step=9"))
    assert ckpt_main(["gc", str(ckpt), "--grace-s", "0"]) == 1
    assert "step=9" in capsys.readouterr().err
    assert all(p.exists() for p in planted.values()) and (ckpt / "step=0" / BLOB_DIR).exists()
    writer.close()
    assert ckpt_main(["gc", str(ckpt), "--grace-s", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["untracked"] == out["removed"] == ["step=0/w.ckpt", "step=9/w.ckpt"]
    assert sorted(out["tracked"]) == ["last.ckpt", "step=5/w.ckpt", "step=6/w.ckpt"]
    assert out["emptied"] == ["step=0"] and out["pending"] == 0
    assert sorted(p.name for p in ckpt.iterdir()) == [BLOB_DIR, "last.ckpt", "mine", "step=5", "step=6", "step=9"]
    # a folder that still holds a user's file is kept, and so is a manifest in a folder without a blob store
    assert planted["notes"].read_text() == "mine" and not planted["newer"].exists()
    assert planted["copy"].read_bytes() == copy
    store = DeltaStore()
    for name in ("last.ckpt", "step=5/w.ckpt", "step=6/w.ckpt"):
        assert store.verify(ckpt / name)["ok"]


def test_a_resumed_run_removes_a_killed_runs_checkpoints_in_subdirectories(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _fit_into_subdirectories(tmp_path, ckpt, 6, resume=False)
    planted = _plant_in_subdirectories(ckpt)
    copy = planted["copy"].read_bytes()
    with pytest.warns(UserWarning, match=r"Removing 2 checkpoints .*: step=0/w.ckpt, step=9/w.ckpt\."):
        cb = _fit_into_subdirectories(tmp_path, ckpt, 8, resume=True)
    assert sorted(Path(p).relative_to(ckpt).as_posix() for p in cb.orphans) == ["step=0/w.ckpt", "step=9/w.ckpt"]
    assert not planted["older"].exists() and not planted["newer"].exists()
    assert planted["notes"].read_text() == "mine" and planted["copy"].read_bytes() == copy
    assert sorted(p.relative_to(ckpt).as_posix() for p in ckpt.glob("*/w.ckpt")) == [
        "mine/w.ckpt",
        "step=7/w.ckpt",
        "step=8/w.ckpt",
    ]
