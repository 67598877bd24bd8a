"""Memory per device for data parallel (DDP), fully sharded data parallel (FSDP / ZeRO-3) and pipeline parallel.

Formulas (``P`` parameters, ``N`` devices in the job, ``A`` activation bytes of one per-device batch, ``b`` bytes of
model state per parameter):

* **model state** ``b = 16`` for Adam: mixed precision keeps a 2-byte compute copy of each weight, a 2-byte gradient,
  a 4-byte fp32 master weight and two 4-byte moments (2 + 2 + 4 + 4 + 4); pure fp32 Adam is also 16 (4 + 4 + 4 + 4).
  SGD with momentum is 12 in fp32. Pass ``bytes_per_param`` for other optimizers. ``P`` counts the parameters that
  train; a frozen one (``requires_grad=False``) has no gradient and no optimizer state and costs its weight alone, at
  its own dtype's element size: ``W`` bytes for all of them (:func:`trainable_and_frozen`).
* **buffers** ``B``: the module buffers (BatchNorm's running statistics, registered tables and masks, persistent or
  not) at their own element size (:func:`buffer_bytes`). No plan shards or splits them: every device that runs a
  module holds its buffers whole.
* **DDP**: every device holds everything: ``b·P + W + B + A``.
* **FSDP (ZeRO-3)**: state sharded over ``N``, plus the largest wrapped unit (:func:`largest_unit_params`: a block,
  or the rest of the model outside the blocks) gathered in full for its forward and backward (2-byte weights and
  2-byte gradients: ``4·L``, the term DeepSpeed's ``estimate_zero3_model_states_mem_needs`` uses); ``fully_shard``
  leaves buffers replicated: ``(b·P + W)/N + B + 4·L + A``.
* **Pipeline** (``S = N`` stages, ``M`` micro-batches, 1F1B schedule; ``A`` the activations of the batch the pipeline
  runs): the heaviest stage's state (a parameter used by several stages counted in each: every one keeps a copy),
  plus its share of the activations for the micro-batches in flight (at most ``min(S, M)``, each ``1/M`` of the
  batch): ``b·P_stage + W_stage + B_stage + A/S · min(S, M)/M``, with ``M`` by default :func:`default_microbatches`,
  what ``PipelineStrategy`` runs.

Activations are *measured* when they can be: :func:`measure_activation_bytes` runs one forward and backward of an
example batch and sums the distinct tensors autograd saved for backward. Parameters and buffers are excluded
(BatchNorm saves its running statistics for backward; they are model state, counted once in ``B``), and so are the
copies of parameters autocast makes (a bf16 weight saved for a matmul's backward is model state, not an activation).
That is what stays alive between forward and backward, on any device. Measure under the autocast you train with (bf16
halves it).

A model or batch on the **meta device** has no values to run, so the activations are *estimated* with the
transformer formula of Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models", no
recomputation): per layer ``s·b·h·(34 + 5·a·s/h)`` bytes with 16-bit activations (``s`` sequence, ``b`` batch, ``h``
hidden size, ``a`` heads), times ``L`` layers, doubled for fp32 (:func:`estimate_activation_bytes`; the hidden size,
heads and layers read from the model by :func:`transformer_shape`, the batch and sequence from the batch's shape).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_accel._utils.checks import check_callable, check_choice, check_int

__all__ = [
    "HEAD_ATTRIBUTES",
    "ActivationProfile",
    "MemoryEstimate",
    "block_stack",
    "buffer_bytes",
    "count_layers",
    "estimate_activation_bytes",
    "estimate_ddp",
    "estimate_fsdp",
    "estimate_pipeline",
    "estimate_tensor_parallel",
    "default_microbatches",
    "pipeline_in_flight",
    "largest_unit_params",
    "measure_activation_bytes",
    "pipeline_stage_buffer_bytes",
    "pipeline_stage_parameters",
    "pipeline_stage_params",
    "preserved_state",
    "resolve_stages_per_rank",
    "SCHEDULES",
    "trainable_and_frozen",
    "transformer_shape",
]

#: Adam, mixed precision: 2 (weight) + 2 (grad) + 4 (fp32 master) + 4 (exp_avg) + 4 (exp_avg_sq).
ADAM_MIXED_BYTES_PER_PARAM = 16
#: Attributes holding an attention module's head count (divided by a tensor-parallel size; read by the estimate).
HEAD_ATTRIBUTES = ("n_head", "num_heads", "n_heads", "num_attention_heads")
#: Micro-batches per pipeline rank in a step when none are given: 2 keeps every rank busy in 1F1B's steady state (at
#: least one micro-batch per rank is required) without cutting the batch finer than needed.
MICROBATCHES_PER_RANK = 2


#: pipeline schedules (``PipelineStrategy(schedule=...)``): what a stage keeps in flight differs, see
#: :func:`estimate_pipeline`
SCHEDULES = ("1f1b", "gpipe", "interleaved1f1b")


def resolve_stages_per_rank(schedule: str, stages_per_rank: int | None) -> int:
    """Check ``schedule`` and ``stages_per_rank`` together; returns the stages per rank (None: 2 for the interleaved
    schedule, else 1).

    Raises:
        ValueError: an unknown schedule, or a count the schedule cannot run (both values and what it needs).
    """
    check_choice("schedule", schedule, SCHEDULES)
    check_int("stages_per_rank", stages_per_rank, low=1, allow_none=True)
    spr = stages_per_rank if stages_per_rank is not None else (2 if schedule == "interleaved1f1b" else 1)
    if (schedule == "interleaved1f1b") != (spr > 1):
        raise ValueError(
            f"`stages_per_rank`={spr} with `schedule`={schedule!r}: the interleaved schedule needs >= 2 stages "
            "per rank, '1f1b' and 'gpipe' exactly 1."
        )
    return spr


def default_microbatches(pipeline_size: int) -> int:
    """Micro-batches per step of a pipeline of ``pipeline_size`` ranks when none are given:
    ``MICROBATCHES_PER_RANK · pipeline_size``. The one rule the pipeline plans run with and their memory estimate
    assumes."""
    check_int("pipeline_size", pipeline_size, low=1)
    return MICROBATCHES_PER_RANK * pipeline_size


def trainable_and_frozen(params: Iterable[torch.Tensor]) -> tuple[int, int]:
    """Split ``params`` (each counted once, however often listed) into what their model state costs.

    Returns:
        ``(P, W)``: the elements of the trainable parameters (each costs ``bytes_per_param``), and the bytes of the
        frozen ones (``requires_grad=False``): their weights alone at their own dtype's element size, since a frozen
        parameter has no gradient and no optimizer state, and autocast does not cache a low-precision copy of it.
    """
    seen: set[int] = set()
    trainable = frozen = 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel() * p.element_size()
    return trainable, frozen


def buffer_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the buffers of ``modules`` and their submodules at their own element size: BatchNorm's running
    statistics and ``num_batches_tracked``, tables and masks a model registers, persistent or not (each occupies
    memory on every device that runs it). Each buffer counts once however often it is reached (a module shared by
    several, a buffer registered twice)."""
    return _distinct_bytes(b for root in modules for b in root.buffers())


