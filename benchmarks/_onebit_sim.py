"""Where compressed momentum loses loss: a one-process simulation of ``ddp_1bit``'s Adam path for ``N`` ranks.

``docs/onebit.md`` ("Variance refreshes") decomposes the loss gap of the compressed-momentum path with this tool. It
trains ``benchmarks/localsteps.py``'s character GPT (AdamW β = (0.9, 0.95), 15 % LR warm-up + cosine, clipping 1.0,
16 windows per rank and step, rank ``r`` taking windows ``r, r+N, ...`` as the DistributedSampler does) in one process.
Each simulated rank computes its own gradient on its own windows, and the averaging is the algorithm of
``lightning_accel/comm/momentum.py`` written out: local momentum, ``u = m_loc / D`` floored at ``|m̂/D| <= 1``, the
two-phase 1-bit allreduce with worker and server error feedback (``compress_reference`` on the canonical layout's
blocks), ``m = ū·D``. Variants:

- ``ddp``: exact Adam on the averaged gradient (DDP);
- ``freeze``: the variance frozen at the end of warm-up, exact averaging (no compression);
- ``worker`` / ``server`` / ``full``: the frozen variance with only the worker side, only the server side, or both
  compressed.

``--refresh R`` adds the variance refreshes (fp32 steps ``R, 3R, 7R, ...`` into the compressed stage, the variance
catching up on the skipped steps, residuals rescaled to the new ``D``). Each line printed is one fit's JSON: the
held-out loss and, over the last 50 compressed steps, the worker, server and total error of the averaged ``u``
relative to its exact average.

    python benchmarks/_onebit_sim.py --world 4 --variants ddp,freeze,full --refresh 8

It reproduces the strategy: at 2 processes, 240 steps, ``full`` without refreshes gives 2.1388 against the
strategy's 2.1346. A fit of ``N`` ranks costs ``N`` forward/backward passes per step (~50 s for N = 4 here).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/_onebit_sim.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.localsteps import BATCH, LR, SEQ, VOCAB, _windows, corpus
from lightning_accel.comm.compress import GroupLayout, compress_reference, decode
from lightning_accel.models.transformer import GPT

VARIANTS = ("ddp", "freeze", "worker", "server", "full")
BETAS, EPS, WD, CLIP = (0.9, 0.95), 1e-8, 0.01, 1.0


def lr_at(step: int, steps: int) -> float:
    """Linear warm-up over 15 % of the fit, then cosine to a tenth (the benchmark's schedule)."""
    warm, low = int(0.15 * steps), LR * 0.1
    if step < warm:
        return LR * (step + 1) / warm
    return low + (LR - low) * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def refresh_steps(warmup: int, first: int, steps: int) -> set[int]:
    """``warmup + R * (2**j - 1)`` for ``j >= 1`` below ``steps`` (none when ``first`` is 0)."""
    out, n = set(), first
    while first and warmup + n < steps:
        out.add(warmup + n)
        n = 2 * n + first
    return out


def _mean(ts: list[torch.Tensor]) -> torch.Tensor:
    """``sum(ts) / len(ts)``, summed left to right as Python's ``sum`` does (the figures in the docs)."""
    return functools.reduce(torch.add, ts) / len(ts)


def _clip_factor(grads: list[torch.Tensor]) -> float:
    norm = float(torch.sqrt(functools.reduce(torch.add, [(g * g).sum() for g in grads])))
    return min(1.0, CLIP / (norm + 1e-6))


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def fit(world: int, variant: str, *, steps: int, warmup: int, block: int, refresh: int) -> dict[str, Any]:
    """One simulated fit; returns its held-out loss and the averaging errors."""
    train, held = corpus()
    held_out = _windows(held, 128, seed=2)
    torch.manual_seed(0)
    model = GPT(VOCAB, SEQ, 4, 4, 128, 0.0)
    params = list(model.parameters())
    lay = GroupLayout([p.numel() for p in params], world, block, torch.device("cpu"))
    data = _windows(train, steps * BATCH * world, seed=1)
    per_rank = [data[r::world] for r in range(world)]
    b1, b2 = BETAS
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    e_w = [torch.zeros(lay.padded_numel) for _ in range(world)]
    e_s = [torch.zeros(lay.chunk_numel) for _ in range(world)]
    denom: list[torch.Tensor] | None = None
    last_v = -1  # the step the variance was last updated at
    fp32_at = refresh_steps(warmup, refresh, steps)
    errors: list[tuple[float, float, float]] = []

    def flat(ts: list[torch.Tensor]) -> torch.Tensor:
        buf = torch.zeros(lay.padded_numel)
        for o, t in zip(lay.offsets, ts, strict=True):
            buf[o : o + t.numel()] = t.reshape(-1)
        return buf

    for t in range(steps):
        lr, step = lr_at(t, steps), t + 1
        grads = []
        for r in range(world):
            model.zero_grad(set_to_none=True)
            _loss(model, per_rank[r][t * BATCH : (t + 1) * BATCH]).backward()
            grads.append([p.grad.detach().clone() for p in params])  # type: ignore[union-attr]
        with torch.no_grad():
            if variant == "ddp" or t < warmup or t in fp32_at:  # exact Adam on the average
                avg = [_mean([g[i] for g in grads]) for i in range(len(params))]
                c, keep = _clip_factor(avg), b2 ** (t - last_v)  # the variance catches up on skipped steps
                for i, p in enumerate(params):
                    g = avg[i] * c
                    m[i].mul_(b1).add_(g, alpha=1 - b1)
                    v[i].mul_(keep).addcmul_(g, g, value=1 - keep)
                    p.mul_(1 - lr * WD)
                    p.add_(m[i] / ((v[i] / (1 - b2**step)).sqrt() + EPS), alpha=-lr / (1 - b1**step))
                last_v = t
                if denom is not None:  # a refresh: freeze again here, residuals to the new denominator
                    new = [(v[i] / (1 - b2**step)).sqrt() + EPS for i in range(len(params))]
                    ratio = flat([a / b for a, b in zip(denom, new, strict=True)])
                    e_w = [e * ratio for e in e_w]
                    e_s = [e * ratio[r * lay.chunk_numel : (r + 1) * lay.chunk_numel] for r, e in enumerate(e_s)]
                    denom = new
                continue
            if denom is None:  # the first compressed step freezes the variance of the last warm-up step
                denom = [(v[i] / (1 - b2**t)).sqrt() + EPS for i in range(len(params))]
            bound = 1 - b1**step
            us = []
            for own in grads:  # each rank's local momentum from its own (locally clipped) gradient
                c = _clip_factor(own)
                us.append(
                    flat(
                        [
                            ((b1 * m[i] + (1 - b1) * own[i] * c) / denom[i]).clamp(-bound, bound)
                            for i in range(len(params))
                        ]
                    )
                )
            exact = _mean(us)
            ubar = exact
            if variant != "freeze":
                worker = variant in ("worker", "full")
                sent = []
                for r in range(world):
                    if worker:
                        packed, scales, e_w[r] = compress_reference(us[r], e_w[r], lay.table)  # type: ignore[assignment]
                        sent.append(decode(packed, scales, lay.table.lengths))
                    else:
                        sent.append(us[r])
                wavg = _mean(sent)
                ubar = wavg
                if variant in ("server", "full"):
                    c_n, chunks = lay.chunk_numel, []
                    for r in range(world):
                        ch = lay.chunks[r]
                        x = torch.where(ch.mask, wavg[r * c_n : (r + 1) * c_n], 0.0)
                        packed, scales, e_s[r] = compress_reference(x, e_s[r], ch)  # type: ignore[assignment]
                        chunks.append(decode(packed, scales, ch.lengths))
                    ubar = torch.cat(chunks)
                mask, norm = lay.table.mask, exact[lay.table.mask].norm()
                errors.append(
                    (
                        float((wavg - exact)[mask].norm() / norm),
                        float((ubar - wavg)[mask].norm() / norm),
                        float((ubar - exact)[mask].norm() / norm),
                    )
                )
            for i, (o, p) in enumerate(zip(lay.offsets, params, strict=True)):
                u = ubar[o : o + p.numel()].view_as(p)
                m[i] = u * denom[i]
                p.mul_(1 - lr * WD)
                p.add_(u, alpha=-lr / (1 - b1**step))
    with torch.no_grad():
        out: dict[str, Any] = {
            "world": world,
            "variant": variant,
            "refresh": refresh,
            "loss": round(float(_loss(model, held_out)), 4),
        }
    if errors:
        tail = errors[-50:]
        for k, name in enumerate(("worker_rel_error", "server_rel_error", "total_rel_error")):
            out[name] = round(statistics.mean(e[k] for e in tail), 3)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", default="2,4", help="simulated ranks, comma-separated (default 2,4)")
    p.add_argument("--variants", default="ddp,freeze,full", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--warmup", type=int, default=10, help="fp32 warm-up steps (ddp_1bit's warmup_steps)")
    p.add_argument("--block", type=int, default=640, help="scale block size (ddp_1bit's block_size)")
    p.add_argument("--refresh", type=int, default=0, help="variance_refresh (0: the variance stays frozen)")
    args = p.parse_args(argv)
    bad = [v for v in args.variants.split(",") if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {', '.join(bad)}; expected some of {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(2)
    for world in (int(w) for w in args.world.split(",")):
        for variant in args.variants.split(","):
            t0 = time.perf_counter()
            res = fit(world, variant, steps=args.steps, warmup=args.warmup, block=args.block, refresh=args.refresh)
            print(json.dumps({**res, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
