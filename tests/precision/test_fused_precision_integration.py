"""FusedPrecision inside a Trainer: 30 steps against MixedPrecision (tiny CNN and tiny transformer), GradScaler state
through a checkpoint, and DDP (gloo, 2 processes) doing the surgery in place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import ImageClassifier, TinyGPT
from lightning_accel.precision import FusedPrecision
from lightning_accel.precision.modules import FusedAttentionMixin, FusedBasicBlockMixin, is_fused
from tests.helpers import run_in_processes

STEPS = 30


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _image_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (128,), generator=g)
    x = torch.randn(128, 3, 8, 8, generator=g) * 0.5 + y[:, None, None, None] * 0.3  # learnable
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def _token_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 11, (128, 1), generator=g)
    tokens = (start + torch.arange(17)) % 11  # counting sequences: learnable
    return DataLoader(TensorDataset(tokens), batch_size=8, shuffle=False)


def _fit(model: L.LightningModule, loader: DataLoader, plugin: Any, tmp_path: Path, **kw: Any) -> list[float]:
    rec = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        plugins=[plugin],
        callbacks=[rec],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kw,
    )
    trainer.fit(model, loader)
    return rec.losses


def _compare(losses: list[float], ref: list[float]) -> None:
    assert len(losses) == len(ref) == STEPS
    for i, (a, b) in enumerate(zip(losses, ref, strict=True)):
        # bf16 autocast: the two runs round differently, so they drift apart slowly; 30 steps stay within 5 %
        assert abs(a - b) <= 0.05 * abs(b) + 0.02, f"step {i}: fused {a:.4f} vs eager {b:.4f}"
    assert sum(losses[-5:]) < sum(losses[:5])  # and it learns


def test_cnn_30_steps_match_mixed_precision(tmp_path: Path) -> None:
    torch.manual_seed(0)
    losses_ref = _fit(
        ImageClassifier(num_classes=4, width=8, blocks=(1, 1)),
        _image_loader(),
        MixedPrecision("bf16-mixed", "cpu"),
        tmp_path,
    )
    torch.manual_seed(0)
    model = ImageClassifier(num_classes=4, width=8, blocks=(1, 1))
    plugin = FusedPrecision("bf16-mixed", device="cpu", backend="reference")  # exercise the fused functions
    losses = _fit(model, _image_loader(), plugin, tmp_path)
    assert is_fused(model.model.layers[0], FusedBasicBlockMixin)
    assert plugin.report is not None and plugin.report.counts() == {"conv_bn_relu": 5}
    _compare(losses, losses_ref)


def test_transformer_30_steps_match_mixed_precision(tmp_path: Path) -> None:
    kw = dict(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0, lr=3e-3)
    torch.manual_seed(0)
    losses_ref = _fit(TinyGPT(**kw), _token_loader(), MixedPrecision("bf16-mixed", "cpu"), tmp_path)
    torch.manual_seed(0)
    model = TinyGPT(**kw)
    plugin = FusedPrecision("bf16-mixed", device="cpu", backend="reference")  # exercise the fused functions
    losses = _fit(model, _token_loader(), plugin, tmp_path)
    assert plugin.report is not None and plugin.report.counts() == {"linear_dropout": 2, "qkv": 2, "norm": 5}
    _compare(losses, losses_ref)


class _ScaleProbe(Callback):
    def __init__(self) -> None:
        self.scale_at_start: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.scale_at_start = trainer.precision_plugin.scaler.get_scale()


def test_grad_scaler_state_saved_and_restored(tmp_path: Path) -> None:
    kw = dict(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
    plugin = FusedPrecision(
        "16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    )
    trainer = L.Trainer(
        accelerator="cpu", max_steps=6, plugins=[plugin], logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(TinyGPT(**kw), _token_loader())
    scale = plugin.scaler.get_scale()
    assert scale != 2.0**10  # it moved (grew every 2 finite steps)
    ckpt = tmp_path / "fused.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["FusedPrecision"]["scale"] == scale
    assert "model.blocks.0.attn.q_proj.weight" in saved["state_dict"]  # fused weights saved in the unfused layout

    probe = _ScaleProbe()
    plugin2 = FusedPrecision("16-mixed", device="cpu")
    trainer2 = L.Trainer(
        accelerator="cpu", max_steps=8, plugins=[plugin2], callbacks=[probe], logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False,
    )  # fmt: skip
    trainer2.fit(TinyGPT(**kw), _token_loader(), ckpt_path=ckpt)
    assert probe.scale_at_start == scale


class _OptimizerProbe(Callback):
    """The first optimizer's state when training starts (after Lightning restored the checkpoint)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        opt = trainer.optimizers[0]
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.state = {names[id(p)]: {k: v.clone() for k, v in opt.state[p].items()} for p in opt.state}


