"""Benchmark: FusedPrecision (fused ops + surgery) against eager mixed precision, torch.compile and the references.

    python benchmarks/fused.py [--quick] --out FILE.json

On any machine (the CPU part):

- numerics per op: the max relative error (``max|fused - oracle| / max|oracle|``) of each fused op's forward and
  backward in float32 against its pure-torch oracle, on the torch path and on the Triton kernels under the
  interpreter (a subprocess with ``TRITON_INTERPRET=1``); ``ratios.max_rel_err_fp32`` is the largest of them;
- reference-path timings: train-step time (forward + backward) of a SmallResNet and of GPT blocks, eager vs fused
  (surgery applied), alternated in one process, in float32 on the CPU;
- saved activation memory: bytes autograd keeps for backward per step, eager vs fused (measured with
  ``saved_tensors_hooks``, device-independent).

With a CUDA GPU (the CUDA part): step time (median of CUDA-event timings) and peak memory of torchvision ResNet-50
and a GPT-style block stack at realistic sizes under bf16 autocast for eager MixedPrecision, FusedPrecision,
FusedPrecision + torch.compile and torch.compile alone, giving ``fused_vs_eager_step`` (GPT blocks),
``fused_vs_compile_step`` (GPT blocks) and ``fused_vs_eager_peak_mem`` (ResNet-50). ``--device cuda`` runs the CUDA
part alone (report ``fused_cuda``; what ``benchmarks/gpu_suite.sh`` runs), ``--device cpu`` the CPU part alone.
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
    else:  # no Triton kernel for this op: the fused function is the same on every device
        xc, wc = torch.randn(3, 5, 9, 7), torch.randn(6, 5, 3, 3) / 45**0.5
        g, be = torch.rand(6) + 0.5, torch.randn(6)
        check(
            "conv_bn_relu",
            lambda x, w, g, b: conv_bn_relu(x, w, None, g, b, None, None, True, 0.1, 1e-5, 2, 1, backend=backend),
            lambda x, w, g, b: cbr_ref.conv_bn_relu(x, w, None, g, b, None, None, True, 0.1, 1e-5, 2, 1),
            xc, wc, g, be,
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


# ---------------------------------------------------------------------------------------------------------- CUDA


def cuda_models(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:  # pragma: no cover - needs a GPU
    """Eager / fused / fused+compile / compile on ResNet-50 and GPT blocks under bf16 autocast."""
    import torchvision

    from lightning_accel.models import GPTBlock
    from lightning_accel.precision import apply_fusions
    from lightning_accel.precision.compile import compile_in_place

    dev = torch.device("cuda")
    iters, warmup = (10, 5) if quick else (30, 10)
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
    for name, (build, make_input) in specs.items():
        torch.manual_seed(0)
        base = build().to(dev)
        res: dict[str, Any] = {}
        for variant in ("eager", "fused", "fused_compile", "compile"):
            model = copy.deepcopy(base)
            if variant.startswith("fused"):
                apply_fusions(model, warn_if_empty=False)
            if variant.endswith("compile"):
                compile_in_place(model)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            _, step = _train_step(model, make_input, torch.bfloat16)

            def step_opt(step: Callable[[], None] = step, opt: torch.optim.Optimizer = opt) -> None:
                step()
                opt.step()

            torch.cuda.empty_cache()
            t, mem = cuda_time(step_opt, iters=iters, warmup=warmup)
            res[variant] = {"step_ms": 1e3 * t, "peak_mem_GB": mem / 2**30}
            del model, opt
        results[name] = res
    g, r = results["gpt_blocks"], results["resnet50"]
    ratios = {
        "fused_vs_eager_step": ratio(g["eager"]["step_ms"], g["fused"]["step_ms"]),
        "fused_vs_compile_step": ratio(g["compile"]["step_ms"], g["fused_compile"]["step_ms"]),
        "fused_vs_eager_peak_mem": ratio(r["fused"]["peak_mem_GB"], r["eager"]["peak_mem_GB"]),
        "resnet50_fused_vs_eager_step": ratio(r["eager"]["step_ms"], r["fused"]["step_ms"]),
        "gpt_blocks_fused_vs_eager_peak_mem": ratio(g["fused"]["peak_mem_GB"], g["eager"]["peak_mem_GB"]),
    }
    results["device"] = torch.cuda.get_device_name(0)
    results["date"] = time.strftime("%Y-%m-%d")
    return results, ratios


def parse_args() -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: the CPU part, plus the CUDA part when a GPU is present (default); cpu: the CPU part only; "
        "cuda: the CUDA part only (report `fused_cuda`)",
    )
    p.add_argument("--interp-numerics", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def numerics() -> tuple[dict[str, Any], dict[str, float]]:
    """Case: every fused op's float32 error against its oracle, torch path and Triton interpreter."""
    parts = {"reference_path": op_numerics("reference"), "triton_interpreter": interpreter_numerics()}
    errs = [v for part in parts.values() if isinstance(part, dict) for v in part.values()]
    return {"numerics_max_rel_err_fp32": parts}, {"max_rel_err_fp32": max(errs)}


def main() -> None:
    args = parse_args()
    if args.interp_numerics:  # child process of interpreter_numerics()
        print(json.dumps(op_numerics("triton")))
        return
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("`--device cuda` needs a CUDA device; this machine has none. Run with `--device cpu`.")
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    if args.device != "cuda":
        num_results, num_ratios = numerics()
        cpu_results, cpu_ratios = cpu_models(args.quick)
        results |= {**num_results, "cpu_fp32": cpu_results}
        ratios |= {**num_ratios, **cpu_ratios}
    if args.device != "cpu" and torch.cuda.is_available():
        results["cuda_bf16"], cuda_ratios = cuda_models(args.quick)
        ratios |= cuda_ratios
    elif args.device == "auto":
        results["cuda_bf16"] = "not measured: no CUDA device on this machine"
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    report(
        "fused_cuda" if args.device == "cuda" else "fused",
        quick=args.quick,
        config={
            "cpu_models": {
                "small_resnet": "width 16, blocks (1,1,1), batch 16x3x32x32",
                "gpt_blocks": "2 x GPTBlock(128, 4 heads), batch 8x64",
            },
            "cuda_models": {
                "resnet50": "torchvision, batch 64 (quick 32) x 224px",
                "gpt_blocks": "8 (quick 4) x GPTBlock(1024, 16 heads), batch 8x1024",
            },
        },
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
    }
    return {label: ratios[key] for key, label in short.items() if key in ratios}


if __name__ == "__main__":
    main()
