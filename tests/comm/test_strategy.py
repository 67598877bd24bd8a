"""``OneBitDDPStrategy`` construction and registration (no processes)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest


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
