"""Benchmark ``ddp_1bit`` against plain DDP: accuracy on four recipes, the shaped link, the compressor's host cost.

CPU half (the ``onebit`` report), all in one run:

- **Accuracy.** Two CPU processes (gloo) train the 8x8 digits with the same seeds and data order under DDP,
  ``ddp_1bit`` (``compression="1bit"``, what ``compress="auto"`` picks: compressed momentum for SGD-momentum and
  AdamW, compressed gradients for plain SGD) and ``ddp_1bit`` without error feedback, mean of 2 seeds: (a) a small
  CNN with plain SGD, (b) SGD momentum 0.9 lr 0.05, (c) AdamW lr 1e-3 wd 0.01, (d) a 2-layer transformer encoder
  (d=64, the 8 rows as 8 tokens) with AdamW lr 1e-3 and gradient clipping 1.0. All runs advance one epoch at a time
  in turn. The runs use the strategy's core exactly as ``OneBitDDPStrategy`` wires it (the comm hook, and the
  compressed momentum step in place of ``optimizer.step``), without the Trainer's per-step overhead.
- **A causal LM** (``benchmarks/localsteps.py``'s job: a character GPT on the standard library's source, AdamW
  with warm-up + cosine, clipping, 240 steps, 600 in the full run), 2 and 4 gloo processes: held-out loss of DDP,
  ``ddp_1bit`` with its default arguments (``compression="auto"`` may keep fp32: its choice is recorded) and
  ``ddp_1bit(compression="1bit")``, which always compresses.
- **Shaped link and host cost** (``benchmarks/_onebit_link.py``, when present): DDP, ``ddp_1bit`` and ``auto`` step
  times on a veth pair between two network namespaces shaped with ``tc tbf``, the bisected break-even link speed, and
  the compressor's time per 1M values over one ``torch.add``.

Bytes are measured, not computed: the benchmark wraps ``torch.distributed``'s collectives and counts what each
scheme hands them, as a ring/pairwise implementation puts them on the wire per rank (allreduce ``2 (N-1)/N`` of the
tensor, all-to-all ``(N-1)/N``, all-gather ``(N-1)`` times the input), per step after warm-up.

    python benchmarks/onebit.py --quick --out /tmp/onebit.json

``--device cuda`` runs the GPU half instead (report ``onebit_cuda``): the fused Triton compressor against the torch
one on a 16M-element buffer (64M in the full run), alternated, as GB/s and ``compress_triton_vs_torch``; and, with
two or more GPUs, DDP / fp16 / PowerSGD / 1-bit gradient schemes on an MLP over NCCL with one process per GPU
(``nccl_*`` ratios).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/onebit.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import median, parser, ratio, report, run_cases

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


def _scheme(name: str, model: Any, cfg: dict[str, Any], launch: dict[str, Any]) -> dict[str, Any]:
    """One run: ``model`` in DDP with the scheme's comm hook, its optimizer, and what the epochs will record."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_accel.comm import OneBitState, onebit_hook

    warm = cfg["warmup_steps"]
    ddp = DDP(model, device_ids=[model[0].weight.device.index] if launch["device"] == "cuda" else None)
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
    return {"ddp": ddp, "opt": opt, "step": 0, "bytes": [], "times": [], "losses": [], "acc": 0.0}


