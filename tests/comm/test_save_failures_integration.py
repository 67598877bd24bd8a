"""``strategy="ddp_1bit"``: a checkpoint save that fails on one rank before the gather of the error state (a host out
of memory while copying what the checkpoint holds, an earlier save's gather that failed there alone), in two real
processes (gloo). Every rank must raise, the failing one its own error and the others one line naming it, long before
the process group's timeout, and a later save must still work (the ranks' collectives stay in step)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.comm.test_strategy_integration import _data, _module_cls
from tests.helpers import run_in_processes

MESSAGE = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1048576 bytes"


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test reads it
        return f"{type(e).__name__}: {e}"
    return ""


def _run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import lightning as L

    from lightning_accel.strategies import OneBitDDPStrategy

    torch.set_num_threads(1)
    strategy = OneBitDDPStrategy(warmup_steps=2, compression="1bit", timeout=timedelta(seconds=20))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_module_cls()(opt="sgdm"), _data())
    real = strategy._leftover_grads

    def out_of_memory(state: Any) -> Any:
        raise RuntimeError(MESSAGE)

    if rank == 1:
        strategy._leftover_grads = out_of_memory  # type: ignore[method-assign]
    out = {"failed": _error(lambda: trainer.save_checkpoint(f"{tmp}/failed.ckpt"))}
    strategy._leftover_grads = real  # type: ignore[method-assign]
    out["again"] = _error(lambda: trainer.save_checkpoint(f"{tmp}/again.ckpt"))
    if rank == 0 and not out["again"]:
        ckpt = torch.load(f"{tmp}/again.ckpt", weights_only=False)
        out["gathered"] = sorted(ckpt["lightning_accel_onebit"]["groups"]) if "lightning_accel_onebit" in ckpt else []
    out["failed_written"] = Path(f"{tmp}/failed.ckpt").exists()
    out.update({f"diloco/{k}": v for k, v in _diloco(rank, tmp).items()})
    return out


def _diloco(rank: int, tmp: str) -> dict[str, Any]:
    """The same under local steps, whose save gathers every rank's own parameters and outer state."""
    import lightning as L

    from lightning_accel.strategies import LocalStepsStrategy

    strategy = LocalStepsStrategy(sync_every=2, compression="fp32", timeout=timedelta(seconds=20))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_module_cls()(opt="sgdm"), _data())
    local = strategy.local_steps
    assert local is not None
    real = local.local_flats

    def out_of_memory() -> Any:
        raise RuntimeError(MESSAGE)

    if rank == 1:
        local.local_flats = out_of_memory  # type: ignore[method-assign]
    out = {"failed": _error(lambda: trainer.save_checkpoint(f"{tmp}/diloco_failed.ckpt"))}
    local.local_flats = real  # type: ignore[method-assign]
    # an object that does not pickle in rank 1's part alone (here in its optimizer's param group): its pickling fails
    # before the gather's first collective, which rank 0 must not be left waiting in
    group = trainer.optimizers[0].param_groups[0]
    if rank == 1:
        group["lock"] = threading.Lock()
    out["unpicklable"] = _error(lambda: trainer.save_checkpoint(f"{tmp}/diloco_unpicklable.ckpt"))
    group.pop("lock", None)
    out["again"] = _error(lambda: trainer.save_checkpoint(f"{tmp}/diloco_again.ckpt"))
    if rank == 0 and not out["again"]:
        ckpt = torch.load(f"{tmp}/diloco_again.ckpt", weights_only=False)
        out["gathered"] = len(ckpt["lightning_accel_localsteps"]["ranks"])
    out["failed_written"] = Path(f"{tmp}/diloco_failed.ckpt").exists()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = str(tmp_path_factory.mktemp("save_failures"))
    return run_in_processes(_run, 2, (tmp,), init_process_group=False, timeout=240)


def test_a_save_failing_on_one_rank_before_the_gather_fails_on_every_rank(results: list[dict[str, Any]]) -> None:
    own, other = results[1]["failed"], results[0]["failed"]
    assert own == f"RuntimeError: {MESSAGE}"
    expected = (
        "RuntimeError: ddp_1bit: rank 1 could not prepare its error state for the checkpoint, so no rank saves it"
    )
    assert other.startswith(expected), other
    assert MESSAGE in other and "\n" not in other and "timed out" not in other.lower()
    assert not results[0]["failed_written"]  # rank 0 writes no checkpoint without rank 1's error state


def test_the_next_save_still_gathers_every_rank(results: list[dict[str, Any]]) -> None:
    assert [r["again"] for r in results] == ["", ""]
    assert results[0]["gathered"]  # rank 0 wrote every rank's error state


def test_a_local_steps_save_failing_on_one_rank_fails_on_every_rank(results: list[dict[str, Any]]) -> None:
    own, other = results[1]["diloco/failed"], results[0]["diloco/failed"]
    assert own == f"RuntimeError: {MESSAGE}"
    expected = "RuntimeError: diloco: rank 1 could not prepare its local-steps state for the checkpoint, so no rank"
    assert other.startswith(expected), other
    assert MESSAGE in other and "\n" not in other
    assert not results[0]["diloco/failed_written"]
    assert [r["diloco/again"] for r in results] == ["", ""]
    assert results[0]["diloco/gathered"] == 2


def test_a_local_steps_part_that_does_not_pickle_on_one_rank_fails_on_every_rank(results: list[dict[str, Any]]) -> None:
    own, other = results[1]["diloco/unpicklable"], results[0]["diloco/unpicklable"]
    assert "lock" in own and "pickle" in own, own
    expected = "RuntimeError: diloco: rank 1 could not prepare its local-steps state for the checkpoint, so no rank"
    assert other.startswith(expected), other
    assert "\n" not in other and "timed out" not in other.lower()
