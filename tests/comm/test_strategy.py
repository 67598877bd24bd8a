"""``OneBitDDPStrategy`` construction and registration (no processes)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch


def test_registered_on_import() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_accel  # noqa: F401
    from lightning_accel.strategies import OneBitDDPStrategy

    assert "ddp_1bit" in StrategyRegistry
    st = StrategyRegistry.get("ddp_1bit")
    assert isinstance(st, OneBitDDPStrategy)


@pytest.mark.parametrize(
    ("kwargs", "name", "error"),
    [
        ({"warmup_steps": -3}, "warmup_steps", ValueError),
        ({"warmup_steps": 1}, "warmup_steps", ValueError),
        ({"warmup_steps": True}, "warmup_steps", TypeError),
        ({"block_size": 7}, "block_size", ValueError),
        ({"block_size": 12}, "block_size", ValueError),
        ({"log_stats": "no"}, "log_stats", TypeError),
        ({"find_unused_paramters": True}, "find_unused_paramters", ValueError),
        ({"ddp_comm_hook": print}, "ddp_comm_hook", ValueError),
        ({"compressed_signal": "adam"}, "compressed_signal", ValueError),
        ({"compressor_backend": "eager"}, "compressor_backend", ValueError),
        ({"compression": "int8"}, "compression", ValueError),
        ({"recheck_every": -1}, "recheck_every", ValueError),
        ({"group_numel": 0}, "group_numel", ValueError),
        ({"overlap": "yes"}, "overlap", ValueError),
        ({"overlap": 1}, "overlap", TypeError),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, name: str, error: type[Exception]) -> None:
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.raises(error, match=f"`{name}`"):
        OneBitDDPStrategy(**kwargs)


def test_overlap_true_with_find_unused_parameters_is_refused_at_construction() -> None:
    """Both are known when the strategy is built: one line then, not when the fit sets up its processes."""
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.raises(ValueError, match="`overlap=True`") as info:
        OneBitDDPStrategy(overlap=True, find_unused_parameters=True)
    msg = str(info.value)
    assert "\n" not in msg and "`find_unused_parameters=True`" in msg and "overlap='auto'" in msg
    OneBitDDPStrategy(overlap="auto", find_unused_parameters=True)
    OneBitDDPStrategy(overlap=True, find_unused_parameters=False)


@pytest.mark.parametrize(
    ("kwargs", "given"),
    [
        ({"compression": "fp32"}, "`compression='fp32'`"),
        ({"compressed_signal": "gradients"}, "`compressed_signal='gradients'`"),
        ({"compressed_signal": "gradients", "find_unused_parameters": True}, "`compressed_signal='gradients'`"),
    ],
)
def test_overlap_true_where_nothing_compresses_momentum_is_refused(kwargs: dict, given: str) -> None:
    """Only compressed momentum overlaps backward: with plain DDP or the gradient path ``overlap=True`` would do
    nothing, so it is refused in one line (``'auto'`` and ``False`` stay accepted)."""
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.raises(ValueError, match="`overlap=True` has no effect") as info:
        OneBitDDPStrategy(overlap=True, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and given in msg and "Drop `overlap`" in msg
    OneBitDDPStrategy(overlap="auto", **kwargs)
    OneBitDDPStrategy(overlap=False, **kwargs)


def test_a_forced_triton_compressor_without_triton_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """No device can run the kernel without the package: refused when the strategy is built, naming the argument
    (the fit's device is checked when it sets up). ``compression="fp32"`` never compresses: a compressor asked for
    beside it is refused as doing nothing, whether the package is there or not."""
    from lightning_accel.strategies import OneBitDDPStrategy

    monkeypatch.setattr("lightning_accel.comm.strategy.triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="`compressor_backend='triton'` needs the `triton` package") as info:
        OneBitDDPStrategy(compressor_backend="triton")
    assert "\n" not in str(info.value) and "`compressor_backend='auto'`" in str(info.value)
    with pytest.raises(ValueError, match="`compressor_backend='triton'` has no effect with `compression='fp32'`"):
        OneBitDDPStrategy(compressor_backend="triton", compression="fp32")
    OneBitDDPStrategy(compressor_backend="auto")


def test_unknown_option_lists_the_config_fields() -> None:
    from lightning_accel.comm import OneBitConfig
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.raises(ValueError, match="Unknown option") as info:
        OneBitDDPStrategy(warmup_step=3)
    msg = str(info.value)
    assert "\n" not in msg
    for f in dataclasses.fields(OneBitConfig):
        assert f.name in msg
    assert "overlap" in msg and "log_stats" in msg and "bucket_cap_mb" in msg


def test_signature_defaults_are_the_config_defaults() -> None:
    """LightningCLI reads the explicit signature; its defaults are OneBitConfig's."""
    import inspect

    from lightning_accel.comm import OneBitConfig
    from lightning_accel.strategies import OneBitDDPStrategy

    params = inspect.signature(OneBitDDPStrategy.__init__).parameters
    for f in dataclasses.fields(OneBitConfig):
        assert params[f.name].default == f.default, f.name
    assert OneBitDDPStrategy().onebit_config == OneBitConfig()


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [("compress", "compressed_signal", "momentum"), ("backend", "compressor_backend", "reference")],
)
def test_deprecated_names_map_to_the_new_ones(old: str, new: str, value: str) -> None:
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.warns(DeprecationWarning, match=f"`{old}` is deprecated; use `{new}` \\(same values\\)"):
        st = OneBitDDPStrategy(**{old: value})
    assert getattr(st.onebit_config, new) == value
    with pytest.raises(ValueError, match=f"`{old}` is the deprecated name of `{new}`: pass only `{new}`"):
        OneBitDDPStrategy(**{old: value, new: value})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name alone: no warning
        assert getattr(OneBitDDPStrategy(**{new: value}).onebit_config, new) == value


