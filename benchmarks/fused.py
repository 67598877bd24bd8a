"""Benchmark: FusedPrecision (fused ops + surgery) against eager mixed precision, torch.compile and the references.

    python benchmarks/fused.py [--quick] --out FILE.json

On any machine (the CPU part):

- numerics per op: the max relative error (``max|fused - oracle| / max|oracle|``) of each fused op's forward and
  backward in float32 against its pure-torch oracle, on the torch path and on the Triton kernels under the
  interpreter (a subprocess with ``TRITON_INTERPRET=1``); ``ratios.max_rel_err_fp32`` is the largest of them;
- reference-path timings: train-step time (forward + backward) of a SmallResNet and of GPT blocks, eager vs fused
  (surgery applied), alternated in one process, in float32 on the CPU;
- saved activation memory: bytes autograd keeps for backward per step, eager vs fused (measured with
  ``saved_tensors_hooks``, device-independent);
- the model zoo: torchvision ResNet-18, MobileNetV3-Small, a small torchvision VisionTransformer, an
  ``nn.TransformerEncoder`` of post-norm and one of pre-norm layers, and GPT-2 style blocks, each fused with
  ``backend="reference"``: the surgery's coverage (fused / eligible modules, the skipped ones with their reasons),
  forward and gradient error against eager in float32 (dropout off, so both draw no masks; BatchNorm in training),
  running statistics after the step, eval-mode outputs, and ``state_dict`` round trips loaded with ``strict=True`` both
  ways. ``ratios.fusion_coverage_min`` is the lowest coverage (target >= 0.9) and
  ``ratios.fused_ref_grad_rel_err_max`` the largest gradient error (target <= 1e-5).

With a CUDA GPU (the CUDA part): step time (median of CUDA-event timings) and peak memory of torchvision ResNet-50
and a GPT-style block stack at realistic sizes under bf16 autocast for eager MixedPrecision, FusedPrecision,
FusedPrecision + torch.compile and torch.compile alone, giving ``fused_vs_eager_step`` (GPT blocks),
``fused_vs_compile_step`` (GPT blocks) and ``fused_vs_eager_peak_mem`` (ResNet-50); then the model zoo at GPU sizes,
eager vs fused vs torch.compile (``zoo_<model>_fused_vs_eager_step``, ``..._fused_vs_compile_step``,
``..._fused_vs_eager_peak_mem``). ``--budget-s`` bounds the CUDA part: every model's eager and fused variants run
first, the compiles (the slow ones) after, and a variant that would start after the budget is spent is recorded as
skipped, and a variant that fails is recorded with its
error, so one run unattended always writes its report. ``--device cuda`` runs the CUDA part alone (report
``fused_cuda``; what ``benchmarks/gpu_suite.sh`` runs), ``--device cpu`` the CPU part alone. ``--dry-run`` runs the
CUDA part's code on the CPU at toy sizes (wall-clock timings, no peak memory, ``torch.compile(backend="eager")``), to
check it without a GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from benchmarks._harness import alternate, cuda_time, median, parser, ratio, report

REPO = Path(__file__).resolve().parent.parent


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


# --------------------------------------------------------------------------------------------------------- numerics


def op_numerics(backend: str) -> dict[str, float]:
    """Forward/backward max relative error of each op in float32 against its oracle (odd shapes)."""
    from lightning_accel.ops.conv_bn_relu import conv_bn_relu
    from lightning_accel.ops.conv_bn_relu import reference as cbr_ref
    from lightning_accel.ops.linear_dropout import linear_dropout
    from lightning_accel.ops.linear_dropout import reference as ld_ref
    from lightning_accel.ops.norm import layer_norm, rms_norm
    from lightning_accel.ops.norm import reference as norm_ref

    torch.manual_seed(0)
    out: dict[str, float] = {}

    def check(name: str, fused: Callable[..., torch.Tensor], oracle: Callable[..., torch.Tensor], *inputs: Any) -> None:
        a = [t.detach().clone().requires_grad_() if torch.is_tensor(t) else t for t in inputs]
        b = [t.detach().clone().requires_grad_() if torch.is_tensor(t) else t for t in inputs]
        ya, yb = fused(*a), oracle(*b)
        dy = torch.randn_like(yb)
        ya.backward(dy)
        yb.backward(dy)
        out[f"{name}.fwd"] = rel_err(ya, yb)
        grads = [
            rel_err(x.grad, y.grad) for x, y in zip(a, b, strict=True) if torch.is_tensor(x) and y.grad is not None
        ]
        out[f"{name}.bwd"] = max(grads)

    x, w, bias = torch.randn(37, 129), torch.randn(129), torch.randn(129)
    check(
        "layer_norm",
        lambda x, w, b: layer_norm(x, w, b, 1e-5, backend),
        lambda x, w, b: norm_ref.layer_norm(x, w, b, 1e-5),
        x,
        w,
        bias,
    )  # noqa: E501
    check("rms_norm", lambda x, w: rms_norm(x, w, 1e-6, backend), lambda x, w: norm_ref.rms_norm(x, w, 1e-6), x, w)
    xl, wl, bl, rl = torch.randn(3, 13, 19), torch.randn(23, 19) / 19**0.5, torch.randn(23), torch.randn(3, 13, 23)
    if backend == "triton":
        from lightning_accel.ops.linear_dropout import triton as kernels

        keep = kernels.dropout_keep_mask(11, 39, 23, 0.2, "cpu").view(3, 13, 23)
    else:
        keep = ld_ref.dropout_mask(11, (39, 23), 0.2, "cpu").view(3, 13, 23)
    check(
        "linear_dropout_residual",
        lambda x, w, b, r: linear_dropout(x, w, b, 0.2, True, r, seed=11, backend=backend),
        lambda x, w, b, r: ld_ref.linear_dropout(x, w, b, keep, 0.2, r),
        xl, wl, bl, rl,
    )  # fmt: skip
    if backend == "triton":
        check(
            "linear_dropout_residual.triton_gemm",
            lambda x, w, b, r: linear_dropout(x, w, b, 0.2, True, r, seed=11, backend=backend, gemm="triton"),
            lambda x, w, b, r: ld_ref.linear_dropout(x, w, b, keep, 0.2, r),
            xl, wl, bl, rl,
        )  # fmt: skip
    xc, wc = torch.randn(3, 5, 9, 7), torch.randn(6, 5, 3, 3) / 45**0.5
    g, be = torch.rand(6) + 0.5, torch.randn(6)
    for act in ("relu", "hardswish", "gelu"):
        name = "conv_bn_relu" if act == "relu" else f"conv_bn_{act}"
        check(
            name,
            lambda x, w, g, b, a=act: conv_bn_relu(
                x, w, None, g, b, None, None, True, 0.1, 1e-5, 2, 1, backend=backend, activation=a
            ),
            lambda x, w, g, b, a=act: cbr_ref.conv_bn_relu(
                x, w, None, g, b, None, None, True, 0.1, 1e-5, 2, 1, activation=a
            ),
            xc, wc, g, be,
        )  # fmt: skip
    check(
        "linear_gelu_dropout",
        lambda x, w, b: linear_dropout(x, w, b, 0.2, True, seed=11, backend=backend, activation="gelu"),
        lambda x, w, b: ld_ref.linear_dropout(x, w, b, keep, 0.2, activation="gelu"),
        xl, wl, bl,
    )  # fmt: skip
    return out


def interpreter_numerics() -> dict[str, float] | str:
    """:func:`op_numerics` for the Triton kernels, in a subprocess with ``TRITON_INTERPRET=1``."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--interp-numerics"], env=env, capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return "timed out"
    if proc.returncode != 0:
        return f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------- CPU timings


