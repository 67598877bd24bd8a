"""Memory estimates against the formulas, on models of known size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.models.transformer import GPT
from lightning_accel.parallel import (
    count_layers,
    estimate_ddp,
    estimate_fsdp,
    estimate_pipeline,
    largest_unit_params,
    measure_activation_bytes,
    pipeline_stage_params,
)
from lightning_accel.parallel.estimate import (
    default_microbatches,
    estimate_tensor_parallel,
    pipeline_stage_parameters,
    trainable_and_frozen,
)


def mlp(width: int = 256, depth: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])


def test_formulas_on_a_model_of_known_size() -> None:
    m = mlp(256, 4)
    p = sum(x.numel() for x in m.parameters())
    assert p == 4 * 256 * 256
    d = estimate_ddp(p, activations=1000)
    assert (d.model_state, d.working, d.activations, d.total) == (16 * p, 0, 1000, 16 * p + 1000)
    f = estimate_fsdp(p, 1000, world=4, largest_unit=largest_unit_params(m))
    assert largest_unit_params(m) == 256 * 256
    assert f.total == 16 * p // 4 + 4 * 256 * 256 + 1000
    stages = pipeline_stage_params(m, 2)
    assert stages == [2 * 256 * 256, 2 * 256 * 256]
    pp = estimate_pipeline(stages, 8000, microbatches=8)
    assert pp.total == 16 * 2 * 256 * 256 + 8000 // 2 * 2 // 8
    assert estimate_ddp(p, 0, bytes_per_param=12).model_state == 12 * p  # SGD + momentum in fp32


def test_activation_measurement_counts_saved_inputs_once() -> None:
    torch.manual_seed(0)
    m = mlp(256, 4)
    x = torch.randn(8, 256)
    prof = measure_activation_bytes(m, x)
    # each Linear saves its input for the weight gradient (fp32, 8 x 256); weights are parameters: not counted
    assert prof.activation_bytes == 4 * 8 * 256 * 4
    assert all(p.grad is None for p in m.parameters())  # measurement leaves no gradients behind
    # a ReLU saves its output, which is the next Linear's saved input: the same storage counts once
    m2 = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False))
    assert measure_activation_bytes(m2, torch.randn(4, 64)).activation_bytes == 2 * 4 * 64 * 4
    # linear in the batch
    assert measure_activation_bytes(m, torch.randn(16, 256)).activation_bytes == 2 * prof.activation_bytes


def test_activation_measurement_inputs_and_loss_fn() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
            return {"out": self.a(x) + self.a(y)}

    m = Two()
    assert measure_activation_bytes(m, (torch.randn(2, 4), torch.randn(2, 4))).activation_bytes > 0
    assert measure_activation_bytes(m, {"x": torch.randn(2, 4), "y": torch.randn(2, 4)}).activation_bytes > 0
    got = measure_activation_bytes(m, (torch.randn(2, 4), torch.randn(2, 4)), loss_fn=lambda o: o["out"].pow(2).sum())
    assert got.activation_bytes > 0

    class Weird(nn.Module):
        def forward(self, x: torch.Tensor) -> str:
            return "no tensor"

    with pytest.raises(TypeError, match="loss_fn"):
        measure_activation_bytes(Weird(), torch.randn(2))


def test_layers_and_units_of_a_transformer() -> None:
    g = GPT(vocab_size=27, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=0.0)
    assert count_layers(g) == 3  # the block stack, not the 4-element MLP Sequential inside each block
    block = sum(p.numel() for p in g.blocks[0].parameters()) if hasattr(g, "blocks") else None
    if block is not None:
        assert largest_unit_params(g) == block
    total = sum(p.numel() for p in g.parameters())
    st = pipeline_stage_params(g, 3)
    assert sum(st) == total and len(st) == 3
    assert count_layers(nn.Linear(2, 2)) == 1


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`world`"):
        estimate_fsdp(10, 0, world=0, largest_unit=1)
    with pytest.raises(ValueError, match="`stages`"):
        pipeline_stage_params(mlp(), 0)


def test_parameters_shared_between_blocks_count_on_every_stage_that_holds_them() -> None:
    block = nn.Linear(100, 100)

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(10, 100)
            self.blocks = nn.ModuleList([block] * 4)  # the same block four times: its weights exist once per holder

    m = Shared()
    held = sum(p.numel() for p in block.parameters())
    emb = sum(p.numel() for p in m.emb.parameters())
    # both stages run the block, so both keep a copy (with its gradient and optimizer state): charged to each
    assert pipeline_stage_params(m, 2) == [held + emb, held]
    assert [len(ps) for ps in pipeline_stage_parameters(m, 2)] == [4, 2]  # weight + bias (+ the embedding's)


def test_frozen_parameters_cost_their_weights_only() -> None:
    m = mlp(256, 4)
    for p in m[:3].parameters():  # a frozen backbone, a trainable head
        p.requires_grad_(False)
    m[:2].to(torch.bfloat16)  # a frozen weight costs its own dtype's element size
    layer = 256 * 256
    trainable, frozen = trainable_and_frozen([*m.parameters(), *m.parameters()])  # each counted once
    assert (trainable, frozen) == (layer, 2 * 2 * layer + 4 * layer)
    assert estimate_ddp(trainable, 0, frozen_bytes=frozen).model_state == 16 * layer + 8 * layer
    assert estimate_ddp(trainable, 0, frozen_bytes=frozen).formula == "16·P + W + A"
    assert estimate_fsdp(trainable, 0, world=2, largest_unit=layer, frozen_bytes=frozen).model_state == 12 * layer
    pp = estimate_pipeline([0, layer], 0, stage_frozen_bytes=[4 * layer, 4 * layer])
    assert pp.model_state == 20 * layer
    tp = estimate_tensor_parallel(trainable, layer, 0, 2, layer, frozen_bytes=frozen, split_frozen_bytes=4 * layer)
    assert tp.model_state == 8 * layer + 4 * layer + 2 * layer
    with pytest.raises(ValueError, match="`stage_frozen_bytes` lists 1 stage"):
        estimate_pipeline([1, 1], 0, stage_frozen_bytes=[0])


def test_pipeline_micro_batches_default_to_what_the_strategy_runs() -> None:
    assert default_microbatches(4) == 8
    pp = estimate_pipeline([10, 10], 8000)  # 2 stages, 4 micro-batches of the batch, 2 in flight
    assert pp.activations == 8000 // 2 * 2 // 4 and pp.formula.endswith("A/2·2/4")
    with pytest.raises(ValueError, match="`pipeline_size`"):
        default_microbatches(0)


def test_the_pipeline_estimate_follows_the_schedule_and_the_stages_per_rank() -> None:
    from lightning_accel.parallel.estimate import pipeline_in_flight

    # 4 ranks, 8 micro-batches: GPipe keeps all 8 in flight on the first rank, 1F1B 4
    assert pipeline_in_flight("gpipe", 4, 8) == 8 and pipeline_in_flight("1f1b", 4, 8) == 4
    assert pipeline_in_flight("1f1b", 4, 2) == 2  # fewer micro-batches than ranks: all of them
    # interleaved, 2 stages per rank: the warm-up (1·4 + 2·3) and one more, of 16 stage-micro-batches; in bytes 1F1B's
    # times 1 + (S-1)/(S·v) once M >= S
    assert pipeline_in_flight("interleaved1f1b", 4, 8, 2) == 11
    assert pipeline_in_flight("interleaved1f1b", 2, 1, 2) == 2  # capped by what there is
    acts = 64_000
    f1b = estimate_pipeline([10] * 4, acts, microbatches=8)
    gpipe = estimate_pipeline([10] * 4, acts, microbatches=8, schedule="gpipe")
    inter = estimate_pipeline([10] * 8, acts, microbatches=8, schedule="interleaved1f1b")
    assert (f1b.activations, gpipe.activations) == (acts // 4 * 4 // 8, acts // 4)
    assert inter.activations == pytest.approx(f1b.activations * (1 + 3 / 8), rel=1e-6)
    assert gpipe.formula.endswith("A/4·8/8") and inter.formula == "2·(16·P_stage) + A/8·11/8"
    # each rank holds its stages' state: rank r has stages r and r + 4
    uneven = estimate_pipeline([1, 2, 3, 4, 50, 6, 7, 8], 0, bytes_per_param=1, schedule="interleaved1f1b")
    assert uneven.model_state == 51
    with pytest.raises(ValueError, match="`stages_per_rank`=2 with `schedule`='gpipe'"):
        estimate_pipeline([10] * 4, acts, schedule="gpipe", stages_per_rank=2)
    with pytest.raises(ValueError, match="lists 3 stage.*`stages_per_rank`=2"):
        estimate_pipeline([10] * 3, acts, schedule="interleaved1f1b")
    with pytest.raises(ValueError, match="`schedule`"):
        estimate_pipeline([10] * 4, acts, schedule="zero-bubble")


def test_measuring_activations_leaves_the_model_as_it_was() -> None:
    m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
    m.train()
    m[2].eval()  # a submodule the user put in eval mode
    stats = [b.clone() for b in m.buffers()]
    x = torch.randn(16, 4) + 5.0
    torch.manual_seed(3)
    expected_next = torch.rand(1)
    torch.manual_seed(3)
    measure_activation_bytes(m, x)
    assert [x.training for x in m.modules()] == [True, True, True, False, True]
    assert all(torch.equal(a, b) for a, b in zip(stats, m.buffers(), strict=True))  # BatchNorm stats unchanged
    assert torch.equal(torch.rand(1), expected_next)  # the RNG stream too


def test_module_buffers_count_as_model_state_on_every_device_that_runs_them() -> None:
    torchvision = pytest.importorskip("torchvision")
    from lightning_accel.parallel.estimate import buffer_bytes, pipeline_stage_buffer_bytes

    # BatchNorm2d(64): fp32 running mean and variance, and an int64 `num_batches_tracked`
    assert buffer_bytes([nn.BatchNorm2d(64)]) == 2 * 64 * 4 + 8
    # ResNet-18's 20 BatchNorm layers over 64 + 4·64 + 5·128 + 5·256 + 5·512 = 4800 channels
    assert buffer_bytes([torchvision.models.resnet18()]) == 2 * 4800 * 4 + 20 * 8
    bn = nn.BatchNorm1d(8)
    assert buffer_bytes([bn, nn.Sequential(bn, bn)]) == 2 * 8 * 4 + 8  # each buffer once, however often reached
    b = 1000
    assert estimate_ddp(10, 0, buffer_bytes=b).model_state == 160 + b
    assert estimate_ddp(10, 0, buffer_bytes=b).formula == "16·P + B + A"
    f = estimate_fsdp(10, 0, world=2, largest_unit=5, buffer_bytes=b)  # `fully_shard` shards parameters only
    assert (f.model_state, f.formula) == (80 + b, "16·P/2 + B + 4·L + A")
    tp = estimate_tensor_parallel(10, 4, 0, 2, 5, buffer_bytes=b, frozen_bytes=8)
    assert (tp.model_state, tp.formula) == (16 * 6 + 32 + 8 + b, "16·(P-P_tp+P_tp/2) + W-W_tp+W_tp/2 + B + 4·L/2 + A")
    pp = estimate_pipeline([10, 10], 0, stage_buffer_bytes=[0, b])
    assert (pp.model_state, pp.formula) == (160 + b, "16·P_stage + B_stage + A/2·2/4")
    with pytest.raises(ValueError, match="`stage_buffer_bytes` lists 1 stage"):
        estimate_pipeline([1, 1], 0, stage_buffer_bytes=[0])

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.zeros(100))  # outside the stack: on the first stage
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(4)])

    per_bn = 2 * 8 * 4 + 8
    assert pipeline_stage_buffer_bytes(Blocks(), 2) == [400 + 2 * per_bn, 2 * per_bn]


def test_running_statistics_are_not_activations() -> None:
    # BatchNorm saves its running statistics for backward: model state (counted in `buffer_bytes`), not activations
    m = nn.Sequential(nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8))
    x = torch.randn(4, 8)
    # the Linear's input and output (saved by BatchNorm), BatchNorm's saved mean and inverse std
    assert measure_activation_bytes(m, x).activation_bytes == 2 * 4 * 8 * 4 + 2 * 8 * 4


def test_the_largest_fsdp_unit_is_what_the_sharded_strategy_gathers_at_once() -> None:
    torchvision = pytest.importorskip("torchvision")

    # ResNet-18's only repeated stack is a stage's two blocks: the stages, stem and head outside it are gathered as
    # units of their own, each direct child of the network one (the largest: layer4)
    net = torchvision.models.resnet18(num_classes=4)
    assert largest_unit_params(net) == sum(p.numel() for p in net.layer4.parameters())

    class Lit(nn.Module):  # a LightningModule holding the network: the network outside its blocks is one unit
        def __init__(self) -> None:
            super().__init__()
            self.model = torchvision.models.resnet18(num_classes=4)

    lit = Lit()
    in_blocks = sum(p.numel() for p in lit.model.layer1.parameters())
    assert largest_unit_params(lit) == sum(p.numel() for p in lit.parameters()) - in_blocks
    # a language model: the embedding tied to the head is one unit, larger than a block
    g = GPT(vocab_size=5000, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    assert largest_unit_params(g) == g.tok_emb.weight.numel() > sum(p.numel() for p in g.blocks[0].parameters())
    # an auto-wrap policy's classes: those modules, and the root holding the rest
    m = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10), nn.Linear(10, 10))
    assert largest_unit_params(m, [nn.Linear]) == 100 * 100 + 100
