"""The comm hook under real DDP (2 gloo processes) against the single-process oracle."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn as nn

from lightning_accel.comm import GroupLayout, OneBitState, fp32_ring_bytes, onebit_hook
from tests.comm._oracle import Params, Simulation

SIZES = [(10,), (37, 29), (5,), (7, 13), (300,)]  # odd sizes: padding inside and between parameters
WARMUP = 2
STEPS = 6
NAN_STEP = 4
ZERO_PARAM = 2  # its gradient is exactly zero on every rank and step


def coefficients(rank: int, step: int, nan: bool) -> list[torch.Tensor]:
    """The gradients rank ``rank`` produces at ``step`` (d loss / d p = c)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    cs = [torch.randn(*s, generator=g) * (1 + rank) for s in SIZES]
    cs[ZERO_PARAM].zero_()
    if nan and step == NAN_STEP and rank == 1:
        cs[1][3, 4] = float("nan")
    return cs


def _run(
    rank: int, world: int, nan: bool, bucket_cap_mb: float, loss_scales: list[float] | None, min_numel: int = 0
) -> dict:
    torch.manual_seed(0)
    model = Params(SIZES)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    scale = {"s": 1.0}
    state = OneBitState(
        warmup_steps=WARMUP,
        block_size=64,
        min_compress_numel=min_numel,
        parameters=model.parameters(),
        loss_scale_fn=(lambda: scale["s"]) if loss_scales else None,
    )
    ddp.register_comm_hook(state, onebit_hook)
    grads, errors = [], []
    for step in range(STEPS):
        s = loss_scales[step] if loss_scales else 1.0
        scale["s"] = s
        ddp.zero_grad(set_to_none=True)
        ddp([c * s for c in coefficients(rank, step, nan)]).backward()
        grads.append([(p.grad.detach() / s).numpy() for p in model.ps])
        errors.append(
            {k: (g.worker_error.numpy().copy(), g.server_error.numpy().copy()) for k, g in state.groups.items()}
        )
    hook_name = ddp._get_ddp_logging_data().get("comm_hook")
    worker = state.comm_worker is not None and state.comm_worker._thread.is_alive()
    state.close()
    threads = [t.name for t in threading.enumerate()]
    return {
        "worker": worker,
        "worker_after_close": "lightning-accel-1bit" in threads,
        "grads": grads,
        "errors": errors,
        "keys": sorted(state.groups),
        "hook": hook_name,
        "nonfinite": state.stats.nonfinite_groups,
        "step": state.step,
        "ratio": state.stats.compression_ratio,
        "compressed": state.stats.compressed_calls,
    }


def _t(results: list[dict]) -> list[dict]:
    """numpy (what the processes can return) -> tensors."""
    for r in results:
        r["grads"] = [[torch.from_numpy(a) for a in step] for step in r["grads"]]
        r["errors"] = [{k: tuple(map(torch.from_numpy, v)) for k, v in e.items()} for e in r["errors"]]
    return results


def _oracle(keys: list[tuple[int, ...]], nan: bool) -> list[list[torch.Tensor]]:
    """Expected averaged gradients per step (model parameter order)."""
    sims = {k: Simulation([math.prod(SIZES[i]) for i in k], 2, 64) for k in keys}
    out = []
    for step in range(STEPS):
        cs = [coefficients(r, step, nan) for r in range(2)]
        if step < WARMUP:
            out.append([(cs[0][i] + cs[1][i]) / 2 for i in range(len(SIZES))])
            continue
        got: list[torch.Tensor | None] = [None] * len(SIZES)
        for k, sim in sims.items():
            avg = sim.step([[cs[r][i] for i in k] for r in range(2)])
            for i, a in zip(k, avg, strict=True):
                got[i] = a.reshape(SIZES[i])
        out.append(got)
    return out


SCENARIOS = {
    "one-bucket": (False, 25.0, None),
    "several-buckets": (False, 0.002, None),
    "nan": (True, 25.0, None),
    "scaled": (False, 25.0, [1.0, 2.0, 1024.0, 1024.0, 256.0, 65536.0]),
    "small-buckets-fp32": (False, 0.002, None, 10**6),
}


def _run_all(rank: int, world: int) -> dict:
    # one pair of processes for every scenario: spawning costs ~5 s each on a busy 2-core machine
    return {name: _run(rank, world, *args) for name, args in SCENARIOS.items()}


