"""Every public callback and plugin together under 2-process DDP (gloo), with their default arguments, under
``strategy="ddp"``, ``"ddp_1bit"`` and ``"diloco"`` (local steps): no collective or ``trainer.*`` property may be
reached on some ranks only.

One process launch runs every strategy (later fits reuse the process group of the first); a hang or a
``Connection closed by peer`` in any callback fails the test through the rank that saw it. The checkpoints go through
the setup the docs recommend (``DeltaModelCheckpoint`` with ``CheckpointGuard``, as the ``lightning-accel`` CLI adds),
which raises a failed async save on every rank: no warning about an unrouted save may appear. ``StructuredPruning`` runs
in a fit of its own without ``FusedPrecision``: its torch.fx trace cannot follow the fused modules' forward (a
combination that raises a clear TypeError at the pruning epoch, on every rank alike).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers import run_in_processes


def _fits(rank: int, world_size: int, origin: str, root: str) -> dict[str, Any]:
    import warnings

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger

    import lightning_accel as la
    from lightning_accel.models import ImageClassifier

    class Scheduled(ImageClassifier):
        """WarmupCosineLR bound by PerStepLR (the LightningCLI ``lr_scheduler:`` path)."""

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            return {"optimizer": opt, "lr_scheduler": la.WarmupCosineLR(opt, warmup_fraction=0.1)}

    out: dict[str, Any] = {}
    strategies = {
        "ddp": lambda: "ddp",
        "ddp_1bit": lambda: la.OneBitDDPStrategy(warmup_steps=2),
        "diloco": lambda: la.LocalStepsStrategy(sync_every=2),
    }
    runs = (("ddp", False), ("ddp_1bit", False), ("diloco", False), ("ddp", True), ("ddp_1bit", True))
    for strategy, prune in runs:
        pl.seed_everything(0)
        name = strategy + ("_prune" if prune else "")
        tmp = Path(root) / name
        model = Scheduled(width=4, blocks=(1,))
        model.example_input_array = torch.zeros(2, 3, 16, 16)
        teacher = ImageClassifier(width=4, blocks=(1,)).model
        dm = la.CachedDataModule(
            origin,
            cache_dir=str(tmp / "cache"),
            ram_dir=str(tmp / "ram"),
            ram_bytes="4MiB",
            image_size=16,
            batch_size=8,
            num_workers=0,
            val_fraction=0.2,
            train_augment=la.GpuAugment(mean=(0.2,) * 3, std=(0.3,) * 3, flip_p=0.5),
            mean=(0.2,) * 3,
            std=(0.3,) * 3,
        )
        monitor = la.PerformanceMonitor()  # defaults: the report goes to the logger's log_dir
        callbacks = [
            monitor,
            la.CudaMemoryManager(),
            la.LinearScalingLR(base_batch_size=8),
            la.PerStepLR(),
            la.KnowledgeDistillation(teacher, temperature=2.0, alpha=0.5),
            la.CheckpointGuard(),
            la.DeltaModelCheckpoint(dirpath=str(tmp / "ckpt"), save_last=True),
        ]
        plugins: list[Any] = [la.DeltaCheckpointIO(async_save=True)]
        if prune:
            callbacks = [monitor, la.PerStepLR(), la.StructuredPruning(0.25, schedule=1), *callbacks[-2:]]
        else:
            plugins.append(la.FusedPrecision("bf16-mixed"))
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategies[strategy](),
            max_epochs=2,
            limit_train_batches=4,
            limit_val_batches=2,
            log_every_n_steps=2,
            logger=CSVLogger(str(tmp), name="logs"),
            plugins=plugins,
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, datamodule=dm)
            trainer.validate(model, datamodule=dm, verbose=False)
        r = monitor.report
        assert r is not None
        out[name] = {
            "steps": r.steps,
            "samples_per_s": r.samples_per_s,
            "seconds": r.seconds,
            "epochs": r.epochs,
            "report": (Path(trainer.log_dir) / "perf_report.json").is_file(),
            "png": monitor.png_path,
            "last": (tmp / "ckpt" / "last.ckpt").is_file(),
            "global_step": trainer.global_step,
            "unrouted": [str(w.message) for w in caught if "raised on global rank 0 alone" in str(w.message)],
        }
    return out


def test_every_callback_and_plugin_under_two_process_ddp_ddp_1bit_and_diloco(tmp_path: Path) -> None:
    from lightning_accel.datasets import materialize_digits
    from lightning_accel.perf.plot import plot_available

    origin = tmp_path / "digits"
    materialize_digits(origin, size=16, num_images=160)
    a, b = run_in_processes(_fits, 2, (str(origin), str(tmp_path / "runs")), init_process_group=False, timeout=400)
    for strategy in ("ddp", "ddp_1bit", "diloco", "ddp_prune", "ddp_1bit_prune"):
        ra, rb = a[strategy], b[strategy]
        assert ra["global_step"] == rb["global_step"] == 8
        assert ra["seconds"] == rb["seconds"]  # reduced: one figure, the same on every rank
        assert ra["samples_per_s"] == rb["samples_per_s"]
        assert [e["epoch"] for e in ra["epochs"]] == [0.0, 1.0] and ra["epochs"] == rb["epochs"]
        assert ra["unrouted"] == rb["unrouted"] == []  # the recommended setup routes every save
        assert ra["report"] and ra["last"]  # rank 0 wrote the report with default arguments
        if plot_available():
            assert ra["png"] and Path(ra["png"]).is_file() and rb["png"] is None  # rank 0 drew the picture
