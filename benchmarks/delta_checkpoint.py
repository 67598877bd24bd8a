"""Delta checkpoints vs ``TorchCheckpointIO`` in real Lightning training on the digits.

One process runs, with the same seed and data:

1. ``torch``      — ImageClassifier (AdamW) + ``ModelCheckpoint(every_n_train_steps=N, save_top_k=3, save_last=True,
   monitor="step", mode="max")`` with Lightning's ``TorchCheckpointIO``;
2. ``lossless``   — the same with ``DeltaCheckpointIO(async_save=True)``;
3. ``quantized``  — ``DeltaCheckpointIO(async_save=True, quantize="int8", quantize_groups="all")``;
4. ``frozen_torch`` / ``frozen_lossless`` — a frozen-backbone fine-tune (backbone weights from run 2, BatchNorm
   statistics frozen, only the linear head trains).

Per run: bytes written by the saves, bytes on disk at the end, mean and median training stall per save (time the
``ModelCheckpoint`` hook blocked the loop; ``stall_vs_torch`` uses the medians, ``stall_mean_vs_torch`` the means),
mean load time of every remaining checkpoint (timed alternately across runs), and for the full runs the validation
accuracy after resuming from the oldest remaining top-k checkpoint and training to the end.
``lossless_roundtrip_exact``: every remaining lossless checkpoint restores bitwise-equal tensors to what the training
loop handed to ``save_checkpoint``. ``disk_end_vs_torch_lossless``: bytes left on disk at the end of the lossless run
over those of the torch run (top-k + last). ``pending_peak``: one more lossless run with ``async_save=True`` and
``ModelCheckpoint(every_n_train_steps=1, save_top_k=2, save_last=True)``: the most saves that were queued or running
at once (``max_pending``, + 1 overtaking, bounds it), with the stalls and coalesced saves it took in ``results``.

``pressure`` (``async_fit_time_vs_torch_sync``, ``async_peak_rss_growth_vs_torch``): a ~21M-parameter MLP (Adam,
a ~250 MB checkpoint) trained with ``ModelCheckpoint(every_n_train_steps=1)``, once with ``TorchCheckpointIO``
(synchronous) and once with ``DeltaCheckpointIO(async_save=True)``, alternated in the same process: fit time
(including the final wait for saves in flight) and peak RSS growth during the fit, plus where the delta run's stall
per save went (snapshot, waiting for a slot, the rest) and what its writer spent (comparing/hashing, encoding,
writing). ``frozen_sync_save_time_vs_torch``: a frozen torchvision resnet18 whose head trains one step between
saves, saved synchronously by ``DeltaCheckpointIO()`` and ``TorchCheckpointIO`` alternately: median time per save.

``readers`` (``reader_false_errors``) and ``orphans`` (``orphan_bytes_after_kills_vs_tracked``), from
:mod:`benchmarks._delta_faults`: loads of ``last.ckpt`` while a writer keeps replacing it, on local disk and on a moto
S3 server (errors that are not real damage), and a loop of SIGKILLs of a training process resumed each time with
``ckpt_path="last"`` (bytes of untracked checkpoints left at the end over the tracked ones).

The runs whose bytes on disk are compared use ``gc_grace_s=0``: with the default grace period the blobs of removed
checkpoints stay up to a minute for readers before a later save's collection deletes them.

Note: with ``save_last=True`` Lightning writes every step twice (``step=...ckpt`` and ``last.ckpt``); the delta store
writes the second copy as references only, which is part of the measured win. ``results`` also give the bytes per
unique save so the two effects can be told apart.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/delta_checkpoint.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from benchmarks._delta_faults import orphan_case, reader_case
from benchmarks._harness import StepClock, alternate, cpu_trainer, median, parser, ratio, report
from lightning_accel.checkpoint.plugin import DeltaCheckpointIO
from lightning_accel.models import ImageClassifier

#: runs whose every save is recorded to check the lossless round trip
RECORDED = ("lossless", "frozen_lossless")


def _digits(size: int) -> tuple[TensorDataset, TensorDataset]:
    """The real digits (scikit-learn's 1,797 images) as normalised (N, 3, size, size) tensors, split 80/20."""
    from lightning_accel.data.dataset import split_indices
    from lightning_accel.datasets import load_digits_arrays

    images, labels = load_digits_arrays()
    x = torch.from_numpy(images).float().div(16.0).unsqueeze(1)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x = (x - x.mean()) / x.std()
    y = torch.from_numpy(labels)
    tr, va = split_indices(len(y), 0.2, seed=0)
    return TensorDataset(x[tr], y[tr]), TensorDataset(x[va], y[va])


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and not p.is_symlink())