def test_find_unused_alias_keeps_compression() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_accel  # noqa: F401
    from lightning_accel.strategies import OneBitDDPStrategy

    st = StrategyRegistry.get("ddp_1bit_find_unused_parameters_true")
    assert isinstance(st, OneBitDDPStrategy)
    assert st._ddp_kwargs == {"find_unused_parameters": True}


def test_unused_parameters_error_points_to_the_1bit_alias() -> None:
    """Lightning's advice (`strategy='ddp_find_unused_parameters_true'`) would silently drop compression."""
    from lightning_accel.strategies import OneBitDDPStrategy

    err = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one.")
    OneBitDDPStrategy().on_exception(err)
    msg = str(err)
    assert "strategy='ddp_1bit_find_unused_parameters_true'" in msg
    assert "OneBitDDPStrategy(find_unused_parameters=True)" in msg
    assert "'ddp_find_unused_parameters_true'" not in msg


def test_ddp_options_pass_through() -> None:
    from lightning_accel.strategies import OneBitDDPStrategy

    st = OneBitDDPStrategy(warmup_steps=4, find_unused_parameters=True, static_graph=True, bucket_cap_mb=1)
    assert st._ddp_kwargs == {"find_unused_parameters": True, "static_graph": True, "bucket_cap_mb": 1}
    assert st.onebit_config.warmup_steps == 4


def test_cli_style_defaults_are_accepted_and_dropped() -> None:
    """LightningCLI passes every DDP argument with its default value: that must not be an error."""
    from lightning_accel.strategies import OneBitDDPStrategy

    st = OneBitDDPStrategy(ddp_comm_hook=None, ddp_comm_state=None, output_device=None, dim=0, static_graph=False)
    assert st._ddp_kwargs == {}


def test_single_process_warns_and_trains_plain() -> None:
    from lightning_accel.strategies import OneBitDDPStrategy

    st = OneBitDDPStrategy()
    assert st.world_size == 1
    with pytest.warns(UserWarning, match="single process"):
        st._register_onebit_hook()  # what `configure_ddp` runs once DDP wraps the model
    assert st.onebit_state is None


def test_example_config_builds_the_strategy_through_lightningcli() -> None:
    """The YAML example parses and instantiates (LightningCLI passes every DDP argument with its default)."""
    from pathlib import Path

    from lightning_accel.cli import AccelCLI
    from lightning_accel.strategies import OneBitDDPStrategy

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "quickstart_ddp1bit.yaml"
    cli = AccelCLI(args=["--config", str(config), "--trainer.logger=false"], run=False)
    st = cli.trainer.strategy
    assert isinstance(st, OneBitDDPStrategy)
    assert st.onebit_config.warmup_steps == 20 and st._ddp_kwargs == {}
    assert cli.trainer.num_devices == 2