@pytest.fixture(scope="module")
def runs(ddp_pair_results: list[dict]) -> dict[str, list[dict]]:
    per_rank = [r["hook"] for r in ddp_pair_results]  # launched with test_momentum's scenarios (conftest.py)
    return {name: _t([per_rank[0][name], per_rank[1][name]]) for name in SCENARIOS}


@pytest.mark.parametrize("scenario", ["one-bucket", "several-buckets"])
def test_hook_matches_oracle_and_replicas_agree(runs: dict, scenario: str) -> None:
    r0, r1 = runs[scenario]
    assert r0["hook"] and "onebit_hook" in r0["hook"]
    assert r0["keys"] == r1["keys"]
    if scenario == "several-buckets":
        assert len(r0["keys"]) > 1
    assert r0["step"] == STEPS and r0["compressed"] == (STEPS - WARMUP) * len(r0["keys"])
    # the compressed buckets ran in the comm thread (CPU), which close() stopped
    assert r0["worker"] and r1["worker"] and not r0["worker_after_close"]
    expected = _oracle(r0["keys"], nan=False)
    for step in range(STEPS):
        for i in range(len(SIZES)):
            assert torch.equal(r0["grads"][step][i], r1["grads"][step][i]), "replicas must be bit-identical"
            torch.testing.assert_close(r0["grads"][step][i], expected[step][i], atol=1e-6, rtol=1e-6)
    # compressed steps really are 1-bit: the averaged gradient takes few distinct values per block
    assert r0["grads"][-1][4].unique().numel() <= 2 * math.ceil(300 / 64) + 2
    # the all-zero parameter decodes to exact zeros, never to ±scale
    assert all(torch.count_nonzero(r0["grads"][s][ZERO_PARAM]) == 0 for s in range(STEPS))
    # bytes are counted from the tensors handed to the collectives: 2 (N-1) rows of C/8 signs + 4 M scale bytes
    layouts = [GroupLayout([math.prod(SIZES[i]) for i in k], 2, 64, torch.device("cpu")) for k in r0["keys"]]
    fp32 = sum(fp32_ring_bytes(lay.numel, 2) for lay in layouts)
    assert r0["ratio"] == pytest.approx(fp32 / sum(2 * lay.message_bytes for lay in layouts))


def test_nan_step_decodes_nonfinite_and_keeps_error_state(runs: dict) -> None:
    r0, r1 = runs["nan"]
    nan_grads = r0["grads"][NAN_STEP]
    assert not torch.isfinite(nan_grads[1]).all(), "a NaN on one rank must reach every rank's result"
    assert not torch.isfinite(r1["grads"][NAN_STEP][1]).all()
    assert r0["nonfinite"] == 1 == r1["nonfinite"]
    for r in (r0, r1):
        before, after = r["errors"][NAN_STEP - 1], r["errors"][NAN_STEP]
        for k in before:
            assert torch.equal(before[k][0], after[k][0]) and torch.equal(before[k][1], after[k][1])
    # the next steps are finite again and continue as if the NaN step had not touched the state
    expected = _oracle(r0["keys"], nan=True)
    for step in range(NAN_STEP + 1, STEPS):
        for i in range(len(SIZES)):
            assert torch.isfinite(r0["grads"][step][i]).all()
            torch.testing.assert_close(r0["grads"][step][i], expected[step][i], atol=1e-6, rtol=1e-6)


def test_loss_scale_changes_keep_error_state_consistent(runs: dict) -> None:
    """Gradients carrying a changing (power-of-two) loss scale give exactly the scale times the unscaled result."""
    scaled, plain = runs["scaled"][0], runs["one-bucket"][0]
    for step in range(STEPS):
        for a, b in zip(scaled["grads"][step], plain["grads"][step], strict=True):
            assert torch.equal(a, b)


def test_buckets_below_min_compress_numel_stay_fp32(runs: dict) -> None:
    r0, _ = runs["small-buckets-fp32"]
    assert r0["compressed"] == 0 and r0["keys"] == []
    for step in range(STEPS):
        cs = [coefficients(r, step, False) for r in range(2)]
        for i in range(len(SIZES)):
            torch.testing.assert_close(r0["grads"][step][i], (cs[0][i] + cs[1][i]) / 2)
