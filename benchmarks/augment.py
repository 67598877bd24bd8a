"""Benchmark: ``GpuAugment`` (batch-wise, on the batch's device) against torchvision's per-sample CPU transforms.

The same augmentation on both sides: random resized crop (scale 0.08-1, ratio 3/4-4/3) to 224 px, horizontal flip
(p 0.5), colour jitter (brightness, contrast, saturation 0.4), scale to [0, 1] and normalise, from uint8 (3, 256, 256)
images (random pixels: the cost does not depend on the content), a batch of 128 (64 in ``--quick``). Cases, alternated
batch by batch:

a. ``torchvision_cpu``: ``torchvision.transforms.v2`` applied sample by sample in this process, as a DataLoader worker
   does (the baseline; a DataLoader spreads it over its workers, so divide by their number for a loader's cost);
b. ``gpu_augment_cpu``: ``GpuAugment`` on the CPU batch (its fallback without a GPU);
c. ``gpu_augment_cuda`` (with a GPU): the uint8 batch copied to the GPU and augmented there (CUDA-synchronised).

``ratios``: ``cpu_fallback_vs_torchvision`` and ``cuda_vs_torchvision`` (samples/s over the baseline).

    python benchmarks/augment.py --quick --out /tmp/augment.json [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/augment.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks._harness import alternate, median, parser, ratio, report
from lightning_accel.data import GpuAugment

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
AUG = {"size": 224, "crop_scale": (0.08, 1.0), "flip_p": 0.5, "brightness": 0.4, "contrast": 0.4, "saturation": 0.4}


def parse_args() -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: the CPU cases, plus the CUDA case with a GPU (default); cpu: CPU cases only; cuda: the baseline "
        "and the CUDA case (report `augment_cuda`)",
    )
    return p.parse_args()


def torchvision_cpu(images: torch.Tensor) -> Callable[[], None]:
    """Case a: per-sample torchvision v2 transforms (one parameter draw per sample, like a worker's ``__getitem__``)."""
    from torchvision.transforms import v2

    t = v2.Compose(
        [
            v2.RandomResizedCrop(AUG["size"], scale=AUG["crop_scale"], antialias=True),
            v2.RandomHorizontalFlip(AUG["flip_p"]),
            v2.ColorJitter(brightness=AUG["brightness"], contrast=AUG["contrast"], saturation=AUG["saturation"]),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )

    def run() -> None:
        out = torch.stack([t(img) for img in images])
        assert out.shape[-1] == AUG["size"]

    return run


def gpu_augment(images: torch.Tensor, device: torch.device) -> Callable[[], None]:
    """Cases b and c: ``GpuAugment`` on the batch's device (on CUDA including the uint8 host-to-device copy)."""
    aug = GpuAugment(MEAN, STD, seed=0, **AUG).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run() -> None:
        out = aug(images.to(device), train=True)
        sync()  # GPU work is asynchronous: the batch is done when the device is
        assert out.shape[-1] == AUG["size"]

    return run


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("`--device cuda` needs a CUDA device; this machine has none. Run with `--device cpu`.")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    batch, repeats = (64, 5) if args.quick else (128, 15)
    images = torch.randint(0, 256, (batch, 3, 256, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    cases: dict[str, Callable[[], Any]] = {"torchvision_cpu": torchvision_cpu(images)}
    if args.device != "cuda":
        cases["gpu_augment_cpu"] = gpu_augment(images, torch.device("cpu"))
    if args.device != "cpu" and torch.cuda.is_available():
        cases["gpu_augment_cuda"] = gpu_augment(images.pin_memory(), torch.device("cuda"))
    times = alternate(cases, repeats=repeats, warmup=2)
    sps = {name: batch / median(ts) for name, ts in times.items()}
    results: dict[str, Any] = {
        "samples_per_s": {k: round(v, 1) for k, v in sps.items()},
        "batch_ms": {k: round(1e3 * median(v), 3) for k, v in times.items()},
    }
    if torch.cuda.is_available() and "gpu_augment_cuda" in cases:
        results["device"] = torch.cuda.get_device_name(0)
    ratios: dict[str, float] = {}
    if "gpu_augment_cpu" in sps:
        ratios["cpu_fallback_vs_torchvision"] = ratio(sps["gpu_augment_cpu"], sps["torchvision_cpu"])
    if "gpu_augment_cuda" in sps:
        ratios["cuda_vs_torchvision"] = ratio(sps["gpu_augment_cuda"], sps["torchvision_cpu"])
    report(
        "augment_cuda" if args.device == "cuda" else "augment",
        quick=args.quick,
        config={
            "batch": batch,
            "input": "uint8 3x256x256",
            "repeats": repeats,
            "torch_threads": torch.get_num_threads(),
            **AUG,
        },
        results=results,
        ratios=ratios,
        out=args.out,
        chart_title="augmentation samples/s over torchvision per-sample CPU",
    )


if __name__ == "__main__":
    main()
