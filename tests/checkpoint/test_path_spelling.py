"""A checkpoint path that names no file (empty, or ending with a separator) is refused on the caller's thread, in
one line naming it, and nothing is written: ``"runs/ckpt/"`` once became a *file* ``runs/ckpt`` that every later
save into that folder then failed on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaStore


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", ["ckpt/", ""], ids=["slash", "empty"])
def test_a_path_naming_no_file_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool, name: str
) -> None:
    monkeypatch.chdir(tmp_path)
    io = DeltaCheckpointIO(async_save=async_save)
    try:
        with pytest.raises(ValueError, match=r"Checkpoint path .* (ends with a separator|is empty)"):
            io.save_checkpoint({"w": torch.ones(300)}, name)
        io.save_checkpoint({"w": torch.ones(300)}, "ckpt/last.ckpt")  # the folder is still free to hold checkpoints
        io.wait()
    finally:
        io.teardown()
    assert (tmp_path / "ckpt").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(ValueError, match="ends with a separator"):
        DeltaStore().save({"w": torch.ones(3)}, f"{tmp_path}/other/")
    assert not (tmp_path / "other").exists()
