"""Split a checkpoint dict into named tensors and a tensor-free *skeleton* that loads without unpickling code.

The skeleton is the checkpoint with every (strided, dense) tensor replaced by a placeholder string
(``"\\x00la.tensor:<name>"``); it is serialised with ``torch.save`` and read back with
``torch.load(weights_only=True)``, which refuses arbitrary classes. Tensors are kept out of the skeleton even when
tiny, because the weights-only unpickler pays a fixed cost per tensor (Adam's ``step`` scalars add up; load times in
``benchmarks/delta_checkpoint.py``); small tensors are packed as raw bytes next to the skeleton instead, in one
*skeleton blob* (:func:`pack_skeleton_blob`).

Allowed leaves: ``str``, ``bytes``, ``int``, ``float``, ``bool``, ``None``, ``complex``, ``torch.dtype``,
``torch.device``, ``torch.Size``, tensors; containers: ``dict`` / ``OrderedDict`` / ``list`` / ``tuple`` / ``set``;
dict keys: the same leaves. Leaves and keys must be of these exact types: the weights-only unpickler refuses
subclasses (a ``str`` or ``int`` ``Enum``, ``numpy.float64``) and ``frozenset``. Anything else (a custom class, a
``functools.partial``, an ``AttributeDict``) is refused at *save* time with the key path that holds it, so a
checkpoint that was written can always be loaded safely.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from lightning_accel._utils.compat import set_state_dict_metadata, state_dict_metadata
from lightning_accel.checkpoint import codec

__all__ = [
    "PLACEHOLDER",
    "UnsafeCheckpointContent",
    "alias_groups",
    "restore_aliases",
    "dump_skeleton",
    "fill_skeleton",
    "load_skeleton",
    "pack_skeleton_blob",
    "placeholder_names",
    "split",
    "unpack_skeleton_blob",
]

PLACEHOLDER = "\x00la.tensor:"
_PRIMITIVES = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)
# No frozenset: `torch.load(weights_only=True)` refuses it (a checkpoint holding one could be written, never read).
_CONTAINERS = (dict, OrderedDict, list, tuple, set)


class UnsafeCheckpointContent(TypeError):
    """The checkpoint holds an object that could only be restored by unpickling arbitrary code."""


def _key_str(k: Any) -> str:
    return str(k).replace("/", "%2F")


def _is_leaf(obj: Any) -> bool:
    """Whether ``obj`` is an allowed leaf: the exact types only, since the weights-only unpickler refuses subclasses
    (``str``/``int`` Enums, ``numpy.float64``) that an ``isinstance`` test would let through."""
    return type(obj) in _PRIMITIVES


def _unique_name(path: str, taken: Any) -> str:
    """The tensor name of key path ``path``: the path without its leading ``/`` (``"tensor"`` at the root), with
    ``#1``, ``#2``, ... appended when two key paths spell the same name."""
    name = path.lstrip("/") or "tensor"
    base, i = name, 1
    while name in taken:
        name, i = f"{base}#{i}", i + 1
    return name


def _plain_metadata(meta: Any, path: str) -> Any:
    """``meta`` (a state dict's ``_metadata``: module prefix -> ``{"version": int, ...}``) if it holds only the plain
    leaves and containers the skeleton allows and no tensor (it is kept as an attribute, where no placeholder is
    filled back); else :class:`UnsafeCheckpointContent` naming ``path``."""
    if _is_leaf(meta):
        return meta
    if type(meta) in (dict, OrderedDict):
        for k, v in meta.items():
            _plain_metadata(k, path)
            _plain_metadata(v, f"{path}/{_key_str(k)}")
        return meta
    if type(meta) in (list, tuple, set):
        for v in meta:
            _plain_metadata(v, path)
        return meta
    raise UnsafeCheckpointContent(
        f"The state dict metadata at `{path}` holds a `{type(meta).__module__}.{type(meta).__qualname__}`; only plain "
        "data (dicts, lists, numbers, strings) can be stored there. Remove it from the state dict's `_metadata` in "
        "`on_save_checkpoint`."
    )


