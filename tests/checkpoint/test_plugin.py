"""DeltaCheckpointIO's constructor: keyword-only arguments that mirror StoreOptions' fields, validated there."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaStore, StoreOptions


def test_signature_mirrors_the_store_options() -> None:
    plugin = inspect.signature(DeltaCheckpointIO.__init__).parameters
    own = [
        p
        for p in plugin.values()
        if p.name
        not in (
            "self",
            "async_save",
            "max_pending",
            "write_delay_s",
            "on_save_error",
            "deferred_timeout_s",
            "storage_options",
            "gc_grace_s",
        )
    ]
    fields = dataclasses.fields(StoreOptions)
    assert [(p.name, p.default, str(p.annotation)) for p in own] == [(f.name, f.default, str(f.type)) for f in fields]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in plugin.values() if p.name != "self")
    assert plugin["storage_options"].default is None
    assert plugin["gc_grace_s"].default == inspect.signature(DeltaStore.__init__).parameters["gc_grace_s"].default


def test_the_store_takes_options_or_their_keywords_not_both() -> None:
    opts = StoreOptions(delta_ref="previous", max_chain=5)
    assert DeltaStore(options=opts).options is opts
    assert DeltaStore(delta_ref="previous", max_chain=5).options == opts
    assert DeltaStore(options=opts).max_chain == 5 and DeltaStore().max_chain == 2  # "base": base + one delta
    with pytest.raises(ValueError, match="either `options` or the option keywords"):
        DeltaStore(options=opts, zstd_level=5)
    with pytest.raises(TypeError, match="zstd_levle"):
        DeltaStore(zstd_levle=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.zstd_level = 9  # type: ignore[misc]
    assert StoreOptions(quantize="int8", quantize_groups=["state_dict/"]).quantize_groups == ("state_dict/",)
    assert StoreOptions(rebase_ratio=1).rebase_ratio == 1.0 and isinstance(StoreOptions().rebase_ratio, float)


def test_arguments_reach_the_store_and_are_validated_there() -> None:
    io = DeltaCheckpointIO(quantize="int8", delta_ref="previous", max_chain=3, io_threads=1, storage_options={"a": 1})
    s = io.store
    assert (s.quantize, s.delta_ref, s.max_chain, s.io_threads) == ("int8", "previous", 3, 1)
    assert s.fs.storage_options == {"a": 1}
    with pytest.raises(TypeError, match="`storage_options` must be a dict"):
        DeltaCheckpointIO(storage_options="anon")  # type: ignore[arg-type]
    # a key that is not a string failed only at the first save, inside fsspec ("keywords must be strings")
    with pytest.raises(TypeError, match=r"got a key 1 \(int\) in `storage_options\['client_kwargs'\]`"):
        DeltaCheckpointIO(storage_options={"client_kwargs": {1: "x"}})
    with pytest.raises(ValueError, match="`max_chain` must be an integer >= 1"):
        DeltaCheckpointIO(max_chain=0)
    with pytest.raises(TypeError):
        DeltaCheckpointIO(True)  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"on_save_error": "warn"},
        {"max_pending": 4},
        {"write_delay_s": 0.0},
        {"deferred_timeout_s": 60.0},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_an_async_only_argument_without_async_save_is_warned_in_init(kwargs: dict[str, object]) -> None:
    # `on_save_error="warn"` without `async_save` did nothing: a failed save still raised and stopped the run
    ((name, value),) = kwargs.items()
    with pytest.warns(UserWarning, match=rf"`{name}={value!r}` has no effect without `async_save=True`") as rec:
        DeltaCheckpointIO(**kwargs)  # type: ignore[arg-type]
    assert len(rec) == 1 and "\n" not in str(rec[0].message)


def test_the_defaults_and_async_save_warn_nothing() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DeltaCheckpointIO()  # LightningCLI passes every default explicitly: no warning for those
        DeltaCheckpointIO(async_save=False, max_pending=2, write_delay_s=0.05, on_save_error="raise")
        DeltaCheckpointIO(async_save=True, on_save_error="warn", max_pending=4, write_delay_s=0.0)
