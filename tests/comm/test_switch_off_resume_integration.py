"""``strategy="ddp_1bit"`` in two real processes (gloo): a switch-off (:meth:`OneBitDDPStrategy.switch_off`) holds
for the rest of the fit, a fit resumed from a checkpoint saved after it included; and ``overlap=True`` on the gradient
path that ``compressed_signal="auto"`` picks for an optimizer at setup is warned about, once, on rank zero."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.comm.test_strategy_integration import _fit, _module_cls
from tests.helpers import run_in_processes

REASON = "loss spiked"


def _switch_off_then_resume(tmp: str, name: str, **strategy_kwargs: Any) -> dict[str, Any]:
    """Compressed from the warm-up's end (step 2), switched off at step 3, saved after step 6, resumed to step 10 by
    a fresh strategy with the same arguments ("auto" rechecks at steps 4, 6 and 8)."""
    from lightning.pytorch.callbacks import Callback

    from lightning_accel.strategies import OneBitDDPStrategy

    class SwitchOff(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                trainer.strategy.switch_off(REASON)

    def strategy() -> OneBitDDPStrategy:
        s = OneBitDDPStrategy(warmup_steps=2, **strategy_kwargs)
        s.measure_fn = lambda state: (2.0, 1.0)  # "auto": 1-bit is always the faster
        return s

    first = strategy()
    trainer, _ = _fit(first, max_steps=6, callbacks=[SwitchOff()])
    ckpt = str(Path(tmp) / f"{name}.ckpt")
    trainer.save_checkpoint(ckpt)
    resumed = strategy()
    _fit(resumed, max_steps=10, ckpt=ckpt)
    state = resumed.onebit_state
    assert state is not None and first.onebit_state is not None
    return {
        "first": first.onebit_state.stats.compressed_calls,
        "resumed": state.stats.compressed_calls,
        "step": state.step,
        "decision": state.decision,
        "reason": resumed.switched_off_reason,
    }


def _gradient_path_overlap() -> list[str]:
    """``overlap=True`` with an optimizer whose momentum is not compressed: the fit runs, and says it does nothing."""
    from lightning_accel.strategies import OneBitDDPStrategy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(
            OneBitDDPStrategy(warmup_steps=2, compression="1bit", overlap=True),
            max_steps=3,
            model=_module_cls()(opt="rmsprop"),
        )
    return [str(w.message) for w in caught if "`overlap=True`" in str(w.message)]


def _run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, kwargs in {"1bit": {"compression": "1bit"}, "auto": {"compression": "auto", "recheck_every": 2}}.items():
        out[name] = _switch_off_then_resume(tmp, name, **kwargs)
    out["overlap_warnings"] = _gradient_path_overlap()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_in_processes(_run, 2, (str(tmp_path_factory.mktemp("switch_off")),), init_process_group=False)


@pytest.mark.parametrize("compression", ["1bit", "auto"])
def test_a_fit_resumed_after_a_switch_off_stays_in_fp32(results: list[dict[str, Any]], compression: str) -> None:
    for r in results:
        got = r[compression]
        assert got["first"] == 1  # step 2 only: switched off at step 3 (and kept off by "auto"'s rechecks)
        assert got["step"] == 10
        # without the saved switch-off, "1bit" compressed again from the resumed step on, and "auto" re-measured
        # at its next recheck and went back to 1-bit
        assert got["resumed"] == 0, got
        assert got["decision"] == "fp32" and got["reason"] == REASON


def test_overlap_true_on_the_gradient_path_warns_once_on_rank_zero(results: list[dict[str, Any]]) -> None:
    zero, one = (r["overlap_warnings"] for r in results)
    assert len(zero) == 1 and "RMSprop" in zero[0] and "\n" not in zero[0], zero
    assert one == []
