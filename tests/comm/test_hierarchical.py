"""Hierarchical 1-bit averaging on a simulated 2 x 2 layout (4 gloo processes, node-major ranks).

The oracle below is written from the algorithm's description (node average in fp32, then the two-phase exchange of
each shard between nodes), looping over nodes and shards; it shares only the block tables with the package. Then:
the package matches it step after step (error feedback carried), replicas are bit-identical, fewer bytes cross
between nodes than on the flat path, the result is as close to the true mean as the flat path's, and ``ddp_1bit``
trains with it under Lightning (``num_nodes=2, devices=2``) and resumes its per-shard error state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.comm.compress import GroupLayout
from lightning_accel.comm.topology import resolve_hierarchical
from tests.comm._oracle import _blocks, _compress
from tests.helpers import run_in_processes

NODES, LOCAL = 2, 2
NUMELS = [37 * 29, 10, 300, 7 * 13, 1000]
BLOCK = 64
STEPS = 4


class HierOracle:
    """Every rank's worker (per shard) and server (per chunk) errors, one step at a time."""

    def __init__(self) -> None:
        self.layout = GroupLayout(NUMELS, NODES * LOCAL, BLOCK, torch.device("cpu"))
        lay = self.layout
        self.shard_numel = NODES * lay.chunk_numel
        self.e_w = [torch.zeros(self.shard_numel) for _ in range(NODES * LOCAL)]
        self.e_s = [torch.zeros(lay.chunk_numel) for _ in range(NODES * LOCAL)]

    def step(self, xs: list[torch.Tensor]) -> torch.Tensor:
        lay, c, s = self.layout, self.layout.chunk_numel, self.shard_numel
        mask = lay.table.mask
        decoded: dict[tuple[int, int], torch.Tensor] = {}  # (node, shard) -> decoded worker message
        new_w = list(self.e_w)
        for node in range(NODES):
            for local in range(LOCAL):
                rank = node * LOCAL + local
                a = local * s
                avg = torch.stack([xs[node * LOCAL + j][a : a + s] for j in range(LOCAL)]).sum(0) / LOCAL
                x = avg + self.e_w[rank]
                m = mask[a : a + s]
                # the shard's blocks: the layout's blocks inside [a, a + s)
                starts = lay.table.starts
                sel = (starts >= a) & (starts < a + s)
                d = _compress(x, m, _blocks(lay.table.lengths[sel], lay.table.valid[sel]))
                decoded[(node, local)] = d
                new_w[rank] = torch.where(m, x - d, 0.0)
        out = torch.zeros(lay.padded_numel)
        new_s = list(self.e_s)
        for local in range(LOCAL):
            for node in range(NODES):  # node `node` serves chunk local*NODES + node of shard `local`
                rank = node * LOCAL + local
                chunk = local * NODES + node
                ch = lay.chunks[chunk]
                rows = [decoded[(n, local)][node * c : (node + 1) * c] for n in range(NODES)]
                x = torch.stack(rows).mean(0) + self.e_s[rank]
                d = _compress(x, ch.mask, _blocks(ch.lengths, ch.valid))
                out[chunk * c : (chunk + 1) * c] = d
                new_s[rank] = torch.where(ch.mask, x - d, 0.0)
        if bool(torch.isfinite(out).all()):
            self.e_w, self.e_s = new_w, new_s
        return out


def _inputs(step: int, rank: int, layout: GroupLayout) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(layout.padded_numel, generator=g) * (1 + rank) + 0.3 * step
    return torch.where(layout.table.mask, x, 0.0)


