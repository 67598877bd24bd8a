"""Parallelisation plans applied to an unchanged network: FSDP2 sharding and DTensor tensor parallelism.

* :func:`apply_fully_shard`: ``torch.distributed.fsdp.fully_shard`` on every block of the network's repeated stack
  (the units the FSDP estimate counts, :func:`fsdp_units`), then on the root, so only one block's full parameters are
  gathered at a time (torchtitan's plan). The mixed-precision policy comes from the training precision
  (:func:`mixed_precision_policy`).
* :func:`tensor_parallel_plan` / :func:`apply_tensor_parallel`: Megatron-style column/row pairs inside every block:
  the attention's ``q/k/v`` projections column-wise and its output projection row-wise (one all-reduce per
  attention), an MLP's first ``Linear`` column-wise and its second row-wise (one all-reduce per MLP). Attention
  modules keep ``n_head / tp`` heads per rank (their head-count attribute is divided). Everything else (embeddings,
  norms, head) stays replicated: identical on every rank of the tensor-parallel group, so its gradients need no sync.
* A **packed** projection (``c_attn``, ``qkv``, ``qkv_proj``, ``Wqkv``: one ``Linear`` with ``3·d`` outputs, q then k
  then v) is split per head (style ``"colwise_packed"``): its rows are reordered so that the contiguous shard of rank
  ``r`` is ``q_r, k_r, v_r`` (the rows of that rank's heads in each of the three), and the attention module's width
  attributes (:data:`PACKED_WIDTH_ATTRIBUTES`, e.g. ``n_embd`` in ``c_attn(x).split(self.n_embd, dim=2)``) are
  divided like its head count. The reorder is undone for full state dicts (:func:`unpack_rows`), so a checkpoint
  keeps the unsplit layout. ``nn.MultiheadAttention`` (``in_proj_weight``) is refused with one line: its forward
  takes the width from its input, so no per-rank attribute can make a split run.
* An ``nn.Sequential`` MLP is paired only across modules that act on each feature alone
  (:data:`ELEMENTWISE_MODULES`: activations, dropout, identity): between the pair each rank holds a slice of the
  features, on which a ``Softmax`` or a parameter-free ``LayerNorm`` would compute something else. Such a pair stays
  replicated, and the coverage says why.
* :func:`tensor_parallel_coverage` says which ``Linear`` modules a plan splits and which stay replicated, and why.

The core never imports Lightning; ``ShardedStrategy`` (``strategy.py``) applies these inside a Trainer.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from lightning_accel._utils.checks import check_int
from lightning_accel._utils.errors import one_line
from lightning_accel.parallel.estimate import HEAD_ATTRIBUTES, block_stack

__all__ = [
    "BATCH_SPLITS",
    "COLWISE_NAMES",
    "ELEMENTWISE_MODULES",
    "HEAD_ATTRIBUTES",
    "PACKED_NAMES",
    "PACKED_WIDTH_ATTRIBUTES",
    "ROWWISE_NAMES",
    "STYLES",
    "apply_fully_shard",
    "apply_tensor_parallel",
    "check_plan_styles",
    "check_tensor_parallel_plan",
    "describe_coverage",
    "fsdp_groups",
    "fsdp_units",
    "is_parallelized",
    "mixed_precision_policy",
    "pack_rows",
    "tensor_parallel_coverage",
    "tensor_parallel_plan",
    "unpack_rows",
]

#: How a model-parallel plan reads its batch (``batch_split`` of the sharded and pipeline strategies, and of the
#: memory estimate). ``"data_parallel"``: the sampler splits the data over the data-parallel replicas only (every rank
#: of a tensor-parallel / pipeline group reads the same batch: the global batch is ``replicas x batch_size``);
#: ``"world"``: it splits over every rank, as DDP does, and each group gathers its ranks' batches into one (the global
#: batch and the steps per epoch are DDP's).
BATCH_SPLITS = ("data_parallel", "world")

#: ``Linear`` names split by output features (their outputs are sharded), as in Llama / GPT-2 / BERT code.
COLWISE_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv", "qkv_proj", "c_attn", "query", "key", "value", "wq", "wk", "wv",
     "w1", "w3", "fc1", "c_fc", "up_proj", "gate_proj", "fc_in"}
)  # fmt: skip
#: ``Linear`` names split by input features (they take a sharded input and all-reduce their output).
ROWWISE_NAMES = frozenset({"proj", "o_proj", "out_proj", "c_proj", "wo", "w2", "fc2", "down_proj", "fc_out", "dense"})
#: ``Linear`` names of a packed q/k/v projection (``3·d`` outputs: q, then k, then v), split per head.
PACKED_NAMES = frozenset({"c_attn", "qkv", "qkv_proj", "Wqkv", "in_proj"})
#: Attributes of the module holding a packed projection that give the width of one of q/k/v (``split(self.n_embd)``),
#: divided by the tensor-parallel size like its head count.
PACKED_WIDTH_ATTRIBUTES = ("n_embd", "embed_dim", "split_size", "hidden_size", "d_model")
#: plan styles: ``"colwise_packed"`` is ``"colwise"`` on rows reordered per head (:func:`pack_rows`)
STYLES = ("colwise", "rowwise", "colwise_packed")
#: Parameter-free modules that act on each feature alone: the only ones an ``nn.Sequential`` MLP may have between the
#: column-wise and the row-wise ``Linear`` of a pair, since between them each rank holds a slice of the features. A
#: module that mixes features (``Softmax(dim=-1)``, ``LayerNorm(elementwise_affine=False)``, ``GLU``) would compute
#: on the slice alone, a different function (Softmax: 0.033 off on a 16-32-16 MLP), so such a pair stays replicated.
ELEMENTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Dropout, nn.Identity,
)  # fmt: skip


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` wraps before the root: the blocks of the longest repeated stack."""
    return block_stack(model)


