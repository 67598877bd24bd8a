"""The jobs ``benchmarks/tune.py`` tunes, and the worker that tunes one of them (in its own processes).

Each job is a ``lightning-accel fit`` config mapping in its *plain* form (no lightning-accel lever switched on):

- ``quickstart``: ``examples/configs/quickstart.yaml``'s CNN and cached digits, without its checkpoint plugin;
- ``tinygpt``: TinyGPT (AdamW) on the digits as token sequences, 2 processes (DDP over gloo);
- ``image``: the small ResNet on an ImageFolder read by torchvision (:class:`ImageFolderData`), built by
  :func:`_image_job` (the one place that says which images).

``python benchmarks/_tune_jobs.py JOB WORK OUT.json [--quick]`` tunes ``JOB`` and runs the grid in the same processes
(a multi-device job's other ranks are started by Lightning with this same command line); rank 0 writes ``OUT.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/_tune_jobs.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

REPO = Path(__file__).resolve().parent.parent


class DigitsTokens(L.LightningDataModule):
    """The digits as 65-token sequences (``lightning_accel.datasets.digits_tokens``), for TinyGPT."""

    def __init__(self, batch_size: int = 32, num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size, self.num_workers = batch_size, num_workers

    def setup(self, stage: str) -> None:
        from lightning_accel.datasets import digits_tokens

        tokens, _ = digits_tokens()
        full = TensorDataset(torch.from_numpy(tokens))
        self.train, self.val = Subset(full, range(0, 1500)), Subset(full, range(1500, len(full)))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, num_workers=self.num_workers)


class ImageFolderData(L.LightningDataModule):
    """torchvision ``ImageFolder`` + DataLoader over ``data_dir`` (decode every sample every epoch): the plain way."""

    def __init__(
        self,
        data_dir: str,
        image_size: int = 64,
        batch_size: int = 64,
        num_workers: int = 1,
        val_fraction: float = 0.1,
        mean: tuple[float, ...] = (0.188, 0.188, 0.188),
        std: tuple[float, ...] = (0.318, 0.318, 0.318),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_dir, self.image_size, self.batch_size = data_dir, image_size, batch_size
        self.num_workers, self.val_fraction, self.mean, self.std = num_workers, val_fraction, mean, std
        self.classes: list[str] = []

    def setup(self, stage: str) -> None:
        import torchvision.transforms as T
        from torchvision.datasets import ImageFolder

        tf = T.Compose(
            [
                T.Resize(self.image_size, antialias=True),
                T.CenterCrop(self.image_size),
                T.ToTensor(),
                T.Normalize(self.mean, self.std),
            ]
        )
        full = ImageFolder(self.data_dir, transform=tf)
        self.classes = list(full.classes)
        perm = torch.randperm(len(full), generator=torch.Generator().manual_seed(0)).tolist()
        n_val = max(1, int(len(full) * self.val_fraction))
        self.train, self.val = Subset(full, perm[n_val:]), Subset(full, perm[:n_val])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, num_workers=self.num_workers)


def quickstart_job(work: Path, quick: bool) -> dict[str, Any]:
    """The quickstart's job (examples/configs/quickstart.yaml) in its plain form, writing under ``work``."""
    from lightning_accel.tune import load_job

    job = load_job(REPO / "examples" / "configs" / "quickstart.yaml")
    t = job["trainer"]
    t.pop("plugins", None)  # plain: torch.save checkpoints
    t["callbacks"] = [c for c in t["callbacks"] if "PerformanceMonitor" not in c["class_path"]]
    t["callbacks"][0]["init_args"]["dirpath"] = str(work / "checkpoints")
    t.update(default_root_dir=str(work), accelerator="cpu")
    d = job["data"]["init_args"]
    d.update(origin=str(work / "digits64"), cache_dir=str(work / "cache"))
    if quick:  # a 2.9 s step at 64 px, width 32, batch 64 on 2 loaded cores; 1/32 of the FLOPs here
        d.update(image_size=32, batch_size=32)
        job["model"]["init_args"]["width"] = 16
    return job


def tinygpt_job(work: Path, quick: bool) -> dict[str, Any]:
    """TinyGPT with AdamW on 2 processes (gloo), plain DDP and fp32."""
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "ddp",
            "max_epochs": 3,
            "enable_checkpointing": False,
            "default_root_dir": str(work),
        },
        "model": {
            "class_path": "lightning_accel.models.TinyGPT",
            "init_args": {"n_layer": 2, "n_embd": 64 if quick else 128, "n_head": 4, "dropout": 0.0},
        },
        "data": {"class_path": "benchmarks._tune_jobs.DigitsTokens", "init_args": {"batch_size": 32}},
    }


