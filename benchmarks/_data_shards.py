"""Benchmark cases of the data cache's packed-origin features: the shard-window shuffle and multi-node sharing.

Imported by ``benchmarks/data_cache.py`` (each function returns ``(results, ratios)``); runnable on its own:
``python benchmarks/_data_shards.py --quick --out FILE.json``.

- :func:`run_windowed_s3`: a packed origin on S3 (moto), ``stage_bytes`` = 1/4 of the pack. One cold epoch under the
  window shuffle (``ShardWindowSampler``, window from ``auto_window``) and one under the global shuffle, 2 workers,
  fresh caches each: bytes read from S3 over the data set's bytes (``windowed_s3_bytes_over_dataset``, target
  <= 1.1). And the accuracy cost of the window: the digits (16 px, 1,797 images, a 20 % validation split) trained
  for the same epochs three ways: global shuffle, window shuffle over a shuffled pack (``pack_origin(...,
  shuffle_seed=0)``), window shuffle over a class-sorted pack; final ``val_acc`` of each (mean over seeds).
- :func:`run_augment_placement`: ``GpuAugment``'s CPU fallback in the training step against on the loader's
  background thread (``CachedDataModule(cpu_augment=...)``), 2 DDP processes, warm epochs
  (``augment_step_over_thread``: seconds per epoch in the step over on the thread).
- :func:`run_multinode`: 2 simulated nodes x 2 ranks (4 gloo processes, ``Trainer(num_nodes=2, devices=2)``, node
  from ``NODE_RANK``, ``{node_rank}`` in ``cache_dir`` / ``ram_dir``), a packed origin on S3, 2 epochs (``--quick``:
  480 images, main-process reads; full: 3,200 images, 1 worker per rank): per node, samples decoded over the
  distinct samples its ranks read (``multinode_redecode_ratio``, max over nodes, target <= 1.0), and bytes fetched
  over the bytes of the distinct shards its ranks read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/_data_shards.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L
import torch

from benchmarks._harness import median, parser, ratio, report

BATCH = 32
WORKERS = 2


def _upload_pack(root: Path, url: str, opts: dict[str, Any], shards: int) -> Any:
    from lightning_accel.data import pack_origin

    total = sum(p.stat().st_size for p in root.rglob("*.jpg"))
    return pack_origin(str(root), url, dest_storage_options=opts, shard_bytes=max(1, total // shards), shuffle_seed=0)


@contextlib.contextmanager
def _packed_digits(
    prefix: str, bucket: str, *, size: int, n_images: int, shards: int
) -> Iterator[tuple[Path, str, dict[str, Any], Any]]:
    """The digits rendered at ``size`` px and packed into ``shards`` shards on a local S3 bucket (moto): yields
    ``(work dir, url, storage options, listing)``; the S3 server and the work dir go on exit."""
    from benchmarks.data_cache import local_s3
    from lightning_accel.datasets import materialize_digits

    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        with local_s3() as opts:
            import fsspec

            root = work / f"digits{size}"
            materialize_digits(root, size=size, num_images=n_images)
            fsspec.filesystem("s3", skip_instance_cache=True, **opts).call_s3("create_bucket", Bucket=bucket)
            url = f"s3://{bucket}/packed"
            yield work, url, opts, _upload_pack(root, url, opts, shards)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cold_epoch(url: str, opts: dict[str, Any], work: Path, stage: int, window: int | None) -> tuple[float, int]:
    """One cold epoch through fresh directories; returns (seconds, bytes read from the origin)."""
    from lightning_accel.data import (
        CacheDataLoader,
        CachedDataset,
        EpochOrderSampler,
        ImageDecoder,
        LmdbTier,
        ObjectStore,
        SampleCache,
        list_origin,
    )
    from lightning_accel.data.sampler import ShardWindowSampler

    d = Path(tempfile.mkdtemp(dir=work))
    store = ObjectStore(url, opts, max_concurrency=16)
    listing = list_origin(store)
    cache = SampleCache(
        store,
        listing,
        ImageDecoder(64),
        ssd=LmdbTier(d / "ssd", 1 << 30),
        stage_dir=d / "shards",
        stage_bytes=stage,
        max_pending=4 * BATCH,
    )
    ds = CachedDataset(cache, prefetch_batches=2)
    sampler: EpochOrderSampler
    if window is None:
        sampler = EpochOrderSampler(ds, seed=0, batch_size=BATCH)
    else:
        sampler = ShardWindowSampler(ds, listing.pack.shard, window=window, seed=0, batch_size=BATCH)
    loader = CacheDataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=WORKERS, warm_num_workers=None)
    t0 = time.perf_counter()
    n = sum(len(y) for _, y in loader)
    dt = time.perf_counter() - t0
    assert n == len(ds), (n, len(ds))
    fetched = int(cache.stats.as_dict()["bytes_fetched"])
    shutil.rmtree(d, ignore_errors=True)
    return dt, fetched


def _val_acc(origin: str, work: Path, *, shuffle: str, window: int | None, epochs: int, seed: int) -> float:
    import lightning as L

    from lightning_accel.data import CachedDataModule
    from lightning_accel.models import ImageClassifier

    L.seed_everything(seed, workers=True, verbose=False)
    d = Path(tempfile.mkdtemp(dir=work))
    dm = CachedDataModule(
        origin,
        cache_dir=str(d / "cache"),
        ram_dir=str(d / "ram"),
        ram_bytes="32MiB",
        image_size=16,
        batch_size=BATCH,
        num_workers=0,
        val_fraction=0.2,
        seed=seed,
        shuffle=shuffle,
        shuffle_window=None if shuffle == "global" else window,  # a window means nothing to the global shuffle
        mean=(0.19,) * 3,
        std=(0.32,) * 3,
    )
    model = ImageClassifier(width=16, blocks=(1, 1))
    model.example_input_array = None
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm)
    acc = float(trainer.callback_metrics["val_acc"])
    shutil.rmtree(d, ignore_errors=True)
    return acc


def _accuracy(work: Path, quick: bool) -> dict[str, Any]:
    """val_acc of the digits under the global shuffle and the window shuffle (shuffled and class-sorted packs)."""
    from lightning_accel.data import pack_origin
    from lightning_accel.data.sampler import auto_window
    from lightning_accel.datasets import materialize_digits

    root = work / "digits16"
    materialize_digits(root, size=16)
    total = sum(p.stat().st_size for p in root.rglob("*.jpg"))
    shard = max(1, total // 16)  # 16 shards, a window from a stage of 1/4 of the pack, as on S3
    mixed = pack_origin(str(root), str(work / "mixed"), shard_bytes=shard, shuffle_seed=0)
    pack_origin(str(root), str(work / "sorted"), shard_bytes=shard)
    assert mixed.pack is not None
    window = auto_window(total // 4, mixed.pack.shard_sizes)
    epochs, seeds = (6, [0]) if quick else (10, [0, 1, 2])
    runs = {
        "global": (str(root), "global"),
        "window_shuffled_pack": (str(work / "mixed"), "window"),
        "window_sorted_pack": (str(work / "sorted"), "window"),
    }
    acc = {
        k: [_val_acc(o, work, shuffle=s, window=window, epochs=epochs, seed=sd) for sd in seeds]
        for k, (o, s) in runs.items()
    }
    mean = {k: sum(v) / len(v) for k, v in acc.items()}
    return {
        "acc_epochs": epochs,
        "acc_seeds": seeds,
        "acc_window_shards": window,
        "acc_shards": len(mixed.pack.shards),
        "val_acc": mean,
        "val_acc_runs": acc,
        "window_acc_cost_shuffled_pack": mean["global"] - mean["window_shuffled_pack"],
        "window_acc_cost_sorted_pack": mean["global"] - mean["window_sorted_pack"],
    }


def run_windowed_s3(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Packed S3 origin, ``stage_bytes`` = 1/4 of the pack: bytes per cold epoch under the window and the global
    shuffle (alternated), and the accuracy cost of the window on the digits."""
    from lightning_accel.data.sampler import auto_window

    n_images, shards, repeats = (1024, 16, 1) if quick else (4096, 32, 3)
    with _packed_digits("la-bench-shards-", "shards", size=64, n_images=n_images, shards=shards) as (
        work,
        url,
        opts,
        listing,
    ):
        pack_bytes = sum(listing.pack.shard_sizes)
        stage = pack_bytes // 4
        window = auto_window(stage, listing.pack.shard_sizes)
        runs: dict[str, list[tuple[float, int]]] = {"window": [], "global": []}
        for _ in range(repeats):
            for name, w in (("window", window), ("global", None)):
                runs[name].append(_cold_epoch(url, opts, work, stage, w))
        acc = _accuracy(work, quick)
    by = {k: median([b for _, b in v]) / pack_bytes for k, v in runs.items()}
    secs = {k: median([t for t, _ in v]) for k, v in runs.items()}
    results = {
        "windowed_s3": {
            "images": n_images,
            "image_size": 64,
            "pack_bytes": pack_bytes,
            "shards": len(listing.pack.shards),
            "stage_bytes": stage,
            "window_shards": window,
            "bytes_over_dataset": by,
            "cold_epoch_s": secs,
            "cold_window_over_global_speed": ratio(secs["global"], secs["window"]),
            **acc,
        }
    }
    return results, {"windowed_s3_bytes_over_dataset": round(by["window"], 4)}


