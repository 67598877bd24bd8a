"""Compressed momentum under real DDP (2 gloo processes) against a single-process simulation of the same math.

The simulation is written from the algorithm in ``lightning_accel/comm/momentum.py`` (numbered steps), per parameter
and per rank, with the loop-by-loop 1-bit allreduce of ``_oracle.py``; only the block table is shared.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from lightning_accel.comm import MomentumCompressor, OneBitState, onebit_hook, plan_groups
from tests.comm._oracle import Params, Simulation

SIZES = [(10,), (37, 29), (5,), (7, 13), (300,)]
WARMUP = 3
STEPS = 9
GROUP_NUMEL = 400  # several groups: the pipeline keeps up to three in flight
SKIP_AT = WARMUP + 2  # a compressed step whose backward ran but whose optimizer step did not
BLOCK = 64
LR = 0.05
REFRESH = 2  # variance_refresh: fp32 refresh steps at n = 2, 6 into the compressed stage (steps WARMUP + 2, + 6)
REFRESH_STEPS = 12


def coefficients(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(*s, generator=g) * (1 + rank) for s in SIZES]


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Two parameter groups with their own lr / weight decay."""
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": LR / 2, "weight_decay": 0.05}]
    if name == "sgdm":
        return torch.optim.SGD(groups, lr=LR, momentum=0.9, weight_decay=0.01)
    if name == "nesterov":
        return torch.optim.SGD(groups, lr=LR, momentum=0.9, nesterov=True)
    if name == "adam":
        return torch.optim.Adam(groups, lr=1e-2, weight_decay=0.01)
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)


OPTIMIZERS = ("sgdm", "nesterov", "adam", "adamw")


def _run(rank: int, world: int, name: str, overlap: bool = False, skip_at: int | None = None, refresh: int = 0) -> dict:
    """``overlap``: small buckets, and the hook hands each to the compressor during backward (groups start there);
    ``skip_at``: that step's backward runs but its optimizer step does not (the started groups must be dropped);
    ``refresh``: ``variance_refresh``, driven as the strategy drives it (``state.refreshing`` before backward)."""
    torch.manual_seed(0)
    model = Params(SIZES)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001 if overlap else None)
    state = OneBitState(
        warmup_steps=WARMUP,
        block_size=BLOCK,
        compressed_signal="momentum",
        group_numel=GROUP_NUMEL,
        variance_refresh=refresh,
        parameters=model.parameters(),
    )
    state.mode = "momentum"
    ddp.register_comm_hook(state, onebit_hook)
    opt = make_optimizer(name, list(model.parameters()))
    comp = MomentumCompressor(opt, state)
    params, local, started, refreshed = [], [], [], []
    for step in range(REFRESH_STEPS if refresh else STEPS):
        opt.zero_grad(set_to_none=True)
        state.refreshing = state.refresh_due
        refreshed.append(state.refreshing)
        state.bucket_fn = comp.on_bucket if overlap else None
        ddp(coefficients(rank, step)).backward()
        state.bucket_fn = None
        local.append(state.local_grads)
        started.append(len(comp._early.started) if comp._early is not None else 0)
        if step == skip_at:
            pass
        elif state.local_grads:
            comp.compressed_step()
        elif state.refreshing:
            comp.refresh_step()
        else:
            opt.step()
        state.refreshing = False
        params.append([p.detach().clone().numpy() for p in model.parameters()])
    return {
        "params": params,
        "local": local,
        "refreshed": refreshed,
        "started": started,
        "keys": sorted(state.groups),
        "compressed": state.stats.compressed_calls,
        "bytes": state.stats.last_step.sent,
        "fp32": state.stats.last_step.fp32,
    }


