"""``torch.compile`` applied in place, with a fallback to eager (and one clear warning, on global rank 0) when
compilation fails.

``nn.Module.compile()`` stores ``torch.compile(module._call_impl)`` in ``module._compiled_call_impl``, which
``nn.Module.__call__`` prefers; :func:`compile_in_place` stores a guarded version there instead, so the module object
(and DDP's reference to it) stays the same. Compilation is lazy: it happens, and can fail, at the first call.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from lightning_accel._utils import compat
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.rank import is_global_zero

__all__ = ["CompileFallback", "compile_in_place", "compile_errors"]

_log = logging.getLogger(__name__)


def compile_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "compilation failed" (not "the model is wrong"), across torch versions."""
    return compat.compile_error_types()


class CompileFallback:
    """The callable installed as ``module._compiled_call_impl``: compiled first, eager for good after a failure.

    A call that fails to compile is run again eagerly, as if it were the first: until a compiled call has gone through,
    the module's buffers are copied before each call and put back after a failure. Compilation is per graph, so with a
    graph break the part before it may have run (updating batch-norm statistics and ``num_batches_tracked`` in place)
    before a later part failed to compile; the eager rerun would count that batch twice.
    """

    def __init__(self, module: nn.Module, **compile_kwargs: Any) -> None:
        self.eager = compat.module_call_impl(module)
        self.compiled = torch.compile(self.eager, **compile_kwargs)
        self.name = type(module).__name__
        self.failed: BaseException | None = None
        self.succeeded = False  # a compiled call went through: compilation is done, no more buffer copies
        self._module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is None:
            saved = None if self.succeeded else _snapshot_buffers(self._module)
            try:
                out = self.compiled(*args, **kwargs)
                self.succeeded = True
                return out
            except compile_errors() as e:
                if saved is not None:
                    _restore_buffers(saved)
                self.failed = e
                first = one_line(e, first=True)[:300]
                message = (
                    f"`torch.compile` failed for {self.name} ({type(e).__name__}: {first}); running it eagerly (the "
                    "fused ops still apply). Pass `compile=False` to silence this, or fix the cause above (a C++ "
                    "compiler for inductor on CPU, a supported GPU for Triton on CUDA)."
                )
                # Every rank compiles the same module the same way and falls back alike: one line per job, not one
                # per process (the other ranks log it, for a failure of their own).
                if is_global_zero():
                    warnings.warn(message, UserWarning, stacklevel=2)
                else:
                    _log.info(message)
        return self.eager(*args, **kwargs)


_Snapshot = list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]


def _snapshot_buffers(module: nn.Module) -> _Snapshot:
    """``(owner, name, buffer, copy)`` of every buffer of ``module`` (shared buffers once)."""
    seen: set[int] = set()
    out: _Snapshot = []
    for owner in module.modules():
        for name, buf in owner.named_buffers(recurse=False):
            if buf is not None and id(buf) not in seen:
                seen.add(id(buf))
                out.append((owner, name, buf, buf.detach().clone()))
    return out


def _restore_buffers(saved: _Snapshot) -> None:
    """Put the buffers of :func:`_snapshot_buffers` back: the same tensor objects, with the copied values."""
    with torch.no_grad():
        for owner, name, buf, copy in saved:
            buf.copy_(copy)
            setattr(owner, name, buf)  # a forward may have replaced the buffer itself


def compile_in_place(module: nn.Module, **compile_kwargs: Any) -> bool:
    """Compile ``module``'s ``__call__`` in place (idempotent); returns False if it was already compiled."""
    if isinstance(compat.compiled_call_impl(module), CompileFallback):
        return False
    compat.set_compiled_call_impl(module, CompileFallback(module, **compile_kwargs))
    return True
