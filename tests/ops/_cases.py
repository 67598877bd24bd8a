"""Shared parameters of the op tests: the (dtype, atol, rtol) table and odd shapes."""

from __future__ import annotations

import torch

# fp16/bf16 results are compared with a float32 computation on the *same* low-precision inputs
DTYPES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 1e-3, 1e-3),
    (torch.bfloat16, 2e-2, 2e-2),
]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    """Compare in float32 with the table's tolerances (dtypes may differ: the oracle runs in float32)."""
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Fresh leaf copies that require grad (None stays None)."""
    return [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]


def assert_grad_close(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, factor: float = 10.0
) -> None:
    """Gradients that are reductions (GEMM inputs, weights, BN): absolute tolerance ``factor * atol`` scaled by the
    tensor's largest magnitude, since a sum of rounded low-precision products is only as exact as its largest terms."""
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    assert_close(actual, expected, factor * atol * scale, rtol)