def _run_all(rank: int, world: int) -> dict:
    out = {name: _run(rank, world, name) for name in OPTIMIZERS}
    for name in OPTIMIZERS:
        out[f"{name}/overlap"] = _run(rank, world, name, overlap=True)
        out[f"{name}/skip"] = _run(rank, world, name, overlap=True, skip_at=SKIP_AT)
    for name in ("adam", "adamw"):
        out[f"{name}/refresh"] = _run(rank, world, name, refresh=REFRESH)
    return out


def _denom(opt: torch.optim.Optimizer, p: nn.Parameter, freeze: int) -> torch.Tensor:
    g = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    return (opt.state[p]["exp_avg_sq"] / (1 - g["betas"][1] ** freeze)).sqrt() + g["eps"]


def _refresh(name: str, params: list[nn.Parameter], opt: torch.optim.Optimizer, avg: list[torch.Tensor]) -> dict:
    """The documented refresh step on the averaged gradient: Adam with the variance catching up on the ``k`` steps it
    was frozen, ``v = β2^k v + (1-β2^k) d²``; returns the new freeze step per parameter index."""
    hp = {id(p): g for g in opt.param_groups for p in g["params"]}
    new = {}
    for i, p in enumerate(params):
        g, s = hp[id(p)], opt.state[p]
        s["step"] += 1
        t = int(s["step"])
        b1, b2 = g["betas"]
        d = avg[i] + g["weight_decay"] * p if name == "adam" else avg[i]
        keep = b2 ** (t - s["freeze"])
        s["exp_avg"] = b1 * s["exp_avg"] + (1 - b1) * d
        s["exp_avg_sq"] = keep * s["exp_avg_sq"] + (1 - keep) * d * d
        if name == "adamw":
            p *= 1 - g["lr"] * g["weight_decay"]
        p -= g["lr"] / (1 - b1**t) * s["exp_avg"] / ((s["exp_avg_sq"] / (1 - b2**t)).sqrt() + g["eps"])
        new[i] = t
    return new