@pytest.mark.parametrize(("steps", "error"), [(0, ValueError), (True, TypeError), (2.5, TypeError)])
def test_step_trial_refuses_bad_step_counts(steps: object, error: type[Exception]) -> None:
    from lightning_accel.comm import StepTrial

    with pytest.raises(error, match="`steps` must be an integer >= 1"):
        StepTrial(steps=steps)  # type: ignore[arg-type]


def test_a_state_saved_during_the_auto_trial_resumes_undecided_and_tries_again() -> None:
    """A checkpoint taken while ``compression="auto"`` tries 1-bit steps must not make the tried mode the decision:
    the resumed state is undecided and its trial runs again, once the resumed process has timed fp32 steps of its own
    to compare with (a decision saved outside a trial, or by a state without ``trial_until``, loads as it is)."""
    from lightning_accel.comm import OneBitState, StepTrial

    cpu = torch.device("cpu")
    st = OneBitState(compression="auto", warmup_steps=2, recheck_every=0)
    trial = StepTrial()
    for step in range(4):  # the trial of 1-bit steps starts at step 2, the end of warm-up
        st.step = step
        trial.step_started(st, cpu)
        trial.step_ended(1.0)
    assert st.decision == "1bit" and st.trial_until == 6
    assert st.decide_from is None  # a fit from step 0 tries at the end of warm-up: its warm-up steps are timed
    saved = st.state_dict()
    assert saved["trial_until"] == 6
    resumed = OneBitState(compression="auto", warmup_steps=2, recheck_every=0)
    resumed.trial_until = 5  # a live state's trial ends with the load: its step times are not in the checkpoint
    resumed.load_state_dict(saved, 1)
    resumed.step = 4
    assert resumed.decision is None and resumed.trial_until is None
    assert resumed.needs_decision and not resumed.compressing
    again = StepTrial()
    for step in range(4, 8):  # the resumed process's first step, then the 3 fp32 steps the trial compares with
        resumed.step = step
        assert again.step_started(resumed, cpu) is None
        again.step_ended(1.0)
        assert resumed.decision is None and resumed.trial_until is None and not resumed.needs_decision
    assert resumed.decide_from == 8
    resumed.step = 8
    assert resumed.needs_decision
    assert again.step_started(resumed, cpu) is None
    assert resumed.decision == "1bit" and resumed.trial_until == 8 + 3 + 1  # tried again, after steps of its own

    st.trial_until = None  # decided (what the trial's end leaves): the decision is kept
    kept = OneBitState(compression="auto", warmup_steps=2, recheck_every=0)
    kept.load_state_dict(st.state_dict(), 1)
    assert kept.decision == "1bit" and not kept.needs_decision
    old = {k: v for k, v in saved.items() if k != "trial_until"}  # written before `trial_until` was saved
    legacy = OneBitState(compression="auto", warmup_steps=2, recheck_every=0)
    legacy.load_state_dict(old, 1)
    assert legacy.decision == "1bit"


@pytest.mark.parametrize(
    ("flag", "new", "value"),
    [("compress", "compressed_signal", "gradients"), ("backend", "compressor_backend", "reference")],
)
def test_lightningcli_parses_the_deprecated_spelling(flag: str, new: str, value: str) -> None:
    """YAML written for the old names keeps working (with a DeprecationWarning) next to the defaults the CLI fills."""
    from pathlib import Path

    from lightning_accel.cli import AccelCLI

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "quickstart_ddp1bit.yaml"
    args = ["--config", str(config), "--trainer.logger=false", f"--trainer.strategy.init_args.{flag}={value}"]
    with pytest.warns(DeprecationWarning, match=f"`{flag}` is deprecated; use `{new}`"):
        cli = AccelCLI(args=args, run=False)
    assert getattr(cli.trainer.strategy.onebit_config, new) == value


def _run_overlap_trial(overlap_s: float, serial_s: float, fp32_steps: int = 2) -> tuple[list[bool], dict]:
    from lightning_accel.comm import OverlapTrial

    trial = OverlapTrial(steps=3)
    orders = []
    for step in range(fp32_steps + 14):
        compressing = step >= fp32_steps
        overlapped = trial.step_started(step, compressing, None, torch.device("cpu"))
        orders.append(overlapped)
        trial.step_ended((overlap_s if overlapped else serial_s) if compressing else 1.0)
    assert trial.decision is not None
    return orders, trial.decision


