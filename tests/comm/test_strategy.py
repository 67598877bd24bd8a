"""``OneBitDDPStrategy`` construction and registration (no processes)."""

from __future__ import annotations

import pytest


def test_registered_on_import() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_accel  # noqa: F401
    from lightning_accel.strategies import OneBitDDPStrategy

    assert "ddp_1bit" in StrategyRegistry
    st = StrategyRegistry.get("ddp_1bit")
    assert isinstance(st, OneBitDDPStrategy)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"warmup_steps": -3}, "warmup_steps"),
        ({"warmup_steps": 1}, "warmup_steps"),
        ({"block_size": 7}, "block_size"),
        ({"log_stats": "no"}, "log_stats"),
        ({"find_unused_paramters": True}, "find_unused_paramters"),
        ({"ddp_comm_hook": print}, "ddp_comm_hook"),
        ({"compress": "adam"}, "compress"),
        ({"compression": "int8"}, "compression"),
        ({"recheck_every": -1}, "recheck_every"),
        ({"group_numel": 0}, "group_numel"),
        ({"overlap": "yes"}, "overlap"),
        ({"overlap": 1}, "overlap"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.raises(ValueError, match=f"`{name}`"):
        OneBitDDPStrategy(**kwargs)


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
    assert st._onebit_config["warmup_steps"] == 4


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
    assert st._onebit_config["warmup_steps"] == 20 and st._ddp_kwargs == {}
    assert cli.trainer.num_devices == 2


@pytest.mark.parametrize("steps", [0, True, 2.5])
def test_step_trial_refuses_bad_step_counts(steps: object) -> None:
    from lightning_accel.comm import StepTrial

    with pytest.raises(ValueError, match="`steps`"):
        StepTrial(steps=steps)  # type: ignore[arg-type]
