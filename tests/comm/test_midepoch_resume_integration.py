"""A fit checkpointed mid-epoch by a callback while it trains (not at its end), killed, and resumed continues bit for
bit like the uninterrupted fit, in two real gloo processes: ``ddp_1bit`` compressing the momentum during backward
(``overlap=True``) with ``warmup_steps="auto"`` resolved before the save, and ``diloco`` with a synchronous start, two
fragments, 1-bit exchanges and an exchange in flight at the save.

Each batch is drawn from ``(step, rank)`` (``step_data``), so the resumed fit sees the batches the uninterrupted one
saw after the save although Lightning restarts a plain DataLoader at the start of the epoch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.comm.test_strategy_integration import _data, _module_cls, _params
from tests.helpers import run_in_processes

STEPS = 16  # two epochs of 8 batches per rank
SAVE_AT = 12  # mid-epoch, 2 steps into ddp_1bit's compressed stage ("auto" resolves to 10 warm-up steps for AdamW)
DILOCO_SAVE_AT = 6  # fragment 1 is sent at step 6 and applied at step 7: in flight at the save


def _fit(strategy: Any, ckpt: str | None = None, callbacks: tuple = ()) -> tuple[Any, Any]:
    import lightning as L

    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
    )  # fmt: skip
    model = _module_cls()(step_data=True)
    trainer.fit(model, _data(), ckpt_path=ckpt)
    return trainer, model


def _save_at(path: str, at: int) -> Any:
    from lightning.pytorch.callbacks import Callback

    class SaveMidEpoch(Callback):
        """Saves after optimizer step ``at``, then stops the fit there (the process "killed" after its save) when
        ``stop``."""

        def __init__(self, stop: bool) -> None:
            self.stop = stop
            self.snapshot: dict[str, Any] = {}

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == at:
                trainer.save_checkpoint(path)
                if self.stop:
                    trainer.should_stop = True

    return SaveMidEpoch


def _onebit(tmp: str) -> dict[str, Any]:
    from lightning_accel.strategies import OneBitDDPStrategy

    def strategy() -> OneBitDDPStrategy:
        return OneBitDDPStrategy(warmup_steps="auto", compression="1bit", overlap=True, group_numel=500)

    ckpt = f"{tmp}/onebit-mid.ckpt"
    cb = _save_at(ckpt, SAVE_AT)
    full_trainer, full = _fit(strategy(), callbacks=(cb(stop=False),))
    _fit(strategy(), callbacks=(cb(stop=True),))  # the fit that is "killed" after its save
    trainer, resumed = _fit(strategy(), ckpt=ckpt)
    saved = torch.load(ckpt, weights_only=False)["lightning_accel_onebit"]
    return {
        "full": _params(full),
        "resumed": _params(resumed),
        "saved_step": saved["step"],
        "saved_since": saved["compressed_since"],
        "warmup_end": (full_trainer.strategy.onebit_state.warmup_end, trainer.strategy.onebit_state.warmup_end),
        "overlap": (full_trainer.strategy.overlap, trainer.strategy.overlap),
    }


def _diloco(tmp: str) -> dict[str, Any]:
    from lightning_accel.strategies import LocalStepsStrategy

    def strategy() -> LocalStepsStrategy:  # synchronous steps 1-2; fragment 1 sent at step 6 and applied at step 7
        return LocalStepsStrategy(sync_every=4, fragments=2, overlap_steps=1, sync_start=2, block_size=16)

    ckpt = f"{tmp}/diloco-mid.ckpt"
    cb = _save_at(ckpt, DILOCO_SAVE_AT)
    _, full = _fit(strategy(), callbacks=(cb(stop=False),))
    _fit(strategy(), callbacks=(cb(stop=True),))
    trainer, resumed = _fit(strategy(), ckpt=ckpt)
    payload = torch.load(ckpt, weights_only=False)["lightning_accel_localsteps"]
    return {
        "full": _params(full),
        "resumed": _params(resumed),
        "saved_step": payload["ranks"][0]["outer"]["step"],
        "in_flight": [f["sent_at"] for f in payload["ranks"][0]["outer"]["fragments"]],
        "steps": trainer.strategy.local_steps.step_count,
    }


def _run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {"onebit": _onebit(tmp), "diloco": _diloco(tmp)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = str(tmp_path_factory.mktemp("midepoch"))
    return run_in_processes(_run, 2, (tmp,), init_process_group=False, timeout=400)


def test_onebit_overlapped_resumed_mid_epoch_continues_exactly(results: list[dict[str, Any]]) -> None:
    for res in (r["onebit"] for r in results):
        assert res["saved_step"] == SAVE_AT and res["saved_since"] == 10  # saved in the compressed stage
        assert res["warmup_end"] == (10, 10) and res["overlap"] == (True, True)
        np.testing.assert_array_equal(res["full"], res["resumed"])
    np.testing.assert_array_equal(results[0]["onebit"]["resumed"], results[1]["onebit"]["resumed"])


def test_diloco_resumed_mid_epoch_with_an_exchange_in_flight_continues_exactly(results: list[dict[str, Any]]) -> None:
    for res in (r["diloco"] for r in results):
        assert res["saved_step"] == DILOCO_SAVE_AT and res["in_flight"] == [None, DILOCO_SAVE_AT]
        assert res["steps"] == STEPS
        np.testing.assert_array_equal(res["full"], res["resumed"])
    np.testing.assert_array_equal(results[0]["diloco"]["resumed"], results[1]["diloco"]["resumed"])