def _train_epoch(
    r: dict[str, Any],
    order: Any,
    data: tuple[Any, ...],
    rank: int,
    cfg: dict[str, Any],
    launch: dict[str, Any],
    counter: _ByteCounter,
) -> None:
    """One epoch of one run: per step the bytes its hook handed the collectives and the step time after warm-up."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    xtr, ytr, xva, yva = data
    world = launch["world_size"]
    sync = torch.cuda.synchronize if launch["device"] == "cuda" else (lambda: None)
    ddp, opt = r["ddp"], r["opt"]
    ddp.train()
    gb = cfg["batch_size"] * world
    epoch_losses = []
    for b in range(len(order) // gb):
        idx = order[b * gb : (b + 1) * gb][rank::world]
        before = counter.bytes
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
        sync()  # GPU work is asynchronous: the step ends when the device is done
        dt = time.perf_counter() - t0
        if r["step"] >= cfg["warmup_steps"]:
            r["bytes"].append(counter.bytes - before)
            r["times"].append(dt)
        r["step"] += 1
        epoch_losses.append(float(loss.detach()))
    # the epoch's mean training loss, averaged over ranks
    t = torch.tensor(sum(epoch_losses) / len(epoch_losses), device=xtr.device)
    dist.all_reduce(t)
    r["losses"].append(float(t) / world)
    ddp.eval()
    with torch.no_grad():
        r["acc"] = float((ddp.module(xva).argmax(1) == yva).float().mean())


def _worker(rank: int, cfg: dict[str, Any], launch: dict[str, Any], queue: Any) -> None:
    """One rank: every scheme from the same model and data, one epoch of each in turn; rank 0 reports.

    ``launch``: ``{"device": "cpu" | "cuda", "backend": "gloo" | "nccl", "world_size": N}`` (one GPU per rank).
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if launch["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(launch["backend"], rank=rank, world_size=launch["world_size"])
    counter = _ByteCounter()
    counter.install()
    data = tuple(t.to(device) for t in _data())
    runs = {name: _scheme(name, _model(cfg["hidden"]).to(device), cfg, launch) for name in CONFIGS}
    for epoch in range(cfg["epochs"]):
        order = torch.randperm(len(data[0]), generator=torch.Generator().manual_seed(1000 + epoch)).to(device)
        for name in CONFIGS:  # alternate: one epoch of each run in turn
            _train_epoch(runs[name], order, data, rank, cfg, launch, counter)
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


def parse_args() -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="SGD (default) or Adam")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0; see docs/onebit.md)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 0.1 for SGD, 2e-3 for Adam)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: the schemes on 2 gloo processes (default); cuda: the GPU half (Triton compressor bandwidth, the "
        "schemes over NCCL with one process per GPU)",
    )
    return p.parse_args()


