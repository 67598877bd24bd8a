"""``ShardedStrategy`` on 2 gloo processes when applying its plan fails on one rank only (an out-of-memory error while
sharding, a module that cannot be split there): every rank must raise, the failing one its own error and the others
one line naming it, long before the process group's timeout."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import run_in_processes


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def trainer(max_steps: int = 2, **kw: Any) -> pl.Trainer:
    from lightning_accel.parallel import ShardedStrategy

    # the process group's timeout: a rank left waiting fails after 20 s, not after 30 minutes
    strategy = ShardedStrategy(timeout=timedelta(seconds=20), **kw)
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test reads it
        return f"{type(e).__name__}: {e}"
    return ""


def _work(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import torch.distributed.fsdp as fsdp

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    real = fsdp.fully_shard

    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    if rank == 1:
        fsdp.fully_shard = out_of_memory  # type: ignore[assignment]
    try:
        out["oom"] = _error(lambda: trainer().fit(Net(), loader()))
    finally:
        fsdp.fully_shard = real

    # tensor parallel: the split scatters the weights from rank 0, which a rank whose plan failed never reaches
    import lightning_accel.parallel.strategies.sharded as sharded

    check = sharded.check_tensor_parallel_plan

    def differs(*args: Any, **kwargs: Any) -> None:
        raise ValueError("`tp_plan` names `net.0`, which is not in the model: name nn.Linear modules.")

    if rank == 1:
        sharded.check_tensor_parallel_plan = differs  # type: ignore[assignment]
    try:
        plan = {"net.0": "colwise", "net.2": "rowwise"}
        out["tp"] = _error(lambda: trainer(tensor_parallel_size=2, tp_plan=plan).fit(Net(), loader()))
    finally:
        sharded.check_tensor_parallel_plan = check
    # every rank still in step: a plain fit after both failures trains
    out["after"] = _error(lambda: trainer().fit(Net(), loader()))

    # a resume whose file one rank cannot read (a node-local path, a file not yet visible on another node): the
    # others would go on into the loading's collectives
    first = trainer()
    first.fit(Net(), loader())
    first.optimizers[0].param_groups[0]["lr"] = 0.05  # as a scheduler would have set it
    ckpt = f"{tmp}/sharded.ckpt"
    first.save_checkpoint(ckpt)
    resumed = trainer(max_steps=4)
    if rank == 1:
        io = resumed.strategy.checkpoint_io

        def missing(path: Any, *args: Any, **kwargs: Any) -> Any:
            raise FileNotFoundError(f"[Errno 2] No such file or directory: '{path}'")

        io.load_checkpoint = missing  # type: ignore[method-assign]
    out["resume"] = _error(lambda: resumed.fit(Net(), loader(), ckpt_path=ckpt))
    again = trainer(max_steps=4)
    out["after_resume"] = _error(lambda: again.fit(Net(), loader(), ckpt_path=ckpt))
    out["resumed_step"], out["resumed_lr"] = again.global_step, again.optimizers[0].param_groups[0]["lr"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = str(tmp_path_factory.mktemp("sharded_failures"))
    return run_in_processes(_work, 2, (tmp,), init_process_group=False, timeout=240)


def test_a_plan_failing_on_one_rank_fails_on_every_rank_naming_it(results: list[dict[str, Any]]) -> None:
    own, other = results[1]["oom"], results[0]["oom"]
    assert own == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", own
    assert other.startswith("RuntimeError: ShardedStrategy: rank 1 could not apply its parallel plan to `Net`"), other
    assert "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in other
    assert "timed out" not in other.lower() and "\n" not in other


def test_a_tensor_parallel_plan_failing_on_one_rank_fails_on_every_rank_before_the_split(
    results: list[dict[str, Any]],
) -> None:
    own, other = results[1]["tp"], results[0]["tp"]
    assert own.startswith("ValueError: `tp_plan` names `net.0`"), own
    assert other.startswith("RuntimeError: ShardedStrategy: rank 1 could not apply its parallel plan to `Net`"), other
    assert "ValueError: `tp_plan` names `net.0`" in other and "\n" not in other


def test_the_ranks_stay_in_step_after_a_failed_plan(results: list[dict[str, Any]]) -> None:
    assert [r["after"] for r in results] == ["", ""]


def test_a_checkpoint_one_rank_cannot_read_fails_the_resume_on_every_rank(results: list[dict[str, Any]]) -> None:
    own, other = results[1]["resume"], results[0]["resume"]
    assert own.startswith("FileNotFoundError: [Errno 2] No such file or directory"), own
    assert other.startswith("RuntimeError: ShardedStrategy: rank 1 could not read the checkpoint"), other
    assert "FileNotFoundError" in other and "\n" not in other and "timed out" not in other.lower()


def test_a_stateless_optimizer_resumes_with_its_hyperparameters(results: list[dict[str, Any]]) -> None:
    """Plain SGD keeps no tensor per parameter: the resume restores its groups (the learning rate a scheduler left)."""
    for got in results:
        assert got["after_resume"] == ""
        assert got["resumed_step"] == 4 and got["resumed_lr"] == 0.05
