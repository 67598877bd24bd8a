"""Parallel plans on 2 CPU processes (gloo): step time and peak live tensor memory per rank of FSDP2, tensor parallel
and a 1F1B pipeline against DDP, on a ~20M-parameter TinyGPT; loss agreement with one process; the selector.

Memory is *live tensor bytes*, not RSS (the interpreter and libraries dominate RSS): at the start of a profiled step
the bytes of this rank's parameters, gradients and optimizer state, plus the highest running sum of the allocations
and frees ``torch.profiler`` (``profile_memory=True``) records during that step; on CUDA ``max_memory_allocated``.
Every plan runs in the same two processes, in turn; the selector (:func:`choose_by_trial`, the same trial code
``AutoStrategy(policy="measure")`` runs: each candidate in turn) is timed separately from the reference timing
(all plans alternating, one step each per round, median), and ``selector_step_over_best`` is the selected plan's
reference step time over the fastest reference step time.

A second model, a GPT-2-style LM (:func:`lightning_accel.models.gpt2.gpt2_lm`: packed ``attn.c_attn``, ``attn.c_proj``,
``mlp.c_fc``, ``mlp.c_proj``, a head tied to the embedding, as an ``nn.Sequential``), checks what a plan must not get
wrong, in a second launch of two processes: tensor parallel with the packed attention split per head
(``tp_packed_qkv_loss_max_abs_diff``, losses against DDP's) and FSDP2 with the tied embedding/head in one group
(``fsdp_tied_loss_max_abs_diff``); then Trainer fits of ``AutoStrategy(policy="measure")`` restricted to each
candidate, counting the distinct samples of every step over both ranks and the steps per epoch
(``selector_global_batch_changes``: candidates whose global batch or steps per epoch differ from DDP's), and one
fit whose tensor-parallel trial fails in its first step (``selector_failed_trials_abort_fit``: 1 when that aborts
the fit or the failure is not reported as dropped).

    python benchmarks/parallel.py --quick --out /tmp/bench/parallel.json
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/parallel.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import parser, ratio, report

PLANS = ("ddp", "fsdp", "tp", "pipeline")


def _gpt(cfg: dict[str, Any]) -> Any:
    import torch

    from lightning_accel.models.transformer import GPT

    torch.manual_seed(0)
    return GPT(cfg["vocab"], cfg["seq"], cfg["layers"], cfg["heads"], cfg["width"], dropout=0.0)


def _ce(out: Any, tokens: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(out.reshape(-1, out.size(-1)).float(), tokens[:, 1:].reshape(-1))


def _peak_step(stepper: Any) -> int:
    """Live tensor bytes at the peak of one step (see the module docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lightning_accel.parallel.trials import held_tensor_bytes

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        stepper.step()
        return int(torch.cuda.max_memory_allocated())
    base = held_tensor_bytes(stepper.model, stepper.optimizer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        stepper.step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    run = peak = 0
    for _, n in events:
        run += n
        peak = max(peak, run)
    return base + peak


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lightning_accel.parallel.select import StrategyChoice, choose_by_trial, select_strategy
    from lightning_accel.parallel.trials import plan_stepper, time_plan

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    x = tokens[:, :-1]
    base = _gpt(cfg)
    out: dict[str, Any] = {"params": sum(p.numel() for p in base.parameters())}
    steppers = {}
    for plan in PLANS:
        st = plan_stepper(plan, copy.deepcopy(base), x, tokens, loss_fn=_ce, lr=1e-3)
        losses = [st.step() for _ in range(cfg["loss_steps"])]
        out[plan] = {"losses": losses, "peak_bytes": _peak_step(st)}
        steppers[plan] = st
    # reference step times: the plans alternate, one step each per round, so drift on this shared machine hits all
    rounds: dict[str, list[float]] = {p: [] for p in PLANS}
    for _ in range(cfg["rounds"]):
        for plan, st in steppers.items():
            rounds[plan].append(time_plan(st, steps=1, warmup=0))
    for plan in PLANS:
        out[plan]["step_s"] = statistics.median(rounds[plan])
    del steppers
    # the selector: the memory estimate's candidates (all fit in 1 GiB here), then its own timed trial
    choice: StrategyChoice = select_strategy(base, devices=world, device_memory_bytes=2**30, example_batch=x[:2])

    def trial(plan: str) -> float:
        return time_plan(plan_stepper(plan, copy.deepcopy(base), x, tokens, loss_fn=_ce), steps=cfg["steps"])

    picked = choose_by_trial(choice, trial)
    out["selector"] = {"plan": picked.plan, "trial_s": picked.measured, "table": picked.table()}
    return out


def _single(cfg: dict[str, Any]) -> list[float]:
    import torch

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    m = _gpt(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses = []
    for _ in range(cfg["loss_steps"]):
        opt.zero_grad(set_to_none=True)
        loss = _ce(m(tokens[:, :-1]), tokens)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def case_plans(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    from tests.helpers import run_in_processes

    ref = _single(cfg)
    r0, r1 = run_in_processes(_worker, 2, (cfg,), timeout=1800)
    results: dict[str, Any] = {"params_m": round(r0["params"] / 1e6, 2), "single_losses": ref}
    for plan in PLANS:
        results[plan] = {
            "step_ms": round(r0[plan]["step_s"] * 1e3, 1),
            "peak_mb_rank0": round(r0[plan]["peak_bytes"] / 2**20, 1),
            "peak_mb_rank1": round(r1[plan]["peak_bytes"] / 2**20, 1),
            "losses_rank0": r0[plan]["losses"],
        }

    def peak(plan: str) -> float:
        return max(r0[plan]["peak_bytes"], r1[plan]["peak_bytes"])

    def loss_diff(plan: str) -> float:
        return max(abs(a - b) for a, b in zip(r0[plan]["losses"], ref, strict=True))

    times = {p: r0[p]["step_s"] for p in PLANS}
    sel = r0["selector"]
    results["selector"] = {
        "plan": sel["plan"],
        "trial_ms": {k: round(v * 1e3, 1) for k, v in sel["trial_s"].items()},
        "fastest_by_reference_timing": min(times, key=times.__getitem__),
    }
    print(sel["table"])
    ratios = {
        "fsdp_peak_mem_over_ddp": ratio(peak("fsdp"), peak("ddp")),
        "pipeline_peak_mem_over_ddp": ratio(peak("pipeline"), peak("ddp")),
        "tp_peak_mem_over_ddp": ratio(peak("tp"), peak("ddp")),
        "fsdp_step_over_ddp": ratio(times["fsdp"], times["ddp"]),
        "tp_step_over_ddp": ratio(times["tp"], times["ddp"]),
        "pipeline_step_over_ddp": ratio(times["pipeline"], times["ddp"]),
        "tp_loss_max_abs_diff": float(f"{loss_diff('tp'):.3g}"),
        "pipeline_loss_max_abs_diff": float(f"{loss_diff('pipeline'):.3g}"),
        "fsdp_loss_max_abs_diff": float(f"{loss_diff('fsdp'):.3g}"),
        "selector_step_over_best": ratio(times[sel["plan"]], min(times.values())),
    }
    return results, ratios


def _packed_tied_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks._models import GPT2LM
    from lightning_accel.models.gpt2 import gpt2_lm
    from lightning_accel.parallel import AutoStrategy
    from lightning_accel.parallel.plans import tensor_parallel_coverage
    from lightning_accel.parallel.trials import plan_stepper
    from tests.parallel.test_selector_integration import FailsUnderTensorParallel, fit_and_watch

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    ddp = fit_and_watch("ddp", GPT2LM())  # the Trainer starts the process group the plans below use
    out["trainer"] = {"ddp": {k: ddp[k] for k in ("seen", "steps_per_epoch")}}
    for plan in ("fsdp", "tp", "pipeline"):
        auto = AutoStrategy(
            policy="measure", candidates=[plan], device_memory_bytes=2**30, trial_steps=1, example_batch_size=4
        )
        got = fit_and_watch(auto, GPT2LM())
        chosen = auto.choice.plan if auto.choice is not None else None
        out["trainer"][plan] = {"plan": chosen, **{k: got[k] for k in ("seen", "steps_per_epoch", "strategy")}}
    auto = AutoStrategy(policy="measure", candidates=["ddp", "tp"], device_memory_bytes=2**30, trial_steps=1)
    try:
        got = fit_and_watch(auto, FailsUnderTensorParallel())
        dropped = dict(auto.choice.dropped) if auto.choice is not None else {}
        out["failing"] = {"completed": got["steps_per_epoch"] > 0 and len(got["seen"]) > 0, "dropped": dropped}
    except Exception as e:  # noqa: BLE001  (what the ratio counts)
        out["failing"] = {"completed": False, "error": f"{type(e).__name__}: {e}"}
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    model = {k: cfg[k] for k in ("vocab", "seq", "layers", "heads", "width")}
    for plan in ("ddp", "tp", "fsdp"):
        st = plan_stepper(plan, gpt2_lm(**model), tokens[:, :-1], tokens, loss_fn=_ce, lr=1e-3)
        out[plan] = [st.step() for _ in range(cfg["loss_steps"])]
        if plan == "tp":
            out["tp_coverage"] = tensor_parallel_coverage(st.model, {})
            from torch.distributed.tensor import DTensor

            out["tp_split"] = sorted(
                {n.rsplit(".", 1)[0] for n, p in st.model.named_parameters() if isinstance(p, DTensor)}
            )
    return out


def case_packed_tied(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    from tests.helpers import run_in_processes

    r0, _ = run_in_processes(_packed_tied_worker, 2, (cfg,), init_process_group=False, timeout=1800)
    ddp = r0["trainer"]["ddp"]
    changes = [
        plan
        for plan in ("fsdp", "tp", "pipeline")
        if r0["trainer"][plan]["plan"] != plan
        or (r0["trainer"][plan]["seen"], r0["trainer"][plan]["steps_per_epoch"])
        != (ddp["seen"], ddp["steps_per_epoch"])
    ]
    attention_split = any(n.endswith("attn.c_attn") for n in r0["tp_split"])
    failing = r0["failing"]
    aborted = not failing["completed"] or "tp" not in failing.get("dropped", {})

    def diff(plan: str) -> float:
        return max(abs(a - b) for a, b in zip(r0[plan], r0["ddp"], strict=True))

    results = {
        "model": "gpt2_lm (packed c_attn, tied head)",
        "tp_split_modules": r0["tp_split"],
        "trainer_runs": r0["trainer"],
        "global_batch_changed": changes,
        "failing_trial": failing,
        "losses": {plan: r0[plan] for plan in ("ddp", "tp", "fsdp")},
    }
    ratios = {
        # attention not split would make the TP comparison meaningless: report it as a failure (inf)
        "tp_packed_qkv_loss_max_abs_diff": float(f"{diff('tp'):.3g}") if attention_split else float("inf"),
        "fsdp_tied_loss_max_abs_diff": float(f"{diff('fsdp'):.3g}"),
        "selector_global_batch_changes": float(len(changes)),
        "selector_failed_trials_abort_fit": float(aborted),
    }
    return results, ratios


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    # ~20M parameters: 6 blocks of width 512 (12·512² each) + embeddings
    cfg = {"vocab": 256, "seq": 64, "layers": 6, "heads": 8, "width": 512, "batch": 4}
    cfg.update({"steps": 2, "loss_steps": 2, "rounds": 3} if args.quick else {"steps": 4, "loss_steps": 4, "rounds": 7})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results, ratios = case_plans(cfg)
    gpt2 = {"vocab": 64, "seq": 16, "layers": 2, "heads": 4, "width": 32, "batch": 8, "loss_steps": cfg["loss_steps"]}
    packed_results, packed_ratios = case_packed_tied(gpt2)
    results["packed_tied"] = packed_results
    ratios.update(packed_ratios)
    report(
        "parallel",
        quick=args.quick,
        config={**cfg, "gpt2": gpt2, "processes": 2, "backend": "gloo", "dtype": "fp32"},
        results=results,
        ratios=ratios,
        out=args.out,
    )


if __name__ == "__main__":
    main()
