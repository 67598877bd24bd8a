"""Arguments that would do nothing in the mode a strategy was built for are refused at construction, in one line
naming them (``compression="fp32"`` compresses nothing: no warm-up, scale blocks, error feedback, compressor or
variance refresh applies)."""

from __future__ import annotations

from typing import Any

import pytest

_INERT_WITH_FP32 = [
    {"warmup_steps": 5},
    {"block_size": 256},
    {"min_compress_numel": 1024},
    {"error_feedback": False},
    {"compressor_backend": "reference"},
    {"compressed_signal": "gradients"},
    {"group_numel": 1 << 10},
    {"variance_refresh": 0},
    {"hierarchical": True},
    {"processes_per_node": 2},
]


@pytest.mark.parametrize("kwargs", _INERT_WITH_FP32, ids=lambda k: next(iter(k)))
def test_a_compression_argument_with_fp32_is_refused(kwargs: dict[str, Any]) -> None:
    from lightning_accel.strategies import OneBitDDPStrategy

    ((name, value),) = kwargs.items()
    with pytest.raises(ValueError, match="has no effect with `compression='fp32'`") as info:
        OneBitDDPStrategy(compression="fp32", **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and f"`{name}={value!r}`" in msg and f"Drop `{name}`" in msg
    OneBitDDPStrategy(compression="1bit", **kwargs)  # the same argument does something when compressing


def test_every_inert_argument_is_named_at_once() -> None:
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.raises(ValueError) as info:
        OneBitDDPStrategy(compression="fp32", block_size=256, error_feedback=False)
    msg = str(info.value)
    assert "`block_size=256`" in msg and "`error_feedback=False`" in msg and "\n" not in msg


def test_fp32_with_every_default_is_accepted() -> None:
    """LightningCLI passes every argument with its default: that is not asking for anything."""
    import inspect

    from lightning_accel.strategies import OneBitDDPStrategy

    defaults = {
        k: p.default
        for k, p in inspect.signature(OneBitDDPStrategy.__init__).parameters.items()
        if p.kind is p.KEYWORD_ONLY and k not in ("compression", "compress", "backend")
    }
    s = OneBitDDPStrategy(compression="fp32", **defaults)
    assert s.onebit_config.compression == "fp32"


def test_a_deprecated_name_with_fp32_is_refused_under_its_new_name() -> None:
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="`compressed_signal='gradients'`"):
        OneBitDDPStrategy(compression="fp32", compress="gradients")


def test_diloco_nesterov_without_outer_momentum_is_refused() -> None:
    """Without outer momentum the outer step is ``outer_lr`` times the average either way: ``nesterov=False`` asked
    for beside it would do nothing (the default ``True`` passes, as LightningCLI fills it in)."""
    from lightning_accel.comm import LocalStepsConfig
    from lightning_accel.strategies import LocalStepsStrategy

    with pytest.raises(ValueError, match=r"^`nesterov=False` has no effect with `outer_momentum=0.0`") as info:
        LocalStepsStrategy(nesterov=False)
    msg = str(info.value)
    assert "\n" not in msg and "Drop `nesterov`" in msg
    LocalStepsStrategy(nesterov=True)
    assert LocalStepsConfig(nesterov=False, outer_momentum=0.9).nesterov is False


@pytest.mark.parametrize(
    ("kwargs", "given", "signal"),
    [
        ({"variance_refresh": 4}, "`variance_refresh=4`", "gradients"),
        ({"variance_refresh": 0}, "`variance_refresh=0`", "gradients"),
        ({"group_numel": 1 << 10}, "`group_numel=1024`", "gradients"),
        ({"min_compress_numel": 1024}, "`min_compress_numel=1024`", "momentum"),
    ],
)
def test_an_argument_of_the_other_signal_is_refused(kwargs: dict[str, Any], given: str, signal: str) -> None:
    """``variance_refresh`` refreshes compressed Adam momentum, ``group_numel`` sizes its groups, ``min_compress_numel``
    sizes gradient buckets: named beside the other ``compressed_signal``, each would do nothing."""
    from lightning_accel.strategies import OneBitDDPStrategy

    with pytest.raises(ValueError, match=f"has no effect with `compressed_signal='{signal}'`") as info:
        OneBitDDPStrategy(compressed_signal=signal, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and given in msg
    OneBitDDPStrategy(compressed_signal="auto", **kwargs)  # the optimizers decide: checked when the fit sets up