def scheme_config(args: argparse.Namespace) -> dict[str, Any]:
    """The training knobs shared by every scheme (the JSON's ``config``)."""
    from tests.helpers import free_port

    return {
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


def train_schemes(cfg: dict[str, Any], *, device: str, world_size: int, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Case: every scheme trained on ``world_size`` processes (gloo on CPU, NCCL with one GPU each on ``"cuda"``);
    per scheme validation accuracy, training loss, bytes per step, step time."""
    import torch.multiprocessing as mp

    launch = {"device": device, "backend": "nccl" if device == "cuda" else "gloo", "world_size": world_size}
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, cfg, launch, queue)) for r in range(world_size)]
    for pr in procs:
        pr.start()
    deadline = time.monotonic() + timeout_s
    for pr in procs:
        pr.join(timeout=max(1.0, deadline - time.monotonic()))
    for pr in procs:
        if pr.is_alive():  # a hung collective: fail loudly instead of waiting forever
            pr.kill()
            pr.join()
    if any(pr.exitcode for pr in procs):
        raise SystemExit(f"a benchmark process failed (exit codes {[pr.exitcode for pr in procs]})")
    results: dict[str, dict[str, Any]] = queue.get()
    gbps = 1e9 / 8  # bytes per second on a 1 Gbit/s link
    for r in results.values():
        r["est_step_ms_at_1gbps"] = r["step_ms"] + 1000 * r["bytes_per_step"] / gbps
    return results


def scheme_ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The published ratios: bytes against fp32 DDP, accuracy and loss effects, step-time costs."""
    ddp, one, noef = results["ddp"], results["onebit"], results["onebit_noef"]
    return {
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


def compressor_bandwidth(quick: bool, device: str) -> tuple[dict[str, Any], dict[str, float]]:
    """Case (GPU half): the fused Triton compressor against the torch one on one flat buffer, with error feedback.

    Timed alternately (``repeats`` rounds, CUDA events on a GPU); bandwidth counts the bytes each must move at least:
    gradient and error read, new error written (fp32), the mask read (1 byte), the signs written (1/8 byte).
    Off CUDA the Triton kernel runs only under ``TRITON_INTERPRET=1`` (a correctness check, not a speed).
    """
    import torch

    from lightning_accel.comm.compress import GroupLayout, compress_reference

    numel = (1 << 24 if quick else 1 << 26) if device == "cuda" else 1 << 12
    layout = GroupLayout([numel // 4] * 4, world_size=1, block_size=2048, device=torch.device(device))
    gen = torch.Generator().manual_seed(0)
    grad = (torch.randn(layout.padded_numel, generator=gen) * layout.table.mask.cpu()).to(device)
    error = (torch.randn(layout.padded_numel, generator=gen) * 1e-3 * layout.table.mask.cpu()).to(device)
    impls: dict[str, Any] = {"torch": compress_reference}
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from lightning_accel.comm.triton_kernels import compress_triton

        impls["triton"] = compress_triton
    outs = {name: fn(grad, error, layout.table) for name, fn in impls.items()}  # also compiles the kernel
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(3 if quick else 5):  # alternate the implementations round by round
        for name, fn in impls.items():
            times[name].append(_timed(lambda fn=fn: fn(grad, error, layout.table), device, iters=10 if quick else 30))
    moved = layout.padded_numel * (3 * 4 + 1) + layout.padded_numel // 8
    results: dict[str, Any] = {"numel": layout.padded_numel, "blocks": layout.num_blocks, "bytes_moved": moved}
    for name, ts in times.items():
        results[f"{name}_ms"] = 1e3 * median(ts)
        results[f"{name}_GBps"] = moved / median(ts) / 1e9
    ratios: dict[str, float] = {}
    if "triton" in outs:
        (p_ref, s_ref, e_ref), (p_tri, s_tri, e_tri) = outs["torch"], outs["triton"]
        results["packed_identical"] = bool(torch.equal(p_ref, p_tri))
        results["scales_max_rel_err"] = float(((s_tri - s_ref).abs().max() / s_ref.abs().max()).item())
        results["error_max_abs_diff"] = float((e_tri - e_ref).abs().max().item())
        ratios["compress_triton_vs_torch"] = ratio(median(times["torch"]), median(times["triton"]))
        ratios["compress_triton_GBps"] = round(results["triton_GBps"], 1)
    return results, ratios


def _timed(step: Any, device: str, iters: int) -> float:
    """Seconds per call of ``step`` (CUDA events around ``iters`` back-to-back calls on a GPU; host clock on CPU)."""
    import torch

    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        return (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


# ---------------------------------------------------------------------------------------------- accuracy (CPU half)
RECIPES = ("sgd", "sgdm", "adamw", "transformer_adamw")
ACC_SCHEMES = ("ddp", "onebit", "onebit_noef")


def _digits_tensors():
    """The 8x8 digits as ``(N, 8, 8)`` floats in [0, 1], a fixed 80/20 split (the same for every run)."""
    import torch

    from lightning_accel.datasets.digits import load_digits_arrays

    images, labels = load_digits_arrays()
    x = torch.from_numpy(images.reshape(len(images), 8, 8)).float() / 16.0
    y = torch.from_numpy(labels).long()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_val = len(x) // 5
    va, tr = perm[:n_val], perm[n_val:]
    return x[tr], y[tr], x[va], y[va]


def _recipe_model(recipe: str, seed: int):
    """(a)-(c): a small CNN on the 8x8 images; (d): a 2-layer transformer encoder (d=64), the 8 rows as 8 tokens."""
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    if recipe != "transformer_adamw":
        return nn.Sequential(
            nn.Unflatten(1, (1, 8)),
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    class RowTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 64)
            self.pos = nn.Parameter(torch.randn(8, 64) * 0.02)
            layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(x) + self.pos).mean(dim=1))

    return RowTransformer()


def _recipe_optimizer(recipe: str, params: Any):
    import torch

    if recipe == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if recipe == "sgdm":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _acc_run(recipe: str, scheme: str, seed: int, warmup: int) -> dict[str, Any]:
    """One run: the recipe's model in DDP, plain (``ddp``) or with ``ddp_1bit``'s core exactly as the strategy wires it:
    the comm hook, and compressed momentum in place of ``optimizer.step`` where the optimizer supports it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_accel.comm import MomentumCompressor, OneBitState, momentum_kind, onebit_hook

    model = _recipe_model(recipe, seed)
    ddp = DDP(model)
    opt = _recipe_optimizer(recipe, ddp.parameters())
    comp = None
    if scheme == "ddp":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # the same allreduce, through the byte counter
    else:
        mode = "momentum" if momentum_kind(opt) else "gradients"  # what compressed_signal="auto" picks
        state = OneBitState(
            warmup_steps=warmup,
            # the strategy's default unless ONEBIT_BLOCK overrides it (exploration runs)
            block_size=int(os.environ.get("ONEBIT_BLOCK", OneBitState().config.block_size)),
            compressed_signal=mode,
            compression="1bit",
            error_feedback=scheme == "onebit",
            parameters=model.parameters(),
        )
        state.mode = mode
        ddp.register_comm_hook(state, onebit_hook)
        if mode == "momentum":
            comp = MomentumCompressor(opt, state)
    return {
        "ddp": ddp,
        "opt": opt,
        "comp": comp,
        "hook_state": None if scheme == "ddp" else state,
        "step": 0,
        "bytes": [],
        "loss": 0.0,
        "acc": 0.0,
        "clip": recipe == "transformer_adamw",
        "warmup": warmup,
    }


def _acc_epoch(r: dict[str, Any], data: tuple[Any, ...], order: Any, rank: int, counter: _ByteCounter) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    xtr, ytr, xva, yva = data
    ddp, opt, comp, st = r["ddp"], r["opt"], r["comp"], r["hook_state"]
    gb = 32 * WORLD
    losses = []
    ddp.train()
    for b in range(len(order) // gb):
        idx = order[b * gb : (b + 1) * gb][rank::WORLD]
        before = counter.bytes
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])
        loss.backward()
        if r["clip"]:  # what Lightning's gradient_clip_val=1.0 does: the local gradient in the compressed stage
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        if comp is not None and st.local_grads:
            comp.compressed_step()
        else:
            opt.step()
        if r["step"] >= r["warmup"]:
            r["bytes"].append(counter.bytes - before)
        r["step"] += 1
        losses.append(float(loss.detach()))
    t = torch.tensor(sum(losses) / len(losses))
    dist.all_reduce(t)
    r["loss"] = float(t) / WORLD
    ddp.eval()
    with torch.no_grad():
        r["acc"] = float((ddp.module(xva).argmax(1) == yva).float().mean())


def _acc_worker(rank: int, cfg: dict[str, Any], queue: Any) -> None:
    """One rank: every (recipe, scheme, seed) run from the same data, one epoch of each in turn; rank 0 reports."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    counter = _ByteCounter()
    counter.install()
    data = _digits_tensors()
    runs = {
        (recipe, scheme, seed): _acc_run(recipe, scheme, seed, cfg["warmup_steps"])
        for recipe in cfg["recipes"]
        for scheme in ACC_SCHEMES
        for seed in cfg["seeds"]
    }
    t0 = time.perf_counter()
    for epoch in range(cfg["epochs"]):
        for (_recipe, _scheme, seed), r in runs.items():  # alternate: one epoch of each run in turn
            g = torch.Generator().manual_seed(1000 * seed + epoch)  # same order for every scheme of a seed
            _acc_epoch(r, data, torch.randperm(len(data[0]), generator=g), rank, counter)
    out = {
        f"{recipe}/{scheme}/seed{seed}": {
            "val_acc": r["acc"],
            "train_loss": r["loss"],
            "bytes_per_step": median(r["bytes"]) if r["bytes"] else 0.0,
            "steps": r["step"],
            "params": sum(p.numel() for p in r["ddp"].parameters()),
            "compressed": "momentum" if r["comp"] is not None else ("gradients" if scheme != "ddp" else "none"),
        }
        for (recipe, scheme, seed), r in runs.items()
    }
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def accuracy_config(quick: bool) -> dict[str, Any]:
    """The accuracy case's knobs (the JSON's ``config["accuracy"]``); ``ONEBIT_EPOCHS`` / ``ONEBIT_RECIPES``
    (comma-separated) override the epochs and the recipes for exploration runs."""
    from tests.helpers import free_port

    # both runs train to convergence (30 epochs): in shorter runs the recipes are still mid-descent and the
    # final-epoch accuracy swings between consecutive epochs in *both* arms (ONEBIT_EPOCHS runs a shorter one to see
    # it), so a shorter run measures that swing, not the scheme; --quick saves its time on the link case instead
    epochs = int(os.environ.get("ONEBIT_EPOCHS", 30))
    steps_per_epoch = (1797 - 1797 // 5) // (32 * WORLD)
    return {
        "recipes": os.environ.get("ONEBIT_RECIPES", ",".join(RECIPES)).split(","),
        "schemes": list(ACC_SCHEMES),
        "seeds": [0, 1],
        "epochs": epochs,
        "batch_per_rank": 32,
        # ~15 % of training, the 1-bit Adam rule: Adam's variance is frozen at its end
        "warmup_steps": round(0.15 * epochs * steps_per_epoch),
        "block_size": int(os.environ.get("ONEBIT_BLOCK", 640)),  # 640: OneBitDDPStrategy's default
        "compression": "1bit (forced: the accuracy case measures the compressed algorithm, not auto's choice)",
        "lr": {
            "sgd": 0.1,
            "sgdm": "0.05, momentum 0.9",
            "adamw": "1e-3, wd 0.01",
            "transformer_adamw": "1e-3, wd 0.01, clip 1.0",
        },
        "port": free_port(),
    }


def accuracy_cases(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Case: DDP vs ``ddp_1bit`` vs ``ddp_1bit`` without error feedback on the four recipes, mean of 2 seeds."""
    import torch.multiprocessing as mp

    cfg = accuracy_config(quick)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_acc_worker, args=(r, cfg, queue)) for r in range(WORLD)]
    for pr in procs:
        pr.start()
    deadline = time.monotonic() + (900 if quick else 3600)
    for pr in procs:
        pr.join(timeout=max(1.0, deadline - time.monotonic()))
    for pr in procs:
        if pr.is_alive():
            pr.kill()
            pr.join()
    if any(pr.exitcode for pr in procs):
        raise SystemExit(f"an accuracy process failed (exit codes {[pr.exitcode for pr in procs]})")
    runs = queue.get()
    results: dict[str, Any] = {"config": cfg, "runs": runs}
    for recipe in cfg["recipes"]:
        for scheme in ACC_SCHEMES:
            rs = [runs[f"{recipe}/{scheme}/seed{s}"] for s in cfg["seeds"]]
            results[f"{recipe}/{scheme}"] = {
                k: round(sum(r[k] for r in rs) / len(rs), 4) for k in ("val_acc", "train_loss", "bytes_per_step")
            }
    mean = lambda recipe, scheme, k: results[f"{recipe}/{scheme}"][k]  # noqa: E731
    ratios = {
        "bytes_fp32_over_1bit": ratio(mean("sgdm", "ddp", "bytes_per_step"), mean("sgdm", "onebit", "bytes_per_step")),
        **{
            f"acc_1bit_minus_ddp_{recipe}": round(mean(recipe, "onebit", "val_acc") - mean(recipe, "ddp", "val_acc"), 4)
            for recipe in cfg["recipes"]
        },
        "loss_noef_over_ef_sgdm": ratio(
            mean("sgdm", "onebit_noef", "train_loss"), mean("sgdm", "onebit", "train_loss")
        ),
    }
    return results, ratios


#: the causal-LM case: name -> (strategy, arguments)
LM_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "onebit_default": ("ddp_1bit", {}),
    "onebit_1bit": ("ddp_1bit", {"compression": "1bit"}),
}


def _lm_fits(rank: int, world: int, steps: int) -> dict[str, Any]:
    from benchmarks.localsteps import _summary, fit_one

    return {
        name: _summary(fit_one(name, steps, 0, devices=world, spec=spec), steps) for name, spec in LM_CONFIGS.items()
    }


def lm_cases(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Case: the causal LM at 2 and 4 processes (one launch per world size, the fits in turn)."""
    from tests.helpers import run_in_processes

    steps = 240 if quick else 600
    results: dict[str, Any] = {"steps": steps}
    ratios: dict[str, float] = {}
    for world in (2, 4):
        res = run_in_processes(_lm_fits, world, args=(steps,), init_process_group=False, timeout=1800)[0]
        results[f"ws{world}"] = res
        ddp = res["ddp"]["held_out_loss"]
        ratios[f"lm_loss_1bit_over_ddp_ws{world}"] = round(res["onebit_default"]["held_out_loss"] / ddp, 4)
        ratios[f"lm_loss_1bit_forced_over_ddp_ws{world}"] = round(res["onebit_1bit"]["held_out_loss"] / ddp, 4)
        ratios[f"lm_bytes_ddp_over_1bit_forced_ws{world}"] = round(
            res["ddp"]["bytes_per_step"] / max(1.0, res["onebit_1bit"]["bytes_per_step"]), 1
        )
    return results, ratios


def link_and_host_cases(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Cases: the shaped link (two network namespaces, veth, ``tc tbf``) and the host cost of the compressor, from
    ``benchmarks/_onebit_link.py``; recorded as not run when that module is absent."""
    try:
        from benchmarks._onebit_link import run_host_cost, run_link_cases
    except ImportError as e:
        return {"link": f"not run: benchmarks/_onebit_link.py is not importable ({e})"}, {}
    return run_cases({"link": run_link_cases, "host_cost": run_host_cost}, quick)


def main_cpu(args: argparse.Namespace) -> None:
    """Accuracy on 2 gloo processes, the shaped link and the host cost: the published ``onebit`` report."""
    t0 = time.perf_counter()
    acc_results, ratios = accuracy_cases(args.quick)
    lm_results, lm_ratios = lm_cases(args.quick)
    ratios.update(lm_ratios)
    link_results, link_ratios = link_and_host_cases(args.quick)
    ratios.update(link_ratios)
    cfg = {"world_size": WORLD, "accuracy": acc_results.pop("config"), "wall_s": round(time.perf_counter() - t0, 1)}
    report(
        "onebit",
        quick=args.quick,
        config=cfg,
        results={"accuracy": acc_results, "lm": lm_results, **link_results},
        ratios=ratios,
        out=args.out,
        chart={k: v for k, v in ratios.items() if k.startswith("acc_")},
        chart_title="ddp_1bit val accuracy minus DDP's (mean of 2 seeds)",
    )


def main_cuda(args: argparse.Namespace) -> None:
    """The GPU half: compressor bandwidth on one GPU, then the schemes over NCCL when there are 2+ GPUs."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("`--device cuda` needs a CUDA device; this machine has none. Run without `--device`.")
    t0 = time.perf_counter()
    world = min(torch.cuda.device_count(), 8)
    comp_results, ratios = compressor_bandwidth(args.quick, "cuda")
    results: dict[str, Any] = {"compressor": comp_results, "device": torch.cuda.get_device_name(0)}
    cfg = {**scheme_config(args), "world_size": world, "backend": "nccl"}
    if world >= 2:
        schemes = train_schemes(cfg, device="cuda", world_size=world, timeout_s=300 if args.quick else 900)
        results["nccl"] = schemes
        ratios.update({f"nccl_{k}": v for k, v in scheme_ratios(schemes).items()})
    else:  # NCCL refuses two ranks on one GPU, and 1-bit averaging needs at least two ranks
        results["nccl"] = f"not measured: {world} GPU (the schemes need one GPU per rank, at least 2)"
    cfg["wall_s"] = round(time.perf_counter() - t0, 1)
    report(
        "onebit_cuda",
        quick=args.quick,
        config=cfg,
        results=results,
        ratios=ratios,
        out=args.out,
        chart_title="1-bit on CUDA: Triton compressor speed-up, NCCL ratios",
    )


def main() -> None:
    args = parse_args()
    if args.device == "cuda":
        main_cuda(args)
    else:
        main_cpu(args)


if __name__ == "__main__":
    main()
