"""``sync_buffers`` of the local-steps core on 3 gloo processes (a world size that is not a power of two: the average
of identical fp32 values, ``(a + a + a) / 3``, is not always ``a``): the buffers that changed since the last sync are
averaged in their own precision, the ones no rank changed (a registered constant mask, a float64 table) keep their
exact values and do not travel, and integer buffers (BatchNorm's ``num_batches_tracked``) are left alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_accel.comm.allreduce import fp32_ring_bytes
from lightning_accel.comm.localsteps import LocalSteps, LocalStepsConfig
from tests.helpers import run_in_processes

WORLD = 3
SYNCS = 4


def _buffers(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)  # the same constants on every rank
    return {
        "mask": torch.rand(1000, generator=g),  # fp32, never changed
        "table64": torch.rand(64, generator=g, dtype=torch.float64),  # fp64, never changed
        "count": torch.tensor(7, dtype=torch.int64),  # an integer buffer
        "stat": torch.zeros(16),  # fp32, changed on every rank between syncs (a BatchNorm statistic)
        "stat64": torch.zeros(4, dtype=torch.float64),  # fp64, changed between syncs
        "half": torch.zeros(4, dtype=torch.float16),  # half, changed between syncs
    }


def _run(rank: int, world: int, names: tuple[str, ...]) -> dict:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(32))
    bufs = {k: v for k, v in _buffers(rank).items() if k in names}
    original = {k: v.clone() for k, v in bufs.items()}
    cfg = LocalStepsConfig(sync_every=1, compression="fp32", overlap_steps=0)
    local = LocalSteps([param], cfg, buffers=list(bufs.values()))
    changing = [k for k in ("stat", "stat64", "half") if k in bufs]
    errors = dict.fromkeys(changing, 0.0)  # the largest distance from the exact average, over the syncs
    for step in range(SYNCS):
        with torch.no_grad():
            param.add_(0.01 * (rank + 1))
            for k in changing:
                # a value that differs per rank (and, in float64, beyond fp32's precision)
                bufs[k].add_(0.1 * (rank + 1) + 1e-12 * step)
        before = {k: bufs[k].clone() for k in changing}
        local.step()
        for k, b in before.items():
            gathered = [torch.empty_like(b) for _ in range(world)]
            torch.distributed.all_gather(gathered, b)
            exact = torch.stack([x.double() for x in gathered]).mean(0)
            errors[k] = max(errors[k], float((bufs[k].double() - exact).abs().max()))
    return {
        "errors": errors,
        "bytes": local.bytes_sent,
        "unchanged": {k: bool(torch.equal(bufs[k], original[k])) for k in ("mask", "table64", "count") if k in bufs},
        "values": {k: v.numpy().copy() for k, v in bufs.items()},  # numpy: torch tensors would travel as shared memory
    }


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    every = ("mask", "table64", "count", "stat", "stat64", "half")
    changing = ("stat", "stat64", "half")
    out = run_in_processes(_both, WORLD, args=(every, changing), timeout=180)
    return {"every": [r["every"] for r in out], "changing": [r["changing"] for r in out]}


def _both(rank: int, world: int, every: tuple[str, ...], changing: tuple[str, ...]) -> dict:
    return {"every": _run(rank, world, every), "changing": _run(rank, world, changing)}


def test_constant_and_integer_buffers_keep_their_exact_values(results: dict[str, list[dict]]) -> None:
    for r in results["every"]:
        assert r["unchanged"] == {"mask": True, "table64": True, "count": True}


def test_changed_buffers_are_averaged_in_their_own_precision_and_identical_on_every_rank(
    results: dict[str, list[dict]],
) -> None:
    ranks = results["every"]
    # float64 to its own precision (not fp32's, ~1e-8 here), fp32 to fp32's, half to half's
    tolerance = {"stat64": 1e-15, "stat": 1e-6, "half": 1e-3}
    for k, tol in tolerance.items():
        assert ranks[0]["errors"][k] <= tol, (k, ranks[0]["errors"][k])
    for k in ("stat", "stat64", "half"):
        assert ranks[0]["values"][k].dtype == _buffers(0)[k].numpy().dtype
        for r in ranks[1:]:
            np.testing.assert_array_equal(r["values"][k], ranks[0]["values"][k])


def test_only_the_buffers_that_changed_travel(results: dict[str, list[dict]]) -> None:
    # the two constant floating-point buffers add their flags alone (4 bytes each, per sync; the integer one has
    # none) to what the changing ones cost: less than the smallest of them (64 values) would cost once
    extra = results["every"][0]["bytes"] - results["changing"][0]["bytes"]
    assert 0 < extra == SYNCS * (fp32_ring_bytes(5, WORLD) - fp32_ring_bytes(3, WORLD)) < fp32_ring_bytes(64, WORLD)
