"""Dispatch helpers shared by the ops: is Triton usable for these tensors, is the CPU interpreter active.

Triton reads ``TRITON_INTERPRET`` when it is imported, so :func:`interpreter_active` reads the environment rather than
Triton's state: a process that imported Triton before setting the variable runs compiled kernels (and needs CUDA).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Literal

import torch

__all__ = ["Backend", "check_backend", "interpreter_active", "resolve_backend", "triton_available", "use_triton"]

# auto: Triton kernels on CUDA (the torch path of the fused function if Triton is missing), plain eager torch ops
#       elsewhere (on a CPU the native kernels are faster than any Python-level fusion; measured in benchmarks/fused.py)
# triton: force the kernels; reference: force the fused autograd function's torch path; eager: the unfused oracle
Backend = Literal["auto", "triton", "reference", "eager"]
_BACKENDS = ("auto", "triton", "reference", "eager")


@cache
def triton_available() -> bool:
    """True when ``import triton`` works (it is absent on macOS/Windows wheels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_active() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_backend(backend: str) -> None:
    """Raise ``ValueError`` for an unknown ``backend`` argument."""
    if backend not in _BACKENDS:
        raise ValueError(f"`backend` must be one of {_BACKENDS}, got {backend!r}. Use 'auto' unless testing a path.")


def resolve_backend(t: torch.Tensor, backend: Backend) -> Literal["triton", "reference", "eager"]:
    """The concrete path for tensor ``t``: ``auto`` is Triton on CUDA and eager torch elsewhere."""
    check_backend(backend)
    if backend == "auto":
        if t.is_cuda:
            return "triton" if triton_available() else "reference"
        return "eager"
    if backend == "triton":
        use_triton(t, backend)  # raises with the reason when the kernels cannot run here
    return backend  # type: ignore[return-value]


def use_triton(t: torch.Tensor, backend: Backend) -> bool:
    """Inside a fused function: Triton kernels (True) or their torch path (``auto``: Triton on CUDA).

    ``backend="triton"`` forces the kernels; it needs a CUDA tensor, or a CPU tensor with the interpreter active.

    Raises:
        RuntimeError: when the Triton path is forced but cannot run, with the reason and the fix.
    """
    check_backend(backend)
    if backend in ("reference", "eager"):
        return False
    if backend == "auto":
        return t.is_cuda and triton_available()
    if not triton_available():
        raise RuntimeError("`backend='triton'` needs the `triton` package: `pip install triton` (Linux x86_64).")
    if not t.is_cuda and not interpreter_active():
        raise RuntimeError(
            f"`backend='triton'` got a tensor on {t.device}; Triton kernels need CUDA tensors, or "
            "`TRITON_INTERPRET=1` set before `import triton` to run them on the CPU."
        )
    return True
