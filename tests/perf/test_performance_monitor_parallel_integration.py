"""PerformanceMonitor under model-parallel strategies (2 gloo processes): the ranks of a pipeline or a tensor-parallel
group train on one batch together, so the job's throughput counts that batch once."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import run_in_processes


def _fits(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_accel.callbacks import PerformanceMonitor
    from lightning_accel.models import TinyGPT
    from lightning_accel.parallel import PipelineStrategy, ShardedStrategy
    from tests.tiny import trainer

    runs = {
        "pipeline": lambda: PipelineStrategy(),
        "pipeline_world": lambda: PipelineStrategy(batch_split="world"),
        "tensor": lambda: ShardedStrategy(tensor_parallel_size=2),
    }
    found = {}
    for name, strategy in runs.items():
        torch.manual_seed(0)  # the same data on every rank: with the default split both ranks read the same batch
        tokens = torch.randint(0, 27, (32, 17))
        mon = PerformanceMonitor(
            report_path="", verbose=False, count_flops=False, skip_steps=1, tokens_fn=lambda b: int(b[0].numel())
        )
        t = trainer(devices=2, strategy=strategy(), max_steps=4, callbacks=[mon])
        t.fit(TinyGPT(n_layer=2, n_embd=32, block_size=17), DataLoader(TensorDataset(tokens), batch_size=8))
        r = mon.report
        assert r is not None and r.samples_per_s is not None and r.tokens_per_s is not None
        epoch = r.epochs[0]
        found[name] = {
            # samples / s x s / step: the samples of one step of the whole job
            "samples_per_step": r.samples_per_s * r.step_time_s,
            "tokens_per_step": r.tokens_per_s * r.step_time_s,
            "epoch_samples_per_step": epoch["samples_per_s"] * sum(epoch[c] for c in r.seconds) / epoch["steps"],
        }
    return found


@pytest.mark.slow
def test_a_batch_shared_by_a_group_is_counted_once() -> None:
    for found in run_in_processes(_fits, 2, init_process_group=False, timeout=300):
        # one replica reading batches of 8: 8 samples per step, not 2 x 8
        assert found["pipeline"]["samples_per_step"] == pytest.approx(8)
        assert found["tensor"]["samples_per_step"] == pytest.approx(8)
        assert found["pipeline"]["tokens_per_step"] == pytest.approx(8 * 17)
        assert found["tensor"]["epoch_samples_per_step"] == pytest.approx(8)
        # `batch_split="world"`: each rank reads 8, the pipeline runs the 16 gathered, seen by both of its ranks
        assert found["pipeline_world"]["samples_per_step"] == pytest.approx(16)
        assert found["pipeline_world"]["epoch_samples_per_step"] == pytest.approx(16)
