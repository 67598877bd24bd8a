"""The local-steps core (:mod:`lightning_accel.comm.localsteps`): config checks, fragments and their schedule, the outer
step against a hand-computed oracle on 2 gloo processes, the overlapped application, 1-bit averaging with error
feedback, and a state round trip with an exchange in flight."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.comm.localsteps import LocalStepsConfig, split_fragments
from tests.helpers import run_in_processes


@pytest.mark.parametrize(
    ("kwargs", "kind", "needle"),
    [
        ({"sync_every": 0}, ValueError, "`sync_every`"),
        ({"fragments": 9, "sync_every": 8}, ValueError, "`fragments`"),
        ({"overlap_steps": 4, "sync_every": 8, "fragments": 2}, ValueError, "`overlap_steps`"),
        ({"compression": "int3"}, ValueError, "`compression`"),
        ({"outer_momentum": 1.0}, ValueError, "`outer_momentum`"),
        ({"outer_lr": 0.0}, ValueError, "`outer_lr`"),
        ({"outer_lr": float("inf")}, ValueError, "`outer_lr`"),
        ({"outer_lr": float("nan")}, ValueError, "`outer_lr`"),
        ({"outer_momentum": float("inf")}, ValueError, "`outer_momentum`"),
        ({"overlap_steps": 1, "sync_every": 1}, ValueError, "`overlap_steps`"),
        ({"block_size": 12}, ValueError, "`block_size`"),
        ({"nesterov": 1}, TypeError, "`nesterov`"),
        ({"sync_every": 2.0}, TypeError, "`sync_every`"),
        ({"sync_start": -1}, ValueError, "`sync_start`"),
        ({"sync_start": 1.5}, TypeError, "`sync_start`"),
    ],
)
def test_config_rejects_bad_values_naming_them(kwargs: dict, kind: type, needle: str) -> None:
    with pytest.raises(kind, match=needle):
        LocalStepsConfig(**kwargs)


def test_a_block_size_that_fp32_averaging_would_ignore_is_refused() -> None:
    """The fp32 exchange has no scale blocks: a block size beside it would be dropped without a word."""
    with pytest.raises(ValueError, match="`block_size=256`") as info:
        LocalStepsConfig(compression="fp32", block_size=256)
    msg = str(info.value)
    assert "\n" not in msg and "`compression='fp32'`" in msg and "Drop `block_size`" in msg
    assert LocalStepsConfig(compression="fp32").block_size == 640  # the default: nothing was asked for
    assert LocalStepsConfig(compression="1bit", block_size=256).block_size == 256


@pytest.mark.parametrize(
    ("kwargs", "overlap"),
    [
        ({}, 1),
        ({"sync_every": 8, "fragments": 2}, 1),
        ({"sync_every": 1, "compression": "fp32"}, 0),  # a sync every step: nothing to overlap with
        ({"sync_every": 4, "fragments": 4}, 0),  # a fragment due every step
        ({"sync_every": 4, "fragments": 4, "overlap_steps": 0}, 0),
        ({"sync_every": 8, "overlap_steps": 5}, 5),
    ],
)
def test_default_overlap_follows_the_schedule(kwargs: dict, overlap: int) -> None:
    cfg = LocalStepsConfig(**kwargs)
    assert cfg.overlap_steps == overlap
    assert LocalStepsConfig(**{**kwargs, "overlap_steps": overlap}) == cfg  # resolved: the same config as explicit


def test_split_fragments_is_contiguous_balanced_and_complete() -> None:
    numels = [100, 5, 5, 90, 10, 100, 1]
    parts = split_fragments(numels, 3)
    assert [i for p in parts for i in p] == list(range(len(numels)))
    assert len(parts) == 3 and all(parts)
    sizes = [sum(numels[i] for i in p) for p in parts]
    assert max(sizes) <= 2 * min(sizes)
    assert split_fragments([4, 4], 5) == [[0], [1]]  # never an empty fragment
    assert split_fragments([7], 1) == [[0]]


def test_send_phases_spread_fragments_over_the_interval() -> None:
    assert [LocalStepsConfig(sync_every=8, fragments=1).send_phase(0)] == [0]
    cfg = LocalStepsConfig(sync_every=8, fragments=4, overlap_steps=1)
    assert [cfg.send_phase(f) for f in range(4)] == [2, 4, 6, 0]


def _oracle(rank: int, world: int) -> dict:
    """Scenarios on a real gloo group; each rank's 'inner step' adds a rank-dependent step to its parameters."""
    import torch.distributed as dist

    from lightning_accel.comm.localsteps import LocalSteps

    out: dict = {}

    def params() -> list[torch.Tensor]:
        torch.manual_seed(0)  # same start on every rank, as after DDP's broadcast
        return [torch.randn(37), torch.randn(5, 3), torch.randn(64)]

    def inner(ps: list[torch.Tensor], step: int) -> None:
        g = torch.Generator().manual_seed(100 * step + rank)
        for p in ps:
            p.add_(torch.randn(p.shape, generator=g), alpha=0.1)

    def gathered(ps: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = torch.cat([p.reshape(-1) for p in ps])
        parts = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(parts, flat)
        return parts

    # fp32, no overlap, H=3: the outer Nesterov step by hand
    ps = params()
    start = torch.cat([p.reshape(-1) for p in ps]).clone()
    cfg = LocalStepsConfig(sync_every=3, compression="fp32", overlap_steps=0, outer_lr=0.7, outer_momentum=0.9)
    ls = LocalSteps(ps, cfg)
    outer, m = start.clone(), torch.zeros_like(start)
    expected = []
    for step in range(1, 7):
        inner(ps, step)
        if step % 3 == 0:
            locals_ = gathered(ps)
            delta = torch.stack([outer - x for x in locals_]).mean(0)
            m = 0.9 * m + delta
            outer = outer - 0.7 * (delta + 0.9 * m)
            expected.append(outer.clone())
        ls.step()
        if step % 3 == 0:
            out.setdefault("fp32", []).append(
                (torch.cat([p.reshape(-1) for p in ps]) - expected[-1]).abs().max().item()
            )
    out["fp32_bytes"] = ls.bytes_sent
    out["fp32_syncs"] = ls.syncs

    # overlap 2: the exchange issued at step 4 is applied at step 6, the local progress of steps 5-6 kept
    ps = params()
    start = torch.cat([p.reshape(-1) for p in ps]).clone()
    cfg = LocalStepsConfig(sync_every=4, compression="fp32", overlap_steps=2, outer_lr=0.7, outer_momentum=0.9)
    ls = LocalSteps(ps, cfg)
    for step in range(1, 7):
        inner(ps, step)
        if step == 4:
            sent = torch.cat([p.reshape(-1) for p in ps]).clone()
            delta = torch.stack([start - x for x in gathered(ps)]).mean(0)
            new_outer = start - 0.7 * (delta + 0.9 * delta)
        if step == 6:
            before = torch.cat([p.reshape(-1) for p in ps]).clone()
        ls.step()
        out.setdefault("in_flight", []).append(ls.in_flight)
    now = torch.cat([p.reshape(-1) for p in ps])
    out["overlap_err"] = (now - (before + new_outer - sent)).abs().max().item()

    # 1-bit: bit-identical on every rank after a sync, close to the fp32 average, error state kept
    ps = params()
    ls = LocalSteps(ps, LocalStepsConfig(sync_every=2, overlap_steps=0, block_size=16))
    for step in range(1, 3):
        inner(ps, step)
        ls.step()
    parts = gathered(ps)
    out["onebit_same"] = all(torch.equal(parts[0], p) for p in parts)
    out["onebit_error_norm"] = float(ls.fragments[0].errors.worker_error.norm())  # type: ignore[union-attr]
    out["onebit_bytes"] = ls.bytes_sent

    # round trip with an exchange in flight (2 fragments, overlap 1): resume = uninterrupted, bit for bit
    def run(split_at: int | None) -> torch.Tensor:
        ps = params()
        cfg = LocalStepsConfig(sync_every=4, fragments=2, overlap_steps=1, block_size=16)
        ls = LocalSteps(ps, cfg)
        for step in range(1, 14):
            inner(ps, step)
            ls.step()
            if step == split_at:
                assert ls.in_flight
                state = ls.state_dict()
                flats = ls.local_flats()
                ps = params()
                ls = LocalSteps(ps, cfg)
                ls.load_local_flats(flats)
                ls.load_state_dict(state)
        ls.final_sync()
        return torch.cat([p.reshape(-1) for p in ps])

    full, resumed = run(None), run(6)
    out["resume_equal"] = torch.equal(full, resumed)
    out["final_same"] = all(torch.equal(gathered([full])[0], p) for p in gathered([full]))

    # synchronous start (3 steps), then H=2 with 1-bit: the first steps average the parameters in fp32 (the mean of
    # the ranks' parameters after each step, DDP's bytes), the local schedule starts after them from that average
    from lightning_accel.comm.allreduce import fp32_ring_bytes

    ps = params()
    ls = LocalSteps(ps, LocalStepsConfig(sync_every=2, overlap_steps=0, block_size=16, sync_start=3))
    start_err, start_bytes, synced = [], [], []
    for step in range(1, 6):
        inner(ps, step)
        mean = torch.stack(gathered(ps)).mean(0)
        sent = ls.step()
        synced.append(ls.last_synced)
        now = torch.cat([p.reshape(-1) for p in ps])
        if step <= 3:
            start_err.append((now - mean).abs().max().item())
            start_bytes.append(sent)
            if step == 3:
                frag = ls.fragments[0]  # θ_global: the averaged parameters, in the fragment's padded layout
                out["start_outer_is_params"] = torch.equal(frag.outer, ls._flatten(frag, torch.zeros_like(frag.outer)))
    out["start_err"] = start_err
    out["start_bytes_ok"] = all(b == fp32_ring_bytes(ls.fragments[0].layout.padded_numel, world) for b in start_bytes)
    out["start_synced"] = synced
    out["start_syncs"] = ls.syncs

    # the schedule counts from the end of the synchronous start: H=4 syncs H steps after it, then every H steps
    def sync_steps(sync_start: int, **kw: int) -> list[int]:
        ps = params()
        cfg = LocalStepsConfig(sync_every=4, compression="fp32", sync_start=sync_start, **kw)
        ls = LocalSteps(ps, cfg)
        at = []
        for step in range(1, 17):
            inner(ps, step)
            ls.step()
            if ls.last_synced:
                at.append(step)
        return at

    out["schedule"] = {s: sync_steps(s, overlap_steps=0) for s in (0, 3, 5)}
    out["schedule_streamed"] = sync_steps(3, fragments=2, overlap_steps=1)

    # a parameter with no elements is left out of the fragments; the others train and sync as usual
    ps = [torch.zeros(0), *params(), torch.zeros(0, 3)]
    ls = LocalSteps(ps, LocalStepsConfig(sync_every=2, fragments=2, overlap_steps=0, block_size=16))
    for step in range(1, 5):
        inner(ps, step)
        ls.step()
    ls.final_sync()
    out["empty_tracked"] = [p.numel() for p in ls.params]
    out["empty_same"] = all(torch.equal(gathered(ps)[0], p) for p in gathered(ps))
    out["empty_syncs"] = ls.syncs

    # the final sync leaves alone a fragment synced at that very step: with outer momentum (fp32) or 1-bit residuals
    # an outer step on its zero pseudo-gradient would still move θ_global (by lr μ² m, or by the residual), a step
    # DiLoCo never takes. Fragment 1 is sent at step 4 (the last) and, with overlap, applied by the final sync's
    # `finish` at that step; fragment 0, synced at step 3, moved since and syncs once more
    final: dict[str, tuple[float, int, int]] = {}
    for name, kw in {
        "fp32_momentum": {"compression": "fp32", "outer_lr": 0.7, "outer_momentum": 0.9, "overlap_steps": 0},
        "onebit": {"block_size": 16, "overlap_steps": 0},
        "streamed": {"fragments": 2, "sync_every": 4, "overlap_steps": 1, "compression": "fp32", "outer_momentum": 0.9},
    }.items():
        ps = params()
        ls = LocalSteps(ps, LocalStepsConfig(**{"sync_every": 2, **kw}))
        for step in range(1, 5):
            inner(ps, step)
            ls.step()
        ls.finish()
        before = torch.cat([p.reshape(-1) for p in ps]).clone()
        state, flats, syncs = ls.state_dict(), ls.local_flats(), ls.syncs
        ls.final_sync()
        moved = torch.cat([p.reshape(-1) for p in ps]) - before
        # frozen fragments: the elements of fragment 1 (the last parameter, 64 elements)
        frozen = moved[-64:] if name == "streamed" else moved
        # a resumed state knows it too (a fit resumed from a checkpoint saved at its end runs no step)
        again = params()
        resumed = LocalSteps(again, LocalStepsConfig(**{"sync_every": 2, **kw}))
        resumed.load_local_flats(flats)
        resumed.load_state_dict(state)
        resumed_syncs = resumed.syncs
        resumed.final_sync()
        final[name] = (frozen.abs().max().item(), ls.syncs - syncs, resumed.syncs - resumed_syncs)
    out["final_sync"] = final
    return out


@pytest.fixture(scope="module")
def oracle() -> list[dict]:
    return run_in_processes(_oracle, 2)


def test_outer_nesterov_step_matches_the_oracle(oracle: list[dict]) -> None:
    for res in oracle:
        assert res["fp32_syncs"] == 2
        assert max(res["fp32"]) < 1e-5
        assert res["fp32_bytes"] > 0


def test_overlapped_exchange_keeps_the_local_progress(oracle: list[dict]) -> None:
    for res in oracle:
        assert res["overlap_err"] < 1e-5
        # issued at step 4, served at 5, applied at 6
        assert res["in_flight"] == [False, False, False, True, True, False]


def test_onebit_outer_average_is_identical_on_every_rank(oracle: list[dict]) -> None:
    for res in oracle:
        assert res["onebit_same"]
        assert res["onebit_error_norm"] > 0  # the residual is kept for the next sync
        assert res["onebit_bytes"] > 0


def test_state_round_trip_with_an_exchange_in_flight_is_bit_exact(oracle: list[dict]) -> None:
    for res in oracle:
        assert res["resume_equal"]
        assert res["final_same"]


def test_a_synchronous_start_averages_every_step_then_hands_over_to_the_schedule(oracle: list[dict]) -> None:
    for res in oracle:
        assert max(res["start_err"]) < 1e-6  # each of the first 3 steps: every rank holds the mean of the parameters
        assert res["start_bytes_ok"] and res["start_outer_is_params"]
        # steps 1-3 synchronous; then H=2 counted from there: step 4 a local step, step 5 the first sync
        assert res["start_synced"] == [True, True, True, False, True]
        assert res["start_syncs"] == 4


def test_the_schedule_begins_after_the_synchronous_start(oracle: list[dict]) -> None:
    for res in oracle:
        assert res["schedule"] == {0: [4, 8, 12, 16], 3: [1, 2, 3, 7, 11, 15], 5: [1, 2, 3, 4, 5, 9, 13]}
        # fragment 0 sent at 5, 9, 13 and fragment 1 at 7, 11, 15 (2 and 4 steps past the start), each applied a
        # step later: step 4 is the only local step without an exchange
        assert res["schedule_streamed"] == [1, 2, 3, *range(5, 17)]


def test_parameters_without_elements_are_left_out(oracle: list[dict]) -> None:
    for res in oracle:
        assert res["empty_tracked"] == [37, 15, 64]
        # a fragment each step, then at the end the one synced before the last step (the other just synced)
        assert res["empty_same"] and res["empty_syncs"] == 4 + 1


def test_the_final_sync_takes_no_outer_step_for_a_fragment_synced_at_that_step(oracle: list[dict]) -> None:
    for res in oracle:
        final = res["final_sync"]
        # synced at step 4 (the last): nothing moves, no extra outer update, after a resume too
        assert final["fp32_momentum"] == (0.0, 0, 0)
        assert final["onebit"] == (0.0, 0, 0)
        # streamed: fragment 1 (sent and applied at step 4) stays; fragment 0 (synced at step 3) syncs once more
        assert final["streamed"] == (0.0, 1, 1)


@pytest.mark.parametrize("change", ["fragments", "trainable"])
def test_a_resume_of_another_layout_is_refused_before_anything_is_restored(
    one_process_group: None, change: str
) -> None:
    """A checkpoint of another parameter split (``fragments``, or other trainable parameters) is refused with the
    layout message and the fix, before any parameter, buffer or outer state is overwritten (this rank's parameters
    were restored first, and the check came after them: a deep ``ValueError`` or a ``RuntimeError`` about a shape,
    some parameters already changed). The message depends only on what every rank shares: the same line on each."""
    from lightning_accel.comm import LocalStepsStrategy
    from lightning_accel.comm.localsteps import LocalSteps

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))

    saved_model = model()
    with torch.no_grad():
        for p in saved_model.parameters():
            p.add_(1.0)  # what the saving rank had trained: differs from the live parameters everywhere
    if change == "trainable":
        saved_model[0].weight.requires_grad_(False)  # frozen when saved, trained now
    saved_cfg = LocalStepsConfig(sync_every=4, fragments=2 if change == "fragments" else 1, block_size=16)
    saved = LocalSteps([p for p in saved_model.parameters() if p.requires_grad], saved_cfg)
    own = {"local": saved.local_flats(), "outer": saved.state_dict(), "optimizers": [], "precision": None}

    strategy = LocalStepsStrategy(sync_every=4, fragments=1, block_size=16, parallel_devices=[torch.device("cpu")])
    live = model()
    strategy._local = LocalSteps(list(live.parameters()), strategy.local_steps_config)
    before = [p.detach().clone() for p in live.parameters()]
    outer = [f.outer.clone() for f in strategy._local.fragments]
    with pytest.raises(
        ValueError,
        match=r"`ckpt_path` 'run/last.ckpt': .*local-steps state was made for .* Resume with the same `fragments`",
    ):
        strategy._restore_local({"format": 2, "ranks": [own]}, "run/last.ckpt")
    assert all(torch.equal(a, p) for a, p in zip(before, live.parameters(), strict=True)), "parameters overwritten"
    assert all(torch.equal(a, f.outer) for a, f in zip(outer, strategy._local.fragments, strict=True))
    assert strategy._local.step_count == 0
