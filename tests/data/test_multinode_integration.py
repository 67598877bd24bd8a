"""Two simulated nodes x two ranks (4 gloo processes, one launch): each node's ranks share one cache and one stage
directory (``{node_rank}`` in ``cache_dir`` / ``ram_dir``), every sample is decoded once per node and every shard
fetched once per node, the ranks' splits are disjoint, and cache statistics are summed across ranks and logged once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from typing_extensions import override

from lightning_accel.data import pack_origin
from tests.helpers import run_in_processes

NODES, PER_NODE = 2, 2


class _Recorder(Logger):
    """Records every ``log_metrics`` call on every rank (Lightning's own loggers only act on rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, float]] = []

    @property
    @override
    def name(self) -> str:
        return "recorder"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append(dict(metrics))

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _rank(rank: int, world: int, url: str, opts: dict[str, Any], tmp: str) -> dict[str, Any]:
    # what a launcher sets on each node (torchrun: GROUP_RANK; Lightning, SLURM: NODE_RANK)
    node, local = divmod(rank, PER_NODE)
    os.environ.update(LOCAL_RANK=str(local), NODE_RANK=str(node), GROUP_RANK=str(node), LOCAL_WORLD_SIZE=str(PER_NODE))
    import lightning as L
    import torch

    from lightning_accel.data import CachedDataModule
    from lightning_accel.models import ImageClassifier

    dm = CachedDataModule(
        url,
        storage_options=opts,
        cache_dir=f"{tmp}/node{{node_rank}}/cache",
        ram_dir=f"{tmp}/node{{node_rank}}/ram",
        ram_bytes="4MiB",
        image_size=16,
        batch_size=20,
        num_workers=0,
        val_fraction=0.2,
        shuffle="window",
        shuffle_window=2,
        log_every_n_steps=1,
    )
    model = ImageClassifier(width=8, blocks=(1,))
    model.example_input_array = None
    recorder = _Recorder()
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=PER_NODE,
        num_nodes=NODES,
        strategy="ddp",
        logger=recorder,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_rank == rank and trainer.node_rank == node
    sampler: Any = trainer.train_dataloader.sampler
    ds: Any = sampler.dataset
    train = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        train.append([ds.indices[p] for p in sampler.epoch_order()])
    val_sampler: Any = trainer.val_dataloaders.sampler
    val = [val_sampler.dataset.indices[p] for p in val_sampler.epoch_order()]
    logged = [c for c in recorder.calls if any(k.startswith("cache/") for k in c)]
    return {
        "node": node,
        "cache_dir": dm.cache_dir,
        "local": dm.cache_stats,
        "global": dm.global_cache_stats(),  # a collective, on every rank
        "train": train,
        "val": val,
        "logged": logged[-1] if logged else None,
        "n_logged": len(logged),
        "shard_of": list(ds.cache.listing.pack.shard),
        "shard_sizes": list(ds.cache.listing.pack.shard_sizes),
        "threads": torch.get_num_threads(),
    }


def test_two_nodes_of_two_ranks_decode_and_fetch_once_per_node(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    listing = pack_origin(str(small_digits), url, dest_storage_options=opts, shard_bytes=6_000, shuffle_seed=0)
    assert listing.pack is not None
    out = run_in_processes(_rank, NODES * PER_NODE, (url, opts, str(tmp_path)), init_process_group=False, timeout=420)
    assert [o["node"] for o in out] == [0, 0, 1, 1]
    assert out[0]["cache_dir"] == out[1]["cache_dir"] != out[2]["cache_dir"] == out[3]["cache_dir"]
    for epoch in range(2):  # 160 training samples, 40 per rank, disjoint
        parts = [set(o["train"][epoch]) for o in out]
        assert sum(len(p) for p in parts) == len(set().union(*parts)) == 160
    shard_of, sizes = out[0]["shard_of"], out[0]["shard_sizes"]
    for node in range(NODES):
        ranks = [o for o in out if o["node"] == node]
        read = {i for o in ranks for i in o["train"][0] + o["train"][1] + o["val"]}
        decoded = sum(o["local"]["origin_fetches"] for o in ranks)
        assert decoded == len(read)  # each sample the node read decoded once on the node
        fetched = sum(o["local"]["bytes_fetched"] for o in ranks)
        assert fetched == sum(sizes[s] for s in {shard_of[i] for i in read})  # each shard fetched once per node
    total = {k: sum(o["local"][k] for o in out) for k in ("requests", "ram_hits", "ssd_hits", "origin_fetches")}
    for o in out:  # summed over the 4 ranks, the same on every rank; rates from the sums
        assert {k: o["global"][k] for k in total} == total
        assert o["global"]["hit_rate"] == (total["ram_hits"] + total["ssd_hits"]) / total["requests"]
    assert out[0]["n_logged"] > 0 and all(o["n_logged"] == 0 for o in out[1:])  # logged once, by global rank 0
    # the last logged step (end of epoch 2's training): ~4 x 90 requests summed over ranks; rank 0 alone ends at 100
    assert out[0]["logged"]["cache/requests"] > 2 * out[0]["local"]["requests"]
