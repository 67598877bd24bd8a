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

The core never imports Lightning; ``ShardedStrategy`` (``strategy.py``) applies these inside a Trainer.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from lightning_accel._utils.checks import check_int
from lightning_accel.parallel.estimate import block_stack

__all__ = [
    "COLWISE_NAMES",
    "HEAD_ATTRIBUTES",
    "ROWWISE_NAMES",
    "apply_fully_shard",
    "apply_tensor_parallel",
    "fsdp_units",
    "is_parallelized",
    "mixed_precision_policy",
    "tensor_parallel_plan",
]

#: ``Linear`` names split by output features (their outputs are sharded), as in Llama / GPT-2 / BERT code.
COLWISE_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv", "qkv_proj", "c_attn", "query", "key", "value", "wq", "wk", "wv",
     "w1", "w3", "fc1", "c_fc", "up_proj", "gate_proj", "fc_in"}
)  # fmt: skip
#: ``Linear`` names split by input features (they take a sharded input and all-reduce their output).
ROWWISE_NAMES = frozenset({"proj", "o_proj", "out_proj", "c_proj", "wo", "w2", "fc2", "down_proj", "fc_out", "dense"})
#: Attributes holding an attention module's head count, divided by the tensor-parallel size.
HEAD_ATTRIBUTES = ("n_head", "num_heads", "n_heads", "num_attention_heads")


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` wraps before the root: the blocks of the longest repeated stack."""
    return block_stack(model)


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
    """``fully_shard`` each unit (default :func:`fsdp_units`), then ``model`` itself. Returns the number of units.

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
    for u in chosen:
        fully_shard(u, **kw)
    fully_shard(model, **kw)
    return len(chosen)


def _linear_pairs(module: nn.Module) -> dict[str, str]:
    """``{relative name: "colwise" | "rowwise"}`` for the column/row pairs inside one block."""
    plan: dict[str, str] = {}
    for prefix, m in module.named_modules():
        children = list(m.named_children())
        linears = {n: c for n, c in children if isinstance(c, nn.Linear)}
        if not linears:
            continue
        join = (prefix + ".") if prefix else ""
        if isinstance(m, nn.Sequential):
            # Linear, activation..., Linear whose features chain: the MLP pattern
            seq = [(n, c) for n, c in children if isinstance(c, nn.Linear) or any(True for _ in c.parameters())]
            for (n1, a), (n2, b) in zip(seq, seq[1:], strict=False):
                chained = isinstance(a, nn.Linear) and isinstance(b, nn.Linear) and a.out_features == b.in_features
                if chained and join + n1 not in plan and join + n2 not in plan:
                    plan[join + n1], plan[join + n2] = "colwise", "rowwise"
            continue
        col = [n for n in linears if n in COLWISE_NAMES]
        row = [n for n in linears if n in ROWWISE_NAMES]
        if col and len(row) == 1:
            width = {linears[n].out_features for n in col}
            if len(width) == 1 and linears[row[0]].in_features == width.pop():
                plan.update({join + n: "colwise" for n in col})
                plan[join + row[0]] = "rowwise"
    return plan


def tensor_parallel_plan(model: nn.Module, tp_size: int) -> dict[str, str]:
    """``{fully qualified Linear name: "colwise" | "rowwise"}`` for every block of the repeated stack.

    Raises:
        ValueError: no column/row pair was found (with the count of ``Linear`` modules and the fix), or a split
            dimension or head count is not divisible by ``tp_size``.
    """
    check_int("tensor_parallel_size", tp_size, low=1)
    names = {id(m): n for n, m in model.named_modules()}
    plan: dict[str, str] = {}
    for block in block_stack(model) or [model]:
        base = names[id(block)]
        for rel, style in _linear_pairs(block).items():
            plan[f"{base}.{rel}" if base else rel] = style
    if not plan:
        n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
        raise ValueError(
            f"tensor parallel found 0 parallelisable layer pairs in `{type(model).__name__}` ({n_linear} Linear "
            f"modules, none in a column/row pair: q/k/v + output projection named {sorted(ROWWISE_NAMES)[:4]}..., or "
            "an nn.Sequential `Linear, act, Linear` MLP). Use the sharded plan (`fsdp`) for this model, or pass an "
            "explicit `tp_plan` {module name: 'colwise' | 'rowwise'}."
        )
    mods = dict(model.named_modules())
    for name, style in plan.items():
        lin = mods[name]
        assert isinstance(lin, nn.Linear)
        dim = lin.out_features if style == "colwise" else lin.in_features
        if dim % tp_size:
            raise ValueError(
                f"`{name}` has {dim} {'output' if style == 'colwise' else 'input'} features, not divisible by "
                f"`tensor_parallel_size`={tp_size}. Use a tensor-parallel size that divides {dim}."
            )
    for m in _attention_modules(model, plan):
        for attr in HEAD_ATTRIBUTES:
            heads = getattr(m, attr, None)
            if isinstance(heads, int) and heads % tp_size:
                raise ValueError(
                    f"`{type(m).__name__}.{attr}`={heads} heads cannot be split over `tensor_parallel_size`={tp_size}."
                    f" Use a tensor-parallel size that divides {heads}."
                )
    return plan


def _attention_modules(model: nn.Module, plan: dict[str, str]) -> list[nn.Module]:
    """Modules whose direct ``Linear`` children are column-split by name (attention): their head count shrinks."""
    parents = {re.sub(r"\.[^.]+$", "", n) for n, s in plan.items() if s == "colwise" and n.rsplit(".", 1)[-1] in
               COLWISE_NAMES}  # fmt: skip
    mods = dict(model.named_modules())
    return [mods[p] for p in sorted(parents) if p in mods]


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, plan: dict[str, str] | None = None) -> dict[str, str]:
    """Split ``model``'s Linear pairs over ``tp_mesh`` (``parallelize_module`` with ``ColwiseParallel`` /
    ``RowwiseParallel``) and divide attention head counts by the mesh size. Returns the plan applied.

    Args:
        model: the module, changed in place.
        tp_mesh: a 1-D device mesh (the tensor-parallel group).
        plan: ``{module name: "colwise" | "rowwise"}`` (None: :func:`tensor_parallel_plan`).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    chosen = tensor_parallel_plan(model, tp) if plan is None else dict(plan)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    bad = {k: v for k, v in chosen.items() if v not in styles}
    if bad:
        raise ValueError(f"`tp_plan` values must be 'colwise' or 'rowwise', got {bad}.")
    for m in _attention_modules(model, chosen):
        for attr in HEAD_ATTRIBUTES:
            heads = getattr(m, attr, None)
            if isinstance(heads, int):
                setattr(m, attr, heads // tp)
    parallelize_module(model, tp_mesh, {k: styles[v]() for k, v in chosen.items()})
    return chosen