def _image_job(work: Path, quick: bool) -> dict[str, Any]:
    """The end-to-end image job: the small ResNet on an ImageFolder read by torchvision. The images: the digits
    rendered as 64 px JPEGs (``materialize_digits``); swap the folder (and ``image_size``) here for other data."""
    from lightning_accel.datasets import materialize_digits

    folder = work / "images"
    materialize_digits(str(folder), size=64)
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 3,
            "enable_checkpointing": False,
            "default_root_dir": str(work),
        },
        "model": {
            "class_path": "lightning_accel.models.ImageClassifier",
            "init_args": {"num_classes": "auto", "width": 16 if quick else 32},
        },
        "data": {
            "class_path": "benchmarks._tune_jobs.ImageFolderData",
            "init_args": {"data_dir": str(folder), "image_size": 64, "batch_size": 64, "num_workers": 1},
        },
    }


#: job -> (builder, levers the grid spans, tune budget in seconds: quick, full)
JOBS = {
    "quickstart": (quickstart_job, ("precision", "checkpoint"), (60, 240)),
    "tinygpt": (tinygpt_job, ("strategy", "precision"), (90, 300)),
    "image": (_image_job, ("data", "precision"), (70, 240)),
}


def run_job(name: str, work: Path, quick: bool) -> dict[str, Any]:
    """Tune job ``name`` from its plain config, then measure the grid over the same options (alternated, with the
    tuner's choice among them) in the same processes."""
    from lightning_accel._utils.rank import global_rank
    from lightning_accel.tune import exhaustive, tune_job

    build, levers, budgets = JOBS[name]
    work.mkdir(parents=True, exist_ok=True)
    job = build(work, quick)
    budget = budgets[0] if quick else budgets[1]
    # two trials of one config differ by up to 30 % here at 8 timed steps; quick tunes used a quarter of their budget
    steps, warmup = 16, 3
    # torch.compile takes a minute per trial on 2 CPU cores; AutoStrategy times its own plans: full runs only
    skip: tuple[str, ...] = ("compile", "AutoStrategy") if quick else ()
    if quick and name == "image":
        skip += ("FusedPrecision",)  # keeps the quick grid at 9 points
    if name == "tinygpt":
        skip += ("channels_last",)  # no 4-D weights: the tuner leaves it out by itself, and so does the grid
    t0 = time.monotonic()
    res = tune_job(
        job,
        budget=budget,
        out=str(work / "tuned" / "tuned.yaml"),
        levers=levers,
        skip=skip,
        warmup=warmup,
        steps=steps,
        use_cache=False,
        cache_dir=str(work / "cache_tune"),
    )
    tune_s = time.monotonic() - t0
    tuned = {k: v for k, v in res.config.items()}
    tuned["trainer"] = dict(tuned["trainer"])
    # the tuned job as the grid would build it: without the guard the tuner adds (and without a callbacks list the
    # plain job did not have), so the grid can tell it is one of its own combinations
    tuned["trainer"]["callbacks"] = [
        c for c in tuned["trainer"].get("callbacks", []) if "RollbackGuard" not in str(c.get("class_path"))
    ]
    if not tuned["trainer"]["callbacks"] and "callbacks" not in job["trainer"]:
        del tuned["trainer"]["callbacks"]
    rows = exhaustive(
        job,
        levers,
        warmup=warmup,
        steps=steps,
        rounds=3,
        skip=skip,
        extra={"tuned": tuned},
        root=work / "grid",
    )
    out = {
        "job": name,
        "tune_s": tune_s,
        "budget_s": budget,
        "chosen": res.chosen,
        "trials": [
            {"name": t.name, "step_s": t.step_s, "decision": t.decision, "reason": t.reason} for t in res.trials
        ],
        "grid": rows,
        "rank": global_rank(),
    }
    return out


def main() -> None:
    # One torch thread per process for every trial alike: on this 2-core machine under load ~10, one forward+backward
    # of the width-16 ResNet on 64 images of 32 px took 0.25 s with 1 thread and 2.26 s with 2 (OpenMP threads waiting
    # for a core), which would drown every lever's effect.
    torch.set_num_threads(1)
    name, work, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    result = run_job(name, work, "--quick" in sys.argv)
    if result["rank"] == 0:
        out.write_text(json.dumps(result, indent=1, default=repr))


if __name__ == "__main__":
    main()
