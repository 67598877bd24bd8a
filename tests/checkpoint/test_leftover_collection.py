"""The first save in a directory collects what an earlier run left: a failure there must not fail the save."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint import codec
from lightning_accel.checkpoint.store import BLOB_DIR, DeltaStore, store_dir


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"state_dict": {"w": torch.randn(4096, generator=g)}, "epoch": seed}


def _plant_orphan(directory: Path) -> Path:
    """A blob no manifest references, as a killed earlier run leaves it."""
    orphan = directory / BLOB_DIR / "ff" / ("f" * 40)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(codec.encode_full(torch.zeros(10)))
    return orphan


def test_a_failed_collection_of_leftovers_warns_saves_and_is_retried_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    earlier = DeltaStore()
    earlier.save(_state(0), tmp_path / "a.ckpt")
    earlier.close()
    orphan = _plant_orphan(tmp_path)

    store = DeltaStore(gc_grace_s=0)
    real_rm = store.fs.rm

    def rm(url: Any) -> None:
        if str(url).endswith(orphan.name):
            raise PermissionError(13, "Permission denied", str(url))
        real_rm(url)

    monkeypatch.setattr(store.fs, "rm", rm)
    where = re.escape(repr(store_dir(tmp_path)))
    with pytest.warns(UserWarning, match=rf"{where}.*PermissionError"):
        store.save(_state(1), tmp_path / "b.ckpt")
    assert store.verify(tmp_path / "b.ckpt")["ok"]  # the save went ahead
    assert orphan.exists()

    monkeypatch.setattr(store.fs, "rm", real_rm)  # the cause is gone: the next save collects
    store.save(_state(2), tmp_path / "c.ckpt")
    assert not orphan.exists()
    for name in ("a.ckpt", "b.ckpt", "c.ckpt"):
        assert store.verify(tmp_path / name)["ok"]
    store.close()


def test_a_successful_collection_of_leftovers_runs_once_per_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DeltaStore(gc_grace_s=0)
    calls: list[str] = []
    real = store.collect_garbage

    def counting(directory: Any, **kw: Any) -> int:
        calls.append(str(directory))
        return real(directory, **kw)

    monkeypatch.setattr(store, "collect_garbage", counting)
    store.save(_state(0), tmp_path / "a.ckpt")
    store.save(_state(1), tmp_path / "b.ckpt")
    assert len(calls) == 1
    store.close()