class CountingTorchIO(TorchCheckpointIO):
    """TorchCheckpointIO that counts the bytes it writes and the seconds its saves and removals take."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_written = 0
        self.io_s = 0.0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        t0 = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        self.io_s += time.perf_counter() - t0
        self.bytes_written += os.path.getsize(path)

    def remove_checkpoint(self, path: Any) -> None:
        t0 = time.perf_counter()
        super().remove_checkpoint(path)
        self.io_s += time.perf_counter() - t0


class TimedDeltaIO(DeltaCheckpointIO):
    """DeltaCheckpointIO that counts the seconds its ``save_checkpoint`` / ``remove_checkpoint`` calls block."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.io_s = 0.0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        t0 = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        self.io_s += time.perf_counter() - t0

    def remove_checkpoint(self, path: Any) -> None:
        t0 = time.perf_counter()
        super().remove_checkpoint(path)
        self.io_s += time.perf_counter() - t0


def stall_breakdown(io: Any, stalls: list[float]) -> dict[str, float]:
    """Where the mean stall per ``ModelCheckpoint`` save event went: inside the checkpoint IO's calls (for async
    delta: the snapshot and the wait for a slot, the rest being queueing), and outside them (Lightning building the
    checkpoint dict, ``ModelCheckpoint``'s bookkeeping), which both IOs pay alike."""
    n = max(1, len(stalls))
    io_s = getattr(io, "io_s", 0.0) / n
    out = {
        "mean_stall_s": sum(stalls) / n,
        "in_checkpoint_io_s": io_s,
        "outside_checkpoint_io_s": sum(stalls) / n - io_s,
    }
    if isinstance(io, DeltaCheckpointIO):
        st = io.writer_stats
        out["snapshot_s"] = st.snapshot_s / n
        out["wait_for_slot_s"] = st.stall_s / n
    return out


class StallCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose batch-hook saves are timed by a :class:`StepClock` (``clock.times``: how long each save
    blocked the loop) and, with ``record``, whose saved tensors are kept for the round-trip check."""

    def __init__(self, *a: Any, record: bool = False, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.clock = StepClock()
        self.record = record
        self.saved: dict[str, dict[str, torch.Tensor]] = {}
        self._record_s = 0.0

    @property
    def stalls(self) -> list[float]:
        """Seconds each save blocked the training loop."""
        return self.clock.times

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kw: Any) -> None:
        before = self._last_global_step_saved
        self._record_s = 0.0
        t0 = self.clock.now()
        super().on_train_batch_end(trainer, *args, **kw)
        if self._last_global_step_saved != before:  # the bookkeeping copy below is not part of the stall
            self.clock.record(self.clock.now() - t0 - self._record_s)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        if self.record:
            t0 = time.perf_counter()
            ck = trainer._checkpoint_connector.dump_checkpoint(self.save_weights_only)
            flat = {f"sd/{k}": v.detach().clone() for k, v in ck["state_dict"].items()}
            for i, o in enumerate(ck["optimizer_states"]):
                for pid, st in o["state"].items():
                    flat.update({f"opt{i}/{pid}/{n}": t.detach().clone() for n, t in st.items()})
            self.saved[os.path.abspath(filepath)] = flat
            self._record_s += time.perf_counter() - t0
        super()._save_checkpoint(trainer, filepath)


class FrozenBackbone(ImageClassifier):
    """Only the linear head trains; backbone parameters and BatchNorm statistics stay fixed."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        for m in (self.model.stem, self.model.layers):
            m.requires_grad_(False)

    def train(self, mode: bool = True) -> FrozenBackbone:
        super().train(mode)
        self.model.stem.eval()
        self.model.layers.eval()
        return self


