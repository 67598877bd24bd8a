"""Knowledge distillation (Hinton et al., 2015): a frozen teacher's softened logits as extra targets.

Functional core (plain torch, no Lightning):

- :func:`distillation_loss` -- ``T^2 * KL(p_teacher || p_student)`` with ``p = softmax(logits / T)``, averaged over
  the samples (rows). The ``T^2`` keeps the soft term's gradient scale independent of ``T``.
- :func:`combine_losses` -- ``(1 - alpha) * hard + alpha * soft``.
- :func:`freeze_teacher` -- ``requires_grad_(False)`` + ``eval()``, so the teacher never trains, never updates
  BatchNorm statistics and never drops units.
- :func:`load_teacher` -- build a teacher from a checkpoint (a plain Lightning/``torch.save`` file or a
  ``DeltaCheckpointIO`` manifest) **without unpickling** arbitrary objects
  (:func:`~lightning_accel.checkpoint.read_checkpoint`): ``teacher_class(**hyper_parameters)`` (``config=`` for
  hyper-parameters saved from one argument ``config``) then
  ``load_state_dict``.
- :func:`check_logits_match` -- the teacher's and the student's logits must have the same shape.

About the direction of the KL: it is sometimes written ``KL(softmax(student/T) || softmax(teacher/T))``; we compute the
standard distillation term, the KL *from the teacher to the student* (``F.kl_div(log p_student, log p_teacher)``),
whose gradient is Hinton's ``(p_student - p_teacher) / T`` -- the cross-entropy against soft targets up to a constant.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import os
import reprlib
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel._utils.checks import check_number
from lightning_accel._utils.errors import one_line
from lightning_accel.checkpoint.reader import read_checkpoint
from lightning_accel.recipes.prune import resize_to_state_dict

__all__ = [
    "check_distillation_args",
    "check_logits_match",
    "combine_losses",
    "distillation_loss",
    "freeze_teacher",
    "legacy_teacher_fingerprint",
    "load_teacher",
    "teacher_fingerprint",
]


def check_distillation_args(temperature: float, alpha: float) -> None:
    """Validate ``temperature`` finite and > 0 and ``alpha`` in [0, 1] (through ``_utils.checks.check_number``).

    Raises:
        TypeError: an argument that is not a number (a bool or a string neither), naming it.
        ValueError: naming the argument, with the value and the fix.
    """
    # an infinite temperature flattens both distributions to uniform: the soft loss is NaN (inf^2 x 0), not a signal
    check_number(
        "temperature",
        temperature,
        low=0,
        high=math.inf,
        low_open=True,
        high_open=True,
        fix="Typical values are 1-8 (4 is a good start).",
    )
    check_number(
        "alpha",
        alpha,
        low=0,
        high=1,
        fix="It is the weight of the distillation term: 0 trains on the hard labels only, 1 on the teacher only.",
    )


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))``, summed over classes, averaged over rows.

    Logits of any shape ``(..., C)`` work (e.g. ``(B, T, V)`` for language models): all leading dims are rows.
    Computed in float32 for stability under mixed precision. Gradients flow to ``student_logits`` only. Classes whose
    teacher logit is ``-inf`` (masked) have zero teacher probability and contribute nothing (``0 log 0 = 0``), also
    where the student masks them too.

    Args:
        student_logits: the student's raw scores, last dim = classes.
        teacher_logits: the teacher's raw scores, same shape.
        temperature: softening temperature ``T > 0``, finite.
    """
    check_distillation_args(temperature, 0.0)
    check_logits_match(student_logits, teacher_logits)
    t = float(temperature)
    c = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, c) / t, dim=-1)
    log_p = F.log_softmax(teacher_logits.detach().float().reshape(-1, c) / t, dim=-1)
    p = log_p.exp()
    # classes the teacher gives no mass (logits masked to -inf: padded vocabularies, forbidden classes) contribute
    # 0 log 0 = 0; `F.kl_div` computes exp(-inf) * (-inf - s) = 0 * -inf = NaN there, which made the whole loss NaN
    kl = torch.where(p > 0, p * (log_p - s), torch.zeros_like(p))
    return kl.sum() / kl.shape[0] * (t * t)


