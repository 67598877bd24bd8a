"""Local steps (``strategy="diloco"``) against DDP and ``ddp_1bit`` on a causal LM over real text.

The job: a character-level GPT (4 layers, d=128, 4 heads, context 64) learning the Python standard library's own
source (the ``*.py`` files at the top of ``sysconfig``'s ``stdlib`` directory, read from disk; every tenth file held
out), AdamW with 15 % linear warm-up and cosine decay, gradient clipping at 1.0, the same token windows for every
strategy (16 per rank and step). Two cases:

- **loss and bytes** (``--quick``: 240 steps; full: 600), 2 and 4 gloo processes on loopback: DDP, ``ddp_1bit`` with
  its defaults, local steps with ``H = 16`` and ``H = 64`` (1-bit outer averaging, DiLoCo's outer Nesterov SGD), and
  ``H = 64`` streamed in 4 fragments; the held-out loss at the end of each fit and the bytes each rank sent per step
  (counted at the collectives); the step time during a sync against a plain local step (streaming's overlap).
- **time to DDP's loss on a shaped link**: two network namespaces joined by a veth pair (``tc tbf`` at 100 Mbit/s and
  1 Gbit/s), one rank in each; DDP and local steps (``H = 16``, a fit 2.5x as long on its own schedule) each fit on
  the link, evaluate the held-out loss every few steps (evaluation time off the clock), and the wall-clock each needs
  to reach DDP's final held-out loss is compared. Needs root and
  ``ip``/``tc``; without them the case says why and its ratios are absent.

``ratios``: ``localsteps_loss_over_ddp`` (worst of ws 2 and 4, the better of H = 16 / 64 per world size),
``bytes_ddp_over_localsteps`` (H = 64), ``time_to_ddp_loss_speedup_100mbit`` / ``_1gbit``,
``localsteps_step_during_sync_over_plain_step``.

Run: ``python benchmarks/localsteps.py --quick --out /tmp/localsteps.json`` (as root for the link case).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/localsteps.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import median, parser, ratio, report
from benchmarks.onebit import _ByteCounter

SEQ = 64
BATCH = 16
VOCAB = 128
LR = 3e-3
#: on the link, local steps fit this many times DDP's steps (its own schedule) to find when it reaches DDP's loss
LINK_STEPS_FACTOR = 2.5
#: name -> (strategy name, its arguments)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "ddp_1bit": ("ddp_1bit", {}),
    "local_h16": ("diloco", {"sync_every": 16}),
    "local_h64": ("diloco", {"sync_every": 64}),
    "local_h64_f4": ("diloco", {"sync_every": 64, "fragments": 4, "overlap_steps": 4}),
}


def corpus() -> tuple[Any, Any]:
    """Token ids (bytes clipped to 7 bits) of the standard library's top-level modules: (train, held-out)."""
    import numpy as np

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if len(files) < 20:
        raise SystemExit(f"the standard library at {files[0].parent if files else '?'} has too few modules")
    parts: tuple[list[bytes], list[bytes]] = ([], [])
    for i, f in enumerate(files):
        parts[i % 10 == 9].append(f.read_bytes())
    train, held = (np.frombuffer(b"".join(p), dtype=np.uint8).clip(max=VOCAB - 1).astype(np.int64) for p in parts)
    return train, held


def _windows(ids: Any, n: int, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - SEQ - 1, (n,), generator=g)
    t = torch.from_numpy(ids)
    return torch.stack([t[s : s + SEQ + 1] for s in starts.tolist()])