def _core(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_accel.comm.allreduce import HierarchicalOneBitAllreduce, OneBitAllreduce, OneBitBuffers
    from lightning_accel.comm.compress import compress_fast, compress_reference
    from lightning_accel.comm.topology import node_topology

    topo = node_topology(LOCAL)
    assert (topo.node, topo.local_rank, topo.nodes) == divmod(rank, LOCAL) + (NODES,)
    layout = GroupLayout(NUMELS, world, BLOCK, torch.device("cpu"))
    shard = layout.node_shard(topo.local_rank, LOCAL)
    bufs = OneBitBuffers(layout, rank, topo)
    errs = {k: (torch.zeros(shard.numel), torch.zeros(layout.chunk_numel)) for k in ("ref", "fast")}
    flat_err = (torch.zeros(layout.padded_numel), torch.zeros(layout.chunk_numel))
    outs: dict[str, list[torch.Tensor]] = {"ref": [], "fast": [], "flat": []}
    sent: dict[str, int] = {}
    for step in range(STEPS):
        x = _inputs(step, rank, layout)
        for k, compress, b in (("ref", compress_reference, None), ("fast", compress_fast, bufs)):
            w, s = errs[k]
            op = HierarchicalOneBitAllreduce(x, layout, w, s, topology=topo, compress=compress, buffers=b)
            res = op.start().serve().finish()
            assert bool(res.finite)
            outs[k].append(res.out.clone())
            assert res.worker_error is not None and res.server_error is not None
            errs[k] = (res.worker_error.clone(), res.server_error.clone())
            sent[k], sent["intra"] = res.bytes_sent, res.intra_bytes
        w, s = flat_err
        res = OneBitAllreduce(x, layout, w, s, compress=compress_reference).start().serve().finish()
        assert res.worker_error is not None and res.server_error is not None
        flat_err = (res.worker_error.clone(), res.server_error.clone())
        outs["flat"].append(res.out.clone())
        sent["flat"] = res.bytes_sent
    # the flat path's bytes to ranks of the other node: 2 phases x its peers there x one message
    sent["flat_cross"] = 2 * (world - LOCAL) * layout.message_bytes
    dist.barrier()
    # numpy, not tensors: a tensor's shared-memory handle can vanish with the process before the parent reads it
    arrays = {k: [t.numpy() for t in v] for k, v in outs.items()}
    return {"outs": arrays, "sent": sent, "message_bytes": layout.message_bytes}


def test_hierarchical_matches_the_oracle_and_sends_half_across_nodes() -> None:
    out = run_in_processes(_core, NODES * LOCAL, timeout=240)
    for o in out:
        o["outs"] = {k: [torch.from_numpy(a) for a in v] for k, v in o["outs"].items()}
    oracle = HierOracle()
    lay = oracle.layout
    mask = lay.table.mask
    for step in range(STEPS):
        xs = [_inputs(step, r, lay) for r in range(NODES * LOCAL)]
        want = oracle.step(xs)
        for r in range(NODES * LOCAL):
            got = out[r]["outs"]["ref"][step]
            torch.testing.assert_close(torch.where(mask, got, 0.0), want, rtol=1e-5, atol=1e-6)
            # the buffer-reusing CPU path: the same result up to the last bits of a scale
            torch.testing.assert_close(out[r]["outs"]["fast"][step], got, rtol=1e-5, atol=1e-6)
            # replicas are bit-identical: every rank decodes the same bytes
            assert torch.equal(got, out[0]["outs"]["ref"][step])
    # as close to the true mean as the flat path (both are 1-bit with error feedback; averaged over the steps)
    hier_err = flat_err = 0.0
    for step in range(STEPS):
        true = torch.stack([_inputs(step, r, lay) for r in range(NODES * LOCAL)]).mean(0)
        hier_err += float((out[0]["outs"]["ref"][step] - true)[mask].norm() / true[mask].norm())
        flat_err += float((out[0]["outs"]["flat"][step] - true)[mask].norm() / true[mask].norm())
    assert hier_err < 1.1 * flat_err
    for o in out:
        s = o["sent"]
        # between nodes: 2 phases x 1 peer x one message per rank; the flat path sends 2 x 2 messages there
        assert s["ref"] == s["fast"] == 2 * (NODES - 1) * o["message_bytes"]
        assert s["ref"] * LOCAL <= 0.55 * s["flat_cross"] * LOCAL
        assert s["intra"] > 0


def test_resolve_hierarchical() -> None:
    assert resolve_hierarchical("auto", 4, 2) is True
    assert resolve_hierarchical("auto", 4, 4) is False  # one node
    assert resolve_hierarchical("auto", 4, 1) is False  # one process per node
    assert resolve_hierarchical("auto", 6, 4) is False  # does not split
    assert resolve_hierarchical(False, 4, 2) is False
    assert resolve_hierarchical(True, 4, 1) is True
    with pytest.raises(ValueError, match="processes per node"):
        resolve_hierarchical(True, 6, 4)
    # one node of several processes (no `processes_per_node`): nothing to split, one line that says so
    with pytest.raises(ValueError, match=r"`hierarchical=True` needs several nodes, got one node of 2 processes") as e:
        resolve_hierarchical(True, 2, 2)
    assert "\n" not in str(e.value) and "`processes_per_node=`" in str(e.value)
    with pytest.raises(ValueError, match="`hierarchical`"):
        resolve_hierarchical("yes", 4, 2)  # type: ignore[arg-type]


def _fit(rank: int, world: int, tmp: str, hierarchical: bool, signal: str, resume: bool) -> dict[str, Any]:
    node, local = divmod(rank, LOCAL)
    os.environ.update(LOCAL_RANK=str(local), NODE_RANK=str(node), GROUP_RANK=str(node), LOCAL_WORLD_SIZE=str(LOCAL))
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_accel.strategies import OneBitDDPStrategy
    from tests.tiny import CheckpointModel, tiny_loader

    L.seed_everything(0)
    model = CheckpointModel()  # Adam: the compressed momentum with a frozen variance
    strategy = OneBitDDPStrategy(
        warmup_steps=3,
        compression="1bit",
        compressed_signal=signal,
        hierarchical=hierarchical,
        overlap=False,
        log_stats=False,
    )
    ckpt = ModelCheckpoint(dirpath=f"{tmp}/ckpt", save_last=True, every_n_train_steps=6, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=12 if resume else 6,
        accelerator="cpu",
        devices=LOCAL,
        num_nodes=NODES,
        strategy=strategy,
        logger=False,
        callbacks=[ckpt],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, tiny_loader(), ckpt_path=f"{tmp}/ckpt/last.ckpt" if resume else None)
    state = strategy.onebit_state
    assert state is not None
    topo = strategy.node_topology
    return {
        "topology": None if topo is None else (topo.nodes, topo.local_size, topo.node, topo.local_rank),
        "params": [p.detach().numpy().copy() for p in model.parameters()],  # numpy: no shared-memory handles
        "worker_sizes": sorted(g.worker_error.numel() for g in state.groups.values()),
        "padded": sorted(g.layout.padded_numel for g in state.groups.values()),
        "compressed_calls": state.stats.compressed_calls,
        "layout_key": state.layout_key,
    }


# the momentum path, the flat path beside it, and the gradient path (its comm thread has groups of its own)
@pytest.mark.parametrize(("hierarchical", "signal"), [(True, "auto"), (False, "auto"), (True, "gradients")])
def test_ddp_1bit_trains_and_resumes_hierarchically(tmp_path: Path, hierarchical: bool, signal: str) -> None:
    args = (str(tmp_path), hierarchical, signal)
    first = run_in_processes(_fit, NODES * LOCAL, (*args, False), init_process_group=False)
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    saved = ckpt["lightning_accel_onebit"]
    assert saved["nodes_layout"] == ([LOCAL, NODES] if hierarchical else None)
    second = run_in_processes(_fit, NODES * LOCAL, (*args, True), init_process_group=False)
    for out in (first, second):
        for r, o in enumerate(out):
            assert o["compressed_calls"] > 0
            for a, b in zip(o["params"], out[0]["params"], strict=True):  # replicas stay identical
                assert (a == b).all()
            if hierarchical:
                assert o["topology"] == (NODES, LOCAL, *divmod(r, LOCAL))
                # the worker error is per shard: 2 of the group's 4 chunks
                assert o["worker_sizes"] == [p // LOCAL for p in o["padded"]]
            else:
                assert o["topology"] is None and o["worker_sizes"] == o["padded"]
    # the resumed run adopted the saved per-shard error state (no reset warning path: same layout)
    assert second[0]["layout_key"] == saved["nodes_layout"]


class _FakeState:
    """What ``gather_state_dict`` reads of a ``OneBitState``: its ``state_dict`` and ``process_group``."""

    process_group = None

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def state_dict(self) -> dict[str, Any]:
        r = self.rank
        return {
            "world_size": self.world_size,
            "step": 3,
            "groups": {
                "0": {"worker": torch.arange(10.0).reshape(2, 5) + 100 * r, "server": torch.arange(5.0) - r},
                "1": {"worker": torch.full((7,), float(r)), "server": torch.tensor([r + 0.5], dtype=torch.float64)},
            },
        }


def _gather(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_accel.comm import gather_state_dict, gather_state_dict_async

    def plain(groups: dict[str, Any]) -> dict[str, Any]:  # tensors do not outlive their process through the queue
        return {k: {t: (str(x.dtype), list(x.shape), x.tolist()) for t, x in v.items()} for k, v in groups.items()}

    everyone = gather_state_dict(_FakeState(rank, world_size))  # type: ignore[arg-type]
    to_zero = gather_state_dict(_FakeState(rank, world_size), dst=0)  # type: ignore[arg-type]
    assert everyone is not None
    # issued asynchronously: what is sent is copied at the call, so a step that changes the errors afterwards (the
    # next one, while the collective may still run) does not reach the saved state
    live = _FakeState(rank, world_size)
    groups = live.state_dict()["groups"]
    live.state_dict = lambda: {"world_size": world_size, "step": 3, "groups": groups}  # type: ignore[method-assign]
    deferred, works = gather_state_dict_async(live, dst=0)  # type: ignore[arg-type]
    for v in groups.values():
        for x in v.values():
            x.fill_(-7)
    for work in works:
        work.wait()
    later = deferred.result() if deferred is not None else None
    return {
        "everyone": plain(everyone["groups"]),
        "to_zero": None if to_zero is None else plain(to_zero["groups"]),
        "async": None if later is None else plain(later["groups"]),
        "async_works": len(works),
    }


def test_the_error_state_is_gathered_in_one_collective_per_dtype_and_only_to_the_writer_with_dst() -> None:
    """Every group's worker and server errors, of two dtypes, come back stacked by rank with their shapes and
    dtypes; with ``dst=0`` rank 0 gets exactly what the all-gather gives and the other rank gets None."""
    out = run_in_processes(_gather, 2, timeout=120)

    def stacked(make: Any) -> tuple[str, list[int], list]:
        x = torch.stack([make(r) for r in (0, 1)])
        return str(x.dtype), list(x.shape), x.tolist()

    for rank in (0, 1):
        g = out[rank]["everyone"]
        assert g["0"]["worker"] == stacked(lambda r: torch.arange(10.0).reshape(2, 5) + 100 * r)
        assert g["0"]["server"] == stacked(lambda r: torch.arange(5.0) - r)
        assert g["1"]["worker"] == stacked(lambda r: torch.full((7,), float(r)))
        assert g["1"]["server"] == ("torch.float64", [2, 1], [[0.5], [1.5]])
    assert out[1]["to_zero"] is None
    assert out[0]["to_zero"] == out[0]["everyone"]
    # the asynchronous gather gives rank 0 the same state, as it was when issued; one collective per dtype each
    assert out[0]["async"] == out[0]["everyone"] and out[1]["async"] is None
    assert out[0]["async_works"] == out[1]["async_works"] == 2


def _fits_in_one_process(rank: int, world: int, tmp: str) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank))
    import lightning as L
    from torch.distributed.distributed_c10d import _world

    from lightning_accel.strategies import OneBitDDPStrategy
    from tests.tiny import CheckpointModel, tiny_loader

    def live_groups() -> int:
        return len(_world.pg_map)  # every process group this process holds, the default one included

    counts, layouts, calls = [], [], []
    # the momentum path, then the gradient path (its comm thread makes groups of its own, the layout's included)
    for signal in ("auto", "gradients"):
        # 2 nodes x 1 process: the layout of two machines, simulated by the two processes of this one
        strategy = OneBitDDPStrategy(
            warmup_steps=2,
            compression="1bit",
            compressed_signal=signal,
            hierarchical=True,
            processes_per_node=1,
            overlap=False,
            log_stats=False,
        )
        trainer = L.Trainer(
            max_steps=4,
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp,
        )
        trainer.fit(CheckpointModel(), tiny_loader())
        counts.append(live_groups())
        topo, state = strategy.node_topology, strategy.onebit_state
        assert topo is not None and state is not None
        layouts.append((topo.nodes, topo.local_size))
        calls.append(state.stats.compressed_calls)
    return {"counts": counts, "layouts": layouts, "calls": calls}


def test_repeated_hierarchical_fits_leave_no_process_groups_behind(tmp_path: Path) -> None:
    """Each fit makes the intra- and cross-node groups (and the comm thread its copies of them); its teardown destroys
    them on every rank, so fits in one process leave only the default group alive, whatever their number."""
    out = run_in_processes(_fits_in_one_process, 2, (str(tmp_path),), init_process_group=False)
    for o in out:
        assert o["layouts"] == [(2, 1), (2, 1)]  # hierarchical both times; the numbers stay readable after the fit
        assert all(c > 0 for c in o["calls"])
        assert o["counts"] == [1, 1]
