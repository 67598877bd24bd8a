"""S3 with a custom endpoint, as the docs show it: the plugin's ``storage_options`` reach ``ModelCheckpoint``
(``DeltaModelCheckpoint``), and ``ckpt_path="last"`` resumes from the bucket (``resolve_ckpt_path``, the CLI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint, resolve_ckpt_path, resolve_last
from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

_AWS_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE")


def test_custom_endpoint_only_on_the_plugin_saves_resumes_from_last(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in _AWS_ENV:  # nothing from the environment: the endpoint and keys are only in storage_options
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    bucket, opts = s3_bucket
    dirpath = f"s3://{bucket}/run/ckpt"

    def callback() -> DeltaModelCheckpoint:
        return DeltaModelCheckpoint(
            dirpath=dirpath, every_n_train_steps=4, save_top_k=2, save_last=True, monitor="step", mode="max"
        )

    cb = callback()
    model = CheckpointModel()
    ckpt_trainer(tmp_path, [DeltaCheckpointIO(storage_options=opts)], [cb]).fit(model, tiny_loader())
    assert resolve_last(dirpath, storage_options=opts) == f"{dirpath}/last.ckpt"
    assert cb.best_model_path.startswith(dirpath)
    # A second run resumes from "last" in the bucket (Lightning alone finds nothing there).
    resumed = CheckpointModel()
    io = DeltaCheckpointIO(storage_options=opts)
    trainer = ckpt_trainer(tmp_path, [io], [callback()], max_epochs=3)
    ckpt_path = resolve_ckpt_path(trainer, "last")
    assert ckpt_path == f"{dirpath}/last.ckpt"
    trainer.fit(resumed, tiny_loader(), ckpt_path=ckpt_path)
    assert trainer.global_step == 3 * 8 and trainer.current_epoch == 3  # continued from step 16, not from 0
    # An empty directory: None (a fresh run), with Lightning's warning.
    empty = ckpt_trainer(tmp_path, [io], [DeltaModelCheckpoint(dirpath=f"s3://{bucket}/none", save_last=True)])
    with pytest.warns(UserWarning, match="no last checkpoint") as w:
        assert resolve_ckpt_path(empty, "last") is None
    assert "HINT" not in str(w[0].message)  # it saves `last.ckpt` already: a first run, not a missing option
    plain = ckpt_trainer(tmp_path, [io], [DeltaModelCheckpoint(dirpath=f"s3://{bucket}/none")])
    with pytest.warns(UserWarning, match=r"no last checkpoint.*HINT: Set `ModelCheckpoint\(..., save_last=True\)`"):
        assert resolve_ckpt_path(plain, "last") is None
    assert resolve_ckpt_path(empty, "best") == "best"
    with pytest.raises(TypeError, match="`storage_options` must be a dict"):
        DeltaModelCheckpoint(dirpath=dirpath, storage_options="anon")  # type: ignore[arg-type]
    assert torch.is_tensor(io.load_checkpoint(f"{dirpath}/last.ckpt")["state_dict"]["net.0.weight"])