def test_overlap_trial_times_both_orders_then_keeps_the_faster() -> None:
    orders, decision = _run_overlap_trial(overlap_s=0.5, serial_s=0.4)
    # 2 fp32 steps, then 4 overlapped (the first builds the state, untimed), 4 serial (the first untimed), decided
    assert orders[2:10] == [True] * 4 + [False] * 4
    assert decision["step"] == 10 and not decision["overlap"]
    assert all(o is False for o in orders[10:])
    assert decision["overlap_s"] == pytest.approx(0.5) and decision["serial_s"] == pytest.approx(0.4)
    orders, decision = _run_overlap_trial(overlap_s=0.4, serial_s=0.5)
    assert decision["overlap"] and all(orders[10:])


def test_overlap_trial_keeps_overlap_on_a_near_tie_and_restarts_after_fp32_steps() -> None:
    from lightning_accel.comm import OverlapTrial

    _, decision = _run_overlap_trial(overlap_s=0.500, serial_s=0.495)  # 1 % faster: within the margin
    assert decision["overlap"]
    trial = OverlapTrial(steps=2)
    for step, compressing in enumerate([True, True, False, True, True, True, True, True, True, True]):
        trial.step_started(step, compressing, None, torch.device("cpu"))
        trial.step_ended(1.0)
    # the compressed run restarted at step 3 (a fp32 step interrupted the first one): decided at 3 + 2 * 3
    assert trial.decision is not None and trial.decision["step"] == 9


def test_overlap_trial_leaves_out_the_blocks_first_steps_refreshes_and_steps_that_never_ended() -> None:
    """Only the timed steps of each block enter its median: not a block's first step (it builds state), not a
    variance refresh (``timed=False``), not a step whose end was never reported (it raised); durations may be
    functions, resolved when the trial decides (CUDA event pairs)."""
    from lightning_accel.comm import OverlapTrial

    trial = OverlapTrial(steps=3)
    cpu = torch.device("cpu")
    # overlapped block: steps 0 (first, 9 s), 1 (refresh, 9 s), 2 and 3 (2 s, lazily); serial block: step 4 (first,
    # 9 s), 5 (raised: never ended), 6 and 7 (1 s)
    for step in range(8):
        trial.step_started(step, True, None, cpu, timed=step != 1)
        if step == 5:
            continue
        trial.step_ended((lambda: 2.0) if step in (2, 3) else 1.0 if step in (6, 7) else 9.0)
    assert trial.step_started(8, True, None, cpu) is False  # serial is faster
    assert trial.decision == {"step": 8, "overlap_s": 2.0, "serial_s": 1.0, "overlap": False}


def test_step_trial_times_each_step_from_its_start_to_its_end_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compression="auto"`` compares the steps' own durations: what passes between two steps (a data-bound
    epoch's wait for batches, a save) does not enter the trial."""
    import lightning_accel.comm.auto as auto
    from lightning_accel.comm import OneBitState, StepTiming, StepTrial
    from lightning_accel.perf import HostClock

    figures: list[tuple[float, float]] = []

    def decide(state: OneBitState, device: torch.device, **kw: object) -> str:  # rank 0's verdict, without a group
        t32, t1 = kw["timings"]  # type: ignore[misc]
        figures.append((t32, t1))
        state.set_decision("1bit" if t1 * (1 + auto.STEP_MARGIN) < t32 else "fp32")
        return str(state.decision)

    monkeypatch.setattr(auto, "decide", decide)

    now = [0.0]
    timing = StepTiming(HostClock(lambda: now[0]))
    st = OneBitState(compression="auto", warmup_steps=4, recheck_every=0)
    trial = StepTrial()
    for step in range(13):  # fp32 steps 0-3 (1 s each, 5 s waits for data between), the 1-bit trial 4-7 (0.8 s),
        # fp32 again 8-11, decided at 12
        st.step = step
        timing.begin()  # the optimizer step (automatic optimization) ...
        trial.step_started(st, torch.device("cpu"))
        timing.begin()  # ... runs the training step inside it: nested, not a second span
        now[0] += 0.8 if st.compressing else 1.0
        assert timing.end() is None
        span = timing.end()
        assert span == pytest.approx(0.8 if st.compressing else 1.0)
        trial.step_ended(span)
        now[0] += 5.0 if step < 4 or step > 8 else 0.0  # the loader's wait: outside every span
    assert figures == [pytest.approx((1.0, 0.8))] and st.decision == "1bit"
    assert timing.end() is None  # an unmatched end is ignored