def _mn_rank(
    rank: int, world: int, url: str, opts: dict[str, Any], tmp: str, per_node: int, workers: int
) -> dict[str, Any]:
    node, local = divmod(rank, per_node)
    os.environ.update(LOCAL_RANK=str(local), NODE_RANK=str(node), GROUP_RANK=str(node), LOCAL_WORLD_SIZE=str(per_node))
    import lightning as L

    from lightning_accel.data import CachedDataModule
    from lightning_accel.models import ImageClassifier

    dm = CachedDataModule(
        url,
        storage_options=opts,
        cache_dir=f"{tmp}/node{{node_rank}}/cache",
        ram_dir=f"{tmp}/node{{node_rank}}/ram",
        ram_bytes="64MiB",
        image_size=32,
        batch_size=BATCH,
        num_workers=workers,
        val_fraction=0.1,
        mean=(0.19,) * 3,
        std=(0.32,) * 3,
    )
    model = ImageClassifier(width=8, blocks=(1,))
    model.example_input_array = None
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=per_node,
        num_nodes=world // per_node,
        strategy="ddp",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    fit_s = time.perf_counter() - t0
    sampler: Any = trainer.train_dataloader.sampler
    ds: Any = sampler.dataset
    read: list[int] = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        read += [ds.indices[p] for p in sampler.epoch_order()]
    vs: Any = trainer.val_dataloaders.sampler
    read += [vs.dataset.indices[p] for p in vs.epoch_order()]
    pack = ds.cache.listing.pack
    return {
        "node": node,
        "read": sorted(set(read)),
        "local": dm.cache_stats,
        "global": dm.global_cache_stats(),
        "fit_s": fit_s,
        "shard_of": list(pack.shard),
        "shard_sizes": list(pack.shard_sizes),
    }