def saved_activation_bytes(step: Callable[[], torch.Tensor]) -> int:
    """Bytes of distinct storages autograd saves for backward during ``step()`` (the loss's graph)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(seen.values())


def _train_step(model: nn.Module, make_input: Callable[[], torch.Tensor], autocast: torch.dtype | None) -> Callable:
    device = next(model.parameters()).device.type

    def forward() -> torch.Tensor:
        with torch.autocast(device, dtype=autocast or torch.float32, enabled=autocast is not None):
            return model(make_input()).float().square().mean()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        forward().backward()

    return forward, step


def cpu_models(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Eager vs fused (``backend="reference"``) train-step time and saved activation bytes on the CPU (float32)."""
    from lightning_accel.models import GPTBlock, SmallResNet
    from lightning_accel.precision import apply_fusions

    torch.manual_seed(0)
    cases = {
        "small_resnet": (
            SmallResNet(width=16, blocks=(1, 1, 1)),
            (lambda: torch.randn(16, 3, 32, 32)),
        ),
        "gpt_blocks": (
            nn.Sequential(*[GPTBlock(128, 4, dropout=0.1) for _ in range(2)]),
            (lambda: torch.randn(8, 64, 128)),
        ),
    }
    results: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for name, (eager, make_input) in cases.items():
        fused = copy.deepcopy(eager)
        apply_fusions(fused, warn_if_empty=False, backend="reference")  # the fused functions, not auto's eager ops
        fwd_e, step_e = _train_step(eager, make_input, None)
        fwd_f, step_f = _train_step(fused, make_input, None)
        mem_e, mem_f = saved_activation_bytes(fwd_e), saved_activation_bytes(fwd_f)
        times = alternate({"eager": step_e, "fused": step_f}, repeats=5 if quick else 20, warmup=2)
        results[name] = {
            "eager_step_ms": 1e3 * median(times["eager"]),
            "fused_step_ms": 1e3 * median(times["fused"]),
            "eager_saved_MB": mem_e / 2**20,
            "fused_saved_MB": mem_f / 2**20,
        }
        ratios[f"cpu_{name}_fused_vs_eager_step"] = ratio(median(times["eager"]), median(times["fused"]))
        ratios[f"cpu_{name}_saved_act_fused_over_eager"] = ratio(mem_f, mem_e)
    return results, ratios