def _distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` at their own element size, each tensor once however often it is listed."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device for one strategy.

    Attributes:
        strategy: ``"ddp"``, ``"fsdp"`` or ``"pipeline"``.
        model_state: parameters + gradients + optimizer state + module buffers on one device.
        working: extra transient model memory (FSDP's gathered unit).
        activations: activation bytes on one device.
        formula: the formula with the numbers filled in, for explanations.
        blocker: why this plan cannot run this model at all ("" when it can): such a plan never fits.
    """

    strategy: str
    model_state: int
    working: int
    activations: int
    formula: str = ""
    blocker: str = ""

    @property
    def total(self) -> int:
        """Bytes needed per device."""
        return self.model_state + self.working + self.activations


@dataclass(frozen=True)
class ActivationProfile:
    """What one forward/backward of the example batch showed.

    Attributes:
        activation_bytes: distinct bytes autograd saved for backward (parameters excluded).
        forward_s: seconds of the forward pass.
        backward_s: seconds of the backward pass (the window in which DDP can hide gradient communication).
        saved_tensors: how many saved tensors were seen (before de-duplication).
    """

    activation_bytes: int
    forward_s: float
    backward_s: float
    saved_tensors: int = 0
    notes: list[str] = field(default_factory=list)


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _scalar(out: Any) -> torch.Tensor:
    """Reduce a model output (tensor, tuple, dict, object with ``.loss`` / ``.logits``) to a scalar to backward."""
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    if isinstance(out, dict):
        if "loss" in out:
            return out["loss"]
        out = list(out.values())
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, (tuple, list)):
        ts = [o.float().sum() for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
        if ts:
            return torch.stack(ts).sum()
    raise TypeError(
        f"cannot reduce a model output of type {type(out).__name__} to a loss. Pass `loss_fn=` (output -> scalar)."
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: autograd nodes that only cast, view or copy their input: a saved tensor reached from a parameter through these
#: alone is a copy of that parameter (autocast's cached bf16 weight), not an activation
_COPY_NODES = frozenset(
    {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
     "ExpandBackward0", "CloneBackward0", "AliasBackward0", "ReshapeAliasBackward0", "SqueezeBackward0",
     "UnsqueezeBackward0"}
)  # fmt: skip


def _copies_a_parameter(t: torch.Tensor, param_ids: set[int]) -> bool:
    """True when ``t`` was made from a parameter by casts / views / copies only (followed through its grad_fn)."""
    fn = t.grad_fn
    for _ in range(8):
        if fn is None or type(fn).__name__ not in _COPY_NODES:
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
        if type(fn).__name__ == "AccumulateGrad":
            return id(getattr(fn, "variable", None)) in param_ids
    return False


@contextlib.contextmanager
def preserved_state(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run the block on ``modules`` and leave them as they were, whatever happens inside: every submodule's own
    ``training`` flag (``train(was)`` would reset a submodule the user put in eval), every buffer's values (a training
    forward updates BatchNorm's running statistics and ``num_batches_tracked``) and torch's RNG state, CPU and CUDA
    (dropout draws from it). What measures a model on an example batch runs inside it, so measuring never changes what
    the user then trains or evaluates; parameters and their gradients are the caller's business."""
    mods = list({id(m): m for root in modules for m in root.modules()}.values())
    modes = [(m, m.training) for m in mods]
    buffers = list({id(b): (b, b.detach().clone()) for m in mods for b in m.buffers(recurse=False)}.values())
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def measure_activation_bytes(
    model: nn.Module, example_batch: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None = None
) -> ActivationProfile:
    """Run one forward and backward of ``example_batch`` and measure the activations autograd keeps.

    Every tensor packed for backward is seen through ``torch.autograd.graph.saved_tensors_hooks``; tensors are
    de-duplicated by storage (a view and its base count once), and storages that belong to parameters are skipped, as
    are copies of parameters (autocast's low-precision weights: reached from a parameter by casts and views only) and
    the model's buffers (BatchNorm saves its running statistics for backward: model state, not activations).
    It runs in training mode inside :func:`preserved_state`: every module's ``training`` flag, the buffers
    (BatchNorm's running statistics) and the RNG state are restored afterwards; gradients are cleared.

    Args:
        model: an ``nn.Module`` (a LightningModule works: its ``forward`` is called).
        example_batch: one per-device batch of *inputs to forward*: a tensor, a tuple/list of positional arguments, or
            a dict of keyword arguments.
        loss_fn: ``output -> scalar`` (default: the ``loss`` of the output, or the sum of its tensors).

    Raises:
        ValueError: the model or the batch is on the meta device (nothing to measure; the fix names the formula).
        TypeError: ``loss_fn`` is neither callable nor None.
    """
    check_callable("loss_fn", loss_fn, "a function `output -> scalar loss`")
    params = list(model.parameters())
    if any(p.is_meta for p in params) or (isinstance(example_batch, torch.Tensor) and example_batch.is_meta):
        raise ValueError(
            f"cannot measure activations of `{type(model).__name__}` on the meta device: nothing runs there. Use "
            "`estimate_activation_bytes(...)` (the transformer formula) or `select_strategy`, which estimates them."
        )
    # buffers too: they live as long as the model, and the estimates count them once as model state (`buffer_bytes`)
    param_ptrs = {t.untyped_storage().data_ptr() for t in [*params, *model.buffers()]}
    param_ids = {id(p) for p in params}
    seen: dict[int, int] = {}
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        try:
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in param_ptrs and ptr not in seen and not _copies_a_parameter(t, param_ids):
                seen[ptr] = s.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some wrappers)
            pass
        return t

    device = params[0].device if params else torch.device("cpu")
    try:
        with preserved_state([model]):
            model.train()  # every module's own mode comes back when `preserved_state` ends
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                _sync(device)
                t0 = time.perf_counter()
                out = _call(model, example_batch)
                loss = (loss_fn or _scalar)(out)
                _sync(device)
                t1 = time.perf_counter()
            loss.backward()
            _sync(device)
            t2 = time.perf_counter()
    finally:
        for p in params:
            p.grad = None
    return ActivationProfile(
        activation_bytes=int(sum(seen.values())), forward_s=t1 - t0, backward_s=t2 - t1, saved_tensors=count
    )


def transformer_shape(model: nn.Module) -> dict[str, int]:
    """What the activation formula needs from the model: ``layers`` (:func:`count_layers`), ``hidden`` (the most
    common ``in_features`` of the blocks' ``Linear`` modules, else an embedding's or a LayerNorm's width) and
    ``heads`` (a :data:`HEAD_ATTRIBUTES` attribute; 0 when none, so the attention-score term drops out)."""
    blocks = block_stack(model) or [model]
    widths: dict[int, int] = {}
    for b in blocks:
        for m in b.modules():
            if isinstance(m, nn.Linear):
                widths[m.in_features] = widths.get(m.in_features, 0) + 1
    hidden = max(widths, key=lambda w: (widths[w], w)) if widths else 0
    if not hidden:
        for m in model.modules():
            if isinstance(m, nn.Embedding):
                hidden = m.embedding_dim
                break
            if isinstance(m, nn.LayerNorm):
                hidden = int(m.normalized_shape[-1])
                break
    heads = 0
    for m in model.modules():
        for attr in HEAD_ATTRIBUTES:
            v = getattr(m, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                heads = v
                break
        if heads:
            break
    return {"layers": count_layers(model), "hidden": hidden, "heads": heads}


def estimate_activation_bytes(
    *, layers: int, hidden: int, seq: int, batch: int, heads: int = 0, bytes_per_value: int = 2
) -> int:
    """``L · s·b·h·(34 + 5·a·s/h)`` bytes for 16-bit activations (Korthikanti et al. 2022, no recomputation),
    scaled by ``bytes_per_value / 2`` (4: fp32). ``heads=0`` drops the attention-score term (fused attention)."""
    per_layer = seq * batch * hidden * 34 + (5 * heads * seq * seq * batch if heads else 0)
    return int(layers * per_layer * bytes_per_value / 2)


def _block_lists(model: nn.Module) -> list[nn.Module]:
    """The model's stack of repeated layers: the longest ``nn.ModuleList``/``nn.Sequential`` whose children all have
    the same type (a transformer's blocks, not an MLP's ``Linear, GELU, Linear``), else the longest of any kind."""
    best: tuple[bool, int] = (False, 0)
    out: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m):
            children = list(m)
            key = (len({type(c) for c in children}) == 1, len(children))
            if key > best:
                best, out = key, children
    return out


def block_stack(model: nn.Module) -> list[nn.Module]:
    """The blocks of the model's longest stack of repeated layers (empty when it has none): the units FSDP shards
    one by one, the pieces a tensor-parallel plan splits, what ``count_layers`` counts."""
    blocks = _block_lists(model)
    return blocks if len(blocks) > 1 else []


def count_layers(model: nn.Module) -> int:
    """Depth as the rule of thumb means it: the length of the model's longest stack of blocks (``ModuleList`` /
    ``Sequential``), or, when it has none, the number of leaf modules that own parameters."""
    blocks = _block_lists(model)
    if len(blocks) > 1:
        return len(blocks)
    return sum(1 for m in model.modules() if not list(m.children()) and any(True for _ in m.parameters(recurse=False)))


def largest_unit_params(model: nn.Module, unit_types: Iterable[type[nn.Module]] | None = None) -> int:
    """Parameters of the largest unit FSDP gathers in full at once (the ``L`` of :func:`estimate_fsdp`).

    By default the units ``ShardedStrategy`` wraps: each block of the longest block stack, then the rest of the model
    (everything no block holds): as one unit when ``model`` holds parameters directly, else one per direct child
    holding any. With ``unit_types`` (an auto-wrap policy's classes): each module of those types, and the root holding
    the rest. Units that share a parameter (an embedding tied to the head) are gathered together and count as one;
    each parameter counts once in a unit. The rest is often the largest unit (a CNN's stem, stages and head outside
    its few repeated blocks; a language model's embedding and head)."""
    types = tuple(unit_types) if unit_types else None
    if types:
        units = [m for m in model.modules() if isinstance(m, types)]
        roots = [model]
    else:
        units = block_stack(model)
        has_own = any(True for _ in model.parameters(recurse=False))
        roots = [model] if has_own else [c for c in model.children() if any(True for _ in c.parameters())]
    groups = [{id(p): p.numel() for p in u.parameters()} for u in units]
    held = {i for g in groups for i in g}
    groups += [{id(p): p.numel() for p in r.parameters() if id(p) not in held} for r in roots]
    merged: list[dict[int, int]] = []
    for g in groups:  # units sharing a parameter are one group, gathered together
        for other in [m for m in merged if not m.keys().isdisjoint(g)]:
            merged.remove(other)
            g = {**other, **g}
        merged.append(g)
    return max((sum(g.values()) for g in merged), default=sum(p.numel() for p in model.parameters()))


def pipeline_stage_parameters(model: nn.Module, stages: int) -> list[list[nn.Parameter]]:
    """The parameters each stage holds when the longest block stack is cut into ``stages`` contiguous, balanced
    pieces; the parameters outside the stack (embeddings, heads) go to the first stage (pessimistic: the first stage
    also holds the embedding in most pipelines). A parameter used by blocks on several stages (the same block
    repeated, tied weights) is listed for each of them: every stage that runs it keeps a copy with its own gradient
    and optimizer state, as ``PipelineStrategy`` does. Returns one list per stage, each parameter once in it."""
    held: list[dict[int, nn.Parameter]] = [{} for _ in range(stages)]
    seen: set[int] = set()
    for stage, blocks in enumerate(_stage_blocks(model, stages)):
        for b in blocks:
            for p in b.parameters():
                held[stage].setdefault(id(p), p)
                seen.add(id(p))
    for p in model.parameters():
        if id(p) not in seen:
            held[0].setdefault(id(p), p)
    return [list(h.values()) for h in held]


def _stage_blocks(model: nn.Module, stages: int) -> list[list[nn.Module]]:
    """The blocks of the longest block stack each of ``stages`` stages runs: a greedy contiguous split balancing each
    block's parameters not seen in an earlier block (a shared one weighs on the first block using it only)."""
    check_int("stages", stages, low=1)
    blocks = _block_lists(model)
    seen: set[int] = set()
    sizes = []
    for b in blocks:
        sizes.append(sum(p.numel() for p in b.parameters() if id(p) not in seen))
        seen.update(id(p) for p in b.parameters())
    target = sum(sizes) / stages
    out: list[list[nn.Module]] = [[] for _ in range(stages)]
    stage, acc = 0, 0
    for b, s in zip(blocks, sizes, strict=True):  # greedy contiguous split
        if acc >= target and stage < stages - 1:
            stage, acc = stage + 1, 0
        acc += s
        out[stage].append(b)
    return out


def pipeline_stage_buffer_bytes(model: nn.Module, stages: int) -> list[int]:
    """Bytes of the buffers each stage of :func:`pipeline_stage_parameters`'s split holds: its blocks' buffers, and
    on the first stage those outside the block stack (as for the parameters). Returns one number per stage."""
    split = _stage_blocks(model, stages)
    inside = {id(b) for blocks in split for m in blocks for b in m.buffers()}
    outside = [b for b in model.buffers() if id(b) not in inside]
    out = [buffer_bytes(blocks) for blocks in split]
    out[0] += _distinct_bytes(outside)
    return out


def pipeline_stage_params(model: nn.Module, stages: int) -> list[int]:
    """Parameters per stage of :func:`pipeline_stage_parameters` (a parameter shared by several stages counts in
    each). Returns one number per stage."""
    return [sum(p.numel() for p in ps) for ps in pipeline_stage_parameters(model, stages)]


def _state_terms(bytes_per_param: int, frozen_bytes: int, buffers: int) -> str:
    """``b·P`` with `` + W`` and `` + B`` where there are frozen weights and buffers (the formulas' model state)."""
    return f"{bytes_per_param}·P" + (" + W" if frozen_bytes else "") + (" + B" if buffers else "")


def estimate_ddp(
    params: int,
    activations: int,
    *,
    bytes_per_param: int = ADAM_MIXED_BYTES_PER_PARAM,
    frozen_bytes: int = 0,
    buffer_bytes: int = 0,
) -> MemoryEstimate:
    """``b·P + W + B + A``: every device holds the full model state.

    Args:
        params: parameters that train (each costs ``bytes_per_param``; all of them when ``frozen_bytes`` is 0).
        activations: activation bytes of one per-device batch.
        bytes_per_param: model-state bytes per trainable parameter.
        frozen_bytes: bytes of the frozen parameters' weights (no gradient, no optimizer state; see
            :func:`trainable_and_frozen`).
        buffer_bytes: bytes of the module buffers (:func:`buffer_bytes`), held whole on every device.
    """
    return MemoryEstimate(
        "ddp",
        bytes_per_param * params + frozen_bytes + buffer_bytes,
        0,
        activations,
        _state_terms(bytes_per_param, frozen_bytes, buffer_bytes) + " + A",
    )


def estimate_fsdp(
    params: int,
    activations: int,
    world: int,
    largest_unit: int,
    *,
    bytes_per_param: int = ADAM_MIXED_BYTES_PER_PARAM,
    frozen_bytes: int = 0,
    buffer_bytes: int = 0,
) -> MemoryEstimate:
    """``(b·P + W)/N + B + 4·L + A``: state sharded over ``world`` devices, the buffers replicated (``fully_shard``
    shards parameters only), the largest unit gathered for compute (``params``, ``frozen_bytes`` and ``buffer_bytes``
    as for :func:`estimate_ddp`; ``largest_unit`` counts all its parameters)."""
    check_int("world", world, low=1)
    state = -(-(bytes_per_param * params + frozen_bytes) // world) + buffer_bytes  # ceil
    formula = f"({bytes_per_param}·P + W)/{world}" if frozen_bytes else f"{bytes_per_param}·P/{world}"
    if buffer_bytes:
        formula += " + B"
    return MemoryEstimate("fsdp", state, 4 * largest_unit, activations, formula + " + 4·L + A")


def pipeline_in_flight(schedule: str, pipeline_size: int, microbatches: int, stages_per_rank: int = 1) -> int:
    """Stage-micro-batches whose activations the busiest rank (the first) holds at once under ``schedule``: one
    stage's forward of one micro-batch each, kept until its backward.

    ``"gpipe"`` runs every forward first: all ``M``. ``"1f1b"``: ``min(M, S)`` on the first of ``S`` ranks (its
    warm-up of ``S - 1`` forwards, then one forward before each backward). ``"interleaved1f1b"`` with ``v`` stages
    per rank: ``min(v·M, (v-1)·S + 2·(S-1) + 1)`` (the warm-up of torch's and Megatron's interleaved schedules,
    then one more), which for ``M >= S`` is 1F1B's bytes times ``1 + (S-1)/(S·v)``.
    """
    check_int("pipeline_size", pipeline_size, low=1)
    check_int("microbatches", microbatches, low=1)
    v = resolve_stages_per_rank(schedule, stages_per_rank)  # checks the schedule too
    s, m = pipeline_size, microbatches
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, s)
    return min(v * m, (v - 1) * s + 2 * (s - 1) + 1)


def estimate_pipeline(
    stage_params: list[int],
    activations: int,
    *,
    microbatches: int | None = None,
    bytes_per_param: int = ADAM_MIXED_BYTES_PER_PARAM,
    stage_frozen_bytes: list[int] | None = None,
    schedule: str = "1f1b",
    stages_per_rank: int | None = None,
    stage_buffer_bytes: list[int] | None = None,
) -> MemoryEstimate:
    """``Σ_rank (b·P_stage + W_stage + B_stage) + A/(S·v) · F/M`` for the heaviest rank: its stages' model state, and
    the activations of the ``F`` stage-micro-batches it holds at once (:func:`pipeline_in_flight`: ``min(S, M)`` for
    1F1B, ``M`` for GPipe), each ``1/(S·v)`` of one micro-batch's.

    Args:
        stage_params: per stage, the parameters it trains (a parameter several stages hold counts in each), in loop
            order: ``S·v`` stages for ``S`` pipeline ranks with ``v`` stages each, rank ``r`` holding stages
            ``r, r + S, ...`` (``PipelineStrategy``'s layout).
        activations: activation bytes of the whole batch the pipeline runs in one step (all its micro-batches).
        microbatches: ``M``, micro-batches per step (None: :func:`default_microbatches` of the ``S`` ranks, what
            ``PipelineStrategy`` runs without one).
        bytes_per_param: model-state bytes per trainable parameter.
        stage_frozen_bytes: per stage, the bytes of its frozen parameters' weights (None: none frozen).
        schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved1f1b"`` (:data:`SCHEDULES`).
        stages_per_rank: ``v`` (None: 2 for the interleaved schedule, else 1); must divide the number of stages.
        stage_buffer_bytes: per stage, the bytes of its modules' buffers (None: none;
            :func:`pipeline_stage_buffer_bytes`).
    """
    n = len(stage_params)
    if n < 1:
        raise ValueError(f"`stage_params` must list at least one stage's parameter count, got {stage_params!r}.")
    v = resolve_stages_per_rank(schedule, stages_per_rank)
    if n % v:
        raise ValueError(
            f"`stage_params` lists {n} stage(s), not a multiple of `stages_per_rank`={v}: give {v} stages per rank."
        )
    frozen = list(stage_frozen_bytes) if stage_frozen_bytes is not None else [0] * n
    if len(frozen) != n:
        raise ValueError(
            f"`stage_frozen_bytes` lists {len(frozen)} stage(s) and `stage_params` {n}: give one number per stage."
        )
    buffers = list(stage_buffer_bytes) if stage_buffer_bytes is not None else [0] * n
    if len(buffers) != n:
        raise ValueError(
            f"`stage_buffer_bytes` lists {len(buffers)} stage(s) and `stage_params` {n}: give one number per stage."
        )
    s = n // v
    m = microbatches or default_microbatches(s)
    held = pipeline_in_flight(schedule, s, m, v)
    act = int(activations / n * held / m)
    per_stage = [bytes_per_param * p + w + b for p, w, b in zip(stage_params, frozen, buffers, strict=True)]
    state = max(sum(per_stage[r::s]) for r in range(s))
    w = (" + W_stage" if any(frozen) else "") + (" + B_stage" if any(buffers) else "")
    stage_state = f"{bytes_per_param}·P_stage{w}"
    if v > 1:
        stage_state = f"{v}·({stage_state})"
    formula = f"{stage_state} + A/{n}·{held}/{m}"
    return MemoryEstimate("pipeline", state, 0, act, formula)


def estimate_tensor_parallel(
    params: int,
    split_params: int,
    activations: int,
    world: int,
    largest_unit: int,
    *,
    bytes_per_param: int = ADAM_MIXED_BYTES_PER_PARAM,
    frozen_bytes: int = 0,
    split_frozen_bytes: int = 0,
    buffer_bytes: int = 0,
) -> MemoryEstimate:
    """``b·(P - P_tp + P_tp/N) + W - W_tp + W_tp/N + B + 4·L/N + A``: the split matrices' state divided over ``world``
    tensor-parallel ranks, the rest and the buffers replicated, the largest block gathered a ``1/N`` slice at a time;
    activations counted whole (a pessimistic bound: the split layers' activations shrink too). ``params`` /
    ``split_params`` count trainable parameters, ``frozen_bytes`` / ``split_frozen_bytes`` the frozen weights' bytes
    (all, and those of the split matrices), ``buffer_bytes`` the module buffers, as for :func:`estimate_ddp`."""
    check_int("world", world, low=1)
    split = bytes_per_param * split_params + split_frozen_bytes
    state = bytes_per_param * (params - split_params) + frozen_bytes - split_frozen_bytes + -(-split // world)
    state += buffer_bytes
    formula = f"{bytes_per_param}·(P-P_tp+P_tp/{world}) + 4·L/{world} + A"
    if buffer_bytes:
        formula = formula.replace(" + 4·L", " + B + 4·L", 1)
    if frozen_bytes:
        formula = formula.replace(" + ", f" + W-W_tp+W_tp/{world} + ", 1)
    return MemoryEstimate("tp", state, -(-4 * largest_unit // world), activations, formula)