def combine_losses(hard: torch.Tensor, soft: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(1 - alpha) * hard + alpha * soft`` (the hard term is skipped at ``alpha == 1`` to save its graph)."""
    if alpha >= 1.0:
        return soft.to(hard.dtype) if hard.is_floating_point() else soft
    if alpha <= 0.0:
        return hard
    return (1.0 - alpha) * hard + alpha * soft.to(hard.dtype)


def check_logits_match(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    """Raise ``ValueError`` naming `teacher` when the two logit tensors differ in shape."""
    if tuple(student_logits.shape) != tuple(teacher_logits.shape):
        raise ValueError(
            f"`teacher` output shape {tuple(teacher_logits.shape)} differs from the student's logits "
            f"{tuple(student_logits.shape)}. The teacher must produce logits over the same classes for the same "
            "inputs: check its number of classes, and that it receives the student's inputs."
        )


#: Shortens the value quoted in an error: a tensor or a container of them would print every element.
_SHORT = reprlib.Repr()
_SHORT.maxother = _SHORT.maxstring = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = 3


def freeze_teacher(teacher: nn.Module) -> nn.Module:
    """Freeze ``teacher`` in place (no gradients, eval mode) and return it."""
    if not isinstance(teacher, nn.Module):
        if isinstance(teacher, Mapping):
            # a `state_dict` is a likely slip; its repr would print every tensor, over many lines
            raise TypeError(
                "`teacher` must be a torch.nn.Module (or a checkpoint path), got a mapping "
                f"({type(teacher).__name__}) of {len(teacher)} entries (a state_dict?). Build the teacher and load "
                "the weights into it (`teacher = Net(); teacher.load_state_dict(weights)`), or pass the checkpoint's "
                "path with `teacher_class`."
            )
        shown = " ".join(_SHORT.repr(teacher).split())
        raise TypeError(
            f"`teacher` must be a torch.nn.Module (or a checkpoint path), got {shown} ({type(teacher).__name__})."
        )
    teacher.requires_grad_(False)
    teacher.eval()
    return teacher


#: Elements of a tensor hashed per host copy: bounds the host memory the fingerprint of a GPU teacher takes (16 MB of
#: float32) without copying the teacher to the host whole.
_FINGERPRINT_CHUNK = 1 << 22


def teacher_fingerprint(teacher: nn.Module) -> str:
    """``"<class name>@<hash>"``: the teacher's class and a 12-hex-digit hash of its ``state_dict`` (names, dtypes,
    shapes and every value of every tensor), the same in every process, on every device and in every run with the same
    weights.

    It tells two teachers of one architecture apart (an ensemble of checkpoints), whichever values differ: every byte
    is read, a tensor at a time in chunks of at most 4M elements copied to the host (one pass over the weights: 0.13 s
    for 100 MB of float32 on one core here; :class:`~lightning_accel.recipes.KnowledgeDistillation` computes it once,
    at construction). Entries whose bytes cannot be read as a dense tensor's (the ``meta`` device, sparse or quantized
    tensors, a module's extra state) contribute their names, types and shapes only.
    """
    h = hashlib.blake2b(digest_size=6)
    for name, t in teacher.state_dict().items():
        if not isinstance(t, torch.Tensor):
            h.update(f"{name}:{type(t).__qualname__};".encode())
            continue
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.device.type == "meta" or t.layout != torch.strided or t.is_quantized:
            continue
        # all values, not a sample: a sample of 4096 evenly spaced values skips most of a larger tensor (the last rows
        # of a 512 x 10 head, every column but one of a wide layer), and teachers differing there shared a key
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), _FINGERPRINT_CHUNK):
            chunk = flat[start : start + _FINGERPRINT_CHUNK].cpu().contiguous()
            h.update(chunk.view(torch.uint8).numpy().data)
    return f"{type(teacher).__qualname__}@{h.hexdigest()}"


#: Values of each tensor that :func:`legacy_teacher_fingerprint` reads.
_LEGACY_FINGERPRINT_SAMPLES = 4096


def legacy_teacher_fingerprint(teacher: nn.Module) -> str:
    """The fingerprint earlier versions keyed ``KnowledgeDistillation`` states by: like :func:`teacher_fingerprint`,
    but hashing up to 4096 evenly spaced values of each tensor. Only for recognising the state of the same teacher in
    a checkpoint written by them; it does not tell teachers apart that differ between the sampled values."""
    h = hashlib.blake2b(digest_size=6)
    for name, t in teacher.state_dict().items():
        if not isinstance(t, torch.Tensor):
            h.update(f"{name}:{type(t).__qualname__};".encode())
            continue
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.device.type == "meta" or t.layout != torch.strided or t.is_quantized:
            continue
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _LEGACY_FINGERPRINT_SAMPLES)][:_LEGACY_FINGERPRINT_SAMPLES]
        h.update(sample.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return f"{type(teacher).__qualname__}@{h.hexdigest()}"


def _resolve_class(cls: type[nn.Module] | str | None, path: str) -> type[nn.Module]:
    if cls is None:
        raise ValueError(
            f"`teacher` is a checkpoint path ({path!r}) but `teacher_class` is not set. Pass the teacher's "
            "LightningModule class (or its import path, e.g. 'lightning_accel.models.ImageClassifier'), or pass the "
            "teacher as a module."
        )
    if isinstance(cls, str):
        mod, _, name = cls.rpartition(".")
        if not mod:
            raise ValueError(f"`teacher_class` must be a dotted import path like 'pkg.module.Class', got {cls!r}.")
        try:
            cls = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"`teacher_class` {cls!r} cannot be imported: {one_line(e)}.") from e
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"`teacher_class` must be a torch.nn.Module subclass, got {cls!r}.")
    return cls


def load_teacher(path: str | os.PathLike[str], teacher_class: type[nn.Module] | str | None) -> nn.Module:
    """Build ``teacher_class(**hyper_parameters)`` from a Lightning checkpoint and load its weights, safely.

    The checkpoint is a plain ``torch.save`` file (``Trainer.save_checkpoint``, ``TorchCheckpointIO``) or a
    ``DeltaCheckpointIO`` manifest, read by :func:`~lightning_accel.checkpoint.read_checkpoint`: tensors and plain
    containers only, never arbitrary pickled objects. Hyper-parameters saved from one argument
    (``self.save_hyperparameters(config)``, which Lightning records as ``hparams_name``) are passed back as that
    argument, ``teacher_class(config=...)``, as ``load_from_checkpoint`` does. A plain ``state_dict`` file (no
    ``hyper_parameters``) builds ``teacher_class()``. Layers are resized to the checkpoint's shapes first, so a teacher
    pruned by ``StructuredPruning`` loads too.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no/bad ``teacher_class``, one that the checkpoint's ``hyper_parameters`` cannot construct (a plain
            ``state_dict`` file of a class with required arguments), weights that do not fit it, or a file that is no
            checkpoint.
        pickle.UnpicklingError: a plain file holding objects ``torch.load(weights_only=True)`` refuses.
    """
    p = os.fspath(path)
    cls = _resolve_class(teacher_class, p)
    try:
        ckpt = read_checkpoint(p, map_location="cpu")
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"`teacher` checkpoint {p!r} does not exist. Pass an existing .ckpt file (written by "
            "`Trainer.save_checkpoint`, `DeltaCheckpointIO` or `torch.save`)."
        ) from e
    state = ckpt.get("state_dict", ckpt)
    saved = dict(ckpt.get("hyper_parameters", {}) or {})
    params = inspect.signature(cls.__init__).parameters
    hparams = saved
    named = params.get(str(ckpt.get("hparams_name")))
    if named is not None and named.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
        # `self.save_hyperparameters(config)` saves the entries of the one argument `config` and names it
        # (`hparams_name`): the class takes them back as that argument, as Lightning's `load_from_checkpoint` gives them
        hparams = {named.name: saved}
    elif not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        # LightningCLI adds bookkeeping keys (`_class_path`, `_instantiator`) that are not constructor arguments.
        hparams = {k: v for k, v in saved.items() if k in params}
    try:
        model = cls(**hparams)
    except TypeError as e:
        # a plain `state_dict` file (or a module that never called `save_hyperparameters`) has no constructor arguments
        # to give: Python's message names neither the checkpoint nor a way out
        given = f"its `hyper_parameters` {sorted(saved)}" if saved else "no `hyper_parameters`"
        raise ValueError(
            f"`teacher_class` {cls.__name__} cannot be built from checkpoint {p!r}, which holds {given}: "
            f"{one_line(e)}. Save the teacher with `self.save_hyperparameters()` in its `__init__`, or build and load "
            "it yourself and pass the module as `teacher`."
        ) from e
    resize_to_state_dict(model, state)  # a structurally pruned teacher has smaller layers than a fresh one
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(
            f"`teacher` checkpoint {p!r} does not fit `teacher_class` {cls.__name__}: {one_line(e)}"
        ) from e
    return model
