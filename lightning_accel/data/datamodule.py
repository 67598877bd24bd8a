"""``CachedDataModule``: the Lightning adapter over the decoded-sample cache (see ``docs/data.md``).

It lists the origin once per node in ``prepare_data`` (optionally warms the SSD tier there, with a progress bar),
builds one :class:`~lightning_accel.data.cache.SampleCache` shared by the train and validation subsets in ``setup``,
hands out :class:`~lightning_accel.data.dataset.CacheDataLoader` s with an
:class:`~lightning_accel.data.dataset.EpochOrderSampler` (a ``DistributedSampler``, so Lightning keeps it and each
rank reads ahead in its own order), augments and normalises batches on the device in ``on_after_batch_transfer``
and logs cache statistics as ``cache/...`` through the Trainer's loggers.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel._utils.checks import check_bool, check_bytes, check_callable, check_choice, check_int, check_seed
from lightning_accel._utils.fs import storage_endpoint
from lightning_accel._utils.paths import safe_join
from lightning_accel._utils.rank import distributed_ready, node_rank, raise_if_any_rank_failed
from lightning_accel.data.augment import GpuAugment
from lightning_accel.data.cache import MAX_PENDING, SampleCache
from lightning_accel.data.dataset import (
    CacheDataLoader,
    CachedDataset,
    EpochOrderSampler,
    SequentialOrderSampler,
    check_warm_num_workers,
    default_num_workers,
    drop_lone_last_batch,
    has_batch_norm,
    split_indices,
    split_keys,
)
from lightning_accel.data.decode import ImageDecoder
from lightning_accel.data.lifecycle import parse_duration, ram_root, sweep, touch
from lightning_accel.data.origin import (
    MAX_CONCURRENCY,
    MAX_RETRIES,
    Listing,
    ObjectStore,
    check_origin,
    check_storage_options,
    list_origin,
    text_bytes,
)
from lightning_accel.data.sampler import ShardWindowSampler, auto_window
from lightning_accel.data.stats import CacheStats, summarize
from lightning_accel.data.tiers import LmdbTier, default_ram_dir

__all__ = ["CachedDataModule", "map_classes"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Upper bounds of the counts a typo (an extra digit, a byte count in the wrong field) would turn into a hang or a
# machine brought down. Each DataLoader worker is a process holding its own decoders and origin handles: more
# than a large node's cores only costs memory and start-up time.
_MAX_WORKERS = 256


def _per_node(name: str, path: str) -> str:
    """``path`` with ``{node_rank}`` replaced by this node's index (node-local directories when several simulated
    nodes share one machine, or a shared filesystem holds per-node caches)."""
    if "{" not in path:
        return path
    try:
        return path.format(node_rank=node_rank())
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"`{name}` {path!r} may contain only the placeholder {{node_rank}} ({type(e).__name__}: {e})."
        ) from e


def _local_cache_dir(cache_dir: object) -> str:
    """``cache_dir`` as an absolute local path (``file://`` accepted); raises for a remote URL or a file, and for
    anything but a non-empty string (an empty one would put the cache in the working directory)."""
    if isinstance(cache_dir, os.PathLike):
        cache_dir = os.fspath(cache_dir)
    if not isinstance(cache_dir, str) or not cache_dir.strip():
        raise (ValueError if isinstance(cache_dir, str) else TypeError)(
            f"`cache_dir` must be a local directory path, got {cache_dir!r} ({type(cache_dir).__name__}). Pass a "
            "directory, e.g. '.cache/lightning_accel' (the default)."
        )
    if "://" in cache_dir and not cache_dir.startswith("file://"):
        raise ValueError(
            f"`cache_dir` must be a local directory (LMDB needs a local filesystem), got {cache_dir!r}. "
            "Put the remote data in `origin` and the cache on a local SSD."
        )
    path = os.path.abspath(os.path.expanduser(_per_node("cache_dir", cache_dir.removeprefix("file://"))))
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)  # the nearest part of the path that exists must be a directory
    if os.path.exists(probe) and not os.path.isdir(probe):
        raise ValueError(
            f"`cache_dir` must be a directory, got {cache_dir!r}, where {probe!r} is a file. Pass a directory "
            "path (created if missing) or move the file away."
        )
    return path


# An LMDB tier's map holds B-tree and meta pages beside the entries and keeps 1/32 of it (at least 4 pages) as
# headroom, so a budget under 1 MiB holds next to nothing; below two decoded samples the first write fails in a
# DataLoader worker (BudgetTooSmallError) instead of here.
MIN_TIER_BYTES = 1 << 20


def _absolute_origin(url: str) -> str:
    """``url`` with a local path (plain or ``file://``) made absolute against the current directory; any other URL as
    it is."""
    if "://" not in url:
        return os.path.abspath(os.path.expanduser(url))
    if url.startswith("file://"):
        return "file://" + os.path.abspath(os.path.expanduser(url.removeprefix("file://")))
    return url


def _check_tier_budget(name: str, value: object, budget: int | None, image_size: int | None) -> None:
    """A non-zero tier budget must hold the tier's own pages and at least two decoded samples."""
    if budget is None or budget == 0:
        return
    sample = 3 * image_size * image_size + 4096 if image_size else 0  # uint8 RGB entry, page-rounded header
    need = max(MIN_TIER_BYTES, 2 * sample + 2 * sample // 31 + (64 << 10))
    if budget < need:
        what = f" and two {image_size} px samples ({sample} bytes each)" if sample else ""
        raise ValueError(
            f"`{name}` {value!r}{'' if value == budget else f' ({budget} bytes)'} is below the minimum of {need} "
            "bytes: an LMDB tier needs room for "
            f"its B-tree pages and headroom{what}. Raise `{name}` to at least {need} bytes (e.g. '64MiB'), or set it "
            "to 0 to disable the tier."
        )


def _check_text(name: str, value: object, expected: str) -> None:
    """``value`` must be a non-empty string or None (TypeError for another type, ValueError for a blank string)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be {expected} or None, got {value!r} ({type(value).__name__}).")
    if not value.strip():
        raise ValueError(f"`{name}` must be {expected} or None, got {value!r}.")


def _check_classes(classes: object) -> list[str] | None:
    """A list of class names: TypeError for anything but a sequence of strings, ValueError for an empty list, an
    empty name or a name given twice (the message reads as every ``check_*`` message does)."""
    if classes is None:
        return None
    expected = "a non-empty list of distinct class names (label i is classes[i]) or None"
    if isinstance(classes, str) or not isinstance(classes, Sequence) or not all(isinstance(c, str) for c in classes):
        raise TypeError(f"`classes` must be {expected}, got {classes!r} ({type(classes).__name__}).")
    if not classes or not all(classes) or len(set(classes)) != len(classes):
        raise ValueError(f"`classes` must be {expected}, got {classes!r}.")
    return list(classes)


def map_classes(listing: Listing, classes: list[str], *, name: str, manifest: bool) -> Listing:
    """``listing`` with its labels expressed in the fixed class list ``classes`` (same class name, same label).

    A manifest's labels are already positions in the class list: they are kept and only checked against it.

    Raises:
        ValueError: ``listing`` holds a class (or a manifest label) that ``classes`` does not (``name``: the
            argument the listing came from, for the message).
    """
    if listing.classes == classes:
        return listing
    if manifest:
        top = max(listing.labels, default=-1)
        if top >= len(classes):
            raise ValueError(
                f"`{name}` {listing.origin!r} has label {top}, but the training classes have only {len(classes)} "
                f"labels (0..{len(classes) - 1}). Use the same label numbering in every split, or pass `classes`."
            )
        return Listing(listing.origin, listing.keys, listing.labels, list(classes), listing.pack)
    index = {c: i for i, c in enumerate(classes)}
    unknown = [c for c in listing.classes if c not in index]
    if unknown:
        raise ValueError(
            f"`{name}` {listing.origin!r} has class folder(s) {unknown[:3]} that the training classes do not have "
            f"({len(classes)} classes: {classes[:5]}{' ...' if len(classes) > 5 else ''}); a label must mean the same "
            "class in every split. Remove the folder, or pass `classes` listing every class."
        )
    remap = [index[c] for c in listing.classes]
    return Listing(listing.origin, listing.keys, [remap[y] for y in listing.labels], list(classes), listing.pack)


def _last_batch_of_epoch(trainer: Any) -> bool:
    """Whether the training batch being transferred is the last the Trainer takes this epoch: the batches it counted
    ready before this one (its loop's progress, restored on resume) reach ``trainer.num_training_batches`` (the
    loader's length, or ``limit_train_batches`` of it) with this one."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    ready = getattr(getattr(getattr(loop, "batch_progress", None), "current", None), "ready", None)
    limit = getattr(trainer, "num_training_batches", None)
    if not isinstance(ready, int) or not isinstance(limit, (int, float)):
        return False
    return ready + 1 >= limit


class CachedDataModule(LightningDataModule):
    """Decode once, read decoded uint8 tensors from RAM/SSD tiers, read ahead from the origin, augment on the device.

    Batches reach the LightningModule as ``(images float32 normalised (N, C, H, W), labels int64 (N,))``. Every
    argument but ``origin`` is keyword-only; they come in groups.

    Where the data is:
        origin: fsspec URL or local path of an ImageFolder tree (``<class>/<image>``), of a ``manifest``, or of a
            packed origin (``pack_origin`` / ``lightning-accel data pack``: one GET per shard instead of per image).
            A relative local path (or ``file://`` URL) is made absolute here, against the current directory, as is
            ``val_origin``: every rank and worker then reads the same directory, whatever its own.
        storage_options: fsspec options for the origin (S3 endpoint, credentials, ...).
        manifest: a JSONL file under ``origin`` with ``{"key": ..., "label": ...}`` lines instead of a tree.
        val_origin: a separate validation origin (same layout); ``None`` splits ``val_fraction`` off ``origin``.
        val_fraction: held-out fraction when ``val_origin`` is None (deterministic split by ``seed`` and each
            sample's key, so a sample stays on its side when the origin grows or is re-packed). A fraction that
            leaves either split empty is an error in ``setup``; 0 holds out nothing (validation then reads the
            training samples).
        seed: shuffle and split seed.
        classes: the class names, label ``i`` being ``classes[i]`` (``None``: the class folders of ``origin``,
            sorted). The class list is fixed once, from this argument or the training origin, and every split is
            labelled through it: ``val_origin``'s class ``"c"`` gets the label ``"c"`` has in training, whatever
            folders ``val_origin`` lacks. It is part of the cache's key (entries cached under another class list are
            never read back) and of the checkpointed state (resuming on data with other classes is an error). After
            ``setup()`` it is :attr:`classes` / :attr:`num_classes`.

    What is cached (the deterministic decode):
        image_size: side of the cached images (resize shorter side + centre crop); ignored when ``decode`` is given.
        decode: deterministic ``bytes -> tensor`` step whose output is cached (default ``ImageDecoder(image_size)``;
            from YAML, an ``ImageDecoder`` as ``class_path``/``init_args``, or the import path of a function).
        on_decode_error: ``"raise"`` or ``"skip"`` (skipped samples are counted in ``cache/decode_skipped``, and each
            rank that skipped any warns with its count when a pass over a loader ends, and at teardown). A batch whose
            samples all fail reaches the model with 0 samples rather than being dropped: every rank keeps the same
            number of batches, which DDP needs; a ``training_step`` used with ``"skip"`` must accept N = 0. A skipped
            sample is remembered in the cache under its content identity: later epochs and runs skip it without
            reading it, it does not keep the loader on the cold path, and a fixed file is decoded again.

    Cache tiers:
        cache_dir: local directory (not a network filesystem) for the SSD tier and the shared listing.
        ram_bytes: RAM tier budget for the whole node (bytes or ``"512MiB"``; 0 disables the tier).
        ssd_bytes: SSD tier budget (bytes or ``"20GiB"``; ``None``: no cap; 0 disables the tier).
        ram_dir: RAM tier directory (default ``/dev/shm/lightning_accel/<hash of cache_dir>``). ``cache_dir`` and
            ``ram_dir`` may contain ``{node_rank}`` (from ``NODE_RANK`` / ``GROUP_RANK``): node-local directories
            when several nodes share a filesystem, or simulated nodes one machine. Both are made absolute when the
            module is made (against the working directory then), so every process opens the same tiers.
        ram_ttl: in ``prepare_data`` (once per node), remove RAM tiers next to this one's that no process uses and
            that were last used longer ago than this (seconds or ``"12h"``, ``"7d"``; ``None``: never). Only the
            default location (``/dev/shm/lightning_accel``) is swept; ``lightning-accel data clean`` does it by hand.
        policy: tier behaviour when full: ``"keep"`` (stable subset; best for epoch scans) or ``"fifo"``.
        warm_on_prepare: fill the SSD tier in ``prepare_data`` (once per node, progress bar) instead of in epoch 1.

    Reading the origin:
        max_concurrency: origin reads in flight per process, 1 to 1024 (a thread each).
        retries: retries of a transient origin error (exponential backoff from 0.2 s), 0 to 16 (16 already wait
            about 3.6 hours in all).
        prefetch: read ahead and read misses on a thread pool (``None``: only for remote origins; a local origin is
            read inline, which costs less CPU; ``True`` for a slow local disk).
        prefetch_batches: upcoming batches each reader reads ahead from the origin.
        stage_bytes: a packed remote origin (``pack_origin``) is read a whole shard at a time, staged under
            ``cache_dir/shards`` (shared by the workers and ranks of the node); at most this many bytes are kept
            (least recently used out first; ``None``: no cap, every shard staged stays). At least the packed data's
            size reads each shard once per cold epoch under any shuffle; less needs the window shuffle (``shuffle``).
        shuffle: training order: ``"global"`` (a shuffle of all samples), ``"window"`` (shard-aware: each rank
            reads within a window of shards, see :mod:`~lightning_accel.data.sampler`; packed origins only) or
            ``"auto"`` (``"window"`` for a packed remote origin whose pack exceeds ``stage_bytes``).
        shuffle_window: shards shuffled together under ``"window"`` (``None``: the widest the stage holds for every
            rank of the node). Unused when ``"auto"`` chooses the global shuffle, which the first training loader
            reports once (a warning on rank 0 saying why); a window of all the pack's shards or more is reported
            likewise (each rank then shuffles its whole part at once).

    Loading:
        batch_size: per-device batch size.
        num_workers: DataLoader workers for cold epochs, 0 to 256 (``None``: half the CPUs, at most 8).
        warm_num_workers: workers once the cache is warm, 0 to 256 (0: main-process batch reads; ``None``: keep
            ``num_workers``).
        transform: optional per-sample CPU transform applied after the cache (in the workers; from YAML, a
            ``torch.nn.Module`` such as a torchvision transform as ``class_path``/``init_args``).

    Augmentation (on the device, in ``on_after_batch_transfer``):
        train_augment: batch augmentation for training (default: normalise with ``mean``/``std``).
        val_augment: batch transform for evaluation (default: normalise only, with a :class:`GpuAugment`
            ``train_augment``'s ``mean``, ``std`` and output ``size``, so both splits reach the model alike).
        mean: per-channel mean for the default augmentations (``None``: a :class:`GpuAugment` ``train_augment``'s,
            else ImageNet's). With ``train_augment`` and ``val_augment`` both given no default is left: a value
            that either of them does not have is refused.
        std: per-channel std for the default augmentations (``None``: as ``mean``).
        cpu_augment: where a :class:`GpuAugment` ``train_augment`` runs when the batches stay on the CPU (no GPU, or
            ``accelerator="cpu"``): ``"thread"`` on a background thread of each rank, two batches ahead of the
            training step, so augmenting overlaps with the step instead of adding to it (torch ops release the GIL);
            ``"step"`` in ``on_after_batch_transfer``, on the training thread. Same random stream and same tensors
            either way (batch ``k`` of the stream draws from ``(seed, k)``). CUDA batches are augmented on the GPU
            after the transfer in both cases. See ``docs/data.md`` for the measured difference. ``None`` (default):
            ``"thread"`` for a :class:`GpuAugment` (the default augmentation is one), ``"step"`` for any other
            ``train_augment``, which only the step can run (its random draws are its own); ``"thread"`` with such a
            ``train_augment`` is refused. :attr:`cpu_augment` holds the placement chosen.

    Logging:
        log_every_n_steps: how often (training steps) ``cache/...`` statistics are logged.

    Raises:
        ValueError: an argument out of range (the message names it, with the value and what is expected).
        TypeError: an argument of the wrong type (a string for a number or a flag, a non-callable ``decode``,
            ``transform`` or augmentation, ...), named the same way.
        FileNotFoundError: ``origin`` or ``val_origin`` is a local path that does not exist (remote URLs are
            checked when ``prepare_data`` lists them).
    """

    #: a subclass that writes ``origin`` in ``prepare_data`` (a rendered demo set) sets this: the origin may be
    #: missing when the module is built
    _origin_made_in_prepare: bool = False

    def __init__(
        self,
        origin: str | os.PathLike[str],
        *,
        # where the data is
        storage_options: dict[str, Any] | None = None,
        manifest: str | None = None,
        val_origin: str | os.PathLike[str] | None = None,
        val_fraction: float = 0.1,
        seed: int = 0,
        classes: Sequence[str] | None = None,
        # what is cached
        image_size: int | None = 224,
        # `ImageDecoder` / `nn.Module` first: LightningCLI (jsonargparse) reads a `class_path:` under a bare
        # `Callable[..., Tensor]` as a class whose instances are tensors, and refused every decoder and transform object
        decode: ImageDecoder | Callable[[bytes], torch.Tensor] | None = None,
        on_decode_error: str = "raise",
        # cache tiers
        cache_dir: str | os.PathLike[str] = ".cache/lightning_accel",
        ram_bytes: int | str = "256MiB",
        ssd_bytes: int | str | None = "20GiB",
        ram_dir: str | None = None,
        ram_ttl: float | str | None = "24h",
        policy: str = "keep",
        warm_on_prepare: bool = False,
        # reading the origin
        max_concurrency: int = 16,
        retries: int = 4,
        prefetch: bool | None = None,
        prefetch_batches: int = 2,
        stage_bytes: int | str | None = "4GiB",
        shuffle: str = "auto",
        shuffle_window: int | None = None,
        # loading
        batch_size: int = 64,
        num_workers: int | None = None,
        warm_num_workers: int | None = 0,
        transform: torch.nn.Module | Callable[[torch.Tensor], torch.Tensor] | None = None,
        # augmentation
        train_augment: GpuAugment | None = None,
        val_augment: GpuAugment | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        cpu_augment: str | None = None,
        # logging
        log_every_n_steps: int = 50,
    ) -> None:
        super().__init__()
        # a local `pathlib.Path` is a path as much as its string (`cache_dir` takes one too)
        origin = os.fspath(origin) if isinstance(origin, os.PathLike) else origin
        val_origin = os.fspath(val_origin) if isinstance(val_origin, os.PathLike) else val_origin
        check_origin(origin, must_exist=not self._origin_made_in_prepare)
        if val_origin is not None:
            check_origin(val_origin, "val_origin", must_exist=True)
        # Absolute now, as `cache_dir`: `setup` runs in every rank (and the reads in every DataLoader worker), and a
        # relative path resolved there against another working directory (a launcher's, a spawned rank's, a job that
        # changed directory) read another tree, or none.
        origin = _absolute_origin(origin)
        val_origin = _absolute_origin(val_origin) if val_origin is not None else None
        storage_options = check_storage_options(storage_options)
        _check_text("manifest", manifest, "a JSONL file under `origin` (a relative key such as 'train.jsonl')")
        if manifest is not None:
            try:  # the listing joins it under each origin: a key that escapes would fail only in `setup`, on every rank
                safe_join("", manifest)
            except ValueError:
                raise ValueError(
                    f"`manifest` must be a JSONL file under `origin` (a relative key such as 'train.jsonl'), got "
                    f"{manifest!r}. Use a relative POSIX path without `..`, `.`, a leading `/`, a scheme, `::` or "
                    "backslashes."
                ) from None
        _check_text("ram_dir", ram_dir, "a local directory path")
        check_seed("seed", seed, what="the shuffle and the train/validation split")
        check_callable("decode", decode, "a callable `decode(data: bytes) -> torch.Tensor`")
        # checked even when a `decode` makes it unused: a typo (image_size="224") must not pass silently
        check_int("image_size", image_size, low=1, allow_none=True, fix="None keeps the original size.")
        check_callable("transform", transform, "a callable `transform(image: torch.Tensor) -> torch.Tensor`")
        for name, aug in (("train_augment", train_augment), ("val_augment", val_augment)):
            check_callable(name, aug, "a GpuAugment (or a callable `augment(images, train=...) -> images`)")
        check_bool("warm_on_prepare", warm_on_prepare)
        if prefetch is not None:
            check_bool("prefetch", prefetch, fix="None: only for remote origins.")
        check_int("batch_size", batch_size, low=1)
        check_int(
            "num_workers",
            num_workers,
            low=0,
            high=_MAX_WORKERS,
            allow_none=True,
            fix="Each is a process: use about the CPU count, or None for half the CPUs, at most 8.",
        )
        check_warm_num_workers(warm_num_workers)
        check_int(
            "warm_num_workers",
            warm_num_workers,
            low=0,
            high=_MAX_WORKERS,
            allow_none=True,
            fix="Each is a process: 0 reads warm batches in the main process; None keeps `num_workers`.",
        )
        check_int("log_every_n_steps", log_every_n_steps, low=1, fix="It counts training steps between logs.")
        self.cache_dir = _local_cache_dir(cache_dir)
        check_choice("on_decode_error", on_decode_error, ("raise", "skip"))
        check_choice("policy", policy, ("keep", "fifo"))
        check_choice(
            "cpu_augment",
            cpu_augment,
            ("thread", "step", None),
            fix="None: on the thread for a GpuAugment `train_augment`, in the step otherwise.",
        )
        if cpu_augment == "thread" and train_augment is not None and not isinstance(train_augment, GpuAugment):
            # Augmenting ahead draws batch k of a GpuAugment's seeded stream; another callable's draws would move to
            # another thread and another order, so "thread" was ignored and the callable ran in the step.
            raise ValueError(
                f"`cpu_augment` 'thread' needs a GpuAugment `train_augment`, got {train_augment!r} "
                f"({type(train_augment).__name__}), which only the training step can run. Pass a GpuAugment as "
                "`train_augment`, or `cpu_augment='step'` (or leave it out) to run this one in the step."
            )
        check_choice("shuffle", shuffle, ("auto", "global", "window"))
        check_int("shuffle_window", shuffle_window, low=1, allow_none=True, fix="It counts the shards of a window.")
        if shuffle_window is not None and shuffle == "global":
            raise ValueError(
                f"`shuffle_window` {shuffle_window!r} has no effect with `shuffle='global'` (one shuffle of all "
                "samples). Pass `shuffle='window'` (or 'auto') to shuffle within windows of shards, or leave "
                "`shuffle_window` out."
            )
        split_indices(1, val_fraction, seed)  # validates val_fraction now
        check_int(
            "max_concurrency",
            max_concurrency,
            low=1,
            high=MAX_CONCURRENCY,
            fix="It counts origin reads in flight per process, a thread each (16 to 64 suit an object store).",
        )
        check_int(
            "retries",
            retries,
            low=0,
            high=MAX_RETRIES,
            fix="It counts retries of a transient origin error, each wait twice the last from 0.2 s; 0 for none.",
        )
        check_int(
            "prefetch_batches",
            prefetch_batches,
            low=0,
            fix="It counts batches read ahead per reader; 0 to read only on demand.",
        )
        # where the data is
        self.origin = origin
        self.storage_options = storage_options
        self.manifest = manifest
        self.val_origin = val_origin
        self.val_fraction = val_fraction
        self.seed = seed
        self._given_classes = _check_classes(classes)
        self._classes: list[str] | None = None  # fixed in setup (or prepare_data): see `classes`
        self._ckpt_classes: list[str] | None = None  # a checkpoint's class list, checked once ours is fixed
        # what is cached
        self.decode = decode if decode is not None else ImageDecoder(image_size)
        self.on_decode_error = on_decode_error
        # cache tiers
        self.ram_bytes = check_bytes("ram_bytes", ram_bytes, fix="RAM is finite: use 0 to disable the tier.")
        self.ssd_bytes = check_bytes("ssd_bytes", ssd_bytes, allow_none=True, fix="Use 0 to disable the tier.")
        cached_size = image_size if decode is None else None  # a custom decode's output size is unknown here
        _check_tier_budget("ram_bytes", ram_bytes, self.ram_bytes, cached_size)
        _check_tier_budget("ssd_bytes", ssd_bytes, self.ssd_bytes, cached_size)
        tag = hashlib.sha1(text_bytes(self.cache_dir)).hexdigest()[:12]
        # Absolute now, as `cache_dir`: the tiers open lazily in each process (DataLoader workers, spawned ranks), and
        # a relative path resolved there against another working directory named another tier.
        self.ram_dir = (
            os.path.abspath(os.path.expanduser(_per_node("ram_dir", ram_dir)))
            if ram_dir is not None
            else default_ram_dir(tag)
        )
        self.ram_ttl = parse_duration(ram_ttl, name="ram_ttl")
        self.policy = policy
        self.warm_on_prepare = warm_on_prepare
        # reading the origin
        self.max_concurrency = max_concurrency
        self.retries = retries
        self.prefetch = prefetch
        self.prefetch_batches = prefetch_batches
        self.stage_bytes = check_bytes("stage_bytes", stage_bytes, allow_none=True)
        self.shuffle = shuffle
        self.shuffle_window = shuffle_window
        # loading
        self.batch_size = batch_size
        self.num_workers = default_num_workers() if num_workers is None else num_workers
        self.warm_num_workers = warm_num_workers
        self.transform = transform
        # augmentation
        # The default evaluation transform normalises as training does: with ImageNet's statistics instead of a
        # GpuAugment train_augment's own (and at another size), validation scored images the model never saw.
        given = train_augment if isinstance(train_augment, GpuAugment) else None
        default = GpuAugment(
            mean if mean is not None else (given.mean if given is not None else IMAGENET_MEAN),
            std if std is not None else (given.std if given is not None else IMAGENET_STD),
            size=given.size if given is not None else None,
            crop_scale=None,
            flip_p=0.0,
        )
        if train_augment is not None and val_augment is not None:
            # `mean`/`std` set only the default augmentations' normalisation, and neither is used: a value that the
            # given augmentations do not already have would be dropped (the same value says nothing new: accepted)
            for name, value, ours in (("mean", mean, default.mean), ("std", std, default.std)):
                theirs = [getattr(a, name, None) for a in (train_augment, val_augment)]
                if value is not None and any(t != ours for t in theirs):
                    raise ValueError(
                        f"`{name}` {value!r} has no effect: `train_augment` and `val_augment` are both given (with "
                        f"{name} {theirs[0]!r} and {theirs[1]!r}), and `{name}` sets only the default augmentations' "
                        f"normalisation. Pass it to the augmentations (`GpuAugment({name}=...)`), or leave `{name}` "
                        "out."
                    )
        if given is not None and val_augment is None:
            mismatch = [
                f"`{name}` {ours}"
                for name, ours, theirs, arg in (
                    ("mean", default.mean, given.mean, mean),
                    ("std", default.std, given.std, std),
                )
                if arg is not None and ours != theirs
            ]
            if mismatch:
                rank_zero_warn(
                    f"{' and '.join(mismatch)} {'differs' if len(mismatch) == 1 else 'differ'} from `train_augment`'s "
                    f"(mean {given.mean}, std {given.std}): the default validation transform normalises with the "
                    "arguments, training with `train_augment`'s. Pass the same values, or leave `mean`/`std` out to "
                    "follow `train_augment`."
                )
        self.train_augment = train_augment if train_augment is not None else default
        self.val_augment = val_augment if val_augment is not None else copy.deepcopy(default)
        # the placement chosen: a GpuAugment can be augmented ahead on the thread, anything else only in the step
        self.cpu_augment = (
            cpu_augment
            if cpu_augment is not None
            else "thread"
            if isinstance(self.train_augment, GpuAugment)
            else "step"
        )
        # training batches augmented ahead on the loader's thread (`_augment_ahead`), by id until the step takes them
        self._ready: dict[int, tuple[torch.Tensor, int]] = {}
        self._stream_base = 0
        # logging
        self.log_every_n_steps = log_every_n_steps
        # state: the node's statistics (shared with the workers), the datasets and caches made in setup
        self.stats = CacheStats()
        self.train_set: CachedDataset | None = None
        self.val_set: CachedDataset | None = None
        self._caches: dict[str, SampleCache] = {}
        self._last_logged_step = -1
        self._train_loader: CacheDataLoader | None = None
        self._resume: dict[str, Any] | None = None  # the train sampler's state from a checkpoint, until applied
        self._skipped_reported = 0  # this rank's decode_skipped already reported (see _report_skipped)
        # a `shuffle_window` left unused or covering the whole pack already reported (see _report_unused_window)
        self._window_reported = False
        # prepare_data's failure under a multi-rank Trainer, raised in setup once every rank knows (see _in_lockstep)
        self._prepare_error: Exception | None = None

    # ---- listing -------------------------------------------------------------------------------------------------
    def _store(self, url: str) -> ObjectStore:
        return ObjectStore(url, self.storage_options, max_concurrency=self.max_concurrency, retries=self.retries)

    def _listing_path(self, store: ObjectStore) -> str:
        # The store's URL (a local origin made absolute), not the argument: a relative `origin` names another
        # directory from another working directory, and two jobs sharing `cache_dir` read each other's listing. For
        # the same reason an object store's endpoint (not its credentials): one `s3://` URL names other objects on
        # another endpoint. (Only added when set, so the listings of the default endpoint keep their names.)
        endpoint = "" if store.is_local else storage_endpoint(self.storage_options) or ""
        name = f"{store.url}|{self.manifest}{'|' + endpoint if endpoint else ''}"
        h = hashlib.sha1(text_bytes(name)).hexdigest()[:16]
        return os.path.join(self.cache_dir, f"listing-{h}.json")

    def _list(self, url: str, *, refresh: bool) -> Listing:
        store = self._store(url)
        path = self._listing_path(store)
        if not refresh and os.path.exists(path):
            saved = Listing.load(path)
            if saved.origin == store.url:  # else another origin's (a file written before the URL was normalised)
                return saved
        listing = list_origin(store, manifest=self.manifest)
        # An unwritable cache dir is reported once by the SSD tier; without the file, ranks only list again.
        try:
            listing.save(path)
        except OSError:
            # Nor may an earlier run's file stand in for this listing (a full disk, a read-only cache dir): `setup`
            # on every rank read it, so files added since were left out and files rewritten since were served
            # their old cached entries (the old content identity names them).
            with contextlib.suppress(OSError):
                os.unlink(path)
        return listing

    # ---- tiers and caches ----------------------------------------------------------------------------------------
    def _cache(self, url: str, listing: Listing) -> SampleCache:
        ssd = LmdbTier(os.path.join(self.cache_dir, "ssd"), self.ssd_bytes, name="ssd", policy=self.policy)
        ram = None
        if self.ram_bytes and self.ram_dir is not None:
            ram = LmdbTier(
                self.ram_dir,
                self.ram_bytes,
                name="ram",
                policy=self.policy,
                note=f"RAM tier of the cache in {os.path.abspath(self.cache_dir)}",
            )
        for tier in (ram, ssd):
            if tier is not None:
                tier.open()  # in the main process: an unusable directory warns once here, before workers start
        return SampleCache(
            self._store(url),
            listing,
            self.decode,
            ram=ram,
            ssd=ssd,
            stats=self.stats,
            on_decode_error=self.on_decode_error,
            max_pending=min(MAX_PENDING, max(64, self.prefetch_batches * self.batch_size * 2)),
            prefetch=self.prefetch,
            stage_dir=os.path.join(self.cache_dir, "shards"),
            stage_bytes=self.stage_bytes if self.stage_bytes is not None else sys.maxsize,  # None: no cap
        )

    @property
    def classes(self) -> list[str]:
        """The fixed class names (label ``i`` is ``classes[i]``) of every split; available after ``setup()``.

        Raises:
            RuntimeError: before ``setup()`` (or ``prepare_data()``) fixed them and no ``classes`` argument was given.
        """
        if self._classes is not None:
            return list(self._classes)
        if self._given_classes is not None:
            return list(self._given_classes)
        raise RuntimeError(
            "`CachedDataModule.classes` is known once `setup()` has listed the origin; call `dm.setup('fit')` first "
            "or pass `classes=[...]`."
        )

    @property
    def num_classes(self) -> int:
        """``len(classes)``: the size of a classifier's output layer; available after ``setup()``."""
        return len(self.classes)

    def _fix_classes(self, listing: Listing) -> list[str]:
        """Fix the class list once (the argument, else the training origin's) and check it against a checkpoint's."""
        fixed = self._given_classes if self._given_classes is not None else list(listing.classes)
        if self._classes is not None and self._classes != fixed:
            # the classes that differ: the first few of each list alone were often the same ones
            gone = [c for c in self._classes if c not in fixed]
            new = [c for c in fixed if c not in self._classes]
            raise ValueError(
                f"`origin` {self.origin!r} now has {len(fixed)} classes, not the {len(self._classes)} fixed before "
                f"(missing {gone[:5]}{' ...' if len(gone) > 5 else ''}, new {new[:5]}{' ...' if len(new) > 5 else ''}"
                "). Restore the origin's class folders, or pass `classes`."
            )
        self._classes = fixed
        self._check_ckpt_classes()
        return fixed

    def _check_ckpt_classes(self) -> None:
        ckpt, ours = self._ckpt_classes, self._classes
        if ckpt is not None and ours is not None and ckpt != ours:
            raise ValueError(
                f"the checkpoint was trained on {len(ckpt)} classes {ckpt[:5]}{' ...' if len(ckpt) > 5 else ''}, but "
                f"`origin` {self.origin!r} has {len(ours)} classes {ours[:5]}{' ...' if len(ours) > 5 else ''}: the "
                "labels would mean other classes. Resume on the same class folders, or pass `classes` from the "
                "checkpoint."
            )

    def _datasets(self, refresh: bool) -> tuple[CachedDataset, CachedDataset]:
        manifest = self.manifest is not None
        listing = self._list(self.origin, refresh=refresh)
        classes = self._fix_classes(listing)
        listing = map_classes(listing, classes, name="origin", manifest=manifest)
        cache = self._cache(self.origin, listing)
        self._caches = {"train": cache}
        if self.val_origin is not None:
            vlisting = map_classes(
                self._list(self.val_origin, refresh=refresh), classes, name="val_origin", manifest=manifest
            )
            vcache = self._cache(self.val_origin, vlisting)
            self._caches["val"] = vcache
            return self._dataset(cache), self._dataset(vcache, lane=1)
        tr, va = split_keys(listing.keys, self.val_fraction, self.seed)
        if self.val_fraction > 0 and (not va or not tr):
            # Refused rather than patched up: an empty validation split used to validate on the training samples,
            # and an empty training split trains on nothing.
            raise ValueError(
                f"`val_fraction` {self.val_fraction!r} splits the {len(listing)} samples of `origin` {self.origin!r} "
                f"into {len(tr)} training and {len(va)} validation samples; each needs at least 1. Pick a "
                "`val_fraction` that leaves both non-empty, 0 to hold out nothing, or pass `val_origin`."
            )
        return self._dataset(cache, tr), self._dataset(cache, va if va else tr, lane=1)

    def _dataset(self, cache: SampleCache, indices: Sequence[int] | None = None, *, lane: int = 0) -> CachedDataset:
        # Validation counts in its own lane: its workers run beside the training loader's persistent ones.
        return CachedDataset(
            cache, indices, transform=self.transform, prefetch_batches=self.prefetch_batches, stats_lane=lane
        )

    def _in_lockstep(self) -> bool:
        """True when a Trainer of 2 ranks or more drives this module: its hooks then run in a process group, where a
        rank that raises alone leaves the others waiting in Lightning's next barrier until the group's timeout."""
        import torch.distributed as dist

        return self.trainer is not None and distributed_ready() and dist.get_world_size() > 1

    @override
    def prepare_data(self) -> None:
        """Once per node: sweep stale RAM tiers, list the origin(s), optionally warm the SSD tier.

        Under a Trainer of several ranks a failure here (an origin this node cannot reach, or that holds no sample) is
        raised by ``setup`` instead, on every rank at once: Lightning runs this hook on one rank per node only, and
        the ranks that did not run it would otherwise wait for the failed one in ``setup``'s barrier.
        """
        self._prepare_error = None
        try:
            self._sweep_ram_tiers()
            train, val = self._datasets(refresh=True)
            if self.warm_on_prepare:
                for name, ds in (("train", train), ("val", val)):
                    self._warm(ds, name)
        except Exception as e:
            if not self._in_lockstep():
                raise
            self._prepare_error = e

    def _warm(self, ds: CachedDataset, name: str) -> None:
        if ds.cached_fraction() >= 1.0:
            return
        loader = CacheDataLoader(
            ds, batch_size=self.batch_size, num_workers=self.num_workers, warm_num_workers=None, read_ahead=0
        )
        try:
            from tqdm.auto import tqdm  # type: ignore[import-untyped]  # tqdm ships no type hints

            it: Any = tqdm(loader, desc=f"warming the {name} cache", unit="batch", leave=False)
        except ImportError:  # pragma: no cover - tqdm ships with lightning
            it = loader
        for _ in it:
            pass
        ds.cache.spill()  # misses went to the RAM tier first: the SSD tier holds them all after the warm-up
        for _, tier in ds.cache.tiers:
            tier.flush()

    def _sweep_ram_tiers(self) -> None:
        if self.ram_ttl is None or self.ram_dir is None:
            return
        root = os.path.dirname(self.ram_dir)
        if os.path.realpath(root) != os.path.realpath(ram_root()):
            return  # a directory the user chose: never remove its neighbours unasked
        sweep(root, older_than_s=self.ram_ttl, keep=[self.ram_dir])

    @override
    def setup(self, stage: str) -> None:
        """Make the datasets (on every rank; the listing ``prepare_data`` saved is reused).

        Under a Trainer of several ranks, a failure on any rank (here, or in that node's ``prepare_data``) raises on
        every rank: the failed rank its own error, the others a ``RuntimeError`` naming that rank and its error. That
        costs one collective (a one-integer all-reduce), reached by every rank whether it failed or not.
        """
        if self.ram_dir is not None:
            touch(self.ram_dir)  # last use, for the sweep of stale tiers
        # A failed prepare_data is raised even when the datasets of an earlier fit are there: that fit's listing must
        # not stand in for an origin that can no longer be listed.
        error, self._prepare_error = self._prepare_error, None
        if error is None and self.train_set is None:
            try:
                self.train_set, self.val_set = self._datasets(refresh=False)
            except Exception as e:
                if not self._in_lockstep():
                    raise
                error = e
        if self._in_lockstep():
            assert self.trainer is not None
            raise_if_any_rank_failed(
                error,
                lambda rank, more: f"`CachedDataModule` could not set up its data on rank {rank}{more}",
                device=self.trainer.strategy.root_device,
            )
        if error is not None:
            raise error

    # ---- loaders -------------------------------------------------------------------------------------------------
    def _sharding(self) -> tuple[int, int]:
        """(number of ranks, this rank) for the sampler."""
        trainer = self.trainer
        kw = getattr(trainer, "distributed_sampler_kwargs", None) if trainer is not None else None
        if kw:
            return int(kw.get("num_replicas", 1)), int(kw.get("rank", 0))
        return 1, 0

    def _window(self, ds: CachedDataset) -> int | None:
        """Shards per shuffle window for ``ds``, or None for the global shuffle."""
        packed = ds.cache.packed
        if self.shuffle == "global":
            return None
        if packed is None:
            if self.shuffle == "window":
                raise ValueError(
                    "`shuffle='window'` needs a packed origin (pack_origin / `lightning-accel data pack`); "
                    f"{self.origin!r} is not one. Use `shuffle='global'` or pack the origin."
                )
            self._report_unused_window("the origin is not packed (pack_origin / `lightning-accel data pack`)")
            return None
        sizes = packed.pack.shard_sizes
        if self.shuffle == "auto" and not (packed.staging and packed.stage_bytes < sum(sizes)):
            self._report_unused_window(
                f"the stage holds the whole pack ({sum(sizes)} bytes, `stage_bytes` {packed.stage_bytes})"
                if packed.staging
                else "the pack is local, read in place without a stage"
            )
            return None
        if self.shuffle_window is not None:
            if self.shuffle_window >= len(sizes):
                self._report_whole_pack_window(packed.staging, packed.stage_bytes, sizes)
            return self.shuffle_window
        trainer = self.trainer
        local = int(getattr(trainer, "num_devices", 1) or 1) if trainer is not None else 1
        return auto_window(packed.stage_bytes, sizes, local)

    def _report_unused_window(self, why: str) -> None:
        """Warn once (rank 0; no collective) that ``shuffle="auto"`` chose the global shuffle, so a ``shuffle_window``
        the user passed is unused: it is known only once the origin is listed, not in ``__init__``."""
        if self.shuffle_window is None or self._window_reported:
            return
        self._window_reported = True
        rank_zero_warn(
            f"`shuffle_window` {self.shuffle_window!r} is unused: `shuffle='auto'` chose the global shuffle because "
            f"{why}, so every sample is shuffled with every other. Pass `shuffle='window'` to shuffle within windows "
            "of shards anyway (packed origins only), or leave `shuffle_window` out."
        )

    def _report_whole_pack_window(self, staging: bool, stage_bytes: int, sizes: Sequence[int]) -> None:
        """Warn once (rank 0; no collective) that ``shuffle_window`` covers every shard of the pack: each rank then
        shuffles its whole part at once, reading from all its shards together. Known only once the origin is listed,
        not in ``__init__``."""
        if self._window_reported:
            return
        self._window_reported = True
        total = sum(sizes)
        held = (
            f"; the stage (`stage_bytes` {stage_bytes}) is smaller than the pack ({total} bytes), so shards are "
            "evicted before their last read and downloaded again"
            if staging and stage_bytes < total
            else ""
        )
        rank_zero_warn(
            f"`shuffle_window` {self.shuffle_window!r} covers all {len(sizes)} shards of the pack: every rank shuffles "
            f"its whole part at once, reading from all its shards together{held}. Pass a `shuffle_window` below "
            f"{len(sizes)} (or None: the widest the stage holds), or `shuffle='global'` for a shuffle of all samples."
        )

    def _ahead_transform(self) -> Callable[[Any, int], Any] | None:
        """The training loader's ``batch_transform``: :meth:`_augment_ahead` when the batches stay on the CPU and
        ``train_augment`` is a :class:`GpuAugment` (``cpu_augment="thread"``); None otherwise."""
        if self.cpu_augment != "thread" or not isinstance(self.train_augment, GpuAugment):
            return None
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        if not isinstance(device, torch.device) or device.type != "cpu":
            return None  # CUDA batches: augmented on the GPU after the transfer
        return self._augment_ahead

    def _augment_ahead(self, batch: Any, k: int) -> Any:
        """Augment training batch ``k`` of this pass on the loader's background thread (see ``cpu_augment``).

        Its index in the random stream is the stream's position when the pass started plus ``k``: what the step would
        have drawn, as the step takes the batches in this order. Batches of a pass left unfinished (e.g.
        ``limit_train_batches``) were drawn ahead but never taken: the next pass starts after the last one taken
        (:meth:`on_after_batch_transfer` moves the stream there), as the in-step path does."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor)):
            return batch
        x, y = batch
        if x.device.type != "cpu":
            return batch
        aug = self.train_augment
        if k == 0:  # a new pass: the last one's consumer is done with its batches
            self._ready.clear()
            self._stream_base = aug.calls
        call = self._stream_base + k
        # forward, not __call__: on this thread a module call would enter whatever the training thread patched
        # into nn.Module.__call__ at the time (torch.fx tracing in pruning surgery raised here)
        out = aug.forward(x, train=True, call=call)
        self._ready[id(out)] = (out, call)  # the reference keeps `id(out)` unique until the step takes it
        return out, y

    def _loader(self, ds: CachedDataset | None, shuffle: bool, *, lone_last: bool = False) -> CacheDataLoader:
        if ds is None:
            raise RuntimeError("`CachedDataModule.setup()` must run before asking for a dataloader.")
        replicas, rank = self._sharding()
        # Unshuffled orders (evaluation, and training under `overfit_batches`, which Lightning reads unshuffled) are
        # `SequentialSampler`s as well: Lightning replaces any other sampler of an overfit fit, with a warning that the
        # loader shuffles, and the training loader's replacement lost the positions a mid-epoch resume continues from
        # (its resumed epoch started over at the first batch).
        ordered = shuffle and not self._overfitting()
        window = self._window(ds) if shuffle else None  # checked under `overfit_batches` too, as for the real fit
        sampler: EpochOrderSampler
        if not ordered:
            sampler = SequentialOrderSampler(ds, replicas, rank, seed=self.seed, batch_size=self.batch_size)
        elif window is not None:
            pack = ds.cache.listing.pack
            assert pack is not None
            shard_of = [pack.shard[i] for i in ds.indices]
            sampler = ShardWindowSampler(
                ds,
                shard_of,
                num_replicas=replicas,
                rank=rank,
                window=window,
                seed=self.seed,
                batch_size=self.batch_size,
            )
        else:
            sampler = EpochOrderSampler(ds, replicas, rank, shuffle=True, seed=self.seed, batch_size=self.batch_size)
        # `lone_last`: the training loader, which drops a last batch of one sample that the model's BatchNorm cannot
        # train on (see `drop_lone_last_batch`; the sampler's resume arithmetic follows the loader's `drop_last`)
        trainer = self.trainer
        model = trainer.lightning_module if lone_last and trainer is not None else None
        drop_last = drop_lone_last_batch(model, len(sampler), self.batch_size, type(self).__name__)
        sampler.trim_lone_last = has_batch_norm(model)  # a resumed epoch's remainder can leave one sample as well
        return CacheDataLoader(
            ds,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            drop_last=drop_last,
            warm_num_workers=self.warm_num_workers,
            on_epoch_end=functools.partial(self._report_skipped, "training" if shuffle else "evaluation"),
            batch_transform=self._ahead_transform() if shuffle else None,
            pass_batches=functools.partial(self._pass_batches, shuffle),
            warm_check=self._decides_warm,
        )

    def _overfitting(self) -> bool:
        """Whether the attached Trainer fits with ``overfit_batches``: its training loader reads the first batches of
        an unshuffled order, every epoch (Lightning's own rule)."""
        trainer = self.trainer
        if trainer is None or not self._restoring_fit():
            return False
        n = getattr(trainer, "overfit_batches", 0)
        return isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0

    def _decides_warm(self) -> bool:
        """Whether the loader's coming pass may switch it to the warm path: not a sanity-check pass, whose 2 batches
        cached say nothing of the validation passes after it (and the switch is one-way)."""
        return not bool(getattr(self.trainer, "sanity_checking", False))

    def _pass_batches(self, training: bool) -> float | None:
        """The batches the Trainer takes of the loader's coming pass (``limit_*_batches``, ``overfit_batches``, the
        sanity check's ``num_sanity_val_steps``): the loader reads no further and checks only those for its warm path
        (not on a sanity check, see :meth:`_decides_warm`); None when unknown."""
        trainer = self.trainer
        if trainer is None:
            return None
        if training:
            n: Any = getattr(trainer, "num_training_batches", None)
            # The fit loop sets that count only after it creates the first epoch's iterator (it is `inf` until
            # then): the first pass, the cold one, was read whole. `limit_train_batches` (`overfit_batches` and
            # `fast_dev_run` set it too) caps it the way the fit loop does.
            cap = self._training_cap(getattr(trainer, "limit_train_batches", None))
            if cap is not None and not (isinstance(n, (int, float)) and n <= cap):
                n = cap
        elif getattr(trainer, "sanity_checking", False):
            # Whole, the pass read ahead (4 batches in the main process, 2 per worker) what the check never takes:
            # 56 origin reads for its 16 samples (2 batches of 8 out of 13).
            counts = getattr(trainer, "num_sanity_val_batches", None)
            n = counts[0] if isinstance(counts, list) and len(counts) == 1 else None
        else:
            attr = (
                "num_test_batches"
                if getattr(trainer, "testing", False)
                else "num_predict_batches"
                if getattr(trainer, "predicting", False)
                else "num_val_batches"
            )
            counts = getattr(trainer, attr, None)
            n = counts[0] if isinstance(counts, list) and len(counts) == 1 else None
        return float(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else None

    def _training_cap(self, limit: object) -> int | None:
        """The training batches ``limit`` (a Trainer's ``limit_train_batches``) lets a pass take: an ``int`` counts
        batches, a ``float`` below 1 is a fraction of the loader's length (as Lightning's fit loop reads them)."""
        if isinstance(limit, bool):
            return None
        if isinstance(limit, int):
            return max(0, limit)
        loader = self._train_loader
        if isinstance(limit, float) and 0 <= limit < 1 and loader is not None:
            return int(len(loader) * limit)
        return None

    @override
    def train_dataloader(self) -> CacheDataLoader:
        """The training loader; its sampler counts consumed batches, and Lightning keeps the loader's
        ``state_dict`` in checkpoints, so a run resumed mid-epoch reads only that epoch's samples not yet seen."""
        self._train_loader = self._loader(self.train_set, shuffle=True, lone_last=True)
        if self._resume is not None and isinstance(self._train_loader.sampler, EpochOrderSampler):
            self._train_loader.sampler.load_state_dict(self._resume)
        return self._train_loader

    @override
    def state_dict(self) -> dict[str, Any]:
        """The training sampler's position (epoch, samples consumed, seed) and the training augmentation's position
        in its random stream (:attr:`GpuAugment.calls`), saved in every checkpoint.

        Lightning restores a datamodule's state before it builds the loaders, so a run resumed from a mid-epoch
        checkpoint reads only that epoch's samples not yet seen, each augmented as the uninterrupted run would have
        (the stream continues where it was instead of starting over). (The loader's own ``state_dict`` holds the
        sampler's position too; Lightning skips restoring that one when ``configure_optimizers`` built the loader
        early, e.g. through ``trainer.estimated_stepping_batches``.)"""
        state: dict[str, Any] = {}
        if self._classes is not None:
            state["classes"] = list(self._classes)
        loader = self._train_loader
        if loader is not None and isinstance(loader.sampler, EpochOrderSampler):
            state["train_sampler"] = loader.sampler.state_dict()
        if isinstance(self.train_augment, GpuAugment):
            # the consumer's position (the loader's thread may have augmented batches ahead, never taken)
            state["train_augment_calls"] = self.train_augment.calls
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the checkpoint's sampler position for the training loader built next, continue the training
        augmentation's random stream where the checkpoint left it, and check the class list.

        The training position is taken only by a ``fit`` (or with no Trainer attached): ``validate``, ``test`` and
        ``predict`` with ``ckpt_path`` restore this state too, and a later ``fit`` without ``ckpt_path`` must start
        its first epoch whole.

        Raises:
            ValueError: the checkpoint's classes differ from this data's (checked now when ``setup`` has run, which
                is where Lightning restores it, else in ``setup``): before the first step of the resumed run.
        """
        if self._restoring_fit():
            self._resume = state_dict.get("train_sampler")
            saved_seed = (self._resume or {}).get("seed", self.seed)
            if saved_seed != self.seed and self.val_origin is None and self.val_fraction > 0:
                rank_zero_warn(
                    f"the checkpoint was trained with `seed` {saved_seed}, this module has {self.seed}: the seed also "
                    f"picks the {self.val_fraction!r} of `origin` held out for validation, so validation now holds "
                    "out other samples, some of them trained on. Set `seed` back to keep the split."
                )
            calls = state_dict.get("train_augment_calls")
            if calls is not None and isinstance(self.train_augment, GpuAugment):
                self.train_augment.calls = int(calls)
        ckpt = state_dict.get("classes")
        self._ckpt_classes = None if ckpt is None else [str(c) for c in ckpt]
        self._check_ckpt_classes()

    def _restoring_fit(self) -> bool:
        """Whether a checkpoint restored now is for training: the attached Trainer runs ``fit``, or none is attached
        (a state loaded by hand). Before, ``trainer.validate(ckpt_path=...)`` kept the checkpoint's sampler position,
        and the next ``fit`` without ``ckpt_path`` skipped the samples that checkpoint had consumed of its epoch."""
        fn = getattr(getattr(self.trainer, "state", None), "fn", None)
        return fn is None or getattr(fn, "value", fn) == "fit"

    @override
    def val_dataloader(self) -> CacheDataLoader:
        return self._loader(self.val_set, shuffle=False)

    @override
    def test_dataloader(self) -> CacheDataLoader:
        """The validation split's loader, with a warning: the module has no test split of its own. To test on held-out
        data, point ``val_origin`` at it for the ``test`` run (``--data.val_origin=DIR`` on the command line)."""
        rank_zero_warn(
            f"{type(self).__name__} has no test split: `test` runs on the validation split (`val_origin`, or the "
            "`val_fraction` held out of `origin`). To test on other data, pass it as `val_origin` for the test run."
        )
        return self.val_dataloader()

    @override
    def predict_dataloader(self) -> CacheDataLoader:
        """The validation split's loader (the module has no prediction split of its own)."""
        return self.val_dataloader()

    # ---- device side ---------------------------------------------------------------------------------------------
    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Augment (training) or normalise (evaluation) the uint8 batch on its device; log cache statistics. A CPU
        training batch already augmented on the loader's thread (``cpu_augment="thread"``) passes through."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor)):
            return batch  # not one of our (images, labels) batches, e.g. the model summary's example input
        x, y = batch
        trainer = self.trainer
        training = bool(trainer is not None and trainer.training)
        ready = self._ready.pop(id(x), None) if training else None
        if ready is not None and ready[0] is x:  # augmented ahead on the loader's thread (`cpu_augment="thread"`)
            self.train_augment.calls = ready[1] + 1
        else:
            aug = self.train_augment if training else self.val_augment
            x = aug(x, train=training)
        if training:
            self._consumed(trainer)
            self._maybe_log(trainer)
        return x, y

    def _consumed(self, trainer: Any) -> None:
        """One training batch of the order consumed: the sampler's position, for a mid-epoch resume."""
        loader = self._train_loader
        if loader is not None and isinstance(loader.sampler, EpochOrderSampler):
            loader.sampler.advance(self.batch_size)
            if _last_batch_of_epoch(trainer):
                # The Trainer ends this epoch here (`limit_train_batches` stops it before the order's end): its state
                # must say "epoch over", or a run resumed from its end-of-epoch checkpoint read the rest of this
                # epoch's order as the next epoch (DataLoader workers draw it before Lightning's `set_epoch`).
                loader.sampler.finish_epoch()
        if self._resume is not None and self._resume.get("epoch") != trainer.current_epoch:
            self._resume = None  # the resumed epoch is over: a reloaded loader starts whole epochs

    def _maybe_log(self, trainer: Any) -> None:
        step = int(trainer.global_step)
        if step == self._last_logged_step or step % self.log_every_n_steps:
            return
        self._last_logged_step = step
        stats = self.global_cache_stats()  # a collective: every rank reaches it at the same step
        if not trainer.is_global_zero:
            return
        metrics = {f"cache/{k}": float(v) for k, v in stats.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def global_cache_stats(self) -> dict[str, Any]:
        """:attr:`cache_stats` summed over every rank (counts summed; ``hit_rate`` etc. recomputed from the sums,
        i.e. the global rates). A collective under a multi-process strategy: call it on every rank."""
        trainer = self.trainer
        totals = self.stats.totals()
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        if strategy is not None and int(getattr(trainer, "world_size", 1)) > 1:
            totals = strategy.reduce(totals.to(strategy.root_device), reduce_op="sum").cpu()
        return summarize(totals)

    @property
    def cache_stats(self) -> dict[str, Any]:
        """Totals over the main process and every worker of this rank: hits per tier, bytes fetched, evictions, ..."""
        return self.stats.as_dict()

    def _report_skipped(self, what: str) -> None:
        """Warn with the samples this rank skipped as undecodable since the last report (none: silent).

        Per rank and without a collective: it runs where a loader's pass ended (ranks may differ there) and at
        teardown; the global count is ``cache/decode_skipped`` in the logged statistics."""
        # Read the trainer's properties before deciding, so every rank reads the same ones whatever it skipped.
        trainer = self.trainer
        epoch = int(getattr(trainer, "current_epoch", 0)) if trainer is not None else 0
        _, rank = self._sharding()
        skipped = int(self.stats.as_dict()["decode_skipped"])
        new = skipped - self._skipped_reported
        if new <= 0:
            return
        self._skipped_reported = skipped
        warnings.warn(
            f"lightning_accel data: rank {rank} skipped {new} undecodable sample(s) in {what} (epoch {epoch}; "
            f"{skipped} in all) because `on_decode_error='skip'`; fix or remove the files, or pass "
            "`on_decode_error='raise'` to stop at the first one with its key.",
            RuntimeWarning,
            stacklevel=2,
        )

    @override
    def teardown(self, stage: str) -> None:
        """Copy the RAM tier's entries to the SSD tier (local rank 0 of each node), so they survive a reboot; fsync.
        Report undecodable samples skipped since the last report. A checkpoint's sampler position ends with the fit
        that restored it: a later ``fit`` without ``ckpt_path`` starts its first epoch whole."""
        self._report_skipped(f"{getattr(stage, 'value', stage)}")
        if getattr(stage, "value", stage) == "fit":
            # Otherwise kept until a batch of a later epoch is consumed (`_consumed`): a resumed fit that ended with
            # the resumed epoch left it, and the next fit's loader skipped that epoch's first samples again.
            self._resume = None
        trainer = self.trainer
        spill = trainer is None or int(getattr(trainer, "local_rank", 0)) == 0
        for cache in self._caches.values():
            if spill:
                cache.spill()
            for _, tier in cache.tiers:
                tier.flush()