def fsdp_groups(modules: list[nn.Module], root: nn.Module) -> tuple[list[list[nn.Module]], list[str]]:
    """``modules`` (the FSDP units) grouped so that tied parameters stay in one FSDP group.

    Units that share a parameter (an embedding tied to the LM head, both children of one ``nn.Sequential`` or
    ``nn.ModuleList``) become one group, sharded by one ``fully_shard([...])`` call (gathered together, the way the
    tied weight is used); a unit sharing a parameter with ``root`` outside every unit is left to ``root``'s group.
    Returns the groups in the units' order and one line per merge or skip (for the log).
    """
    owners: dict[int, set[int]] = {}
    for i, m in enumerate(modules):
        for p in m.parameters():
            owners.setdefault(id(p), set()).add(i)
    inside = set(owners)
    names = {id(m): n for n, m in root.named_modules()}
    outside_users: set[int] = set()  # units whose parameters the root also uses outside every unit
    in_units = {id(x) for u in modules for x in u.modules()}
    for m in root.modules():
        if id(m) in in_units:
            continue
        for p in m.parameters(recurse=False):
            if id(p) in inside:
                outside_users |= owners[id(p)]
    parent = list(range(len(modules)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for users in owners.values():
        first, *rest = sorted(users)
        for j in rest:
            parent[find(j)] = find(first)
    groups: dict[int, list[int]] = {}
    for i in range(len(modules)):
        groups.setdefault(find(i), []).append(i)
    out: list[list[nn.Module]] = []
    notes: list[str] = []
    for members in groups.values():
        label = ", ".join(f"`{names.get(id(modules[i]), type(modules[i]).__name__)}`" for i in members)
        if any(i in outside_users for i in members):
            notes.append(f"{label} share a parameter with the rest of the model: left to the enclosing FSDP group")
            continue
        if len(members) > 1:
            notes.append(f"{label} share tied parameters: one FSDP group")
        out.append([modules[i] for i in members])
    return out, notes


def _shard_groups(groups: list[list[nn.Module]], **kw: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for g in groups:
        fully_shard(g[0] if len(g) == 1 else g, **kw)


def is_parallelized(model: nn.Module) -> bool:
    """True when ``fully_shard`` or a DTensor plan was applied already (e.g. by the user's ``configure_model``)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    )


def mixed_precision_policy(precision: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a Trainer ``precision``: ``"bf16-mixed"`` / ``"16-mixed"`` compute in
    that dtype with fp32 gradient reduction (fp32 master weights stay sharded); anything else: None (no policy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def apply_fully_shard(
    model: nn.Module,
    mesh: Any = None,
    *,
    units: list[nn.Module] | None = None,
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
) -> int:
    """``fully_shard`` each unit (default :func:`fsdp_units`; units that share tied parameters as one group,
    :func:`fsdp_groups`), then ``model`` itself. Returns the number of units.

    Args:
        model: the module to shard in place (a LightningModule works: its network's blocks are found inside it).
        mesh: a 1-D device mesh to shard over (None: the default process group).
        units: the modules to shard one by one (None: the repeated blocks).
        mp_policy: a ``MixedPrecisionPolicy`` (None: keep the parameters' dtype).
        reshard_after_forward: free each unit's gathered parameters after its forward (ZeRO-3; False: ZeRO-2-like,
            faster, more memory).
    """
    from torch.distributed.fsdp import fully_shard

    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    chosen = fsdp_units(model) if units is None else units
    groups, _ = fsdp_groups(chosen, model)
    _shard_groups(groups, **kw)
    fully_shard(model, **kw)
    return len(chosen)


def _packed_parts(name: str, lin: nn.Linear, width: int | None = None) -> int:
    """3 for a packed q/k/v projection (by name, ``3·width`` outputs when the width is known), else 1."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf not in PACKED_NAMES or lin.out_features % 3:
        return 1
    return 3 if width is None or lin.out_features == 3 * width else 1


def _elementwise(m: nn.Module) -> bool:
    """Whether ``m`` acts on each feature alone (:data:`ELEMENTWISE_MODULES`, or an ``nn.Sequential`` of them)."""
    if isinstance(m, nn.Sequential):
        return all(_elementwise(c) for c in m)
    return type(m) in ELEMENTWISE_MODULES


def _sequential_pairs(seq: nn.Sequential, join: str) -> tuple[dict[str, str], dict[str, str]]:
    """The ``Linear, elementwise..., Linear`` MLP pairs of ``seq`` whose features chain, and, for a ``Linear`` left
    unpaired because a feature-mixing module sits between it and its partner, why. Names are prefixed by ``join``."""
    plan: dict[str, str] = {}
    why: dict[str, str] = {}
    prev: tuple[str, nn.Linear] | None = None
    between: list[tuple[str, nn.Module]] = []
    for n, c in seq.named_children():
        if isinstance(c, nn.Linear):
            if prev is not None and prev[1].out_features == c.in_features and join + prev[0] not in plan:
                mixing = [(m, x) for m, x in between if not _elementwise(x)]
                if not mixing:
                    plan[join + prev[0]], plan[join + n] = "colwise", "rowwise"
                else:
                    label = ", ".join(f"`{join}{m}` ({type(x).__name__})" for m, x in mixing)
                    for name, partner in ((prev[0], n), (n, prev[0])):
                        why.setdefault(
                            join + name, f"{label} between it and its partner `{join}{partner}` mixes features"
                        )
            prev, between = (n, c), []
        elif any(True for _ in c.parameters()):
            prev, between = None, []  # a module with weights (a norm, a conv) ends the MLP pattern
        else:
            between.append((n, c))
    return plan, {k: v for k, v in why.items() if k not in plan}


def _linear_pairs(module: nn.Module, base: str = "") -> tuple[dict[str, str], dict[str, str]]:
    """``{name: "colwise" | "colwise_packed" | "rowwise"}`` for the column/row pairs inside one block, and
    ``{name: why it stays replicated}`` for a ``Linear`` whose pair a feature-mixing module broke; names are relative
    to ``module``, prefixed by ``base`` (the block's name in the model)."""
    plan: dict[str, str] = {}
    why: dict[str, str] = {}
    for prefix, m in module.named_modules():
        children = list(m.named_children())
        linears = {n: c for n, c in children if isinstance(c, nn.Linear)}
        if not linears:
            continue
        path = ".".join(x for x in (base, prefix) if x)
        join = (path + ".") if path else ""
        if isinstance(m, nn.Sequential):
            # Linear, elementwise activation..., Linear whose features chain: the MLP pattern
            pairs, broken = _sequential_pairs(m, join)
            plan.update(pairs)
            why.update(broken)
            continue
        col = [n for n in linears if n in COLWISE_NAMES]
        row = [n for n in linears if n in ROWWISE_NAMES]
        if col and len(row) == 1:
            out_width = linears[row[0]].in_features
            parts = {n: _packed_parts(n, linears[n], out_width) for n in col}
            width = {linears[n].out_features // parts[n] for n in col}
            if len(width) == 1 and out_width == width.pop():
                plan.update({join + n: "colwise_packed" if parts[n] > 1 else "colwise" for n in col})
                plan[join + row[0]] = "rowwise"
    return plan, why


def _block_pairs(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """:func:`_linear_pairs` of every block of the repeated stack (or of ``model``), with fully qualified names."""
    names = {id(m): n for n, m in model.named_modules()}
    plan: dict[str, str] = {}
    why: dict[str, str] = {}
    for block in block_stack(model) or [model]:
        pairs, broken = _linear_pairs(block, names[id(block)])
        plan.update(pairs)
        why.update(broken)
    return plan, why


def _refuse_multihead_attention(model: nn.Module, plan: dict[str, str]) -> None:
    """One line naming an ``nn.MultiheadAttention`` the plan would leave whole inside a split block."""
    for name, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            raise ValueError(
                f"tensor parallel cannot split `{name}` (nn.MultiheadAttention): its packed `in_proj_weight` is "
                "applied by `F.multi_head_attention_forward`, which takes the width from the input, so a per-head "
                "shard cannot run. Write the attention with a packed `c_attn`/`qkv` Linear (or q/k/v Linears) and an "
                "output projection, use the sharded plan (`fsdp`), or pass `tp_plan` naming only the MLP Linears "
                "(the attention then stays replicated)."
            )


def tensor_parallel_plan(model: nn.Module, tp_size: int) -> dict[str, str]:
    """``{fully qualified Linear name: "colwise" | "colwise_packed" | "rowwise"}`` for every block of the repeated
    stack (see the module docstring; :func:`tensor_parallel_coverage` lists what stays replicated).

    Raises:
        ValueError: no column/row pair was found (with the count of ``Linear`` modules and the fix), the model holds
            an ``nn.MultiheadAttention`` (one line naming it and the fix), a packed projection's module has no head
            count, or a split dimension or head count is not divisible by ``tp_size``.
    """
    check_int("tensor_parallel_size", tp_size, low=1)
    plan, broken = _block_pairs(model)
    _refuse_multihead_attention(model, plan)
    if not plan:
        n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
        mixing = f"; {next(iter(broken.values()))}" if broken else ""
        raise ValueError(
            f"tensor parallel found 0 parallelisable layer pairs in `{type(model).__name__}` ({n_linear} Linear "
            f"modules, none in a column/row pair: q/k/v (or a packed {sorted(PACKED_NAMES)[:2]}...) + output "
            f"projection named {sorted(ROWWISE_NAMES)[:4]}..., or an nn.Sequential `Linear, act, Linear` MLP with "
            f"only elementwise modules between{mixing}). Use the sharded plan (`fsdp`) for this model, or pass an "
            "explicit `tp_plan` {module name: 'colwise' | 'rowwise'}."
        )
    check_tensor_parallel_plan(model, plan, tp_size)
    return plan


def check_plan_styles(plan: Any, name: str = "tp_plan") -> dict[str, str]:
    """``plan`` when it is a ``{module name: style}`` dict whose styles are all in :data:`STYLES` (the check that
    needs no model, so a strategy can run it in ``__init__``).

    Raises:
        TypeError: ``plan`` is not a dict of strings to strings (one line naming ``name``, the value and the fix).
        ValueError: a style is not one of :data:`STYLES` (one line listing the bad entries).
    """
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        got = one_line(f"{plan!r}")
        raise TypeError(
            f"`{name}` must be a dict {{module name: style}}, got {got[:120]}{'...' if len(got) > 120 else ''} "
            f"({type(plan).__name__}). Map each nn.Linear name to one of {list(STYLES)}, e.g. "
            "{'blocks.0.attn.q_proj': 'colwise', 'blocks.0.attn.proj': 'rowwise'}."
        )
    bad = {k: v for k, v in plan.items() if v not in STYLES}
    if bad:
        raise ValueError(f"`{name}` values must be one of {list(STYLES)}, got {bad}. Fix the style of these entries.")
    return plan


def check_tensor_parallel_plan(model: nn.Module, plan: dict[str, str], tp_size: int) -> None:
    """Raise ``ValueError`` (one line: the module, the numbers, the fix) when ``plan`` cannot split ``model``."""
    mods = dict(model.named_modules())
    check_plan_styles(plan)
    for name, style in plan.items():
        lin = mods.get(name)
        if not isinstance(lin, nn.Linear):
            raise ValueError(
                f"`tp_plan` names `{name}`, which is {'not in the model' if lin is None else type(lin).__name__}: "
                "name nn.Linear modules."
            )
        parts = _parts(name, lin, style)
        dim = lin.out_features // parts if style != "rowwise" else lin.in_features
        if dim % tp_size:
            raise ValueError(
                f"`{name}` has {dim} {'output' if style != 'rowwise' else 'input'} features"
                f"{' per q/k/v part' if parts > 1 else ''}, not divisible by `tensor_parallel_size`={tp_size}. Use a "
                f"tensor-parallel size that divides {dim}."
            )
        if parts > 1:
            parent = mods[name.rsplit(".", 1)[0]] if "." in name else model
            if not any(isinstance(getattr(parent, a, None), int) for a in HEAD_ATTRIBUTES):
                raise ValueError(
                    f"`{name}` is a packed q/k/v projection but `{type(parent).__name__}` has no head count "
                    f"attribute ({', '.join(HEAD_ATTRIBUTES)}) to divide per rank. Name its head count `n_head`, or "
                    "pass `tp_plan` without it (the attention then stays replicated)."
                )
    for m in _attention_modules(model, plan):
        for attr in HEAD_ATTRIBUTES:
            heads = getattr(m, attr, None)
            if isinstance(heads, int) and heads % tp_size:
                raise ValueError(
                    f"`{type(m).__name__}.{attr}`={heads} heads cannot be split over `tensor_parallel_size`={tp_size}."
                    f" Use a tensor-parallel size that divides {heads}."
                )


def _parts(name: str, lin: nn.Linear, style: str) -> int:
    """How many q/k/v parts a column-split ``Linear`` packs (``"colwise"`` on a packed name counts as packed)."""
    if style == "colwise_packed":
        return 3
    return _packed_parts(name, lin) if style == "colwise" else 1


def _attention_modules(model: nn.Module, plan: dict[str, str]) -> list[nn.Module]:
    """Modules whose direct ``Linear`` children are column-split q/k/v projections (attention): their head count
    shrinks. A child counts when its name is a column-wise or packed name, or its style is ``"colwise_packed"``."""
    # packed names (`Wqkv`, `in_proj`) are not all column-wise names (the automatic plan does not pair them), but a
    # user plan splitting one splits that attention's heads just the same
    qkv_names = COLWISE_NAMES | PACKED_NAMES
    parents = {re.sub(r"\.[^.]+$", "", n) for n, s in plan.items()
               if s == "colwise_packed" or (s == "colwise" and n.rsplit(".", 1)[-1] in qkv_names)}  # fmt: skip
    mods = dict(model.named_modules())
    return [mods[p] for p in sorted(parents) if p in mods]


def pack_rows(t: torch.Tensor, tp: int, parts: int = 3) -> torch.Tensor:
    """Reorder the rows of a packed projection's weight (or bias) from ``[q; k; v]`` to
    ``[q_0; k_0; v_0; q_1; k_1; v_1; ...]``, so that the ``r``-th of ``tp`` contiguous shards holds rank ``r``'s
    heads of all three parts (``q_r`` = rows ``r·d/tp .. (r+1)·d/tp`` of q, the heads ``r·h/tp ..``)."""
    rows = t.shape[0]
    return t.reshape(parts, tp, rows // (parts * tp), *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def unpack_rows(t: torch.Tensor, tp: int, parts: int = 3) -> torch.Tensor:
    """The inverse of :func:`pack_rows`: ``[q_0; k_0; v_0; q_1; ...]`` back to ``[q; k; v]``."""
    rows = t.shape[0]
    return t.reshape(tp, parts, rows // (parts * tp), *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def tensor_parallel_coverage(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``{Linear name: what the plan does with it}``: ``"colwise"``, ``"colwise_packed"`` (per head),
    ``"rowwise"``, or ``"replicated: <why>"`` (outside the repeated blocks, a feature-mixing module such as
    ``Softmax`` between it and its partner, or no column/row partner)."""
    _, broken = _block_pairs(model)
    blocks = {id(b) for b in block_stack(model)}
    in_block: set[str] = set()
    for name, m in model.named_modules():
        if id(m) in blocks:
            in_block.update(f"{name}.{n}" if n else name for n, _ in m.named_modules())
    out: dict[str, str] = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if name in plan:
            out[name] = plan[name]
        elif blocks and name not in in_block:
            out[name] = "replicated: outside the repeated blocks (embeddings, head)"
        elif name in broken:
            out[name] = f"replicated: {broken[name]}"
        else:
            out[name] = "replicated: no column/row partner in its block"
    return out


def describe_coverage(coverage: dict[str, str], tp: int) -> str:
    """One line for the log: how many ``Linear`` modules each style covers, and the replicated ones with why."""
    counts: dict[str, int] = {}
    for style in coverage.values():
        key = style if not style.startswith("replicated") else "replicated"
        counts[key] = counts.get(key, 0) + 1
    reps = [f"`{n}` ({s.split(': ', 1)[1]})" for n, s in coverage.items() if s.startswith("replicated")]
    shown = ", ".join(reps[:4]) + (f" and {len(reps) - 4} more" if len(reps) > 4 else "")
    packed = [n for n, s in coverage.items() if s == "colwise_packed"]
    return one_line(
        f"tensor parallel over {tp} ranks: {counts.get('colwise', 0)} Linear column-wise, "
        f"{counts.get('colwise_packed', 0)} packed q/k/v per head"
        f"{' (' + ', '.join(packed[:2]) + (', ...' if len(packed) > 2 else '') + ')' if packed else ''}, "
        f"{counts.get('rowwise', 0)} row-wise, {counts.get('replicated', 0)} replicated"
        + (f": {shown}" if reps else "")
        + "."
    )


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, plan: dict[str, str] | None = None) -> dict[str, str]:
    """Split ``model``'s Linear pairs over ``tp_mesh`` (``parallelize_module`` with ``ColwiseParallel`` /
    ``RowwiseParallel``), reorder packed projections per head (:func:`pack_rows`), and divide the attention modules'
    head counts (and, beside a packed projection, their width attributes) by the mesh size. Returns the plan
    applied, ``"colwise"`` on a packed name resolved to ``"colwise_packed"``.

    Args:
        model: the module, changed in place.
        tp_mesh: a 1-D device mesh (the tensor-parallel group).
        plan: ``{module name: "colwise" | "colwise_packed" | "rowwise"}`` (None: :func:`tensor_parallel_plan`).

    Raises:
        ValueError: the plan cannot split the model (:func:`check_tensor_parallel_plan`; one line, with the fix).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    chosen = tensor_parallel_plan(model, tp) if plan is None else dict(plan)
    check_tensor_parallel_plan(model, chosen, tp)
    mods = dict(model.named_modules())
    for name, style in list(chosen.items()):
        lin = mods[name]
        assert isinstance(lin, nn.Linear)
        if _parts(name, lin, style) > 1:
            chosen[name] = "colwise_packed"
            with torch.no_grad():
                lin.weight.copy_(pack_rows(lin.weight, tp))
                if lin.bias is not None:
                    lin.bias.copy_(pack_rows(lin.bias, tp))
            parent = mods[name.rsplit(".", 1)[0]] if "." in name else model
            for attr in PACKED_WIDTH_ATTRIBUTES:
                width = getattr(parent, attr, None)
                if isinstance(width, int) and not isinstance(width, bool) and 3 * width == lin.out_features:
                    setattr(parent, attr, width // tp)
    for m in _attention_modules(model, chosen):
        for attr in HEAD_ATTRIBUTES:
            heads = getattr(m, attr, None)
            if isinstance(heads, int):
                setattr(m, attr, heads // tp)
    styles = {"colwise": ColwiseParallel, "colwise_packed": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {k: styles[v]() for k, v in chosen.items()})
    return chosen