def simulate(name: str, skip_at: int | None = None, refresh: int = 0) -> list[list[torch.Tensor]]:
    """The expected parameters after every step: torch's optimizer on the average during warm-up, then steps 2-5
    (``skip_at``: a step that changes nothing; ``refresh``: the refresh steps ``R, 3R, ...`` into the compressed
    stage, after which each error-feedback residual is rescaled by ``D_old / D_new``)."""
    torch.manual_seed(0)
    model = Params(SIZES)
    params = list(model.parameters())
    opt = make_optimizer(name, params)
    hp = {id(p): g for g in opt.param_groups for p in g["params"]}
    keys = plan_groups([(i, p.numel()) for i, p in enumerate(params)], GROUP_NUMEL)
    sims = {k: Simulation([params[i].numel() for i in k], 2, BLOCK) for k in keys}
    out = []
    freeze: dict[int, int] = {}
    refresh_at = {WARMUP + refresh * (2**j - 1) for j in range(1, 6)} if refresh else set()
    for step in range(REFRESH_STEPS if refresh else STEPS):
        cs = [coefficients(r, step) for r in range(2)]
        if step in refresh_at:
            with torch.no_grad():
                old = {i: _denom(opt, params[i], freeze[i]) for i in freeze}
                for i in freeze:
                    opt.state[params[i]]["freeze"] = freeze[i]
                freeze.update(_refresh(name, params, opt, [(a + b) / 2 for a, b in zip(cs[0], cs[1], strict=True)]))
                for k, sim in sims.items():
                    ratio = sim.canon([old[i] / _denom(opt, params[i], freeze[i]) for i in k])
                    ratio[~sim.layout.table.mask] = 1.0
                    c = sim.layout.chunk_numel
                    sim.e_w = [e * ratio for e in sim.e_w]
                    sim.e_s = [e * ratio[r * c : (r + 1) * c] for r, e in enumerate(sim.e_s)]
            out.append([p.detach().clone() for p in params])
            continue
        if step == skip_at:
            out.append([p.detach().clone() for p in params])
            continue
        if step < WARMUP:
            for i, p in enumerate(params):
                p.grad = (cs[0][i] + cs[1][i]) / 2
            opt.step()
            out.append([p.detach().clone() for p in params])
            continue
        with torch.no_grad():
            for k, sim in sims.items():
                denoms = {}
                if name in ("adam", "adamw"):
                    for i in k:
                        g, s = hp[id(params[i])], opt.state[params[i]]
                        freeze.setdefault(i, int(s["step"]))
                        s["step"] += 1
                        b2 = g["betas"][1]
                        denoms[i] = (s["exp_avg_sq"] / (1 - b2 ** freeze[i])).sqrt() + g["eps"]
                local = []
                for r in range(2):
                    ms = []
                    for i in k:
                        p, g, s = params[i], hp[id(params[i])], opt.state[params[i]]
                        d = cs[r][i].clone()
                        if name in ("sgdm", "nesterov"):
                            d = d + g["weight_decay"] * p
                            ms.append(g["momentum"] * s["momentum_buffer"] + d)
                        else:
                            if name == "adam":
                                d = d + g["weight_decay"] * p
                            b1, t = g["betas"][0], int(s["step"])
                            u = (b1 * s["exp_avg"] + (1 - b1) * d) / denoms[i]  # the preconditioned momentum
                            ms.append(u.clamp(-(1 - b1**t), 1 - b1**t))  # |m_hat / D| <= 1
                    local.append(ms)
                avg = sim.step(local)
                for i, m in zip(k, avg, strict=True):
                    p, g, s = params[i], hp[id(params[i])], opt.state[params[i]]
                    m = m.reshape(p.shape)
                    if name == "sgdm":
                        s["momentum_buffer"] = m.clone()
                        p -= g["lr"] * m
                    elif name == "nesterov":
                        upd = (1 + g["momentum"]) * m - g["momentum"] * s["momentum_buffer"]
                        s["momentum_buffer"] = m.clone()
                        p -= g["lr"] * upd
                    else:
                        b1, t = g["betas"][0], int(s["step"])
                        s["exp_avg"] = m * denoms[i]
                        if name == "adamw":
                            p *= 1 - g["lr"] * g["weight_decay"]
                        p -= g["lr"] / (1 - b1**t) * m
        out.append([p.detach().clone() for p in params])
    return out


