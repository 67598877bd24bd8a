"""Pipeline parallelism on ``torch.distributed.pipelining``: split a network into stages, run a schedule, sync grads.

What a network must provide: an ordered list of modules ("pieces") whose composition is its forward, each taking the
previous piece's single tensor output, found by :func:`find_pipeline_modules`:

1. a ``pipeline_modules()`` method (on the module itself or on one of its direct children, e.g. the network inside a
   LightningModule), returning the pieces in forward order, or
2. the network as an ``nn.Sequential`` (the module itself or a direct child): its children are the pieces.

Either way the pieces must hold every parameter of the module (a head beside an ``nn.Sequential`` backbone would be
left out of the pipeline's forward): a split that leaves one out is refused, naming it.

The stages are contiguous runs of pieces balanced by :func:`balance_stages` on each piece's model-state bytes plus
its measured activations (:func:`piece_costs`). On each rank, :func:`keep_only` drops the parameters of every piece
it does not run, so its optimizer sees only its stage(s) and its memory holds only its share. A parameter used by
pieces on different stages (a tied embedding / LM head) is kept by each holder and its gradient is summed between
them after every step (Megatron's tied-embedding rule), so the copies stay equal.

:class:`PipelineRunner` owns the ``PipelineStage`` objects and the schedule of one rank: ``"1f1b"`` (default,
``Schedule1F1B``: at most ``stages`` micro-batches of activations alive), ``"gpipe"`` (``ScheduleGPipe``: all
micro-batches' activations alive, simplest), ``"interleaved1f1b"`` (``ScheduleInterleaved1F1B``, ``v`` stages per rank
in loop order: rank ``r`` runs stages ``r, r + pp, ...``; smaller bubble, more messages). With ``dp`` replicas of the
pipeline (world ``= dp · pp``), gradients are averaged over the replicas after the schedule.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_accel._utils.checks import check_choice, check_int
from lightning_accel.parallel.estimate import (
    SCHEDULES,
    default_microbatches,
    preserved_state,
    resolve_stages_per_rank,
    trainable_and_frozen,
)

__all__ = [
    "PLAIN_TYPES",
    "SCHEDULES",
    "PipelineLayout",
    "PipelineRunner",
    "balance_stages",
    "batch_tensors",
    "check_microbatches",
    "check_no_sync_batchnorm",
    "check_stages_train",
    "find_pipeline_modules",
    "is_per_sample_list",
    "keep_only",
    "mapping_like",
    "piece_costs",
    "join_outputs",
    "pipeline_layout",
    "resolve_stages_per_rank",
    "sequence_like",
    "split_batch",
    "trainable_pieces",
]


def check_microbatches(microbatches: int, pipeline_size: int, schedule: str) -> None:
    """Refuse ``microbatches`` that a pipeline of ``pipeline_size`` ranks cannot run under ``schedule``: fewer than its
    ranks (some stages would idle for the whole step), or, interleaved, not a multiple of them. One line naming both
    values and the fix (``PipelineStrategy`` checks it when it is built, :class:`PipelineRunner` when it is set up).
    """
    if microbatches < pipeline_size:
        raise ValueError(
            f"`microbatches`={microbatches} is smaller than `pipeline_size`={pipeline_size}: some stages would "
            f"idle for the whole step. Use `microbatches` >= {pipeline_size}, or None for "
            f"{default_microbatches(pipeline_size)}."
        )
    if schedule == "interleaved1f1b" and microbatches % pipeline_size:
        raise ValueError(
            f"`microbatches`={microbatches} with `schedule`='interleaved1f1b' and `pipeline_size`={pipeline_size}: "
            "the interleaved schedule needs a multiple of the pipeline size. Use "
            f"`microbatches`={pipeline_size * -(-microbatches // pipeline_size)}, or None."
        )


def find_pipeline_modules(module: nn.Module) -> list[nn.Module]:
    """The pieces of ``module`` in forward order (see the module docstring for the two ways to provide them).

    Raises:
        TypeError: ``module`` provides neither, or the pieces leave out some of its parameters (named, with the
            fix).
    """
    candidates: list[nn.Module] = [module, *module.children()]
    for m in candidates:
        fn = getattr(m, "pipeline_modules", None)
        if callable(fn):
            pieces = list(fn())
            if not pieces or not all(isinstance(p, nn.Module) for p in pieces):
                raise TypeError(f"`{type(m).__name__}.pipeline_modules()` must return a non-empty list of nn.Modules.")
            owner = "its own" if m is module else f"its child `{type(m).__name__}`'s"
            return _check_complete(module, pieces, f"{owner} `pipeline_modules()`")
    for m in candidates:
        if isinstance(m, nn.Sequential) and len(m) > 0:
            where = "itself" if m is module else f"its child `{type(m).__name__}`"
            return _check_complete(module, list(m), f"the children of {where} (an `nn.Sequential`)")
    raise TypeError(
        f"PipelineStrategy cannot split `{type(module).__name__}`: it needs the pieces of its forward in order. Give "
        "it (or the network it holds, e.g. `self.model`) a `pipeline_modules()` method returning the modules whose "
        "composition is the forward (each takes the previous one's single tensor output), or make the network an "
        "`nn.Sequential`."
    )


def _check_complete(module: nn.Module, pieces: list[nn.Module], source: str) -> list[nn.Module]:
    """``pieces`` when they hold every parameter of ``module``: the pipeline's forward is their composition and each
    rank keeps only its stages' parameters, so a parameter outside them (a head beside an ``nn.Sequential`` backbone)
    would silently leave the model trained, and saved.

    Raises:
        TypeError: parameters of ``module`` that no piece holds (named, with the fix).
    """
    held = {id(p) for piece in pieces for p in piece.parameters()}
    left = [n for n, p in module.named_parameters() if id(p) not in held]
    if not left:
        return pieces
    more = f" and {len(left) - 5} more" if len(left) > 5 else ""
    raise TypeError(
        f"PipelineStrategy cannot split `{type(module).__name__}`: the pieces from {source} leave out the "
        f"parameters {', '.join(f'`{n}`' for n in left[:5])}{more}, which the pipeline's forward (the pieces in order) "
        "would drop. Give the LightningModule a `pipeline_modules()` method returning every piece of its forward in "
        "order (e.g. `[*self.features, self.head]`)."
    )


def _state_bytes(m: nn.Module, bytes_per_param: int) -> int:
    trainable, frozen = trainable_and_frozen(m.parameters())
    return bytes_per_param * trainable + frozen


def piece_costs(pieces: Sequence[nn.Module], example_input: Any = None, *, bytes_per_param: int = 16) -> list[int]:
    """Bytes each piece costs on its stage: ``bytes_per_param`` per trainable parameter, a frozen one's weight bytes
    alone (no gradient, no optimizer state; :func:`~lightning_accel.parallel.estimate.trainable_and_frozen`), plus the
    activations autograd saves for its backward, measured by running ``example_input`` through the pieces in order
    (one forward in training mode, no backward; 0 without an example).

    The forward runs inside :func:`~lightning_accel.parallel.estimate.preserved_state`: the pieces' modes, their
    buffers (BatchNorm's running statistics) and the RNG state are as before afterwards, so measuring at setup never
    changes what is then trained or evaluated. ``example_input`` must be a batch the pieces can run in training mode
    (BatchNorm needs more than one sample): the strategy measures on ``example_input_array``."""
    acts = [0] * len(pieces)
    if example_input is not None:
        with preserved_state(pieces):
            for p in pieces:
                p.train()  # the activations a training step keeps for its backward (dropout masks included)
            x = example_input
            for i, p in enumerate(pieces):
                param_ptrs = {q.untyped_storage().data_ptr() for q in p.parameters()}
                seen: dict[int, int] = {}

                def pack(t: torch.Tensor, seen: dict[int, int] = seen, skip: set[int] = param_ptrs) -> torch.Tensor:
                    try:
                        s = t.untyped_storage()
                        if s.data_ptr() not in skip:
                            seen.setdefault(s.data_ptr(), s.nbytes())
                    except (RuntimeError, NotImplementedError):
                        pass
                    return t

                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    x = p(x)
                acts[i] = int(sum(seen.values()))
                x = x.detach()
    return [_state_bytes(p, bytes_per_param) + a for p, a in zip(pieces, acts, strict=False)]


def trainable_pieces(pieces: Sequence[nn.Module]) -> list[bool]:
    """Per piece, whether it holds a parameter that trains (``requires_grad``): what :func:`balance_stages` gives
    every stage when it can, since a stage without one leaves its rank's optimizer an empty parameter list."""
    return [any(p.requires_grad for p in piece.parameters()) for piece in pieces]


def balance_stages(
    costs: Sequence[float], stages: int, *, trainable: Sequence[bool] | None = None
) -> list[tuple[int, int]]:
    """Cut ``costs`` into ``stages`` contiguous, non-empty runs minimising the largest run's sum (exact linear
    partition by dynamic programming). Returns ``(start, stop)`` per stage.

    With ``trainable`` (per piece, :func:`trainable_pieces`), every run also holds at least one trainable piece when
    that is possible (at least ``stages`` trainable pieces): the best such cut, which may be less balanced. When it is
    not possible the plain balance is returned; :func:`check_stages_train` names the stages left without one.

    Raises:
        ValueError: more stages than pieces, with both numbers and the fix.
    """
    n = len(costs)
    check_int("stages", stages, low=1)
    if stages > n:
        raise ValueError(
            f"cannot cut {n} pipeline piece(s) into {stages} stages: every stage needs at least one. Use at most {n} "
            "stages (fewer processes per pipeline, or `stages_per_rank=1`), or split the network into more pieces."
        )
    if trainable is not None and len(trainable) != n:
        raise ValueError(f"`trainable` has {len(trainable)} entries for {n} pieces: give one per piece.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    # trained[i]: trainable pieces among the first i; a run (j, i) may stand alone when it holds one
    trained = [0]
    for t in trainable if trainable is not None else [True] * n:
        trained.append(trained[-1] + bool(t))
    need = trainable is not None and trained[-1] >= stages
    inf = float("inf")
    # best[k][i]: the smallest max-run for the first i pieces in k runs; cut[k][i]: where the last run starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                if need and trained[i] == trained[j]:
                    continue
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    bounds: list[tuple[int, int]] = []
    i = n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def check_stages_train(
    bounds: Sequence[tuple[int, int]], trainable: Sequence[bool], *, model: str = "the model"
) -> None:
    """Raise when a stage of ``bounds`` holds no trainable piece: its rank's optimizer would get an empty parameter
    list (torch refuses it) while the other ranks wait for it. Every rank computes the same ``bounds`` from the same
    model, so every rank raises alike.

    Raises:
        ValueError: one line naming the stage(s), their pieces, the trainable pieces and the fix.
    """
    idle = [s for s, (a, b) in enumerate(bounds) if not any(trainable[a:b])]
    if not idle:
        return
    held = [i for i, t in enumerate(trainable) if t]
    where = ", ".join(
        f"{s} (piece {a})" if b - a == 1 else f"{s} (pieces {a}..{b - 1})"
        for s, (a, b) in ((s, bounds[s]) for s in idle)
    )
    if held:
        why = f"only {len(held)} of the {len(trainable)} pieces ({held}) train, too few for {len(bounds)} stages"
        fix = (
            f"Use at most {len(held)} stage{'s' if len(held) > 1 else ''} (`pipeline_size`, `stages_per_rank`), "
            "unfreeze a parameter in those pieces, or train the frozen backbone data parallel (`strategy='ddp'`)."
        )
    else:
        why = f"none of its {len(trainable)} pieces trains"
        fix = "Unfreeze the parameters to train (`requires_grad_(True)`), or only validate / test / predict."
    raise ValueError(
        f"pipeline stage(s) {where} of {model} hold no parameter that trains, so their rank's optimizer would be "
        f"empty: {why}. {fix}"
    )


def check_no_sync_batchnorm(module: nn.Module, *, model: str = "the model") -> None:
    """Raise when ``module`` holds an ``nn.SyncBatchNorm``: in training it all-gathers its batch statistics over every
    rank of its process group in each forward, but a pipeline stage's forward runs on its own rank only, so that rank
    would wait forever for ranks busy with other stages. Static (no forward runs), so every rank raises alike, before
    any stage runs.

    Raises:
        ValueError: one line naming the module(s) and the fix.
    """
    synced = [name or "(the model)" for name, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if not synced:
        return
    more = f" and {len(synced) - 3} more" if len(synced) > 3 else ""
    raise ValueError(
        f"a pipeline cannot train {model}: it holds `nn.SyncBatchNorm` ({', '.join(f'`{n}`' for n in synced[:3])}"
        f"{more}), which syncs over every rank in each training forward while a pipeline stage runs on one rank. Use "
        "`nn.BatchNorm*` in the pipeline (drop `Trainer(sync_batchnorm=True)` / `convert_sync_batchnorm`), or train "
        "it data parallel (`strategy='ddp'`)."
    )


def keep_only(root: nn.Module, owned: Sequence[nn.Module]) -> int:
    """Drop from ``root`` every parameter and buffer that no module of ``owned`` uses (set to ``None`` through
    ``register_parameter`` / ``register_buffer``), so ``root.parameters()`` and the optimizer built from it see
    only this rank's stages and the memory is freed. Returns the number of parameter elements dropped."""
    keep = {id(t) for m in owned for t in (*m.parameters(), *m.buffers())}
    dropped = 0
    for m in root.modules():
        for name, p in list(m.named_parameters(recurse=False, remove_duplicate=False)):
            if id(p) not in keep:
                dropped += p.numel()
                m.register_parameter(name, None)
        for name, b in list(m.named_buffers(recurse=False, remove_duplicate=False)):
            if id(b) not in keep:
                m.register_buffer(name, None)
    return dropped


def _parameter_order(root: nn.Module) -> dict[str, int]:
    """``{name: place}`` in ``root.named_parameters()`` order; every name of a tied parameter gets its first place."""
    first: dict[int, int] = {}
    order: dict[str, int] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        order[name] = first.setdefault(id(p), len(first))
    return order


class _Stage(nn.Module):
    """A contiguous run of pieces applied in order (holds references: the pieces stay in the user's module)."""

    def __init__(self, pieces: Sequence[nn.Module]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)

    def forward(self, x: Any) -> Any:
        for p in self.pieces:
            x = p(x)
        return x


@dataclass(frozen=True)
class PipelineLayout:
    """Who runs what: ``world = dp · pp`` ranks, rank ``r`` is replica ``r // pp``, pipeline rank ``r % pp``; each
    pipeline rank runs ``stages_per_rank`` stages in loop order (``pp_rank + i·pp``).

    Attributes:
        dp: pipeline replicas (data parallel).
        pp: ranks per pipeline.
        stages_per_rank: virtual stages per rank (1 except for interleaved schedules).
        bounds: ``(start, stop)`` piece indices of every stage.
    """

    dp: int
    pp: int
    stages_per_rank: int
    bounds: tuple[tuple[int, int], ...]

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stages_of(self, rank: int) -> list[int]:
        return [rank % self.pp + i * self.pp for i in range(self.stages_per_rank)]

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.pp + stage % self.pp


def pipeline_layout(
    costs: Sequence[float],
    world: int,
    *,
    pipeline_size: int | None = None,
    stages_per_rank: int = 1,
    trainable: Sequence[bool] | None = None,
) -> PipelineLayout:
    """Balance ``costs`` over ``pipeline_size · stages_per_rank`` stages; the rest of ``world`` is data parallel.
    With ``trainable`` (per piece), every stage gets a trainable piece when it can (:func:`balance_stages`).

    Raises:
        ValueError: ``world`` not divisible by ``pipeline_size``, or more stages than pieces (both numbers, the fix).
    """
    pp = world if pipeline_size is None else pipeline_size
    if pp < 1 or world % pp:
        raise ValueError(
            f"the world size {world} is not divisible by `pipeline_size`={pp}: every pipeline replica needs all its "
            f"stages. Use a `pipeline_size` that divides {world} (one of {_divisors(world)}), or a multiple of {pp} "
            "processes."
        )
    check_int("stages_per_rank", stages_per_rank, low=1)
    bounds = balance_stages(costs, pp * stages_per_rank, trainable=trainable)
    return PipelineLayout(world // pp, pp, stages_per_rank, tuple(bounds))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mapping_like(template: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``items`` in a mapping of ``template``'s type, as Lightning rebuilds a batch it moves: an ``OrderedDict``, a
    ``defaultdict`` (with its factory), a tokenizer's ``BatchEncoding`` or any ``UserDict`` stays one, so a step that
    reads it (``batch.input_ids``) works on a micro-batch too; a type that cannot be made from a dict gives a
    ``dict``."""
    if type(template) is dict:
        return items
    if isinstance(template, defaultdict):
        out = copy.copy(template)
        out.clear()
        out.update(items)
        return out
    make: Callable[[dict[Any, Any]], Any] = type(template)  # a concrete mapping type made from a dict (most are)
    try:
        return make(items)
    except Exception:  # noqa: BLE001 -- a mapping type with another constructor: its items still reach the step
        return items


def sequence_like(template: Sequence[Any], items: list[Any]) -> Any:
    """``items`` in a sequence of ``template``'s type: a namedtuple (made from its fields, which ``type(t)(items)``
    would not do) or a tuple stays one, anything else is a list."""
    if isinstance(template, tuple):
        return type(template)(*items) if hasattr(template, "_fields") else type(template)(items)
    return list(items)


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor of ``batch`` (nested tuples / lists / mappings), in order; other values are left out."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (tuple, list)):
        return [t for b in batch for t in batch_tensors(b)]
    if isinstance(batch, Mapping):  # a dict, or a tokenizer's `BatchEncoding` (a `UserDict`)
        return [t for b in batch.values() for t in batch_tensors(b)]
    return []


#: the plain values a per-sample list holds (the ids, paths or texts ``default_collate`` gathers into a list)
PLAIN_TYPES = (str, bytes, int, float, bool, type(None))


def is_per_sample_list(x: Any, rows: int) -> bool:
    """Whether ``x`` is a list of ``rows`` plain values (strings, numbers, None): one per sample of a batch of ``rows``
    rows, as ``default_collate`` gathers a string field (``{"id": ["a", "b", ...]}``), so it is split, gathered and
    joined with the rows. A list of tensors is a structure (``[inputs, targets]``), never per sample."""
    return isinstance(x, list) and rows > 0 and len(x) == rows and all(isinstance(v, PLAIN_TYPES) for v in x)


def _placed_tensors(batch: Any, place: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``batch`` with its place in it (``[1]``, ``["x"][0]``; the whole batch: ``""``), in order."""
    if isinstance(batch, torch.Tensor):
        return [(place, batch)]
    if isinstance(batch, (tuple, list)):
        return [pt for i, b in enumerate(batch) for pt in _placed_tensors(b, f"{place}[{i}]")]
    if isinstance(batch, Mapping):
        return [pt for k, b in batch.items() for pt in _placed_tensors(b, f"{place}[{k!r}]")]
    return []


def _check_rows(batch: Any) -> None:
    """Raise when the tensors of ``batch`` (0-dim ones aside) differ in their first dimension: one line naming the
    sizes, where each differing tensor is, and the fix (see :func:`split_batch`)."""
    placed = [(p, t) for p, t in _placed_tensors(batch) if t.ndim]
    sizes = [int(t.shape[0]) for _, t in placed]
    if len(set(sizes)) <= 1:
        return
    rows = sizes[0]
    odd = [f"`{p or 'batch'}` ({n} rows)" for (p, _), n in zip(placed, sizes, strict=True) if n != rows]
    more = f" and {len(odd) - 3} more" if len(odd) > 3 else ""
    shown = sizes if len(sizes) <= 8 else [*sizes[:8], "..."]
    raise ValueError(
        f"the batch's tensors differ in their first dimension ({shown}; the first has {rows} rows, "
        f"{', '.join(odd[:3])}{more}): the pipeline cuts every tensor of a batch along dim 0 into micro-batches, so "
        "each needs one row per sample. A list of per-sample tensors of different lengths cannot be cut: pad them "
        "into one tensor in the DataLoader's `collate_fn` (`torch.nn.utils.rnn.pad_sequence(..., batch_first=True)`, "
        "with a mask or the lengths as a tensor of one row per sample)."
    )


def split_batch(batch: Any, chunks: int) -> list[Any]:
    """Split every tensor of ``batch`` (nested tuples, namedtuples, lists and mappings, each micro-batch's of the
    batch's type: :func:`mapping_like`, :func:`sequence_like`) along dim 0 into ``chunks`` equal parts, and every list
    with one plain value per sample (:func:`is_per_sample_list`) with them; other non-tensors and 0-dim tensors (a
    scalar has no batch dimension) are repeated.

    Every tensor with a dimension must have the batch's rows as its first: a list of per-sample tensors of different
    lengths (a ragged batch) or a tensor of another first size would otherwise be cut into parts that do not line up
    with the other tensors' rows, each sample's own tensor split across micro-batches.

    Raises:
        ValueError: the tensors differ in their first dimension (named by their place in the batch), or it is not
            divisible by ``chunks``.
    """
    _check_rows(batch)
    rows = next((t.shape[0] for t in batch_tensors(batch) if t.ndim), 0)

    def split(x: Any) -> list[Any]:
        if isinstance(x, torch.Tensor) and x.ndim == 0:  # as `gather_batch` passes it through
            return [x] * chunks
        if is_per_sample_list(x, rows):  # each micro-batch its samples' ids, as its tensors' rows (`Tensor.chunk`)
            size = -(-rows // chunks)
            return [x[i * size : (i + 1) * size] for i in range(chunks)]
        if isinstance(x, torch.Tensor):
            if x.shape[0] % chunks:
                raise ValueError(
                    f"a batch tensor of shape {tuple(x.shape)} cannot be split into `microbatches`={chunks} equal "
                    f"micro-batches. Use a batch size that is a multiple of {chunks} (and `drop_last=True`), or set "
                    "`microbatches` to a divisor of the batch size."
                )
            return list(x.chunk(chunks))
        if isinstance(x, (list, tuple)):
            parts = [split(v) for v in x]
            return [sequence_like(x, [p[i] for p in parts]) for i in range(chunks)]
        if isinstance(x, Mapping):
            parts_d = {k: split(v) for k, v in x.items()}
            return [mapping_like(x, {k: v[i] for k, v in parts_d.items()}) for i in range(chunks)]
        return [x] * chunks

    return split(batch)


def join_outputs(parts: list[Any], *, average_scalars: bool = False) -> Any:
    """One batch's output from its micro-batches' outputs, in order (what ``predict_step`` returned per micro-batch):
    tensors concatenated along dim 0 (0-dim ones stacked), mappings and tuples (namedtuples too) joined per key or
    position, each of its type, lists concatenated (a list holds one entry per sample, as Lightning's prediction lists
    do), ``None`` from every micro-batch as ``None`` (a ``predict_step`` that writes its predictions away and returns
    nothing: the batch's prediction is ``None``, as without a pipeline), anything else as the list of the
    micro-batches' values.

    With ``average_scalars`` (a training or evaluation step's outputs), a 0-dim floating-point tensor or a Python
    float is averaged over the micro-batches instead, as the pipeline's loss and logged values are: the whole batch's
    value for a mean over its samples (an accuracy), where a stack would hand ``outputs["acc"].item()`` a vector."""
    if all(p is None for p in parts):
        return None
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.ndim:
            return torch.cat(parts)
        stacked = torch.stack(parts)
        return stacked.mean() if average_scalars and stacked.is_floating_point() else stacked
    if average_scalars and isinstance(first, float) and all(isinstance(p, float) for p in parts):
        return sum(parts) / len(parts)
    if isinstance(first, Mapping):
        return mapping_like(
            first, {k: join_outputs([p[k] for p in parts], average_scalars=average_scalars) for k in first}
        )
    if isinstance(first, tuple):
        return sequence_like(
            first, [join_outputs(list(vals), average_scalars=average_scalars) for vals in zip(*parts, strict=True)]
        )
    if isinstance(first, list):
        return [v for p in parts for v in p]
    return list(parts)


class PipelineRunner:
    """The stages and schedule of one rank; :meth:`step` runs one optimizer step's forward and backward.

    Args:
        root: the module that owns every piece (its unused parameters are dropped, see :func:`keep_only`).
        pieces: the pieces, in forward order.
        layout: the split (:func:`pipeline_layout`).
        rank: this process's global rank.
        device: this process's device.
        schedule: one of :data:`SCHEDULES`.
        microbatches: micro-batches per step (``>= pp``).
        loss_fn: ``(last stage output, target micro-batch) -> scalar loss``, run on the last stage.
    """

    def __init__(
        self,
        root: nn.Module,
        pieces: Sequence[nn.Module],
        layout: PipelineLayout,
        *,
        rank: int,
        device: torch.device,
        schedule: str = "1f1b",
        microbatches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> None:
        check_choice("schedule", schedule, SCHEDULES)
        if (schedule == "interleaved1f1b") != (layout.stages_per_rank > 1):
            raise ValueError(
                f"`schedule`={schedule!r} with `stages_per_rank`={layout.stages_per_rank}: the interleaved schedule "
                "needs `stages_per_rank` >= 2 and the others exactly 1."
            )
        check_microbatches(microbatches, layout.pp, schedule)
        self.layout, self.rank, self.device = layout, rank, device
        self.schedule_name, self.microbatches, self.loss_fn = schedule, microbatches, loss_fn
        self.replica, self.pp_rank = divmod(rank, layout.pp)
        self.stage_ids = layout.stages_of(rank)
        self.stage_modules = [_Stage(pieces[a:b]) for a, b in (layout.bounds[s] for s in self.stage_ids)]
        #: per piece, whether it trains (every rank knows it for every stage: read before the others' are dropped)
        self.trainable = tuple(trainable_pieces(pieces))
        #: the unsplit ``root``'s parameter names in ``named_parameters()`` order (a tied parameter's every name maps
        #: to its first place): a full optimizer state lists its parameters in that order, the one a one-process
        #: optimizer over ``root.parameters()`` has, since ``Optimizer.load_state_dict`` matches them by position
        self.param_order = _parameter_order(root)
        #: every piece, in forward order (references: they stay in ``root``, those of other ranks without parameters)
        self.pieces = tuple(pieces)
        #: every process group this runner made (those this rank is a member of): :meth:`release` destroys them
        #: (:func:`~lightning_accel.parallel.trials.release_groups` too, for a trial's runner)
        self.groups: list[Any] = []
        #: whether :meth:`release` destroyed the groups (:meth:`reopen` makes them again)
        self.released = False
        self._shared = self._shared_params(pieces)  # read before the other ranks' parameters are dropped
        self._tied: list[tuple[list[nn.Parameter], Any]] = []
        #: this replica's pipeline ranks / this pipeline rank's replicas
        self.pp_group: Any = None
        self.dp_group: Any = None
        self._make_groups()  # collective: every rank creates every group, in the same order
        keep_only(root, self.stage_modules)
        self.params = [p for p in root.parameters() if p.requires_grad]
        self._schedules: dict[Any, Any] = {}

    # ----------------------------------------------------------------------------------------------------- groups
    def _new_group(self, ranks: list[int]) -> Any:
        """``dist.new_group(ranks)`` (collective: every rank calls it), kept in :attr:`groups` where this rank is in
        it."""
        g = dist.new_group(ranks)
        if self.rank in ranks:
            self.groups.append(g)
        return g

    def _make_groups(self) -> None:
        """Create every group of the split (tied parameters' holders, then :attr:`pp_group`, :attr:`dp_group`).
        Collective: every rank calls it, and makes every group in the same order."""
        lay = self.layout
        self._tied = []
        for ranks, params in self._shared:
            for r in range(lay.dp):
                g = self._new_group([r * lay.pp + i for i in ranks])
                if r == self.replica and self.pp_rank in ranks:
                    self._tied.append((params, g))
        for r in range(lay.dp):
            g = self._new_group([r * lay.pp + i for i in range(lay.pp)])
            if r == self.replica:
                self.pp_group = g
        for i in range(lay.pp):
            g = self._new_group([r * lay.pp + i for r in range(lay.dp)])
            if i == self.pp_rank:
                self.dp_group = g

    def _shared_params(self, pieces: Sequence[nn.Module]) -> list[tuple[tuple[int, ...], list[nn.Parameter]]]:
        """Per set of pipeline ranks that share parameters (a tied embedding / LM head), those ranks and the shared
        parameters this rank holds (none where it is not among them: every rank still knows every set, to create the
        same groups)."""
        lay = self.layout
        holders: dict[int, set[int]] = {}
        by_id: dict[int, nn.Parameter] = {}
        order: list[int] = []
        for stage, (a, b) in enumerate(lay.bounds):
            for piece in pieces[a:b]:
                for p in piece.parameters():
                    if id(p) not in holders:
                        holders[id(p)], by_id[id(p)] = set(), p
                        order.append(id(p))
                    holders[id(p)].add(stage % lay.pp)
        shared: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for pid in order:
            if len(holders[pid]) > 1:
                ranks = tuple(sorted(holders[pid]))
                shared.setdefault(ranks, [])
                if self.pp_rank in ranks:
                    shared[ranks].append(by_id[pid])
        return list(shared.items())

    def release(self) -> None:
        """Destroy every process group this runner made (local, no collective; NCCL warns about groups left at
        exit) and the schedules built on them. The split stays: :meth:`reopen` makes the groups again."""
        for g in self.groups:
            if g is None or g == dist.GroupMember.NON_GROUP_MEMBER:
                continue
            with contextlib.suppress(ValueError):  # destroyed already (a `destroy_process_group()` of every group)
                dist.destroy_process_group(g)
        self.groups, self._tied = [], []
        self.pp_group = self.dp_group = None
        self._schedules.clear()
        self.released = True

    def reopen(self) -> None:
        """Make the groups :meth:`release` destroyed again (collective: every rank of the world calls it)."""
        if self.released:
            self._make_groups()
            self.released = False

    def set_loss_fn(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        """Use ``loss_fn`` from now on (a new Trainer reusing this split); the schedules built with the old one go."""
        self.loss_fn = loss_fn
        self._schedules.clear()

    # --------------------------------------------------------------------------------------------------- schedule
    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.layout.num_stages - 1 in self.stage_ids

    def eval_microbatches(self, rows: int) -> int:
        """The micro-batches to evaluate a batch of ``rows`` samples in: ``microbatches`` when they divide it, else the
        largest count below that does (the last batch of an evaluation loader, which keeps every sample, is often
        smaller; forward only, so the count changes no result). The interleaved schedule needs a multiple of the
        pipeline size; with none that divides ``rows``, ``microbatches`` (the split then says what is wrong)."""
        m = self.microbatches
        if rows <= 0 or rows % m == 0:
            return m
        step = self.layout.pp if self.schedule_name == "interleaved1f1b" else 1
        fits = [d for d in range(step, min(m, rows) + 1, step) if rows % d == 0]
        return max(fits) if fits else m

    def _schedule(self, key: Any, microbatches: int | None = None) -> Any:
        """One schedule per micro-batch shape (and count): ``PipelineStage`` infers and fixes its buffers' shapes on
        first use. A count other than ``microbatches`` (:meth:`eval_microbatches`) evaluates with GPipe's schedule,
        which, unlike 1F1B's, runs fewer micro-batches than stages."""
        n = microbatches or self.microbatches
        if (key, n) in self._schedules:
            return self._schedules[(key, n)]
        from torch.distributed import pipelining as pl

        stages: list[Any] = [
            pl.PipelineStage(m, s, self.layout.num_stages, self.device, group=self.pp_group)
            for m, s in zip(self.stage_modules, self.stage_ids, strict=False)
        ]
        sched: Any
        if self.schedule_name == "interleaved1f1b":
            sched = pl.ScheduleInterleaved1F1B(stages, n, loss_fn=self.loss_fn)
        else:
            cls = pl.Schedule1F1B if self.schedule_name == "1f1b" and n == self.microbatches else pl.ScheduleGPipe
            sched = cls(stages[0], n, loss_fn=self.loss_fn)
        self._schedules[(key, n)] = sched
        return sched

    def step(self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None, key: Any = None) -> torch.Tensor:
        """Forward and backward of ``microbatches`` micro-batches, then the gradient syncs.

        Args:
            inputs: per micro-batch, the first stage's input tensor (read on the rank with stage 0 only).
            targets: per micro-batch, what ``loss_fn`` receives on the last stage (read there only).
            key: the micro-batch shape (one schedule per shape; None: one shape throughout).

        Returns:
            The mean micro-batch loss, on every rank of this pipeline (sent from the last stage).
        """
        sched = self._schedule(("train", key))
        losses: list[torch.Tensor] = []
        kwargs = self._microbatch_kwargs(inputs, targets, losses)
        sched.step(**kwargs)
        self._sync_grads()
        return self._loss_everywhere(losses)

    @torch.no_grad()
    def evaluate(
        self,
        inputs: Sequence[Any] | None,
        targets: Sequence[Any] | None,
        key: Any = None,
        microbatches: int | None = None,
    ) -> torch.Tensor:
        """Forward only (``schedule.eval``) of ``microbatches`` micro-batches (None: :attr:`microbatches`; the same on
        every rank of the pipeline, see :meth:`eval_microbatches`); the mean micro-batch loss on every rank of this
        pipeline."""
        sched = self._schedule(("eval", key), microbatches)
        losses: list[torch.Tensor] = []
        kwargs = self._microbatch_kwargs(inputs, targets, losses)
        sched.eval(**kwargs)
        return self._loss_everywhere(losses)

    def _microbatch_kwargs(
        self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None, losses: list[torch.Tensor]
    ) -> dict[str, Any]:
        """The schedule's arguments for this rank: inputs on the first stage, targets and ``losses`` on the last."""
        kwargs: dict[str, Any] = {}
        if self.has_first:
            assert inputs is not None, "the rank with the first stage needs the inputs"
            kwargs["arg_mbs"] = [(x,) for x in inputs]
        if self.has_last:
            assert targets is not None, "the rank with the last stage needs the targets"
            kwargs["target_mbs"] = list(targets)
            kwargs["losses"] = losses
        return kwargs

    def _loss_everywhere(self, losses: list[torch.Tensor]) -> torch.Tensor:
        t = torch.stack([loss.detach().float() for loss in losses]).mean() if losses else torch.zeros(())
        t = t.to(self.device)
        src = self.layout.rank_of(self.layout.num_stages - 1, self.replica)
        dist.broadcast(t, src=src, group=self.pp_group)
        return t

    def _sync_grads(self) -> None:
        for params, group in self._tied:  # tied weights: each holder computed a part of the gradient
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
        if self.layout.dp > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.dp_group)
                p.grad.div_(self.layout.dp)

    def grad_norm_sq(self) -> torch.Tensor:
        """Squared L2 norm of the whole model's gradient, on every rank (tied parameters counted once)."""
        tied_skip: set[int] = set()
        for params, group in self._tied:
            if dist.get_rank(group) != 0:  # the lowest holder counts them
                tied_skip.update(id(p) for p in params)
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        for p in self.params:
            if p.grad is not None and id(p) not in tied_skip:
                total += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(total, group=self.pp_group)
        return total

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every stage's gradients by ``max_norm / global norm`` when the global norm exceeds it (the norm
        ``clip_grad_norm_`` would compute on the unsplit model). Returns the global norm before clipping."""
        norm = float(self.grad_norm_sq().sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm
