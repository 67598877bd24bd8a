"""Training recipes on the digits: knowledge distillation (3 seeds) and structured pruning (amount 0.5 + fine-tune).

Run: ``python benchmarks/recipes.py [--quick] --out FILE.json``

1. A teacher CNN (``SmallResNet``, width 32) is trained on 80 % of the 1,797 digits (upscaled to 16x16 in memory).
2. Distillation: an MLP student (256 hidden units, 4.5x fewer parameters) is trained from the same start and data
   order, per seed, alone and with ``KnowledgeDistillation(teacher, T=2, alpha=0.5)``; ``kd_acc_minus_student`` is
   the mean validation-accuracy gain. (Probed on this data: the gain is small and depends on the regime -- a 32-unit
   MLP or T=4/alpha=0.7 lost 0.5-1.5 points; the wide student, which overfits alone, gains.)
3. Pruning: per seed (the fine-tune's data order), a copy of the teacher is fine-tuned with
   ``StructuredPruning(amount=0.5, schedule=0)`` and its other defaults (channels removed before the first step);
   ``pruned_acc_drop`` is the mean validation-accuracy drop over the seeds and ``pruned_acc_drop_worst`` the largest
   (the validation set has 360 images: one image is 0.0028, so a single seed cannot resolve a 0.01 target).
   Parameters and CPU inference time (batch 256, alternated with the original, median of repeats; the first seed's
   pruned model) are compared with the original teacher.

Every run uses Lightning's Trainer with the callbacks, AdamW and ``WarmupCosineLR`` stepped per batch.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/recipes.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import benchmarks._harness as H
from lightning_accel.callbacks import KnowledgeDistillation, StructuredPruning
from lightning_accel.data.dataset import split_indices
from lightning_accel.datasets import load_digits_arrays
from lightning_accel.models import SmallResNet
from lightning_accel.recipes.lr import WarmupCosineLR
from lightning_accel.recipes.prune import count_parameters

RES = 16


class Classifier(LightningModule):
    """Cross-entropy around any network; AdamW + per-step WarmupCosineLR. ``training_step`` calls ``self(x)`` once,
    which is how ``KnowledgeDistillation`` finds the student's logits."""

    def __init__(self, net: nn.Module, lr: float, warmup_fraction: float = 0.1) -> None:
        super().__init__()
        self.net = net
        self.lr = lr
        self.warmup_fraction = warmup_fraction
        self.example_input_array = torch.zeros(2, 1, RES, RES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=5e-4)
        total = int(self.trainer.estimated_stepping_batches)
        sched = WarmupCosineLR(opt, total_steps=total, warmup_fraction=self.warmup_fraction, min_lr=self.lr * 0.01)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def log(msg: str) -> None:
    print(f"[recipes {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def digits(res: int) -> tuple[TensorDataset, TensorDataset]:
    images, labels = load_digits_arrays()
    x = torch.from_numpy(images).float().div_(16.0).unsqueeze(1)
    x = F.interpolate(x, size=(res, res), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    y = torch.from_numpy(labels)
    tr, va = split_indices(len(y), 0.2, seed=0)
    return TensorDataset(x[tr], y[tr]), TensorDataset(x[va], y[va])


def fit(module: LightningModule, train: TensorDataset, epochs: int, seed: int, callbacks: list | None = None) -> float:
    seed_everything(seed, verbose=False)
    loader = DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(seed))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks or [],
    )
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    return time.perf_counter() - t0


@torch.inference_mode()
def accuracy(net: nn.Module, ds: TensorDataset) -> float:
    net.eval()
    x, y = ds.tensors
    pred = torch.cat([net(x[i : i + 512]).argmax(1) for i in range(0, len(x), 512)])
    return float((pred == y).float().mean())


def student_net() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(RES * RES, 256), nn.ReLU(), nn.Linear(256, 10))


def teacher_net() -> nn.Module:
    return SmallResNet(num_classes=10, width=32, blocks=(1, 1, 1), in_channels=1)


def recipe_config(quick: bool) -> dict[str, Any]:
    """Data, models, epochs, seeds and the recipes' knobs (the JSON's ``config``)."""
    return {
        "input": f"digits 8x8 upscaled to {RES}x{RES}, 1 channel, 80/20 split (seed 0)",
        "teacher": "SmallResNet(width=32, blocks=(1,1,1))",
        "student": f"MLP {RES * RES}-256-10",
        "teacher_epochs": 5 if quick else 10,
        "student_epochs": 10,
        "seeds": [0, 1, 2],
        "kd": {"temperature": 2.0, "alpha": 0.5},
        "prune": {
            "amount": 0.5,
            "norm": "l1",
            "finetune_epochs": 10 if quick else 12,
            "finetune_lr": 3e-3,
            "seeds": [0, 1, 2, 3, 4] if quick else list(range(10)),
        },
        "infer": {"batch": 256, "repeats": 7 if quick else 15, "threads": torch.get_num_threads()},
        "optimizer": "AdamW(wd 5e-4) + WarmupCosineLR(warmup 10 %, per step)",
    }


