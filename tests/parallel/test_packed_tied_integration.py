"""Tensor parallel on a packed ``c_attn`` and FSDP2 on a tied embedding/head, on 2 gloo processes (one launch): the
losses of DDP, the per-head shards on each rank, and a tensor-parallel checkpoint in the unsplit layout."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._models import GPT2LM
from lightning_accel.models.gpt2 import gpt2_lm
from tests.helpers import run_in_processes

TOL = 1e-4


def ce(out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)).float(), tokens[:, 1:].reshape(-1))


def _trainer_checkpoint(strategy: Any, path: str, resume: str | None = None) -> None:
    import lightning.pytorch as pl

    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 17), generator=g), torch.arange(8))
    t = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip
    t.fit(GPT2LM(), torch.utils.data.DataLoader(ds, batch_size=8), ckpt_path=resume)
    t.save_checkpoint(path)


def _work(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from lightning_accel.parallel import ShardedStrategy
    from lightning_accel.parallel.plans import pack_rows
    from lightning_accel.parallel.trials import plan_stepper

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    # every rank reads the same whole batch: tensor parallel and DDP train on the same data
    _trainer_checkpoint("ddp", os.path.join(tmp, "ddp.ckpt"))
    tp = ShardedStrategy(tensor_parallel_size=2)
    _trainer_checkpoint(tp, os.path.join(tmp, "tp.ckpt"))
    out["coverage"] = tp.applied["tp_coverage"]
    # resumed at its last step (nothing left to train) and saved again: the reorder on load undoes the one on save
    _trainer_checkpoint(
        ShardedStrategy(tensor_parallel_size=2), os.path.join(tmp, "tp2.ckpt"), resume=os.path.join(tmp, "tp.ckpt")
    )

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (8, 17), generator=g)
    for plan in ("ddp", "tp", "fsdp"):
        st = plan_stepper(plan, gpt2_lm(), tokens[:, :-1], tokens, loss_fn=ce, lr=1e-2)
        net: Any = st.model  # the nn.Sequential of gpt2_lm
        if plan == "tp":
            w = net[1].attn.c_attn.weight
            assert isinstance(w, DTensor)
            original = gpt2_lm()[1].attn.c_attn.weight.detach()
            out["shard_is_qkv_of_rank"] = torch.equal(w.to_local(), pack_rows(original, world).chunk(world)[rank])
            q, k, v = original.chunk(3)
            mine = torch.cat([z.chunk(world)[rank] for z in (q, k, v)])
            out["shard_rows_q_k_v"] = torch.equal(w.to_local(), mine)
            out["heads"] = (net[1].attn.n_head, net[1].attn.n_embd)
        if plan == "fsdp":
            out["still_tied"] = net[-1].head.weight is net[0].wte.weight
        out[plan] = [st.step() for _ in range(3)]
    return out


def test_packed_attention_split_per_head_and_tied_sharding_track_ddp(tmp_path: Path) -> None:
    r0, r1 = run_in_processes(_work, 2, (str(tmp_path),), init_process_group=False, timeout=600)
    for r in (r0, r1):
        assert r["shard_is_qkv_of_rank"] and r["shard_rows_q_k_v"], "each rank holds q_r, k_r, v_r"
        assert r["heads"] == (2, 16)  # 4 heads of width 32 -> 2 heads, 16 features per q/k/v on each rank
        for plan in ("tp", "fsdp"):
            diff = max(abs(a - b) for a, b in zip(r[plan], r0["ddp"], strict=True))
            assert diff <= TOL, f"{plan}: {r[plan]} vs DDP {r0['ddp']}"
    assert r0["still_tied"]
    cov = r0["coverage"]
    assert cov["net.1.attn.c_attn"] == "colwise_packed" and cov["net.1.attn.c_proj"] == "rowwise"
    assert cov["net.2.mlp.c_fc"] == "colwise" and cov["net.2.mlp.c_proj"] == "rowwise"
    assert cov["net.3.head"].startswith("replicated: ")
    # the tensor-parallel checkpoint is in the unsplit layout: it matches DDP's after the same two steps
    ddp = torch.load(tmp_path / "ddp.ckpt", weights_only=False)["state_dict"]
    tp = torch.load(tmp_path / "tp.ckpt", weights_only=False)["state_dict"]
    assert set(ddp) == set(tp)
    for k in [k for k in ddp if k.endswith("c_attn.bias")]:
        # the key bias has no gradient (softmax ignores a constant added to every score): Adam turns its rounding
        # noise into steps of the learning rate, in any layout; compare the query and value thirds
        ddp[k], tp[k] = (torch.cat([b.chunk(3)[0], b.chunk(3)[2]]) for b in (ddp[k], tp[k]))
    again = torch.load(tmp_path / "tp2.ckpt", weights_only=False)
    first = torch.load(tmp_path / "tp.ckpt", weights_only=False)
    assert all(torch.equal(first["state_dict"][k], again["state_dict"][k]) for k in first["state_dict"])
    for a, b in zip(first["optimizer_states"], again["optimizer_states"], strict=True):
        for name, st in a["state"].items():
            assert all(torch.equal(v, b["state"][name][k]) for k, v in st.items()), name
    diffs = {k: float((ddp[k] - tp[k]).abs().max()) for k in ddp}
    assert max(diffs.values()) <= TOL, diffs  # a wrong row order would differ by the weights themselves (~0.1)
