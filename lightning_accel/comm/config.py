"""``OneBitConfig``: the hyper-parameters of 1-bit averaging, validated once, shared by the hook and the strategy.

:class:`~lightning_accel.comm.state.OneBitState` holds one (``state.config``), and
:class:`~lightning_accel.comm.strategy.OneBitDDPStrategy` builds one from its arguments; the defaults here are the
strategy's. The comm hook used alone starts from :data:`HOOK_DEFAULTS` (gradients, always compressed), because
without an optimizer-side step it can only compress the gradients.

Two arguments were renamed: ``compress`` is now ``compressed_signal`` (what is compressed) and ``backend`` is now
``compressor_backend`` (the compressor's kernel, not the process-group backend). :func:`resolve_renamed` maps the old
names onto the new ones for one release, with a :class:`DeprecationWarning`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from lightning_accel._utils.checks import check_bool, check_choice, check_int, renamed_argument

__all__ = [
    "COMPRESSED_SIGNALS",
    "COMPRESSIONS",
    "COMPRESSOR_BACKENDS",
    "HOOK_DEFAULTS",
    "RENAMED",
    "CompressedSignal",
    "Compression",
    "CompressorBackend",
    "OneBitConfig",
    "config_fields",
    "resolve_renamed",
]

#: what is compressed: the optimizer's momentum (SGD-momentum, Adam, AdamW), the gradients, or chosen per optimizer
CompressedSignal = Literal["auto", "momentum", "gradients"]
COMPRESSED_SIGNALS: tuple[CompressedSignal, ...] = get_args(CompressedSignal)
#: whether to compress after warm-up: measured at the end of warm-up, always, or never
Compression = Literal["auto", "1bit", "fp32"]
COMPRESSIONS: tuple[Compression, ...] = get_args(Compression)
#: the compressor's kernel: the fused Triton kernel and its torch reference (there is no separate "eager" oracle)
CompressorBackend = Literal["auto", "triton", "reference"]
COMPRESSOR_BACKENDS: tuple[CompressorBackend, ...] = get_args(CompressorBackend)

#: deprecated argument name -> its new name (same values)
RENAMED: dict[str, str] = {"compress": "compressed_signal", "backend": "compressor_backend"}


@dataclass(frozen=True)
class OneBitConfig:
    """Hyper-parameters of 1-bit compressed averaging (immutable; every field is checked at construction).

    Attributes:
        warmup_steps: optimizer steps of plain fp32 allreduce (and the unmodified optimizer) before compressing;
            >= 2 because DDP rebuilds its buckets after the first iteration. Adam's variance is frozen at its end.
            ``"auto"``: resolved by the strategy during the fit (:class:`~lightning_accel.comm.warmup.WarmupWatch`):
            :data:`~lightning_accel.comm.warmup.AUTO_MIN_WARMUP` steps for SGD, the gradient path and Adam/AdamW with
            ``variance_refresh > 0``; with ``variance_refresh=0``, the first step (from that minimum) at which Adam's
            per-tensor mean variance moved by less than :data:`~lightning_accel.comm.warmup.STABLE_CHANGE` over the
            last :data:`~lightning_accel.comm.warmup.CHECK_EVERY` steps, and at the latest 15 % of the fit.
        variance_refresh: Adam/AdamW in the compressed-momentum stage: refresh the frozen variance with one fp32
            step (DDP's gradient average and an exact Adam step whose variance catches up on the steps it skipped)
            this many steps after the variance was frozen, then after intervals that double (``R, 3R, 7R, ...``
            steps into the stage: ``log2`` of the stage's length in fp32 steps, so the bytes stay ~30x below fp32
            in a long fit); 0: never (the variance stays frozen, as in 1-bit Adam).
        block_size: maximum elements per scale block, a multiple of 8 (640: 5 % scale overhead, ~30x fewer bytes
            than fp32; ``benchmarks/onebit.py`` measures the accuracy, ``ONEBIT_BLOCK`` tries other sizes there).
        min_compress_numel: gradient buckets with fewer elements stay fp32 (gradient compression only).
        error_feedback: keep worker/server residuals (False gives plain scaled signs, for comparison only).
        compressor_backend: ``"auto"`` (the fused Triton kernel for CUDA tensors when ``triton`` is installed, the
            torch compressor elsewhere), ``"triton"`` (always; needs CUDA tensors or ``TRITON_INTERPRET=1``) or
            ``"reference"`` (the torch compressor). Not the process-group backend.
        compressed_signal: what travels compressed: ``"momentum"`` (the optimizer's momentum with a frozen Adam
            variance, :mod:`~lightning_accel.comm.momentum`; SGD with momentum, Adam, AdamW), ``"gradients"`` (the
            gradient buckets, in the comm hook) or ``"auto"`` (momentum where the optimizer supports it, else
            gradients). The hook alone (without an optimizer-side step) can only compress gradients.
        compression: whether to compress after warm-up: ``"auto"`` (measure fp32 against compressed averaging at
            the end of warm-up and keep the faster, :mod:`~lightning_accel.comm.auto`), ``"1bit"`` (always) or
            ``"fp32"`` (never: plain DDP).
        recheck_every: with ``compression="auto"``, measure again every this many steps after warm-up (0: never);
            refused with another ``compression``, where it would change nothing.
        group_numel: the momentum path compresses parameters in groups of about this many elements (model order);
            communication of one group overlaps the compression of the next.

    Raises:
        TypeError: a field of the wrong type (a bool is never an integer here).
        ValueError: a field out of range, naming it, the value and the fix.
    """

    warmup_steps: int | Literal["auto"] = "auto"
    block_size: int = 640
    min_compress_numel: int = 0
    error_feedback: bool = True
    compressor_backend: CompressorBackend = "auto"
    compressed_signal: CompressedSignal = "auto"
    compression: Compression = "auto"
    recheck_every: int = 0
    group_numel: int = 1 << 22
    variance_refresh: int = 8

    def __post_init__(self) -> None:
        if not (type(self.warmup_steps) is str and self.warmup_steps == "auto"):
            if type(self.warmup_steps) is str:  # a typo of "auto", or a number written as a string
                raise TypeError(
                    f"`warmup_steps` must be an integer >= 2 or 'auto', got {self.warmup_steps!r} (str). Use 'auto' "
                    "(the warm-up ends when it has served its purpose) or an integer, e.g. `warmup_steps=10`."
                )
            # a numpy string "auto" too: refused with the numpy hint, as every numpy scalar is
            check_int(
                "warmup_steps",
                self.warmup_steps,
                low=2,
                fix="DDP rebuilds its buckets after the first iteration, so compression state made earlier would be "
                "stale; use 'auto' or e.g. `warmup_steps=10`.",
            )
        check_int("block_size", self.block_size, low=8, fix="Use e.g. `block_size=2048`.")
        if self.block_size % 8:
            raise ValueError(
                f"`block_size` must be a multiple of 8, got {self.block_size!r}. Use e.g. `block_size=2048`."
            )
        check_int("min_compress_numel", self.min_compress_numel, low=0, fix="Use 0 to compress every bucket.")
        check_bool("error_feedback", self.error_feedback, fix="Keep the default True for training.")
        check_choice(
            "compressor_backend",
            self.compressor_backend,
            COMPRESSOR_BACKENDS,
            fix="Use 'auto' (the Triton kernel on CUDA, torch elsewhere) unless testing a path.",
        )
        check_choice(
            "compressed_signal",
            self.compressed_signal,
            COMPRESSED_SIGNALS,
            fix="Use 'auto' (momentum for SGD-momentum/Adam/AdamW, gradients otherwise).",
        )
        check_choice(
            "compression",
            self.compression,
            COMPRESSIONS,
            fix="Use 'auto' to measure which is faster at the end of warm-up.",
        )
        check_int("recheck_every", self.recheck_every, low=0, fix="Use 0 to decide once.")
        if self.recheck_every and self.compression != "auto":
            # only "auto" measures; kept, the argument would change nothing (a run meant to re-measure never would)
            raise ValueError(
                f"`recheck_every={self.recheck_every}` has no effect with `compression={self.compression!r}`: only "
                "`compression='auto'` measures fp32 against 1-bit and tries the other mode again. Use "
                "`compression='auto'`, or drop `recheck_every`."
            )
        check_int("group_numel", self.group_numel, low=8, fix="Use e.g. `1 << 22`.")
        check_int("variance_refresh", self.variance_refresh, low=0, fix="Use 0 to keep the variance frozen.")


#: the comm hook's defaults when it is used without the strategy: it compresses gradients, from the end of warm-up
HOOK_DEFAULTS = OneBitConfig(compressed_signal="gradients", compression="1bit", warmup_steps=10)


def config_fields() -> tuple[str, ...]:
    """The names of :class:`OneBitConfig`'s fields, in order."""
    return tuple(f.name for f in dataclasses.fields(OneBitConfig))


def resolve_renamed(given: Mapping[str, Any], *, defaults: OneBitConfig, stacklevel: int = 3) -> dict[str, Any]:
    """``given`` with each deprecated name of :data:`RENAMED` moved onto its new name.

    An old name whose value is None counts as not given (LightningCLI passes every parameter). A given old name emits
    a :class:`DeprecationWarning` naming the new one.

    Raises:
        ValueError: an old name given beside its new name with a value other than ``defaults``' (one line).
    """
    out = dict(given)
    for old, new in RENAMED.items():
        value = out.pop(old, None)
        if value is None:
            continue
        given_new = out.get(new, getattr(defaults, new)) != getattr(defaults, new)
        out[new] = renamed_argument(new, out.get(new), old, value, new_given=given_new, stacklevel=stacklevel + 1)
    return out
