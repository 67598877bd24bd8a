"""Lightning names a save whose file name is taken ``-v1``, ``-v2``... after asking ``ModelCheckpoint.file_exists``;
with ``async_save`` the previous save of that name is often still queued, not on disk. ``DeltaModelCheckpoint`` counts
queued saves as existing (and queued removals as gone), so every save keeps its own file, as with synchronous saves.
With ``on_save_error="warn"`` a store it cannot reach for that check is warned, not fatal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint, DeltaStore
from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader


def test_the_plugin_reports_what_its_queue_leaves_at_a_path(tmp_path: Path) -> None:
    io = DeltaCheckpointIO(async_save=True, write_delay_s=10)  # nothing starts before `wait`
    try:
        a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
        assert io.exists(a) is None  # nothing queued: the file system knows
        io.save_checkpoint({"w": torch.ones(300)}, a)
        io.save_checkpoint({"w": torch.ones(300)}, b)
        assert io.exists(a) is True and not a.exists()
        io.remove_checkpoint(b)
        assert io.exists(b) is False
        io.wait()
        assert io.exists(a) is None and a.exists() and not b.exists()
    finally:
        io.teardown()
    assert DeltaCheckpointIO().exists(a) is None  # synchronous: always the file system


def test_a_repeated_filename_gets_its_version_suffix_while_the_first_save_is_queued(tmp_path: Path) -> None:
    # 8 steps, a save every 2 named "epoch=0": 4 checkpoints kept (save_top_k=-1). Queued saves start only at
    # teardown, so `file_exists` never finds one on disk: each save took the name "epoch=0.ckpt" and replaced the last.
    io = DeltaCheckpointIO(async_save=True, write_delay_s=10, max_pending=8)
    cb = DeltaModelCheckpoint(
        dirpath=tmp_path / "ckpt", filename="{epoch}", every_n_train_steps=2, save_top_k=-1, monitor="train_loss"
    )
    ckpt_trainer(tmp_path, [io], [cb], max_epochs=1).fit(CheckpointModel(), tiny_loader())
    names = sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt"))
    assert names == ["epoch=0-v1.ckpt", "epoch=0-v2.ckpt", "epoch=0-v3.ckpt", "epoch=0.ckpt"]
    assert sorted(Path(p).name for p in cb.best_k_models) == names
    steps = sorted(DeltaStore().load(tmp_path / "ckpt" / n)["global_step"] for n in names)
    assert steps == [2, 4, 6, 8]
    assert io.writer_stats.coalesced == 0


class _Outage(Callback):
    """From the first step on, the checkpoint callback's existence checks fail, as an object store's do in an outage
    (the plugin's own store still writes: its saves are not what is tested here)."""

    def __init__(self, cb: DeltaModelCheckpoint) -> None:
        self.cb = cb

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def unreachable(url: Any) -> bool:
            raise ConnectionError(f"Could not connect to the endpoint URL: {url}")

        assert self.cb._store is not None
        self.cb._store.exists = unreachable  # type: ignore[method-assign]


@pytest.mark.parametrize("on_save_error", ["warn", "raise"])
def test_an_unreachable_store_at_the_name_check_is_warned_in_warn_mode(tmp_path: Path, on_save_error: str) -> None:
    io = DeltaCheckpointIO(async_save=True, on_save_error=on_save_error)  # type: ignore[arg-type]
    cb = DeltaModelCheckpoint(
        dirpath=tmp_path / "ckpt", filename="{epoch}", every_n_train_steps=4, save_top_k=-1, monitor="train_loss"
    )
    trainer = ckpt_trainer(tmp_path, [io], [cb, _Outage(cb)], max_epochs=1)
    if on_save_error == "raise":  # the store's own error, as before
        with pytest.raises(ConnectionError, match="Could not connect"):
            trainer.fit(CheckpointModel(), tiny_loader())
        return
    with pytest.warns(UserWarning, match="Could not check whether checkpoint .*epoch=0.ckpt exists"):
        trainer.fit(CheckpointModel(), tiny_loader())  # was: ConnectionError out of `fit` despite "warn"
    assert trainer.global_step == 8
    assert (tmp_path / "ckpt" / "epoch=0.ckpt").exists()
