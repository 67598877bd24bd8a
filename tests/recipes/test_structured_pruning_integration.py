"""Trainer-level tests of StructuredPruning: mid-fit surgery with a live optimizer and schedule, resume, DDP."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_accel.callbacks import StructuredPruning
from lightning_accel.models import TinyGPT
from lightning_accel.recipes.prune import batch_norms, count_parameters, recalibrate_batchnorm
from tests.helpers import run_in_processes
from tests.tiny import classifier, loader, trainer


class _OptimizerMatchesModel(Callback):
    """After every optimizer step: the optimizer holds exactly the model's parameters, with state of their shape."""

    def __init__(self) -> None:
        self.checked = 0
        self.sizes: list[int] = []

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, _: int
    ) -> None:
        opt = trainer.optimizers[0]
        in_opt = [p for g in opt.param_groups for p in g["params"]]
        params = list(pl_module.parameters())
        assert len(in_opt) == len(params) and all(a is b for a, b in zip(in_opt, params, strict=True))
        for p in params:
            for v in opt.state[p].values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    assert v.shape == p.shape
        assert torch.isfinite(outputs["loss"])
        self.sizes.append(count_parameters(pl_module))
        self.checked += 1


def test_prunes_mid_fit_and_keeps_optimizer_and_schedule() -> None:
    check = _OptimizerMatchesModel()
    cb = StructuredPruning(amount=0.5, schedule=1)
    model = classifier(width=8)
    full = count_parameters(model)
    t = trainer(callbacks=[cb, check], max_epochs=2, limit_train_batches=3)
    t.fit(model, loader())
    assert check.checked == 6
    assert check.sizes[:3] == [full] * 3 and check.sizes[3] < 0.35 * full  # pruned at the start of epoch 1
    assert cb.done == [1] and cb.history[0]["params_before"] == full
    assert model.model.layers[0].conv1.out_channels == 4 and model.model.fc.in_features == 16
    sched = t.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 6  # the cosine schedule kept its position (rebuilding would restart it)


def test_iterative_schedule_reaches_the_amount() -> None:
    cb = StructuredPruning(amount=0.5, schedule=[0, 1], norm="l2")
    model = classifier(width=8)
    trainer(callbacks=[cb], max_epochs=2, limit_train_batches=1).fit(model, loader())
    assert [h["epoch"] for h in cb.history] == [0, 1]
    assert model.model.layers[1].conv1.out_channels == 8  # 16 -> 12 (25 %) -> 8 (50 % of the original)


class _CopyAtFirstBatch(Callback):
    """Copies the network at the first training batch, after StructuredPruning (listed before it) pruned it."""

    def __init__(self) -> None:
        self.copy: torch.nn.Module | None = None
        self.batch: Any = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.copy is None:
            self.copy = copy.deepcopy(pl_module.model)  # the SmallResNet (not the module, which holds the trainer)
            self.batch = batch


