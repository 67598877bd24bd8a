"""``torch.compile`` applied in place, with a fallback to eager (and one clear warning) when compilation fails.

``nn.Module.compile()`` stores ``torch.compile(module._call_impl)`` in ``module._compiled_call_impl``, which
``nn.Module.__call__`` prefers; :func:`compile_in_place` stores a guarded version there instead, so the module object
(and DDP's reference to it) stays the same. Compilation is lazy: it happens, and can fail, at the first call.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from lightning_accel._utils import compat
from lightning_accel._utils.errors import one_line

__all__ = ["CompileFallback", "compile_in_place", "compile_errors"]


def compile_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "compilation failed" (not "the model is wrong"), across torch versions."""
    return compat.compile_error_types()


class CompileFallback:
    """The callable installed as ``module._compiled_call_impl``: compiled first, eager for good after a failure."""

    def __init__(self, module: nn.Module, **compile_kwargs: Any) -> None:
        self.eager = compat.module_call_impl(module)
        self.compiled = torch.compile(self.eager, **compile_kwargs)
        self.name = type(module).__name__
        self.failed: BaseException | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is None:
            try:
                return self.compiled(*args, **kwargs)
            except compile_errors() as e:
                self.failed = e
                first = one_line(e, first=True)[:300]
                warnings.warn(
                    f"`torch.compile` failed for {self.name} ({type(e).__name__}: {first}); running it eagerly (the "
                    "fused ops still apply). Pass `compile=False` to silence this, or fix the cause above (a C++ "
                    "compiler for inductor on CPU, a supported GPU for Triton on CUDA).",
                    UserWarning,
                    stacklevel=2,
                )
        return self.eager(*args, **kwargs)


def compile_in_place(module: nn.Module, **compile_kwargs: Any) -> bool:
    """Compile ``module``'s ``__call__`` in place (idempotent); returns False if it was already compiled."""
    if isinstance(compat.compiled_call_impl(module), CompileFallback):
        return False
    compat.set_compiled_call_impl(module, CompileFallback(module, **compile_kwargs))
    return True