def train_teacher(cfg: dict[str, Any], train: TensorDataset, val: TensorDataset) -> tuple[nn.Module, dict[str, Any]]:
    """Case 1: the teacher CNN, trained once; every later case starts from it."""
    seed_everything(0, verbose=False)
    teacher = teacher_net()
    results: dict[str, Any] = {
        "teacher_fit_s": round(fit(Classifier(teacher, lr=3e-3), train, cfg["teacher_epochs"], seed=0), 2),
        "teacher_acc": accuracy(teacher, val),
        "teacher_params": count_parameters(teacher),
    }
    log(f"teacher: acc {results['teacher_acc']:.4f} in {results['teacher_fit_s']} s")
    return teacher, results


def distillation(cfg: dict[str, Any], teacher: nn.Module, train: TensorDataset, val: TensorDataset) -> dict[str, Any]:
    """Case 2: per seed, the same student initialisation and data order trained alone and with the teacher."""
    alone, kd = [], []
    for seed in cfg["seeds"]:
        seed_everything(seed, verbose=False)
        init = student_net()
        s1, s2 = copy.deepcopy(init), copy.deepcopy(init)
        fit(Classifier(s1, lr=3e-3), train, cfg["student_epochs"], seed=seed)
        cb = KnowledgeDistillation(teacher, **cfg["kd"])
        fit(Classifier(s2, lr=3e-3), train, cfg["student_epochs"], seed=seed, callbacks=[cb])
        alone.append(accuracy(s1, val))
        kd.append(accuracy(s2, val))
        log(f"seed {seed}: student {alone[-1]:.4f}, with KD {kd[-1]:.4f}")
    return {"student_acc": alone, "kd_student_acc": kd, "student_params": count_parameters(student_net())}


def pruning(
    cfg: dict[str, Any], teacher: nn.Module, train: TensorDataset, val: TensorDataset
) -> tuple[nn.Module, dict[str, Any]]:
    """Case 3: per seed, structured pruning of a copy of the teacher + a short fine-tune (the recipe's defaults)."""
    p = cfg["prune"]
    accs, times, first, groups = [], [], None, []
    for seed in p["seeds"]:
        pruned = copy.deepcopy(teacher).requires_grad_(True)  # KnowledgeDistillation froze the teacher in place
        cb = StructuredPruning(amount=p["amount"], norm=p["norm"], schedule=0)
        times.append(round(fit(Classifier(pruned, lr=p["finetune_lr"]), train, p["finetune_epochs"], seed, [cb]), 2))
        accs.append(accuracy(pruned, val))
        log(f"pruned, seed {seed}: acc {accs[-1]:.4f} in {times[-1]} s")
        if first is None:
            first, groups = pruned, cb.history[0]["groups"]
    assert first is not None
    results: dict[str, Any] = {
        "prune_finetune_s": times,
        "pruned_acc": accs,
        "pruned_params": count_parameters(first),
        "pruned_groups": [f"{'+'.join(n)}:{a}->{b}" for n, a, b in groups],
    }
    log(f"pruned: acc {accs}, params {results['pruned_params']}")
    return first, results


def inference_speed(cfg: dict[str, Any], teacher: nn.Module, pruned: nn.Module, val: TensorDataset) -> dict[str, float]:
    """Case 4: CPU inference time of one batch, original and pruned alternated, median of repeats."""
    xb = val.tensors[0][: cfg["infer"]["batch"]].contiguous()
    teacher.eval()
    pruned.eval()

    def timed(net: nn.Module) -> Callable[[], float]:
        def run() -> float:
            with torch.inference_mode():
                t0 = time.perf_counter()
                net(xb)
                return time.perf_counter() - t0

        return run

    times = H.alternate(
        {"original": timed(teacher), "pruned": timed(pruned)}, repeats=cfg["infer"]["repeats"], warmup=2
    )
    return {"infer_original_s": H.median(times["original"]), "infer_pruned_s": H.median(times["pruned"])}


def recipe_ratios(results: dict[str, Any]) -> dict[str, float]:
    """The published ratios: the distillation gain and the pruned model's size, speed and accuracy (mean and worst
    drop over the fine-tune seeds)."""
    return {
        "kd_acc_minus_student": round(
            statistics.mean(results["kd_student_acc"]) - statistics.mean(results["student_acc"]), 4
        ),
        "pruned_params_frac": H.ratio(results["pruned_params"], results["teacher_params"]),
        "pruned_cpu_infer_speedup": H.ratio(results["infer_original_s"], results["infer_pruned_s"]),
        "pruned_acc_drop": round(results["teacher_acc"] - statistics.mean(results["pruned_acc"]), 4),
        "pruned_acc_drop_worst": round(results["teacher_acc"] - min(results["pruned_acc"]), 4),
    }


def main() -> None:
    args = H.parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(2)
    cfg = recipe_config(args.quick)
    train, val = digits(RES)
    teacher, results = train_teacher(cfg, train, val)
    results |= distillation(cfg, teacher, train, val)
    pruned, pruned_results = pruning(cfg, teacher, train, val)
    results |= pruned_results
    results |= inference_speed(cfg, teacher, pruned, val)
    H.report(
        "recipes",
        quick=args.quick,
        config=cfg,
        results=results,
        ratios=recipe_ratios(results),
        out=args.out,
        chart_title="recipes: KD gain, pruned params / speed-up / accuracy drop",
    )


if __name__ == "__main__":
    main()
