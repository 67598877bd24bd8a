"""Benchmark: the decoded-sample cache against torchvision ``ImageFolder`` + ``DataLoader``.

Data: the digits rendered as 224 px JPEGs (2,048 in ``--quick``, 4,096 in the full run), batch 64, 2 workers, and
the same decoded uint8 tensors on both sides (``ImageDecoder(224)`` is ``Resize -> CenterCrop -> PILToTensor`` after
``ImageFolder``'s loader; checked bit for bit before timing). Cases, alternated round by round:

a. ``imagefolder``: ImageFolder + DataLoader from local disk, decoding every epoch (the baseline);
b. ``cold_local``: a first epoch through an empty cache from the local directory (decode + write the tiers);
c. ``cold_s3``: the same from S3 (moto's ThreadedMotoServer on 127.0.0.1, in its own process), from the data set
   packed once into 4 MiB shards (``pack_origin``, before timing; the shards hold the JPEGs' bytes unchanged), with
   read-ahead of whole shards in sampler order; also ``cold_s3_tree``: from the plain ImageFolder tree on S3, one
   GET per JPEG (what a packed origin avoids);
d. ``first_warm``: the epoch right after ``cold_local``'s, alone (the loader switches from the cold pass's workers
   to main-process batch reads as it starts);
e. ``warm``: the steady warm epochs after it: the median of five consecutive epochs, each listed in
   ``warm_epochs_s``;
f. ``over_budget``: SSD budget half the decoded data set, RAM tier off: the second epoch's hit rate.

Then, from ``benchmarks/_data_shards.py`` when it is there (recorded as not run otherwise): the packed S3 origin with
``stage_bytes`` a quarter of the pack under the windowed shuffle, the 2-node x 2-rank run, and where ``GpuAugment``'s
CPU fallback runs (in the training step or on the loader's thread, 2 DDP processes).

``--busy-core`` keeps one core busy for the whole run with a spinning subprocess (another job on the machine; recorded
in ``config``); the 1-minute load at the start and end is in ``results`` either way.

Also measured: how fast this process writes fresh memory the first time and again (``memory_touch_gb_s``, see
:func:`memory_touch_gb_s`: on a virtual machine whose host reclaims idle memory, cold epochs pay for it), the warm
path through 2 worker processes with a RAM tier holding half the data (its hit rate with
2 workers), and the bytes read from S3 in the cold and in a warm epoch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/data_cache.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks._harness import alternate, median, parser, ratio, report, run_cases
from lightning_accel.data import (
    CacheDataLoader,
    CachedDataset,
    EpochOrderSampler,
    ImageDecoder,
    LmdbTier,
    ObjectStore,
    SampleCache,
    list_origin,
    pack_origin,
)

BATCH = 64
WORKERS = 2


_MOTO = """
import logging, time
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
ThreadedMotoServer(ip_address="127.0.0.1", port={port}, verbose=False).start()
while True:
    time.sleep(60)
