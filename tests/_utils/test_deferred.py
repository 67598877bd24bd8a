from __future__ import annotations

import threading

import pytest
import torch

from lightning_accel._utils.deferred import Deferred, resolve_deferred, resolves_deferred


def test_a_deferred_value_is_produced_once_whoever_asks() -> None:
    calls = []
    d = Deferred(lambda: calls.append(threading.get_ident()) or 7)
    threads = [threading.Thread(target=d.result) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert d.result() == 7 and len(calls) == 1


def test_a_failed_production_raises_its_error_to_every_caller() -> None:
    def fail() -> int:
        raise RuntimeError("the collective failed")

    d = Deferred(fail)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the collective failed"):
            d.result()


def test_resolving_replaces_deferred_values_and_leaves_the_rest_alone() -> None:
    t = torch.ones(2)
    untouched = {"w": t, "list": [1, (2, 3)]}
    tree = {
        "model": untouched,
        "state": Deferred(lambda: {"err": Deferred(lambda: torch.zeros(3))}),
        "l": [Deferred(lambda: 5)],
    }
    out = resolve_deferred(tree)
    assert out["model"] is untouched and out["model"]["w"] is t  # nothing to resolve: not copied
    assert torch.equal(out["state"]["err"], torch.zeros(3)) and out["l"] == [5]
    assert isinstance(tree["state"], Deferred)  # the tree given is not changed


def test_only_a_writer_that_says_so_gets_deferred_values() -> None:
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_accel.checkpoint import DeltaCheckpointIO

    assert resolves_deferred(DeltaCheckpointIO(async_save=True))
    assert not resolves_deferred(DeltaCheckpointIO()) and not resolves_deferred(TorchCheckpointIO())
    assert not resolves_deferred(None)
