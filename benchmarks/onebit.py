"""Benchmark ``ddp_1bit`` against plain DDP, ``fp16_compress_hook`` and PowerSGD (rank 2) on the digits.

Two CPU processes (gloo) train the same MLP (64 -> hidden -> hidden -> 10) on the flattened 8x8 digits with the same
seed, data order and epochs under five gradient-averaging schemes: plain fp32 allreduce, fp16 compression, PowerSGD
rank 2, 1-bit with error feedback, and 1-bit without error feedback. The five runs advance one epoch at a time in
turn (A, B, C, D, E, A, ...) so machine noise spreads over all of them.

Bytes are measured, not computed: the benchmark wraps ``torch.distributed``'s collectives and counts what each hook
hands them, as a ring/pairwise implementation puts them on the wire per rank (allreduce ``2 (N-1)/N`` of the tensor,
all-to-all ``(N-1)/N``, all-gather ``(N-1)`` times the input), averaged over the steps after warm-up (the compressed
phase). ``est_step_ms_at_1gbps`` adds the time those bytes take on a 1 Gbit/s link to the measured compute time
(this machine's loopback is far faster than any real network, so measured step times favour no compression).

    python benchmarks/onebit.py --quick --out /tmp/onebit.json
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import median, parser, ratio, report  # noqa: E402

CONFIGS = ("ddp", "fp16", "powersgd_r2", "onebit", "onebit_noef")
WORLD = 2


class _ByteCounter:
    """Wraps the collectives the hooks call and counts the bytes each rank sends."""

    def __init__(self) -> None:
        self.bytes = 0
        self.installed = False

    def install(self) -> None:
        import torch.distributed as dist

        if self.installed:
            return
        self.installed = True
        n = dist.get_world_size()

        def wrap(name: str, count):
            orig = getattr(dist, name)

            def f(*args: Any, **kwargs: Any):
                self.bytes += count(*args, **kwargs)
                return orig(*args, **kwargs)

            setattr(dist, name, f)

        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        wrap("all_reduce", lambda t, *a, **k: round(2 * (n - 1) / n * nbytes(t)))
        wrap("all_to_all_single", lambda out, inp, *a, **k: round((n - 1) / n * nbytes(inp)))
        for name in ("all_gather_single", "all_gather_into_tensor"):
            if hasattr(dist, name):
                wrap(name, lambda out, inp, *a, **k: (n - 1) * nbytes(inp))


def _data(seed: int = 0):
    import torch

    from lightning_accel.datasets.digits import load_digits_arrays

    images, labels = load_digits_arrays()
    x = torch.from_numpy(images.reshape(len(images), 64)).float() / 16.0
    y = torch.from_numpy(labels)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = len(x) // 5
    va, tr = perm[:n_val], perm[n_val:]
    return x[tr], y[tr], x[va], y[va]


def _model(hidden: int):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _worker(rank: int, cfg: dict, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_accel.comm import OneBitState, onebit_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    counter = _ByteCounter()
    counter.install()
    xtr, ytr, xva, yva = _data()
    warm = cfg["warmup_steps"]
    runs = {}
    for name in CONFIGS:
        model = _model(cfg["hidden"])
        ddp = DDP(model)
        if name == "ddp":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif name == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name == "powersgd_r2":
            state = psgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=warm)
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        else:
            state = OneBitState(warmup_steps=warm, parameters=model.parameters(), error_feedback=name == "onebit")
            ddp.register_comm_hook(state, onebit_hook)
        if cfg["optimizer"] == "adam":
            opt = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"])
        else:
            opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
        runs[name] = {"ddp": ddp, "opt": opt, "step": 0, "bytes": [], "times": [], "losses": [], "acc": 0.0}
    gb = cfg["batch_size"] * WORLD
    for epoch in range(cfg["epochs"]):
        order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(1000 + epoch))
        for name in CONFIGS:  # alternate: one epoch of each run in turn
            r = runs[name]
            ddp, opt = r["ddp"], r["opt"]
            ddp.train()
            epoch_losses = []
            for b in range(len(order) // gb):
                idx = order[b * gb : (b + 1) * gb][rank::WORLD]
                before = counter.bytes
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])
                loss.backward()
                opt.step()
                dt = time.perf_counter() - t0
                if r["step"] >= warm:
                    r["bytes"].append(counter.bytes - before)
                    r["times"].append(dt)
                r["step"] += 1
                epoch_losses.append(float(loss.detach()))
            # the epoch's mean training loss, averaged over ranks
            t = torch.tensor(sum(epoch_losses) / len(epoch_losses))
            dist.all_reduce(t)
            r["losses"].append(float(t) / WORLD)
            ddp.eval()
            with torch.no_grad():
                r["acc"] = float((ddp.module(xva).argmax(1) == yva).float().mean())
    out = {}
    for name, r in runs.items():
        st = r["ddp"]._get_ddp_logging_data()
        out[name] = {
            "val_acc": r["acc"],
            "train_loss": r["losses"][-1],
            "bytes_per_step": median(r["bytes"]) if r["bytes"] else 0.0,
            "step_ms": 1000 * median(r["times"]) if r["times"] else 0.0,
            "steps": r["step"],
            "comm_hook": st.get("comm_hook", ""),
            "params": sum(p.numel() for p in r["ddp"].parameters()),
        }
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="SGD (default) or Adam")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0; see docs/onebit.md)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 0.1 for SGD, 2e-3 for Adam)")
    args = p.parse_args()
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    cfg = {
        "epochs": 15 if args.quick else 30,
        # <= 1 MB of fp32 parameters: one DDP bucket. torch's powerSGD_hook deadlocks on gloo with several buckets
        # (it issues its second allreduce from gloo's callback thread, racing the next bucket's first one).
        "hidden": 256 if args.quick else 384,
        "batch_size": 32,
        "optimizer": args.optimizer,
        "momentum": args.momentum,
        "lr": args.lr if args.lr is not None else (0.1 if args.optimizer == "sgd" else 2e-3),
        "warmup_steps": 20,
        "port": free_port(),
    }
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_worker, args=(r, cfg, queue)) for r in range(WORLD)]
    for pr in procs:
        pr.start()
    deadline = time.monotonic() + (600 if args.quick else 1800)
    for pr in procs:
        pr.join(timeout=max(1.0, deadline - time.monotonic()))
    for pr in procs:
        if pr.is_alive():  # a hung collective: fail loudly instead of waiting forever
            pr.kill()
            pr.join()
    if any(pr.exitcode for pr in procs):
        raise SystemExit(f"a benchmark process failed (exit codes {[pr.exitcode for pr in procs]})")
    results = queue.get()
    gbps = 1e9 / 8  # bytes per second on a 1 Gbit/s link
    for r in results.values():
        r["est_step_ms_at_1gbps"] = r["step_ms"] + 1000 * r["bytes_per_step"] / gbps
    ddp, one, noef = results["ddp"], results["onebit"], results["onebit_noef"]
    ratios = {
        "bytes_fp32_over_1bit": ratio(ddp["bytes_per_step"], one["bytes_per_step"]),
        "acc_1bit_minus_ddp": round(one["val_acc"] - ddp["val_acc"], 4),
        "loss_noef_over_ef": ratio(noef["train_loss"], one["train_loss"]),
        "bytes_fp32_over_fp16": ratio(ddp["bytes_per_step"], results["fp16"]["bytes_per_step"]),
        "bytes_fp32_over_powersgd_r2": ratio(ddp["bytes_per_step"], results["powersgd_r2"]["bytes_per_step"]),
        "step_time_1bit_over_ddp": ratio(one["step_ms"], ddp["step_ms"]),
        "est_step_time_1gbps_1bit_over_ddp": ratio(one["est_step_ms_at_1gbps"], ddp["est_step_ms_at_1gbps"]),
        # below this link speed the bytes saved outweigh the compression work measured here
        "break_even_link_mbps": round(
            8 * (ddp["bytes_per_step"] - one["bytes_per_step"]) / max(1e-9, one["step_ms"] - ddp["step_ms"]) / 1e3, 1
        ),
    }
    cfg["world_size"] = WORLD
    cfg["wall_s"] = round(time.perf_counter() - t0, 1)
    report(
        "onebit",
        quick=args.quick,
        config=cfg,
        results=results,
        ratios=ratios,
        out=args.out,
        chart={k: ratios[k] for k in ("bytes_fp32_over_1bit", "bytes_fp32_over_fp16", "bytes_fp32_over_powersgd_r2")},
        chart_title="fp32 bytes / scheme bytes",
    )


if __name__ == "__main__":
    main()
