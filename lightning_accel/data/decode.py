"""The deterministic ``decode`` step whose output is cached: raw bytes -> fixed-size uint8 CHW tensor.

A decoder is any picklable callable ``decode(data: bytes) -> torch.Tensor`` with a ``fingerprint`` string attribute
(it namespaces the cache: change the decoder and old entries are not reused). Without one, the cache derives a stable
identity (:func:`decoder_fingerprint`). It must be deterministic; random augmentation belongs after the cache (a CPU
``transform`` or :class:`~lightning_accel.data.augment.GpuAugment`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import logging
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from lightning_accel._utils import compat
from lightning_accel._utils.checks import check_int

__all__ = ["DecodeError", "ImageDecoder", "decoder_fingerprint"]


class DecodeError(ValueError):
    """A sample's bytes could not be decoded; the message names the key."""


_ADDRESS = " at 0x"  # what object.__repr__ and function reprs embed: a memory address, new in every process


def _code_digest(code: types.CodeType) -> str:
    """A digest of a code object's bytecode, names and constants (nested code objects included; line numbers not)."""
    h = hashlib.sha1(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            h.update(_code_digest(c).encode())
        elif isinstance(c, frozenset):  # `x in {"a", "b"}`: its order follows the per-process string hash seed
            h.update(repr(sorted(repr(v) for v in c)).encode())
        else:
            h.update(repr(c).encode())
    return h.hexdigest()[:16]


def _global_names(code: types.CodeType) -> set[str]:
    """The names a code object (and the code nested in it: lambdas, comprehensions) may load as globals."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def _global_values(fn: types.FunctionType) -> list[tuple[str, Any]]:
    """``(name=, value)`` of the module-level values ``fn`` reads: data, not code (modules, classes and functions are
    code it calls, named by its own code already). A decoder reading a module-level setting (``SIZE = 16``) changes
    its output when that setting changes, as a closure value does; values without a stable form are left out (the
    caller cannot name them in every run either)."""
    scope = fn.__globals__
    out = []
    for name in sorted(_global_names(fn.__code__)):
        if name not in scope:
            continue  # an attribute name, a builtin, or a global not defined (yet)
        value = scope[name]
        if isinstance(value, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)):
            continue
        if isinstance(value, logging.Logger):  # its repr holds its level: a run at DEBUG must not decode again
            continue
        out.append((f"{name}=", value))
    return out


_NOT_INSTANCES = (
    type,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    functools.partial,
)


def _is_callable_object(obj: Any) -> bool:
    """A callable instance of a class (a ``__call__`` of its own, an ``nn.Module``) without a ``fingerprint``: its
    output follows its code and its attributes, which its ``repr`` need not show (``nn.Module`` shows no plain
    attribute; a hand-written ``__repr__`` shows what its author chose)."""
    if isinstance(obj, _NOT_INSTANCES) or not callable(obj) or not hasattr(obj, "__dict__"):
        return False
    return not getattr(obj, "fingerprint", None)


def _object_parts(obj: Any) -> tuple[list[str], list[tuple[str, Any]], Any]:
    """(class and code digest, ``(label, value)`` attributes, the function whose module-level values count) of an
    object. For an ``nn.Module``: its ``forward`` (its ``__call__`` is torch's), public attributes, submodules,
    parameters and buffers (not the hooks and flags torch keeps, nor ``training``: ``.eval()`` is no new decoder)."""
    cls = type(obj)
    if isinstance(obj, torch.nn.Module):
        code = inspect.getattr_static(cls, "forward", None)
        attrs = sorted((k, v) for k, v in vars(obj).items() if not k.startswith("_") and k != "training")
        named = [(f"{k}=", v) for k, v in attrs]
        parts = (
            ("module", obj.named_children()),
            ("param", obj.named_parameters(recurse=False)),
            ("buffer", obj.named_buffers(recurse=False)),
        )
        for kind, items in parts:
            named += [(f"{kind} {k}=", v) for k, v in items]
    else:
        code = inspect.getattr_static(cls, "__call__", None)
        named = [(f"{k}=", v) for k, v in sorted(vars(obj).items())]
    head = [f"{cls.__module__}.{cls.__qualname__}"]
    if isinstance(code, types.FunctionType):
        head.append(_code_digest(code.__code__))
        return head, named, code
    return head, named, None


def _stable_identity(obj: Any, depth: int = 0) -> str | None:
    """A text naming ``obj`` that is the same in every process, or None when none can be made."""
    text = repr(obj)
    if _ADDRESS not in text and not _is_callable_object(obj):
        return text  # a repr without an address (numbers, strings, dataclasses, ImageDecoder, ...)
    if depth > 4:
        return None
    named: list[tuple[str, Any]] = []  # (label, value) pairs whose stable identities make up obj's
    optional: list[tuple[str, Any]] = []  # pairs left out when they have no stable identity (module-level values)
    if isinstance(obj, functools.partial):
        named = [("", v) for v in (obj.func, *obj.args)] + [(f"{k}=", v) for k, v in sorted(obj.keywords.items())]
        head = ["partial"]
    elif isinstance(obj, types.MethodType):
        named, head = [("", obj.__func__), ("", obj.__self__)], ["method"]
    elif isinstance(obj, types.FunctionType):
        # The code is part of the identity: editing the function's body decodes again, never serves old entries.
        cells = [c.cell_contents for c in obj.__closure__ or ()]
        kwdefaults = sorted((obj.__kwdefaults__ or {}).items())
        named = [("", v) for v in (*(obj.__defaults__ or ()), *cells)] + [(f"{k}=", v) for k, v in kwdefaults]
        head = [f"{obj.__module__}.{obj.__qualname__}", _code_digest(obj.__code__)]
        optional = _global_values(obj)
    elif isinstance(obj, (type, types.BuiltinFunctionType)):
        return f"{obj.__module__}.{obj.__qualname__}"
    elif hasattr(obj, "__dict__"):
        # A callable object takes this branch whatever its repr: a decoder module `Gray(size)` printed as `Gray()`
        # kept one namespace for every size, and a later run at another size was served the earlier run's samples.
        head, named, code = _object_parts(obj)
        optional = _global_values(code) if code is not None else []
    else:
        return None
    parts = list(head)
    for label, value in named:
        ident = _stable_identity(value, depth + 1)
        if ident is None:
            return None
        parts.append(label + ident)
    for label, value in optional:
        ident = _stable_identity(value, depth + 1)
        if ident is not None:
            parts.append("global " + label + ident)
    return f"({', '.join(parts)})"


def decoder_fingerprint(decode: Callable[[bytes], torch.Tensor]) -> str:
    """The text that namespaces a decoder's cache entries; the same in every run for the same decoder.

    Its ``fingerprint`` attribute when it has one (set it to a string that changes whenever the output changes);
    else an identity made of what defines it: a function's module, qualified name, code, default arguments, closure
    values and the module-level values its code reads (a lambda or nested function too), an object's class,
    ``__call__`` code (an ``nn.Module``'s ``forward``; with the module-level values it reads) and attributes (whatever
    its ``repr`` shows), a ``functools.partial``'s function and arguments; other values (numbers, strings, lists,
    dataclasses, ...) by their ``repr`` when that holds no memory address. Code the decoder calls is not part of it:
    give the decoder a ``fingerprint`` when that changes. When no identity can be made (an attribute whose
    repr holds a memory address), this warns and falls back to the repr: nothing is served from an earlier run.
    """
    fp = getattr(decode, "fingerprint", None)
    if fp:
        return str(fp)
    ident = _stable_identity(decode)
    if ident is not None:
        return ident
    warnings.warn(
        f"`decode` {decode!r} has no `fingerprint` and no identity that is the same in every run, so the cache "
        "cannot recognise its entries in a later run (every run decodes again). Set `decode.fingerprint` to a string "
        "that changes whenever its output changes, e.g. 'my_decode-v1'.",
        UserWarning,
        stacklevel=3,
    )
    return repr(decode)


class ImageDecoder:
    """Decode an image file, resize its shorter side to ``size`` and centre-crop to ``size x size``: uint8 (3, H, W).

    Exactly torchvision's ``Resize(size) -> CenterCrop(size) -> PILToTensor()`` after ``ImageFolder``'s loader
    (``PIL.Image.open(...).convert("RGB")``), so cached tensors are bit-identical to that pipeline; steps that would
    only copy (converting an RGB image to RGB, resizing or cropping an image already at the size) are skipped.

    Args:
        size: output side in pixels; ``None`` keeps the original size (then every image must have the same size).
        fast_jpeg: decode JPEGs that need no resize with libjpeg-turbo through torchvision (same pixels,
            faster; see :meth:`decode_into`); ``False``: PIL for everything.
        device: ``"cuda"`` (or ``"cuda:N"``): :meth:`decode_batch_into` decodes a batch's JPEGs that need no resize
            in one nvJPEG call on that device (``torchvision.io.decode_jpeg(..., device="cuda")``) and copies them
            into the batch; the rest, and :meth:`decode_into`, stay on the CPU. nvJPEG's pixels differ from
            libjpeg-turbo's by rounding (IDCT, chroma upsampling), so the cache keeps them apart (``fingerprint``).
            CUDA cannot run in forked DataLoader workers: decode in the main process (``num_workers=0``).
        draft: JPEGs at least twice ``size`` on their shorter side are decoded at a reduced scale in the DCT domain
            (PIL's ``Image.draft``: 1/2, 1/4 or 1/8, never below ``size``) before the resize. Not bit-identical to
            the full decode + resize (its own cache namespace): on scikit-learn's 427x640 photographs at 160 px,
            13.2 -> 7.1 ms per image, mean absolute pixel difference 2.4 of 255 (max 59, at edges), measured under
            load. At 224 px from sources under 448 px it changes nothing (no scale fits). Default off.
    """

    def __init__(
        self, size: int | None = 224, *, fast_jpeg: bool = True, device: str | None = None, draft: bool = False
    ) -> None:
        check_int("image_size", size, low=1, allow_none=True, fix="None keeps the original size.")
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"`device` must be None (CPU) or a CUDA device such as 'cuda', got {device!r}.")
        if not isinstance(draft, bool):
            raise TypeError(f"`draft` must be True or False, got {draft!r} ({type(draft).__name__}).")
        if not isinstance(fast_jpeg, bool):  # a string is truthy: fast_jpeg="no" decoded through libjpeg-turbo
            raise TypeError(f"`fast_jpeg` must be True or False, got {fast_jpeg!r} ({type(fast_jpeg).__name__}).")
        self.size = size
        self.fast_jpeg = bool(fast_jpeg)
        self.device = device
        self.draft = draft

    @property
    def fingerprint(self) -> str:
        # The CPU paths (PIL, libjpeg-turbo) give the same pixels: one namespace. nvJPEG's differ: its own; so do
        # draft-scaled decodes. The size is in every namespace: a new `size` decodes again, never serves old entries.
        tail = ("" if self.device is None else ",nvjpeg") + (",draft" if self.draft and self.size is not None else "")
        return f"ImageDecoder(size={self.size},v1{tail})"

    def pil_transform(self) -> Any:
        """The torchvision transform applied to the RGB PIL image (also what a baseline ``ImageFolder`` should use)."""
        T = _transforms()
        ops = [T.Resize(self.size), T.CenterCrop(self.size)] if self.size is not None else []
        return T.Compose([*ops, T.PILToTensor()])

    def _rgb(self, data: bytes) -> Any:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            if self.draft and self.size is not None and img.format == "JPEG":
                img.draft("RGB", (self.size, self.size))  # the smallest DCT scale that keeps both sides >= size
            img.load()
            # ImageFolder's `convert("RGB")` copies an image that already is RGB (most JPEGs): skip that copy.
            rgb = img if img.mode == "RGB" else img.convert("RGB")
        if self.size is not None and rgb.size != (self.size, self.size):
            resize, crop = _resize_and_crop(self.size)
            if min(rgb.size) != self.size:  # at the size already, Resize only copies
                rgb = resize(rgb)
            if rgb.size != (self.size, self.size):
                rgb = crop(rgb)
        return rgb

    def out_shape(self, data: bytes) -> tuple[int, int, int]:
        """The (3, H, W) shape :meth:`decode_into` needs for ``data`` without decoding its pixels."""
        if self.size is not None:
            return (3, self.size, self.size)
        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
        return (3, h, w)

    def decode_into(self, data: bytes, out: torch.Tensor) -> None:
        """Decode ``data`` straight into ``out``, a contiguous uint8 (3, H, W) tensor (e.g. a row of a batch).

        A baseline or progressive JPEG with 1 or 3 components that needs no resize (already at the size, or only a
        centre crop) is decoded by ``torchvision.io.decode_jpeg`` (libjpeg-turbo, as PIL) and copied into ``out`` once,
        at a fraction of the cost through PIL (``Image.open`` + ``load`` + ``split``; the cold rows of
        ``benchmarks/data_cache.py`` include decoding), bit-identical (tested; libjpeg-turbo's default integer IDCT and
        upsampling on both sides). Everything else (PNG, CMYK JPEGs, images that need a resize: PIL's resampling is not
        torchvision's tensor resize) goes through PIL, whose CHW planes come from ``split()`` (a C de-interleave).
        Bit-identical to ``pil_transform()`` either way.

        Raises:
            ValueError: ``out`` is not a contiguous uint8 tensor of the decoded image's shape.
        """
        fast = self._jpeg_tensor(data)
        if fast is not None:
            _check_out(out, fast.shape[1], fast.shape[2])
            # numpy's strided copy of the HWC decode into the CHW row: cheaper than torch's `copy_` for this
            # layout
            np.copyto(out.numpy(), fast.numpy())
            return
        rgb = self._rgb(data)
        w, h = rgb.size
        _check_out(out, h, w)
        _fill_planes(rgb, out)

    def decode_batch_into(self, datas: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Decode on ``device`` (one nvJPEG batch) the JPEGs of ``datas`` that need no resize, copy each into its
        ``outs`` row (contiguous uint8 (3, H, W), any device); returns which were done. The caller decodes the others
        with :meth:`decode_into`. Without ``device`` nothing is done here.
        """
        done = [False] * len(datas)
        ops = compat.jpeg_decode_ops() if self.device is not None else None
        if ops is None or not datas:
            return done
        _, decode_cuda, _, rgb_mode = ops
        pos = [i for i, d in enumerate(datas) if d.startswith(b"\xff\xd8")]
        if not pos:
            return done
        device = torch.device(self.device)  # type: ignore[arg-type]  # not None here
        encoded = [torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8) for i in pos]
        try:
            imgs = decode_cuda(encoded, rgb_mode, device)
        except RuntimeError:
            return done  # one undecodable image fails the call: the CPU path decides, image by image
        s = self.size
        for i, img in zip(pos, imgs, strict=True):
            _, h, w = img.shape
            if s is not None:
                if min(h, w) != s:
                    continue  # a resize: the CPU path applies PIL's filter
                top, left = int(round((h - s) / 2.0)), int(round((w - s) / 2.0))
                img = img[:, top : top + s, left : left + s]
            out = outs[i]
            if tuple(out.shape) != tuple(img.shape) or out.dtype != torch.uint8:
                continue  # the CPU path raises the error that names the shapes
            out.copy_(img, non_blocking=False)
            done[i] = True
        return done

    def _jpeg_tensor(self, data: bytes) -> torch.Tensor | None:
        """The (3, H, W) uint8 image (a view, maybe strided) by libjpeg-turbo through torchvision, or None when
        this image must take the PIL path (not a JPEG, not 1 or 3 components, needs a resize, or torchvision fails
        to decode it: PIL then decides, and raises what ImageFolder would)."""
        if not data.startswith(b"\xff\xd8") or not self.fast_jpeg:
            return None
        ops = compat.jpeg_decode_ops()
        if ops is None:
            return None
        decode_cpu, _, unchanged, _ = ops
        try:
            img = decode_cpu(torch.frombuffer(bytearray(data), dtype=torch.uint8), unchanged)
        except (RuntimeError, ValueError):
            return None
        c, h, w = img.shape
        if c == 1:
            img = img.expand(3, h, w)  # PIL's L -> RGB replicates the channel, as this does
        elif c != 3:
            return None  # CMYK / YCCK: PIL's conversion differs from libjpeg's, keep ImageFolder's result
        s = self.size
        if s is None:
            return img
        if min(h, w) != s:
            return None  # a resize: PIL's filter is what the ImageFolder pipeline applies
        # torchvision's CenterCrop offsets: int(round((side - size) / 2))
        top, left = int(round((h - s) / 2.0)), int(round((w - s) / 2.0))
        return img[:, top : top + s, left : left + s]

    def __call__(self, data: bytes) -> torch.Tensor:
        fast = self._jpeg_tensor(data)
        if fast is not None:
            return fast.contiguous()
        rgb = self._rgb(data)
        w, h = rgb.size
        out = torch.empty((3, h, w), dtype=torch.uint8)
        _fill_planes(rgb, out)
        return out

    def __repr__(self) -> str:
        dev = "" if self.device is None else f", device={self.device!r}"
        return f"ImageDecoder(size={self.size}{dev}{', draft=True' if self.draft else ''})"


@functools.lru_cache(maxsize=8)
def _resize_and_crop(size: int) -> tuple[Any, Any]:
    """torchvision's ``Resize(size)`` and ``CenterCrop(size)`` (stateless, so one pair per size serves every decoder,
    thread and process)."""
    T = _transforms()
    return T.Resize(size), T.CenterCrop(size)


def _check_out(out: torch.Tensor, h: int, w: int) -> None:
    if out.dtype != torch.uint8 or tuple(out.shape) != (3, h, w) or not out.is_contiguous():
        raise ValueError(
            f"`out` must be a contiguous uint8 tensor of shape (3, {h}, {w}), got {out.dtype} "
            f"{tuple(out.shape)} (contiguous={out.is_contiguous()})."
        )


def _transforms() -> Any:
    """``torchvision.transforms``, imported on first use (decoding a cached epoch never needs it)."""
    from torchvision import transforms  # type: ignore[import-untyped]  # torchvision ships no type hints

    return transforms


def _fill_planes(rgb: Any, out: torch.Tensor) -> None:
    w, h = rgb.size
    planes = out.numpy().reshape(3, h * w)
    for c, plane in enumerate(rgb.split()):
        planes[c] = np.frombuffer(plane.tobytes(), dtype=np.uint8)
