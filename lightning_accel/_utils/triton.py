"""The Triton switch shared by the fused ops and the 1-bit compressor: one ``backend=`` argument, one reading of
``TRITON_INTERPRET``.

Every caller that has a Triton kernel takes ``backend``:

``"auto"``
    the Triton kernels for CUDA tensors when the ``triton`` package is installed; elsewhere the fastest torch path the
    caller offers (plain ``"eager"`` torch ops where it has them: on a CPU the native kernels beat any Python-level
    fusion, measured in ``benchmarks/fused.py``; its ``"reference"`` path otherwise).
``"triton"``
    force the kernels; they need CUDA tensors, or the CPU interpreter (``TRITON_INTERPRET=1`` before ``import triton``).
``"reference"``
    the caller's own torch implementation of what the kernel computes (the fused function's torch path, the torch
    compressor).
``"eager"``
    the unfused torch ops, the oracle (only callers that have one accept it).

Triton reads ``TRITON_INTERPRET`` when its ``@triton.jit`` kernels are defined, so :func:`interpreter_active` reads the
environment rather than Triton's state, with Triton's own rule for the value (``1``/``true``/``on``/``yes``, any case);
a process that imported the kernels before setting the variable runs compiled kernels (and needs CUDA).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache
from typing import Literal, get_args

import torch

from lightning_accel._utils.checks import check_choice

__all__ = [
    "BACKENDS",
    "Backend",
    "ResolvedBackend",
    "check_backend",
    "interpreter_active",
    "resolve_backend",
    "triton_available",
    "use_triton",
]

Backend = Literal["auto", "triton", "reference", "eager"]
ResolvedBackend = Literal["triton", "reference", "eager"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

# the values Triton's `getenv_bool` takes as true (checked against triton 3.8: "2", "no", "" are false)
_TRUE = frozenset({"1", "true", "on", "yes"})


@cache
def triton_available() -> bool:
    """True when ``import triton`` works (it is absent on macOS/Windows wheels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_active() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET`` set to a true value)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def check_backend(backend: object, allowed: Sequence[str] = BACKENDS, *, name: str = "backend") -> None:
    """Raise unless ``backend`` is one of ``allowed`` (the values the caller implements).

    Raises:
        TypeError: ``backend`` is not a string.
        ValueError: naming the argument (``name``), the value received, the values expected and the fix.
    """
    if isinstance(backend, str) and backend in allowed:
        return  # the fused ops call this on every forward: the accepted case costs one membership test
    check_choice(
        name, backend, allowed, fix="Use 'auto' (Triton kernels on CUDA, torch elsewhere) unless testing a path."
    )


def _device(where: torch.Tensor | torch.device) -> torch.device:
    return where.device if isinstance(where, torch.Tensor) else where


def resolve_backend(
    where: torch.Tensor | torch.device, backend: str, allowed: Sequence[str] = BACKENDS
) -> ResolvedBackend:
    """The concrete path for a tensor (or device) ``where``; see the module docstring for what ``auto`` picks.

    Args:
        where: the tensor the kernels would read, or its device.
        backend: the caller's ``backend`` argument.
        allowed: the values the caller implements; ``auto`` resolves to ``"eager"`` off CUDA only when it is listed.

    Raises:
        ValueError: for a ``backend`` outside ``allowed``.
        RuntimeError: when ``"triton"`` is forced but cannot run here, with the reason and the fix.
    """
    check_backend(backend, allowed)
    device = _device(where)
    if backend == "auto":
        if device.type == "cuda" and triton_available():
            return "triton"
        return "eager" if device.type != "cuda" and "eager" in allowed else "reference"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(
                "`backend='triton'` needs the `triton` package: `pip install triton` (Linux x86_64), or use "
                "`backend='auto'` to fall back to torch."
            )
        if device.type != "cuda" and not interpreter_active():
            raise RuntimeError(
                f"`backend='triton'` got a tensor on {device}; Triton kernels need CUDA tensors, or "
                "`TRITON_INTERPRET=1` set before `import triton` to run them on the CPU. Use `backend='auto'` "
                "to fall back to torch."
            )
        return "triton"
    return "reference" if backend == "reference" else "eager"


def use_triton(where: torch.Tensor | torch.device, backend: str, allowed: Sequence[str] = BACKENDS) -> bool:
    """Triton kernels (True) or a torch path (False) for ``where``: :func:`resolve_backend` is ``"triton"``.

    Raises:
        ValueError: for a ``backend`` outside ``allowed``.
        RuntimeError: when ``"triton"`` is forced but cannot run here.
    """
    return resolve_backend(where, backend, allowed) == "triton"
