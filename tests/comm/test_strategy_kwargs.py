"""DDP keywords that ``OneBitDDPStrategy`` and ``LocalStepsStrategy`` cannot honour are refused at construction, in one
line naming the argument and the fix; the DDP options they do honour reach ``DistributedDataParallel``."""

from __future__ import annotations

import pytest
import torch


def _strategies() -> list:
    from lightning_accel.strategies import LocalStepsStrategy, OneBitDDPStrategy

    return [OneBitDDPStrategy, LocalStepsStrategy]


@pytest.mark.parametrize("cls_index", [0, 1])
@pytest.mark.parametrize(
    "kwargs",
    [
        # DDP would average these parameters itself, with a plain fp32 allreduce outside the strategy's comm hook
        {"delay_all_reduce_named_params": [("w", torch.nn.Parameter(torch.zeros(2)))]},
        {"param_to_hook_all_reduce": torch.nn.Parameter(torch.zeros(2))},
    ],
)
def test_ddp_options_that_bypass_the_strategys_averaging_are_refused(cls_index: int, kwargs: dict) -> None:
    cls = _strategies()[cls_index]
    (name,) = kwargs
    with pytest.raises(ValueError, match=f"`{name}`") as info:
        cls(**kwargs)
    msg = str(info.value)
    assert "\n" not in msg and "Drop" in msg


