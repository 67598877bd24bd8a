from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_accel.data import GpuAugment
from tests.helpers import run_in_processes

MEAN, STD = (0.2, 0.3, 0.4), (0.5, 0.25, 0.2)


def _batch(n: int = 6, h: int = 20, w: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_eval_is_exact_normalisation() -> None:
    x = _batch()
    out = GpuAugment(MEAN, STD).eval()(x)
    ref = (x.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=1e-6)


def test_identity_parameters_change_nothing_but_normalisation() -> None:
    x = _batch()
    aug = GpuAugment(MEAN, STD, crop_scale=None, flip_p=0.0)
    assert torch.allclose(aug(x, train=True), aug(x, train=False), atol=1e-5)


def test_flip_is_an_exact_mirror() -> None:
    x = _batch()
    out = GpuAugment((0, 0, 0), (1, 1, 1), crop_scale=None, flip_p=1.0)(x, train=True)
    assert torch.allclose(out, x.flip(-1).float() / 255, atol=1e-5)


def test_randomness_is_per_sample_and_seedable() -> None:
    x = _batch(1).expand(8, -1, -1, -1).contiguous()  # 8 copies of one image
    aug = GpuAugment(MEAN, STD, size=16, crop_scale=(0.3, 1.0), brightness=0.3, contrast=0.3, saturation=0.3, seed=7)
    out = aug(x, train=True)
    assert out.shape == (8, 3, 16, 16)
    assert len({tuple(o.flatten()[:50].tolist()) for o in out}) == 8  # each copy augmented differently
    again = GpuAugment(MEAN, STD, size=16, crop_scale=(0.3, 1.0), brightness=0.3, contrast=0.3, saturation=0.3, seed=7)
    assert torch.equal(again(x, train=True), out)
    assert not torch.equal(aug(x, train=True), out)  # the next call draws new parameters


def test_an_empty_training_batch_takes_its_place_in_the_stream() -> None:
    """A batch whose samples were all skipped (0 rows) is a training batch too: the next batch draws what it would
    as batch 1 given by index (the data module's augment-ahead thread numbers batches by position)."""
    x, empty = _batch(), _batch(0)
    by_count = GpuAugment(MEAN, STD, size=16, crop_scale=(0.3, 1.0), flip_p=0.5, seed=5)
    assert by_count(empty, train=True).shape == (0, 3, 16, 16) and by_count.calls == 1
    by_index = GpuAugment(MEAN, STD, size=16, crop_scale=(0.3, 1.0), flip_p=0.5, seed=5)
    assert torch.equal(by_count(x, train=True), by_index(x, train=True, call=1))
    assert by_count.calls == 2 and by_index.calls == 0  # an explicit index leaves the counter alone


def test_crop_parameters_stay_inside_the_image() -> None:
    aug = GpuAugment(MEAN, STD, crop_scale=(0.08, 1.0), crop_ratio=(0.5, 2.0))
    p = aug.sample_params(1000, 30, 40, torch.Generator().manual_seed(0))
    assert (p["cw"] <= 1).all() and (p["ch"] <= 1).all()
    assert ((p["cx"].abs() + p["cw"]) <= 1 + 1e-9).all() and ((p["cy"].abs() + p["ch"]) <= 1 + 1e-9).all()
    area = p["cw"] * p["ch"]
    assert area.min() >= 0.05 and area.max() <= 1.0


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="`crop_scale`"):
        GpuAugment(crop_scale=(0.5, 1.5))
    with pytest.raises(ValueError, match=r"`flip_p` must be a number >= 0 and <= 1, got 2\.0"):
        GpuAugment(flip_p=2.0)
    with pytest.raises(
        ValueError, match=r"`brightness` must be a number >= 0 and < 1, got 1\.0\. 0 leaves it unchanged"
    ):
        GpuAugment(brightness=1.0)
    with pytest.raises(TypeError, match=r"`flip_p` must be a number .*, got True \(bool\)"):
        GpuAugment(flip_p=True)
    with pytest.raises(ValueError, match="channels"):
        GpuAugment(MEAN, STD)(torch.zeros(2, 1, 4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        GpuAugment(MEAN, STD)(torch.zeros(3, 4, 4, dtype=torch.uint8))


@pytest.mark.parametrize(
    ("kw", "error", "pattern"),
    [
        (
            {"size": 0},
            ValueError,
            r"`size` must be an integer >= 1 and <= 16384 or None, got 0\. None keeps the input size",
        ),
        ({"size": -4}, ValueError, r"`size` must be an integer >= 1 and <= 16384 or None, got -4"),
        ({"size": 22400}, ValueError, r"`size` must be an integer >= 1 and <= 16384 or None, got 22400\. None keeps"),
        ({"size": 2.5}, TypeError, r"`size` must be an integer >= 1 and <= 16384 or None, got 2\.5 \(float\)"),
        ({"seed": "abc"}, TypeError, r"`seed` must be an integer or None, got 'abc' \(str\)"),
        ({"crop_scale": (0.5,)}, ValueError, r"`crop_scale` must be a \(low, high\) pair of numbers, got \(0\.5,\)"),
        ({"crop_ratio": "wide"}, TypeError, r"`crop_ratio` must be a \(low, high\) pair of numbers, got 'wide'"),
        (
            {"std": [1, 1, "1"]},
            TypeError,
            r"`std` must be a sequence of numbers, one per channel, .*holding '1' \(str\)",
        ),
        ({"mean": 0.5}, TypeError, r"`mean` must be a sequence of numbers, one per channel, got 0\.5 \(float\)"),
        # an infinite std normalised every image to 0, silently; an infinite ratio cropped to a line
        ({"std": (1.0, float("inf"), 1.0)}, ValueError, r"`std` must be .*holding inf: every value must be finite\.$"),
        ({"mean": (float("-inf"),) * 3}, ValueError, r"`mean` must be .*holding -inf: every value must be finite"),
        ({"crop_ratio": (0.5, float("inf"))}, ValueError, r"`crop_ratio` must be a \(low, high\) pair .*holding inf"),
    ],
)
def test_bad_sizes_seeds_and_sequences_fail_at_construction(kw: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern) as e:
        GpuAugment(**kw)
    assert "\n" not in str(e.value)


@pytest.mark.gpu
def test_cuda_matches_the_cpu_fallback() -> None:
    x = _batch(16, 64, 64)
    kw: dict[str, Any] = {
        "size": 48,
        "crop_scale": (0.2, 1.0),
        "brightness": 0.2,
        "contrast": 0.2,
        "saturation": 0.2,
        "seed": 3,
    }
    cpu = GpuAugment(MEAN, STD, **kw)(x, train=True)
    gpu = GpuAugment(MEAN, STD, **kw).cuda()(x.cuda(), train=True)
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=1e-4)


def _augment_on_rank(rank: int, world: int, seed: int | None) -> list[object]:
    torch.manual_seed(0)  # the same global seed on every rank, as `seed_everything` gives
    aug = GpuAugment((0.5,) * 3, (0.25,) * 3, crop_scale=(0.2, 1.0), flip_p=0.5, brightness=0.4, seed=seed)
    x = torch.full((4, 3, 16, 16), 100, dtype=torch.uint8)
    x[..., :8] = 200
    return [aug(x, train=True).numpy(), aug.forward(x, train=True, call=0).numpy()]


@pytest.mark.parametrize("seed", [0, None])
def test_ranks_draw_their_own_parameters_and_repeat_them(seed: int | None) -> None:
    (a0, again0), (a1, again1) = run_in_processes(_augment_on_rank, 2, (seed,), timeout=120)
    assert (a0 == again0).all() and (a1 == again1).all()  # batch 0 of each rank's stream, drawn twice
    assert not (a0 == a1).all()  # the same input on both ranks, augmented differently
