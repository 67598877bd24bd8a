"""DeltaCheckpointIO's constructor: keyword-only arguments that mirror DeltaStore's, validated by the store."""

from __future__ import annotations

import inspect

import pytest

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaStore


def test_signature_mirrors_the_store() -> None:
    plugin = inspect.signature(DeltaCheckpointIO.__init__).parameters
    store = inspect.signature(DeltaStore.__init__).parameters
    own = [p for p in plugin.values() if p.name not in ("self", "async_save", "max_pending")]
    forwarded = [p for p in store.values() if p.name != "self"]
    assert [(p.name, p.default, str(p.annotation)) for p in own] == [
        (p.name, p.default, str(p.annotation)) for p in forwarded
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in [*own, plugin["async_save"]])


def test_arguments_reach_the_store_and_are_validated_there() -> None:
    io = DeltaCheckpointIO(quantize="int8", delta_ref="previous", max_chain=3, io_threads=1, storage_options={"a": 1})
    s = io.store
    assert (s.quantize, s.delta_ref, s.max_chain, s.io_threads) == ("int8", "previous", 3, 1)
    assert s.fs.storage_options == {"a": 1}
    with pytest.raises(TypeError, match="`storage_options` must be a dict"):
        DeltaCheckpointIO(storage_options="anon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`max_chain` must be an integer >= 1"):
        DeltaCheckpointIO(max_chain=0)
    with pytest.raises(TypeError):
        DeltaCheckpointIO(True)  # type: ignore[misc]