def run_multinode(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """2 nodes x 2 ranks, 2 epochs over a packed S3 origin: decodes and shard fetches per node."""
    from benchmarks import _data_shards as this  # spawned ranks import the function by this module's name
    from tests.helpers import run_in_processes

    nodes, per_node = 2, 2
    # quick: main-process reads (4 ranks + 4 workers oversubscribe 2 shared cores past the --quick budget); full: 1
    # worker per rank
    n_images, workers = (480, 0) if quick else (3200, 1)
    with _packed_digits("la-bench-nodes-", "nodes", size=32, n_images=n_images, shards=8) as (work, url, opts, _):
        out = run_in_processes(
            this._mn_rank,
            nodes * per_node,
            (url, opts, str(work), per_node, workers),
            init_process_group=False,
            timeout=600,
        )
    shard_of, sizes = out[0]["shard_of"], out[0]["shard_sizes"]
    per_node_rows = {}
    for node in range(nodes):
        ranks = [o for o in out if o["node"] == node]
        read = {i for o in ranks for i in o["read"]}
        decoded = sum(o["local"]["origin_fetches"] for o in ranks)
        shard_bytes = sum(sizes[s] for s in {shard_of[i] for i in read})
        per_node_rows[f"node{node}"] = {
            "distinct_samples_read": len(read),
            "decoded": decoded,
            "redecode_ratio": decoded / max(1, len(read)),
            "bytes_fetched": sum(o["local"]["bytes_fetched"] for o in ranks),
            "shard_fetch_ratio": sum(o["local"]["bytes_fetched"] for o in ranks) / max(1, shard_bytes),
        }
    g = out[0]["global"]
    results = {
        "multinode": {
            "nodes": nodes,
            "ranks_per_node": per_node,
            "images": n_images,
            "workers_per_rank": workers,
            "epochs": 2,
            "per_node": per_node_rows,
            "global_stats": {k: g[k] for k in ("requests", "ram_hits", "ssd_hits", "origin_fetches", "hit_rate")},
            "fit_s_max": max(o["fit_s"] for o in out),
        }
    }
    worst = max(r["redecode_ratio"] for r in per_node_rows.values())
    return results, {"multinode_redecode_ratio": round(worst, 4)}


class _EpochTimes(L.Callback):
    """Keeps each training epoch's wall time."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.times: list[float] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.t0 = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.times.append(time.perf_counter() - self.t0)


def _aug_rank(rank: int, world: int, origin: str, tmp: str, epochs: int, repeats: int) -> dict[str, list[float]]:
    from lightning_accel.data import CachedDataModule, GpuAugment
    from lightning_accel.models import ImageClassifier

    torch.set_num_threads(1)
    out: dict[str, list[float]] = {"thread": [], "step": []}
    for r in range(repeats):
        for mode in ("thread", "step") if r % 2 == 0 else ("step", "thread"):
            L.seed_everything(r, verbose=False)
            aug = GpuAugment((0.19,) * 3, (0.32,) * 3, size=56, crop_scale=(0.35, 1.0), brightness=0.2, contrast=0.2)
            dm = CachedDataModule(
                origin,
                cache_dir=f"{tmp}/{mode}{r}/cache",
                ram_dir=f"{tmp}/{mode}{r}/ram",
                ram_bytes="64MiB",
                image_size=64,
                batch_size=BATCH,
                num_workers=0,
                val_fraction=0.1,
                train_augment=aug,
                mean=(0.19,) * 3,
                std=(0.32,) * 3,
                cpu_augment=mode,
            )
            model = ImageClassifier(width=16, blocks=(1, 1))
            model.example_input_array = None
            timer = _EpochTimes()
            trainer = L.Trainer(
                max_epochs=epochs,
                accelerator="cpu",
                devices=world,
                strategy="ddp",
                logger=False,
                enable_progress_bar=False,
                enable_checkpointing=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
                callbacks=[timer],
            )
            trainer.fit(model, datamodule=dm)
            out[mode] += timer.times[1:]  # warm epochs: the first decodes
    return out


def run_augment_placement(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Where the CPU fallback of ``GpuAugment`` runs: in the training step or on the loader's background thread.

    2 DDP processes (gloo) on the 2 cores, 1 torch thread each, a small CNN on the 64 px digits (56 px crops, colour
    jitter), warm epochs (the cache is full after the first), the two placements alternated: seconds per warm epoch
    (max over ranks, median over epochs)."""
    from benchmarks import _data_shards as this  # spawned ranks import the function by this module's name
    from lightning_accel.datasets import materialize_digits
    from tests.helpers import run_in_processes

    n_images, epochs, repeats = (1024, 3, 2) if quick else (1797, 4, 4)
    work = Path(tempfile.mkdtemp(prefix="la-bench-aug-"))
    try:
        materialize_digits(work / "digits64", size=64, num_images=n_images)
        args = (str(work / "digits64"), str(work), epochs, repeats)
        out = run_in_processes(this._aug_rank, 2, args, init_process_group=False, timeout=900)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per = {m: [max(t) for t in zip(*(o[m] for o in out), strict=True)] for m in ("thread", "step")}
    secs = {m: median(v) for m, v in per.items()}
    results = {
        "augment_placement": {
            "images": n_images,
            "ranks": 2,
            "warm_epoch_s": {m: [round(x, 3) for x in v] for m, v in per.items()},
            "median_warm_epoch_s": {m: round(v, 4) for m, v in secs.items()},
        }
    }
    return results, {"augment_step_over_thread": ratio(secs["step"], secs["thread"])}


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for case in (run_windowed_s3, run_multinode, run_augment_placement):
        r, q = case(args.quick)
        results.update(r)
        ratios.update(q)
    config = {"batch_size": BATCH, "num_workers": WORKERS, "torch_threads": 1}
    report("data_shards", quick=args.quick, config=config, results=results, ratios=ratios, out=args.out)


if __name__ == "__main__":
    main()
