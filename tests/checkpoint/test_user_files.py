"""A user's own files in a checkpoint directory (notes, a ``.bak`` copy of a checkpoint, a folder named like a
checkpoint, a text file named like one) survive every save, top-k removal, ``ckpt gc`` and resume, byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint, read_checkpoint
from lightning_accel.checkpoint.cli import main as ckpt_main
from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader


def _planted(ckpt: Path) -> dict[str, bytes]:
    """Every file below ``ckpt`` that the user put there, by path, with its bytes."""
    names = ("notes.txt", "epoch=0-step=9.ckpt", "epoch=0-step=3.ckpt/inside.txt", "epoch=0-step=1.ckpt.bak")
    return {n: (ckpt / n).read_bytes() for n in names if (ckpt / n).is_file()}


def _fit(root: Path, async_save: bool, max_steps: int, ckpt_path: str | None = None) -> None:
    io = DeltaCheckpointIO(async_save=async_save, gc_grace_s=0.0)
    cb = DeltaModelCheckpoint(
        dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=1, save_last=True, monitor="step", mode="max"
    )
    t = ckpt_trainer(root, [io], [cb], max_steps=max_steps)
    t.fit(CheckpointModel(hidden=8), tiny_loader(64), ckpt_path=ckpt_path)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_users_files_in_the_checkpoint_directory_survive_saves_removals_gc_and_resume(
    tmp_path: Path, async_save: bool
) -> None:
    ckpt = tmp_path / "ckpt"
    # a folder where the resumed run saves step 3 (it saves `epoch=0-step=3-v1.ckpt` instead), with a file in it
    (ckpt / "epoch=0-step=3.ckpt").mkdir(parents=True)
    (ckpt / "epoch=0-step=3.ckpt" / "inside.txt").write_text("mine")
    (ckpt / "empty=0.ckpt").mkdir()  # and an empty one
    (ckpt / "notes.txt").write_text("lr 1e-2 diverged at step 3\n")
    (ckpt / "epoch=0-step=9.ckpt").write_text("not a checkpoint, but named like one\n")

    _fit(tmp_path, async_save, max_steps=2)
    # a copy of a checkpoint the rotation will remove: the user's, in the same directory as the blobs it names
    shutil.copyfile(ckpt / "epoch=0-step=2.ckpt", ckpt / "epoch=0-step=1.ckpt.bak")
    before = _planted(ckpt)
    assert len(before) == 4

    _fit(tmp_path, async_save, max_steps=4, ckpt_path=str(ckpt / "last.ckpt"))  # resume: rotates step 2 out
    assert not (ckpt / "epoch=0-step=2.ckpt").exists()
    assert _planted(ckpt) == before and (ckpt / "empty=0.ckpt").is_dir()

    assert ckpt_main(["gc", str(ckpt), "--grace-s", "0"]) == 0
    assert _planted(ckpt) == before and (ckpt / "empty=0.ckpt").is_dir()
    # the copy still loads: the blobs it names were not collected while it is in the directory
    assert read_checkpoint(ckpt / "epoch=0-step=1.ckpt.bak")["global_step"] == 2
    assert read_checkpoint(ckpt / "last.ckpt")["global_step"] == 4