def _resume(plugin: Any, ckpt: Path, tmp_path: Path, **kw: Any) -> dict[str, dict[str, torch.Tensor]]:
    probe = _OptimizerProbe()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, plugins=[plugin], callbacks=[probe], logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(TinyGPT(**kw), _token_loader(), ckpt_path=ckpt)
    return probe.state


def test_resume_across_qkv_packing_both_ways(tmp_path: Path) -> None:
    kw = dict(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    ckpts = {}
    for name, plugin in (("plain", MixedPrecision("bf16-mixed", "cpu")), ("fused", FusedPrecision(device="cpu"))):
        trainer = L.Trainer(
            accelerator="cpu", max_steps=2, plugins=[plugin], logger=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(TinyGPT(**kw), _token_loader())
        ckpts[name] = tmp_path / f"{name}.ckpt"
        trainer.save_checkpoint(ckpts[name])
    saved = {k: torch.load(v, weights_only=True)["optimizer_states"][0] for k, v in ckpts.items()}
    # a fused run saves the optimizer state as the unfused run does: same parameter count, q/k/v apart
    assert [g["params"] for g in saved["fused"]["param_groups"]] == [
        g["params"] for g in saved["plain"]["param_groups"]
    ]
    names = [n for n, _ in TinyGPT(**kw).named_parameters()]  # the unfused order the plain optimizer has
    attn = "model.blocks.0.attn"
    for src in ("plain", "fused"):
        fused_state = _resume(FusedPrecision(device="cpu"), ckpts[src], tmp_path, **kw)  # packs on load
        plain_state = _resume(MixedPrecision("bf16-mixed", "cpu"), ckpts[src], tmp_path, **kw)
        parts = [saved[src]["state"][names.index(f"{attn}.{x}_proj.weight")] for x in "qkv"]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused_state[f"{attn}.qkv_proj.weight"][key], torch.cat([p[key] for p in parts]))
            torch.testing.assert_close(plain_state[f"{attn}.k_proj.weight"][key], parts[1][key])
        assert float(fused_state[f"{attn}.qkv_proj.weight"]["step"]) == 2.0


def test_trainer_precision_and_plugin_together_is_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        L.Trainer(accelerator="cpu", precision="bf16-mixed", plugins=[FusedPrecision("bf16-mixed", device="cpu")])


def test_channels_last_converts_conv_weights_and_trains_like_the_default_layout(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = _fit(ImageClassifier(num_classes=4, width=8, blocks=(1, 1)), _image_loader(), FusedPrecision(), tmp_path)
    torch.manual_seed(0)
    model = ImageClassifier(num_classes=4, width=8, blocks=(1, 1))
    losses = _fit(model, _image_loader(), FusedPrecision(memory_format="channels_last"), tmp_path)
    convs = [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert any(not w.is_contiguous() for w in convs)  # (a 1x1 kernel's two layouts coincide)
    _compare(losses, ref)


def test_memory_format_is_validated_at_construction() -> None:
    with pytest.raises(ValueError, match=r"`memory_format` must be 'preserve' or 'channels_last', got 'nhwc'"):
        FusedPrecision(memory_format="nhwc")  # type: ignore[arg-type]


def _channels_last_ddp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """2 ranks, ddp_1bit + async delta checkpoints with channels_last weights: trains in sync, and the saved
    checkpoint restores the exact weights into a default-layout model."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_accel.checkpoint import DeltaCheckpointIO
    from lightning_accel.strategies import OneBitDDPStrategy

    torch.manual_seed(0)
    model = ImageClassifier(num_classes=4, width=8, blocks=(1, 1))
    ckpt = ModelCheckpoint(dirpath=f"{root}/ckpt", save_last=True, every_n_train_steps=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_steps=8, callbacks=[ckpt], logger=False,
        strategy=OneBitDDPStrategy(warmup_steps=2, compression="1bit"), enable_progress_bar=False,
        plugins=[FusedPrecision(memory_format="channels_last"), DeltaCheckpointIO(async_save=True)],
        enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(model, _image_loader())
    trainer.strategy.checkpoint_io.teardown()  # rank 0's background writer has finished
    torch.distributed.barrier()  # (rank 1 writes nothing: its teardown returns before rank 0's last save lands)
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    restored = DeltaCheckpointIO().load_checkpoint(f"{root}/ckpt/last.ckpt")["state_dict"]
    overlap = trainer.strategy.overlap
    try:  # the bucket views of channels_last gradients do not follow the layout: overlapping is refused
        L.Trainer(
            accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_checkpointing=False,
            strategy=OneBitDDPStrategy(warmup_steps=2, compression="1bit", overlap=True), enable_progress_bar=False,
            plugins=[FusedPrecision(memory_format="channels_last")], enable_model_summary=False, default_root_dir=root,
        ).fit(ImageClassifier(num_classes=4, width=8, blocks=(1, 1)), _image_loader())  # fmt: skip
        refused = ""
    except ValueError as err:
        refused = str(err)
    return {
        "overlap": overlap,
        "refused": refused,
        # parameters only: BatchNorm's running statistics are updated by each rank's last batch after DDP's broadcast
        "sum": float(sum(p.detach().double().sum() for p in model.parameters())),
        "exact": all(torch.equal(restored[k], v) for k, v in weights.items()),
    }


def test_channels_last_under_two_process_1bit_ddp_with_async_delta_checkpoints(tmp_path: Path) -> None:
    results = run_in_processes(_channels_last_ddp_worker, 2, (str(tmp_path),), init_process_group=False, timeout=240)
    assert results[0]["exact"]
    assert results[0]["sum"] == results[1]["sum"]  # the ranks stayed in sync
    for r in results:  # compressed after backward, from `p.grad`: DDP's bucket views do not follow channels_last
        assert r["overlap"] is False
        assert "`overlap=True`" in r["refused"] and "channels_last" in r["refused"]


class _DDPProbe(Callback):
    def __init__(self) -> None:
        self.seen: dict[str, bool] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        wrapped = trainer.strategy.model  # the DistributedDataParallel wrapper while fitting
        attn = pl_module.model.blocks[0].attn
        self.seen = {
            "ddp_wraps_our_module": wrapped.module is pl_module,
            "qkv_in_ddp_params": any(p is attn.qkv_proj.weight for p in wrapped.parameters()),
        }


def _ddp_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    attn = model.model.blocks[0].attn
    probe = _DDPProbe()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp", max_steps=3, callbacks=[probe],
        plugins=[FusedPrecision("bf16-mixed", device="cpu")], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(model, _token_loader())
    return {
        "same_attn_object": model.model.blocks[0].attn is attn,
        "attn_fused": is_fused(attn, FusedAttentionMixin),
        **probe.seen,
        "weight_sum": float(attn.qkv_proj.weight.sum()),
    }


def test_ddp_surgery_happens_in_place(tmp_path: Path) -> None:
    results = run_in_processes(_ddp_worker, 2, (str(tmp_path),), init_process_group=False, timeout=240)
    for r in results:
        assert r["same_attn_object"] and r["attn_fused"] and r["ddp_wraps_our_module"] and r["qkv_in_ddp_params"]
    assert results[0]["weight_sum"] == pytest.approx(results[1]["weight_sum"], abs=1e-6)  # ranks stayed in sync


def _broken_backend(gm: torch.fx.GraphModule, example_inputs: list) -> None:
    raise RuntimeError("no compiler on this machine")


def test_compile_failure_falls_back_to_eager_in_a_trainer(tmp_path: Path) -> None:
    kw = dict(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    plugin = FusedPrecision("bf16-mixed", device="cpu", compile=True, compile_kwargs={"backend": _broken_backend})
    model = TinyGPT(**kw)
    with pytest.warns(UserWarning, match="`torch.compile` failed for TinyGPT.*running it eagerly"):
        losses = _fit(model, _token_loader(), plugin, tmp_path)
    assert len(losses) == STEPS and model._compiled_call_impl.failed is not None


class _EncoderLM(L.LightningModule):
    """A transformer encoder layer and a GPT-2 style block over random embeddings, regression to zero."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_accel.models.gpt2 import GPT2Block

        self.enc = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True, norm_first=True)
        self.block = GPT2Block(16, 2, dropout=0.1)

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        (x,) = batch
        return self.block(self.enc(x)).float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _ddp_structural_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from lightning_accel.precision.modules import FusedGPT2BlockMixin, FusedTransformerEncoderLayerMixin

    torch.manual_seed(0)
    model = _EncoderLM()
    plugin = FusedPrecision("bf16-mixed", device="cpu", backend="reference")
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp", max_steps=3, plugins=[plugin], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
    )  # fmt: skip
    data = torch.randn(32, 5, 16, generator=torch.Generator().manual_seed(1))
    trainer.fit(model, DataLoader(TensorDataset(data), batch_size=4))
    assert plugin.report is not None
    return {
        "fused": is_fused(model.enc, FusedTransformerEncoderLayerMixin) and is_fused(model.block, FusedGPT2BlockMixin),
        "coverage": plugin.report.coverage(),
        "param_sum": float(sum(p.double().sum() for p in model.parameters())),
    }


def test_ddp_with_encoder_layer_and_gpt2_block(tmp_path: Path) -> None:
    results = run_in_processes(_ddp_structural_worker, 2, (str(tmp_path),), init_process_group=False, timeout=240)
    for r in results:
        assert r["fused"] and r["coverage"] == 1.0
    assert results[0]["param_sum"] == pytest.approx(results[1]["param_sum"], abs=1e-9)  # ranks stayed in sync


class _ShardedGPT(TinyGPT):
    """TinyGPT sharded with FSDP2's ``fully_shard`` in ``configure_model``, as ``ModelParallelStrategy`` requires."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])


def _model_parallel_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.manual_seed(0)
    model = _ShardedGPT(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    plugin = FusedPrecision("bf16-mixed", device="cpu")
    strategy = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, plugins=[plugin],
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True)], logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(model, _token_loader())
    assert plugin.report is not None
    attn = [c for c in plugin.report.skipped() if c.kind == "attention"]
    return {
        "fused": sorted(plugin.report.counts()),
        "attention": [(c.module, c.reason) for c in attn],
        "saved": (Path(root) / "last.ckpt").exists(),
    }


def test_model_parallel_fully_shard_keeps_qkv_apart_and_checkpoints(tmp_path: Path) -> None:
    """Under ``ModelParallelStrategy`` the model is sharded (``fully_shard`` in ``configure_model``) before the plugin
    converts it: packing q/k/v made a DTensor parameter FSDP does not manage, and the first forward failed ("mixed
    torch.Tensor and DTensor"). The projections stay apart, with the reason; the rest fuses, trains and checkpoints."""
    results = run_in_processes(_model_parallel_worker, 2, (str(tmp_path),), init_process_group=False, timeout=240)
    for r in results:
        assert r["fused"] == ["linear_dropout", "norm"] and r["saved"]
        assert len(r["attention"]) == 1 and "is a DTensor (sharded by fully_shard" in r["attention"][0][1], r
