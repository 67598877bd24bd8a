"""A resume whose checkpoint holds an unusable part for one rank only, in two real processes (gloo): ``diloco``'s own
state of rank 1 made for another layout, or its optimizer state of another shape; ``ddp_1bit``'s error state with rank
1's rows missing. Every rank must raise, the failing one its own error and the others one line naming it, long before
the process group's timeout (20 s here), and a later resume of a sound checkpoint must still work (the ranks'
collectives stay in step)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.comm.test_strategy_integration import _data, _module_cls
from tests.helpers import run_in_processes

TIMEOUT = timedelta(seconds=20)


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test reads it
        return f"{type(e).__name__}: {e}"
    return ""


def _trainer(strategy: Any) -> Any:
    import lightning as L

    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def _tampered(rank: int, src: str, dst: str, edit: Any) -> None:
    """Rank 0 writes ``src`` edited by ``edit`` to ``dst``; every rank waits for the file."""
    import torch.distributed as dist

    if rank == 0:
        ckpt = torch.load(src, weights_only=False)
        edit(ckpt)
        torch.save(ckpt, dst)
    dist.barrier()


def _diloco(rank: int, tmp: str) -> dict[str, Any]:
    from lightning_accel.strategies import LocalStepsStrategy

    def strategy() -> LocalStepsStrategy:
        return LocalStepsStrategy(sync_every=2, compression="fp32", timeout=TIMEOUT)

    trainer = _trainer(strategy())
    trainer.fit(_module_cls()(opt="sgdm"), _data())
    good = f"{tmp}/diloco.ckpt"
    trainer.save_checkpoint(good)

    def other_layout(ckpt: dict[str, Any]) -> None:  # rank 1's outer state of another size
        frag = ckpt["lightning_accel_localsteps"]["ranks"][1]["outer"]["fragments"][0]
        frag["outer"] = torch.zeros(frag["outer"].numel() + 1)

    def other_optimizer(ckpt: dict[str, Any]) -> None:  # rank 1's optimizer state of another parameter count
        opt = ckpt["lightning_accel_localsteps"]["ranks"][1]["optimizers"][0]
        opt["param_groups"][0]["params"] = opt["param_groups"][0]["params"][:-1]

    out: dict[str, Any] = {}
    for name, edit in (("layout", other_layout), ("optimizer", other_optimizer)):
        path = f"{tmp}/diloco-{name}.ckpt"
        _tampered(rank, good, path, edit)
        out[name] = _error(lambda p=path: _trainer(strategy()).fit(_module_cls()(opt="sgdm"), _data(), ckpt_path=p))
    out["again"] = _error(lambda: _trainer(strategy()).fit(_module_cls()(opt="sgdm"), _data(), ckpt_path=good))
    return out


def _onebit(rank: int, tmp: str) -> dict[str, Any]:
    from lightning_accel.strategies import OneBitDDPStrategy

    def strategy() -> OneBitDDPStrategy:
        return OneBitDDPStrategy(warmup_steps=2, compression="1bit", timeout=TIMEOUT)

    trainer = _trainer(strategy())
    trainer.fit(_module_cls()(opt="sgdm"), _data())
    good = f"{tmp}/onebit.ckpt"
    trainer.save_checkpoint(good)

    def missing_rows(ckpt: dict[str, Any]) -> None:  # rank 1's error state gone from one group
        group = next(iter(ckpt["lightning_accel_onebit"]["groups"].values()))
        group["worker"] = group["worker"][:1]

    path = f"{tmp}/onebit-missing.ckpt"
    _tampered(rank, good, path, missing_rows)
    out = {"missing": _error(lambda: _trainer(strategy()).fit(_module_cls()(opt="sgdm"), _data(), ckpt_path=path))}
    out["again"] = _error(lambda: _trainer(strategy()).fit(_module_cls()(opt="sgdm"), _data(), ckpt_path=good))
    return out


def _run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {"diloco": _diloco(rank, tmp), "onebit": _onebit(rank, tmp)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = str(tmp_path_factory.mktemp("restore_failures"))
    return run_in_processes(_run, 2, (tmp,), init_process_group=False, timeout=300)


def _one_line_naming_rank_1(text: str, start: str) -> None:
    assert text.startswith(start), text
    assert "\n" not in text and "timed out" not in text.lower() and "timeout" not in text.lower(), text


def test_a_local_steps_part_of_another_layout_on_one_rank_fails_on_every_rank(results: list[dict[str, Any]]) -> None:
    own, other = results[1]["diloco"]["layout"], results[0]["diloco"]["layout"]
    _one_line_naming_rank_1(own, "ValueError: `ckpt_path` ")
    assert "diloco-layout.ckpt" in own and "Resume with the same" in own
    _one_line_naming_rank_1(other, "RuntimeError: diloco: rank 1 could not restore its local-steps state from ")
    assert "diloco-layout.ckpt" in other and "Resume with the same" in other  # rank 1's reason, quoted


def test_a_local_steps_optimizer_state_unusable_on_one_rank_fails_on_every_rank(results: list[dict[str, Any]]) -> None:
    own, other = results[1]["diloco"]["optimizer"], results[0]["diloco"]["optimizer"]
    _one_line_naming_rank_1(own, "ValueError: `ckpt_path` ")
    assert "diloco-optimizer.ckpt" in own and "rank 1's optimizer state cannot be loaded" in own, own
    _one_line_naming_rank_1(other, "RuntimeError: diloco: rank 1 could not restore its optimizer state from ")
    assert "diloco-optimizer.ckpt" in other


def test_a_local_steps_resume_after_a_refused_one_works(results: list[dict[str, Any]]) -> None:
    assert [r["diloco"]["again"] for r in results] == ["", ""]


def test_onebit_error_state_missing_a_ranks_rows_is_refused_on_every_rank(results: list[dict[str, Any]]) -> None:
    for res in results:  # every rank reads the whole payload and finds the same fault: the same line everywhere
        text = res["onebit"]["missing"]
        _one_line_naming_rank_1(text, "ValueError: `ckpt_path` ")
        assert "onebit-missing.ckpt" in text and "1 of 2 ranks" in text, text
    assert results[0]["onebit"]["missing"] == results[1]["onebit"]["missing"]
    assert [r["onebit"]["again"] for r in results] == ["", ""]


# -- rank 1's own precision state and its outer momentum, unusable alone ------------------------------------------


def _diloco_rank_parts(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """``diloco`` under a GradScaler (``16-mixed`` on CPU): each rank's loss scale is its own part of the checkpoint,
    and so are its outer momentum and error feedback. Rank 1's precision state emptied, then its outer momentum of
    another size (the outer parameters, which the layout check reads, left sound)."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_accel.strategies import LocalStepsStrategy

    torch.set_num_threads(1)

    def fit(ckpt: str | None = None) -> L.Trainer:
        trainer = L.Trainer(
            strategy=LocalStepsStrategy(sync_every=2, timeout=TIMEOUT), accelerator="cpu", devices=2, max_steps=4,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(_module_cls()(opt="sgdm"), _data(), ckpt_path=ckpt)
        return trainer

    good = f"{tmp}/parts.ckpt"
    fit().save_checkpoint(good)

    def no_scaler_state(ckpt: dict[str, Any]) -> None:
        ckpt["lightning_accel_localsteps"]["ranks"][1]["precision"] = {}

    def other_momentum(ckpt: dict[str, Any]) -> None:
        frag = ckpt["lightning_accel_localsteps"]["ranks"][1]["outer"]["fragments"][0]
        frag["momentum"] = torch.zeros(frag["momentum"].numel() + 8)

    def no_errors(ckpt: dict[str, Any]) -> None:
        ckpt["lightning_accel_localsteps"]["ranks"][1]["outer"]["fragments"][0]["worker_error"] = None

    out: dict[str, Any] = {}
    for name, edit in (("precision", no_scaler_state), ("momentum", other_momentum), ("errors", no_errors)):
        path = f"{tmp}/parts-{name}.ckpt"
        _tampered(rank, good, path, edit)
        out[name] = _error(lambda p=path: fit(p))
    out["again"] = _error(lambda: fit(good))
    return out


@pytest.fixture(scope="module")
def part_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = str(tmp_path_factory.mktemp("restore_parts"))
    return run_in_processes(_diloco_rank_parts, 2, (tmp,), init_process_group=False, timeout=300)


def test_a_loss_scale_unusable_on_one_rank_fails_the_diloco_resume_on_every_rank(
    part_results: list[dict[str, Any]],
) -> None:
    own, other = part_results[1]["precision"], part_results[0]["precision"]
    _one_line_naming_rank_1(own, "ValueError: `ckpt_path` ")
    assert "parts-precision.ckpt" in own and "rank 1's MixedPrecision state cannot be loaded" in own, own
    _one_line_naming_rank_1(other, "RuntimeError: diloco: rank 1 could not restore its precision plugin state from ")
    assert "parts-precision.ckpt" in other and "MixedPrecision" in other, other


@pytest.mark.parametrize("part", ["momentum", "errors"])
def test_an_outer_state_damaged_on_one_rank_fails_the_diloco_resume_on_every_rank(
    part_results: list[dict[str, Any]], part: str
) -> None:
    own, other = part_results[1][part], part_results[0][part]
    _one_line_naming_rank_1(own, "ValueError: `ckpt_path` ")
    assert f"parts-{part}.ckpt" in own and "fragment 0" in own, own
    _one_line_naming_rank_1(other, "RuntimeError: diloco: rank 1 could not restore its local-steps state from ")
    assert f"parts-{part}.ckpt" in other and "fragment 0" in other, other


def test_a_diloco_resume_under_a_grad_scaler_works_after_refused_ones(part_results: list[dict[str, Any]]) -> None:
    assert [r["again"] for r in part_results] == ["", ""]


# -- the checks themselves, in one process -------------------------------------------------------------------------


def _gathered(rows: int, world: int = 2) -> dict[str, Any]:
    return {"world_size": world, "groups": {"0,1": {"worker": torch.zeros(rows, 8), "server": torch.zeros(rows, 4)}}}


def test_check_gathered_state_wants_one_row_per_rank() -> None:
    from lightning_accel.comm.state import check_gathered_state

    check_gathered_state(_gathered(2))
    check_gathered_state({"world_size": 2, "groups": {}})  # nothing compressed yet: nothing to check
    with pytest.raises(ValueError, match=r"^the 1-bit error state of group '0,1' \(worker\) holds rows for 1 of 2"):
        check_gathered_state(_gathered(1))
    with pytest.raises(ValueError, match=r"holds rows for 3 of 2 ranks"):
        check_gathered_state(_gathered(3))
    broken = _gathered(2)
    del broken["groups"]["0,1"]["server"]
    with pytest.raises(ValueError, match=r"group '0,1' \(server\) holds no tensor"):
        check_gathered_state(broken)
    with pytest.raises(ValueError, match=r"world_size None .* incomplete or corrupt"):
        check_gathered_state({"groups": {}})
    with pytest.raises(ValueError, match=r"is a list, expected a mapping"):
        check_gathered_state([])  # type: ignore[arg-type]


def test_an_incomplete_local_steps_part_is_refused_naming_the_checkpoint(one_process_group: None) -> None:
    """A part without its outer state, or with local parameters of other sizes, is refused before anything is
    restored, in one line naming `ckpt_path` (not a bare KeyError)."""
    import torch.nn as nn

    from lightning_accel.comm import LocalStepsStrategy
    from lightning_accel.comm.localsteps import LocalSteps

    strategy = LocalStepsStrategy(sync_every=4)
    param = nn.Parameter(torch.arange(8.0))
    local = strategy._local = LocalSteps([param], strategy.local_steps_config)
    with pytest.raises(
        ValueError, match=r"^`ckpt_path` '/c/a.ckpt': rank 0's part .* incomplete or corrupt \(KeyError"
    ):
        strategy._restore_local({"format": 2, "ranks": [{"local": []}]}, "/c/a.ckpt")
    with pytest.raises(ValueError, match=r"^`ckpt_path` '/c/b.ckpt': expected 1 fragment tensors of \[8\] elements"):
        strategy._restore_local(
            {"format": 2, "ranks": [{"outer": local.state_dict(), "local": [torch.zeros(7)]}]}, "/c/b.ckpt"
        )
    assert torch.equal(param.detach(), torch.arange(8.0))  # refused before any copy


def test_a_local_steps_state_with_a_damaged_tensor_or_counter_is_refused_before_loading(
    one_process_group: None,
) -> None:
    """The layout matches, but a tensor or counter ``load_state_dict`` would fail on halfway is refused first, naming
    the fragment and the entry; nothing is loaded."""
    import copy

    import torch.nn as nn

    from lightning_accel.comm.localsteps import LocalSteps, LocalStepsConfig

    param = nn.Parameter(torch.arange(8.0))
    local = LocalSteps([param], LocalStepsConfig(sync_every=4, block_size=8))
    sound = local.state_dict()
    local.check_state(sound)

    def damaged(edit: Any) -> dict[str, Any]:
        state = copy.deepcopy(sound)
        edit(state)
        return state

    frag0 = "fragment 0's "
    cases = [
        (lambda s: s["fragments"][0].update(momentum=torch.zeros(9)), frag0 + r"`momentum` .* holds a tensor of shape"),
        (lambda s: s["fragments"][0].update(server_error=None), frag0 + r"`server_error` .* holds no tensor"),
        (lambda s: s["fragments"][0].update(sent=torch.zeros(1)), frag0 + r"`sent_at` .* is None"),
        (lambda s: s.update(step="4"), r"the checkpoint's local-steps `step` is '4', expected an integer"),
    ]
    for edit, match in cases:
        with pytest.raises(ValueError, match=f"^{match}") as info:
            local.load_state_dict(damaged(edit))
        assert "\n" not in str(info.value) and "incomplete or corrupt" in str(info.value)
    assert local.step_count == 0 and torch.equal(param.detach(), torch.arange(8.0))


@pytest.mark.parametrize("payload", [[1, 2], {"format": 2}, {"format": 2, "ranks": "x"}])
def test_a_local_steps_payload_without_its_ranks_parts_is_refused_naming_the_checkpoint(
    tmp_path: Any, payload: Any
) -> None:
    """Read alike by every rank: refused on each in one line, instead of a bare ``KeyError`` / ``TypeError``."""
    from lightning_accel.comm import LocalStepsStrategy

    path = str(tmp_path / "broken.ckpt")
    torch.save({"state_dict": {}, "lightning_accel_localsteps": payload}, path)
    with pytest.raises(ValueError, match=r"^`ckpt_path` '.*broken\.ckpt': its local-steps state") as info:
        LocalStepsStrategy().load_checkpoint(path)
    assert "\n" not in str(info.value) and "incomplete or corrupt" in str(info.value)