"""


def _wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"moto did not listen on 127.0.0.1:{port} within {timeout} s")


def _epoch(loader: Any) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for x, _ in loader:
        n += len(x)
    return time.perf_counter() - t0, n


class Pipeline:
    """One cache (fresh directories) and its loader."""

    def __init__(
        self,
        origin: str,
        opts: dict[str, Any] | None,
        work: Path,
        *,
        ram_bytes: int,
        ssd_bytes: int,
        warm_num_workers: int | None = 0,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(dir=work))
        self.ram_dir = Path(tempfile.mkdtemp(dir="/dev/shm")) if ram_bytes else None
        store = ObjectStore(origin, opts, max_concurrency=16)
        self.cache = SampleCache(
            store,
            list_origin(store),
            ImageDecoder(224),
            ram=LmdbTier(self.ram_dir, ram_bytes, name="ram") if self.ram_dir else None,
            ssd=LmdbTier(self.dir / "ssd", ssd_bytes, name="ssd"),
            max_pending=4 * BATCH,
        )
        self.ds = CachedDataset(self.cache, prefetch_batches=2)
        self.sampler = EpochOrderSampler(self.ds, batch_size=BATCH, seed=0)
        self.loader = CacheDataLoader(
            self.ds,
            batch_size=BATCH,
            sampler=self.sampler,
            num_workers=WORKERS,
            persistent_workers=True,
            warm_num_workers=warm_num_workers,
        )
        self.epochs = 0

    def epoch(self) -> tuple[float, dict[str, Any]]:
        """Run one epoch; returns its seconds and the statistics of that epoch alone."""
        self.sampler.set_epoch(self.epochs)
        self.epochs += 1
        self.cache.stats.reset()
        dt, n = _epoch(self.loader)
        assert n == len(self.ds), (n, len(self.ds))
        return dt, self.cache.stats.as_dict()

    def close(self) -> None:
        it = getattr(self.loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.ram_dir is not None:
            shutil.rmtree(self.ram_dir, ignore_errors=True)


@contextlib.contextmanager
def local_s3() -> Iterator[dict[str, Any]]:
    """A local S3 endpoint (moto) in a process of its own; yields the fsspec ``storage_options`` that reach it.

    Fake credentials, never a developer's profile. Its own process: in this one, moto's request handling would compete
    for the GIL with the DataLoader's main loop (the S3 endpoint is part of the machine's load either way, as a real
    one is not).
    """
    from tests.helpers import free_port

    fake = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in fake.items():
        os.environ.setdefault(k, v)
    os.environ.pop("AWS_PROFILE", None)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request log lines
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", _MOTO.format(port=port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_port(port)
        yield {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
            "use_listings_cache": False,
        }
    finally:
        server.kill()
        server.wait()


@dataclass
class Dataset224:
    """The JPEG data set, prepared once before timing: a local ImageFolder tree, the same tree on S3, and a packed
    copy on S3 (4 MiB shards holding the JPEGs' bytes unchanged)."""

    root: Path
    n_images: int
    jpeg_bytes: int
    opts: dict[str, Any]
    shards: int


def prepare_data(work: Path, n_images: int, opts: dict[str, Any]) -> Dataset224:
    """Render the JPEGs, upload the tree to S3 and pack it there (before any timing)."""
    import fsspec

    from lightning_accel.datasets import materialize_digits

    root = work / "digits224"
    t0 = time.perf_counter()
    materialize_digits(root, size=224, num_images=n_images)
    files = sorted(root.rglob("*.jpg"))
    jpeg_bytes = sum(p.stat().st_size for p in files)
    s3 = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    s3.call_s3("create_bucket", Bucket="bench")  # no LocationConstraint: us-east-1 rejects one
    s3.pipe({f"bench/digits/{p.parent.name}/{p.name}": p.read_bytes() for p in files})
    packed = pack_origin(str(root), "s3://bench/packed", dest_storage_options=opts, shard_bytes=4 << 20)
    assert packed.pack is not None and sum(packed.pack.shard_sizes) == jpeg_bytes  # the JPEG bytes, unchanged
    print(f"data: {n_images} JPEGs, {jpeg_bytes / 1e6:.1f} MB, ready in {time.perf_counter() - t0:.1f} s")
    return Dataset224(root, n_images, jpeg_bytes, opts, len(packed.pack.shards))


def check_identical(data: Dataset224, work: Path, folder: Any) -> int:
    """The cache decodes to the ImageFolder pipeline's tensors bit for bit; returns the bytes of one cached entry."""
    n = data.n_images
    probe = Pipeline(str(data.root), None, work, ram_bytes=0, ssd_bytes=1 << 30)
    batch = probe.cache.load([0, 1, n - 1])
    ref = torch.stack([folder[i][0] for i in (0, 1, n - 1)])
    assert bool(torch.equal(batch.images, ref)), "the cache's decode differs from the ImageFolder pipeline"
    entry_bytes = probe.cache.ssd.cost(probe.cache.key(0), len(probe.cache.ssd.get(probe.cache.key(0)) or b""))
    probe.close()
    return entry_bytes


class Cases:
    """The timed cases (see the module docstring), each ``() -> seconds of the epoch it measures``.

    The cold cases keep their pipeline until the next round (``warm`` reads the local one); what a case observes
    besides its time goes to :attr:`extra`.
    """

    def __init__(self, data: Dataset224, work: Path, folder: Any, dataset_bytes: int) -> None:
        from torch.utils.data import DataLoader

        self.data, self.work, self.root = data, work, str(data.root)
        self.dataset_bytes = dataset_bytes
        self.full_ssd = 2 * dataset_bytes + (64 << 20)
        self.half = dataset_bytes // 2
        self.base_loader = DataLoader(
            folder, batch_size=BATCH, shuffle=True, num_workers=WORKERS, persistent_workers=True
        )
        self.state: dict[str, Pipeline | None] = {"local": None, "s3": None, "s3_tree": None}
        self.pipes: list[Pipeline] = []
        self.extra: dict[str, list[Any]] = {
            "warm_s3_bytes": [],
            "cold_s3_bytes": [],
            "cold_s3_tree_bytes": [],
            "warm_epochs_s": [],
            "first_warm_hit_rate": [],
            "first_warm_origin_bytes": [],
            "first_warm_s3_s": [],
            "over_budget_hit_rate": [],
            "over_budget_fraction": [],
            "workers_warm_s": [],
            "workers_ram_hit_rate": [],
            "workers_ssd_hit_rate": [],
        }

    def all(self) -> dict[str, Callable[[], float]]:
        """Every case by name, in the order each round runs them."""
        return {
            "imagefolder": self.imagefolder,
            "cold_local": self.cold_local,
            "first_warm": self.first_warm,
            "cold_s3": self.cold_s3,
            "cold_s3_tree": self.cold_s3_tree,
            "warm": self.warm,
            "warm_workers": self.warm_workers,
            "over_budget": self.over_budget,
        }

    def _fresh(self, slot: str, origin: str, opts: dict[str, Any] | None) -> Pipeline:
        old = self.state[slot]
        if old is not None:
            old.close()
        p = Pipeline(origin, opts, self.work, ram_bytes=self.half, ssd_bytes=self.full_ssd)
        self.state[slot] = p
        return p

    def imagefolder(self) -> float:
        return _epoch(self.base_loader)[0]

    def cold_local(self) -> float:
        dt, s = self._fresh("local", self.root, None).epoch()
        assert s["origin_fetches"] == self.data.n_images
        return dt

    def cold_s3(self) -> float:
        p = self._fresh("s3", "s3://bench/packed", self.data.opts)
        dt, s = p.epoch()
        self.extra["cold_s3_bytes"].append(s["bytes_fetched"])
        dt_warm, s = p.epoch()  # its first warm epoch: no S3 traffic at all
        self.extra["warm_s3_bytes"].append(s["bytes_fetched"])
        self.extra["first_warm_s3_s"].append(dt_warm)
        return dt

    def cold_s3_tree(self) -> float:
        dt, s = self._fresh("s3_tree", "s3://bench/digits", self.data.opts).epoch()
        self.extra["cold_s3_tree_bytes"].append(s["bytes_fetched"])
        return dt

    def first_warm(self) -> float:
        # the epoch right after the cold one: it starts with the cold pass's workers still up and switches to
        # main-process reads
        local = self.state["local"]
        assert local is not None and local.epochs == 1, "`cold_local` runs just before `first_warm` in every round"
        dt, s = local.epoch()
        assert s["origin_fetches"] == 0, s
        self.extra["first_warm_hit_rate"].append(s["hit_rate"])
        self.extra["first_warm_origin_bytes"].append(s["bytes_fetched"])
        return dt

    def warm(self) -> float:
        # five steady epochs of the warm cache after `first_warm` (short: their seconds are in `warm_epochs_s`):
        # their median
        local = self.state["local"]
        assert local is not None and local.epochs == 2, "`first_warm` runs before `warm` in every round"
        times = [local.epoch()[0] for _ in range(5)]
        self.extra["warm_epochs_s"].append([round(t, 4) for t in times])
        return median(times)

    def warm_workers(self) -> float:
        # the alternative warm path: 2 worker processes, batch reads in shared memory, RAM tier = half the data
        # (node-wide: whichever worker promoted a sample, both hit it)
        p = Pipeline(self.root, None, self.work, ram_bytes=self.half, ssd_bytes=self.full_ssd, warm_num_workers=None)
        self.pipes.append(p)
        p.epoch()  # cold: decode, write the SSD tier
        p.epoch()  # SSD hits, promoted to the RAM tier (half the data fits)
        dt, s = p.epoch()
        self.extra["workers_ram_hit_rate"].append(s["ram_hit_rate"])
        self.extra["workers_ssd_hit_rate"].append(s["ssd_hit_rate"])
        p.close()
        self.pipes.remove(p)
        return dt

    def over_budget(self) -> float:
        p = Pipeline(self.root, None, self.work, ram_bytes=0, ssd_bytes=self.half)
        self.pipes.append(p)
        p.epoch()
        dt, s = p.epoch()
        self.extra["over_budget_hit_rate"].append(s["ssd_hit_rate"])
        self.extra["over_budget_fraction"].append(self.half / self.dataset_bytes)
        assert p.cache.ssd is not None and p.cache.ssd.file_bytes() <= self.half
        p.close()
        self.pipes.remove(p)
        return dt

    def close(self) -> None:
        for p in [*self.pipes, *(v for v in self.state.values() if v is not None)]:
            p.close()


def memory_touch_gb_s(mib: int = 256) -> dict[str, float]:
    """GB/s at which this process writes ``mib`` MiB of freshly allocated memory, the first time and right after.

    Why it is in the results: on a virtual machine whose host reclaims the guest's idle memory, a write to memory the
    guest has not used for a while first faults it back in on the host (measured on the 2-core machine of
    ``docs/data.md``: 0.13 GB/s the first time, 1.6-6 GB/s right after). A cold cache epoch writes every decoded
    sample to fresh pages (~300 MB in ``--quick``) and ImageFolder writes none: where ``first`` is far below
    ``again``, the cold ratios measure the machine's memory as much as the pipelines."""
    import numpy as np

    out = {}
    for name in ("first", "again"):
        t0 = time.perf_counter()
        a = np.ones(mib << 20, dtype=np.uint8)
        out[name] = round((mib << 20) / 1e9 / (time.perf_counter() - t0), 2)
        del a
    return out


def cache_numbers(
    data: Dataset224, cases: Cases, timings: dict[str, list[float]], entry_bytes: int
) -> tuple[dict[str, Any], dict[str, float]]:
    """``results`` and the published ratios (samples/s over the ImageFolder baseline, hit rates)."""
    extra, n_images, jpeg_bytes = cases.extra, data.n_images, data.jpeg_bytes
    sps = {k: n_images / median(v) for k, v in timings.items()}
    base = sps["imagefolder"]
    hit = median(extra["over_budget_hit_rate"])
    frac = median(extra["over_budget_fraction"])
    results = {
        "samples_per_s": {k: round(v, 1) for k, v in sps.items()},
        "epoch_s": {k: [round(x, 3) for x in v] for k, v in timings.items()},
        "warm_epochs_s": extra["warm_epochs_s"],
        "first_warm_hit_rate": min(extra["first_warm_hit_rate"]),
        "identical_outputs": True,  # check_identical asserts it before timing
        "n_images": n_images,
        "jpeg_bytes": jpeg_bytes,
        "decoded_entry_bytes": entry_bytes,
        "s3_bytes_cold_epoch": extra["cold_s3_bytes"],
        "s3_bytes_warm_epoch": max(extra["warm_s3_bytes"]),
        "first_warm_origin_bytes": max(extra["first_warm_origin_bytes"]),
        "first_warm_s3_samples_per_s": round(n_images / median(extra["first_warm_s3_s"]), 1),
        "s3_bytes_cold_epoch_over_dataset": round(max(extra["cold_s3_bytes"]) / jpeg_bytes, 4),
        "s3_tree_bytes_cold_epoch_over_dataset": round(max(extra["cold_s3_tree_bytes"]) / jpeg_bytes, 4),
        "s3_pack_shards": data.shards,
        "over_budget_budget_over_dataset": round(frac, 4),
        "over_budget_hit_rate": round(hit, 4),
        "warm_workers_ram_hit_rate": round(median(extra["workers_ram_hit_rate"]), 4),
        "warm_workers_ssd_hit_rate": round(median(extra["workers_ssd_hit_rate"]), 4),
    }
    ratios = {
        "warm_vs_imagefolder": ratio(sps["warm"], base),
        "first_warm_vs_imagefolder": ratio(sps["first_warm"], base),
        "cold_s3_vs_imagefolder": ratio(sps["cold_s3"], base),
        "cold_local_vs_imagefolder": ratio(sps["cold_local"], base),
        "over_budget_hit_rate": round(hit, 4),
        "cold_s3_tree_vs_imagefolder": ratio(sps["cold_s3_tree"], base),
        "warm_workers_vs_imagefolder": ratio(sps["warm_workers"], base),
        "over_budget_hit_rate_vs_target": round(hit / (0.9 * frac), 4),
        "s3_bytes_warm_epoch": float(max(extra["warm_s3_bytes"])),
    }
    return results, ratios


def shard_cases(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """The windowed-shuffle S3 run, the 2-node x 2-rank run and the augmentation placement
    (``benchmarks/_data_shards.py``), or "not run"."""
    try:
        from benchmarks._data_shards import run_augment_placement, run_multinode, run_windowed_s3
    except ImportError as e:
        why = f"not run: benchmarks/_data_shards.py is not importable ({e})"
        return {"windowed_s3": why, "multinode": why, "augment_placement": why}, {}
    cases = {"windowed_s3": run_windowed_s3, "multinode": run_multinode, "augment_placement": run_augment_placement}
    return run_cases(cases, quick)


# The spinning child: SIGKILL when the benchmark process dies (Linux ``PR_SET_PDEATHSIG``; the parent check closes
# the race of a parent gone before the call), so not even a SIGKILL of the benchmark leaves it spinning; and a
# deadline of its own.
_SPIN = """
import contextlib, ctypes, os, signal, time
with contextlib.suppress(OSError, AttributeError):
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != {parent}:
    raise SystemExit(0)
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    pass
"""


@contextlib.contextmanager
def busy_core(on: bool, seconds: float = 900.0) -> Iterator[dict[str, Any]]:
    """With ``on``: a subprocess spinning on one core for the whole block (another job on the machine), bounded three
    ways: it stops by itself after ``seconds``, it dies with this process, and the block's exit kills it. Yields what
    the report records (whether it ran, its pid, and the 1-minute load at the start)."""
    info: dict[str, Any] = {"busy_core": on, "loadavg_1min_start": round(os.getloadavg()[0], 2)}
    if not on:
        yield info
        return
    proc = subprocess.Popen([sys.executable, "-c", _SPIN.format(parent=os.getpid(), seconds=seconds)])
    info["busy_core_pid"] = proc.pid
    try:
        time.sleep(1.0)  # let it take its core before the first timing
        yield info
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--busy-core", action="store_true", help="keep one core busy with a spinning process throughout")
    args = p.parse_args()
    n_images = 2048 if args.quick else 4096
    repeats = 2 if args.quick else 3
    torch.set_num_threads(1)
    from torchvision.datasets import ImageFolder

    work = Path(tempfile.mkdtemp(prefix="la-bench-data-"))
    try:
        with busy_core(args.busy_core) as load, local_s3() as opts:
            data = prepare_data(work, n_images, opts)
            folder = ImageFolder(str(data.root), transform=ImageDecoder(224).pil_transform())
            entry_bytes = check_identical(data, work, folder)
            cases = Cases(data, work, folder, dataset_bytes=entry_bytes * n_images)
            touch = memory_touch_gb_s()
            try:
                timings = alternate(cases.all(), repeats=repeats, warmup=0)
            finally:
                cases.close()
            results, ratios = cache_numbers(data, cases, timings, entry_bytes)
            results["memory_touch_gb_s"] = touch
            shard_results, shard_ratios = shard_cases(args.quick)
            results.update(shard_results, loadavg_1min_end=round(os.getloadavg()[0], 2))
        ratios.update(shard_ratios)
        results["loadavg_1min_start"] = load["loadavg_1min_start"]
        config = {
            "busy_core": load["busy_core"],
            "image_size": 224,
            "batch_size": BATCH,
            "num_workers": WORKERS,
            "repeats": repeats,
            "ram_tier_bytes": cases.half,
            "over_budget_ssd_bytes": cases.half,
            "torch_threads": 1,
        }
        report(
            "data_cache",
            quick=args.quick,
            config=config,
            results=results,
            ratios=ratios,
            out=args.out,
            chart={k: v for k, v in ratios.items() if k.endswith("_vs_imagefolder")},
            chart_title="samples/s over ImageFolder (224 px, batch 64, 2 workers)",
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
