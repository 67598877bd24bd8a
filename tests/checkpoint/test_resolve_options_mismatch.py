"""``ckpt_path="last"`` is resolved before the Trainer's ``setup``: with ``DeltaModelCheckpoint(storage_options=...)``
that differ from the plugin's, the first error the user sees is that mismatch, in one line, not the failure of a
search made with the callback's options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint, resolve_ckpt_path
from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader


def test_last_with_callback_options_that_differ_from_the_plugins_names_the_mismatch_first(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    bucket, opts = s3_bucket
    dirpath = f"s3://{bucket}/run/ckpt"
    io = DeltaCheckpointIO(storage_options=opts)
    first = DeltaModelCheckpoint(dirpath=dirpath, save_last=True)
    ckpt_trainer(tmp_path, [io], [first], max_epochs=1).fit(CheckpointModel(), tiny_loader())
    # a stale endpoint left on the callback: a search with it cannot reach the bucket
    stale = {**opts, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    callback = DeltaModelCheckpoint(dirpath=dirpath, save_last=True, storage_options=stale)
    trainer = ckpt_trainer(tmp_path, [DeltaCheckpointIO(storage_options=opts)], [callback], max_epochs=2)
    with pytest.raises(ValueError, match=r"`DeltaModelCheckpoint\(storage_options=.*differs from the plugin's") as e:
        resolve_ckpt_path(trainer, "last")
    assert "\n" not in str(e.value)
    assert "testing" not in str(e.value).replace("'key': '***'", "")  # secrets redacted