@pytest.mark.parametrize("evaluated", [False, True])
def test_bn_statistics_are_rebuilt_after_pruning(evaluated: bool) -> None:
    grab = _CopyAtFirstBatch()
    cb = StructuredPruning(amount=0.5, schedule=0)
    model = classifier(width=8)
    with torch.no_grad():  # statistics of the unpruned network on other data: stale once pruned
        model.train()
        model(torch.randn(32, 3, 8, 8) * 3 + 2)
    if evaluated:
        model.model.eval()  # e.g. evaluated before the fit: Lightning keeps the mode, the callback switches it back
    ctx = pytest.warns(UserWarning, match="was in eval mode") if evaluated else contextlib.nullcontext()
    with ctx:
        trainer(callbacks=[cb, grab], max_epochs=1, limit_train_batches=1).fit(model, loader())
    assert grab.copy is not None and all(m.training for m in grab.copy.modules())
    norms, expected = batch_norms(grab.copy), batch_norms(copy.deepcopy(grab.copy))
    recalibrate_batchnorm(grab.copy, [grab.batch[0]])  # the pruned network's own statistics on the pruning batch
    assert len(norms) == len(expected) == 10
    for bn, ref in zip(norms, expected, strict=True):  # the callback had already rebuilt exactly these
        assert torch.allclose(bn.running_mean, ref.running_mean, atol=1e-6)
        assert torch.allclose(bn.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
        assert bn.momentum == 0.1


def test_bn_statistics_and_modes_left_alone_when_asked() -> None:
    grab = _CopyAtFirstBatch()
    model = classifier(width=8)
    with torch.no_grad():
        model.train()
        model(torch.randn(32, 3, 8, 8) * 3 + 2)
    stale = model.model.layers[2].bn2.running_mean.clone()
    model.model.eval()  # frozen on purpose: kept frozen
    cb = StructuredPruning(amount=0.5, schedule=0, recalibrate_bn=False, train_mode=False)
    trainer(callbacks=[cb, grab], max_epochs=1, limit_train_batches=1).fit(model, loader())
    assert grab.copy is not None and not any(bn.training for bn in batch_norms(grab.copy))
    kept = grab.copy.layers[2].bn2.running_mean
    assert kept.shape[0] == stale.shape[0] // 2 and all(any(torch.isclose(v, stale)) for v in kept)  # sliced only


def test_resume_from_a_pruned_checkpoint(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    model = classifier(width=8)
    trainer(
        callbacks=[StructuredPruning(0.5, schedule=0), ckpt], enable_checkpointing=True, default_root_dir=tmp_path
    ).fit(model, loader())
    pruned = count_parameters(model)
    fresh = classifier(width=8)  # full size: the callback resizes it to the checkpoint before the weights load
    cb = StructuredPruning(0.5, schedule=0)
    t = trainer(callbacks=[cb], max_epochs=2)
    t.fit(fresh, loader(), ckpt_path=tmp_path / "last.ckpt")
    assert count_parameters(fresh) == pruned  # not pruned a second time
    assert cb.done == [0] and len(cb.history) == 1


def test_a_later_fit_of_a_fresh_module_is_pruned_and_the_pruned_one_is_not_pruned_twice(tmp_path: Path) -> None:
    # the epochs pruned in the first fit were kept: the second model trained unpruned, without a word
    cb = StructuredPruning(0.5, schedule=0)
    first, second = classifier(width=8), classifier(width=8)
    full = count_parameters(first)
    trainer(callbacks=[cb], limit_train_batches=2).fit(first, loader())
    pruned = count_parameters(first)
    assert pruned < 0.35 * full
    trainer(callbacks=[cb], limit_train_batches=2).fit(second, loader())
    assert count_parameters(second) == pruned and cb.done == [0] and len(cb.history) == 1
    trainer(callbacks=[cb], limit_train_batches=2).fit(second, loader())  # the same, already pruned module
    assert count_parameters(second) == pruned and cb.done == [0]
    # resuming a fresh module with the same callback restores the pruned epochs instead of pruning again
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(callbacks=[cb, ckpt], enable_checkpointing=True, default_root_dir=tmp_path).fit(
        classifier(width=8), loader()
    )
    fresh = classifier(width=8)
    trainer(callbacks=[cb], max_epochs=2).fit(fresh, loader(), ckpt_path=tmp_path / "last.ckpt")
    assert count_parameters(fresh) == pruned and cb.done == [0] and len(cb.history) == 1


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("64-true", torch.float64)])
@pytest.mark.parametrize("target", [None, "model"])
def test_a_true_precision_traces_with_converted_example_inputs(
    precision: str, dtype: torch.dtype, target: str | None
) -> None:
    # `example_input_array` (float32) was traced against the converted (bf16 / fp64) module: a raw torch.fx ShapeProp
    # error at the first batch
    model = classifier(width=8)
    check = _OptimizerMatchesModel()
    cb = StructuredPruning(0.5, schedule=0, target=target)
    trainer(precision=precision, callbacks=[cb, check], limit_train_batches=2).fit(model, loader())
    assert model.model.layers[0].conv1.out_channels == 4 and check.checked == 2
    assert {p.dtype for p in model.parameters()} == {dtype}


def test_two_pruning_callbacks_share_a_trainer_and_its_checkpoints(tmp_path: Path) -> None:
    # both were keyed "StructuredPruning": Lightning refused the second stateful callback of the type at fit start
    def callbacks() -> list[StructuredPruning]:
        return [StructuredPruning(0.5, schedule=0, target="model.layers"), StructuredPruning(0.25, schedule=1)]

    model = classifier(width=8)
    first = callbacks()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(max_epochs=2, callbacks=[*first, ckpt], enable_checkpointing=True, default_root_dir=tmp_path).fit(
        model, loader()
    )
    assert [cb.done for cb in first] == [[0], [1]]
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]
    assert [saved[cb.state_key]["done"] for cb in first] == [[0], [1]]
    fresh, again = classifier(width=8), callbacks()
    trainer(max_epochs=3, callbacks=again).fit(fresh, loader(), ckpt_path=tmp_path / "last.ckpt")
    assert [cb.done for cb in again] == [[0], [1]]  # each restored its own epochs: nothing pruned twice
    assert count_parameters(fresh) == count_parameters(model)


