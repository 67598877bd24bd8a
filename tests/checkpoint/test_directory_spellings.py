"""One checkpoint directory, however it is spelt: a relative path, a symlink to it, the path Lightning's
``ModelCheckpoint`` resolved with ``realpath``. The store keys its writer lock by directory, so each spelling once took
the directory's ``flock`` again and the process refused its own saves as "another writer". And what Lightning does to
the directory right after an async ``save_checkpoint`` returns (``save_last="link"``) finds the directory there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaStore
from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader


def test_claim_of_a_relative_directory_then_a_save_into_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    io = DeltaCheckpointIO()
    io.claim("ckpts")  # what a user (or a callback) holding a relative `dirpath` calls before training
    try:
        io.save_checkpoint({"w": torch.ones(500)}, "ckpts/a.ckpt")  # was: "being written by another ... process"
        assert torch.equal(io.load_checkpoint("ckpts/a.ckpt")["w"], torch.ones(500))
    finally:
        io.teardown()


def test_a_directory_and_a_symlink_to_it_are_one_writer(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    io = DeltaCheckpointIO(gc_grace_s=0)
    try:
        # ModelCheckpoint saves under realpath(dirpath); the user's own save names the link
        io.save_checkpoint({"w": torch.ones(500)}, real / "step=1.ckpt")
        io.save_checkpoint({"w": torch.full((500,), 2.0)}, tmp_path / "link" / "final.ckpt")
        io.remove_checkpoint(tmp_path / "link" / "step=1.ckpt")
    finally:
        io.teardown()
    assert sorted(p.name for p in real.glob("*.ckpt")) == ["final.ckpt"]
    assert torch.equal(DeltaStore().load(real / "final.ckpt")["w"], torch.full((500,), 2.0))
    assert DeltaStore().verify(tmp_path / "link" / "final.ckpt")["ok"]


def test_async_save_last_link_into_a_fresh_directory(tmp_path: Path) -> None:
    # The first save of a fresh `dirpath` is still queued when Lightning links `last.ckpt` to it: `os.symlink` into the
    # directory that did not exist yet failed, and so did its fallback (`shutil.copy` of the unwritten target).
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=1, save_last="link", monitor="step", mode="max"
    )
    io = DeltaCheckpointIO(async_save=True)
    model = CheckpointModel()
    ckpt_trainer(tmp_path, [io], [ckpt], max_epochs=1).fit(model, tiny_loader())  # 8 steps: saves at 4 and 8
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_symlink()
    restored = DeltaStore().load(last)["state_dict"]
    target = DeltaStore().load(os.path.realpath(last))["state_dict"]
    assert restored.keys() == target.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(restored[k], v), k


def test_an_async_save_makes_no_directory_where_a_queued_save_puts_its_file(tmp_path: Path) -> None:
    # The directory is made on the training thread (above), but never over a file still queued: that save comes first.
    io = DeltaCheckpointIO(async_save=True, write_delay_s=10, on_save_error="warn")
    try:
        io.save_checkpoint({"w": torch.ones(300)}, tmp_path / "good.ckpt")
        io.save_checkpoint({"w": torch.ones(300)}, tmp_path / "good.ckpt" / "oops.ckpt")
        with pytest.warns(UserWarning, match=r"oops\.ckpt' failed: NotADirectoryError"):
            io.wait()
    finally:
        io.teardown()
    assert torch.equal(DeltaStore().load(tmp_path / "good.ckpt")["w"], torch.ones(300))
