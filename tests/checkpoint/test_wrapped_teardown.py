"""Lightning's ``AsyncCheckpointIO`` joins its thread at teardown but never tears down the ``DeltaCheckpointIO`` it
wraps, so the checkpoint directory stayed locked until the process exited (``ckpt gc`` and a second fit on the same
``dirpath`` refused as "another writer"). ``DeltaModelCheckpoint`` and ``CheckpointGuard`` tear it down."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_accel.checkpoint import CheckpointGuard, DeltaCheckpointIO, DeltaModelCheckpoint, DeltaStore
from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader


@pytest.mark.parametrize("callbacks", ["delta_model_checkpoint", "guard"])
def test_a_wrapped_plugin_releases_its_directory_after_the_fit(tmp_path: Path, callbacks: str) -> None:
    ck = tmp_path / "ckpt"
    cbs: list[Any] = (
        [DeltaModelCheckpoint(dirpath=ck, save_last=True)]
        if callbacks == "delta_model_checkpoint"
        else [CheckpointGuard(), ModelCheckpoint(dirpath=ck, save_last=True)]
    )
    inner = DeltaCheckpointIO()
    model = CheckpointModel()
    ckpt_trainer(tmp_path, [AsyncCheckpointIO(inner)], cbs, max_epochs=1).fit(model, tiny_loader())
    store = DeltaStore(gc_grace_s=0)
    try:
        store.collect_garbage(ck)  # takes the writer lock: was "being written by another DeltaStore of this process"
        restored = store.load(ck / "last.ckpt")["state_dict"]
    finally:
        store.close()
    for k, v in model.state_dict().items():
        assert torch.equal(restored[k], v), k