# --------------------------------------------------------------------------------------------------------- model zoo


ZOO_MODELS = (
    "resnet18",
    "mobilenet_v3_small",
    "vit",
    "transformer_encoder_post",
    "transformer_encoder_pre",
    "gpt2_blocks",
)


def zoo_model(name: str, size: str) -> tuple[nn.Module, Callable[[torch.device], torch.Tensor]]:
    """A zoo model (random weights, never downloaded) and its input maker; ``size``: ``"cpu"``, ``"toy"``, ``"gpu"``."""
    import torchvision

    from lightning_accel.models.gpt2 import GPT2Block

    gpu = size == "gpu"
    img, batch = (224, 64) if gpu else (64 if size == "cpu" else 32, 4 if size == "cpu" else 2)
    if name in ("resnet18", "mobilenet_v3_small"):
        net = getattr(torchvision.models, name)(weights=None)
        return net, lambda dev: torch.randn(batch, 3, img, img, device=dev)
    if name == "vit":
        cfg = (
            {"image_size": 224, "patch_size": 16, "num_layers": 6, "num_heads": 8, "hidden_dim": 512, "mlp_dim": 2048}
            if gpu
            else {"image_size": 32, "patch_size": 8, "num_layers": 2, "num_heads": 2, "hidden_dim": 32, "mlp_dim": 64}
        )
        vit = torchvision.models.VisionTransformer(**cfg, dropout=0.1)
        nn.init.normal_(vit.heads.head.weight, std=0.02)  # torchvision zeroes it: the output would be all zeros
        b, s = (32, cfg["image_size"]) if gpu else (2, 32)
        return vit, lambda dev: torch.randn(b, 3, s, s, device=dev)
    d, heads, layers, seq, b = (512, 8, 6, 256, 16) if gpu else (32, 2, 2, 7, 2)
    if name.startswith("transformer_encoder"):
        pre = name.endswith("pre")
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.1, batch_first=pre, norm_first=pre, activation="gelu" if pre else "relu"
        )
        enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        shape = (b, seq, d) if pre else (seq, b, d)
        return enc, lambda dev: torch.randn(*shape, device=dev)
    if name == "gpt2_blocks":
        d, heads, layers, seq, b = (768, 12, 6, 512, 8) if gpu else (32, 2, 2, 7, 2)
        blocks = nn.Sequential(*[GPT2Block(d, heads, dropout=0.1) for _ in range(layers)])
        return blocks, lambda dev: torch.randn(b, seq, d, device=dev)
    raise ValueError(f"`name` must be one of {ZOO_MODELS}, got {name!r}.")