@pytest.fixture(scope="module")
def runs(ddp_pair_results: list[dict]) -> dict[str, list[dict]]:
    per_rank = [r["momentum"] for r in ddp_pair_results]  # launched with test_hook's scenarios (conftest.py)
    return {name: [per_rank[0][name], per_rank[1][name]] for name in per_rank[0]}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_momentum_path_matches_simulation_and_replicas_are_identical(runs: dict, name: str) -> None:
    r0, r1 = runs[name]
    assert r0["local"] == [False] * WARMUP + [True] * (STEPS - WARMUP), "no gradient allreduce after warm-up"
    assert len(r0["keys"]) > 2, "several groups: the pipeline is exercised"
    assert r0["compressed"] == (STEPS - WARMUP) * len(r0["keys"])
    assert r0["fp32"] / r0["bytes"] > 10
    expected = simulate(name)
    for step in range(STEPS):
        for i in range(len(SIZES)):
            a, b = torch.from_numpy(r0["params"][step][i]), torch.from_numpy(r1["params"][step][i])
            assert torch.equal(a, b), f"replicas differ at step {step}, parameter {i}"
            torch.testing.assert_close(a, expected[step][i], atol=2e-5, rtol=1e-5)
    # the compressed steps moved the parameters (not a no-op)
    last = [torch.from_numpy(a) for a in r0["params"][-1]]
    assert all(not torch.equal(x, y) for x, y in zip(last, expected[WARMUP - 1], strict=True))
    assert math.isfinite(float(sum(x.sum() for x in last)))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_groups_started_during_backward_give_identical_results(runs: dict, name: str) -> None:
    (plain, _), (early, early1) = runs[name], runs[f"{name}/overlap"]
    # groups were started inside the hook, during backward, in every compressed step
    assert all(n == len(early["keys"]) for n in early["started"][WARMUP:]) and early["started"][:WARMUP] == [0] * WARMUP
    assert early["keys"] == plain["keys"] and early["compressed"] == plain["compressed"]
    for step in range(STEPS):
        for i in range(len(SIZES)):
            assert (early["params"][step][i] == plain["params"][step][i]).all(), f"step {step}, parameter {i}"
            assert (early["params"][step][i] == early1["params"][step][i]).all()


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_variance_refresh_steps_match_the_documented_math(runs: dict, name: str) -> None:
    r0, r1 = runs[f"{name}/refresh"]
    at = [WARMUP + REFRESH, WARMUP + 3 * REFRESH]
    assert [i for i, f in enumerate(r0["refreshed"]) if f] == at
    # the refresh steps averaged in fp32 (the hook left no local gradients), the others after warm-up did not
    assert [i for i, loc in enumerate(r0["local"]) if not loc] == [*range(WARMUP), *at]
    expected = simulate(name, refresh=REFRESH)
    for step in range(REFRESH_STEPS):
        for i in range(len(SIZES)):
            a, b = torch.from_numpy(r0["params"][step][i]), torch.from_numpy(r1["params"][step][i])
            assert torch.equal(a, b), f"replicas differ at step {step}, parameter {i}"
            torch.testing.assert_close(a, expected[step][i], atol=2e-5, rtol=1e-5)
    # the refresh changed the trajectory: without it the compressed steps after the first refresh differ
    frozen = simulate(name)
    assert not torch.allclose(expected[at[0]][0], frozen[min(at[0], STEPS - 1)][0])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_backward_without_optimizer_step_changes_nothing(runs: dict, name: str) -> None:
    r0, r1 = runs[f"{name}/skip"]
    assert r0["started"][SKIP_AT] == len(r0["keys"])  # its groups were in flight when the step was skipped
    expected = simulate(name, skip_at=SKIP_AT)
    for step in range(STEPS):
        for i in range(len(SIZES)):
            a, b = torch.from_numpy(r0["params"][step][i]), torch.from_numpy(r1["params"][step][i])
            assert torch.equal(a, b)
            torch.testing.assert_close(a, expected[step][i], atol=2e-5, rtol=1e-5)


def _train(
    model: Params, opt: torch.optim.Optimizer, steps: int, state: OneBitState | None = None
) -> MomentumCompressor | None:
    """``steps`` steps of one process as the strategy runs them (the hook counts each backward; its gradients stay
    local in the compressed stage, where the compressor steps); without ``state``, plain DDP's steps."""
    comp = MomentumCompressor(opt, state) if state is not None else None
    for _ in range(steps):
        t = int(next(iter(opt.state.values()))["step"]) if opt.state else 0
        for p, c in zip(model.parameters(), coefficients(0, t), strict=True):
            p.grad = c
        compressing = state is not None and state.compressing
        if state is not None:
            state.step += 1  # the hook counted this backward
        if comp is not None and compressing:
            comp.compressed_step()
        else:
            opt.step()
    return comp


def _restored(opt: torch.optim.Optimizer, model: Params) -> torch.optim.Optimizer:
    """The optimizer a resumed fit builds and loads from the checkpoint (its state, the freeze marks included)."""
    new = make_optimizer("adamw", list(model.parameters()))
    new.load_state_dict(opt.state_dict())
    return new


