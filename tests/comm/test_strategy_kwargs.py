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
