"""The tensor-parallel plan found in a network, and its errors (applying it needs processes: see the
integration test)."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_accel.models.transformer import GPT
from lightning_accel.parallel.plans import (
    describe_coverage,
    fsdp_units,
    mixed_precision_policy,
    tensor_parallel_coverage,
    tensor_parallel_plan,
)


def test_gpt_plan_pairs_attention_and_mlp() -> None:
    gpt = GPT(n_layer=2, n_embd=16, n_head=4, block_size=8)
    plan = tensor_parallel_plan(gpt, 2)
    assert plan["blocks.0.attn.q_proj"] == plan["blocks.1.attn.v_proj"] == "colwise"
    assert plan["blocks.0.attn.proj"] == plan["blocks.0.mlp.2"] == "rowwise" and plan["blocks.0.mlp.0"] == "colwise"
    assert len(plan) == 12 and "head" not in plan  # embeddings and head stay replicated
    assert fsdp_units(gpt) == list(gpt.blocks)


def test_no_parallelisable_layers_and_indivisible_sizes_are_errors() -> None:
    with pytest.raises(ValueError, match=r"found 0 parallelisable layer pairs in `Sequential` \(2 Linear modules"):
        tensor_parallel_plan(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 2)
    with pytest.raises(ValueError, match=r"`CausalSelfAttention.n_head`=4 heads cannot be split over `tensor_para"):
        tensor_parallel_plan(GPT(n_layer=2, n_embd=24, n_head=4, block_size=8), 3)
    with pytest.raises(ValueError, match=r"16 output features, not divisible by `tensor_parallel_size`=3"):
        tensor_parallel_plan(GPT(n_layer=2, n_embd=16, n_head=4, block_size=8), 3)


def test_mixed_precision_policy_follows_the_trainer_precision() -> None:
    import torch

    assert mixed_precision_policy("32-true") is None
    policy = mixed_precision_policy("bf16-mixed")
    assert policy.param_dtype is torch.bfloat16 and policy.reduce_dtype is torch.float32


def test_packed_projection_rows_reordered_per_head() -> None:
    import torch

    from lightning_accel.parallel.plans import pack_rows, unpack_rows

    d, tp = 8, 2  # q, k, v of 8 rows each; rank r holds rows r*4 .. r*4+3 of each
    w = torch.arange(3 * d).float().unsqueeze(1).repeat(1, 5)
    packed = pack_rows(w, tp)
    rank0, rank1 = packed.chunk(tp)
    assert rank0[:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]  # q_0, k_0, v_0
    assert rank1[:, 0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]  # q_1, k_1, v_1
    assert torch.equal(unpack_rows(packed, tp), w)
    b = torch.arange(3 * d).float()
    assert torch.equal(unpack_rows(pack_rows(b, tp), tp), b) and pack_rows(b, 1).equal(b)


def test_packed_c_attn_is_planned_and_coverage_says_what_stays_replicated() -> None:
    from lightning_accel.models.gpt2 import gpt2_lm
    from lightning_accel.parallel.plans import describe_coverage, tensor_parallel_coverage

    net = gpt2_lm(layers=2, heads=4, width=32)
    plan = tensor_parallel_plan(net, 2)
    assert plan["1.attn.c_attn"] == plan["2.attn.c_attn"] == "colwise_packed"
    assert plan["1.attn.c_proj"] == plan["1.mlp.c_proj"] == "rowwise" and plan["1.mlp.c_fc"] == "colwise"
    cov = tensor_parallel_coverage(net, plan)
    assert cov["3.head"] == "replicated: no column/row partner in its block"
    line = describe_coverage(cov, 2)
    assert "2 Linear column-wise, 2 packed q/k/v per head (1.attn.c_attn, 2.attn.c_attn), 4 row-wise" in line
    assert "1 replicated: `3.head`" in line and "\n" not in line
    with pytest.raises(ValueError, match=r"`1.attn.c_attn` has 32 output features per q/k/v part, not divisible"):
        tensor_parallel_plan(gpt2_lm(layers=2, heads=4, width=32), 3)


def test_multihead_attention_is_refused_in_one_line_naming_it() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    net = nn.Sequential(Block(), Block())
    with pytest.raises(ValueError, match=r"cannot split `0.attn` \(nn.MultiheadAttention\).*or pass `tp_plan`") as e:
        tensor_parallel_plan(net, 2)
    assert "\n" not in str(e.value)


def test_tied_units_share_one_fsdp_group() -> None:
    from lightning_accel.models.gpt2 import gpt2_lm
    from lightning_accel.parallel.plans import fsdp_groups

    net = gpt2_lm(layers=2)
    groups, notes = fsdp_groups(fsdp_units(net), net)
    assert [len(g) for g in groups] == [2, 1, 1] and groups[0] == [net[0], net[3]]  # embedding + tied head
    assert notes == ["`0`, `3` share tied parameters: one FSDP group"]
    gpt = GPT(n_layer=2, n_embd=16, n_head=4, block_size=8)  # tied outside the blocks: the blocks shard alone
    groups, notes = fsdp_groups(fsdp_units(gpt), gpt)
    assert groups == [[gpt.blocks[0]], [gpt.blocks[1]]] and notes == []
    first, second, extra = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    extra.weight = second.weight  # a unit's parameter used outside every unit: left to the root
    shared = nn.Sequential(first, second)
    outer = nn.Module()
    outer.stack, outer.extra = shared, extra
    groups, notes = fsdp_groups(list(shared), outer)
    assert groups == [[first]] and "left to the enclosing FSDP group" in notes[0]


class _PackedAttention(nn.Module):
    """An attention holding a packed projection under the given name (`Wqkv`, `in_proj`) and `out_proj`."""

    def __init__(self, packed: str, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.n_head, self.n_embd = heads, width
        self.add_module(packed, nn.Linear(width, 3 * width))
        self.out_proj = nn.Linear(width, width)


class _FakeMesh:
    def size(self) -> int:
        return 2


@pytest.mark.parametrize("packed", ["Wqkv", "in_proj", "c_attn"])
def test_user_plan_on_a_packed_name_divides_and_checks_the_head_count(
    packed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.tensor.parallel as tp_mod

    from lightning_accel.parallel.plans import apply_tensor_parallel, check_tensor_parallel_plan

    # only the bookkeeping is under test: the DTensor split itself needs processes (integration test)
    monkeypatch.setattr(tp_mod, "parallelize_module", lambda *args, **kwargs: None)
    net = nn.Sequential(_PackedAttention(packed), _PackedAttention(packed))
    plan = {f"{i}.{packed}": "colwise" for i in range(2)} | {f"{i}.out_proj": "rowwise" for i in range(2)}
    chosen = apply_tensor_parallel(net, _FakeMesh(), plan)
    assert chosen[f"0.{packed}"] == "colwise_packed"
    assert [(m.n_embd, m.n_head) for m in net] == [(4, 1), (4, 1)]
    odd = nn.Sequential(_PackedAttention(packed, width=6, heads=3))
    with pytest.raises(ValueError, match=r"`_PackedAttention.n_head`=3 heads cannot be split over `tensor_parallel_s"):
        check_tensor_parallel_plan(odd, {f"0.{packed}": "colwise", "0.out_proj": "rowwise"}, 2)
    with pytest.raises(ValueError, match=r"`_PackedAttention.n_head`=3 heads cannot be split"):  # any name, by style
        check_tensor_parallel_plan(odd, {f"0.{packed}": "colwise_packed", "0.out_proj": "rowwise"}, 2)


def test_an_mlp_pair_is_split_across_elementwise_modules_only() -> None:
    def block() -> nn.Sequential:
        return nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16),  # elementwise between: split
            nn.LayerNorm(16),
            nn.Linear(16, 32), nn.Softmax(dim=-1), nn.Linear(32, 16),  # Softmax mixes the features: replicated
            nn.LayerNorm(16),
            nn.Linear(16, 32), nn.LayerNorm(32, elementwise_affine=False), nn.Linear(32, 16),  # so does a plain norm
        )  # fmt: skip

    net = nn.Sequential(block(), block())
    plan = tensor_parallel_plan(net, 2)
    assert plan == {"0.0": "colwise", "0.3": "rowwise", "1.0": "colwise", "1.3": "rowwise"}
    cov = tensor_parallel_coverage(net, plan)
    assert cov["0.5"] == "replicated: `0.6` (Softmax) between it and its partner `0.7` mixes features"
    assert cov["1.11"] == "replicated: `1.10` (LayerNorm) between it and its partner `1.9` mixes features"
    assert "8 replicated: `0.5` (`0.6` (Softmax) between it" in describe_coverage(cov, 2)
    # a model whose every pair is broken has nothing to split: the error says which module broke a pair
    mixing = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.Softmax(dim=-1), nn.Linear(32, 16)) for _ in "ab"])
    with pytest.raises(ValueError, match=r"0 parallelisable layer pairs.*`0.1` \(Softmax\) between it and its partner"):
        tensor_parallel_plan(mixing, 2)