def _no_dropout(model: nn.Module) -> None:
    """Dropout probabilities to 0 (modules and MultiheadAttention), so eager and fused draw no masks."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0


def grad_rel_err(fused: nn.Module, eager: nn.Module, exact: nn.Module) -> tuple[float, str, int]:
    """Largest per-parameter ``max|g_fused - g_eager| / max|g_eager|``, its parameter name, and how many parameters
    were left out.

    ``exact`` is the eager model run in float64 on the same input: parameters whose float64 gradient is zero (a bias
    feeding a BatchNorm, which is shift-invariant; below ``1e-10`` of the largest gradient) are left out, since in
    float32 their gradient is rounding noise in both models.
    """
    triples = [
        (n, a.grad, b.grad, c.grad)
        for (n, a), b, c in zip(fused.named_parameters(), eager.parameters(), exact.parameters(), strict=True)
        if b.grad is not None and c.grad is not None
    ]
    top = max(float(c.abs().max()) for *_, c in triples)
    worst, name, left_out = 0.0, "", 0
    for n, ga, gb, gc in triples:
        if ga is None:
            return float("inf"), n, left_out
        if float(gc.abs().max()) <= 1e-10 * top:
            left_out += 1
            continue
        err = float((ga - gb).abs().max()) / float(gb.abs().max())
        if err > worst:
            worst, name = err, n
    return worst, name, left_out


def _strict_round_trip(fused: nn.Module, eager: nn.Module) -> bool:
    """``state_dict`` keys equal, and each model loads the other's with ``strict=True``."""
    sd_f, sd_e = fused.state_dict(), eager.state_dict()
    same = list(sd_f) == list(sd_e)
    eager.load_state_dict(sd_f, strict=True)
    fused.load_state_dict(sd_e, strict=True)
    return same


def model_zoo() -> tuple[dict[str, Any], dict[str, float]]:
    """Coverage and float32 numerics of the surgery on each zoo model (``backend="reference"``), against eager."""
    from lightning_accel.precision import apply_fusions

    results: dict[str, Any] = {}
    coverages, grad_errs = [], []
    for name in ZOO_MODELS:
        torch.manual_seed(0)
        model, make_input = zoo_model(name, "cpu")
        _no_dropout(model)
        eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
        rep = apply_fusions(model, backend="reference", warn_if_empty=False)
        x = make_input(torch.device("cpu"))
        y, ye = model(x), eager(x)
        w = torch.randn_like(ye)  # a random projection: `y.square().mean()` of a normalised output has ~0 gradient
        (y * w).sum().backward()
        (ye * w).sum().backward()
        (exact(x.double()) * w.double()).sum().backward()
        g_err, g_name, left_out = grad_rel_err(model, eager, exact)
        # running statistics after the step; a statistic that is zero in float64 (the mean of a 1x1 conv of
        # zero-mean channels) is rounding noise in both float32 models, and left out like such gradients
        trip = [
            (a.float(), b.float(), c)
            for a, b, c in zip(model.buffers(), eager.buffers(), exact.buffers(), strict=True)
            if a.is_floating_point()
        ]
        top_buf = max((float(c.abs().max()) for *_, c in trip), default=0.0)
        bufs = [rel_err(a, b) for a, b, c in trip if float(c.abs().max()) > 1e-6 * top_buf]
        model.eval()
        eager.eval()
        with torch.no_grad():
            y_eval, ye_eval = model(x), eager(x)
        results[name] = {
            "coverage": round(rep.coverage(), 4),
            "by_kind": {k: f"{a}/{b}" for k, (a, b) in rep.coverage_by_kind().items()},
            "fusions": rep.counts(),
            "skipped": [f"{c.module}: {c.reason}" for c in rep.skipped()],
            "fwd_rel_err": rel_err(y, ye),
            "grad_rel_err": g_err,
            "grad_worst_param": g_name,
            "grad_params_zero_in_float64": left_out,
            "running_stats_rel_err": max(bufs, default=0.0),
            "eval_fwd_rel_err": rel_err(y_eval, ye_eval),
            "state_dict_strict_both_ways": _strict_round_trip(model, eager),
        }
        coverages.append(rep.coverage())
        grad_errs.append(g_err)
    unregistered = _unregistered_gpt2_coverage()
    results["gpt2_blocks_unregistered"] = unregistered
    ratios = {
        "fusion_coverage_min": round(min(coverages), 4),
        "fused_ref_grad_rel_err_max": max(grad_errs),
        # reported, not a target: a block of your own with the GPT-2 layout, before you register it
        "fusion_coverage_gpt2_unregistered": unregistered["coverage"],
    }
    return {"model_zoo_fp32": results}, ratios