@pytest.mark.parametrize("kwargs", [{"process_group": object()}, {"device_mesh": object()}])
def test_local_steps_refuse_a_ddp_process_group_they_would_not_average_over(kwargs: dict) -> None:
    from lightning_accel.strategies import LocalStepsStrategy

    (name,) = kwargs
    with pytest.raises(ValueError, match=f"`{name}`") as info:
        LocalStepsStrategy(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("cls_index", [0, 1])
def test_honoured_ddp_options_and_their_defaults_pass_through(cls_index: int) -> None:
    cls = _strategies()[cls_index]
    st = cls(
        gradient_as_bucket_view=True,
        static_graph=True,
        bucket_cap_mb=5,
        delay_all_reduce_named_params=None,  # DDP's defaults, as LightningCLI passes them: not an error
        param_to_hook_all_reduce=None,
        process_group=None,
        device_mesh=None,
    )
    kw = st._ddp_kwargs
    assert kw["gradient_as_bucket_view"] is True and kw["static_graph"] is True and kw["bucket_cap_mb"] == 5
    assert not {"delay_all_reduce_named_params", "param_to_hook_all_reduce", "process_group", "device_mesh"} & set(kw)


def test_processes_per_node_without_hierarchical_averaging_is_refused() -> None:
    """It only lays out the nodes of the hierarchical exchange: with ``hierarchical=False`` it would change nothing."""
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.raises(ValueError, match=r"^`processes_per_node=4` has no effect with `hierarchical=False`") as info:
        OneBitDDPStrategy(hierarchical=False, processes_per_node=4)
    assert "\n" not in str(info.value) and "Drop `processes_per_node`" in str(info.value)
    for hierarchical in ("auto", True):  # used there (a one-node job with `True` is refused when the fit sets up)
        OneBitDDPStrategy(hierarchical=hierarchical, processes_per_node=4)
    OneBitDDPStrategy(hierarchical=False)  # LightningCLI passes the default None: not an error


@pytest.mark.parametrize("cls_index", [0, 1])
@pytest.mark.parametrize(
    ("kwargs", "error", "expected"),
    [
        # a string or an int would be truthy for DDP (and for the strategy's own overlap checks): "no" meant True
        ({"find_unused_parameters": "no"}, TypeError, "True or False, got 'no' (str)"),
        ({"static_graph": 1}, TypeError, "True or False, got 1 (int)"),
        ({"gradient_as_bucket_view": "true"}, TypeError, "True or False, got 'true' (str)"),
        ({"broadcast_buffers": 1}, TypeError, "True or False, got 1 (int)"),
        # DDP multiplies it by 1024 * 1024 (a string would be repeated a million times, then fail to convert)
        ({"bucket_cap_mb": "25"}, TypeError, "a number >= 0 or None, got '25' (str)"),
        ({"bucket_cap_mb": -1}, ValueError, "a number >= 0 or None, got -1"),
        ({"bucket_cap_mb": float("nan")}, ValueError, "a number >= 0 or None, got nan"),
        # seconds given as a number: refused by torch only when the processes have started and the group is made
        ({"timeout": 30}, TypeError, "`timeout` must be a datetime.timedelta or None, got 30 (int)"),
        ({"start_method": "spwn"}, ValueError, "one of 'popen', 'spawn', 'fork', 'forkserver', got 'spwn'"),
        ({"process_group_backend": 3}, TypeError, "`process_group_backend` must be a string or None, got 3 (int)"),
    ],
)
def test_ddp_arguments_of_the_wrong_type_are_refused_at_construction(
    cls_index: int, kwargs: dict, error: type, expected: str
) -> None:
    cls = _strategies()[cls_index]
    (name,) = kwargs
    with pytest.raises(error) as info:
        cls(**kwargs)
    msg = str(info.value)
    assert msg.startswith(f"`{name}` must be ") and expected in msg and "\n" not in msg, msg


@pytest.mark.parametrize("cls_index", [0, 1])
def test_ddp_arguments_of_the_right_type_pass(cls_index: int) -> None:
    from datetime import timedelta

    cls = _strategies()[cls_index]
    st = cls(
        find_unused_parameters=False, broadcast_buffers=None, bucket_cap_mb=0.5, timeout=timedelta(seconds=60),
        start_method="spawn", process_group_backend="gloo",
    )  # fmt: skip
    assert st._timeout == timedelta(seconds=60) and st._process_group_backend == "gloo"
    cls(timeout=None, bucket_cap_mb=None)


@pytest.mark.parametrize("value", ["Auto", "", "10"])
def test_a_warmup_steps_string_other_than_auto_names_both_accepted_forms(value: str) -> None:
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.raises(TypeError, match=r"^`warmup_steps` must be an integer >= 2 or 'auto', got ") as info:
        OneBitDDPStrategy(warmup_steps=value)
    assert repr(value) in str(info.value) and "\n" not in str(info.value)


def test_a_numpy_auto_warmup_is_refused_like_any_numpy_value() -> None:
    import numpy as np

    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.raises(TypeError, match=r"^`warmup_steps` must be .*Pass a Python value"):
        OneBitDDPStrategy(warmup_steps=np.str_("auto"))


@pytest.mark.parametrize("compression", ["1bit", "fp32"])
def test_recheck_every_without_auto_compression_is_refused(compression: str) -> None:
    """Only ``compression="auto"`` measures again: kept, ``recheck_every`` would change nothing."""
    from lightning_accel.comm import OneBitConfig
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.raises(ValueError, match=r"^`recheck_every=5` has no effect with `compression=") as info:
        OneBitDDPStrategy(compression=compression, recheck_every=5)
    assert "\n" not in str(info.value) and "compression='auto'" in str(info.value)
    with pytest.raises(ValueError, match=r"^`recheck_every=5` has no effect"):
        OneBitConfig(compression=compression, recheck_every=5)
    OneBitDDPStrategy(compression=compression, recheck_every=0)  # the default: not an error
    OneBitDDPStrategy(compression="auto", recheck_every=5)


def test_local_steps_refuse_a_block_size_fp32_averaging_would_ignore() -> None:
    from lightning_accel.strategies import LocalStepsStrategy

    with pytest.raises(ValueError, match="`block_size=256` has no effect with `compression='fp32'`"):
        LocalStepsStrategy(compression="fp32", block_size=256)
    LocalStepsStrategy(compression="fp32")
