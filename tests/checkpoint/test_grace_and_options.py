"""Arguments that used to pass unchecked: an infinite or invalid grace period (``DeltaStore(gc_grace_s=...)``, ``ckpt
gc --grace-s``), and ``storage_options`` given to ``DeltaModelCheckpoint`` that differ from the plugin's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint
from lightning_accel.checkpoint.cli import main as ckpt_main
from lightning_accel.checkpoint.store import BLOB_DIR, DeltaStore
from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader


def _blobs(directory: Path) -> set[str]:
    return {p.name for p in (directory / BLOB_DIR).rglob("*") if p.is_file() and not p.name.startswith(".")}


# ------------------------------------------------------------------------------------------------ gc_grace_s
def test_an_infinite_grace_period_never_deletes_an_unreferenced_blob(tmp_path: Path) -> None:
    store = DeltaStore(gc_grace_s=math.inf)
    store.save({"w": torch.zeros(4096), "step": 1}, tmp_path / "a.ckpt")
    first = _blobs(tmp_path)
    store.save({"w": torch.ones(4096), "step": 2}, tmp_path / "a.ckpt")  # replaces it: version 1's blobs go unused
    store.remove(tmp_path / "a.ckpt")
    assert store.collect_garbage(tmp_path) == 0
    assert first <= _blobs(tmp_path)
    assert first <= set(store.pending_deletions(tmp_path))
    store.close()
    # a collection with a finite grace period (`ckpt gc --grace-s 0`) deletes them later
    assert ckpt_main(["gc", str(tmp_path), "--grace-s", "0"]) == 0
    assert not _blobs(tmp_path)


@pytest.mark.parametrize("value", [math.nan, -1.0, -math.inf])
def test_an_invalid_grace_period_is_one_line_naming_it(value: float) -> None:
    with pytest.raises(ValueError, match=r"`gc_grace_s` must be a number >= 0, got") as e:
        DeltaStore(gc_grace_s=value)
    assert "\n" not in str(e.value) and "float('inf') never deletes" in str(e.value)
    with pytest.raises(ValueError, match=r"`gc_grace_s` must be"):
        DeltaCheckpointIO(gc_grace_s=value)


# ------------------------------------------------------------------------------------------------ storage_options
def _fit(tmp_path: Path, io: DeltaCheckpointIO, cb: DeltaModelCheckpoint) -> None:
    trainer = ckpt_trainer(tmp_path, [io], [cb], max_steps=1, limit_val_batches=0)
    trainer.fit(CheckpointModel(), tiny_loader(64))


@pytest.mark.parametrize(
    ("plugin", "callback"),
    [
        ({"anon": False, "secret": "s3cr3t", "key": "AKIA123"}, {"anon": True}),
        (None, {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}, "token": "t0ken"}),
    ],
    ids=["both-differ", "callback-only"],
)
def test_storage_options_that_differ_from_the_plugins_are_refused_at_setup(
    tmp_path: Path, plugin: dict[str, Any] | None, callback: dict[str, Any]
) -> None:
    io = DeltaCheckpointIO(storage_options=plugin)
    cb = DeltaModelCheckpoint(dirpath=tmp_path / "ckpt", storage_options=callback)
    with pytest.raises(ValueError, match=r"`DeltaModelCheckpoint\(storage_options=") as e:
        _fit(tmp_path, io, cb)
    message = str(e.value)
    assert "\n" not in message and "DeltaCheckpointIO(storage_options=" in message
    for secret in ("s3cr3t", "AKIA123", "t0ken"):
        assert secret not in message
    assert "'***'" in message
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written


def test_the_same_storage_options_on_both_are_accepted(tmp_path: Path) -> None:
    io = DeltaCheckpointIO(storage_options={"auto_mkdir": True})
    cb = DeltaModelCheckpoint(dirpath=tmp_path / "ckpt", storage_options={"auto_mkdir": True})
    _fit(tmp_path, io, cb)
    assert cb.best_model_path


def test_storage_options_the_checkpoint_io_cannot_use_are_warned_at_setup(tmp_path: Path) -> None:
    """Lightning passes no ``storage_options`` from a checkpoint callback to the ``CheckpointIO``: with its default
    ``TorchCheckpointIO`` the callback's options list ``dirpath`` but never reach the saves there."""
    dirpath = f"memory://{tmp_path.name}/ckpt"
    cb = DeltaModelCheckpoint(dirpath=dirpath, storage_options={"auto_mkdir": True})
    trainer = ckpt_trainer(tmp_path, [], [cb], max_steps=1, limit_val_batches=0)
    with pytest.warns(UserWarning, match=r"`DeltaModelCheckpoint\(storage_options=\.\.\.\)`.*`TorchCheckpointIO`"):
        trainer.fit(CheckpointModel(), tiny_loader(64))
    assert cb.best_model_path.startswith(dirpath)