def test_step_trial_times_the_mode_before_on_both_sides_of_the_tried_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that falls during the trial (a cold cache's workers decoding on the same cores, then done) weighs on
    both modes: the fp32 steps after the 1-bit ones count as much as those before."""
    import lightning_accel.comm.auto as auto
    from lightning_accel.comm import OneBitState, StepTrial

    figures: list[tuple[float, float]] = []

    def decide(state: OneBitState, device: torch.device, **kw: object) -> str:
        t32, t1 = kw["timings"]  # type: ignore[misc]
        figures.append((t32, t1))
        state.set_decision("1bit" if t1 * (1 + auto.STEP_MARGIN) < t32 else "fp32")
        return str(state.decision)

    monkeypatch.setattr(auto, "decide", decide)
    st = OneBitState(compression="auto", warmup_steps=4, recheck_every=0)
    trial = StepTrial()
    modes = []
    for step in range(14):
        st.step = step
        trial.step_started(st, torch.device("cpu"))
        modes.append(st.compressing)
        # fp32 steps take 2.0 s before the trial and 1.0 s after it (the load fell); a 1-bit step 1.5 s
        trial.step_ended(1.5 if st.compressing else (2.0 if step < 4 else 1.0))
    assert modes == [False] * 4 + [True] * 4 + [False] * 6
    # fp32: the median of 2, 2, 2, 1, 1, 1 against 1.5: not faster by the margin, so fp32 (the steps before alone
    # would have chosen 1-bit)
    assert figures == [pytest.approx((1.5, 1.5))] and st.decision == "fp32" and st.trial_until is None


@pytest.mark.parametrize("cls_name", ["OneBitDDPStrategy", "LocalStepsStrategy"])
def test_the_barrier_after_a_save_is_skipped_only_behind_a_background_writer(
    cls_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With an IO that writes in the background, the barrier that ends ``Trainer.save_checkpoint`` is skipped (the
    file is not there when it passes anyway); every other barrier, and that one with a synchronous IO, still runs."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_accel.strategies as strategies
    from lightning_accel.checkpoint import DeltaCheckpointIO

    calls: list[tuple] = []
    monkeypatch.setattr(DDPStrategy, "barrier", lambda self, *a, **k: calls.append(a))
    cases = [
        (DeltaCheckpointIO(async_save=True), True),
        (AsyncCheckpointIO(TorchCheckpointIO()), True),
        (DeltaCheckpointIO(), False),
        (TorchCheckpointIO(), False),
    ]
    for io, skipped in cases:
        strategy = getattr(strategies, cls_name)(checkpoint_io=io)
        calls.clear()
        strategy.barrier("Trainer.save_checkpoint")
        strategy.barrier(name="Trainer.save_checkpoint")
        strategy.barrier("pre_setup")
        strategy.barrier()
        expected = [("pre_setup",), ()] if skipped else [("Trainer.save_checkpoint",), (), ("pre_setup",), ()]
        assert calls == expected, (type(io).__name__, calls)


def _saved_onebit_state(mode: str, kinds: list[str] | None) -> dict:
    """A 1-bit state saved mid-stage (``kinds``: None, as saved before they were) holding one group's error state."""
    from lightning_accel.comm import OneBitState

    src = OneBitState(warmup_steps=2)
    src.step, src.mode, src.compressed_since = 6, mode, 2
    src.pending[(0, 1)] = (torch.ones(48), torch.ones(48))
    saved = src.state_dict()
    if kinds is None:
        saved.pop("kinds", None)
    else:
        saved["kinds"] = kinds
    return saved


@pytest.mark.parametrize(
    ("saved_mode", "saved_kinds", "signal", "optimizer", "reset"),
    [
        ("momentum", ["adam"], "gradients", "adamw", True),  # Adam's m / D residuals adopted as gradient residuals
        ("gradients", [], "auto", "adamw", True),
        ("momentum", ["sgd"], "auto", "adamw", True),  # SGD momentum units, not m / D
        ("momentum", None, "gradients", "adamw", True),  # saved before the kinds were: the mode is compared
        ("momentum", ["adam"], "auto", "adamw", False),
        ("momentum", None, "momentum", "adamw", False),
        ("gradients", [], "gradients", "sgdm", False),
    ],
)
def test_error_feedback_of_another_compressed_signal_is_reset_on_resume(
    saved_mode: str, saved_kinds: list[str] | None, signal: str, optimizer: str, reset: bool
) -> None:
    """The gradient path and the momentum path key their groups by the same parameter indices: resumed with another
    ``compressed_signal`` (or another momentum kind), the saved residuals are in other units and must be reset with
    the reset warning (and the stage ends), not adopted; the same signal keeps them, silently."""
    from lightning_accel.comm import OneBitDDPStrategy, OneBitState
    from tests.comm.test_momentum import make_optimizer

    strategy = OneBitDDPStrategy(warmup_steps=2, compressed_signal=signal)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    params = list(model.parameters())
    state = OneBitState(config=strategy.onebit_config, parameters=params)
    state.load_state_dict(_saved_onebit_state(saved_mode, saved_kinds), 1)
    assert list(state.pending) == [(0, 1)]
    strategy._onebit_state = state
    strategy.optimizers = [make_optimizer(optimizer, params)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy._resolve_compress()
    resets = [w for w in caught if "error state is reset to zero" in str(w.message)]
    assert state.mode == ("gradients" if signal == "gradients" else "momentum")
    if reset:
        assert not state.pending and not state.groups
        assert state.compressed_since is None  # the other path's stage ended with that fit
        assert len(resets) == 1 and f"compressing {saved_mode}" in str(resets[0].message)
    else:
        assert list(state.pending) == [(0, 1)] and state.compressed_since == 2
        assert not resets
    assert state.state_dict()["mode"] == state.mode


@pytest.mark.parametrize(
    ("fit", "continues"),
    [
        ({}, True),
        ({"compression": "fp32"}, False),
        ({"warmup_steps": 10}, False),  # the steps up to 10 update Adam's variance again
        ({"compression": "auto"}, True),  # the saved decision (1-bit) is adopted
    ],
)
def test_a_compressed_stage_continues_only_into_a_fit_that_compresses(fit: dict, continues: bool) -> None:
    """A stage loaded into a fit that does not compress from the loaded step on ends there: the stage that fit
    eventually begins freezes Adam's variance again, and its own checkpoints do not hand the old one on."""
    from lightning_accel.comm import OneBitState

    saved = _saved_onebit_state("momentum", ["adam"])
    saved["decision"] = "1bit"
    state = OneBitState(**{"warmup_steps": 2, "compressed_signal": "momentum", **fit})
    state.load_state_dict(saved, 1)
    assert state.compressed_since == (2 if continues else None)
    assert state.state_dict()["compressed_since"] == (2 if continues else None)
    undecided = {**saved, "trial_until": 8}  # saved during an "auto" trial: undecided, not compressing
    state = OneBitState(warmup_steps=2, compression="auto")
    state.load_state_dict(undecided, 1)
    assert state.decision is None and state.compressed_since is None


@pytest.mark.parametrize(
    ("fp32_ms", "onebit_ms", "decision"),
    [
        (62.8, 60.5, "fp32"),  # 1-bit 3.8 % faster: a trial's fit-to-fit noise, kept on the exact path
        (62.8, 59.0, "1bit"),  # 6.4 % faster: past the 5 % margin
        (62.8, 70.0, "fp32"),
    ],
)
def test_auto_takes_1bit_from_real_steps_only_when_5_percent_faster(
    one_process_group: None, fp32_ms: float, onebit_ms: float, decision: str
) -> None:
    """A 3 % margin let a trial that timed 1-bit 3.8 % faster by chance (the end-to-end CPU job) take it, and that
    fit then ran slower and needed an epoch more to its accuracy target."""
    from lightning_accel.comm import OneBitState
    from lightning_accel.comm.auto import decide

    state = OneBitState(compression="auto", warmup_steps=2, recheck_every=0)
    assert decide(state, torch.device("cpu"), timings=(fp32_ms / 1e3, onebit_ms / 1e3), step=10) == decision
    assert state.decisions[-1]["decision"] == decision
