"""An async save holding a gather still in flight (2 CPU processes, gloo): rank 0's writer waits for the other rank
to join it, and fails that save within ``deferred_timeout_s`` (naming the checkpoint) when the other rank does not,
instead of leaving ``teardown`` waiting for the collective."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_in_processes


def _save_with_a_gather(rank: int, world_size: int, root: str, joins: bool) -> tuple[str, str]:
    import time

    import torch
    import torch.distributed as dist

    from lightning_accel._utils.deferred import Deferred
    from lightning_accel.checkpoint import DeltaCheckpointIO, read_checkpoint

    flag = Path(root) / "rank0-done"
    mine = torch.full((4,), float(rank))
    out = [torch.empty(4) for _ in range(world_size)]
    if rank == 1:
        if not joins:  # alive, but not joining the gather until rank 0's save is over
            while not flag.exists():
                time.sleep(0.05)
        dist.all_gather(out, mine)
        return "joined", ""
    work = dist.all_gather(out, mine, async_op=True)
    io = DeltaCheckpointIO(async_save=True, deferred_timeout_s=60 if joins else 2)
    path = f"{root}/a.ckpt"
    io.save_checkpoint({"w": mine, "gathered": Deferred(lambda: (work.wait(), torch.stack(out))[1])}, path)
    try:
        io.teardown()
        result = ("saved", repr(read_checkpoint(path)["gathered"][:, 0].tolist()))
    except Exception as e:  # noqa: BLE001 - what rank 0 raised is the result
        result = (type(e.__cause__).__name__, str(e))
    flag.write_text("done")
    work.wait()  # the other rank joins now: no collective is left in flight at exit
    return result


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("joins", [True, False], ids=["joins", "never-joins"])
def test_rank_zeros_save_waits_for_the_gather_within_the_bound(tmp_path: Path, joins: bool) -> None:
    results = run_in_processes(_save_with_a_gather, 2, (str(tmp_path), joins), timeout=240)
    assert results[1] == ("joined", "")
    kind, text = results[0]
    if joins:
        assert (kind, text) == ("saved", "[0.0, 1.0]")
    else:
        assert kind == "TimeoutError" and "a.ckpt" in text and "`deferred_timeout_s`" in text and "\n" not in text
        assert not (tmp_path / "a.ckpt").exists()  # nothing published for the failed save
