"""``tune``: measure every lever on the user's own job, one at a time, keep what pays, write the config.

The loop (rank 0 decides every step, the other ranks follow its broadcast):

1. the job's fingerprint (its config, the trial settings, the device, world size and versions) is looked up in the
   cache: a hit writes the outputs again and returns at once;
2. a **baseline** trial of the job as configured gives the step time, the breakdown and the verdict;
3. the levers are tried in the order the verdict points to (``core.lever_order``), each option on the best job so
   far, on the same seed and batches; an option whose trial ran and passed the numerics is followed at once by a
   trial of the best job so far and compared with the mean of the best job's two trials around it (A B A), not
   with one taken minutes earlier (on a shared machine the load between two distant trials moves step times by more
   than a lever's gain); an option is kept by ``core.decide`` (faster by the margin, numerics within the
   precision's tolerance of the baseline, memory fits); a trial whose estimate does not fit in the budget left is
   skipped and reported;
4. ``tuned.yaml`` (the best job with ``RollbackGuard`` in its callbacks) and ``tune_report.{json,md,png}`` are
   written beside it, and the result is cached.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import itertools
import json
import os
import platform
import re
import shutil
import signal
import struct
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_accel._utils.errors import one_line
from lightning_accel._utils.processes import process_running, process_start
from lightning_accel._utils.rank import distributed_ready, global_rank, local_rank, node_rank
from lightning_accel.tune.core import (
    DEFAULT_MARGIN,
    LEVERS,
    Budget,
    TrialResult,
    TuneCache,
    arg_label,
    check_numerics,
    decide,
    fingerprint,
    flags_named,
    folder_problem,
    lever_order,
    named_arg,
    parse_duration,
    progress_line,
)
from lightning_accel.tune.levers import (
    CHANNELS_LAST,
    Option,
    as_list,
    has_checkpoints,
    job_precision,
    options_for,
    world_of,
)
from lightning_accel.tune.runner import (
    OVER_BUDGET,
    TrialMeasure,
    agree,
    agree_check,
    run_trial,
    stop_other_ranks,
)
from lightning_accel.tune.runner import deadline as trial_deadline

__all__ = ["GUARD_CLASS_PATH", "TuneResult", "exhaustive", "job_from_objects", "load_job", "tune", "tune_job"]

#: the callback ``tune`` adds to the config it writes
GUARD_CLASS_PATH = "lightning_accel.callbacks.RollbackGuard"
_TRIAL_VERSION = 4  # part of the fingerprint: a change of what a trial measures invalidates the cache (3: one
# step time per optimizer step under gradient accumulation; 4: a ddp_1bit trial compresses in its timed steps)
#: the first line of every ``tuned.yaml`` ``tune`` writes (followed by the job's fingerprint): a file at ``--out``
#: that does not start with it is the user's, and is not overwritten without ``force``
HEADER = "# written by `lightning-accel tune`"
#: the marker in the reports ``tune`` writes (a key of the JSON report, a text chunk of the PNG)
_REPORT_MARK = "lightning-accel tune"
# The JSON reports of versions before the marker: exactly these keys, and per trial one of these key sets (a trial
# recorded `ref_step_s` from the second version on). Only a file of exactly this structure is taken for one of them.
_OLD_REPORT_KEYS = frozenset({"fingerprint", "cached", "seconds", "budget_s", "chosen", "trials"})
_OLD_TRIAL_KEYS = frozenset(
    {"name", "lever", "changes", "step_s", "breakdown", "dominant", "verdict", "losses", "numerics", "peak_mem_bytes"}
    | {"memory_ok", "decision", "reason", "seconds", "error"}
)
_OLD_TRIAL_KEY_SETS = (_OLD_TRIAL_KEYS, _OLD_TRIAL_KEYS | {"ref_step_s"})
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class TuneResult:
    """What ``tune`` returns.

    Attributes:
        config: the tuned job (a config mapping, what ``tuned.yaml`` holds).
        trials: every trial, in order (the baseline first).
        chosen: lever -> the names of its kept options whose edits are in ``config`` (several, as two options of
            the data lever, joined by ``", "`` in the order kept; an option a later kept one of its lever replaced is
            left out; levers left as configured are absent).
        fingerprint: the job's cache key; ``cached``: whether this result came from the cache.
        seconds: wall seconds of this call; ``budget_s``: the budget.
        paths: the files written (``tuned``, ``json``, ``md``, ``png``).
    """

    config: dict[str, Any]
    trials: list[TrialResult]
    chosen: dict[str, str]
    fingerprint: str
    cached: bool
    seconds: float
    budget_s: float
    paths: dict[str, str] = field(default_factory=dict)

    @property
    def baseline(self) -> TrialResult:
        """The baseline trial."""
        return self.trials[0]

    @property
    def best_step_s(self) -> float | None:
        """The normalised step time of the kept configuration (the baseline's when nothing was kept)."""
        kept = [t for t in self.trials if t.decision in ("kept", "baseline") and t.step_s is not None]
        return kept[-1].step_s if kept else None


def load_job(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The job in a ``lightning-accel fit`` YAML (``fit:`` nesting accepted).

    The file is checked as ``lightning-accel fit --config`` checks it (the same one-line messages), each naming the
    file as the caller gave it: the keyword argument ``path`` from Python, the ``--config`` flag from the ``tune``
    command (which calls it under :func:`~lightning_accel.tune.core.named_as_flags`).

    Raises:
        FileNotFoundError: a missing file.
        ValueError: a folder (its YAML files named), a file that is not valid YAML, is empty or holds no job mapping.
    """
    from lightning_accel.cli import _check_config_file, _config_folder_message

    label = "--config" if flags_named() else "path"
    p = Path(path)
    if p.is_dir():
        raise ValueError(_config_folder_message(os.fspath(path), label))
    if not p.is_file():
        raise FileNotFoundError(
            f"`{label}` {os.fspath(path)!r} does not exist (cwd: {os.getcwd()}). Pass the YAML `fit` runs."
        )
    # invalid YAML, empty, not a mapping: one line naming the file; else the parsed file
    job: Any = _check_config_file(os.fspath(path), label, overrides=False)
    if isinstance(job, dict) and isinstance(job.get("fit"), dict):
        job = job["fit"]
    if not isinstance(job, dict) or "model" not in job:
        raise ValueError(f"`{label}` {os.fspath(path)!r} holds no job: expected a mapping with `model:` (and `data:`).")
    return job


def _as_config(obj: Any, arg: str) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return dict(obj)
    hp = getattr(obj, "hparams", None)
    if hp is None or (len(hp) == 0 and len(__import__("inspect").signature(type(obj)).parameters) > 0):
        raise TypeError(
            f"`{arg}` must be a config mapping (class_path/init_args) or an instance that saved its hyper-parameters "
            f"(`self.save_hyperparameters()`), got {type(obj).__name__} without them. Pass "
            f"{{'class_path': ..., 'init_args': ...}}."
        )
    return {"class_path": f"{type(obj).__module__}.{type(obj).__qualname__}", "init_args": dict(hp)}


def _not_yaml(value: Any, where: str = "") -> tuple[str, Any] | None:
    """The first value in ``value`` (nested mappings and lists) that a YAML config cannot hold, with its dotted key;
    None when all of it can."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _not_yaml(v, f"{where}.{k}" if where else str(k))
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _not_yaml(v, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    return None if value is None or isinstance(value, (str, int, float, bool)) else (where, value)


def job_from_objects(trainer_kwargs: Mapping[str, Any] | None, model: Any, datamodule: Any, seed: int = 0) -> dict:
    """A job config from the Python API's arguments: ``trainer_kwargs`` (YAML-able values) and a model / data module
    given as config mappings or as instances that saved their hyper-parameters.

    Raises:
        TypeError: a value a YAML config cannot hold, naming the argument (``trainer_kwargs``, ``model``,
            ``datamodule``) and the key it is at; ``trainer_kwargs`` that is no mapping; a ``seed`` that is no integer.
        ValueError: a ``seed`` outside what ``seed_everything`` takes.
    """
    from lightning_accel._utils.checks import check_seed

    # here, not in the baseline trial: a bad seed failed it as "`seed_everything` ... Given value: seven" (a key the
    # caller never wrote), -3 as numpy's bounds error, after the trial's instantiation
    check_seed("seed", seed, what="every trial of the tune (the written config keeps it as `seed_everything`)")
    if trainer_kwargs is not None and not isinstance(trainer_kwargs, Mapping):
        raise TypeError(
            f"`trainer_kwargs` must be a mapping of Trainer arguments or None, got {type(trainer_kwargs).__name__} "
            f"({trainer_kwargs!r}). Pass e.g. {{'accelerator': 'cpu', 'devices': 1, 'max_epochs': 1}}."
        )
    job: dict[str, Any] = {"seed_everything": seed, "trainer": copy.deepcopy(dict(trainer_kwargs or {}))}
    job["model"] = _as_config(model, "model")
    if datamodule is not None:
        job["data"] = _as_config(datamodule, "datamodule")
    # each source on its own: the message names the argument that holds the value, and its key
    sources = (("trainer_kwargs", trainer_kwargs, job["trainer"]), ("model", model, job["model"]))
    for arg, given, part in (*sources, ("datamodule", datamodule, job.get("data"))):
        instance = isinstance(part, dict) and given is not None and not isinstance(given, Mapping)
        found = _not_yaml(part["init_args"] if instance and isinstance(part, dict) else part)
        if found is None:
            continue
        where, value = found
        what = f"`{arg}` hyper-parameter {where!r}" if instance else f"`{arg}` value {where!r}"
        fix = (
            "Pass plugins and callbacks as {'class_path': ..., 'init_args': ...}."
            if arg == "trainer_kwargs"
            else f"Save YAML-able hyper-parameters (e.g. str() of a path), or pass `{arg}` as a "
            "{'class_path': ..., 'init_args': ...} mapping."
        )
        raise TypeError(
            f"{what} is of type {type(value).__name__} ({value!r}), which a YAML config cannot hold: values must be "
            f"strings, numbers, booleans, None, lists or mappings of them. {fix}"
        )
    return job


def _env(job: dict[str, Any]) -> dict[str, Any]:
    import lightning
    import torch

    import lightning_accel

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or platform.machine()
    # no host name: the nodes of a multi-node job must compute one fingerprint, hence one cache decision and one work
    # folder (the device model, the CPU count and the world size say what the trials measure on)
    return {
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "lightning_accel": lightning_accel.__version__,
        "device": dev,
        "cuda": torch.cuda.is_available(),
        "cpus": os.cpu_count(),
        "world": world_of(job),
    }


def _rank_zero() -> bool:
    """Rank 0, also before the first trial set up the process group: Lightning starts a job's other ranks with
    ``LOCAL_RANK`` / ``NODE_RANK`` set but no ``RANK``."""
    if distributed_ready() or "RANK" in os.environ:
        return global_rank() == 0
    return local_rank() == 0 and node_rank() == 0


def _node_leader() -> bool:
    """The first process of its node (local rank 0): it removes the node's trial folder and stores the cache entry on
    the node's disk, so that a node-local cache answers the next tune of the job as rank 0's does."""
    return local_rank() == 0


def _say(msg: str, verbose: bool) -> None:
    if verbose and _rank_zero():
        print(msg, file=sys.stderr, flush=True)


def _result(name: str, lever: str, option: Option | None, m: TrialMeasure | None, bs_ratio: int = 1) -> TrialResult:
    r = TrialResult(name=name, lever=lever, changes=dict(option.changes) if option else {})
    if m is not None:
        r.step_s = m.step_s / bs_ratio if m.step_s is not None else None
        r.breakdown, r.dominant, r.verdict = m.breakdown, m.dominant, m.verdict
        r.losses, r.peak_mem_bytes, r.seconds, r.error = m.losses, m.peak_mem, m.seconds, m.error
        r.memory_ok = m.error is None or not m.error.startswith("out of memory")
        if m.peak_mem is not None and m.mem_limit is not None:
            r.memory_ok = r.memory_ok and m.peak_mem <= 0.95 * m.mem_limit
    return r


def tune_job(
    job: dict[str, Any],
    *,
    budget: str | float = "5m",
    out: str | os.PathLike[str] | None = "tuned.yaml",
    allow_batch_change: bool = False,
    margin: float = DEFAULT_MARGIN,
    warmup: int = 3,
    steps: int = 12,
    k: int = 16,
    levers: Sequence[str] | None = None,
    skip: Sequence[str] = (),
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
    verbose: bool = True,
    force: bool = False,
) -> TuneResult:
    """Tune ``job`` (a ``lightning-accel fit`` config mapping); see the module docstring for the loop.

    Args:
        job: the job (``trainer``, ``model``, ``data``, ``seed_everything``).
        budget: the whole tune's wall-clock limit: a string with its unit (``"5m"``, ``"90s"``) or a number of seconds.
        out: where ``tuned.yaml`` goes (the reports beside it); None: write nothing.
        allow_batch_change: also try twice the per-device batch with ``LinearScalingLR``.
        margin: the fraction in [0, 1) a lever must beat the best step time by to be kept.
        warmup: untimed steps at the start of each trial (>= 1); ``steps``: timed steps (>= 3).
        k: loss steps compared by the numerics check (>= 1).
        levers: restrict to these levers, names from ``core.LEVERS`` (default: all that apply; one name alone is
            taken as a list of one).
        skip: leave out the options whose name holds one of these words (e.g. ``["compile"]``: no torch.compile; one
            word alone is taken as a list of one).
        cache_dir: the cache (default ``$LIGHTNING_ACCEL_CACHE/tune`` or ``~/.cache/lightning_accel/tune``).
        use_cache: read the cache (results are stored either way).
        verbose: a progress line per trial on stderr (rank 0).
        force: overwrite files at ``out`` and ``tune_report.{json,md,png}`` beside it that ``tune`` did not write.

    The written config keeps the job's own ``seed_everything`` (the trials all run on one pinned seed, 0 unless the
    job gives an integer); a job's ``ckpt_path`` stays in it, but the trials train from the initial weights (the
    baseline's reason in the report says so).

    Raises:
        TypeError / ValueError: an argument out of its range or of another type (a flag that is not a bool, a path
            that is not one), an empty or unknown lever, a lever with nothing to try on ``job`` (``strategy`` on one
            process, ``checkpoint`` on a job that saves none, ``data`` without a data module), a folder for ``out``
            or the cache that cannot be written,
            or (without ``force``) a file at ``out`` or beside it that ``tune`` did not write, or a tune of the same
            job and settings running in the same folder (two would share one trial folder) -- all before any trial
            runs; or ``warmup`` + ``steps`` that the baseline trial's first steps show cannot end within ``budget``
            (raised after those steps, on every rank; nothing written).
        SystemExit: 143 on SIGTERM (a ``kill``, a preemption), after the trial folder was removed; nothing written.
        OSError: the outputs could not be written at the end (a full disk); the result is stored in the cache
            first, so the same tune run again writes them without measuring.
    """
    from lightning_accel._utils.checks import check_bool, check_int, check_number

    # every message names the argument as the caller gave it: the keyword here, the flag under `lightning-accel tune`
    check_int(arg_label("warmup"), warmup, low=1)
    # the step time is a median of >= 2 step periods, and a job that saves has one period (its timed save's) left out
    check_int(
        arg_label("steps"), steps, low=3, fix="A trial times at least 2 steps besides the one of its checkpoint save."
    )
    check_int(arg_label("k"), k, low=1, fix="It is the number of loss steps the numerics check compares.")
    margin = check_number(
        arg_label("margin"), margin, low=0, high=1, high_open=True, fix="Pass a fraction such as 0.03."
    )
    force = check_bool(arg_label("force"), force)
    # a string here ("no", "false") is truthy: it would try the batch lever, skip the cache or print, against the ask
    allow_batch_change = check_bool(arg_label("allow_batch_change"), allow_batch_change)
    use_cache = check_bool(arg_label("use_cache"), use_cache)
    verbose = check_bool(arg_label("verbose"), verbose)
    for name, path in (("out", out), ("cache_dir", cache_dir)):
        if path is not None and not isinstance(path, (str, os.PathLike)):
            example = "the YAML to write, e.g. 'tuned/tuned.yaml'" if name == "out" else "a folder, e.g. 'tune-cache'"
            raise TypeError(
                f"{named_arg(name)} must be a path (str or os.PathLike) or None, got {path!r} ({type(path).__name__}). "
                f"Pass {example}."
            )
        if path is not None and not os.fspath(path).strip():
            # an empty shell variable (`--cache-dir "$CACHE"`): the cache went to the default folder without a word,
            # and an empty `out` was taken for the working folder
            example = "the YAML to write, e.g. 'tuned/tuned.yaml'" if name == "out" else "a folder, e.g. 'tune-cache'"
            if name == "cache_dir":
                example += f", or leave {named_arg(name)} out for the default cache"
            elif not flags_named():
                example += ", or None to write nothing"
            raise ValueError(f"{named_arg(name)} must be a path, got {os.fspath(path)!r}. Pass {example}.")
    levers, skip = _check_levers(levers, skip, allow_batch_change)
    _check_levers_apply(levers, job)
    if out is not None:  # `~` is the home directory, as for `--cache-dir` (`--out=~/x.yaml` reaches us unexpanded)
        _check_out_is_no_folder_name(out)  # before `Path` drops its trailing separator
        out = Path(out).expanduser()
    cache = TuneCache(cache_dir or Path(os.environ.get("LIGHTNING_ACCEL_CACHE", "~/.cache/lightning_accel")) / "tune")
    # only rank 0 writes the outputs: its view of the folders decides, and every rank raises alike
    agree_check(functools.partial(_check_outputs_and_cache, out, force, cache), here=_rank_zero())
    start = time.monotonic()
    seconds = parse_duration(budget)
    user_job = copy.deepcopy(dict(job))  # what the written config starts from (its own seed setting)
    job = copy.deepcopy(user_job)
    if job.get("trainer") is None:
        # `trainer:` with every line under it commented out is YAML's null, which `fit` reads as no setting; the
        # trials and the written config edit a mapping there (an AttributeError on None failed the baseline)
        job["trainer"] = {}
    if job.get("seed_everything") in (None, True, False):
        job["seed_everything"] = 0  # the same seed for every trial: the same init and batches
    settings = {
        "warmup": warmup,
        "steps": steps,
        "k": k,
        "margin": margin,
        "batch": allow_batch_change,
        "levers": list(levers) if levers else None,
        "skip": list(skip),
        "v": _TRIAL_VERSION,
    }
    key = fingerprint({"job": user_job, "settings": settings}, _env(job))
    # rank 0's entry where the ranks can already talk (a job started by torchrun): one hit-or-miss for all of them
    hit = agree(cache.load(key) if use_cache else None)
    res = _from_cache(hit, key, seconds) if hit is not None else None
    if res is not None:
        _say(f"tune: cached result for this job ({cache.path(key)})", verbose)
        res.seconds = time.monotonic() - start
        res.paths = _write_or_explain(res, out, force=force) if out is not None and _rank_zero() else {}
        return res

    base_root = Path(out).resolve().parent if out is not None else Path.cwd()
    work = base_root / f".tune-{key}"  # the same path on every rank; removed at the end (it is ours)
    # before the `try` whose `finally` removes `work`: a tune refused here must not remove the folder of the tune of
    # this job that runs in it
    agree_check(functools.partial(_sweep_and_claim, base_root, work, out), here=_node_leader())
    bud = Budget(seconds)
    trials: list[TrialResult] = []
    # SIGTERM (a `kill`, a scheduler's preemption) stops the tune as Ctrl-C does: its folder removed, no outputs
    with _terminate_cleanly():
        try:
            _say(progress_line(0, 1, bud, "baseline"), verbose)
            # the baseline stops after a few steps when they show that it cannot end within the budget (`--steps`
            # 100000 ran for hours, past any budget, before the first option was even weighed)
            with trial_deadline(bud.left()):
                m = run_trial(job, warmup=warmup, steps=steps, root=work / "t0")
            base = _result("baseline", "baseline", None, m)
            base.decision, base.reason = "baseline", "the job as configured"
            if job.get("ckpt_path"):  # a trial is a short fit from the start: resuming would measure the checkpoint
                base.reason += "; every trial trains from the initial weights, not from the job's `ckpt_path`"
            base = agree(base)  # rank 0's record (its losses are the reference) on every rank
            if base.error is not None and base.error.startswith(OVER_BUDGET):
                raise ValueError(
                    f"{named_arg('steps', steps)} (after {named_arg('warmup', warmup)}) does not fit in "
                    f"{named_arg('budget', budget)}: the baseline trial stopped after 3 steps, "
                    f"{base.error[len(OVER_BUDGET) :]}. Lower {named_arg('steps')} (or {named_arg('warmup')}), or "
                    f"raise {named_arg('budget')}: each option tried needs about two such trials more."
                )
            if base.error is not None:
                # the error may end with its own punctuation ("did you mean 'trainer'?"): no second stop after it
                error = base.error if base.error.endswith((".", "?", "!")) else f"{base.error}."
                raise RuntimeError(f"the baseline trial of the job failed: {error} Check that `fit` runs the config.")
            if not agree(m.conv_weights):  # no convolution weights: a memory-format option cannot change anything
                skip = [*skip, CHANNELS_LAST]
            trials.append(base)
            best_job, best_step = job, float(base.step_s or 0.0)
            slowest = base.seconds
            precision0 = job_precision(job)
            plan = agree(
                lever_order(
                    base.dominant,
                    multi_device=world_of(job) > 1,
                    allow_batch_change=allow_batch_change,
                    has_checkpoints=has_checkpoints(job),
                )
            )
            if levers:
                plan = [lv for lv in plan if lv in levers]
            chosen: dict[str, str] = {}
            # once a kept option changed the sample order (another data module), every later trial runs in that order:
            # compared with the baseline, it needs the same allowance
            best_reorders = False
            planned = sum(len(_options(str(lv), job, skip)) for lv in plan)
            i = 0
            best_ratio = 1  # the best job's per-device batch over the baseline's
            for lever in plan:
                lever_start = best_job
                kept_opts: list[Option] = []
                opts = _options(lever, best_job, skip)
                for opt in opts:
                    i += 1
                    # the slowest trial so far (a loaded machine slows them all), with a 20 % allowance; and the best
                    # job's trial after it
                    est = 1.2 * slowest * (opt.cost + 1) + opt.extra_s
                    if not agree(bud.affords(est)):
                        r = _result(opt.name, lever, opt, None)
                        r.decision = "skipped"
                        r.reason = f"budget: needs ~{est:.0f} s, {bud.left():.0f} s left"
                        trials.append(agree(r))
                        skipped = f"{opt.name}: skipped ({trials[-1].reason})"
                        _say(progress_line(i, max(i, planned), bud, skipped), verbose)
                        continue
                    _say(progress_line(i, max(i, planned), bud, opt.name), verbose)
                    cand = opt.apply(best_job)
                    m = run_trial(_scratch_cache(cand, job, work), warmup=warmup, steps=steps, root=work / f"t{i}")
                    ratio = best_ratio * opt.samples_ratio
                    r = _result(opt.name, lever, opt, m, ratio)
                    num = check_numerics(
                        base.losses,
                        m.losses,
                        job_precision(cand) if m.losses else precision0,
                        k=k,
                        reorders=opt.reorders or best_reorders,
                        samples_ratio=ratio,
                    )
                    r.numerics = asdict(num) if m.error is None else None
                    # the best job again, right after the candidate, when the decision turns on the time (rank 0 says
                    # so: every rank runs the same trials)
                    if agree(m.error is None and r.step_s is not None and num.ok and r.memory_ok):
                        again = run_trial(
                            _scratch_cache(best_job, job, work), warmup=warmup, steps=steps, root=work / f"t{i}-again"
                        )
                        if again.error is None and again.step_s is not None:
                            # the best job's times just before and just after the candidate: the faster of the two,
                            # so that a stall in one of them cannot carry a slower candidate past the margin (their
                            # mean kept a lever 11 % slower than the job after a reference trial took 1.8x its time);
                            # a load that rises across the three trials costs a lever at most a rejection
                            r.ref_step_s = min(best_step, again.step_s / best_ratio)
                            best_step = again.step_s / best_ratio
                            slowest = max(slowest, again.seconds)
                    ref = r.ref_step_s if r.ref_step_s is not None else best_step
                    d = decide(ref, r.step_s, numerics=num, memory_ok=r.memory_ok, margin=margin, error=m.error)
                    r.decision, r.reason = ("kept" if d.keep else "rejected"), d.reason
                    r = agree(r)  # rank 0 decides; every rank follows
                    trials.append(r)
                    slowest = max(slowest, r.seconds)
                    best_step = agree(best_step)
                    if r.decision == "kept":
                        best_job, best_step, best_ratio = cand, float(r.step_s or best_step), ratio
                        best_reorders = best_reorders or opt.reorders
                        kept_opts.append(opt)
                names = _in_effect(lever_start, kept_opts)
                if names:
                    chosen[lever] = ", ".join(names)
        except (_Terminated, KeyboardInterrupt, SIGTERMException):
            # stopped from outside: the signal reached this process alone, and the job's other ranks waited for it in
            # the tune's next collective (they end with it, not on its closed connection)
            stop_other_ranks()
            raise
        finally:
            if _node_leader():  # every node worked in its own `work` (the same path: one folder on a shared disk)
                _remove_scratch(work)
    config = with_guard(best_job)
    if "seed_everything" in user_job:  # the pinned seed was the trials' business: the job's own setting goes back
        config["seed_everything"] = user_job["seed_everything"]
    else:
        config.pop("seed_everything", None)
    res = TuneResult(config, trials, chosen, key, False, time.monotonic() - start, seconds)
    # the outputs first: the cache is a convenience, and a failure to store it must not cost the tune's result
    unwritten: OSError | None = None
    if _rank_zero() and out is not None:
        try:
            res.paths = write_outputs(res, out, force=force)
        except OSError as e:
            # a full disk, a folder removed meanwhile: the measurements still go to the cache below, so that the next
            # tune of this job writes its outputs at once instead of spending its budget on the same trials again
            unwritten = e
    stored = False
    if _node_leader():  # every rank holds rank 0's records (`agree`), so every node stores the same entry
        entry = {"config": config, "trials": [t.to_dict() for t in trials], "chosen": chosen, "budget_s": seconds}
        try:
            cache.store(key, entry)
            stored = True
        except OSError as e:
            warnings.warn(
                f"tune: the result could not be stored in the cache {os.fspath(cache.path(key))!r} ({one_line(e)}); "
                "this tune's result stands, but the next tune of this job measures it again.",
                stacklevel=2,
            )
    if unwritten is not None and out is not None:
        raise _unwritten_error(unwritten, out, cached=stored, reads_cache=use_cache)
    _say(
        f"tune: done in {res.seconds:.0f} s of {seconds:.0f} s; kept: {', '.join(chosen.values()) or 'nothing'}",
        verbose,
    )
    return res


def tune(
    trainer_kwargs: Mapping[str, Any] | None = None,
    model: Any = None,
    datamodule: Any = None,
    *,
    seed: int = 0,
    **kwargs: Any,
) -> TuneResult:
    """Tune a job given the Python way: ``la.tune(trainer_kwargs, model, datamodule, budget="2m")``.

    ``trainer_kwargs`` are ``Trainer`` arguments with YAML-able values (plugins and callbacks as ``class_path``
    mappings); ``model`` / ``datamodule`` are config mappings or instances that saved their hyper-parameters (the
    tuner builds a fresh one per trial). ``kwargs`` go to :func:`tune_job` (``budget``, ``out``, ...). ``seed`` pins
    every trial (what ``seed_everything`` takes: an integer in 0 .. 2**32 - 1) and is the written config's
    ``seed_everything``.

    Raises:
        TypeError / ValueError: ``trainer_kwargs`` that is no mapping, a ``seed`` out of its range or of another type,
            no ``model`` (and what :func:`job_from_objects` and :func:`tune_job` refuse) -- before any trial.
    """
    if model is None:
        raise ValueError("`model` is required: pass the LightningModule (or its class_path mapping).")
    return tune_job(job_from_objects(trainer_kwargs, model, datamodule, seed), **kwargs)


def _check_levers(
    levers: Sequence[str] | str | None, skip: Sequence[str] | str, allow_batch_change: bool
) -> tuple[list[str] | None, list[str]]:
    """``levers`` and ``skip`` as lists of names, checked: a lone string is one name (not its characters), every lever
    is one of ``core.LEVERS``, every skip word a string that is not blank (the empty word is in every option's name,
    and a space in nearly all).

    Raises:
        TypeError: a skip word that is not a string.
        ValueError: an empty ``levers``, an unknown lever, ``batch`` without ``allow_batch_change``, a blank skip word.
    """
    lv = [levers] if isinstance(levers, str) else None if levers is None else list(levers)
    sk = [skip] if isinstance(skip, str) else list(skip)
    if lv is not None and not lv:  # an empty list asks for no lever: not "all of them", which None says
        raise ValueError(
            f"{named_arg('levers')} must name at least one lever from {', '.join(LEVERS)}, got an empty list. Name the "
            f"levers to try, or leave {named_arg('levers')} out (None) to try all that apply."
        )
    for name in lv or []:
        if name not in LEVERS:
            raise ValueError(
                f"{named_arg('levers')} must name levers from {', '.join(LEVERS)}, got {name!r}. Fix the name, or "
                f"leave {named_arg('levers')} out to try all that apply."
            )
    if lv and "batch" in lv and not allow_batch_change:
        raise ValueError(
            f"{named_arg('levers')} names 'batch', which is tried only with "
            f"{named_arg('allow_batch_change', True)}. Allow it, or drop 'batch'."
        )
    for word in sk:
        # a blank word is in every option's name too ("precision: bf16-mixed"): it would leave out every option
        if not isinstance(word, str) or not word.strip():
            kind = TypeError if not isinstance(word, str) else ValueError
            raise kind(
                f"{named_arg('skip')} must hold non-blank words of option names, got {word!r}. Pass e.g. "
                f"{named_arg('skip', ['compile'], 'compile')}."
            )
    return lv, sk


def _check_levers_apply(levers: Sequence[str] | None, job: Mapping[str, Any]) -> None:
    """Refuse a named lever that has nothing to try on ``job`` (the rule of ``core.lever_order``): the tune left it
    out without a word, ran the baseline alone and reported "kept: nothing", as if the lever had been measured.

    Raises:
        ValueError: naming the lever, why it does not apply to this job and the fix.
    """
    j = dict(job)
    t = j.get("trainer") if isinstance(j.get("trainer"), dict) else {}
    why = {
        "strategy": (
            world_of({**j, "trainer": t}) <= 1,
            "is tried on a job of several processes, and this one's `trainer.devices` x `num_nodes` is 1 ('auto' and "
            "-1 count as 1: set the number of devices)",
        ),
        "checkpoint": (
            not has_checkpoints({**j, "trainer": t}),
            "is tried on a job that saves checkpoints, and this one sets `enable_checkpointing: false` without a "
            "ModelCheckpoint",
        ),
        "data": (
            not isinstance(j.get("data"), dict),
            "is tried on a data module given as `class_path:` under `data:`, and this job gives none",
        ),
        "host_memory": (
            not options_for("host_memory", {**j, "trainer": t}),
            "is tried on a job that trains on the CPU (`trainer.accelerator: cpu`, or `auto` without a GPU) under "
            "glibc and has no HostMemoryManager callback yet, and this one does not",
        ),
    }
    for name in levers or []:
        refused, reason = why.get(name, (False, ""))
        if refused:
            raise ValueError(
                f"{named_arg('levers')} names {name!r}, which {reason}: it would try nothing. Drop {name!r}, or "
                f"leave {named_arg('levers')} out to try all that apply."
            )


#: the type each field of a cached trial must have (a float field takes an int too; None where the field allows it)
_TRIAL_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "lever": (str,),
    "changes": (dict,),
    "step_s": (float, int, type(None)),
    "ref_step_s": (float, int, type(None)),
    "breakdown": (dict,),
    "dominant": (str,),
    "verdict": (str,),
    "losses": (list,),
    "numerics": (dict, type(None)),
    "peak_mem_bytes": (int, type(None)),
    "memory_ok": (bool,),
    "decision": (str,),
    "reason": (str,),
    "seconds": (float, int),
    "error": (str, type(None)),
}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _trial_of(entry: Any) -> TrialResult | None:
    """A cached trial, or None when a field is missing, unknown or of another type (the report reads them all)."""
    if not isinstance(entry, dict) or set(entry) - set(_TRIAL_FIELDS) or not {"name", "lever"} <= set(entry):
        return None
    for name, value in entry.items():
        kinds = _TRIAL_FIELDS[name]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            return None
    if not all(_number(v) for v in entry.get("breakdown", {}).values()) or not all(
        _number(v) for v in entry.get("losses", [])
    ):
        return None
    num = entry.get("numerics")
    if num is not None and not (isinstance(num.get("ok"), bool) and _number(num.get("max_rel_gap"))):
        return None
    return TrialResult(**entry)


def _from_cache(hit: Any, key: str, budget_s: float) -> TuneResult | None:
    """The result a cache entry holds, or None when the entry is not one (another version's layout, a hand edit, a
    field of another type): a cache entry that cannot be read is a miss, never an error. An entry whose tune skipped
    options for its budget is a miss too when this tune's budget is larger: it could measure them."""
    if not isinstance(hit, dict):
        return None
    config, chosen, raw = hit.get("config"), hit.get("chosen"), hit.get("trials")
    if not isinstance(config, dict) or not isinstance(chosen, dict) or not isinstance(raw, list) or not raw:
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in chosen.items()):
        return None
    trials = [t for t in map(_trial_of, raw) if t is not None]
    if len(trials) != len(raw):  # a damaged trial: a miss
        return None
    cut = any(t.decision == "skipped" and t.reason.startswith("budget") for t in trials)
    was = hit.get("budget_s")
    if cut and not (isinstance(was, (int, float)) and budget_s <= was):
        return None
    return TuneResult(config, trials, chosen, key, True, 0.0, budget_s)


def _in_effect(start: dict[str, Any], kept: Sequence[Option]) -> list[str]:
    """The names of the ``kept`` options (applied in turn to ``start``) whose edits show in the result: an option a
    later one replaced (``bf16-mixed``, then ``FusedPrecision``) is left out; one the later ones build on
    (``CachedDataModule``, then ``num_workers=0`` on it) stays."""

    def apply(opts: Sequence[Option]) -> dict[str, Any]:
        j = start
        for o in opts:
            j = o.apply(j)
        return j

    final = apply(kept)
    return [o.name for i, o in enumerate(kept) if apply([*kept[:i], *kept[i + 1 :]]) != final]


def _options(lever: str, job: dict[str, Any], skip: Sequence[str]) -> list[Option]:
    return [o for o in options_for(lever, job) if not any(w in o.name for w in skip)]


def with_guard(job: dict[str, Any]) -> dict[str, Any]:
    """``job`` with ``RollbackGuard`` in its callbacks (once)."""
    j = copy.deepcopy(job)
    t = j.setdefault("trainer", {})
    cbs = as_list(t.get("callbacks"))
    # an entry may be a bare class path (`- lightning_accel.callbacks.RollbackGuard`), which `fit` takes too: a second
    # guard beside it is refused by Lightning (two stateful callbacks of one type), so tuned.yaml would not load
    if not any(str(c.get("class_path", "") if isinstance(c, dict) else c).endswith("RollbackGuard") for c in cbs):
        cbs.append({"class_path": GUARD_CLASS_PATH})
    t["callbacks"] = cbs
    return j


def _written_by_tune(path: Path, kind: str) -> bool:
    """Whether the existing file ``path`` (``kind``: a key of :func:`_report_paths`) is one ``tune`` wrote:
    ``tuned.yaml`` and ``tune_report.md`` by their first line, ``tune_report.json`` by its ``written_by`` key (or, from
    before that key, by the exact structure of those reports: :func:`_is_old_report`), ``tune_report.png`` by its
    ``Software`` text chunk (or, from before it, by being the chart those versions drew for the old JSON report beside
    it: matplotlib's text chunk and the size its figure had for that report's trials)."""
    try:
        if kind == "png":
            png = _png_facts(path.read_bytes())
            if png is None:
                return False
            width, height, chunks = png
            if chunks.get("Software") == _REPORT_MARK:
                return True
            if not chunks.get("Software", "").startswith("Matplotlib"):
                return False
            old = _read_json(path.with_suffix(".json"))
            if not _is_old_report(old):
                return False
            # those versions drew a `max(6, 0.7 * trials + 2)` x 4.2 inch figure at 110 dpi
            expected = max(6.0, 0.7 * len(old["trials"]) + 2) * 110
            return abs(width - expected) <= 1 and abs(height - 4.2 * 110) <= 1
        text = path.read_text(errors="replace")
    except OSError:
        return False
    if kind == "json":
        data = _read_json(path)
        return isinstance(data, dict) and (data.get("written_by") == _REPORT_MARK or _is_old_report(data))
    return text.startswith("# tune report (job " if kind == "md" else HEADER)


def _read_json(path: Path) -> Any:
    """The JSON value in the file ``path``, or None where there is none (missing, unreadable, not JSON)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_old_report(data: Any) -> bool:
    """Whether ``data`` has exactly the structure of a JSON report from before the ``written_by`` marker: a user's file
    that only shares some of its keys (``fingerprint``, ``trials``) is not taken for one."""
    if not isinstance(data, dict) or data.keys() != _OLD_REPORT_KEYS:
        return False
    fp, trials = data["fingerprint"], data["trials"]
    return (
        isinstance(fp, str)
        and re.fullmatch(r"[0-9a-f]{16}", fp) is not None
        and isinstance(data["cached"], bool)
        and isinstance(data["chosen"], dict)
        and isinstance(trials, list)
        and len(trials) > 0
        and all(isinstance(t, dict) and t.keys() in _OLD_TRIAL_KEY_SETS for t in trials)
    )


def _png_facts(data: bytes) -> tuple[int, int, dict[str, str]] | None:
    """Width, height and the ``tEXt`` entries of the PNG ``data``, or None if it is not a well-formed PNG."""
    if not data.startswith(_PNG_SIGNATURE):
        return None
    pos, size, text = len(_PNG_SIGNATURE), None, {}
    while pos + 8 <= len(data):
        length, ctype = struct.unpack(">I4s", data[pos : pos + 8])
        if pos + 8 + length > len(data):
            return None
        if ctype == b"IHDR" and length >= 8:
            size = struct.unpack(">II", data[pos + 8 : pos + 16])
        elif ctype == b"tEXt" and b"\0" in (body := data[pos + 8 : pos + 8 + length]):
            key, value = body.split(b"\0", 1)
            text[key.decode("latin-1")] = value.decode("latin-1")
        elif ctype == b"IEND":
            break
        pos += 12 + length  # length, type, body, CRC
    return None if size is None else (size[0], size[1], text)


def _report_owner(path: Path) -> str | None:
    """The file name of the tuned config that the JSON report at ``path`` was written with (beside it), or None: no
    report there, not one of ``tune``'s, or one from before the reports named their config."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("written_by") != _REPORT_MARK:
        return None
    tuned = data.get("tuned")
    return tuned if isinstance(tuned, str) and tuned else None


def _report_paths(out: Path) -> dict[str, Path]:
    stem = out.parent / "tune_report"
    return {"tuned": out, "json": Path(f"{stem}.json"), "md": Path(f"{stem}.md"), "png": Path(f"{stem}.png")}


def _check_out_is_no_folder_name(out: str | os.PathLike[str]) -> None:
    """Refuse an ``out`` that ends with a path separator (``results/``): ``Path`` drops it, and the tuned config was
    written as a file named ``results``, its reports beside it in the folder above.

    Raises:
        ValueError: naming ``out``, with the path of a YAML in that folder as the fix.
    """
    text = os.fspath(out)
    if text.endswith(("/", os.sep)):
        raise ValueError(
            f"{named_arg('out')} {text!r} names a folder. Pass the path of the YAML to write in it, e.g. "
            f"{named_arg('out', text + 'tuned.yaml')}."
        )


def check_outputs(out: str | os.PathLike[str], *, force: bool = False) -> None:
    """Refuse to overwrite, at ``out`` or as ``tune_report.{json,md,png}`` beside it, a file ``tune`` did not write,
    and reports ``tune`` wrote with another tuned config that is still beside them.

    Raises:
        ValueError: ``out`` is a folder (or ends with a path separator), is named as one of those reports, or is in a
            folder that cannot be created or written (a file on its path), or (without ``force``) one of those files
            exists and is not ``tune``'s, or the reports there are those of another tuned config in that folder.
    """
    _check_out_is_no_folder_name(out)
    paths = _report_paths(Path(out).expanduser())
    problem = folder_problem(paths["tuned"].parent)  # the trials' work folder goes beside it too
    if problem is not None:
        raise ValueError(
            f"{named_arg('out')} {os.fspath(out)!r} cannot be written: {problem}. Pass an {named_arg('out')} in a "
            f"folder you can write, e.g. {named_arg('out', 'tuned/tuned.yaml')}."
        )
    if paths["tuned"].is_dir():
        raise ValueError(
            f"{named_arg('out')} {os.fspath(out)!r} is a folder. Pass the path of the YAML to write, e.g. "
            f"{named_arg('out', 'tuned.yaml')}."
        )
    # the reports go beside `out` under fixed names: an `out` of one of them would be overwritten by that report
    clash = next((p.name for k, p in paths.items() if k != "tuned" and p == paths["tuned"]), None)
    if clash is not None:
        raise ValueError(
            f"{named_arg('out')} {os.fspath(out)!r} is named as the report {clash!r} that `tune` writes beside it, "
            f"which would replace the tuned config. Pass another name, e.g. {named_arg('out', 'tuned.yaml')}."
        )
    if force:
        return
    other = _report_owner(paths["json"])
    if other is not None and other != paths["tuned"].name:
        config = paths["tuned"].parent / other
        if config.is_file() and _written_by_tune(config, "tuned"):
            raise ValueError(
                f"the report {os.fspath(paths['json'])!r} beside {named_arg('out')} is the report of the tuned config "
                f"{os.fspath(config)!r} there, not of {named_arg('out')} {os.fspath(out)!r}: refusing to overwrite it. "
                f"Pass an {named_arg('out')} in another folder, or {named_arg('force', True)} to overwrite it."
            )
    for name, path in paths.items():
        if path.exists() and not _written_by_tune(path, name):
            what = (
                f"{named_arg('out')} {os.fspath(out)!r}"
                if name == "tuned"
                else f"the report {os.fspath(path)!r} beside {named_arg('out')}"
            )
            raise ValueError(
                f"{what} is a file `lightning-accel tune` did not write (no {HEADER!r} line / report marker): "
                f"refusing to overwrite it. Pass another {named_arg('out')}, or {named_arg('force', True)} to "
                "overwrite it."
            )


def write_outputs(res: TuneResult, out: str | os.PathLike[str], *, force: bool = False) -> dict[str, str]:
    """Write ``tuned.yaml`` at ``out`` and ``tune_report.{json,md,png}`` beside it; returns the paths.

    Each file is replaced atomically. When ``out`` is a symbolic link, the file it points to is replaced (the link
    stays as it is); the reports still go beside ``out``.

    Raises:
        ValueError: (without ``force``) a file there that ``tune`` did not write (:func:`check_outputs`).
    """
    import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

    from lightning_accel._utils.atomic import atomic_write_bytes, atomic_write_text

    check_outputs(out, force=force)
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = ", ".join(res.chosen.values()) or "nothing"
    head = f"{HEADER} (job {res.fingerprint}); kept: {kept}\n"
    tuned = head + yaml.safe_dump(res.config, sort_keys=False)
    stem = out.parent / "tune_report"
    summary = {
        "written_by": _REPORT_MARK,
        # the config these reports belong to: a tune with another `out` in this folder does not replace them
        "tuned": out.name,
        "fingerprint": res.fingerprint,
        "cached": res.cached,
        "seconds": res.seconds,
        "budget_s": res.budget_s,
        "chosen": res.chosen,
        "trials": [t.to_dict() for t in res.trials],
    }
    report = json.dumps(summary, indent=1, default=repr)
    table, png = report_markdown(res), report_png(res.trials)
    paths = {"tuned": str(out), "json": f"{stem}.json", "md": f"{stem}.md"}
    # a link at `out` (to the tuned config of an earlier tune, kept elsewhere) is written through: the rename of an
    # atomic write replaced the link itself with a regular file, and the file it pointed to kept the old config
    target = Path(os.path.realpath(out)) if out.is_symlink() else out
    # one set: a Ctrl-C or SIGTERM between two files left a new tuned.yaml beside the reports of an older tune
    with _signals_deferred():
        atomic_write_text(target, tuned)
        atomic_write_text(paths["json"], report)
        atomic_write_text(paths["md"], table)
        if png is not None:
            atomic_write_bytes(f"{stem}.png", png)
            paths["png"] = f"{stem}.png"
    return paths


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Within it, SIGINT and SIGTERM are held and delivered as it ends (to the handler each would have met), so that
    what it writes is written whole: the outputs of one tune are four files, and ``atomic_write_*`` makes each one
    whole, not the four. Held by a Python handler of its own, not by a signal mask: a mask holds a signal for one
    thread only, and the process's other threads (torch's, matplotlib's) took it and let Python raise it at once.
    Only in the main thread (where Python sets handlers), and over handlers Python knows (not one set from C)."""
    kinds = (signal.SIGINT, signal.SIGTERM)
    before = {k: signal.getsignal(k) for k in kinds}
    if threading.current_thread() is not threading.main_thread() or any(h is None for h in before.values()):
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        held.append(signum)

    for k in kinds:
        signal.signal(k, hold)
    try:
        yield
    finally:
        for k, handler in before.items():
            signal.signal(k, handler)
        if held:
            signal.raise_signal(held[0])  # a Ctrl-C raises KeyboardInterrupt here; a SIGTERM meets its own handler


def _unwritten_error(error: OSError, out: str | os.PathLike[str], *, cached: bool, reads_cache: bool) -> OSError:
    """The one-line error for outputs that could not be written at ``out`` (``error``: the write's own), naming the
    argument, the cause and the fix; ``cached``: the tune's result is in the cache, so a second run writes it at once
    (``reads_cache``: this run read the cache; one that did not says how the next one does).
    """
    if not cached:
        again = "; the result could not be cached either: the next tune measures it again"
    else:
        # `--no-cache` (use_cache=False) only skips reading: the same command again would measure again
        how = "" if reads_cache else " without `--no-cache`" if flags_named() else " with `use_cache=True`"
        again = f"; the result is cached: run the same tune again{how} to write it without measuring"
    return OSError(
        f"{named_arg('out')} {os.fspath(out)!r}: the tuned config and its reports could not be written "
        f"({one_line(error)}). Free space in its folder or pass another {named_arg('out')}{again}."
    )


def _write_or_explain(res: TuneResult, out: str | os.PathLike[str], *, force: bool = False) -> dict[str, str]:
    """:func:`write_outputs` of a result read from the cache, with an ``OSError`` of the write (a full disk) as
    :func:`_unwritten_error`'s one line."""
    try:
        return write_outputs(res, out, force=force)
    except OSError as e:
        raise _unwritten_error(e, out, cached=True, reads_cache=True) from e


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def report_markdown(res: TuneResult) -> str:
    """The report as a markdown table: one row per trial."""
    lines = [
        f"# tune report (job {res.fingerprint})",
        "",
        f"{res.seconds:.0f} s of a {res.budget_s:.0f} s budget{' (cached)' if res.cached else ''}; "
        f"kept: {', '.join(res.chosen.values()) or 'nothing'}.",
        "",
        "| trial | step ms | compared with ms | data ms | compute ms | comm ms | ckpt ms | numerics | memory MB "
        "| decision | reason |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in res.trials:
        b = t.breakdown
        num = (
            "-"
            if t.numerics is None
            else f"{'ok' if t.numerics['ok'] else 'FAIL'} {100 * t.numerics['max_rel_gap']:.2f} %"
        )
        mem = "-" if t.peak_mem_bytes is None else f"{t.peak_mem_bytes / 2**20:.0f}"
        lines.append(
            f"| {t.name} | {_ms(t.step_s)} | {_ms(t.ref_step_s)} | {_ms(b.get('data'))} | {_ms(b.get('compute'))} | "
            f"{_ms(b.get('comm'))} | {_ms(b.get('checkpoint'))} | {num} | {mem} | {t.decision} | {t.reason} |"
        )
    if res.trials and res.trials[0].verdict:
        lines += ["", f"Baseline verdict [{res.trials[0].dominant}]: {res.trials[0].verdict}"]
    return "\n".join(lines) + "\n"


def report_png(trials: Sequence[TrialResult]) -> bytes | None:
    """One bar per trial (step time; colour = decision), or None without matplotlib."""
    from lightning_accel._utils.imports import module_available

    if not module_available("matplotlib"):
        return None
    import io

    # drawn on its own Agg canvas: `matplotlib.use("Agg")` would switch the whole process (a notebook's inline
    # figures stop showing after the tune)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colours = {"baseline": "#777777", "kept": "#2a9d3f", "rejected": "#d1495b", "skipped": "#cccccc"}
    fig = Figure(figsize=(max(6.0, 0.7 * len(trials) + 2), 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ys = [1000 * (t.step_s or 0.0) for t in trials]
    ax.bar(range(len(trials)), ys, color=[colours.get(t.decision, "#999999") for t in trials])
    ax.set_xticks(
        range(len(trials)), [t.name.replace(": ", ":\n", 1) for t in trials], rotation=35, ha="right", fontsize=7
    )
    ax.set_ylabel("ms per step (normalised)")
    ax.set_title("tune: one bar per trial (grey baseline, green kept, red rejected)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": _REPORT_MARK})  # marks it as tune's own
    return buf.getvalue()


def exhaustive(
    job: dict[str, Any],
    levers: Sequence[str],
    *,
    warmup: int = 3,
    steps: int = 12,
    rounds: int = 2,
    k: int = 16,
    skip: Sequence[str] = (),
    extra: Mapping[str, dict[str, Any]] | None = None,
    root: str | os.PathLike[str],
) -> list[dict[str, Any]]:
    """Every combination of the levers' options (each lever also "as configured"), each measured ``rounds`` times in
    alternating order (forward, then backward); the reference the tuner's one-lever-at-a-time choice is compared with.
    A row's time is its fastest round: on a shared machine other load only ever slows a round down.

    ``extra`` adds named whole configs to the same alternation (e.g. the tuner's choice, which can combine two options
    of one lever); an extra equal to one of the combinations is not measured again but given that row's times
    (``same_as`` names it): two trials of one config differ by run-to-run noise alone. Returns one row per
    combination, then one per extra: ``{"names": [...], "step_s": fastest,
    "runs": [...], "numerics_ok": ..., "error": ...}`` (step times normalised per baseline batch, as the tuner's).

    The trials run in a folder ``.tune-grid-<hash>`` that the grid makes under ``root``, claims as a tune claims its
    own (an owner file: a second grid of the same job in ``root`` while this one runs is refused with a
    ``ValueError``; a folder a killed grid left is taken over, and one of a killed grid of another job is removed),
    and removes at the end, also when interrupted; ``root`` itself and anything else in it are left alone (``root``
    is removed only when the grid created it and it is empty at the end).

    Raises:
        ValueError: (before any trial) ``rounds``, ``warmup`` or ``k`` below 1, ``steps`` below 3, a ``root`` that
            cannot be created or written, or a grid of the same job running in ``root``.
        TypeError: one of those counts is not an integer.
    """
    from lightning_accel._utils.checks import check_int

    # before any trial: `rounds=0` measured nothing and returned rows without a time, and a `root` that is a file
    # failed with a bare NotADirectoryError
    check_int(arg_label("rounds"), rounds, low=1)
    check_int(arg_label("warmup"), warmup, low=1)
    check_int(arg_label("steps"), steps, low=3, fix="A trial times at least 2 steps besides the one of its save.")
    check_int(arg_label("k"), k, low=1, fix="It is the number of loss steps the numerics check compares.")
    problem = folder_problem(root)
    if problem is not None:
        raise ValueError(
            f"{named_arg('root')} {os.fspath(root)!r} cannot hold the grid's trial folder: {problem}. Pass a folder "
            f"you can write, e.g. {named_arg('root', 'grid')}."
        )
    job = copy.deepcopy(dict(job))
    if job.get("trainer") is None:  # `trainer:` with nothing under it (see `tune_job`)
        job["trainer"] = {}
    if job.get("seed_everything") in (None, True, False):
        job["seed_everything"] = 0
    per: list[list[Option | None]] = [[None, *_options(lv, job, skip)] for lv in levers]
    combos: list[tuple[Option | None, ...]] = list(itertools.product(*per))
    rows: list[dict[str, Any]] = [
        {"names": [o.name for o in c if o], "runs": [], "error": None, "losses": None} for c in combos
    ]
    extras = list((extra or {}).items())
    rows += [{"names": [name], "runs": [], "error": None, "losses": None, "extra": True} for name, _ in extras]
    # every row's job and its batch over the baseline's, built once
    built: list[tuple[dict[str, Any], int]] = []
    for c in combos:
        cand, ratio = job, 1
        for o in c:
            if o is not None:
                cand, ratio = o.apply(cand), ratio * o.samples_ratio
        built.append((cand, ratio))
    configs = [cfg for cfg, _ in built]
    twin = {len(combos) + i: configs.index(cfg) for i, (_, cfg) in enumerate(extras) if cfg in configs}
    built += [(cfg, _batch_ratio(job, cfg)) for _, cfg in extras]
    order = [i for i in range(len(rows)) if i not in twin]
    # the trials work in a folder of the grid's own under `root` (which may be the user's project: removing `root`
    # itself took every file in it); its name comes from the grid, so every process of a multi-device job uses the
    # same one, and a folder of that name left by an interrupted run of the same grid is the grid's too
    grid_root = Path(root).expanduser()
    made_root = not grid_root.exists()
    grid = json.dumps({"job": job, "levers": list(levers), "skip": list(skip)}, sort_keys=True, default=repr)
    work = grid_root / f".tune-grid-{hashlib.sha1(grid.encode()).hexdigest()[:12]}"
    # claimed before the `try` whose `finally` removes `work`: a grid refused here must not remove the folder of the
    # grid of this job that runs in it (both used one folder, and the first to end deleted the other's live trials)
    agree_check(functools.partial(_sweep_and_claim, grid_root, work, None, grid=True), here=_node_leader())
    try:
        for r in range(rounds):
            for idx in order if r % 2 == 0 else reversed(order):
                cand, ratio = built[idx]
                m = run_trial(_scratch_cache(cand, job, work), warmup=warmup, steps=steps, root=work / f"g{idx}")
                if m.error is not None or m.step_s is None:
                    rows[idx]["error"] = m.error
                else:
                    rows[idx]["runs"].append(m.step_s / ratio)
                    rows[idx]["losses"] = rows[idx]["losses"] or m.losses
                    rows[idx]["precision"], rows[idx]["ratio"] = job_precision(cand), ratio
    finally:
        if _node_leader():  # every node claimed and worked in its own `work`, as a tune's (see `tune_job`)
            _remove_scratch(work)
            if made_root:  # `root` was made for the grid: it goes too, unless something else was put in it since
                with contextlib.suppress(OSError):
                    grid_root.rmdir()
    for idx, same in twin.items():
        src = rows[same]
        rows[idx].update({k: src[k] for k in ("runs", "error", "losses", "precision", "ratio") if k in src})
        rows[idx]["same_as"] = src["names"] or ["as configured"]
    base = rows[0]["losses"] or []
    for i, row in enumerate(rows):
        combo = combos[i] if i < len(combos) else ()
        row["step_s"] = min(row["runs"]) if row["runs"] and not row["error"] else None
        if row["step_s"] is not None:  # the grid's best is the best the tuner could have kept: numerics must pass
            reorders = any(o is not None and o.reorders for o in combo) or (
                i >= len(combos) and _class_of(extras[i - len(combos)][1]) != _class_of(job)
            )
            num = check_numerics(
                base, row["losses"], row["precision"], k=k, reorders=reorders, samples_ratio=row["ratio"]
            )
            row["numerics_ok"], row["numerics"] = num.ok, num.reason
        row.pop("losses")
    return rows


def _scratch_ram(work: Path) -> str | None:
    """The RAM-tier folder of the data caches the trials under ``work`` build (None: no tmpfs, no RAM tier)."""
    from lightning_accel.data.tiers import default_ram_dir

    return default_ram_dir("tune-" + hashlib.sha1(os.fspath(work.absolute()).encode()).hexdigest()[:12])


def _scratch_cache(trial: dict[str, Any], job: dict[str, Any], work: Path) -> dict[str, Any]:
    """``trial`` as it runs under ``work``: a ``CachedDataModule`` the data lever put in place of ``job``'s own data
    module, with no ``cache_dir`` of its own, caches into ``work`` (and a RAM tier of the tune's, see
    :func:`_scratch_ram`), which the tune removes at its end. By default it would fill ``.cache/lightning_accel`` in
    the working folder and a RAM tier in ``/dev/shm`` with the decoded data set, left behind after the tune whether
    the lever was kept or not. The config written keeps the module's defaults; a job whose own data module is a
    ``CachedDataModule`` trains on the cache it names, as ``fit`` would."""
    data = trial.get("data")
    if not _class_of(trial).endswith("CachedDataModule") or _class_of(job).endswith("CachedDataModule"):
        return trial
    init = dict((data or {}).get("init_args") or {})
    if "cache_dir" in init:
        return trial
    init["cache_dir"] = os.fspath(work.absolute() / "data-cache")
    ram = _scratch_ram(work)
    if ram is not None and "ram_dir" not in init:
        init["ram_dir"] = ram
    return {**trial, "data": {**(data or {}), "init_args": init}}


def _remove_scratch(work: Path) -> None:
    """Remove the trials' folder ``work`` and the RAM tier of their data caches (:func:`_scratch_cache`)."""
    shutil.rmtree(work, ignore_errors=True)
    ram = _scratch_ram(work)
    if ram is not None:
        shutil.rmtree(ram, ignore_errors=True)


class _Terminated(BaseException):
    """SIGTERM during a tune. A ``BaseException``: no ``except Exception`` on the way (a callback's, a trial's) takes
    it for a failure and goes on."""


@contextlib.contextmanager
def _terminate_cleanly() -> Iterator[None]:
    """Within it, SIGTERM raises :class:`_Terminated` where the tune is (between trials too, where its default action
    killed the process and left the trial folder behind), and leaves it as ``SystemExit(143)``, the exit status of a
    process SIGTERM ended, after the ``finally`` blocks inside ran. Installed only in the main thread and over the
    default action (a handler of the caller's own stays). Inside a trial, Lightning calls this handler after its
    own."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        raise _Terminated

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except _Terminated:
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


#: a tune's trial folder beside ``out`` (``.tune-<fingerprint>``) and an exhaustive grid's under its ``root``
#: (``.tune-grid-<hash>``): the only folders the sweep of dead tunes removes
_WORK_NAME = re.compile(r"\.tune-(?:[0-9a-f]{16}|grid-[0-9a-f]{12})")
#: the marker in an owner file (see :func:`_claim_work`)
_OWNER_MARK = "lightning-accel tune"


def _owner_path(work: Path) -> Path:
    """The file naming the tune that works in ``work`` on this node (the folder of a multi-node job on a shared disk
    is one: each node's first process claims it with a file of its own)."""
    return work / f"owner-node{node_rank()}.json"


def _owner_alive(owner: Mapping[str, Any]) -> bool:
    """Whether the tune an owner file names still runs. One on another host is taken as running (this one cannot
    tell)."""
    if owner.get("host") != platform.node():
        return True
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if not process_running(pid):
        return False
    start = process_start(pid)
    return start is None or owner.get("start") in (None, start)


def _read_owner(path: Path) -> dict[str, Any] | None:
    """The owner file at ``path`` (a mapping with the marker), or None: none there, or not one ``tune`` wrote."""
    try:
        owner = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and owner.get("written_by") == _OWNER_MARK else None


def _check_outputs_and_cache(out: Path | None, force: bool, cache: TuneCache) -> str | None:
    """Rank 0's refusal of the outputs or the cache folder (None: both usable)."""
    try:
        if out is not None:
            check_outputs(out, force=force)
        cache.check()  # results are stored either way (`use_cache` only reads)
    except ValueError as e:
        return str(e)
    return None


def _sweep_and_claim(root: Path, work: Path, out: str | os.PathLike[str] | None, *, grid: bool = False) -> str | None:
    """A node leader's part before the trials: remove what dead tunes left under ``root``, then claim ``work``."""
    _sweep_dead_work(root)
    return _claim_work(work, out, grid=grid)


def _claim_work(work: Path, out: str | os.PathLike[str] | None, *, grid: bool = False) -> str | None:
    """Make ``work`` this tune's trial folder on this node, or say in one line why not (a running tune of the same job
    works in it; ``grid``: the folder of an :func:`exhaustive` grid, made under its ``root``). A folder a dead tune
    left (killed: no ``finally`` ran) is removed first. The claim is an owner file (this process's host, pid and start
    time) linked into place: of two tunes that start at once, one gets it."""
    owner_path = _owner_path(work)
    me = {"written_by": _OWNER_MARK, "host": platform.node(), "pid": os.getpid(), "start": process_start(os.getpid())}
    for _ in range(2):  # a second time after removing what a dead tune left
        work.mkdir(parents=True, exist_ok=True)
        tmp = work / f".owner-{os.getpid()}-{time.monotonic_ns()}.tmp"
        tmp.write_text(json.dumps(me))
        try:
            os.link(tmp, owner_path)  # fails when the file is there: never replaces another tune's claim
            return None
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        owner = _read_owner(owner_path)
        if owner is not None and not _owner_alive(owner):
            _remove_scratch(work)
            continue
        who = "" if owner is None else f" (pid {owner.get('pid')} on {owner.get('host')})"
        if grid:
            return (
                f"another exhaustive grid of this job{who} is running in {os.fspath(work)!r} under "
                f"{named_arg('root')}: two grids of one job in one folder would delete each other's trials. Wait for "
                f"it to end, or pass a {named_arg('root')} in another folder."
            )
        where = named_arg("out") if out is not None else "the working folder"
        return (
            f"another `lightning-accel tune` of this job{who} is running in {os.fspath(work)!r} beside {where}: two "
            f"tunes of one job in one folder would overwrite each other's trials. Wait for it to end, or pass an "
            f"{named_arg('out')} in another folder."
        )
    return f"the trial folder {os.fspath(work)!r} could not be claimed. Remove it, or pass another {named_arg('out')}."


def _sweep_dead_work(root: Path) -> None:
    """Remove the trial folders under ``root`` that tunes which died (SIGKILL, a lost node) left: only folders named
    ``.tune-<fingerprint>`` that hold owner files, all of tunes no longer running on this host; anything else there
    (a folder of the user's, one with a running owner or one of another host) is left alone."""
    try:
        entries = [p for p in root.iterdir() if _WORK_NAME.fullmatch(p.name) and p.is_dir()]
    except OSError:
        return
    for work in entries:
        try:
            owners = [_read_owner(p) for p in work.glob("owner-node*.json")]
        except OSError:
            continue
        if owners and all(o is not None and not _owner_alive(o) for o in owners):
            _remove_scratch(work)


def _class_of(job: dict[str, Any]) -> str:
    data = job.get("data")
    return str(data.get("class_path", "")) if isinstance(data, dict) else ""


def _batch_ratio(job: dict[str, Any], other: dict[str, Any]) -> int:
    """``other``'s per-device batch over ``job``'s (1 when either is not set in the config)."""
    a = ((job.get("data") or {}).get("init_args") or {}).get("batch_size")
    b = ((other.get("data") or {}).get("init_args") or {}).get("batch_size")
    return max(1, int(b) // int(a)) if isinstance(a, int) and isinstance(b, int) and a > 0 else 1