def _unregistered_gpt2_coverage() -> dict[str, Any]:
    """Coverage of two GPT-2 style blocks whose classes were never registered (what a user's own copy of the layout
    gets): norms fuse, the attention and the MLP's Linears are listed as skipped with the registration to add."""
    from lightning_accel.models.gpt2 import GPT2MLP, GPT2Attention
    from lightning_accel.precision import apply_fusions

    class UserAttention(GPT2Attention):
        pass

    class UserMLP(GPT2MLP):
        pass

    class UserBlock(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(d), UserAttention(d, heads)
            self.ln_2, self.mlp = nn.LayerNorm(d), UserMLP(d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    rep = apply_fusions(nn.Sequential(UserBlock(32, 2), UserBlock(32, 2)), backend="reference", warn_if_empty=False)
    kinds = {k: f"{a}/{b}" for k, (a, b) in rep.coverage_by_kind().items()}
    return {"coverage": round(rep.coverage(), 4), "by_kind": kinds, "skipped": len(rep.skipped())}


# ---------------------------------------------------------------------------------------------------------- CUDA


class Budget:
    """A wall-clock allowance: ``left()`` seconds remain; ``fits(need)`` when at least ``need`` do."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fits(self, need: float) -> bool:
        return self.left() >= need


def _measure(step: Callable[[], None], dev: torch.device, iters: int, warmup: int) -> tuple[float, float]:
    """``(median seconds, peak bytes)``: CUDA events on a GPU; wall clock and no peak (0) on a CPU (dry run)."""
    if dev.type == "cuda":
        return cuda_time(step, iters=iters, warmup=warmup)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return median(times), 0.0


def _variant(
    base: nn.Module,
    make_input: Callable[[], torch.Tensor],
    variant: str,
    dev: torch.device,
    iters: int,
    warmup: int,
    compile_kwargs: dict[str, Any],
    backend: str | None = None,
) -> dict[str, Any]:
    """One variant's bf16 train step (forward, backward, SGD step): ``{"step_ms", "peak_mem_GB"}`` or ``{"error"}``."""
    from lightning_accel.precision import apply_fusions
    from lightning_accel.precision.compile import compile_in_place

    model = copy.deepcopy(base)
    try:
        t0 = time.perf_counter()
        if variant.startswith("fused"):
            apply_fusions(model, warn_if_empty=False, backend=backend)  # type: ignore[arg-type]
        if variant.endswith("compile"):
            compile_in_place(model, **compile_kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        _, step = _train_step(model, make_input, torch.bfloat16)

        def step_opt() -> None:
            step()
            opt.step()

        if dev.type == "cuda":
            torch.cuda.empty_cache()
        t, mem = _measure(step_opt, dev, iters, warmup)
        return {"step_ms": 1e3 * t, "peak_mem_GB": mem / 2**30, "wall_s": round(time.perf_counter() - t0, 1)}
    except Exception as e:  # recorded, not raised: the other variants and models still run
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        del model


def _ratio_of(res: dict[str, Any], num: str, den: str, key: str) -> float | None:
    a, b = res.get(num, {}), res.get(den, {})
    if key in a and key in b:
        return ratio(a[key], b[key])
    return None


def cuda_models(
    quick: bool,
    dev: torch.device | None = None,
    budget_s: float = 200.0,
    dry_run: bool = False,
    zoo: tuple[str, ...] = ZOO_MODELS,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Eager / fused / fused+compile / compile on ResNet-50 and GPT blocks, then eager / fused / compile on the ``zoo``
    models, under bf16 autocast, within ``budget_s`` seconds (``dry_run``: the same code on toy sizes, the fused
    variants on the reference backend)."""
    import torchvision

    from lightning_accel.models import GPTBlock, SmallResNet

    dev = dev or torch.device("cuda")
    budget = Budget(budget_s)
    iters, warmup = (1, 1) if dry_run else (10, 5) if quick else (30, 10)
    compile_kwargs: dict[str, Any] = {"backend": "eager"} if dry_run else {}
    # seconds a variant must still have to start: compiles take tens of seconds on a GPU
    need = {
        "eager": 3.0,
        "fused": 3.0,
        "fused_compile": 10.0 if dry_run else 45.0,
        "compile": 10.0 if dry_run else 45.0,
    }
    if dry_run:
        specs = {
            # the keys of the real run, toy models in their place
            "resnet50": (lambda: SmallResNet(width=8, blocks=(1, 1)), (lambda: torch.randn(2, 3, 16, 16, device=dev))),
            "gpt_blocks": (lambda: nn.Sequential(GPTBlock(32, 2, dropout=0.1)), (lambda: torch.randn(2, 8, 32))),
        }
    else:
        specs = {
            "resnet50": (
                lambda: torchvision.models.resnet50(),
                (lambda: torch.randn(32 if quick else 64, 3, 224, 224, device=dev)),
            ),
            "gpt_blocks": (
                lambda: nn.Sequential(*[GPTBlock(1024, 16, dropout=0.1) for _ in range(4 if quick else 8)]),
                (lambda: torch.randn(8, 1024, 1024, device=dev)),
            ),
        }
    results: dict[str, Any] = {}

    def run(name: str, base: nn.Module, make_input: Callable[[], torch.Tensor], variants: tuple[str, ...]) -> None:
        res = results.setdefault(name, {})
        for variant in variants:
            if not budget.fits(need[variant]):
                res[variant] = {"skipped": f"time budget ({budget_s:.0f} s) spent"}
                continue
            torch.manual_seed(0)
            res[variant] = _variant(
                base, make_input, variant, dev, iters, warmup, compile_kwargs, "reference" if dry_run else None
            )

    # every model's eager and fused variants first (seconds each), the compiles after (tens of seconds each on a
    # first run) in order of importance, while the budget lasts: a run short of time still has every eager/fused pair
    bases: dict[str, tuple[nn.Module, Callable[[], torch.Tensor]]] = {}
    for name, (build, make_input) in specs.items():
        torch.manual_seed(0)
        bases[name] = (build().to(dev), make_input)
    for name in zoo:
        torch.manual_seed(0)
        model, make = zoo_model(name, "toy" if dry_run else "gpu")
        bases[f"zoo_{name}"] = (model.to(dev), (lambda make=make: make(dev)))
    for name, base in bases.items():
        run(name, *base, ("eager", "fused"))
    run("gpt_blocks", *bases["gpt_blocks"], ("fused_compile", "compile"))
    run("resnet50", *bases["resnet50"], ("fused_compile", "compile"))
    for name in zoo:
        run(f"zoo_{name}", *bases[f"zoo_{name}"], ("compile",))
    g, r = results["gpt_blocks"], results["resnet50"]
    pairs = {
        "fused_vs_eager_step": (g, "eager", "fused", "step_ms"),
        "fused_vs_compile_step": (g, "compile", "fused_compile", "step_ms"),
        "fused_vs_eager_peak_mem": (r, "fused", "eager", "peak_mem_GB"),
        "resnet50_fused_vs_eager_step": (r, "eager", "fused", "step_ms"),
        "gpt_blocks_fused_vs_eager_peak_mem": (g, "fused", "eager", "peak_mem_GB"),
    }
    for name in zoo:
        z = results[f"zoo_{name}"]
        pairs[f"zoo_{name}_fused_vs_eager_step"] = (z, "eager", "fused", "step_ms")
        pairs[f"zoo_{name}_fused_vs_compile_step"] = (z, "compile", "fused", "step_ms")
        pairs[f"zoo_{name}_fused_vs_eager_peak_mem"] = (z, "fused", "eager", "peak_mem_GB")
    if dry_run:  # a CPU has no peak-memory counter
        pairs = {k: v for k, v in pairs.items() if v[3] != "peak_mem_GB"}
    ratios = {}
    for key, (res, num, den, field_) in pairs.items():
        value = _ratio_of(res, num, den, field_)
        if value is not None:
            ratios[key] = value
    results["device"] = torch.cuda.get_device_name(0) if dev.type == "cuda" else f"{dev} (dry run)"
    results["date"] = time.strftime("%Y-%m-%d")
    results["budget_s"], results["budget_left_s"] = budget_s, round(budget.left(), 1)
    return results, ratios


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: the CPU part, plus the CUDA part when a GPU is present (default); cpu: the CPU part only; "
        "cuda: the CUDA part only (report `fused_cuda`)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds the CUDA part may take (default 200 with --quick, 600 without); variants that would start after "
        "it are recorded as skipped",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run the CUDA part's code on the CPU at toy sizes (no GPU needed; timings are not meaningful)",
    )
    p.add_argument(
        "--zoo",
        default=",".join(ZOO_MODELS),
        help=f"comma-separated zoo models for the CUDA part (default all: {','.join(ZOO_MODELS)})",
    )
    p.add_argument("--interp-numerics", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.zoo = tuple(z for z in args.zoo.split(",") if z)
    unknown = [z for z in args.zoo if z not in ZOO_MODELS]
    if unknown:
        p.error(f"--zoo got unknown model(s) {unknown}; expected names from {','.join(ZOO_MODELS)}.")
    if args.budget_s is not None and not args.budget_s > 0:
        p.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}; e.g. --budget-s 200.")
    return args


def numerics() -> tuple[dict[str, Any], dict[str, float]]:
    """Case: every fused op's float32 error against its oracle, torch path and Triton interpreter."""
    parts = {"reference_path": op_numerics("reference"), "triton_interpreter": interpreter_numerics()}
    errs = [v for part in parts.values() if isinstance(part, dict) for v in part.values()]
    return {"numerics_max_rel_err_fp32": parts}, {"max_rel_err_fp32": max(errs)}


#: What each part of the benchmark runs (the JSON's ``config``).
CONFIG: dict[str, Any] = {
    "cpu_models": {
        "small_resnet": "width 16, blocks (1,1,1), batch 16x3x32x32",
        "gpt_blocks": "2 x GPTBlock(128, 4 heads), batch 8x64",
    },
    "cuda_models": {
        "resnet50": "torchvision, batch 64 (quick 32) x 224px",
        "gpt_blocks": "8 (quick 4) x GPTBlock(1024, 16 heads), batch 8x1024",
    },
    "zoo_cpu": "resnet18/mobilenet_v3_small 4x3x64x64; ViT 32px patch 8, 2 layers, dim 32; encoders and GPT-2 "
    "blocks 2 layers, dim 32, 2 heads, seq 7; float32, dropout 0, backend reference",
    "zoo_cuda": "resnet18/mobilenet_v3_small 64x224px; ViT 224px patch 16, 6 layers, dim 512; encoders 6 x "
    "d512 seq 256 batch 16; GPT-2 6 x d768 seq 512 batch 8; bf16 autocast, eager/fused/compile",
}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.interp_numerics:  # child process of interpreter_numerics()
        print(json.dumps(op_numerics("triton")))
        return
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        raise SystemExit(
            "`--device cuda` needs a CUDA device; this machine has none. Run with `--device cpu`, or add `--dry-run`."
        )
    budget_s = args.budget_s if args.budget_s is not None else 200.0 if args.quick else 600.0
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    if args.device != "cuda":
        num_results, num_ratios = numerics()
        cpu_results, cpu_ratios = cpu_models(args.quick)
        zoo_results, zoo_ratios = model_zoo()
        results |= {**num_results, "cpu_fp32": cpu_results, **zoo_results}
        ratios |= {**num_ratios, **cpu_ratios, **zoo_ratios}
    if args.dry_run and args.device != "cpu":
        results["cuda_bf16_dry_run"], dry = cuda_models(True, torch.device("cpu"), budget_s, True, args.zoo)
        ratios |= {f"dry_run_{k}": v for k, v in dry.items()}
    elif args.device != "cpu" and torch.cuda.is_available():
        results["cuda_bf16"], cuda_ratios = cuda_models(args.quick, budget_s=budget_s, zoo=args.zoo)
        ratios |= cuda_ratios
    elif args.device == "auto":
        results["cuda_bf16"] = "not measured: no CUDA device on this machine"
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    report(
        "fused_cuda" if args.device == "cuda" else "fused",
        quick=args.quick or args.dry_run,  # a dry run writes no chart
        config=CONFIG,
        results=results,
        ratios=ratios,
        out=args.out,
        chart=_chart_values(ratios),
        chart_title="fused vs eager (speed >1, memory <1 better)",
    )


def _chart_values(ratios: dict[str, float]) -> dict[str, float]:
    """Short bar labels for the PNG."""
    short = {
        "cpu_small_resnet_fused_vs_eager_step": "CPU resnet\nspeed-up",
        "cpu_small_resnet_saved_act_fused_over_eager": "CPU resnet\nsaved act.",
        "cpu_gpt_blocks_fused_vs_eager_step": "CPU GPT\nspeed-up",
        "cpu_gpt_blocks_saved_act_fused_over_eager": "CPU GPT\nsaved act.",
        "fused_vs_eager_step": "GPU GPT\nspeed-up",
        "fused_vs_compile_step": "GPU GPT\nvs compile",
        "fused_vs_eager_peak_mem": "GPU R50\npeak mem",
        "fusion_coverage_min": "zoo\ncoverage min",
    }
    return {label: ratios[key] for key, label in short.items() if key in ratios}


if __name__ == "__main__":
    main()
