"""Two nodes launched as users launch them: ``torchrun`` in each of two network namespaces (``benchmarks/_multinode``),
2 x 2 ranks of ``lightning-accel fit`` over gloo, data from a moto S3 server inside node0, 1-bit DDP, delta checkpoints
on S3. One worker of node1 gets SIGKILL mid-epoch after a checkpoint; torchrun restarts the group, ``--ckpt_path
last`` resumes it, and the run ends with the parameters of an uninterrupted run, bit for bit.

Needs root and ``ip``/``tc`` (skipped with the reason otherwise). About 75 s on 2 cores: the uninterrupted reference
(~26 s), the killed and restarted job (~44 s, of which ~15 s is the restarted workers' start-up), packing, verifying.
"""

from __future__ import annotations

import pytest

from benchmarks import _multinode as mn


@pytest.fixture
def nodes():
    try:
        with mn.TwoNodes() as n:
            yield n
    except mn.NamespacesUnavailable as err:
        pytest.skip(f"two network namespaces are needed: {err}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_a_node1_worker_and_resume_to_the_uninterrupted_result(nodes: mn.TwoNodes) -> None:
    url, listing = mn.digits_origin(nodes)
    save_every, kill_at = 4, 6  # 10 steps per epoch: the kill lands mid-epoch 0, two steps after a save
    out = mn.run_restart(nodes, origin=url, listing=listing, steps=20, save_every=save_every, kill_at=kill_at)
    assert out["agent_exit_codes"] == [0, 0], out.get("error")
    assert out["restarts"] == [1, 1]  # both agents restarted their workers once (node0: for the re-joined node)
    assert out["kill_step"] == kill_at and out["resumed_step"] == save_every
    assert out["resumed_from"].endswith("/last.ckpt")
    assert 0 < out["restart_lost_steps"] <= save_every
    assert out["final_steps"] == 20
    # model, optimizer, LR schedule, the 1-bit error feedback and the sampler's mid-epoch position all came back
    assert out["same_batches"] and out["loss_max_abs_diff"] == 0.0
    assert out["final_max_abs_diff"] == 0.0
    assert out["checkpoints"] and out["checkpoints_failed"] == 0
    assert {"last.ckpt", f"step={save_every}.ckpt", "step=20.ckpt"} <= set(out["checkpoints"])
    for node in ("node0", "node1"):  # one decode per sample per node, each needed shard fetched once per node
        counts = out["data"][node]
        assert counts["decodes_per_sample"] == 1.0 and counts["extra_decodes"] == 0  # the run ends at an epoch's end
        assert counts["decodes_per_cached"] == 1.0  # nothing the killed launch had cached was decoded again
        assert 1.0 <= counts["shard_fetch_ratio"] <= 1.05
    # a stopped survivor exits at once (ElasticExit, which the CLI adds under torchrun): seconds, not 30 s
    assert out["teardown_s"] is not None and out["teardown_s"] < 20
    assert out["resume_s"] is not None and out["resume_s"] < 120