def _flatten(ck: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat = {f"sd/{k}": v for k, v in ck["state_dict"].items()}
    for i, o in enumerate(ck["optimizer_states"]):
        for pid, st in o["state"].items():
            flat.update({f"opt{i}/{pid}/{n}": t for n, t in st.items()})
    return flat


@dataclass
class Setup:
    """What every run shares: data, model size, epochs, the save interval and a scratch directory."""

    size: int
    width: int
    epochs: int
    every: int
    train_set: TensorDataset
    val_set: TensorDataset
    workdir: Path
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # per run: what it measured
    ios: dict[str, Any] = field(default_factory=dict)  # per run: its checkpoint IO (to load its checkpoints)

    @classmethod
    def create(cls, quick: bool, every: int | None) -> Setup:
        # 16 px digits (the originals are 8x8) keep compute low while width 48 gives an 8 MB Adam checkpoint.
        size, width = (16, 48) if quick else (16, 64)
        train_set, val_set = _digits(size)
        return cls(
            size=size,
            width=width,
            epochs=2 if quick else 8,
            every=every or (8 if quick else 10),
            train_set=train_set,
            val_set=val_set,
            workdir=Path(tempfile.mkdtemp(prefix="delta_ckpt_bench_")),
        )

    def loaders(self) -> tuple[DataLoader, DataLoader]:
        g = torch.Generator().manual_seed(0)
        return (
            DataLoader(self.train_set, batch_size=64, shuffle=True, generator=g),
            DataLoader(self.val_set, batch_size=256),
        )

    def trainer(self, root: Path, io: Any, callbacks: list[Any], **kw: Any) -> L.Trainer:
        return cpu_trainer(plugins=[io], callbacks=callbacks, default_root_dir=str(root), max_epochs=self.epochs, **kw)

    def model(self, kind: str, backbone: dict[str, torch.Tensor] | None = None) -> ImageClassifier:
        L.seed_everything(0, verbose=False)
        if kind == "frozen":
            m = FrozenBackbone(width=self.width, lr=3e-3)
            assert backbone is not None
            m.load_state_dict({k: v for k, v in backbone.items() if not k.startswith("model.fc.")}, strict=False)
            return m
        return ImageClassifier(width=self.width, lr=3e-3)


def train_with_saves(
    setup: Setup, name: str, io: Any, kind: str, backbone: dict[str, torch.Tensor] | None = None
) -> ImageClassifier:
    """Case: one training run saving every ``setup.every`` steps through ``io``; fills ``setup.runs[name]``."""
    root = setup.workdir / name
    cb = StallCheckpoint(
        dirpath=root / "ckpt",
        filename="{step}",
        every_n_train_steps=setup.every,
        save_top_k=3,
        save_last=True,
        monitor="step",
        mode="max",
        record=name in RECORDED,
    )
    model = setup.model(kind, backbone)
    trainer = setup.trainer(root, io, [cb])
    t0 = time.perf_counter()
    trainer.fit(model, *setup.loaders())
    fit_s = time.perf_counter() - t0
    ckpt_dir = root / "ckpt"
    written = io.bytes_written if hasattr(io, "bytes_written") else sum(s.bytes_written for s in io.history)
    saves = len(cb.stalls)
    run: dict[str, Any] = {
        "saves": saves,
        "bytes_written": int(written),
        "bytes_on_disk": _dir_bytes(ckpt_dir),
        "mean_stall_s": sum(cb.stalls) / max(1, saves),
        "median_stall_s": median(cb.stalls) if cb.stalls else 0.0,
        "fit_s": fit_s,
        "remaining": sorted(str(q) for q in ckpt_dir.glob("*.ckpt")),
        "val_acc": float(trainer.callback_metrics.get("val_acc", torch.tensor(float("nan")))),
    }
    run["stall_breakdown_per_event"] = stall_breakdown(io, cb.stalls)
    if cb.record:
        run["roundtrip_exact"] = roundtrip_exact(io, run["remaining"], cb.saved)
    setup.runs[name], setup.ios[name] = run, io
    return model


def roundtrip_exact(io: Any, paths: list[str], saved: dict[str, dict[str, torch.Tensor]]) -> bool:
    """Every remaining checkpoint restores bitwise what the training loop handed to ``save_checkpoint``."""
    exact = True
    for path in paths:
        got = _flatten(io.load_checkpoint(path))
        want = saved[os.path.abspath(path)]
        exact &= got.keys() == want.keys() and all(
            got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want
        )
    return bool(exact)


def load_times(setup: Setup, repeats: int) -> None:
    """Case: mean load time of every remaining checkpoint per run, runs alternated to spread machine noise."""

    def loader(name: str) -> Any:
        def go() -> float:
            t0 = time.perf_counter()
            for path in setup.runs[name]["remaining"]:
                setup.ios[name].load_checkpoint(path)
            return (time.perf_counter() - t0) / len(setup.runs[name]["remaining"])

        return go

    for n, ts in alternate({n: loader(n) for n in setup.runs}, repeats=repeats, warmup=1).items():
        setup.runs[n]["mean_load_s"] = median(ts)


def resume_accuracy(setup: Setup, name: str, io: Any) -> None:
    """Case: resume from the oldest remaining top-k checkpoint (mid-run), train to the end, validate."""
    run = setup.runs[name]
    ckpts = [q for q in run["remaining"] if not q.endswith("last.ckpt")]
    oldest = min(ckpts, key=lambda q: int(Path(q).stem.split("=")[1]))
    run["resumed_from"] = Path(oldest).name
    model = setup.model("full")
    trainer = setup.trainer(setup.workdir / f"{name}_resume", io, [], enable_checkpointing=False)
    trainer.fit(model, *setup.loaders(), ckpt_path=oldest)
    run["resume_val_acc"] = float(trainer.validate(model, setup.loaders()[1], verbose=False)[0]["val_acc"])


def every_step_pressure(setup: Setup) -> dict[str, Any]:
    """Case: async saves at every training step (two per step with ``save_last``), one epoch: how many saves were in
    flight at most, how often and how long the loop waited for a slot, how many saves coalesced."""
    root = setup.workdir / "every_step"
    io = DeltaCheckpointIO(async_save=True)
    cb = ModelCheckpoint(
        dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=2, save_last=True, monitor="step", mode="max"
    )
    epochs, setup.epochs = setup.epochs, 1
    try:
        trainer = setup.trainer(root, io, [cb])
    finally:
        setup.epochs = epochs
    t0 = time.perf_counter()
    trainer.fit(setup.model("full"), *setup.loaders())
    st = io.writer_stats
    return {
        "max_pending": io.max_pending,
        "saves_submitted": st.submitted,
        "pending_peak": st.pending_peak,
        "stalls": st.stalls,
        "stall_s": st.stall_s,
        "coalesced": st.coalesced,
        "fit_s": time.perf_counter() - t0,
        "last_loads": bool(io.load_checkpoint(root / "ckpt" / "last.ckpt")["global_step"] == trainer.global_step),
    }


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (``VmHWM``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class _RSSProbe(L.Callback):
    """Peak RSS sampled at every step and save (used where ``VmHWM`` cannot be reset)."""

    def __init__(self) -> None:
        self.peak = 0

    def on_train_batch_end(self, *args: Any, **kw: Any) -> None:
        self.peak = max(self.peak, _rss())

    def on_save_checkpoint(self, *args: Any, **kw: Any) -> None:
        self.peak = max(self.peak, _rss())


class WideMLP(L.LightningModule):
    """``depth`` square ``width`` x ``width`` layers (5 x 2048: ~21M parameters), Adam: a ~250 MB checkpoint."""

    def __init__(self, width: int = 2048, depth: int = 5) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers[:-1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return (self.net(x) - x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def _pressure_run(workdir: Path, name: str, io: Any, steps: int, width: int) -> dict[str, Any]:
    """One fit of :class:`WideMLP` saving at every step through ``io``: fit time, peak RSS growth, stalls."""
    root = workdir / name
    L.seed_everything(0, verbose=False)
    model = WideMLP(width=width)
    data = DataLoader(TensorDataset(torch.randn(steps * 16, width)), batch_size=16)
    cb = StallCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1)
    probe = _RSSProbe()
    trainer = cpu_trainer(plugins=[io], callbacks=[probe, cb], default_root_dir=str(root), max_epochs=1)
    gc.collect()
    rss0 = _rss()
    hwm = _reset_peak_rss()
    t0 = time.perf_counter()
    trainer.fit(model, data)  # teardown waits for the saves in flight: part of the fit time
    fit_s = time.perf_counter() - t0
    peak = (_peak_rss() if hwm else probe.peak) - rss0
    del trainer, model, data
    gc.collect()
    run: dict[str, Any] = {
        "fit_s": fit_s,
        "peak_rss_growth_bytes": peak,
        "rss_held_after_fit_bytes": _rss() - rss0,
        "saves": len(cb.stalls),
        "median_stall_s": median(cb.stalls) if cb.stalls else 0.0,
        "mean_stall_s": sum(cb.stalls) / max(1, len(cb.stalls)),
        "peak_from": "VmHWM" if hwm else "sampled",
        "stall_breakdown_per_event": stall_breakdown(io, cb.stalls),
    }
    if isinstance(io, DeltaCheckpointIO):
        st, hist = io.writer_stats, list(io.history)
        run["writer"] = {
            "submitted": st.submitted,
            "written": len(hist),
            "coalesced": st.coalesced,
            "cancelled": st.cancelled,
            "stalls": st.stalls,
            "tensors_shared": st.tensors_shared,
            "buffers_allocated": st.buffers_allocated,
            "pending_peak": st.pending_peak,
        }
        # What the background writer spent per save it wrote (summed over its encode threads).
        w = max(1, len(hist))
        run["writer_per_written_save_s"] = {
            "compare_or_hash": sum(h.hash_s for h in hist) / w,
            "encode": sum(h.encode_s for h in hist) / w,
            "write": sum(h.write_s for h in hist) / w,
            "total": sum(h.seconds for h in hist) / w,
        }
    return run


def pressure_case(setup: Setup, quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Case: save at every step of a ~21M-parameter model, async delta vs synchronous torch, alternated."""
    steps, reps, width = (16, 1, 2048) if quick else (40, 2, 2048)
    runs: dict[str, list[dict[str, Any]]] = {"torch_sync": [], "delta_async": []}
    for rep in range(reps):
        order = ["torch_sync", "delta_async"] if rep % 2 == 0 else ["delta_async", "torch_sync"]
        for name in order:
            io = CountingTorchIO() if name == "torch_sync" else TimedDeltaIO(async_save=True)
            runs[name].append(_pressure_run(setup.workdir / f"pressure{rep}", name, io, steps, width))
        shutil.rmtree(setup.workdir / f"pressure{rep}", ignore_errors=True)
    t, d = runs["torch_sync"], runs["delta_async"]
    results = {
        "model": f"WideMLP(width={width}, depth=5) + Adam, {sum(p.numel() for p in WideMLP(width).parameters())} "
        f"params, {steps} steps, ModelCheckpoint(every_n_train_steps=1)",
        "runs": runs,
    }
    ratios = {
        "async_fit_time_vs_torch_sync": ratio(median([r["fit_s"] for r in d]), median([r["fit_s"] for r in t])),
        "async_peak_rss_growth_vs_torch": ratio(
            median([r["peak_rss_growth_bytes"] for r in d]), median([r["peak_rss_growth_bytes"] for r in t])
        ),
    }
    return results, ratios


def frozen_sync_case(setup: Setup, quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Case: a frozen resnet18 whose head trains one step between saves; synchronous saves, delta vs torch,
    alternated per save; median seconds per save."""
    import torchvision  # type: ignore[import-untyped]

    saves = 10 if quick else 20
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=100).eval()
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("fc."))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(8, 3, 64, 64)
    ios: dict[str, Any] = {"torch": CountingTorchIO(), "delta": DeltaCheckpointIO()}
    times: dict[str, list[float]] = {k: [] for k in ios}
    root = setup.workdir / "frozen_sync"
    for i in range(saves):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        ck = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": i}
        for name in list(ios) if i % 2 == 0 else list(ios)[::-1]:
            path = root / name / f"step={i}.ckpt"
            path.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            ios[name].save_checkpoint(ck, path)
            times[name].append(time.perf_counter() - t0)
            if i >= 3:  # keep 3, as save_top_k=3 would (not timed)
                ios[name].remove_checkpoint(root / name / f"step={i - 3}.ckpt")
    ios["delta"].teardown()
    frozen = DeltaCheckpointIO().load_checkpoint(root / "delta" / f"step={saves - 1}.ckpt")["state_dict"]
    exact = all(torch.equal(frozen[k], v) for k, v in model.state_dict().items())
    shutil.rmtree(root, ignore_errors=True)
    hist = list(ios["delta"].history)
    results = {
        "saves": saves,
        "torch_median_save_s": median(times["torch"]),
        "delta_median_save_s": median(times["delta"]),
        "delta_bytes_vs_torch": ratio(sum(h.bytes_written for h in hist), ios["torch"].bytes_written),
        "delta_unchanged_tensors_per_save": sum(h.tensors_unchanged for h in hist) / len(hist),
        "delta_compare_or_hash_s_per_save": sum(h.hash_s for h in hist) / len(hist),
        "delta_encode_s_per_save": sum(h.encode_s for h in hist) / len(hist),
        "delta_write_s_per_save": sum(h.write_s for h in hist) / len(hist),
        "roundtrip_exact": exact,
    }
    return results, {
        "frozen_sync_save_time_vs_torch": ratio(results["delta_median_save_s"], results["torch_median_save_s"])
    }


def delta_numbers(
    runs: dict[str, dict[str, Any]], pressure: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, float]]:
    """``results`` (every run, without its file list) and the published ratios against ``TorchCheckpointIO``."""
    t, lo, q, ft, fl = (runs[n] for n in ("torch", "lossless", "quantized", "frozen_torch", "frozen_lossless"))
    results: dict[str, Any] = {n: {k: v for k, v in r.items() if k != "remaining"} for n, r in runs.items()}
    for r in results.values():
        r["bytes_written_per_save"] = r["bytes_written"] / max(1, r["saves"])
    results["lossless_roundtrip_exact"] = bool(lo["roundtrip_exact"] and fl["roundtrip_exact"])
    if pressure is not None:
        results["every_step"] = pressure
    ratios = {
        "lossless_bytes_vs_torch": ratio(lo["bytes_written"], t["bytes_written"]),
        "frozen_bytes_vs_torch": ratio(fl["bytes_written"], ft["bytes_written"]),
        "quantized_bytes_vs_torch": ratio(q["bytes_written"], t["bytes_written"]),
        "lossless_disk_vs_torch": ratio(lo["bytes_on_disk"], t["bytes_on_disk"]),
        "disk_end_vs_torch_lossless": ratio(lo["bytes_on_disk"], t["bytes_on_disk"]),
        "quantized_disk_vs_torch": ratio(q["bytes_on_disk"], t["bytes_on_disk"]),
        # Median per-save stall: one save that another tenant of a shared machine delays would dominate a mean of
        # 5-10 saves; the mean ratio is reported next to it.
        "stall_vs_torch": ratio(lo["median_stall_s"], t["median_stall_s"]),
        "stall_mean_vs_torch": ratio(lo["mean_stall_s"], t["mean_stall_s"]),
        "load_vs_torch": ratio(lo["mean_load_s"], t["mean_load_s"]),
        "quantized_resume_acc_minus_torch": round(q["resume_val_acc"] - t["resume_val_acc"], 4),
    }
    if pressure is not None:
        ratios["pending_peak"] = pressure["pending_peak"]
    return results, ratios


def run_all(setup: Setup, quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Every case of this benchmark, in order, on ``setup``: the Lightning runs, loads and resumes, the every-step
    backpressure run, then the frozen, pressure, reader and kill-loop cases."""
    train_with_saves(setup, "torch", CountingTorchIO(), "full")
    # gc_grace_s=0 in the runs whose bytes on disk are compared: with the default grace period, blobs of removed
    # checkpoints wait up to a minute for readers before a later save's collection deletes them
    trained = train_with_saves(setup, "lossless", TimedDeltaIO(async_save=True, gc_grace_s=0), "full")
    quantized = DeltaCheckpointIO(async_save=True, quantize="int8", quantize_groups="all", gc_grace_s=0)
    train_with_saves(setup, "quantized", quantized, "full")
    backbone = {k: v.detach().clone() for k, v in trained.state_dict().items()}
    train_with_saves(setup, "frozen_torch", CountingTorchIO(), "frozen", backbone)
    train_with_saves(setup, "frozen_lossless", TimedDeltaIO(async_save=True, gc_grace_s=0), "frozen", backbone)
    load_times(setup, repeats=3 if quick else 5)
    resume_accuracy(setup, "torch", CountingTorchIO())
    resume_accuracy(setup, "quantized", DeltaCheckpointIO())
    pressure = every_step_pressure(setup)
    results, ratios = delta_numbers(setup.runs, pressure)
    for case, fn in (("frozen_sync", frozen_sync_case), ("pressure", pressure_case)):
        r, q = fn(setup, quick)
        results[case] = r
        ratios.update(q)
    # readers loading during saves (local and moto S3) and the kill loop's leftovers: benchmarks/_delta_faults.py
    for case, out in (("readers", reader_case(quick, None)), ("orphans", orphan_case(quick))):
        results[case] = out["results"]
        ratios.update(out["ratios"])
    return results, ratios


def parse_args() -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--every", type=int, default=None, help="ModelCheckpoint(every_n_train_steps=...)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    setup = Setup.create(args.quick, args.every)
    try:
        results, ratios = run_all(setup, args.quick)
        config = {
            "model": f"ImageClassifier(width={setup.width}) + AdamW",
            "data": f"digits {setup.size}px, {len(setup.train_set)} train / {len(setup.val_set)} val",
            "epochs": setup.epochs,
            "checkpoint": f"ModelCheckpoint(every_n_train_steps={setup.every}, save_top_k=3, save_last=True, "
            "monitor='step')",
            "lossless": "DeltaCheckpointIO(async_save=True, gc_grace_s=0)",
            "quantized": "DeltaCheckpointIO(async_save=True, quantize='int8', quantize_groups='all', gc_grace_s=0)",
            "torch_threads": torch.get_num_threads(),
        }
        report(
            "delta_checkpoint",
            quick=args.quick,
            config=config,
            results=results,
            ratios=ratios,
            out=args.out,
            chart={k: v for k, v in ratios.items() if not k.startswith("quantized_resume") and k != "pending_peak"},
            chart_title="delta checkpoints: ours / TorchCheckpointIO",
        )
    finally:
        shutil.rmtree(setup.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
