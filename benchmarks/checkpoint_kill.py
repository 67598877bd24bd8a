"""SIGKILL a training subprocess at random moments while it saves delta checkpoints; check every survivor loads.

Each round starts a worker (``--worker``) that resumes from ``<root>/last.ckpt`` when it exists, then trains a small
MLP with Adam and saves after *every* step (``step=N.ckpt`` + ``last.ckpt``, removing all but the newest two step
checkpoints, which runs garbage collection), so most of its wall time is spent inside saves. The parent lets 1-3
steps go by, kills it with SIGKILL after a further random delay (inside the following saves), and checks:

1. every manifest left in the directory restores with all checksums (``DeltaStore.verify``);
2. the next round resumes exactly from the global step recorded in the surviving ``last.ckpt``.

``python benchmarks/checkpoint_kill.py --kills 20 [--s3]`` runs the loop longer than the test
(``tests/checkpoint/test_kill.py``); ``--quick`` runs 3 rounds. Local directories, or ``--s3`` against a moto S3
server started here. ``results``: ``kills``, ``checkpoints_verified``, ``resumes`` and ``steps`` (the global step of
``last.ckpt`` after each kill); ``ratios``: ``verified_per_kill`` and ``resumed_frac`` (rounds that resumed from a
surviving checkpoint).

    python benchmarks/checkpoint_kill.py --quick --out /tmp/bench/checkpoint_kill.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/checkpoint_kill.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import parser, ratio, report

__all__ = ["kill_loop", "main"]

REPO = Path(__file__).resolve().parent.parent
WIDTHS = (128, 512, 512, 8)  # the MLP both workers train


def _torch_worker(root: str, storage_options: dict[str, Any] | None, async_save: bool, seed: int) -> None:
    """The same loop without Lightning (no Trainer to build, so each round starts sooner): what the bounded CI test
    runs.

    It drives the core exactly as ``DeltaCheckpointIO`` does: ``DeltaStore.save`` on the training thread, or a CPU
    ``snapshot`` handed to a ``BackgroundWriter`` when ``async_save``.
    """
    import torch
    from torch import nn

    from benchmarks._models import mlp
    from lightning_accel.checkpoint.background import BackgroundWriter, snapshot
    from lightning_accel.checkpoint.store import DeltaStore

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    net = mlp(*WIDTHS)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    store, writer = DeltaStore(storage_options=storage_options), BackgroundWriter()
    last = f"{root}/last.ckpt"
    step = 0
    if store.fs.exists(last):
        ckpt = store.load(last)
        net.load_state_dict(ckpt["state_dict"])
        opt.load_state_dict(ckpt["optimizer_states"][0])
        step = int(ckpt["global_step"])
    print("STARTED " + json.dumps({"resumed_step": step}), flush=True)
    x = torch.randn(512, 128)
    y = x[:, :8].argmax(1)
    while True:
        print(f"STEP {step}", flush=True)
        idx = torch.randint(0, 512, (32,))
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
        step += 1
        ckpt = {"state_dict": net.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": step}
        jobs: list[tuple[Any, ...]] = [(store.save, ckpt, f"{root}/step={step:06d}.ckpt"), (store.save, ckpt, last)]
        if step > 2:
            jobs.append((store.remove, f"{root}/step={step - 2:06d}.ckpt"))
        for fn, *args in jobs:
            if async_save:
                writer.submit(fn, *[snapshot(a) for a in args])
            else:
                fn(*args)


def _worker(root: str, storage_options: dict[str, Any] | None, async_save: bool, seed: int) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks._models import MLP
    from lightning_accel.checkpoint.plugin import DeltaCheckpointIO
    from lightning_accel.checkpoint.store import DeltaStore

    torch.set_num_threads(1)
    torch.manual_seed(seed)

    class SaveEveryStep(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            print("STARTED " + json.dumps({"resumed_step": trainer.global_step}), flush=True)

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            print(f"STEP {trainer.global_step}", flush=True)

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            step = trainer.global_step
            trainer.save_checkpoint(f"{root}/step={step:06d}.ckpt")
            trainer.save_checkpoint(f"{root}/last.ckpt")
            if step > 2:
                trainer.strategy.remove_checkpoint(f"{root}/step={step - 2:06d}.ckpt")

    last = f"{root}/last.ckpt"
    store = DeltaStore(storage_options=storage_options)
    resume = last if store.fs.exists(last) else None
    x = torch.randn(512, 128)
    data = DataLoader(TensorDataset(x, x[:, :8].argmax(1)), batch_size=32, shuffle=True)
    trainer = L.Trainer(
        max_steps=10**6,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[DeltaCheckpointIO(async_save=async_save, storage_options=storage_options)],
        callbacks=[SaveEveryStep()],
    )
    trainer.fit(MLP(*WIDTHS), data, ckpt_path=resume)


def _manifests(store: Any, root: str) -> list[str]:
    from lightning_accel.checkpoint.store import is_manifest_bytes

    out = []
    for name in store.fs.list_files(root):
        url = f"{root}/{name}"
        try:
            if is_manifest_bytes(store.fs.head(url, 64)):
                out.append(url)
        except FileNotFoundError:
            continue
    return sorted(out)


def kill_loop(
    root: str,
    *,
    kills: int,
    storage_options: dict[str, Any] | None = None,
    seed: int = 0,
    max_delay_s: float = 0.3,
    timeout_s: float = 120.0,
    lightning: bool = True,
) -> dict[str, Any]:
    """Run ``kills`` rounds of start / resume / SIGKILL against ``root``; raise AssertionError on any violation.

    Returns:
        ``{"kills", "checkpoints_verified", "resumes", "steps"}`` (``steps``: the global step of ``last.ckpt``
        after each kill).
    """
    from lightning_accel.checkpoint.store import DeltaStore

    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    verified = resumes = 0
    steps: list[int] = []
    expected_resume = 0
    for k in range(kills):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", root, "--seed", str(seed + k)]
        if storage_options:
            cmd += ["--storage-options", json.dumps(storage_options)]
        if k % 2:
            cmd.append("--async-save")
        if not lightning:
            cmd.append("--plain-torch")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            deadline = time.monotonic() + timeout_s
            line = ""
            while not line.startswith("STARTED "):
                line = proc.stdout.readline()  # type: ignore[union-attr]
                if not line and proc.poll() is not None:
                    raise AssertionError(f"worker exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}")  # type: ignore[union-attr]
                if time.monotonic() > deadline:
                    raise AssertionError("worker did not start in time")
            resumed = json.loads(line[len("STARTED ") :])["resumed_step"]
            assert resumed == expected_resume, f"round {k}: resumed at step {resumed}, expected {expected_resume}"
            resumes += int(resumed > 0)
            # Let a random number of steps (each one two saves and a removal) go by, then kill at a random moment
            # inside the next ones: the saves are most of the loop's time.
            target = resumed + rng.randint(1, 3)
            while not (line.startswith("STEP ") and int(line.split()[1]) >= target):
                line = proc.stdout.readline()  # type: ignore[union-attr]
                if (not line and proc.poll() is not None) or time.monotonic() > deadline:
                    raise AssertionError(f"worker stopped stepping ({proc.poll()}): {proc.stderr.read()[-3000:]}")  # type: ignore[union-attr]
            time.sleep(rng.uniform(0.0, max_delay_s))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        store = DeltaStore(storage_options=storage_options)
        for url in _manifests(store, root):
            assert store.verify(url)["ok"], url  # raises CheckpointCorruptError naming the tensor otherwise
            verified += 1
        last = f"{root}/last.ckpt"
        expected_resume = int(store.load(last)["global_step"]) if store.fs.exists(last) else 0
        steps.append(expected_resume)
    return {"kills": kills, "checkpoints_verified": verified, "resumes": resumes, "steps": steps}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=None, help="rounds of start / resume / SIGKILL (default: 3 quick, 20)")
    p.add_argument("--s3", action="store_true", help="run against a moto S3 server started by this script")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--storage-options", default=None, help=argparse.SUPPRESS)
    p.add_argument("--async-save", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plain-torch", action="store_true", help="workers train with a plain torch loop (no Trainer)")
    return p.parse_args(argv)


def s3_kill_loop(kills: int, seed: int, lightning: bool) -> dict[str, Any]:
    """Case: :func:`kill_loop` against a moto S3 server started (and stopped) here."""
    import fsspec
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    opts = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
        "use_listings_cache": False,
    }
    fsspec.filesystem("s3", skip_instance_cache=True, **opts).mkdir("kill")
    try:
        return kill_loop("s3://kill/ckpt", kills=kills, storage_options=opts, seed=seed, lightning=lightning)
    finally:
        server.stop()


def local_kill_loop(kills: int, seed: int, lightning: bool) -> dict[str, Any]:
    """Case: :func:`kill_loop` in a temporary local directory."""
    with tempfile.TemporaryDirectory() as d:
        return kill_loop(f"{d}/ckpt", kills=kills, seed=seed, lightning=lightning)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        opts = json.loads(args.storage_options) if args.storage_options else None
        (_torch_worker if args.plain_torch else _worker)(args.worker, opts, args.async_save, args.seed)
        return
    kills = args.kills if args.kills is not None else (3 if args.quick else 20)
    lightning = not args.plain_torch
    results = (s3_kill_loop if args.s3 else local_kill_loop)(kills, args.seed, lightning)
    ratios = {
        "verified_per_kill": ratio(results["checkpoints_verified"], results["kills"]),
        "resumed_frac": ratio(results["resumes"], results["kills"]),
    }
    config = {
        "kills": kills,
        "storage": "s3 (moto)" if args.s3 else "local",
        "worker": "Trainer + DeltaCheckpointIO" if lightning else "plain torch + DeltaStore",
        "async_save": "every other round",
        "seed": args.seed,
        "model": f"MLP{WIDTHS}, Adam",
    }
    report("checkpoint_kill", quick=args.quick, config=config, results=results, ratios=ratios, out=args.out)


if __name__ == "__main__":
    main()
