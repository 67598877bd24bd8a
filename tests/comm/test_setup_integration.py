"""``strategy="ddp_1bit"`` in two real processes (gloo): :meth:`OneBitDDPStrategy.switch_off` called before ``fit``
holds from the first step (and in the checkpoints, so a resume stays in fp32), as a call during the fit holds from
the next step; and ``variance_refresh`` asked for where no Adam momentum is compressed is warned about at setup, once,
on rank zero, as is a ``group_numel`` or ``min_compress_numel`` the optimizers' signal ignores; a
``processes_per_node`` that cannot lay out the job's processes is refused at setup on every rank
(``hierarchical="auto"`` took the flat exchange without a word)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.comm.test_strategy_integration import _fit, _module_cls
from tests.helpers import run_in_processes

REASON = "kept off by the caller"


def _strategy(**kwargs: Any) -> Any:
    from lightning_accel.strategies import OneBitDDPStrategy

    s = OneBitDDPStrategy(warmup_steps=2, compression="1bit", **kwargs)
    s.measure_fn = lambda state: (2.0, 1.0)  # "auto": 1-bit is always the faster
    return s


def _switched(strategy: Any) -> dict[str, Any]:
    state = strategy.onebit_state
    assert state is not None
    return {
        "compressed": state.stats.compressed_calls,
        "step": state.step,
        "decision": state.decision,
        "reason": strategy.switched_off_reason,
    }


def _before_fit(tmp: str) -> dict[str, Any]:
    """Switched off before the fit (6 steps, saved), then resumed to 10 steps by a fresh strategy."""
    first = _strategy()
    out: dict[str, Any] = {"returned": first.switch_off(REASON)}
    trainer, _ = _fit(first, max_steps=6)
    out["first"] = _switched(first)
    ckpt = str(Path(tmp) / "before.ckpt")
    trainer.save_checkpoint(ckpt)
    resumed = _strategy()
    _fit(resumed, max_steps=10, ckpt=ckpt)
    out["resumed"] = _switched(resumed)
    return out


def _during_fit() -> dict[str, Any]:
    """Switched off at step 3 (the compressed stage began at step 2)."""
    from lightning.pytorch.callbacks import Callback

    returned: list[bool] = []

    class SwitchOff(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                returned.append(trainer.strategy.switch_off(REASON))

    s = _strategy()
    _fit(s, max_steps=6, callbacks=[SwitchOff()])
    return {**_switched(s), "returned": returned}


def _unused_warnings(opt: str, **kwargs: Any) -> list[str]:
    """The setup warnings of a short fit with ``opt`` that name an argument this fit leaves without effect."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(_strategy(**kwargs), max_steps=3, model=_module_cls()(opt=opt))
    return [str(w.message) for w in caught if "has no effect in this fit" in str(w.message)]


def _refresh_warnings(variance_refresh: int, opt: str) -> list[str]:
    return [m for m in _unused_warnings(opt, variance_refresh=variance_refresh) if "`variance_refresh" in m]


def _bad_layout() -> str:
    from lightning_accel.strategies import OneBitDDPStrategy

    try:
        _fit(OneBitDDPStrategy(warmup_steps=2, processes_per_node=3), max_steps=3)
    except ValueError as e:
        return str(e)
    return ""


def _run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "bad_layout": _bad_layout(),
        "before": _before_fit(tmp),
        "during": _during_fit(),
        "sgdm": _refresh_warnings(4, "sgdm"),
        "sgdm_default": _refresh_warnings(8, "sgdm"),
        "adamw": _refresh_warnings(4, "adamw"),
        # compressed_signal="auto" picks the gradient path for RMSprop, the momentum path for AdamW
        "rmsprop_sizes": _unused_warnings("rmsprop", group_numel=1 << 10, min_compress_numel=64),
        "adamw_sizes": _unused_warnings("adamw", group_numel=1 << 10, min_compress_numel=64),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_in_processes(_run, 2, (str(tmp_path_factory.mktemp("prefit")),), init_process_group=False)


def test_a_switch_off_before_fit_holds_from_the_first_step_and_through_a_resume(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        got = r["before"]
        assert got["returned"] is False  # 1-bit averaging was not on yet
        # before: the call did nothing, and the fit compressed from the end of its warm-up (steps 2-5)
        assert got["first"] == {"compressed": 0, "step": 6, "decision": "fp32", "reason": REASON}, got
        assert got["resumed"] == {"compressed": 0, "step": 10, "decision": "fp32", "reason": REASON}, got


def test_a_switch_off_during_fit_holds_from_the_next_step(results: list[dict[str, Any]]) -> None:
    for r in results:
        got = r["during"]
        assert got["returned"] == [True]
        assert got["compressed"] == 1 and got["decision"] == "fp32" and got["reason"] == REASON, got


def test_variance_refresh_without_adam_is_warned_about_once_on_rank_zero(results: list[dict[str, Any]]) -> None:
    zero, one = results
    assert len(zero["sgdm"]) == 1 and "\n" not in zero["sgdm"][0], zero["sgdm"]
    assert "SGD" in zero["sgdm"][0] and "`variance_refresh=4`" in zero["sgdm"][0]
    assert one["sgdm"] == []
    # the default was not asked for, and Adam's variance is what it refreshes
    assert zero["sgdm_default"] == [] and zero["adamw"] == []


def test_a_size_the_chosen_signal_ignores_is_warned_about_once_on_rank_zero(results: list[dict[str, Any]]) -> None:
    """``group_numel`` sizes compressed momentum, ``min_compress_numel`` gradient buckets: with
    ``compressed_signal="auto"`` the optimizers decide at setup which one this fit uses, and the other is named."""
    zero, one = results
    (grads,) = zero["rmsprop_sizes"]
    assert grads.startswith("`group_numel=1024` has no effect in this fit") and "RMSprop" in grads, grads
    assert "\n" not in grads and "Drop `group_numel`" in grads
    (momentum,) = zero["adamw_sizes"]
    assert momentum.startswith("`min_compress_numel=64` has no effect in this fit") and "AdamW" in momentum, momentum
    assert "\n" not in momentum and "Drop `min_compress_numel`" in momentum
    assert one["rmsprop_sizes"] == [] and one["adamw_sizes"] == []


def test_processes_per_node_that_does_not_divide_the_world_is_refused_on_every_rank(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        msg = r["bad_layout"]
        assert msg.startswith("`processes_per_node=3`") and "2 processes" in msg and "\n" not in msg, msg