def test_a_checkpoint_keyed_by_the_class_name_still_restores(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    model = classifier(width=8)
    cb = StructuredPruning(0.5, schedule=0)
    trainer(callbacks=[cb, ckpt], enable_checkpointing=True, default_root_dir=tmp_path).fit(model, loader())
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)
    state["callbacks"] = {"StructuredPruning": state["callbacks"].pop(cb.state_key), **state["callbacks"]}
    torch.save(state, tmp_path / "old.ckpt")  # as written before the key named the target and schedule
    fresh, again = classifier(width=8), StructuredPruning(0.5, schedule=0)
    trainer(max_epochs=2, callbacks=[again]).fit(fresh, loader(), ckpt_path=tmp_path / "old.ckpt")
    assert again.done == [0] and count_parameters(fresh) == count_parameters(model)


def test_ignore_modules_and_its_deprecated_spelling() -> None:
    assert StructuredPruning(ignore_modules=["model.stem"]).ignore_modules == ("model.stem",)
    with pytest.warns(DeprecationWarning, match="`ignore` is deprecated; use `ignore_modules` \\(same values\\)"):
        cb = StructuredPruning(ignore=["model.stem"])
    assert cb.ignore_modules == ("model.stem",)
    with pytest.raises(ValueError, match="pass only `ignore_modules`"):
        StructuredPruning(ignore_modules=["a"], ignore=["b"])


def test_ignore_modules_takes_one_name_and_an_unknown_name_fails_at_setup() -> None:
    assert StructuredPruning(ignore_modules="model.stem").ignore_modules == ("model.stem",)
    cb = StructuredPruning(0.5, ignore_modules=["model.stme"])
    with pytest.raises(
        ValueError, match=r"`ignore_modules` names modules that ImageClassifier does not have: \['model.stme'\]"
    ):
        trainer(callbacks=[cb]).fit(classifier(), loader())
    assert cb.done == []


