"""LightningModules around the reference networks."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence, Sized
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info
from torch.optim.lr_scheduler import LRScheduler
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_accel._utils.checks import check_int, check_number
from lightning_accel.models.resnet import SmallResNet, _check_blocks
from lightning_accel.models.transformer import GPT
from lightning_accel.recipes.callbacks import bind_to_fit
from lightning_accel.recipes.lr import WarmupCosineLR

__all__ = ["ImageClassifier", "TinyGPT"]


class _ConstantLR(LRScheduler):
    """Each param group's base learning rate at every step: the default schedule of a fit with no step bound.

    Unlike torch's ``ConstantLR`` it returns the base rates rather than keeping whatever rate the optimizer holds, so a
    fit resumed from a checkpoint of a decayed schedule trains at ``lr`` again, and a rate scaled through the base
    rates (:class:`~lightning_accel.recipes.LinearScalingLR`) is followed.
    """

    @override
    def get_lr(self) -> list[float | torch.Tensor]:
        return list(self.base_lrs)


def _adamw_cosine(module: LightningModule, lr: float, weight_decay: float) -> Any:
    """AdamW + cosine decay to ``lr / 100`` over the whole fit (per step), the default both reference models use.

    The schedule is a :class:`~lightning_accel.recipes.lr.WarmupCosineLR` without warm-up (the cosine of torch's
    ``CosineAnnealingLR``, in closed form). Its length comes from the current fit, not from a checkpoint:
    ``configure_optimizers`` runs again on resume, and :func:`_bind_default_schedule` re-binds it at
    ``on_train_start``, after Lightning restored the checkpoint's scheduler state -- so an extended run (more
    ``max_epochs``) continues on the longer cosine, and a run resumed at another world size continues from the same
    progress fraction.

    A fit with no step bound has no length to decay over: only ``max_time``, or ``max_epochs=-1`` without
    ``max_steps`` (``trainer.estimated_stepping_batches`` is infinite), or a dataloader without a length and no
    ``max_steps`` (Lightning answers ``-1``, which used to end the cosine after one step). The learning rate then stays
    at ``lr`` for the whole fit (the default schedule has no warm-up), and one info line says so.
    """
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)
    try:  # `LightningModule.trainer` raises when no Trainer is attached (configure_optimizers called by hand)
        trainer = module.trainer if module.fabric is None else None  # under Fabric: a stand-in without the count
    except RuntimeError:
        trainer = None
    horizon = float(trainer.estimated_stepping_batches) if trainer is not None else 1000.0
    sched: LRScheduler
    if math.isinf(horizon) or horizon < 1:
        rank_zero_info(
            f"{type(module).__name__}: the fit has no step bound (`max_steps`, or `max_epochs` over a dataloader "
            f"with a length), so the learning rate stays at lr={lr:g} instead of following a cosine decay."
        )
        sched = _ConstantLR(opt)
    else:
        sched = WarmupCosineLR(opt, total_steps=max(1, int(horizon)), warmup_steps=0, min_lr=lr * 0.01)
    module.__dict__["_default_schedule"] = sched  # not an nn.Module attribute: kept out of state_dict/hparams
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _bind_default_schedule(module: LightningModule) -> None:
    """Re-bind the schedule :func:`_adamw_cosine` built to the current fit (at ``on_train_start``; see there)."""
    sched = module.__dict__.get("_default_schedule")
    if not isinstance(sched, WarmupCosineLR):
        return  # configure_optimizers replaced (LightningCLI `optimizer:`/`lr_scheduler:` blocks), or no step bound
    if any(cfg.scheduler is sched for cfg in module.trainer.lr_scheduler_configs):
        bind_to_fit(sched, module.trainer, sched.total_steps_arg)


def _datamodule_image_size(module: LightningModule) -> int | None:
    """The side of the images the attached data module yields (``image_size``, or its decoder's ``size``), or None."""
    try:
        dm = getattr(module.trainer, "datamodule", None)  # set by the data connector, not declared on the class
    except RuntimeError:  # no Trainer attached
        return None
    for value in (getattr(dm, "image_size", None), getattr(getattr(dm, "decode", None), "size", None)):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _integer_count(value: object) -> int | None:
    """``value`` as a Python int when it is an integer of any kind (``int``, a numpy integer, an integer tensor of one
    element), else None. A bool is not a count."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            return None
        return int(value.item())
    if isinstance(value, numbers.Integral):
        return int(value)
    return None


def _datamodule_num_classes(module: LightningModule, *, strict: bool = False) -> int | None:
    """The number of classes of the attached data module, or None when it does not say.

    Read in this order: a ``num_classes`` attribute (an integer: Python's, numpy's, or a one-element integer tensor
    such as ``labels.max() + 1``), then the length of a ``classes`` attribute (a list or tuple of names, a numpy array
    such as scikit-learn's ``LabelEncoder.classes_``, a ``{name: index}`` dict); both are public on
    :class:`~lightning_accel.data.CachedDataModule` after its ``setup``, which Lightning runs before the model's.

    Args:
        module: the LightningModule whose Trainer's data module is read.
        strict: the count sizes a head (``num_classes="auto"``): a ``num_classes`` that is not an integer, or a count
            below 2, is an error rather than "does not say" (None) or a count used as is.

    Raises:
        ValueError: with ``strict``, the data module's ``num_classes`` is not an integer >= 2 (and not None), or it
            lists fewer than 2 ``classes``: a classifier needs two classes at least.
    """
    try:
        dm = getattr(module.trainer, "datamodule", None)  # set by the data connector, not declared on the class
    except RuntimeError:  # no Trainer attached
        return None
    if dm is None:
        return None
    where = type(dm).__name__
    raw = getattr(dm, "num_classes", None)
    if raw is not None:
        n = _integer_count(raw)
        if strict and (n is None or n < 2):
            raise ValueError(
                f"`num_classes='auto'` needs a class count >= 2, but `{where}.num_classes` is {raw!r} "
                f"({type(raw).__name__}). Fix the data module's `num_classes`, or set an integer `num_classes`."
            )
        if n is not None and n > 0:
            return n
    classes = getattr(dm, "classes", None)
    if classes is None or isinstance(classes, (str, bytes)) or not isinstance(classes, Sized) or len(classes) == 0:
        return None
    if strict and len(classes) < 2:
        raise ValueError(
            f"`num_classes='auto'` needs two classes at least, but `{where}.classes` lists {len(classes)}: "
            f"{classes!r}. Check the data's class folders (or labels), or set an integer `num_classes`."
        )
    return len(classes)


def _as_indices(t: torch.Tensor, what: str) -> torch.Tensor:
    """Class labels or tokens as int64 indices: ``cross_entropy`` takes int64 targets only (int32 ones raise "expected
    target dtype to be Long or Byte"), and ``nn.Embedding`` no uint8/int16 ones, yet a dataset's numpy int32 or uint8
    labels (or tokens) collate as such.

    Raises:
        TypeError: ``t`` holds floats (or complex numbers): those are not indices, and rounding them would guess.
    """
    if t.dtype == torch.int64:
        return t
    if t.is_floating_point() or t.is_complex():
        raise TypeError(
            f"The batch's {what} must be integer indices, got a {t.dtype} tensor. Return them as integers from the "
            "dataset (e.g. `int(label)`, or `.long()`)."
        )
    return t.long()


def _check_optimizer_args(lr: object, weight_decay: object) -> None:
    """The AdamW arguments of this room's modules, checked when the module is built."""
    # finite: an infinite rate or decay turns every weight into NaN/inf at the first step
    check_number(
        "lr",
        lr,
        low=0,
        low_open=True,
        high=math.inf,
        high_open=True,
        fix="It is AdamW's peak learning rate, e.g. `lr=1e-3`.",
    )
    check_number("weight_decay", weight_decay, low=0, high=math.inf, high_open=True, fix="0 disables it.")


class ImageClassifier(LightningModule):
    """``SmallResNet`` trained with cross-entropy; logs ``train_loss``, ``val_loss``, ``val_acc``, ``test_acc``.

    Batches are ``(images, labels)`` with float images (N, C, H, W) and integer labels of any integer dtype (int32 or
    uint8 labels are widened to int64; float labels are refused). Uses AdamW with per-step cosine decay unless a
    LightningCLI ``optimizer:``/``lr_scheduler:`` block replaces ``configure_optimizers`` (a fit with no step bound,
    e.g. only ``max_time``, trains at a constant ``lr``: see :func:`_adamw_cosine`).

    Several validation or test dataloaders are evaluated separately: each has its own accuracy metric, and Lightning
    logs its values as ``val_acc/dataloader_idx_<i>`` (``val_loss/...``, ``test_acc/...`` likewise); with one
    dataloader the names are the plain ones above.

    ``num_classes="auto"`` takes the class count from the Trainer's data module in ``setup`` (its ``num_classes``: an
    int, a numpy integer or a one-element integer tensor; or ``len(classes)``; ``CachedDataModule`` has both after
    ``setup``) and sizes the head there, identically on
    every rank (the body exists from ``__init__``; calling the model before ``setup`` raises rather than use a
    provisional head); ``hparams.num_classes`` then holds the resolved integer, so checkpoints restore with
    ``ImageClassifier.load_from_checkpoint`` without a data module. An integer builds the network in ``__init__``; a
    data module with more classes than that is refused in ``setup``, before the first step.

    Args:
        num_classes: number of classes, or ``"auto"`` (follow the data module; it must say how many).
        width: channels of the first stage.
        blocks: blocks per stage, each at least 1 (its length is the number of stages).
        lr: peak learning rate.
        weight_decay: AdamW weight decay.

    Raises:
        TypeError: an argument of the wrong type, naming it.
        ValueError: an argument out of range, naming it.
    """

    def __init__(
        self,
        num_classes: int | Literal["auto"] = 10,
        width: int = 32,
        blocks: Sequence[int] = (1, 1, 1),
        lr: float = 3e-3,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        if num_classes != "auto":
            check_int("num_classes", num_classes, low=2, fix="Or pass 'auto' to follow the data module.")
        _check_blocks(blocks)  # not rebound: save_hyperparameters keeps the value as given (a YAML list)
        _check_optimizer_args(lr, weight_decay)
        self.save_hyperparameters()
        # "auto": the body is built now (callbacks that look at `model` in their own `setup`, which Lightning runs
        # before this module's, find it), with a provisional 2-way head that `setup` replaces before any use.
        self._head_pending = num_classes == "auto"
        self._auto = self._head_pending  # for messages: the head's size came from the data, not the argument
        n = 2 if num_classes == "auto" else num_classes
        self.model = SmallResNet(num_classes=n, width=width, blocks=tuple(blocks))
        self.val_acc = MulticlassAccuracy(num_classes=n)
        self.test_acc = MulticlassAccuracy(num_classes=n)
        # the accuracy of validation/test dataloaders 1, 2, ... (`val_1`, `test_2`), made at their first batch: one
        # metric shared by all loaders would mix their counts. Metric states are not saved: no state_dict entries.
        self.extra_acc = torch.nn.ModuleDict()
        self.example_input_array = torch.zeros(2, 3, 64, 64)  # until `setup` sees the data's image size

    def _build_head(self, num_classes: int) -> None:
        """Give the network a ``num_classes``-way head (and metrics) and record the count in ``hparams``.

        ``hparams.num_classes`` is what a checkpoint saves, so a resolved "auto" restores as a plain integer.
        """
        self.hparams["num_classes"] = num_classes
        fc = self.model.fc
        if fc.out_features != num_classes:
            # Resized in place, not replaced: the head's parameters stay the same objects, so an optimizer built before
            # `setup` trains this head. LightningCLI's `optimizer:` block builds it from the provisional head's
            # parameters when it parses the config; with a new `nn.Linear` it kept training that orphan while the
            # real head stayed at its initial values.
            fresh = torch.nn.Linear(fc.in_features, num_classes, device=fc.weight.device, dtype=fc.weight.dtype)
            with torch.no_grad():
                fc.weight.data = fresh.weight.data
                if fc.bias is not None and fresh.bias is not None:
                    fc.bias.data = fresh.bias.data
            fc.out_features = num_classes
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)
        self.test_acc = MulticlassAccuracy(num_classes=num_classes)
        self.extra_acc = torch.nn.ModuleDict()
        self._head_pending = False

    def _accuracy(self, stage: str, dataloader_idx: int, device: torch.device) -> tuple[MulticlassAccuracy, str]:
        """``stage``'s (``"val"`` / ``"test"``) accuracy metric for dataloader ``dataloader_idx`` and its attribute
        path (the ``metric_attribute`` Lightning asks for: a metric made after its first lookup of the module's
        metrics would not be found)."""
        if dataloader_idx == 0:
            return getattr(self, f"{stage}_acc"), f"{stage}_acc"
        key = f"{stage}_{dataloader_idx}"
        if key not in self.extra_acc:
            self.extra_acc[key] = MulticlassAccuracy(num_classes=self.hparams["num_classes"]).to(device)
        metric = self.extra_acc[key]
        assert isinstance(metric, MulticlassAccuracy)
        return metric, f"extra_acc.{key}"

    @override
    def setup(self, stage: str) -> None:
        """Size the head for ``num_classes="auto"``, check the data fits the head, size ``example_input_array``.

        The data module's ``setup`` has run (Lightning calls it first), so its class count is known here; every rank
        reads the same listing and builds the same head before DDP wraps the model and the optimizer is created.

        Without a data module that tells the count, the head is left to a checkpoint (``ckpt_path``), restored after
        this hook; a run with neither stops at its start, before any batch (:meth:`_require_head`).

        Raises:
            ValueError: ``num_classes="auto"`` and the data module says a count that is not an integer >= 2; or the
                data has more classes than an integer ``num_classes``.
        """
        n_data = _datamodule_num_classes(self, strict=self._head_pending)
        if self._head_pending:
            if n_data is None:
                # `test(model, dataloaders=..., ckpt_path=...)`: a checkpoint, restored after `setup` (Lightning does
                # not tell `setup` whether one comes), sizes the head in `on_load_checkpoint`; without one the run
                # stops at its start (`_require_head`), before any batch
                return
            self._build_head(n_data)
        elif n_data is not None and n_data > self.hparams["num_classes"]:
            raise ValueError(
                f"`num_classes` is {self.hparams['num_classes']} but the data module has {n_data} classes: the "
                f"labels would overflow the model's output. Set `num_classes: auto` (or `num_classes: {n_data}`)."
            )
        size = _datamodule_image_size(self)
        if size is not None:
            self.example_input_array = torch.zeros(2, 3, size, size)

    def _require_head(self) -> None:
        """Stop a run whose ``"auto"`` head neither the data module nor a checkpoint sized (called at the start of
        every loop, after the checkpoint restore).

        Raises:
            ValueError: the head is still unsized.
        """
        if self._head_pending:
            raise ValueError(
                "`num_classes='auto'` needs a data module that tells its class count (`num_classes` or `classes`, "
                "e.g. lightning_accel.data.CachedDataModule) or a checkpoint to take it from; pass the data as "
                "`datamodule=`, a `ckpt_path`, or set an integer `num_classes`."
            )

    @override
    def on_fit_start(self) -> None:
        self._require_head()

    @override
    def on_validation_start(self) -> None:
        self._require_head()

    @override
    def on_test_start(self) -> None:
        self._require_head()

    @override
    def on_predict_start(self) -> None:
        self._require_head()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """An unresolved ``"auto"`` head (no ``setup`` ran) takes the checkpoint's class count before the load; a head
        already sized for another count is refused in one line (torch's ``load_state_dict`` would list every
        mismatched tensor over several lines, without saying which argument or data set made the counts differ).

        Raises:
            ValueError: the checkpoint's head has another number of classes than this model's.
        """
        head = checkpoint.get("state_dict", {}).get("model.fc.weight")
        if not isinstance(head, torch.Tensor) or head.dim() != 2:
            return  # a checkpoint without a plain head tensor (another layout): the load decides
        n_ckpt = int(head.shape[0])
        if self._head_pending:
            self._build_head(n_ckpt)
            return
        n_model = getattr(self.model.fc, "out_features", None)  # a surgery may have replaced the Linear
        if isinstance(n_model, int) and n_ckpt != n_model:
            raise ValueError(
                f"The checkpoint was trained on {n_ckpt} classes, but this `ImageClassifier` has {n_model} outputs "
                f"({'`num_classes=auto` read from the data module' if self._auto else f'`num_classes={n_model}`'}). "
                f"Resume on data with the checkpoint's {n_ckpt} classes, or set `num_classes: {n_ckpt}`."
            )

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._head_pending:  # the provisional head would answer with 2 classes: never let it be used
            raise RuntimeError(
                "`ImageClassifier(num_classes='auto')` sizes its head in `setup()`, from the data module; "
                "run it through a Trainer with `datamodule=`, or pass an integer `num_classes`."
            )
        return self.model(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if x.shape[0] == 0:
            # every sample failed to decode (`on_decode_error="skip"`): nothing to learn, but the step still runs on
            # every rank (DDP averages gradients each step), so return a zero loss that reaches every parameter
            return self(x).sum() * 0.0
        y = _as_indices(y, "labels")
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        if x.shape[0] == 0:  # an empty batch (see training_step) has no accuracy; the metrics sync at epoch end
            return
        y = _as_indices(y, "labels")
        logits = self(x)
        acc, attribute = self._accuracy("val", dataloader_idx, logits.device)
        acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", acc, prog_bar=True, metric_attribute=attribute)

    @override
    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        if x.shape[0] == 0:
            return
        y = _as_indices(y, "labels")
        logits = self(x)
        acc, attribute = self._accuracy("test", dataloader_idx, logits.device)
        acc(logits, y)
        self.log("test_acc", acc, metric_attribute=attribute)

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(x).argmax(dim=1)

    @override
    def configure_optimizers(self) -> Any:
        return _adamw_cosine(self, self.hparams["lr"], self.hparams["weight_decay"])

    @override
    def on_train_start(self) -> None:
        _bind_default_schedule(self)


class TinyGPT(LightningModule):
    """``GPT`` trained on next-token prediction; batches are integer token tensors (B, T) or ``(tokens, ...)`` tuples
    (int64, or a narrower integer dtype such as a uint16/int32 token file's, widened to int64).

    Logs ``train_loss`` and ``val_loss`` (``val_loss/dataloader_idx_<i>`` per loader with several validation
    dataloaders). Pairs with :func:`lightning_accel.datasets.digits_tokens`. The optimizer and schedule are
    :class:`ImageClassifier`'s (a fit with no step bound trains at a constant ``lr``).
    """

    def __init__(
        self,
        vocab_size: int = 27,
        block_size: int = 65,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.1,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        _check_optimizer_args(lr, weight_decay)
        self.save_hyperparameters()
        self.model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: Any) -> torch.Tensor:
        """Mean next-token cross-entropy: the model reads ``tokens[:, :-1]`` and predicts ``tokens[:, 1:]``.

        Raises:
            ValueError: the tokens are not (B, T) with 2 <= T <= ``block_size + 1`` (a sequence of one token has no
                next token to predict; it used to stop in the attention with "cannot reshape tensor of 0 elements").
        """
        tokens = _as_indices(batch[0] if isinstance(batch, (list, tuple)) else batch, "tokens")
        longest = self.hparams["block_size"] + 1
        if tokens.dim() != 2 or not 2 <= tokens.shape[1] <= longest:
            raise ValueError(
                f"`TinyGPT` trains on batches of token sequences (B, T) with 2 <= T <= block_size + 1 = {longest} (it "
                f"predicts tokens[:, 1:] from tokens[:, :-1]), got shape {tuple(tokens.shape)}. Batch sequences of "
                f"that length, or set `block_size` to T - 1."
            )
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    @override
    def configure_optimizers(self) -> Any:
        return _adamw_cosine(self, self.hparams["lr"], self.hparams["weight_decay"])

    @override
    def on_train_start(self) -> None:
        _bind_default_schedule(self)
