"""``CachedDataModule`` under 2-process DDP (gloo) when the origin cannot be listed on one rank only (a local origin
present on one node's disk only, an empty folder on one rank): every rank raises in one line, naming the rank that
failed and why, and none is left waiting in a collective for the one that stopped."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, run_in_processes


def _fit(
    rank: int, world: int, digits: str, tmp: str, bad: str, opts: dict[str, Any], nodes: int
) -> tuple[str, str] | None:
    """Fit on ``digits``, except on rank 1, whose origin is ``bad`` (an empty folder, or an object store that does not
    answer, with ``opts``); returns the exception's type and text, None when fit returned."""
    if nodes > 1:  # one rank per node: each runs prepare_data (a fresh node whose origin is missing)
        os.environ.update(LOCAL_RANK="0", NODE_RANK=str(rank), GROUP_RANK=str(rank), LOCAL_WORLD_SIZE="1")
    import lightning as L

    from lightning_accel.data import CachedDataModule
    from lightning_accel.models import ImageClassifier

    dm = CachedDataModule(
        digits if rank == 0 else bad,
        storage_options=None if rank == 0 else opts,
        retries=0,
        cache_dir=f"{tmp}/cache{rank}",
        ram_bytes=0,
        image_size=16,
        batch_size=20,
        num_workers=0,
        val_fraction=0.2,
    )
    model = ImageClassifier(width=8, blocks=(1,))
    model.example_input_array = None
    trainer = L.Trainer(
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=1,
        accelerator="cpu",
        devices=world // nodes,
        num_nodes=nodes,
        strategy="ddp",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    try:
        trainer.fit(model, datamodule=dm)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize(
    ("bad", "nodes"),
    [("unreachable", 2), ("empty", 2), ("empty", 1)],
    ids=["prepare_data-unreachable-origin", "prepare_data-empty-origin", "setup-empty-origin"],
)
def test_an_origin_failing_on_one_rank_raises_on_every_rank(
    small_digits: Path, tmp_path: Path, bad: str, nodes: int
) -> None:
    opts: dict[str, Any] = {}
    if bad == "unreachable":  # nothing listens on that port
        where = "s3://train-bucket/digits"
        opts = {
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
        }
    else:
        where = str(tmp_path / "empty")
        os.mkdir(where)
    args = (str(small_digits), str(tmp_path), where, opts, nodes)
    out = run_in_processes(_fit, 2, args, init_process_group=False, timeout=240)
    assert all(o is not None for o in out), out
    (kind0, text0), (kind1, text1) = out
    for text in (text0, text1):
        assert "\n" not in text and where in text, text  # one line, naming the origin that failed
    assert kind0 == "RuntimeError" and "rank 1" in text0, text0  # the rank that did not fail says which one did
    assert kind1 != "RuntimeError" or "rank 1" not in text1, text1  # the failing rank raises its own error


class _Strategy:
    root_device = "cpu"


class _Trainer:
    """What the data module reads of the Trainer driving it here: a strategy with a device."""

    strategy = _Strategy()


def _refit(rank: int, world: int, digits: str, tmp: str) -> tuple[str, str]:
    """A first fit's setup on both ranks, then rank 0's (the node's) prepare_data of the next fit finds the origin
    gone: the next setup raises on both ranks, though both still hold the first fit's datasets."""
    import shutil

    from lightning_accel.data import CachedDataModule

    origin = f"{tmp}/origin"
    if rank == 0:
        shutil.copytree(digits, origin)
    import torch.distributed as dist

    dist.barrier()
    dm = CachedDataModule(origin, cache_dir=f"{tmp}/cache{rank}", ram_bytes=0, image_size=16, num_workers=0)
    dm.trainer = _Trainer()  # type: ignore[assignment]
    if rank == 0:
        dm.prepare_data()
    dm.setup("fit")
    assert dm.train_set is not None
    dist.barrier()
    if rank == 0:
        shutil.rmtree(origin)
        dm.prepare_data()  # deferred to setup, where every rank learns of it
    try:
        dm.setup("fit")
    except Exception as e:
        return type(e).__name__, str(e)
    return "", "setup returned"


def test_a_prepare_data_failure_is_raised_by_the_next_setup_on_every_rank(small_digits: Path, tmp_path: Path) -> None:
    out = run_in_processes(_refit, 2, (str(small_digits), str(tmp_path)), timeout=120)
    (kind0, text0), (kind1, text1) = out
    assert kind0 not in ("", "RuntimeError") and "origin" in text0, text0
    assert kind1 == "RuntimeError" and "on rank 0" in text1 and "\n" not in text1, text1
