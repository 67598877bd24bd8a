"""The tensor-parallel plan found in a network, and its errors (applying it needs processes: see the
integration test)."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_accel.models.transformer import GPT
from lightning_accel.parallel.plans import fsdp_units, mixed_precision_policy, tensor_parallel_plan


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
