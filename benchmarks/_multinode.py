"""Two nodes on one host, launched the way users launch: ``torchrun`` in each of two network namespaces.

``node0`` and ``node1`` are network namespaces (``la-mn-<pid>-0`` / ``-1``) joined by a veth pair with link-local
addresses (``169.254.78.1`` <-> ``.2``), optionally shaped with ``tc tbf`` on both ends. Inside ``node0`` runs a moto S3
server bound to its veth address, so ``node1``'s data reads and every checkpoint write of a rank on ``node1`` cross the
link. Each namespace runs one ``torchrun`` agent (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous hosted by
``node0``) that starts ``python -m lightning_accel.cli fit --config job.yaml`` twice: a 2 x 2 job over gloo.

What this module gives a benchmark or a test:

- :class:`TwoNodes`: the namespaces, the link (:meth:`~TwoNodes.shape`, byte counters :meth:`~TwoNodes.link_bytes`),
  the S3 server and its helpers (buckets, uploads, listings), a work directory; everything removed on every exit path
  (``with``, ``atexit``, SIGTERM); :class:`NamespacesUnavailable` when it cannot be built (not root, no ``ip``).
- :func:`digits_origin`: the digits as JPEGs, packed into shards (``pack_origin``) and uploaded to ``s3://data/...``.
- :class:`Job` and :func:`write_job`: the LightningCLI YAML of a job (strategy, model size, data, checkpoints, the
  per-rank step log); :func:`launch` / :class:`Launch`: the two agents, their logs, a bounded wait that kills both.
- :func:`run_steps`: one uninterrupted job: median step time, inter-node bytes (per step and in all), data counts.
- :func:`run_restart`: the elastic-restart recipe: ``--max-restarts 1 --ckpt_path last``, a ``kill -9`` of one
  ``node1`` worker mid-epoch after a checkpoint was published, detection / restart / resume seconds, steps redone,
  final parameters against an uninterrupted run, checkpoints verified, cache reuse after the restart.
- :func:`data_counts`: decodes per sample per node and shard bytes fetched per needed shard byte per node.

Job side (named by ``class_path`` in the YAML, so they must be importable in the workers): :class:`ImageMLP`, a model
without dropout whose width is an argument (:func:`mlp_hidden_for` picks it for a parameter count), and
:class:`StepLog`, which writes one JSON line per event and step per rank (step end time, loss, the dataset indices of
the batch, the rank's cache counters, the veth's byte counters, its pid) and, on global rank 0, the final
``state_dict`` (plain tensors, ``torch.load(weights_only=True)``).

Facts this relies on (checked here with torch 2.14): the c10d rendezvous decides who hosts its TCP store by matching
the endpoint against the machine's hostname and addresses; both namespaces share the host's hostname, which resolves
to an address neither namespace has, so without ``--rdzv-conf is_host=1`` on ``node0`` (and ``0`` on ``node1``) no one
hosts it and both agents time out after 60 s. The workers' ``MASTER_ADDR`` is the address rendezvous rank 0 reports,
``socket.getfqdn()`` (the host's, unreachable in a namespace) unless ``--local-addr`` is given; the rendezvous sorts
nodes by that address, so ``node0`` (``.1``) is always group rank 0, before and after a restart. torchrun starts each
worker in a session of its own, so cleanup kills the agents' descendants one by one, not only their groups.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from typing_extensions import override

__all__ = [
    "ADDR",
    "IFACES",
    "ImageMLP",
    "Job",
    "Launch",
    "NamespacesUnavailable",
    "StepLog",
    "TwoNodes",
    "data_counts",
    "digits_origin",
    "launch",
    "mlp_hidden_for",
    "read_steps",
    "run_restart",
    "run_steps",
    "strategy_config",
    "verify_checkpoints",
    "write_job",
]

REPO = Path(__file__).resolve().parent.parent
ADDR = ("169.254.78.1", "169.254.78.2")  # link-local, only on the veth ends made here (_onebit_link uses .77.x)
IFACES = ("lamn0", "lamn1")  # one per namespace: names need to be unique only inside it
S3_PORT = 5000  # fresh namespaces: every port is free
PREFIX = "la-mn"
# Environment a launched job must not inherit: a rank's variables from an enclosing launch (Lightning's, torchrun's)
# would make a worker believe it is already placed.
_DROP_ENV = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
_DROP_PREFIXES = ("MASTER_PORT", "TORCHELASTIC_", "PL_", "AWS_PROFILE", "SLURM_")
FAKE_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class NamespacesUnavailable(RuntimeError):
    """The two nodes cannot be built here (not root, no ``ip``/``tc``, namespaces refused); ``str()`` says why."""


# ------------------------------------------------------------------------------------------------------- helpers


def _run(
    cmd: Sequence[str], *, timeout: float = 30.0, check: bool = True, **kw: Any
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-600:]}"
        )
    return proc


def _remove_stale_namespaces() -> None:
    """Delete ``la-mn-<pid>-*`` namespaces of a run of this module that was killed (its pid is gone)."""
    listed = _run(["ip", "netns", "list"], check=False).stdout.split()
    for name in listed:
        parts = name.split("-")
        ours = len(parts) == 4 and "-".join(parts[:2]) == PREFIX and parts[2].isdigit()
        if ours and not Path(f"/proc/{parts[2]}").exists():
            _run(["ip", "netns", "del", name], check=False)


def _children() -> dict[int, list[int]]:
    """``{ppid: [pid, ...]}`` of every process now (from ``/proc``)."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first)."""
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s descendants (torchrun starts each worker in a session of its own), then ``pid``'s group."""
    for child in descendants(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # our own child's session (start_new_session=True), nothing else


def _stop_all(procs: Sequence[subprocess.Popen[Any]]) -> None:
    """SIGKILL every live process of ``procs`` with its descendants, then reap them (bounded)."""
    for proc in procs:
        if proc.poll() is None:
            _kill_tree(proc.pid)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _proc_start_time(pid: int | str = "self") -> float:
    """Wall-clock start time of process ``pid`` (``/proc/<pid>/stat`` field 22 and the boot time)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    btime = next(
        int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
    )
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` without an enclosing launch's rank variables, with fake AWS credentials and the checkout on
    ``PYTHONPATH`` (so ``class_path: benchmarks._multinode.ImageMLP`` imports in the workers)."""
    env = {
        k: v for k, v in os.environ.items() if k not in _DROP_ENV and not any(k.startswith(p) for p in _DROP_PREFIXES)
    }
    env.update(FAKE_AWS)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


_S3_SERVER = """
import logging, signal, sys, threading
from moto.server import ThreadedMotoServer
# werkzeug logs every request: unread, that output fills a pipe and every server thread blocks on the logging lock
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address=sys.argv[1], port=int(sys.argv[2]), verbose=False)
server.start()
print("READY", flush=True)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()  # EOF: the harness is gone
done.wait()
server.stop()
"""

# One-shot S3 client run inside node0 (boto3 only: it starts in well under a second, unlike `import lightning`).
_S3_CLIENT = """
import json, os, sys, time, boto3
ops = json.loads(sys.argv[2])
s3 = boto3.client("s3", endpoint_url=sys.argv[1])
out = []
for op in ops:
    if op[0] == "mkbucket":
        s3.create_bucket(Bucket=op[1]); out.append(None)
    elif op[0] == "put":  # put LOCAL_DIR BUCKET PREFIX: every file under LOCAL_DIR
        _, root, bucket, prefix = op
        n = 0
        for d, _, files in os.walk(root):
            for f in files:
                p = os.path.join(d, f)
                key = prefix.rstrip("/") + "/" + os.path.relpath(p, root).replace(os.sep, "/")
                s3.upload_file(p, bucket, key.lstrip("/")); n += 1
        out.append(n)
    elif op[0] == "list":  # list BUCKET PREFIX -> {key: size}
        keys = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=op[1], Prefix=op[2]):
            keys.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        out.append(keys)
print(json.dumps(out))
"""


# ---------------------------------------------------------------------------------------------------- the nodes


class TwoNodes:
    """Two network namespaces joined by a veth pair, a moto S3 server in ``node0``, a work directory.

    Use as a context manager; :meth:`close` (also run by ``atexit`` and on SIGTERM while inside ``with`` on the main
    thread) kills every process started here (their descendants included), deletes both namespaces (their veth ends
    and qdiscs go with them) and removes the work and RAM directories.

    Args:
        rate_mbit: ``tc tbf`` rate on both veth ends in Mbit/s; ``None``: unshaped.
        workdir: where jobs write their configs, logs, caches and step logs (default: a new temporary directory,
            removed on close; a given one is kept).
        s3: start the S3 server in ``node0``.

    Attributes:
        names: the namespaces ``(node0, node1)``.
        workdir: the work directory.
        ram_root: a directory on ``/dev/shm`` (when writable) for the jobs' RAM tiers.
        s3_endpoint: ``http://169.254.78.1:5000`` (reachable from both namespaces, not from the host).
        storage_options: fsspec/s3fs options for that endpoint.

    Raises:
        NamespacesUnavailable: not root, no ``ip``/``tc``, or a namespace could not be made (the message says which).
    """

    def __init__(self, rate_mbit: int | None = None, *, workdir: str | Path | None = None, s3: bool = True) -> None:
        self.rate_mbit = rate_mbit
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="la-multinode-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        tag = f"{PREFIX}-{os.getpid()}"
        self.names = (f"{tag}-0", f"{tag}-1")
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.workdir
        self.ram_root = base / f"{tag}-{uuid.uuid4().hex[:6]}"
        self.s3_endpoint = f"http://{ADDR[0]}:{S3_PORT}"
        self.storage_options: dict[str, Any] = {
            "key": FAKE_AWS["AWS_ACCESS_KEY_ID"],
            "secret": FAKE_AWS["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": self.s3_endpoint},
            "use_listings_cache": False,
        }
        self._want_s3 = s3
        self._buckets: set[str] = set()
        self._procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []
        self._closed = False
        self._old_term: Any = None
        self._s3_log: Any = None

    # -- lifecycle
    def __enter__(self) -> TwoNodes:
        self.open()
        with contextlib.suppress(ValueError):  # not the main thread: atexit still cleans up
            self._old_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run finally/atexit on SIGTERM
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old_term is not None:
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGTERM, self._old_term)
        self.close()

    def open(self) -> None:
        """Make the namespaces, the link and the S3 server (idempotent only in the sense that ``close`` undoes it)."""
        if os.geteuid() != 0:
            raise NamespacesUnavailable(f"network namespaces need root (this process runs as uid {os.geteuid()})")
        missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
        if missing:
            raise NamespacesUnavailable(f"network namespaces need the {' and '.join(missing)} command(s), not found")
        atexit.register(self.close)
        try:
            from benchmarks._onebit_link import join_namespaces

            _remove_stale_namespaces()
            join_namespaces(self.names, IFACES, ADDR, self._made)
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            self.close()
            raise NamespacesUnavailable(f"could not build the two namespaces: {err}") from err
        try:
            self.shape(self.rate_mbit)
            if self._want_s3:
                self._start_s3()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill every process started here (and its descendants), delete the namespaces, remove the directories."""
        if self._closed:
            return
        self._closed = True
        _stop_all(self._procs)
        if self._s3_log is not None:
            self._s3_log.close()
        for ns in self._made:
            with contextlib.suppress(Exception):
                _run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(self.ram_root, ignore_errors=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    # -- the link
    def exec_prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program in ``node``'s namespace."""
        return ["ip", "netns", "exec", self.names[node]]

    def shape(self, rate_mbit: int | None) -> None:
        """``tbf rate <rate_mbit>mbit`` on both veth ends (``None``: remove the qdisc, the unshaped link)."""
        from benchmarks._onebit_link import shape_veth

        self.rate_mbit = rate_mbit
        for node, ifc in enumerate(IFACES):
            shape_veth(self.exec_prefix(node), ifc, rate_mbit)

    def link_bytes(self) -> dict[str, int]:
        """The veth counters now: ``{"tx0", "rx0", "tx1", "rx1"}`` (bytes sent / received by node0 and node1)."""
        out: dict[str, int] = {}
        for node, ifc in enumerate(IFACES):
            for d in ("tx", "rx"):
                path = f"/sys/class/net/{ifc}/statistics/{d}_bytes"
                out[f"{d}{node}"] = int(_run([*self.exec_prefix(node), "cat", path]).stdout)
        return out

    # -- processes
    def popen(self, node: int, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, **kw: Any) -> Any:
        """Start ``cmd`` in ``node``'s namespace in a session of its own; :meth:`close` kills it and its descendants."""
        proc = subprocess.Popen(
            [*self.exec_prefix(node), *cmd], env=dict(env or clean_env()), start_new_session=True, **kw
        )
        self._procs.append(proc)
        return proc

    def run(
        self, node: int, cmd: Sequence[str], *, timeout: float = 120.0, env: Mapping[str, str] | None = None
    ) -> str:
        """Run ``cmd`` in ``node``'s namespace to completion (bounded by ``timeout``); its stdout."""
        proc = self.popen(node, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.communicate(timeout=10)
            raise TimeoutError(f"`{' '.join(cmd)[:200]}` in {self.names[node]} took over {timeout:.0f} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)[:200]}` failed ({proc.returncode}): {err.strip()[-1500:]}")
        return str(out)

    # -- S3
    def _start_s3(self) -> None:
        # stderr to a file, never an unread pipe: a full pipe blocks the server (see _S3_SERVER)
        self._s3_log = open(self.workdir / "s3-server.log", "wb")  # noqa: SIM115 - closed in close()
        proc = self.popen(
            0,
            [sys.executable, "-c", _S3_SERVER, ADDR[0], str(S3_PORT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._s3_log,
            text=True,
        )
        self._s3 = proc
        deadline = time.monotonic() + 60
        line = ""
        while not line.startswith("READY"):
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if (not line and proc.poll() is not None) or time.monotonic() > deadline:
                log = (self.workdir / "s3-server.log").read_text(errors="replace")[-800:]
                raise RuntimeError(f"the S3 server in {self.names[0]} did not start: {log}")
        # from node1, across the link: what every node1 read and write will do
        self.s3([("list", "no-such-bucket-probe", "")], node=1, check_exists=False)

    def s3(self, ops: Sequence[Sequence[Any]], *, node: int = 0, check_exists: bool = True) -> list[Any]:
        """Run S3 operations from ``node`` (one short process): ``("mkbucket", B)``, ``("put", DIR, B, PREFIX)`` (every
        file under DIR, returns the count), ``("list", B, PREFIX)`` (returns ``{key: size}``)."""
        try:
            out = self.run(
                node, [sys.executable, "-c", _S3_CLIENT, self.s3_endpoint, json.dumps(list(ops))], timeout=120
            )
        except RuntimeError as err:
            if not check_exists and "NoSuchBucket" in str(err):
                return []
            raise
        return list(json.loads(out.strip().splitlines()[-1]))

    def mkbucket(self, *buckets: str) -> None:
        """Create the S3 buckets not made yet."""
        new = [b for b in buckets if b not in self._buckets]
        if new:
            self.s3([("mkbucket", b) for b in new])
            self._buckets.update(new)

    def list_keys(self, url: str) -> dict[str, int]:
        """``{key: size}`` of the objects under an ``s3://bucket/prefix`` URL."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        return dict(self.s3([("list", bucket, prefix)])[0])


# --------------------------------------------------------------------------------------------------------- data


def digits_origin(
    nodes: TwoNodes, *, num_images: int = 200, size: int = 24, shard_bytes: int = 6_000, name: str = "digits"
) -> tuple[str, Any]:
    """The digits as ``size`` px JPEGs, packed into shards of ~``shard_bytes`` and uploaded to ``s3://data/<name>``.

    Returns:
        ``(url, listing)``: the packed origin's URL (for ``CachedDataModule(origin=...)``) and its
        :class:`~lightning_accel.data.origin.Listing` (``listing.pack`` maps samples to shards and shard sizes).
    """
    from lightning_accel.data import pack_origin
    from lightning_accel.datasets import materialize_digits

    src, packed = nodes.workdir / f"{name}-src", nodes.workdir / f"{name}-pack"
    materialize_digits(src, size=size, num_images=num_images)
    listing = pack_origin(str(src), str(packed), shard_bytes=shard_bytes, shuffle_seed=0)
    url = f"s3://data/{name}"
    nodes.mkbucket("data")
    nodes.s3([("put", str(packed), "data", name)])
    return url, listing


# ------------------------------------------------------------------------------------------------- the job side


def mlp_hidden_for(params: int, *, in_features: int, depth: int = 2, classes: int = 10) -> int:
    """The hidden width ``h`` of :class:`ImageMLP` (``depth`` hidden layers) whose parameter count is nearest
    ``params``: ``(in + 1) h + (depth - 1)(h + 1) h + (h + 1) classes``, solved for ``h``."""
    a, b, c = depth - 1, in_features + 1 + (depth - 1) + classes, classes - params
    h = (-b + (b * b - 4 * a * c) ** 0.5) / (2 * a) if a else -c / b
    return max(1, round(h))


class ImageMLP(pl.LightningModule):
    """An MLP on flattened ``(N, 3, S, S)`` images: ``depth`` hidden ReLU layers of width ``hidden``, no dropout (so a
    resumed run can match an uninterrupted one exactly); SGD with momentum and a per-step exponential LR decay (so
    a resume that lost the scheduler's state shows in the parameters).

    Args:
        image_size: side ``S`` of the input images.
        hidden: width of the hidden layers (:func:`mlp_hidden_for` picks it for a parameter count).
        depth: number of hidden layers.
        classes: outputs.
        lr: initial learning rate.
        momentum: SGD momentum (``ddp_1bit`` averages the momentum, compressed).
        gamma: the learning rate is multiplied by this after every step.
        seed: seed of the initial weights.
    """

    def __init__(
        self,
        image_size: int = 16,
        hidden: int = 64,
        depth: int = 2,
        classes: int = 10,
        lr: float = 0.05,
        momentum: float = 0.9,
        gamma: float = 0.98,
        seed: int = 0,
    ) -> None:
        super().__init__()
        from benchmarks._models import mlp

        torch.manual_seed(seed)
        self.net = mlp(3 * image_size * image_size, *([hidden] * depth), classes)
        self.lr, self.momentum, self.gamma = lr, momentum, gamma
        self.last_loss = float("nan")

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.last_loss = float(loss.detach())
        return loss

    @override
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=self.gamma)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _read_counter(iface: str, what: str) -> int:
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/{what}").read_text())
    except (OSError, ValueError):
        return -1


class StepLog(pl.Callback):
    """One JSON line per event and training step per rank, in ``<dirpath>/rank<global rank>.jsonl`` (appended, so a
    restarted worker continues its rank's file); global rank 0 also saves the final ``state_dict``.

    Every line has ``event``, ``t`` (wall clock), ``rank``, ``pid``, ``restart`` (torchrun's
    ``TORCHELASTIC_RESTART_COUNT``: *not* the launch's index, each agent counts only its own workers' failures, so
    the node whose worker died says 1 and the other 0 after one restart; :func:`read_steps` numbers the launches as
    ``gen``) and ``group_rank`` (the node). Events: ``launch`` (``setup``; with the process's
    start time ``proc_start``), ``start`` (``on_train_start``: ``step`` resumed from, ``ckpt_path``), ``step`` (after
    each training batch: ``step``, ``epoch``, ``loss``, ``lr``, ``samples`` = the dataset indices of the batch,
    ``cache`` = this rank's cache counters, ``net_tx``/``net_rx`` = the namespace's veth counters), ``end``.

    Args:
        dirpath: directory of the step logs (created).
        final_state: where global rank 0 writes ``{name: tensor}`` of the model at the end of ``fit`` (``torch.save``).
        hold_at_step: once per rank (while ``hold-<rank>`` does not exist yet: the first launch), after this global
            step the rank touches ``hold-<rank>`` and waits for ``go`` in ``dirpath`` (at most ``hold_s`` seconds): a
            controller can act at a known step (kill a worker) without racing the training.
        hold_s: the longest wait at ``hold_at_step``.

    A stopped survivor exits at once through the library's ``ElasticExit``, which the ``lightning-accel`` CLI adds
    under torchrun (without it each agent waits 30 s per restart: Lightning's SIGTERM handler blocks in a broadcast).
    """

    def __init__(
        self,
        dirpath: str,
        final_state: str | None = None,
        hold_at_step: int | None = None,
        hold_s: float = 120.0,
    ) -> None:
        super().__init__()
        self.dirpath = Path(dirpath)
        self.final_state = final_state
        self.hold_at_step = hold_at_step
        self.hold_s = hold_s
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
        self._file: Any = None
        self._order: tuple[int, list[int]] | None = None

    def _write(self, trainer: pl.Trainer, event: str, **fields: Any) -> None:
        if self._file is None:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            self._file = open(self.dirpath / f"rank{trainer.global_rank}.jsonl", "a")  # noqa: SIM115
        rec = {
            "event": event,
            "t": time.time(),
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "restart": self.restart,
            "group_rank": int(os.environ.get("GROUP_RANK", "-1")),
            **fields,
        }
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()  # a killed worker's lines must already be on disk

    def _cache(self, trainer: pl.Trainer) -> dict[str, int]:
        dm: Any = getattr(trainer, "datamodule", None)
        stats = getattr(dm, "cache_stats", None)
        keys = ("requests", "ram_hits", "ssd_hits", "origin_fetches", "bytes_fetched", "refetches")
        return {k: int(stats[k]) for k in keys} if isinstance(stats, dict) else {}

    def _batch_samples(self, trainer: pl.Trainer) -> list[int]:
        """Dataset indices of the batch just consumed: positions ``[consumed - batch, consumed)`` of the sampler's
        order (``CachedDataModule``'s sampler counts consumed positions, resumes included)."""
        loader: Any = trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        if sampler is None or not hasattr(sampler, "epoch_order") or not hasattr(sampler, "consumed"):
            return []
        epoch = int(sampler.epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, list(sampler.epoch_order()))
        order, end = self._order[1], int(sampler.consumed)
        indices = sampler.dataset.indices
        return [int(indices[p]) for p in order[max(0, end - int(sampler.batch_size)) : end]]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._write(trainer, "launch", proc_start=_proc_start_time(), local_rank=trainer.local_rank)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, "start", step=trainer.global_step, ckpt_path=str(trainer.ckpt_path))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        opt = trainer.optimizers[0] if trainer.optimizers else None
        self._write(
            trainer,
            "step",
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            batch_idx=batch_idx,
            loss=float(getattr(pl_module, "last_loss", float("nan"))),
            lr=float(opt.param_groups[0]["lr"]) if opt is not None else None,
            samples=self._batch_samples(trainer),
            cache=self._cache(trainer),
            net_tx=_read_counter(self.iface, "tx_bytes"),
            net_rx=_read_counter(self.iface, "rx_bytes"),
        )
        hold = self.dirpath / f"hold-{trainer.global_rank}"
        if self.hold_at_step is not None and trainer.global_step == self.hold_at_step and not hold.exists():
            hold.touch()
            deadline = time.monotonic() + self.hold_s
            while not (self.dirpath / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.01)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, "end", step=trainer.global_step, cache=self._cache(trainer))
        if self.final_state and trainer.is_global_zero:
            state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
            tmp = f"{self.final_state}.tmp"
            torch.save(state, tmp)
            os.replace(tmp, self.final_state)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ------------------------------------------------------------------------------------------------- the job config

_STRATEGY_ALIASES = {
    "ddp_1bit": "lightning_accel.strategies.OneBitDDPStrategy",
    "diloco": "lightning_accel.strategies.LocalStepsStrategy",
    "ddp": "lightning.pytorch.strategies.DDPStrategy",
}


def strategy_config(spec: str | Mapping[str, Any] | tuple[str, Mapping[str, Any]]) -> str | dict[str, Any]:
    """``trainer.strategy`` for the YAML from a spec: ``"ddp"`` / ``"ddp_1bit"`` (aliases as they are),
    ``("ddp_1bit", {"hierarchical": True})`` (an alias or a class path with init args, passed through unchecked), or
    ``{"class_path": ..., "init_args": {...}}`` as LightningCLI takes it."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, tuple):
        name, init_args = spec
        return {"class_path": _STRATEGY_ALIASES.get(name, name), "init_args": dict(init_args)}
    if isinstance(spec, Mapping) and "class_path" in spec:
        cp = str(spec["class_path"])
        return {"class_path": _STRATEGY_ALIASES.get(cp, cp), "init_args": dict(spec.get("init_args") or {})}
    raise TypeError(
        f"`strategy` must be an alias ('ddp', 'ddp_1bit'), a (name, init_args) tuple or a "
        f"{{'class_path', 'init_args'}} mapping, got {spec!r}."
    )


#: ``ddp_1bit`` settings whose result does not depend on timing: bit-for-bit repeatable runs and resumes.
DETERMINISTIC_1BIT: tuple[str, dict[str, Any]] = (
    "ddp_1bit",
    {"compression": "1bit", "overlap": True, "warmup_steps": 2, "log_stats": False},
)


@dataclass
class Job:
    """One 2-node x 2-rank fit: what :func:`write_job` turns into a LightningCLI config.

    Attributes:
        origin: the packed S3 origin (:func:`digits_origin`).
        strategy: a :func:`strategy_config` spec.
        steps: ``max_steps``.
        batch_size: per rank.
        image_size: side of the cached images.
        hidden: :class:`ImageMLP` width (see :func:`mlp_hidden_for`).
        depth: :class:`ImageMLP` hidden layers.
        save_every: ``DeltaModelCheckpoint(every_n_train_steps=...)`` (``None``: no checkpoints).
        async_save: ``DeltaCheckpointIO(async_save=...)``.
        hold_at_step: :class:`StepLog`'s ``hold_at_step`` (first launch only).
        seed: ``seed_everything`` and the model's and data's seeds.
        shuffle: ``CachedDataModule(shuffle=...)``.
        ram_bytes: RAM tier budget per node.
        trainer: extra ``trainer`` settings (override the defaults).
        data: extra ``CachedDataModule`` init args.
    """

    origin: str
    strategy: Any = DETERMINISTIC_1BIT
    steps: int = 20
    batch_size: int = 5
    image_size: int = 16
    hidden: int = 64
    depth: int = 2
    save_every: int | None = 4
    async_save: bool = False
    hold_at_step: int | None = None
    seed: int = 0
    shuffle: str = "global"
    ram_bytes: str = "64MiB"
    trainer: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class JobPaths:
    """Where a written job lives: ``dir`` (config, agent logs), ``config``, ``steps`` (step logs), ``final_state``,
    ``ckpt_url`` (its checkpoint directory on S3), ``cache_dirs`` (per node)."""

    name: str
    dir: Path
    config: Path
    steps: Path
    final_state: Path
    ckpt_url: str | None
    cache_dirs: tuple[Path, Path]


def write_job(nodes: TwoNodes, job: Job, name: str) -> JobPaths:
    """Write ``<workdir>/<name>/job.yaml`` for ``job`` (the ``s3://ckpt`` bucket is made when it saves).

    Each node's cache (``{node_rank}`` in ``cache_dir`` / ``ram_dir``) is its own directory, shared by its two ranks and
    by every launch of the job (so a restart finds what the killed launch cached). The config is JSON, which is YAML.
    """
    d = nodes.workdir / name
    d.mkdir(parents=True, exist_ok=False)
    steps, final = d / "steps", d / "final_state.pt"
    ckpt_url = f"s3://ckpt/{name}" if job.save_every else None
    callbacks: list[dict[str, Any]] = [
        {"class_path": "benchmarks._multinode.StepLog", "init_args": {"dirpath": str(steps), "final_state": str(final)}}
    ]
    if job.hold_at_step is not None:
        callbacks[0]["init_args"]["hold_at_step"] = job.hold_at_step
    plugins: list[dict[str, Any]] = []
    if ckpt_url is not None:
        nodes.mkbucket("ckpt")
        plugins.append(
            {
                "class_path": "lightning_accel.checkpoint.DeltaCheckpointIO",
                "init_args": {"storage_options": nodes.storage_options, "async_save": job.async_save},
            }
        )
        callbacks.append(
            {
                "class_path": "lightning_accel.checkpoint.DeltaModelCheckpoint",
                "init_args": {
                    "dirpath": ckpt_url,
                    "filename": "{step}",
                    "every_n_train_steps": job.save_every,
                    "save_top_k": -1,
                    "save_last": True,
                },
            }
        )
    trainer: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "num_nodes": 2,
        "strategy": strategy_config(job.strategy),
        "deterministic": True,
        "max_steps": job.steps,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": ckpt_url is not None,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "default_root_dir": str(d / "root"),
        "plugins": plugins or None,
        "callbacks": callbacks,
        **job.trainer,
    }
    data = {
        "origin": job.origin,
        "storage_options": nodes.storage_options,
        "cache_dir": str(d / "node{node_rank}" / "cache"),
        "ram_dir": str(nodes.ram_root / name / "node{node_rank}"),
        "ram_bytes": job.ram_bytes,
        "image_size": job.image_size,
        "batch_size": job.batch_size,
        "num_workers": 0,
        "val_fraction": 0.0,
        "shuffle": job.shuffle,
        "seed": job.seed,
        **job.data,
    }
    model = {"image_size": job.image_size, "hidden": job.hidden, "depth": job.depth, "seed": job.seed}
    config = {
        "seed_everything": job.seed,
        "trainer": trainer,
        "model": {"class_path": "benchmarks._multinode.ImageMLP", "init_args": model},
        "data": {"class_path": "lightning_accel.data.CachedDataModule", "init_args": data},
    }
    path = d / "job.yaml"
    path.write_text(json.dumps(config, indent=1))
    caches = (d / "node0" / "cache", d / "node1" / "cache")
    return JobPaths(name, d, path, steps, final, ckpt_url, caches)


# --------------------------------------------------------------------------------------------------------- launch


class Launch:
    """The two ``torchrun`` agents of one job (``agents[k]`` in node ``k``), logging to ``<job dir>/node<k>.log``."""

    def __init__(self, nodes: TwoNodes, paths: JobPaths, agents: list[subprocess.Popen[Any]], logs: list[Any]) -> None:
        self.nodes, self.paths, self.agents, self._logs = nodes, paths, agents, logs
        self.started = time.time()

    def log(self, node: int) -> str:
        """Agent ``node``'s output so far (its workers' output included)."""
        with contextlib.suppress(OSError):
            return (self.paths.dir / f"node{node}.log").read_text(errors="replace")
        return ""

    def poll(self) -> list[int | None]:
        return [a.poll() for a in self.agents]

    def worker_pids(self, node: int) -> list[int]:
        """The live ``lightning_accel.cli`` workers under agent ``node`` (children of torchrun)."""
        out = []
        for pid in descendants(self.agents[node].pid):
            with contextlib.suppress(OSError):
                if b"lightning_accel.cli" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.append(pid)
        return out

    def wait(self, timeout: float) -> list[int]:
        """Wait for both agents (at most ``timeout`` s in all); on timeout kill both trees and raise TimeoutError with
        the logs' tails. Returns the agents' exit codes."""
        deadline = time.monotonic() + timeout
        while any(c is None for c in self.poll()):
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"job {self.paths.name} did not finish in {timeout:.0f} s: {self.tails()}")
            time.sleep(0.05)
        self.close()
        return [int(a.returncode) for a in self.agents]

    def kill(self) -> None:
        _stop_all(self.agents)
        self.close()

    def close(self) -> None:
        for f in self._logs:
            with contextlib.suppress(OSError):
                f.close()

    def tails(self, n: int = 1500) -> str:
        return " | ".join(f"node{k}: ...{self.log(k)[-n:]}" for k in range(2))


def launch(
    nodes: TwoNodes,
    paths: JobPaths,
    *,
    max_restarts: int = 0,
    resume: bool = False,
    port: int = 29400,
    monitor_interval: float = 0.2,
    threads: int = 1,
) -> Launch:
    """Start ``torchrun`` in both namespaces for the job at ``paths``.

    ``torchrun --nnodes 2 --nproc-per-node 2 --node-rank K --rdzv-backend c10d --rdzv-endpoint 169.254.78.1:<port>
    --rdzv-id <job> --rdzv-conf is_host=<K==0>,join_timeout=60 --local-addr <node K's address> --max-restarts N
    --monitor-interval <s> -m lightning_accel.cli fit --config job.yaml [--ckpt_path last]``, with
    ``GLOO_SOCKET_IFNAME`` = node K's veth, ``OMP_NUM_THREADS`` = ``threads``, ``LOGLEVEL=INFO`` (the agents log
    their restarts), ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see the comment in the code: without it the workers
    of a restarted launch do not find each other), fake AWS credentials. ``port``: the rendezvous port (use a new one
    per job: a closed one may linger in TIME_WAIT).
    """
    agents, logs = [], []
    rdzv_id = f"{paths.name}-{uuid.uuid4().hex[:6]}"  # one id for both agents: it names the rendezvous they join
    for k in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
        cmd += ["--node-rank", str(k), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDR[0]}:{port}"]
        cmd += ["--rdzv-id", rdzv_id]
        # see the module docstring: the host cannot be found by hostname in a namespace, nor MASTER_ADDR
        cmd += ["--rdzv-conf", f"is_host={int(k == 0)},join_timeout=60", "--local-addr", ADDR[k]]
        cmd += ["--max-restarts", str(max_restarts), "--monitor-interval", str(monitor_interval)]
        cmd += ["-m", "lightning_accel.cli", "fit", "--config", str(paths.config)]
        if resume:
            cmd += ["--ckpt_path", "last"]
        env = clean_env({"GLOO_SOCKET_IFNAME": IFACES[k], "OMP_NUM_THREADS": str(threads), "LOGLEVEL": "INFO"})
        # The workers' store: with the agent's store shared (torch's default) each worker's keys live under
        # `/worker/attempt_<TORCHELASTIC_RESTART_COUNT>`, a count each agent keeps for itself; the agent whose
        # worker died counts a restart, the other one restarts for the "new node" without counting, so after a
        # restart the two nodes' workers look for each other under different prefixes and node0's find the dead
        # launch's addresses (gloo: "Connection refused"; pytorch/pytorch#135712). A store of the workers' own
        # (rank 0 hosts it at MASTER_ADDR, node0's `--local-addr`) starts empty at every launch.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        log = open(paths.dir / f"node{k}.log", "wb")  # noqa: SIM115 - closed by Launch
        logs.append(log)
        agents.append(nodes.popen(k, cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(paths.dir)))
    return Launch(nodes, paths, agents, logs)


# ------------------------------------------------------------------------------------------------------- reading


def read_steps(steps_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """``{global rank: [record, ...]}`` of a job's step logs (a line cut short by a kill is skipped); each record gets
    ``gen``, the index of the launch that wrote it (0 first, 1 after one restart), from the rank's ``launch`` lines."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(Path(steps_dir).glob("rank*.jsonl")):
        recs: list[dict[str, Any]] = []
        gen = -1
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            gen += rec.get("event") == "launch"
            recs.append({**rec, "gen": max(0, gen)})
        out[int(path.stem.removeprefix("rank"))] = recs
    return out


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return float("nan") if not n else s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _last_cache(recs: list[dict[str, Any]]) -> dict[str, int]:
    """The last cache counters a launch of one rank logged (``end`` or its last step)."""
    for r in reversed(recs):
        if r.get("cache"):
            return dict(r["cache"])
    return {}


def data_counts(
    steps: dict[int, list[dict[str, Any]]],
    listing: Any,
    per_node: int = 2,
    cache_dirs: Sequence[Path] | None = None,
) -> dict[str, Any]:
    """Per node: decodes per sample read and shard bytes fetched per byte of the shards its samples live in.

    ``decodes`` = the ``origin_fetches`` of its ranks summed over every launch (each launch's last logged counters:
    a killed launch's fetches after its last step line are missed), ``samples`` = distinct dataset indices its ranks
    trained on (from the step logs), ``fetched_bytes`` = ``bytes_fetched`` summed the same way, ``needed_bytes`` =
    sizes of the shards holding those samples. ``decodes_per_sample`` is exact for a job that ends at an epoch's end;
    one that stops mid-epoch has read ahead (decoded) samples of batches it never trained on, which count as decodes
    and not as samples. With ``cache_dirs`` (per node, ``JobPaths.cache_dirs``; read after the job, when the last
    launch's teardown has copied the RAM tier into the SSD tier) also ``cached`` = entries of the node's SSD tier and
    ``decodes_per_cached`` (1.0: every decode was of a sample not cached yet, read-ahead included). On a normal run
    both ratios are 1.0 and ``shard_fetch_ratio`` at most ~1.05.
    """
    from lightning_accel.data.tiers import LmdbTier

    pack = listing.pack
    out: dict[str, Any] = {}
    for node in range(2):
        decodes = fetched = 0
        samples: set[int] = set()
        for rank in range(node * per_node, (node + 1) * per_node):
            recs = steps.get(rank, [])
            for gen in sorted({int(r["gen"]) for r in recs}):
                c = _last_cache([r for r in recs if r["gen"] == gen])
                decodes += c.get("origin_fetches", 0)
                fetched += c.get("bytes_fetched", 0)
            samples |= {i for r in recs if r["event"] == "step" for i in r.get("samples", [])}
        needed = sum(pack.shard_sizes[s] for s in {pack.shard[i] for i in samples}) if pack is not None else 0
        out[f"node{node}"] = {
            "decodes": decodes,
            "samples": len(samples),
            "decodes_per_sample": round(decodes / max(1, len(samples)), 4),
            "extra_decodes": decodes - len(samples),  # read-ahead, or samples decoded twice
            "fetched_bytes": fetched,
            "needed_bytes": needed,
            "shard_fetch_ratio": round(fetched / needed, 4) if needed else None,
        }
        if cache_dirs is not None:
            cached = len(LmdbTier(cache_dirs[node] / "ssd", None, name="ssd"))
            out[f"node{node}"]["cached"] = cached
            out[f"node{node}"]["decodes_per_cached"] = round(decodes / max(1, cached), 4)
    return out


def _step_records(steps: dict[int, list[dict[str, Any]]], rank: int = 0) -> list[dict[str, Any]]:
    return [r for r in steps.get(rank, []) if r["event"] == "step"]


def _final_state(path: Path) -> dict[str, torch.Tensor]:
    return dict(torch.load(path, map_location="cpu", weights_only=True))


def max_abs_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts of the same keys (``inf`` when the keys differ)."""
    if set(a) != set(b):
        return float("inf")
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a), default=0.0)


def verify_checkpoints(nodes: TwoNodes, ckpt_url: str, *, timeout: float = 180.0) -> dict[str, Any]:
    """Run ``python -m lightning_accel.checkpoint verify`` (the ``lightning-accel ckpt verify`` tool) in node1 on every
    ``*.ckpt`` under ``ckpt_url``. Returns ``{"checkpoints": [names], "failed": n, "summaries": [...]}``."""
    bucket, _, prefix = ckpt_url.removeprefix("s3://").partition("/")
    keys = sorted(k for k in nodes.list_keys(ckpt_url) if k.endswith(".ckpt") and "/.delta_blobs/" not in k)
    urls = [f"s3://{bucket}/{k}" for k in keys]
    if not urls:
        return {"checkpoints": [], "failed": 0, "summaries": []}
    cmd = [sys.executable, "-m", "lightning_accel.checkpoint", "verify", *urls]
    cmd += ["--storage-options", json.dumps(nodes.storage_options)]
    proc = nodes.popen(1, cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        proc.communicate(timeout=10)
        raise TimeoutError(f"`ckpt verify` took over {timeout:.0f} s") from None
    summaries = []
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            summaries.append(json.loads(line))
    failed = sum(1 for s in summaries if isinstance(s, dict) and not s.get("ok", False))
    if proc.returncode not in (0, 1) or len(summaries) < len(urls):
        failed = max(failed, len(urls) - sum(1 for s in summaries if isinstance(s, dict) and s.get("ok")))
    return {
        "checkpoints": [k.rsplit("/", 1)[-1] for k in keys],
        "failed": failed,
        "returncode": proc.returncode,
        "summaries": summaries,
        "stderr": err[-500:] if proc.returncode else "",
    }


# ----------------------------------------------------------------------------------------------------- the cases


def _run_job(nodes: TwoNodes, job: Job, name: str, *, timeout: float, port: int) -> tuple[JobPaths, list[int]]:
    paths = write_job(nodes, job, name)
    run = launch(nodes, paths, port=port)
    codes = run.wait(timeout)
    if codes != [0, 0]:
        raise RuntimeError(f"job {name} failed (agents exited {codes}): {run.tails()}")
    return paths, codes


_PORTS = iter(range(29400, 29999))


def run_steps(
    nodes: TwoNodes,
    strategy: Any,
    steps: int,
    *,
    origin: str,
    listing: Any = None,
    hidden: int = 64,
    depth: int = 2,
    skip: int = 3,
    timeout: float = 600.0,
    name: str | None = None,
    **job_kw: Any,
) -> dict[str, Any]:
    """One uninterrupted 2 x 2 job of ``steps`` steps with ``strategy`` (no checkpoints unless ``save_every`` is given).

    Returns:
        ``median_step_s`` (rank 0's step end-to-end intervals after the first ``skip`` steps), ``internode_bytes``
        (both veth ends' tx over those same steps, from the namespaces' counters logged by local rank 0 of each node),
        ``internode_bytes_per_step``, ``link_bytes_total`` (the counters over the whole job: setup, data, rendezvous
        included), ``params`` (the model's parameter count), ``data`` (:func:`data_counts`, when ``listing`` is
        given), ``wall_s``, ``final_state`` (path of rank 0's final ``state_dict``), ``paths``.
    """
    job_kw.setdefault("save_every", None)
    job = Job(origin=origin, strategy=strategy, steps=steps, hidden=hidden, depth=depth, **job_kw)
    before = nodes.link_bytes()
    t0 = time.monotonic()
    paths, _ = _run_job(nodes, job, name or f"steps-{uuid.uuid4().hex[:6]}", timeout=timeout, port=next(_PORTS))
    wall = time.monotonic() - t0
    after = nodes.link_bytes()
    logs = read_steps(paths.steps)
    r0 = _step_records(logs, 0)
    ends = [r["t"] for r in r0]
    diffs = [b - a for a, b in zip(ends[skip:], ends[skip + 1 :], strict=False)]
    tx = []
    for rank in (0, 2):  # local rank 0 of each node reads its namespace's veth counters
        recs = _step_records(logs, rank)
        if len(recs) > skip + 1:
            tx.append(recs[-1]["net_tx"] - recs[skip]["net_tx"])
    timed = max(1, len(r0) - skip - 1)
    state = _final_state(paths.final_state)
    out: dict[str, Any] = {
        "steps": len(r0),
        "median_step_s": round(_median(diffs), 5),
        "internode_bytes": sum(tx),
        "internode_bytes_per_step": round(sum(tx) / timed),
        "link_bytes_total": (after["tx0"] - before["tx0"]) + (after["tx1"] - before["tx1"]),
        "params": sum(v.numel() for k, v in state.items()),
        "wall_s": round(wall, 2),
        "final_state": str(paths.final_state),
        "paths": paths,
    }
    if listing is not None:
        out["data"] = data_counts(logs, listing, cache_dirs=paths.cache_dirs)
    return out


def _agent_mark(run: Launch, node: int, needle: str) -> bool:
    return needle in run.log(node)


def run_restart(
    nodes: TwoNodes,
    *,
    origin: str,
    listing: Any = None,
    strategy: Any = DETERMINISTIC_1BIT,
    steps: int = 20,
    save_every: int = 4,
    kill_at: int = 6,
    kill_local_rank: int = 0,
    reference: bool = True,
    timeout: float = 300.0,
    verify: bool = True,
    **job_kw: Any,
) -> dict[str, Any]:
    """The elastic-restart recipe: kill -9 one ``node1`` worker mid-epoch after a checkpoint, let torchrun restart the
    group, compare with an uninterrupted run.

    1. (``reference``) the same job uninterrupted, in a directory of its own.
    2. The job with ``--max-restarts 1 --ckpt_path last``: every rank holds after step ``kill_at`` (first launch only);
       once the checkpoint of step ``kill_at // save_every * save_every`` and ``last.ckpt`` are listed on S3, the
       worker of local rank ``kill_local_rank`` on node1 (a child of node1's agent) gets SIGKILL, then the ranks are
       released (the survivors find the dead peer in their next collective, as they would on a real cluster).
    3. Wait for both agents (bounded by ``timeout``), verify every checkpoint (in node1, ``ckpt verify``).

    Returns:
        ``kill_step``, ``resumed_step`` (the global step the restarted launch started from), ``restart_lost_steps``
        (kill_step - resumed_step: steps trained twice, at most ``save_every``), ``detection_s`` (kill -> node1's agent
        noticing the dead worker: it stops the other one), ``teardown_s`` (kill -> node1's agent logging that it
        restarts the group: its surviving worker has exited), ``restart_s`` (kill -> the first restarted worker process
        exists), ``resume_s`` (kill -> the first step after the restart done), ``restarts`` (per node, from the agents'
        logs), ``final_max_abs_diff`` (against the reference; ``None`` without one), ``same_batches`` (every step
        trained on the reference's samples for that step, on every rank), ``loss_max_abs_diff``, ``checkpoints``,
        ``checkpoints_failed``, ``data`` (:func:`data_counts` of the restarted job; its ``decodes_per_cached`` is 1.0
        when the restarted launch decoded nothing the killed one had cached), ``after_restart_decodes`` (per node:
        origin fetches in the restarted launch, i.e. samples the killed launch had not read yet), ``wall_s``,
        ``ref_wall_s``.
    """
    if kill_at <= save_every:
        raise ValueError(f"`kill_at` ({kill_at}) must be after the first save (`save_every` {save_every}).")
    out: dict[str, Any] = {"steps": steps, "save_every": save_every, "kill_at": kill_at}
    ref_logs: dict[int, list[dict[str, Any]]] | None = None
    ref_state = None
    if reference:
        t0 = time.monotonic()
        ref = Job(origin=origin, strategy=strategy, steps=steps, save_every=save_every, **job_kw)
        ref_paths, _ = _run_job(nodes, ref, f"ref-{uuid.uuid4().hex[:6]}", timeout=timeout, port=next(_PORTS))
        out["ref_wall_s"] = round(time.monotonic() - t0, 2)
        ref_logs, ref_state = read_steps(ref_paths.steps), _final_state(ref_paths.final_state)
    job = Job(origin=origin, strategy=strategy, steps=steps, save_every=save_every, hold_at_step=kill_at, **job_kw)
    paths = write_job(nodes, job, f"restart-{uuid.uuid4().hex[:6]}")
    assert paths.ckpt_url is not None
    t0 = time.monotonic()
    deadline = t0 + timeout
    run = launch(nodes, paths, max_restarts=1, resume=True, port=next(_PORTS))
    try:
        holds = [paths.steps / f"hold-{r}" for r in range(4)]
        while not all(h.exists() for h in holds):
            if any(c is not None for c in run.poll()) or time.monotonic() > deadline:
                raise RuntimeError(f"the job did not reach step {kill_at}: {run.tails()}")
            time.sleep(0.05)
        saved = kill_at // save_every * save_every
        want = {f"step={saved}.ckpt", "last.ckpt"}
        while not want <= {k.rsplit("/", 1)[-1] for k in nodes.list_keys(paths.ckpt_url)}:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{sorted(want)} never appeared under {paths.ckpt_url}")
            time.sleep(0.2)
        logs = read_steps(paths.steps)
        victim_rank = 2 + kill_local_rank
        victim = next(r["pid"] for r in logs[victim_rank] if r["event"] == "launch")
        if victim not in run.worker_pids(1):
            raise RuntimeError(f"rank {victim_rank}'s pid {victim} is not a worker of node1's agent")
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        (paths.steps / "go").touch()
        detected = torn_down = None
        while any(c is None for c in run.poll()):
            now = time.time()
            if detected is None and any(_agent_mark(run, 1, m) for m in ("closing signal", "failed (exitcode")):
                detected = now
            if torn_down is None and _agent_mark(run, 1, "will restart worker group"):
                torn_down = now
            if time.monotonic() > deadline:
                run.kill()
                raise TimeoutError(f"the restarted job did not finish in {timeout:.0f} s: {run.tails()}")
            time.sleep(0.05)
        run.close()
        codes = [int(a.returncode) for a in run.agents]
    finally:
        if any(c is None for c in run.poll()):
            run.kill()
    out["wall_s"] = round(time.monotonic() - t0, 2)
    out["agent_exit_codes"] = codes
    logs = read_steps(paths.steps)
    out["restarts"] = [run.log(k).count("will restart worker group") for k in range(2)]
    if codes != [0, 0]:
        out["error"] = f"agents exited {codes}: {run.tails()}"
        return out
    first = [r for recs in logs.values() for r in recs if r["gen"] == 0 and r["event"] == "step"]
    later = [r for recs in logs.values() for r in recs if r["gen"] >= 1]
    out["kill_step"] = max(r["step"] for r in first)
    starts = [r for r in later if r["event"] == "start"]
    out["resumed_step"] = min(r["step"] for r in starts) if starts else None
    out["resumed_from"] = starts[0]["ckpt_path"] if starts else None
    if out["resumed_step"] is not None:
        out["restart_lost_steps"] = out["kill_step"] - out["resumed_step"]
    out["detection_s"] = round(detected - t_kill, 3) if detected else None
    out["teardown_s"] = round(torn_down - t_kill, 3) if torn_down else None
    launches = [r["proc_start"] for r in later if r["event"] == "launch"]
    out["restart_s"] = round(min(launches) - t_kill, 3) if launches else None
    resumed = [r["t"] for r in later if r["event"] == "step"]
    out["resume_s"] = round(min(resumed) - t_kill, 3) if resumed else None
    out["final_steps"] = max((r["step"] for r in later if r["event"] == "step"), default=None)
    if ref_logs is not None and ref_state is not None:
        state = _final_state(paths.final_state)
        out["final_max_abs_diff"] = max_abs_diff(state, ref_state)
        out["same_batches"], out["loss_max_abs_diff"] = _compare_steps(logs, ref_logs)
    if verify:
        v = verify_checkpoints(nodes, paths.ckpt_url)
        out["checkpoints"], out["checkpoints_failed"] = v["checkpoints"], v["failed"]
        if v["failed"]:
            out["verify"] = v
    if listing is not None:
        out["data"] = data_counts(logs, listing, cache_dirs=paths.cache_dirs)
    after: dict[str, int] = {}
    for node in range(2):
        after[f"node{node}"] = sum(
            _last_cache([r for r in logs.get(rank, []) if r["gen"] >= 1]).get("origin_fetches", 0)
            for rank in (2 * node, 2 * node + 1)
        )
    out["after_restart_decodes"] = after
    out["paths"] = paths
    return out


def _compare_steps(logs: dict[int, list[dict[str, Any]]], ref: dict[int, list[dict[str, Any]]]) -> tuple[bool, float]:
    """Whether every rank's last record of each step trained on the reference's samples, and the largest loss gap."""
    same, gap = True, 0.0
    for rank, recs in ref.items():
        want = {r["step"]: r for r in recs if r["event"] == "step"}
        got = {r["step"]: r for r in logs.get(rank, []) if r["event"] == "step"}  # later launches overwrite
        if set(got) != set(want):
            same = False
        for s, r in want.items():
            g = got.get(s)
            if g is None:
                continue
            same = same and g["samples"] == r["samples"]
            gap = max(gap, abs(g["loss"] - r["loss"]))
    return same, gap


@contextlib.contextmanager
def two_nodes(rate_mbit: int | None = None, **kw: Any) -> Iterator[TwoNodes]:
    """``with two_nodes() as nodes:`` -- :class:`TwoNodes` as a context manager function."""
    with TwoNodes(rate_mbit, **kw) as nodes:
        yield nodes
