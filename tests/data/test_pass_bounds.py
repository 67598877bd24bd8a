"""A pass cut short by ``pass_batches`` ends where its consumer stops: its end-of-pass callback runs there."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from lightning_accel.data.dataset import CacheDataLoader


class _Range(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


@pytest.mark.parametrize("read_ahead", [0, 4])
def test_a_bounded_pass_reports_its_end_at_its_last_batch(read_ahead: int) -> None:
    """Lightning stops asking after the batches it takes (``limit_val_batches``, the sanity check) and never exhausts
    the iterator: the callback must come with the last of those batches, not only at teardown."""
    ends: list[int] = []
    loader = CacheDataLoader(
        _Range(40), batch_size=2, read_ahead=read_ahead, pass_batches=lambda: 2, on_epoch_end=lambda: ends.append(1)
    )
    it = iter(loader)
    next(it)
    assert ends == []
    next(it)  # the pass's last batch, as Lightning takes it
    assert ends == [1]


def test_a_warm_check_that_is_not_callable_is_refused() -> None:
    with pytest.raises(TypeError, match=r"^`warm_check` must be a callable `fn\(\) -> bool` or None, got True"):
        CacheDataLoader(_Range(4), batch_size=2, warm_check=True)  # type: ignore[arg-type]
