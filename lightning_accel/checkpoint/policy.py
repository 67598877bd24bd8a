"""The encode policy of the delta store: what each tensor of a save becomes, as pure functions of what is known.

For one tensor of a save (:func:`plan`), given the chain state its previous save in the directory left
(:class:`ChainState`, or none):

1. ``"unchanged"`` — same dtype and shape, and its bytes hash to what was saved or restored last time: the entry is
   reused (a reference, nothing written).
2. ``"xor"`` or ``"quant"`` — a delta against the chain's reference (``delta_ref="base"``: the chain's full snapshot;
   ``"previous"``: the previous reconstruction), block-quantized when :func:`wants_quant` selects the tensor, else a
   lossless XOR. Only while the chain has room (:attr:`StoreOptions.chain_limit
   <lightning_accel.checkpoint.options.StoreOptions.chain_limit>`), holds fewer than ``full_every`` deltas, and its
   base is not dead (:func:`dead_bases`). The encoded delta is kept only if :func:`keep_delta` (smaller than
   ``rebase_ratio`` x the base); otherwise the tensor becomes ``"full"``.
3. ``"full"`` — a lossless snapshot starting a new chain: a new tensor, a new dtype or shape, a chain that is full
   or old, a delta that would not pay; ``"rebased"`` when the reason was a dead base.

No I/O and no encoding here; the store encodes what the plan says (:meth:`DeltaStore.save
<lightning_accel.checkpoint.store.DeltaStore.save>`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_accel.checkpoint.manifest import TensorEntry
from lightning_accel.checkpoint.options import StoreOptions

__all__ = ["ChainState", "Live", "Plan", "dead_bases", "keep_delta", "plan", "ref_is_last", "wants_quant"]

#: What the live manifests of a directory hold, per manifest path: tensor name -> (chain, sizes).
Live = Mapping[str, Mapping[str, tuple[tuple[str, ...], tuple[int, ...]]]]


@dataclass(frozen=True)
class ChainState:
    """One tensor name after a save in this process: its manifest entry and what the next save deltas against.

    Attributes:
        entry: the manifest entry written.
        hash: BLAKE2b of the reconstruction (what a load returns).
        src_hash: BLAKE2b of what was saved (differs from ``hash`` after a quantized delta).
        ref: the reconstruction the next delta is taken against (a private copy, never a live tensor).
        lossy: the reconstruction comes from a quantized delta.
        age: deltas written since the chain's full snapshot.
        content_id: the id of the snapshot buffer content that was saved (``None``: not known); a later save handed
            the same id holds the same bytes, so it is unchanged without hashing
            (:class:`~lightning_accel.checkpoint.background.SnapshotPool` never reuses an id).
    """

    entry: TensorEntry
    hash: str
    src_hash: str
    ref: torch.Tensor
    lossy: bool = False
    age: int = 0
    content_id: int | None = None


@dataclass(frozen=True)
class Plan:
    """What to do with one tensor: ``kind`` and, for a delta, the key of the blob it is taken against."""

    kind: Literal["unchanged", "xor", "quant", "full", "rebased"]
    ref_key: str | None = None


def wants_quant(options: StoreOptions, name: str, is_float: bool) -> bool:
    """Whether tensor ``name`` may be stored as a quantized delta (``quantize`` set, ``is_float``: a float tensor of
    2 bytes or more per element, :func:`~lightning_accel.checkpoint.codec.quantizable`; selected by
    ``quantize_groups``)."""
    if options.quantize is None or not is_float:
        return False
    groups = options.quantize_groups
    if groups == "all":
        return True
    if groups == "optimizer":
        return name.startswith("optimizer_states/")
    return any(name.startswith(p) for p in groups)


def plan(
    options: StoreOptions,
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    src_hash: str,
    is_float: bool,
    prev: ChainState | None,
    dead: frozenset[tuple[str, str]] | set[tuple[str, str]] = frozenset(),
) -> Plan:
    """The plan for tensor ``name`` (dtype name, shape, BLAKE2b of its bytes) given its previous chain state."""
    if prev is None or prev.entry.dtype != dtype or prev.entry.shape != shape:
        return Plan("full")
    if src_hash in (prev.src_hash, prev.hash):
        return Plan("unchanged")
    chain = prev.entry.chain
    if (name, chain[0]) in dead:
        return Plan("rebased")
    room = options.delta_ref == "base" or len(chain) < options.chain_limit  # "base" chains are always 2 long
    if not room or prev.age >= options.full_every:
        return Plan("full")
    ref_key = chain[0] if options.delta_ref == "base" else chain[-1]
    return Plan("quant" if wants_quant(options, name, is_float) else "xor", ref_key)


def ref_is_last(options: StoreOptions, prev: ChainState) -> bool:
    """Whether ``prev.ref`` holds the bytes whose hash is ``prev.hash`` (what the last save restores): right after a
    full snapshot, and always with ``delta_ref="previous"``. Then a tensor whose bytes equal ``prev.ref`` is
    ``"unchanged"`` (a byte comparison, cheaper than hashing)."""
    return prev.age == 0 or options.delta_ref == "previous"


def keep_delta(options: StoreOptions, delta_bytes: int, prev: ChainState) -> bool:
    """Whether an encoded delta of ``delta_bytes`` is worth keeping: smaller than ``rebase_ratio`` x the base."""
    return delta_bytes < options.rebase_ratio * prev.entry.sizes[0]


def dead_bases(options: StoreOptions, live: Live) -> set[tuple[str, str]]:
    """``(tensor name, base key)`` pairs whose next delta should be a full snapshot instead: no live manifest
    holds the base's own version any more (its checkpoint was removed), and the base is more than
    ``rebase_dead_fraction`` of the bytes that the live chains of that tensor keep on disk."""
    if options.rebase_dead_fraction >= 1.0:
        return set()
    owned: set[tuple[str, str]] = set()
    kept: dict[tuple[str, str], dict[str, int]] = {}
    for tensors in live.values():
        for name, (chain, sizes) in tensors.items():
            if not chain:
                continue
            if len(chain) == 1:
                owned.add((name, chain[0]))
            links = kept.setdefault((name, chain[0]), {})
            for k, n in zip(chain, sizes, strict=False):
                links[k] = int(n)
    dead = set()
    for nb, links in kept.items():
        if nb in owned:
            continue
        total = sum(links.values())
        if total and links.get(nb[1], 0) / total > options.rebase_dead_fraction:
            dead.add(nb)
    return dead
