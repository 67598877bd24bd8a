"""``strategy="ddp_1bit"`` with ``compression="fp32"`` is plain DDP: on a 2 x 2 layout (4 gloo processes, node-major
ranks, where ``hierarchical="auto"`` would average hierarchically) with Adam and every default, its training steps
issue DDP's bucket allreduces and nothing else (no warm-up check, no trial), it makes no node process groups, and its
checkpoint still names the node layout, so a resume with ``compression="1bit"`` adopts it without a reset warning and
compresses hierarchically."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from tests.helpers import run_in_processes

NODES, LOCAL = 2, 2
STEPS = 12  # past warmup_steps="auto"'s first check (step 10)


def _fit(rank: int, world: int, tmp: str, compression: str, resume: bool) -> dict[str, Any]:
    node, local = divmod(rank, LOCAL)
    os.environ.update(LOCAL_RANK=str(local), NODE_RANK=str(node), GROUP_RANK=str(node), LOCAL_WORLD_SIZE=str(LOCAL))
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.distributed_c10d import _world

    from lightning_accel.strategies import OneBitDDPStrategy
    from tests.tiny import CheckpointModel, tiny_loader

    counts = {"all_reduce": 0}
    in_batch = [0]
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        counts["all_reduce"] += in_batch[0]  # Lightning's own setup reduces (the loaders' lengths) are not steps
        return original(*args, **kwargs)

    groups: list[int] = []

    class Probe(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            in_batch[0] = 1

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            in_batch[0] = 0
            groups.append(len(_world.pg_map))  # every process group this process holds, the default one included

    L.seed_everything(0)
    strategy = OneBitDDPStrategy(compression=compression, log_stats=False)  # Adam, warmup_steps="auto"
    trainer = L.Trainer(
        max_steps=2 * STEPS if resume else STEPS,
        accelerator="cpu",
        devices=LOCAL,
        num_nodes=NODES,
        strategy=strategy,
        logger=False,
        callbacks=[Probe()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    ckpt = f"{tmp}/fp32.ckpt"
    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(CheckpointModel(), tiny_loader(), ckpt_path=ckpt if resume else None)
    finally:
        dist.all_reduce = original
    if not resume:
        trainer.save_checkpoint(ckpt)
    state = strategy.onebit_state
    assert state is not None
    topo = strategy.node_topology
    return {
        "all_reduce": counts["all_reduce"],
        "bucket_allreduces": state.stats.uncompressed_calls,
        "compressed_calls": state.stats.compressed_calls,
        "groups": groups,
        "topology": None if topo is None else (topo.nodes, topo.local_size),
        "overlap": (strategy.overlap, strategy.overlap_decision),
        "layout_key": state.layout_key,
        "warmup_end": state.warmup_end,
        "resets": [str(w.message) for w in caught if "reset" in str(w.message)],
    }


def test_fp32_runs_plain_ddp_and_its_checkpoint_resumes_into_hierarchical_1bit(tmp_path: Path) -> None:
    plain = run_in_processes(_fit, NODES * LOCAL, (str(tmp_path), "fp32", False), init_process_group=False)
    for o in plain:
        # one fp32 allreduce per DDP bucket and step, and no other collective of the strategy's
        assert o["bucket_allreduces"] >= STEPS and o["all_reduce"] == o["bucket_allreduces"], o
        assert o["compressed_calls"] == 0
        assert o["groups"] == [1] * STEPS and o["topology"] is None, o  # no node groups were made
        assert o["layout_key"] == [LOCAL, NODES]
        assert o["overlap"] == (False, None)  # no compressed momentum: nothing starts during backward
    saved = torch.load(tmp_path / "fp32.ckpt", weights_only=True)["lightning_accel_onebit"]
    assert saved["nodes_layout"] == [LOCAL, NODES] and saved["decision"] == "fp32"

    resumed = run_in_processes(_fit, NODES * LOCAL, (str(tmp_path), "1bit", True), init_process_group=False)
    for o in resumed:
        assert o["topology"] == (NODES, LOCAL) and o["layout_key"] == [LOCAL, NODES]
        assert o["warmup_end"] == saved["warmup_end"] and o["compressed_calls"] > 0, o
        assert o["resets"] == [], o["resets"]