@pytest.mark.parametrize("between", ["ddp", "fp32", "nothing"])
def test_a_new_compressed_stage_freezes_the_variance_at_its_own_start(one_process_group: None, between: str) -> None:
    """A 1-bit fit whose stage began at step 2, then plain DDP (its checkpoints hold no 1-bit state: the next 1-bit fit
    counts from 0, and its stage begins at step 2 again) or a ``compression="fp32"`` fit (which loads the stage and
    saves it again), both updating Adam's variance, then a 1-bit fit: its stage freezes the variance at its own start,
    not at the first stage's step (whose bias correction ``1 - β2^2`` makes the denominator ~22x too large). Resumed
    within the stage (``nothing`` between), the freeze holds."""
    torch.manual_seed(0)
    model = Params(SIZES)
    opt = make_optimizer("adamw", list(model.parameters()))
    first = OneBitState(warmup_steps=2, compressed_signal="momentum", parameters=model.parameters())
    _train(model, opt, 6, first)
    assert first.compressed_since == 2
    assert {int(s["onebit_freeze_step"]) for s in opt.state.values()} == {2}
    saved = first.state_dict()
    if between == "ddp":
        opt = _restored(opt, model)
        _train(model, opt, 24)
        resumed = OneBitState(warmup_steps=2, compressed_signal="momentum", parameters=model.parameters())
    elif between == "fp32":
        opt = _restored(opt, model)
        fp32 = OneBitState(warmup_steps=2, compression="fp32", compressed_signal="momentum")
        fp32.load_state_dict(saved, 1)
        assert fp32.compressed_since is None  # this fit does not continue the stage, nor do its checkpoints
        _train(model, opt, 24, fp32)
        saved = fp32.state_dict()
        assert saved["compressed_since"] is None
    if between != "ddp":
        resumed = OneBitState(warmup_steps=2, compressed_signal="momentum", parameters=model.parameters())
        resumed.load_state_dict(saved, 1)
    opt = _restored(opt, model)
    before = int(next(iter(opt.state.values()))["step"])
    comp = _train(model, opt, 3 if between == "ddp" else 1, resumed)  # "ddp": 2 warm-up steps first
    assert comp is not None
    stage_start = before + 2 if between == "ddp" else before
    expected = 2 if between == "nothing" else stage_start
    assert {int(s["onebit_freeze_step"]) for s in opt.state.values()} == {expected}
    for i, p in enumerate(model.parameters()):  # the denominator the step used is that of the freeze
        torch.testing.assert_close(comp._denoms[id(p)][1], _denom(opt, p, expected), msg=f"parameter {i}")


def test_a_resume_drops_loaded_error_state_of_a_group_that_changed_like_the_uninterrupted_run(
    one_process_group: None,
) -> None:
    """A parameter without a gradient at some compressed step (unused in that step on every rank) changes the step's
    groups: the uninterrupted run drops the error feedback of the group it belonged to. A run resumed just before that
    step holds that error as loaded state not yet adopted; it must drop it too, not adopt it when the parameter has a
    gradient again (the resumed run then differs from the uninterrupted one: bit-exact resume broken)."""
    sizes = [(40,), (9, 7)]
    used = [(0, 1), (0, 1), (0, 1), (0, 1), (0,), (0, 1)]  # the parameters with a gradient at each step
    cut = 4  # the resumed run saves after this many steps (2 warm-up steps, 2 compressed)

    def run(resume: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Params(sizes)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def fresh() -> OneBitState:
            return OneBitState(
                warmup_steps=2, compressed_signal="momentum", block_size=16, parameters=model.parameters()
            )

        state = fresh()
        comp = MomentumCompressor(opt, state)
        for t, idx in enumerate(used):
            if resume and t == cut:
                saved, opt_state = state.state_dict(), opt.state_dict()
                assert len(saved["groups"]) == 1  # the group of both parameters, with its error feedback
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                opt.load_state_dict(opt_state)
                state = fresh()
                state.load_state_dict(saved, 1)
                comp = MomentumCompressor(opt, state)
            g = torch.Generator().manual_seed(t)
            for i, p in enumerate(model.parameters()):
                p.grad = torch.randn(p.shape, generator=g) if i in idx else None
            state.step += 1  # the hook counted this backward
            if state.compressing:
                comp.compressed_step()
            else:
                opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)