def test_one_ignored_module_name_from_lightningcli_yaml(tmp_path: Path) -> None:
    from lightning_accel.cli import AccelCLI

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  logger: false\n"
        "  callbacks:\n"
        "    - class_path: lightning_accel.StructuredPruning\n"
        "      init_args: {amount: 0.5, ignore_modules: model.stem}\n"
        "model:\n"
        "  class_path: lightning_accel.models.ImageClassifier\n"
        "data:\n"
        "  class_path: tests.tiny.TinyDigits\n"
    )
    cli = AccelCLI(args=["--config", str(cfg)], run=False)  # the YAML's one name, as the Python call takes it
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, StructuredPruning)]  # type: ignore[attr-defined]
    assert cb.ignore_modules == ("model.stem",)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`amount` must be a number >= 0 and < 1, got 1.0"):
        StructuredPruning(amount=1.0)
    with pytest.raises(ValueError, match="`schedule` must be an integer >= 0, got -1. It holds epoch indices"):
        StructuredPruning(schedule=-1)
    with pytest.raises(TypeError, match="`schedule` must be an integer >= 0, got True \\(bool\\)"):
        StructuredPruning(schedule=[1, True])
    with pytest.raises(
        ValueError, match="`schedule` must be an epoch index >= 0 or a non-empty list of them, got \\[\\]"
    ):
        StructuredPruning(schedule=[])
    with pytest.raises(ValueError, match="`schedule` has repeated epochs"):
        StructuredPruning(schedule=[1, 1])
    with pytest.raises(TypeError, match="`round_to`"):
        StructuredPruning(round_to=False)
    with pytest.raises(ValueError, match="`norm`"):
        StructuredPruning(norm="l0")
    with pytest.raises(ValueError, match="`target` 'nope'"):
        trainer(callbacks=[StructuredPruning(target="nope")]).fit(classifier(), loader())
    # refused when the callback is built, each naming the argument, not at setup or through bool()
    with pytest.raises(TypeError, match="`target` must be the dotted name of a submodule .* got 3 \\(int\\)"):
        StructuredPruning(target=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`ignore_modules` must be a module name or a list of them .* got 5 \\(int\\)"):
        StructuredPruning(ignore_modules=5)  # type: ignore[arg-type]
    for flag in ("fold_bn", "recalibrate_bn", "train_mode"):
        with pytest.raises(TypeError, match=f"`{flag}` must be True or False, got 'false' \\(str\\)"):
            StructuredPruning(**{flag: "false"})


class _StemThenBody(LightningModule):
    """``forward`` = ``body(stem(x))``: the body takes the stem's 8 channels, not the 3-channel images."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 8, 1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 10),
        )

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.relu(self.stem(x)))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_a_target_after_a_stem_is_traced_with_its_own_inputs() -> None:
    # `target` used to be traced with the LightningModule's inputs (3-channel images), which the body's first conv
    # (8 input channels) cannot take: a raw torch.fx ShapeProp error at the first batch
    model = _StemThenBody()
    bn = model.body[1]
    check = _OptimizerMatchesModel()
    trainer(callbacks=[StructuredPruning(0.5, target="body"), check], limit_train_batches=2).fit(model, loader())
    assert model.body[0].out_channels == 8 and model.body[3].in_channels == 8 and check.checked == 2
    assert model.stem.out_channels == 8  # outside the target: untouched
    assert int(bn.num_batches_tracked) > 0 and model.training  # trained on, and the modes came back


class _NoForward(LightningModule):
    """No ``forward``: ``training_step`` calls the network itself (the target takes the batch's inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = classifier(width=8).model

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_a_target_of_a_module_without_forward_takes_the_batch_inputs() -> None:
    model = _NoForward()
    trainer(callbacks=[StructuredPruning(0.5, target="net")], limit_train_batches=2).fit(model, loader())
    assert model.net.layers[0].conv1.out_channels == 4


def _ddp_prune(rank: int, world_size: int) -> dict[str, Any]:
    import lightning.pytorch as pl

    pl.seed_everything(0)
    model = classifier(width=8)
    cb = StructuredPruning(amount=0.5, schedule=1)
    t = trainer(devices=2, strategy="ddp", max_epochs=2, limit_train_batches=2, callbacks=[cb])
    t.fit(model, loader(batch_size=16, shuffle=True))
    return {
        "params": count_parameters(model),
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
        "done": cb.done,
    }


@pytest.mark.slow
def test_ddp_two_processes() -> None:
    r0, r1 = run_in_processes(_ddp_prune, 2, init_process_group=False, timeout=240)
    assert r0["done"] == r1["done"] == [1]
    assert r0["params"] == r1["params"] < count_parameters(classifier(width=8)) * 0.35
    assert torch.allclose(torch.tensor(r0["weights"]), torch.tensor(r1["weights"]))  # still one model after re-wrap


@pytest.mark.gpu
def test_prunes_on_the_gpu() -> None:
    check = _OptimizerMatchesModel()
    model = classifier(width=8)
    trainer(accelerator="gpu", callbacks=[StructuredPruning(0.5, schedule=0), check], limit_train_batches=2).fit(
        model, loader()
    )
    assert check.checked == 2 and next(model.parameters()).is_cuda
    assert model.model.layers[0].conv1.out_channels == 4


class _RankOwnStatistics(Callback):
    """Before epoch 1's pruning batch, rank 1 gets BatchNorm statistics of its own (each rank updates its statistics
    from its own batches after DDP's broadcast, so they always differ a little; here, enough to rank channels apart)."""

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 1 and batch_idx == 0 and trainer.global_rank == 1:
            g = torch.Generator().manual_seed(5)
            for bn in batch_norms(pl_module):
                bn.running_var.copy_(torch.rand(bn.running_var.shape, generator=g) * 4 + 0.1)


def _ddp_prune_folded(rank: int, world_size: int) -> dict[str, Any]:
    import lightning.pytorch as pl

    pl.seed_everything(0)
    model = classifier(width=8)
    callbacks = [_RankOwnStatistics(), StructuredPruning(amount=0.5, schedule=1, fold_bn=True)]
    t = trainer(devices=2, strategy="ddp", max_epochs=2, limit_train_batches=2, callbacks=callbacks)
    t.fit(model, loader(batch_size=16, shuffle=True))
    opt = t.optimizers[0]
    return {
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
        "exp_avg": torch.cat([opt.state[p]["exp_avg"].flatten() for p in model.parameters()]).tolist(),
    }


@pytest.mark.slow
def test_ddp_ranks_keep_the_same_channels_with_folded_norms() -> None:
    # `fold_bn` ranked on each rank's own running statistics: the ranks kept different channels, DDP's re-wrap copied
    # rank 0's weights but each rank sliced its Adam moments with its own indices, and the replicas drifted apart
    r0, r1 = run_in_processes(_ddp_prune_folded, 2, init_process_group=False, timeout=240)
    assert torch.equal(torch.tensor(r0["exp_avg"]), torch.tensor(r1["exp_avg"]))
    assert torch.equal(torch.tensor(r0["weights"]), torch.tensor(r1["weights"]))


class _RanksDisagree(Callback):
    """At epoch 1's pruning batch (placed before StructuredPruning): the ranks' weights rank the channels in opposite
    orders (what drift between syncs does under local steps, exaggerated), and every optimizer state tensor of a
    parameter holds its output-channel index, so what each rank kept shows in its sliced state afterwards."""

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch != 1 or batch_idx != 0:
            return
        opt = trainer.optimizers[0]
        with torch.no_grad():
            for p in pl_module.parameters():
                if p.dim() != 4:
                    continue
                n = p.shape[0]
                order = torch.arange(1, n + 1, dtype=p.dtype)
                scale = order if trainer.global_rank == 0 else order.flip(0)
                p.copy_(p.sign() * scale.view(-1, 1, 1, 1))
                for t in opt.state[p].values():
                    if isinstance(t, torch.Tensor) and t.shape == p.shape:
                        t.copy_(torch.arange(n, dtype=t.dtype).view(-1, 1, 1, 1).expand_as(t))


class _KeptChannels(Callback):
    """After the pruning (placed after StructuredPruning): the output channels each conv kept, read from its state."""

    def __init__(self) -> None:
        self.kept: list[list[int]] = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch != 1 or batch_idx != 0:
            return
        opt = trainer.optimizers[0]
        for p in pl_module.parameters():
            if p.dim() == 4:
                t = next(v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.shape == p.shape)
                self.kept.append([int(c) for c in t[:, 0, 0, 0]])


def _prune_where_ranks_disagree(rank: int, world_size: int, strategy: str) -> list[list[int]]:
    import lightning.pytorch as pl

    pl.seed_everything(0)
    model = classifier(width=8)
    kept = _KeptChannels()
    callbacks = [_RanksDisagree(), StructuredPruning(amount=0.5, schedule=1), kept]
    t = trainer(devices=2, strategy=strategy, max_epochs=2, limit_train_batches=2, callbacks=callbacks)
    t.fit(model, loader(batch_size=16, shuffle=True))
    return kept.kept


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "diloco"])
def test_ranks_whose_weights_differ_keep_rank_0s_channels(strategy: str) -> None:
    # each rank ranked its own weights and sliced its optimizer state with its own indices: under local steps
    # (weights differ between syncs) the ranks kept different channels while the re-wrap gave them rank 0's weights
    r0, r1 = run_in_processes(_prune_where_ranks_disagree, 2, (strategy,), init_process_group=False, timeout=240)
    assert r0 == r1
    # rank 0's weights grow with the channel index: each conv kept a top range of its channels (all of them when not
    # pruned); rank 1's own ranking would have kept the bottom ones
    assert r0 and all(k == list(range(k[0], k[0] + len(k))) for k in r0)
    assert any(k[0] > 0 for k in r0)


