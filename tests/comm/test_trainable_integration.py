"""``strategy="ddp_1bit"`` when a callback changes which parameters train mid-fit (``BaseFinetuning`` unfreezing a
backbone, or freezing a layer), in two real processes (gloo).

DDP averages only the parameters that required gradients when it wrapped the model: one unfrozen later would train on
each rank's own gradients (in the fp32 warm-up, a variance refresh, the gradient path) and the ranks' copies would
drift apart without a word; one frozen later would leave DDP waiting for a gradient that never comes. Every rank must
hold the same model at the end, whichever stage the change falls in.
"""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np
import pytest
import torch

from tests.comm.test_strategy_integration import _data, _module_cls, _onebit, _params
from tests.helpers import run_in_processes


def _fit_with_change(strategy: Any, *, opt: str, at: int, unfreeze: bool, max_steps: int = 8) -> dict:
    import lightning as L

    class Change(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == at:
                if unfreeze:
                    pl_module.frozen.requires_grad_(True)
                else:
                    pl_module.net[0].requires_grad_(False)

    model = _module_cls()(opt=opt, frozen=True)
    before = model.frozen.weight.detach().clone()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Change()],
    )
    trainer.fit(model, _data())
    out: dict[str, Any] = {
        "params": _params(model),
        "frozen_moved": float((model.frozen.weight.detach() - before).abs().max()),
    }
    st = getattr(trainer.strategy, "onebit_state", None)
    if st is not None:
        out.update(compressed=st.stats.compressed_calls, step=st.step)
    else:
        out.update(syncs=trainer.strategy.local_steps.syncs, step=trainer.strategy.local_steps.step_count)
    return out


SCENARIOS = {
    # unfrozen in the fp32 warm-up (steps 0-3), then compressed momentum
    "sgdm_warmup": lambda: _fit_with_change(_onebit(warmup_steps=4), opt="sgdm", at=1, unfreeze=True),
    # unfrozen in the compressed stage, with a variance refresh (fp32 averaging of the gradients) after it
    "adamw_refresh": lambda: _fit_with_change(
        _onebit(variance_refresh=1), opt="adamw", at=3, unfreeze=True, max_steps=10
    ),
    # the gradient path: DDP's buckets are what travels
    "gradients": lambda: _fit_with_change(_onebit(compressed_signal="gradients"), opt="sgdm", at=3, unfreeze=True),
    # a trained layer frozen in the compressed stage
    "freeze": lambda: _fit_with_change(_onebit(), opt="sgdm", at=3, unfreeze=False),
    # the same under local steps (whose comm hook communicates nothing, but DDP still waits for every gradient)
    "diloco_freeze": lambda: _fit_with_change(_local(), opt="sgdm", at=3, unfreeze=False),
}


def _resume(tmp: str) -> dict:
    """A parameter unfrozen at step 3 (and kept unfrozen: the callback holds it so, as ``BaseFinetuning`` does after a
    resume), checkpointed at step 6 in the compressed stage and resumed: the model is wrapped while it is frozen again,
    and unfrozen at the first batch. The resumed fit must continue as the uninterrupted one."""
    import lightning as L

    class Unfreeze(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step >= 3:
                pl_module.frozen.requires_grad_(True)

    def fit(max_steps: int, ckpt: str | None = None) -> tuple[Any, Any]:
        model = _module_cls()(opt="sgdm", frozen=True, step_data=True)
        trainer = L.Trainer(
            strategy=_onebit(),
            accelerator="cpu",
            devices=2,
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Unfreeze()],
        )
        trainer.fit(model, _data(), ckpt_path=ckpt)
        return trainer, model

    _, full = fit(10)
    trainer, _ = fit(6)
    ckpt = f"{tmp}/unfrozen.ckpt"
    trainer.save_checkpoint(ckpt)
    _, resumed = fit(10, ckpt)
    return {"full": _params(full), "resumed": _params(resumed)}


def _local() -> Any:
    from lightning_accel.strategies import LocalStepsStrategy

    return LocalStepsStrategy(sync_every=2, compression="fp32")


def _run(rank: int, world: int, tmp: str) -> dict:
    import lightning_accel  # noqa: F401  (registers "ddp_1bit")

    out: dict = {}
    for name, fn in {**SCENARIOS, "resume": lambda: _resume(tmp)}.items():
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - reported by the scenario's own test
            out[name] = {"error": f"rank {rank}, scenario {name!r}:\n{traceback.format_exc()}"}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("trainable"))
    return run_in_processes(_run, 2, args=(tmp,), init_process_group=False, timeout=420)


def _get(results: list[dict], name: str) -> list[dict]:
    for r in results:
        if "error" in r[name]:
            pytest.fail(r[name]["error"], pytrace=False)
    return [r[name] for r in results]


@pytest.mark.parametrize("name", ["sgdm_warmup", "adamw_refresh", "gradients"])
def test_a_parameter_unfrozen_mid_fit_is_averaged_and_the_ranks_end_identical(results: list[dict], name: str) -> None:
    r0, r1 = _get(results, name)
    assert r0["frozen_moved"] > 1e-4  # it trained once unfrozen
    assert r0["compressed"] > 0 and r0["step"] >= 8  # compressed steps ran after the change
    np.testing.assert_array_equal(r0["params"], r1["params"])
    assert torch.isfinite(torch.from_numpy(r0["params"])).all()


def test_a_layer_frozen_mid_fit_stops_training_and_the_ranks_end_identical(results: list[dict]) -> None:
    r0, r1 = _get(results, "freeze")
    assert r0["compressed"] > 0
    np.testing.assert_array_equal(r0["params"], r1["params"])


def test_a_layer_frozen_mid_fit_under_local_steps_stops_training_and_the_ranks_end_identical(
    results: list[dict],
) -> None:
    r0, r1 = _get(results, "diloco_freeze")
    assert r0["step"] == 8 and r0["syncs"] >= 4
    np.testing.assert_array_equal(r0["params"], r1["params"])


def test_a_resume_after_the_unfreezing_continues_as_the_uninterrupted_fit(results: list[dict]) -> None:
    for r in _get(results, "resume"):
        np.testing.assert_array_equal(r["resumed"], r["full"])