def _module(steps: int) -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F

    from lightning_accel.models.transformer import GPT
    from lightning_accel.recipes.lr import WarmupCosineLR

    class CharLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(VOCAB, SEQ, 4, 4, 128, 0.0)

        def loss(self, tokens: Any) -> Any:
            logits = self.model(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.loss(batch[0])

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.95))
            sched = WarmupCosineLR(opt, total_steps=steps, warmup_steps=int(0.15 * steps), min_lr=LR * 0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return CharLM()


#: bytes this process sent at the wrapped collectives (installed once per process, at the first fit)
_COUNTER = _ByteCounter()


def fit_one(
    name: str,
    steps: int,
    eval_every: int,
    *,
    num_nodes: int = 1,
    devices: int = 1,
    spec: tuple[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One rank's fit of ``CONFIGS[name]`` (or of ``spec``, a ``(strategy name, arguments)`` pair): step end times
    (evaluation off the clock), held-out losses every ``eval_every`` steps and at the end, bytes this rank sent per
    step, whether each step applied a sync, and ``ddp_1bit``'s resolved warm-up and compression decision."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    import lightning_accel as la

    torch.set_num_threads(1)
    train, held = corpus()
    world = num_nodes * devices
    data = torch.utils.data.TensorDataset(_windows(train, steps * BATCH * world, seed=1))
    held_out = _windows(held, 128, seed=2)
    kind, kwargs = spec or CONFIGS[name]
    strategy: Any = {"ddp": "ddp", "ddp_1bit": la.OneBitDDPStrategy, "diloco": la.LocalStepsStrategy}[kind]
    if kind != "ddp":
        strategy = strategy(log_stats=False, **kwargs)
    rec: dict[str, Any] = {"ends": [], "evals": [], "bytes": [], "sync": []}

    class Probe(Callback):
        def __init__(self) -> None:
            self.off = 0.0  # seconds spent evaluating, taken off the clock

        def _eval(self, module: Any) -> float:
            t0 = time.perf_counter()
            with torch.no_grad():
                loss = float(module.loss(held_out))
            self.off += time.perf_counter() - t0
            return loss

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if kind == "ddp":  # DDP's own allreduce, issued from Python so that the counter sees it
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                trainer.strategy.model.register_comm_hook(None, allreduce_hook)
            _COUNTER.install()
            self.b0 = _COUNTER.bytes
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            rec["ends"].append(time.perf_counter() - self.t0 - self.off)
            rec["bytes"].append(_COUNTER.bytes - self.b0)
            local = getattr(trainer.strategy, "local_steps", None)
            rec["sync"].append(bool(local is not None and local.last_synced))
            step = trainer.global_step
            if eval_every and step % eval_every == 0:
                rec["evals"].append((step, self._eval(pl_module)))

    module = _module(steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Probe()],
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False))
    with torch.no_grad():  # every strategy ends with the same parameters on every rank
        rec["final_loss"] = float(module.loss(held_out))
    rec["params"] = sum(p.numel() for p in module.parameters())
    onebit = getattr(trainer.strategy, "onebit_state", None)
    if onebit is not None:
        rec["onebit"] = {"warmup_end": onebit.warmup_end, "decision": onebit.decision}
    rec["rank"] = dist.get_rank() if dist.is_initialized() else 0
    return rec


def _steps_s(rec: dict[str, Any]) -> list[float]:
    ends = rec["ends"]
    return [e - s for s, e in zip([0.0, *ends[:-1]], ends, strict=True)]


def _summary(rec: dict[str, Any], steps: int) -> dict[str, Any]:
    b = rec["bytes"]
    step_s = _steps_s(rec)
    skip = max(3, steps // 10)  # warm-up steps (ddp_1bit's fp32 warm-up, allocator) are not the steady step
    steady = list(range(skip, len(step_s)))
    sync = [i for i in steady if rec["sync"][i]]
    plain = [i for i in steady if not rec["sync"][i]]
    return {
        "held_out_loss": round(rec["final_loss"], 4),
        "bytes_per_step": round((b[-1] - b[skip - 1]) / max(1, len(b) - skip), 1),
        "step_ms": round(1e3 * median([step_s[i] for i in steady]), 2),
        "sync_step_ms": round(1e3 * median([step_s[i] for i in sync]), 2) if sync else None,
        "plain_step_ms": round(1e3 * median([step_s[i] for i in plain]), 2) if plain else None,
        "params": rec["params"],
        **({"onebit": rec["onebit"]} if "onebit" in rec else {}),
    }


def _fit_all(rank: int, world: int, steps: int) -> dict[str, Any]:
    return {name: _summary(fit_one(name, steps, 0, devices=world), steps) for name in CONFIGS}


def loss_and_bytes(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Case: every configuration at 2 and 4 processes (one launch per world size, the fits in turn)."""
    from tests.helpers import run_in_processes

    steps = 240 if quick else 600
    results: dict[str, Any] = {"steps": steps}
    worst, byte_ratio, overlap = 0.0, float("inf"), 0.0
    for world in (2, 4):
        res = run_in_processes(_fit_all, world, args=(steps,), init_process_group=False, timeout=1800)[0]
        results[f"ws{world}"] = res
        ddp = res["ddp"]
        best = min(res["local_h16"]["held_out_loss"], res["local_h64"]["held_out_loss"])
        worst = max(worst, best / ddp["held_out_loss"])
        byte_ratio = min(byte_ratio, ddp["bytes_per_step"] / max(1e-9, res["local_h64"]["bytes_per_step"]))
        f4 = res["local_h64_f4"]
        if f4["sync_step_ms"] and f4["plain_step_ms"]:
            overlap = max(overlap, f4["sync_step_ms"] / f4["plain_step_ms"])
    return results, {
        "localsteps_loss_over_ddp": round(worst, 4),
        "bytes_ddp_over_localsteps": round(byte_ratio, 1),
        "localsteps_step_during_sync_over_plain_step": round(overlap, 3),
    }


# ------------------------------------------------------------------------------------------------ the shaped link


def _link_worker(args: list[str]) -> None:
    """``--link-worker NAME STEPS EVAL_EVERY OUT``: one rank of a two-node fit (env from :func:`_link_fit`)."""
    name, steps, every, out = args[0], int(args[1]), int(args[2]), Path(args[3])
    rec = fit_one(name, steps, every, num_nodes=2, devices=1)
    if rec["rank"] == 0:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, out)


def _link_fit(net: Any, name: str, steps: int, every: int, workdir: Path, timeout: float) -> dict[str, Any]:
    from benchmarks._onebit_link import _free_port, rank_env

    out = workdir / f"{name}-{time.monotonic_ns()}.json"
    port = _free_port()
    procs, logs = [], []
    for rank in range(2):
        env = rank_env(rank, port)
        cmd = [*net.exec_prefix(rank), sys.executable, str(Path(__file__).resolve()), "--link-worker"]
        log = open(workdir / f"{name}-rank{rank}.log", "wb")  # noqa: SIM115
        logs.append(log)
        cmd += [name, str(steps), str(every), str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)  # our own child's session
                p.wait()
        for log in logs:
            log.close()
    if not out.exists():
        tail = (workdir / f"{name}-rank0.log").read_text(errors="replace")[-800:]
        raise RuntimeError(f"the link fit `{name}` did not finish: {tail}")
    return dict(json.loads(out.read_text()))


def _time_to(rec: dict[str, Any], target: float) -> float | None:
    """Seconds (evaluation off the clock) until the held-out loss first reached ``target``, or None."""
    for step, loss in rec["evals"]:
        if loss <= target:
            return float(rec["ends"][step - 1])
    return None


def link_case(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Case: DDP and local steps fit on a 100 Mbit/s and a 1 Gbit/s link; wall-clock to DDP's final loss."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc")):
        return {"link": "not run: needs root and ip/tc (network namespaces, a veth pair, tc tbf)"}, {}
    from benchmarks._onebit_link import Netns

    steps = 240 if quick else 600
    every = 8
    results: dict[str, Any] = {"steps": steps, "eval_every": every}
    ratios: dict[str, float] = {}
    workdir = Path(tempfile.mkdtemp(prefix="localsteps-link-"))
    net = Netns()
    try:
        for link, mbit in (("100mbit", 100), ("1gbit", 1000)):
            net.shape(mbit)
            ddp = _link_fit(net, "ddp", steps, every, workdir, timeout=1200)
            target = ddp["evals"][-1][1] if ddp["evals"] else ddp["final_loss"]
            ddp_s = _time_to(ddp, target)
            row: dict[str, Any] = {"ddp_loss": round(target, 4), "ddp_s": ddp_s}
            # local steps fit longer on its own schedule: the question is when it reaches DDP's loss
            long = int(LINK_STEPS_FACTOR * steps)
            rec = _link_fit(net, "local_h16", long, every, workdir, timeout=900)
            best = _time_to(rec, target)
            row.update(
                local_h16_steps=long,
                local_h16_s=best,
                local_h16_step=next((s for s, loss in rec["evals"] if loss <= target), None),
                local_h16_final_loss=round(rec["final_loss"], 4),
                local_h16_step_ms=round(1e3 * median(_steps_s(rec)), 2),
                ddp_step_ms=round(1e3 * median(_steps_s(ddp)), 2),
            )
            row["ddp_wall_s"] = round(ddp["ends"][-1], 2)
            results[link] = row
            if best is not None and ddp_s is not None:
                ratios[f"time_to_ddp_loss_speedup_{link}"] = ratio(ddp_s, best)
            else:  # local steps did not reach DDP's loss within its longer fit: no speed-up to report
                ratios[f"time_to_ddp_loss_speedup_{link}"] = 0.0
    finally:
        net.close()
    return results, ratios


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--link-worker":
        _link_worker(sys.argv[2:])
        return
    args = parser(__doc__.splitlines()[0]).parse_args()
    t0 = time.perf_counter()
    results, ratios = loss_and_bytes(args.quick)
    link_results, link_ratios = link_case(args.quick)
    ratios.update(link_ratios)
    report(
        "localsteps",
        quick=args.quick,
        config={"seq": SEQ, "batch_per_rank": BATCH, "lr": LR, "configs": CONFIGS, "wall_s": time.perf_counter() - t0},
        results={"loss_and_bytes": results, "link": link_results},
        ratios=ratios,
        out=args.out,
        chart_title="local steps against DDP",
    )


if __name__ == "__main__":
    main()