def test_scheduled_epochs_the_fit_never_runs_are_reported(tmp_path: Path) -> None:
    model = classifier(width=8)
    before = count_parameters(model)
    with pytest.warns(UserWarning, match=r"`schedule` epochs \[3\] are not reached with `max_epochs=2`"):
        trainer(callbacks=[StructuredPruning(0.5, schedule=[1, 3])], max_epochs=2).fit(model, loader())
    assert count_parameters(model) < before  # epoch 1 pruned; the warning is about epoch 3 only

    # a plain run's checkpoint resumed with pruning at epoch 0 added: the fit starts at epoch 1
    plain = trainer()
    plain.fit(classifier(width=8), loader())
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    resumed = classifier(width=8)
    with pytest.warns(UserWarning, match=r"`schedule` epochs \[0\] come before epoch 1, where this fit starts"):
        trainer(callbacks=[StructuredPruning(0.5, schedule=0)], max_epochs=2).fit(
            resumed, loader(), ckpt_path=tmp_path / "plain.ckpt"
        )
    assert count_parameters(resumed) == before


@pytest.mark.parametrize(
    ("target", "what", "inside"),
    [("model", "`target` 'model' (GPT)", "'model.blocks'"), (None, "the LightningModule (TinyGPT)", "['model']")],
)
def test_an_untraceable_module_names_the_target_and_submodules_to_try(
    target: str | None, what: str, inside: str
) -> None:
    tokens = DataLoader(TensorDataset(torch.randint(0, 27, (16, 17))), batch_size=8)
    model = TinyGPT(n_layer=1, n_embd=32)  # its forward checks the sequence length: data-dependent control flow
    with pytest.raises(TypeError, match="could not trace") as info:
        trainer(callbacks=[StructuredPruning(0.25, target=target)], limit_train_batches=1).fit(model, tokens)
    message = str(info.value)
    assert f"could not trace {what} with torch.fx" in message and inside in message
    assert "e.g. `target='model'`" not in message  # not the advice to pass the `target` already given
