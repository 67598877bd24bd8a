"""Two nodes x two processes launched with torchrun across a shaped link: DDP, flat and hierarchical ``ddp_1bit``.

Built on ``benchmarks/_multinode.py`` (as root): two network namespaces joined by a veth pair, ``tc tbf`` on both
ends, a moto S3 server inside ``node0`` holding the packed data and the checkpoints, and in each namespace one
``torchrun --nnodes 2 --nproc-per-node 2`` agent running ``python -m lightning_accel.cli fit --config job.yaml``.

Cases:

- **Steps.** A ~25M-parameter MLP (no dropout) trained with SGD-momentum on the digits from S3; the inter-node link at
  1 Gbit/s and at 100 Mbit/s. Per link: median step time (rank 0, after the first steps) and inter-node bytes per
  step (the veth counters) of ``strategy="ddp"``, ``ddp_1bit`` flat (``hierarchical=False``) and hierarchical
  (``hierarchical=True``), both with ``compression="1bit"`` after 2 warm-up steps, so every timed step is a
  compressed one. The arms of one link run back to back, in mirrored order on the second link.
- **Restart.** The fault-tolerant recipe (``--max-restarts 1 --ckpt_path last``, ``DeltaModelCheckpoint`` on S3,
  deterministic ``ddp_1bit``) with a ``kill -9`` of one ``node1`` worker mid-epoch after a checkpoint: detection,
  restart and resume seconds, steps redone, the final parameters against an uninterrupted run of the same job,
  every checkpoint verified, the cache's decodes and shard fetches per node (a small model: the case is about what
  survives the kill, and a job that ends on an epoch boundary makes the data counts exact).

``ratios``: ``hier_over_flat_step_1gbit``, ``hier_over_flat_step_100mbit``, ``hier_over_flat_internode_bytes``,
``ddp_over_hier_step_100mbit``, ``ddp_over_hier_step_1gbit``, ``restart_final_params_max_abs_diff``,
``restart_lost_steps``, ``restart_seconds``, ``unverifiable_checkpoints``, ``decodes_per_sample_per_node``,
``shard_fetches_per_node``. Without root or ``ip``/``tc`` the results say why and the ratios are absent.
``MULTINODE_WORKDIR=DIR`` keeps every job's config, agent logs and step logs in ``DIR``.

    python benchmarks/multinode.py --quick --out /tmp/bench/multinode.json
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/multinode.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import parser, ratio, report

PARAMS = 25_000_000
IMAGE = 16  # the cached images' side: in_features = 3 * 16 * 16
LINKS = (("1gbit", 1000), ("100mbit", 100))
_ONEBIT = {"compression": "1bit", "warmup_steps": 2, "overlap": True, "log_stats": False}
ARMS: dict[str, Any] = {
    "ddp": ("ddp", {}),
    "flat": ("ddp_1bit", {**_ONEBIT, "hierarchical": False}),
    "hier": ("ddp_1bit", {**_ONEBIT, "hierarchical": True}),
}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def step_cases(nodes: Any, origin: str, listing: Any, quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Median step time and inter-node bytes per step of every arm on each link."""
    from benchmarks._multinode import mlp_hidden_for, run_steps

    hidden = mlp_hidden_for(PARAMS, in_features=3 * IMAGE * IMAGE)
    results: dict[str, Any] = {"hidden": hidden}
    for i, (link, mbit) in enumerate(LINKS):
        nodes.shape(mbit)
        order = list(ARMS) if i % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            # DDP at 100 Mbit/s sends ~300 MB per step over the link: fewer steps there
            steps = 5 if arm == "ddp" and mbit <= 100 else (8 if quick else 14)
            load0 = _load()
            r = run_steps(nodes, ARMS[arm], steps, origin=origin, listing=listing, hidden=hidden, skip=2, timeout=900)
            r.pop("paths", None)
            r.pop("final_state", None)
            results[f"{arm}_{link}"] = {**r, "loadavg_1min_start": load0, "loadavg_1min_end": _load()}
    nodes.shape(None)

    def step(arm: str, link: str) -> float:
        return float(results[f"{arm}_{link}"]["median_step_s"])

    def sent(arm: str, link: str) -> float:
        return float(results[f"{arm}_{link}"]["internode_bytes_per_step"])

    ratios = {
        "hier_over_flat_step_1gbit": ratio(step("hier", "1gbit"), step("flat", "1gbit")),
        "hier_over_flat_step_100mbit": ratio(step("hier", "100mbit"), step("flat", "100mbit")),
        "hier_over_flat_internode_bytes": ratio(sent("hier", "1gbit"), sent("flat", "1gbit")),
        "ddp_over_hier_step_100mbit": ratio(step("ddp", "100mbit"), step("hier", "100mbit")),
        "ddp_over_hier_step_1gbit": ratio(step("ddp", "1gbit"), step("hier", "1gbit")),
    }
    return results, ratios


