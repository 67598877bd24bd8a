"""``linear_dropout(gemm="triton")`` where the fused Triton GEMM cannot run: the torch GEMM computes it, and one
warning (per reason, per process, on global rank 0) says so instead of ignoring the argument without a word."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_accel.ops.linear_dropout import function as ld_function
from lightning_accel.ops.linear_dropout import linear_dropout


@pytest.fixture(autouse=True)
def _fresh_warning_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ld_function, "_GEMM_FALLBACK_WARNED", set(), raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for var in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(5, 7), torch.randn(3, 7), torch.randn(3)


@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
def test_fused_gemm_request_off_triton_warns_once_and_computes_the_same(backend: str) -> None:
    x, w, b = _inputs()
    expected = linear_dropout(x, w, b, 0.0, backend=backend)  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match=r"`gemm='triton'` is not used.*torch GEMM") as record:
        got = linear_dropout(x, w, b, 0.0, backend=backend, gemm="triton")  # type: ignore[arg-type]
    assert len([r for r in record if "gemm='triton'" in str(r.message)]) == 1
    torch.testing.assert_close(got, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the next steps stay quiet
        linear_dropout(x, w, b, 0.0, backend=backend, gemm="triton")  # type: ignore[arg-type]


def test_fused_gemm_fallback_names_the_reason() -> None:
    x, w, b = _inputs()
    with pytest.warns(UserWarning) as record:
        linear_dropout(x, w, b, 0.0, backend="auto", gemm="triton")
    message = str(record[0].message)
    assert "cpu" in message and "backend='auto'" in message and "CUDA" in message


def test_default_gemm_and_other_ranks_stay_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear_dropout(x, w, b, 0.0)  # gemm="torch": nothing was asked that is not done
        monkeypatch.setenv("RANK", "1")  # every rank falls back alike: rank 0 speaks for them
        linear_dropout(x, w, b, 0.0, gemm="triton")