def split(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Replace every dense tensor by a placeholder (sparse / non-strided tensors stay in the skeleton).

    Args:
        checkpoint: the Lightning checkpoint dict (not modified).

    Returns:
        ``(skeleton, tensors)``: ``tensors`` maps a stable name (the ``/``-joined key path, e.g.
        ``"optimizer_states/0/state/3/exp_avg"``) to the tensor object (not copied).

    Raises:
        UnsafeCheckpointContent: a value of a type ``torch.load(weights_only=True)`` would refuse, naming its key path.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
                raise UnsafeCheckpointContent(
                    f"The checkpoint holds a tensor subclass `{type(obj).__qualname__}` at `{path or '/'}`; the delta "
                    "checkpoint store only saves plain tensors. Convert it with `.as_subclass(torch.Tensor)` or "
                    "`torch.Tensor(t)` in `on_save_checkpoint`."
                )
            if obj.is_sparse or obj.layout != torch.strided:
                return obj.detach()
            name = _unique_name(path, tensors)
            tensors[name] = obj.detach()
            return PLACEHOLDER + name
        if type(obj) is str:
            if obj.startswith(PLACEHOLDER):
                raise UnsafeCheckpointContent(
                    f"The string at `{path or '/'}` starts with the reserved placeholder prefix {PLACEHOLDER!r}."
                )
            return obj
        if _is_leaf(obj):
            return obj
        if type(obj) in (dict, OrderedDict):
            out = type(obj)()
            for k, v in obj.items():
                if not _is_leaf(k):
                    raise UnsafeCheckpointContent(
                        f"The checkpoint has a dict key {k!r} of type `{type(k).__module__}.{type(k).__qualname__}` "
                        f"at `{path or '/'}`, which `torch.load(weights_only=True)` refuses; keys must be plain str, "
                        "int, float, bool or None (not a subclass such as an Enum or numpy.float64). Convert the key "
                        "in `on_save_checkpoint` / `state_dict()`, e.g. `key.value` or `str(key)`."
                    )
                out[k] = walk(v, f"{path}/{_key_str(k)}")
            meta = state_dict_metadata(obj)
            if meta is not None:
                # `Module.state_dict()` records each module's `_version` here, and `load_state_dict` hands it to the
                # module's `_load_from_state_dict`, which migrates "old" formats when it is missing (an observer's
                # saved `eps` is replaced by the default). `torch.save` keeps it; so must the skeleton.
                set_state_dict_metadata(out, _plain_metadata(meta, f"{path}/_metadata"))
            return out
        if type(obj) in (list, tuple):
            return type(obj)(walk(v, f"{path}/{i}") for i, v in enumerate(obj))
        if type(obj) is set:
            return {walk(v, f"{path}/{i}") for i, v in enumerate(obj)}
        raise UnsafeCheckpointContent(
            f"The checkpoint holds a `{type(obj).__module__}.{type(obj).__qualname__}` at `{path or '/'}`, which "
            "could only be restored by unpickling arbitrary code, so the delta checkpoint store refuses it. Store "
            "plain data instead (dicts, lists, numbers, strings, tensors), e.g. convert it in "
            "`on_save_checkpoint` / `state_dict()`, or use `TorchCheckpointIO` for trusted checkpoints."
        )

    skeleton = walk(checkpoint, "")
    return skeleton, tensors


def dump_skeleton(skeleton: dict[str, Any]) -> bytes:
    """``torch.save`` the skeleton to bytes (it only holds the types :func:`split` allows)."""
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    return buf.getvalue()


def load_skeleton(data: bytes) -> dict[str, Any]:
    """Read a skeleton with ``torch.load(weights_only=True)``: never unpickles arbitrary objects."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def fill_skeleton(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Put the tensors back where their placeholders are (in place for dicts and lists, rebuilt for tuples/sets)."""

    def walk(obj: Any) -> Any:
        if isinstance(obj, str) and obj.startswith(PLACEHOLDER):
            return tensors[obj[len(PLACEHOLDER) :]]
        if isinstance(obj, dict):
            for k in list(obj):
                obj[k] = walk(obj[k])
            return obj
        if isinstance(obj, list):
            for i, v in enumerate(obj):
                obj[i] = walk(v)
            return obj
        if isinstance(obj, (tuple, set, frozenset)) and not isinstance(obj, torch.Size):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(skeleton)


def placeholder_names(skeleton: Any) -> set[str]:
    """The tensor names whose placeholders the skeleton holds."""
    wanted: set[str] = set()

    def walk(obj: Any) -> None:
        if isinstance(obj, str) and obj.startswith(PLACEHOLDER):
            wanted.add(obj[len(PLACEHOLDER) :])
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                walk(v)

    walk(skeleton)
    return wanted


def pack_skeleton_blob(
    skeleton_bytes: bytes, small: dict[str, torch.Tensor], aliases: list[list[list[Any]]] | None = None
) -> bytes:
    """One blob (kind ``"skeleton"``): the ``torch.save``d skeleton followed by the raw bytes of the small tensors,
    zstd on top; the header lists ``[name, dtype, shape, offset]`` per small tensor and, when tensors of the
    checkpoint share memory, their :func:`alias_groups` under ``aliases`` (absent otherwise, so a checkpoint without
    shared tensors writes the same blob as before the record existed)."""
    parts, items, offset = [skeleton_bytes], [], len(skeleton_bytes)
    for name, t in small.items():
        raw = codec.tensor_bytes(t)
        items.append([name, codec.dtype_name(t.dtype), list(t.shape), offset])
        parts.append(raw.tobytes())
        offset += raw.size
    body = b"".join(parts)
    header = {
        "kind": "skeleton",
        "dtype": "uint8",
        "nbytes": len(body),
        "ref": None,
        "items": items,
        "skeleton_bytes": len(skeleton_bytes),
    }
    if aliases:
        header["aliases"] = aliases
    return codec.pack_blob(header, codec.zstd_compress(body, 3, 0))


def unpack_skeleton_blob(blob: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The skeleton (read with ``torch.load(weights_only=True)``) and the small tensors of a skeleton blob.

    Raises:
        codec.CodecError: not a skeleton blob, or a damaged one.
    """
    header, payload = codec.read_header(blob)
    if header["kind"] != "skeleton":
        raise codec.CodecError(f"expected a skeleton blob, got `{header['kind']}`")
    body = codec.zstd_decompress(payload, int(header["nbytes"]))
    n = int(header["skeleton_bytes"])
    skeleton = load_skeleton(body[:n].tobytes())
    small = {}
    for name, dname, shape, offset in header["items"]:
        dtype = codec.dtype_from_name(dname)
        size = codec.itemsize_of(dtype)
        for d in shape:
            size *= int(d)
        if offset < n or offset + size > body.size:
            raise codec.CodecError(f"small tensor {name!r} lies outside the skeleton blob")
        small[name] = codec.tensor_from_bytes(body[offset : offset + size], dtype, shape)
    return skeleton, small


def alias_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[list[Any]]]:
    """The tensors that share memory, grouped by storage: ``[[name, byte offset, strides], ...]`` per group of two or
    more (tied weights, two state-dict keys viewing one buffer), in ``tensors``' order.

    ``torch.save`` writes a storage once and ``torch.load`` gives the tensors viewing it one storage again; the delta
    store saves every tensor on its own, so it records this to restore the sharing (:func:`restore_aliases`).
    Empty tensors hold no memory and are left out, and so are lazy conjugate / negative views (``c.conj()``): their
    values are not the bytes of the memory they view, so they are restored as copies of their own.
    """
    by_storage: dict[tuple[Any, ...], list[list[Any]]] = {}
    for name, t in tensors.items():
        if t.layout != torch.strided or t.is_sparse or not t.numel() or t.device.type == "meta":
            continue
        if t.is_conj() or t.is_neg():  # saved as its resolved values, which are not the bytes it views
            continue
        storage = t.untyped_storage()
        if not storage.data_ptr() or not storage.nbytes():
            continue
        member = [name, int(t.storage_offset()) * t.element_size(), [int(s) for s in t.stride()]]
        by_storage.setdefault((t.device, storage.data_ptr()), []).append(member)
    return [group for group in by_storage.values() if len(group) > 1]


#: Most bytes one restored group of shared tensors may span (a damaged record must not allocate without bound).
_MAX_ALIAS_SPAN = 1 << 48


def restore_aliases(groups: Any, tensors: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
    """Make each group of :func:`alias_groups` share one storage again, in place in ``tensors``.

    Each member's restored values are copied into one new buffer at the byte offset and with the strides it had at
    save time; bytes no member covers are zero. The buffer is made on ``device`` (default: the first member's), so
    the sharing survives a ``map_location``.

    Raises:
        ValueError: the record is damaged (an unknown tensor name, a bad offset or strides).
    """
    if not isinstance(groups, list):
        raise ValueError(f"the shared-tensor record is a {type(groups).__name__}, not a list")
    for group in groups:
        if not isinstance(group, list):
            raise ValueError(f"a shared-tensor group is a {type(group).__name__}, not a list")
        members: list[tuple[str, torch.Tensor, int, list[int], int]] = []
        for member in group:
            if not (isinstance(member, list) and len(member) == 3 and member[0] in tensors):
                raise ValueError(f"shared-tensor entry {member!r} names no tensor of the checkpoint")
            name, offset, stride = member
            t = tensors[name]
            ints = [offset, *stride] if isinstance(stride, list) else []
            if len(ints) != t.dim() + 1 or not all(type(v) is int and 0 <= v < _MAX_ALIAS_SPAN for v in ints):
                raise ValueError(
                    f"shared-tensor entry {member!r} has a bad offset or strides for shape {list(t.shape)}"
                )
            size = t.element_size()
            if offset % size:
                raise ValueError(f"shared-tensor entry {member!r}: offset not a multiple of the {size}-byte item")
            span = (sum((n - 1) * s for n, s in zip(t.shape, stride, strict=True)) + 1) * size if t.numel() else 0
            members.append((name, t, offset, stride, span))
        if not members:
            continue
        align = max(t.element_size() for _, t, _, _, _ in members)
        base = min(offset for _, _, offset, _, _ in members) // align * align
        end = max(offset + span for _, _, offset, _, span in members)
        total = -(-(end - base) // align) * align
        if total > _MAX_ALIAS_SPAN:
            raise ValueError(f"a shared-tensor group spans {total} bytes")
        buf = torch.zeros(total, dtype=torch.uint8, device=device if device is not None else members[0][1].device)
        storage = buf.untyped_storage()
        for name, t, offset, stride, _ in members:
            size = t.element_size()
            view = torch.empty(0, dtype=t.dtype, device=buf.device)
            view.set_(storage, (offset - base) // size, t.shape, stride)
            try:
                view.copy_(t)
            except RuntimeError:  # a view that overlaps itself (an `expand`): written element by element instead
                flat = torch.empty(0, dtype=t.dtype, device=buf.device).set_(storage, 0, (total // size,), (1,))
                index = torch.arange(total // size, device=buf.device).as_strided(
                    t.shape, stride, (offset - base) // size
                )
                flat[index.reshape(-1)] = t.reshape(-1).to(buf.device)
            tensors[name] = view