def _data_ratios(data: dict[str, Any]) -> dict[str, float]:
    nodes = [v for k, v in data.items() if k.startswith("node")]
    if not nodes:
        return {}
    return {
        "decodes_per_sample_per_node": max(float(n["decodes_per_sample"]) for n in nodes),
        "shard_fetches_per_node": max(float(n["shard_fetch_ratio"]) for n in nodes),
    }


def restart_case(nodes: Any, origin: str, listing: Any, quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """kill -9 of a node1 worker mid-epoch; torchrun restarts the group; compared with an uninterrupted run."""
    from benchmarks._multinode import run_restart

    load0 = _load()
    # 200 images: 10 steps per epoch; the kill lands mid-epoch, the job ends on an epoch boundary (exact counts)
    steps, save_every, kill_at = (20, 4, 6) if quick else (40, 8, 25)
    r = run_restart(nodes, origin=origin, listing=listing, steps=steps, save_every=save_every, kill_at=kill_at)
    r.pop("paths", None)
    results = {**r, "save_every": save_every, "loadavg_1min_start": load0, "loadavg_1min_end": _load()}
    diff = r.get("final_max_abs_diff")
    ratios = {
        "restart_final_params_max_abs_diff": float("nan") if diff is None else float(diff),
        "restart_lost_steps": float(r["restart_lost_steps"]),
        "restart_seconds": float(r["resume_s"]),
        "unverifiable_checkpoints": float(r["checkpoints_failed"]),
        **_data_ratios(r.get("data", {})),
    }
    return results, ratios


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    from benchmarks._multinode import NamespacesUnavailable, TwoNodes, digits_origin

    t0, load0 = time.perf_counter(), _load()
    results: dict[str, Any] = {"loadavg_1min_start": load0}
    ratios: dict[str, float] = {}
    try:
        # MULTINODE_WORKDIR keeps the jobs' configs and logs there (default: a temporary directory, removed)
        with TwoNodes(workdir=os.environ.get("MULTINODE_WORKDIR") or None) as nodes:
            origin, listing = digits_origin(nodes, num_images=200)
            results["steps"], step_ratios = step_cases(nodes, origin, listing, args.quick)
            results["restart"], restart_ratios = restart_case(nodes, origin, listing, args.quick)
            ratios = {**step_ratios, **restart_ratios}
    except NamespacesUnavailable as err:
        results["skipped"] = f"no two-node setup here: {err}"
    results["loadavg_1min_end"] = _load()
    report(
        "multinode",
        quick=args.quick,
        config={
            "params": PARAMS,
            "image_size": IMAGE,
            "links": LINKS,
            "arms": ARMS,
            "wall_s": time.perf_counter() - t0,
        },
        results=results,
        ratios=ratios,
        out=args.out,
        chart_title="2 nodes x 2 processes, torchrun",
    )


if __name__ == "__main__":
    main()
