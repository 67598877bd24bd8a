"""The functional core of ``lightning-accel tune``: plain Python, no Lightning, no torch.

Everything the tuner *decides* lives here so that it can be tested with injected timings and losses:

* :func:`tolerance` / :func:`check_numerics` -- whether a trial's loss trajectory matches the baseline's;
* :func:`decide` -- whether a trial's lever is kept (faster by the margin, numerics pass, memory fits);
* :func:`lever_order` -- which lever is tried first, from the baseline's bottleneck verdict;
* :func:`fingerprint` and :class:`TuneCache` -- a second tune of the same job is a cache read;
* :class:`Budget` and :func:`parse_duration` -- the whole tune stays within its ``budget``;
* :class:`TrialResult` -- one row of the report.

The numerics rule (documented in ``docs/tune.md``): each trial runs on the baseline's seed and batches. Over the first
``K`` timed steps the *cumulative mean* of the loss is compared step by step with the baseline's (the running mean
smooths out single-batch noise and still catches drift that grows); the largest relative gap must stay within
:func:`tolerance` of the trial's precision. A lever that changes which samples a step sees (a data module swapped for
another, whose shuffling differs) gets :data:`ORDER_ALLOWANCE` more; a larger batch is compared at equal samples seen.
Any NaN/inf fails.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_MARGIN",
    "LEVERS",
    "ORDER_ALLOWANCE",
    "TOLERANCES",
    "Budget",
    "Decision",
    "Numerics",
    "TrialResult",
    "TuneCache",
    "arg_label",
    "canonical_precision",
    "check_numerics",
    "decide",
    "fingerprint",
    "flags_named",
    "folder_problem",
    "lever_order",
    "named_arg",
    "named_as_flags",
    "parse_duration",
    "progress_line",
    "tolerance",
]

#: Largest relative gap of the loss's cumulative mean against the baseline, by the trial's precision. fp32 on the
#: same batches differs only by summation order (< 1e-4 here) and by levers that change the gradient (1-bit
#: compression with error feedback drifts by ~1 % in the first 20 steps of TinyGPT); bf16/fp16 autocast rounds
#: activations to 8/11 mantissa bits (2-4 % on the digits CNN in 10 steps); true half precision also rounds weights.
TOLERANCES: dict[str, float] = {
    "64-true": 0.02,
    "32-true": 0.02,
    "bf16-mixed": 0.05,
    "16-mixed": 0.05,
    "bf16-true": 0.10,
    "16-true": 0.10,
}
#: Added to the tolerance when a lever changes the order in which samples are seen (another data module).
ORDER_ALLOWANCE = 0.05
#: A lever is kept when its step time is below ``(1 - margin)`` of the best so far: 3 % is above the run-to-run noise
#: of a 20-step trial on an idle machine (1-2 % here) and below every lever's win worth keeping.
DEFAULT_MARGIN = 0.03
#: The levers, in the order tried when the verdict names none of them.
LEVERS = ("data", "precision", "host_memory", "strategy", "checkpoint", "batch")
_FIRST = {"data": "data", "compute": "precision", "comm": "strategy", "checkpoint": "checkpoint"}

_PRECISION_ALIASES = {
    "32": "32-true",
    "32-true": "32-true",
    "64": "64-true",
    "64-true": "64-true",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "16": "16-mixed",
    "16-mixed": "16-mixed",
    "bf16-true": "bf16-true",
    "16-true": "16-true",
}


def canonical_precision(precision: Any) -> str:
    """Lightning's full spelling of a precision setting (``32`` and ``"32"`` -> ``"32-true"``, ``"bf16"`` ->
    ``"bf16-mixed"``, ...): two spellings of one setting compare equal. Anything else comes back as ``str()``."""
    return _PRECISION_ALIASES.get(str(precision), str(precision))


def tolerance(precision: str, *, reorders: bool = False) -> float:
    """The numerics tolerance for a trial running at ``precision`` (Lightning's spelling; aliases accepted).

    Raises:
        ValueError: an unknown precision string.
    """
    key = _PRECISION_ALIASES.get(str(precision))
    if key is None:
        raise ValueError(
            f"`precision` must be one of {sorted(_PRECISION_ALIASES)}, got {precision!r}. Pass Lightning's precision "
            "string of the trial."
        )
    return TOLERANCES[key] + (ORDER_ALLOWANCE if reorders else 0.0)


@dataclass
class Numerics:
    """The numerics check's verdict: ``ok``, the largest relative gap, the tolerance, and why in words."""

    ok: bool
    max_rel_gap: float
    tol: float
    steps: int
    reason: str


def _cummean(xs: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        out.append(total / (i + 1))
    return out


def check_numerics(
    baseline: Sequence[float],
    losses: Sequence[float],
    precision: str,
    *,
    k: int = 16,
    reorders: bool = False,
    samples_ratio: int = 1,
) -> Numerics:
    """Compare a trial's per-step losses with the baseline's on the same seed and batches.

    Args:
        baseline: the baseline trial's per-step training losses (from the first step).
        losses: the trial's per-step losses.
        precision: the trial's precision (picks the tolerance, :func:`tolerance`).
        k: compare the first ``k`` trial steps (fewer when either run has fewer).
        reorders: the trial sees samples in another order (adds :data:`ORDER_ALLOWANCE`).
        samples_ratio: the trial's batch over the baseline's (a larger batch: trial step ``i`` is compared with the
            mean of baseline steps ``i*r .. i*r + r - 1``, i.e. at equal samples seen).
    """
    tol = tolerance(precision, reorders=reorders)
    if any(not math.isfinite(x) for x in losses):
        bad = next(i for i, x in enumerate(losses) if not math.isfinite(x))
        return Numerics(False, math.inf, tol, len(losses), f"loss is {losses[bad]} at step {bad}")
    if samples_ratio < 1:
        raise ValueError(f"`samples_ratio` must be >= 1, got {samples_ratio}. Pass trial batch // baseline batch.")
    base = [
        sum(baseline[i * samples_ratio : (i + 1) * samples_ratio]) / samples_ratio
        for i in range(len(baseline) // samples_ratio)
    ]
    n = min(k, len(base), len(losses))
    if n == 0:
        return Numerics(False, math.inf, tol, 0, "no steps to compare (the trial or the baseline recorded no loss)")
    a, b = _cummean(base[:n]), _cummean(list(losses[:n]))
    gaps = [abs(y - x) / max(abs(x), 1e-8) for x, y in zip(a, b, strict=True)]
    worst = max(range(n), key=lambda i: gaps[i])
    gap = gaps[worst]
    if gap <= tol:
        return Numerics(True, gap, tol, n, f"loss within {100 * gap:.2f} % of the baseline (tolerance {100 * tol:g} %)")
    return Numerics(
        False,
        gap,
        tol,
        n,
        f"loss drifts {100 * gap:.2f} % from the baseline at step {worst} (tolerance {100 * tol:g} % at {precision})",
    )


@dataclass
class Decision:
    """Whether a trial's lever is kept, and the reason in one line."""

    keep: bool
    reason: str


def decide(
    best_step_s: float,
    step_s: float | None,
    *,
    numerics: Numerics | None,
    memory_ok: bool,
    margin: float = DEFAULT_MARGIN,
    error: str | None = None,
) -> Decision:
    """The decision rule: keep a lever only if it is faster than the best so far by ``margin`` *and* its numerics
    pass *and* its memory fits (a failed trial is never kept).

    Args:
        best_step_s: the current best (normalised) step time.
        step_s: the trial's (normalised) step time, None when it did not run to the end.
        numerics: the trial's numerics check (None when it did not run).
        memory_ok: its peak memory fitted the device.
        margin: the fraction the trial must beat ``best_step_s`` by.
        error: the one-line error when the trial failed.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"`margin` must be in [0, 1), got {margin}. Pass a fraction such as 0.03.")
    if error is not None or step_s is None:
        return Decision(False, f"trial failed: {error or 'no step time'}")
    if not memory_ok:
        return Decision(False, "memory does not fit the device")
    if numerics is None or not numerics.ok:
        return Decision(False, f"numerics: {numerics.reason if numerics else 'not checked'}")
    need = best_step_s * (1 - margin)
    gain = 1 - step_s / best_step_s if best_step_s > 0 else 0.0
    if step_s <= need:
        return Decision(True, f"{100 * gain:.1f} % faster than the best so far (margin {100 * margin:g} %)")
    if abs(gain) < 0.0005:  # "0.0 % faster" or "-0.0 % slower" read as a fault
        return Decision(False, f"as fast as the best so far (needs {100 * margin:g} % faster)")
    if gain > 0:
        return Decision(False, f"only {100 * gain:.1f} % faster (needs {100 * margin:g} %)")
    return Decision(False, f"{100 * -gain:.1f} % slower than the best so far")


def lever_order(dominant: str, *, multi_device: bool, allow_batch_change: bool, has_checkpoints: bool) -> list[str]:
    """The levers to try, the one the verdict points to first (``data`` -> data, ``compute`` -> precision,
    ``comm`` -> strategy, ``checkpoint`` -> checkpoint IO); the rest in :data:`LEVERS` order. Strategy only on a
    multi-device job, checkpoint IO only when the job saves, the batch lever only when allowed."""
    applies = {"strategy": multi_device, "checkpoint": has_checkpoints, "batch": allow_batch_change}
    levers = [lv for lv in LEVERS if applies.get(lv, True)]
    first = _FIRST.get(dominant)
    if first in levers and first != "batch":
        levers.remove(first)
        levers.insert(0, first)
    return levers


def fingerprint(job: Mapping[str, Any], env: Mapping[str, Any]) -> str:
    """A stable 16-hex-digit hash of the job (its config as a mapping) and the environment it is tuned on (device,
    world size, versions): two tunes with the same fingerprint would measure the same thing."""
    blob = json.dumps({"job": job, "env": env}, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class TuneCache:
    """Tune results keyed by :func:`fingerprint`, one JSON file each under ``directory``.

    ``load`` returns None for a missing or unreadable entry (a damaged file is a cache miss, not an error).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).expanduser()

    def path(self, key: str) -> Path:
        """Where the entry ``key`` lives."""
        if not re.fullmatch(r"[0-9a-f]{16}", key):
            raise ValueError(f"`key` must be a fingerprint (16 hex digits), got {key!r}. Pass `fingerprint(...)`.")
        return self.directory / f"{key}.json"

    def check(self) -> None:
        """Refuse, in one line, a cache directory that cannot be created or written (checked before any trial: a
        tune must not find out after all its trials ran).

        Raises:
            ValueError: a file on its path, or the nearest existing folder on it is not writable.
        """
        problem = folder_problem(self.directory)
        if problem is not None:
            raise ValueError(
                f"{named_arg('cache_dir')} {os.fspath(self.directory)!r} cannot hold the tune cache: {problem}. Pass a "
                f"folder you can write as {named_arg('cache_dir')}."
            )

    def load(self, key: str) -> dict[str, Any] | None:
        """The stored result of ``key``, or None."""
        try:
            data = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def store(self, key: str, result: Mapping[str, Any]) -> Path:
        """Write ``result`` for ``key`` atomically (tmp + rename); returns the file."""
        from lightning_accel._utils.atomic import atomic_write_text

        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(result, indent=1, default=repr))
        return path


def folder_problem(folder: str | os.PathLike[str]) -> str | None:
    """Why ``folder`` cannot be created or written, in words (None: it can): the nearest path on it that exists is a
    file, or a folder this process cannot write."""
    p = Path(folder).expanduser().absolute()
    try:
        while not p.exists() and p != p.parent:
            p = p.parent
        if not p.is_dir():
            return f"{os.fspath(p)!r} is a file, not a folder"
    except OSError as e:  # a folder on the way that cannot be searched
        return f"{os.fspath(p)!r} cannot be read ({e.strerror or e})"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"the folder {os.fspath(p)!r} is not writable"
    return None


# True while the `lightning-accel tune` command runs the tune: its messages then name the command's flags. A Python
# caller of `tune(...)` / `tune_job(...)` gave keyword arguments: a flag it never typed would send it looking in vain.
_NAMED_AS_FLAGS: ContextVar[bool] = ContextVar("lightning_accel_tune_named_as_flags", default=False)


@contextlib.contextmanager
def named_as_flags() -> Iterator[None]:
    """Within it, messages name the arguments of a tune as the ``lightning-accel tune`` flags (``--budget``,
    ``--cache-dir``); outside it, as the keyword arguments of :func:`~lightning_accel.tune.tune_job` (``budget``)."""
    token = _NAMED_AS_FLAGS.set(True)
    try:
        yield
    finally:
        _NAMED_AS_FLAGS.reset(token)


def flags_named() -> bool:
    """Whether messages name the ``lightning-accel tune`` flags (inside :func:`named_as_flags`)."""
    return _NAMED_AS_FLAGS.get()


def arg_label(name: str) -> str:
    """The keyword argument ``name`` of :func:`~lightning_accel.tune.tune_job` as the caller spelled it: the name itself
    from Python, its flag (``--cache-dir`` for ``cache_dir``) under :func:`named_as_flags`."""
    return "--" + name.replace("_", "-") if _NAMED_AS_FLAGS.get() else name


def named_arg(name: str, value: Any = None, flag_value: Any = None) -> str:
    """The argument ``name`` for a message, in backticks, with ``value`` when given: ``budget``, ``force=True``,
    ``skip=['compile']`` from Python; ``--budget``, ``--force`` (a switch takes no value), ``--skip compile`` under
    :func:`named_as_flags`, where ``flag_value`` (when given) is written in place of ``value``."""
    label = arg_label(name)
    if value is None:
        return f"`{label}`"
    if _NAMED_AS_FLAGS.get():
        shown = value if flag_value is None else flag_value
        return f"`{label}`" if shown is True else f"`{label} {shown}`"
    return f"`{label}={value!r}`"


_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str | float | int) -> float:
    """Seconds in ``"90s"``, ``"5m"``, ``"1.5min"``, ``"1h"`` (or a number of seconds, from Python).

    A string must carry its unit: ``"5"`` could mean 5 seconds (``timeout``) or 5 minutes (Slurm's ``--time``), and
    taken as seconds it ran a tune too short for any option while reporting that none paid.

    Raises:
        ValueError: anything else, a string without a unit, or a duration that is not positive and finite.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        # the sign is matched so that "-1m" is told it is not positive, not that it is no duration
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*(s|m|min|h|)\s*", str(text))
        if m is None:
            raise ValueError(f"{named_arg('budget')} must be a duration such as 90s, 5m or 1h, got {text!r}.")
        if not m.group(2):
            raise ValueError(
                f"{named_arg('budget')} must give its unit (s, m, min or h), got {text!r}: seconds or minutes? Pass "
                f"e.g. {named_arg('budget', m.group(1) + 'm')} or {named_arg('budget', m.group(1) + 's')}."
            )
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not seconds > 0:
        raise ValueError(
            f"{named_arg('budget')} must be positive, got {text!r}. Pass e.g. {named_arg('budget', '5m')}."
        )
    if not math.isfinite(seconds):  # the reports hold the budget: `Infinity` is not JSON other tools can read
        raise ValueError(
            f"{named_arg('budget')} must be finite, got {text!r}. Pass the wall-clock limit of the whole tune, e.g. "
            f"{named_arg('budget', '1h')}."
        )
    return seconds


class Budget:
    """Wall-clock budget of a tune: a trial runs only when its estimate fits in what is left.

    Args:
        seconds: the whole budget.
        clock: a monotonic clock (tests inject one).
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not seconds > 0:
            raise ValueError(f"`seconds` must be positive, got {seconds}. Pass the budget in seconds.")
        self.seconds = float(seconds)
        self.clock = clock
        self.start = clock()

    def elapsed(self) -> float:
        """Seconds since the budget started."""
        return self.clock() - self.start

    def left(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self.seconds - self.elapsed())

    def affords(self, estimate_s: float) -> bool:
        """Whether a trial estimated at ``estimate_s`` ends within the budget."""
        return estimate_s <= self.left()


def progress_line(done: int, total: int, budget: Budget, current: str) -> str:
    """One progress line: ``tune [3/9] 212 s left | precision: bf16-mixed``."""
    return f"tune [{done}/{total}] {budget.left():.0f} s left | {current}"


@dataclass
class TrialResult:
    """One trial of the report.

    Attributes:
        name: what changed, in words (``"precision: bf16-mixed"``; ``"baseline"``).
        lever: the lever (``"baseline"``, ``"data"``, ``"precision"``, ...).
        changes: the config changes against the job as configured (dotted keys -> values).
        step_s: normalised seconds per step (slowest rank; per baseline batch; checkpoint saves amortised).
        ref_step_s: what the decision compared with: the faster of the best job's step times just before this
            trial and in a trial right after it (None when the trial failed or its numerics did not pass, so the
            time did not matter, or the trial after it failed).
        breakdown: seconds per step by category (data, compute, comm, checkpoint, ...), mean over ranks.
        dominant: the category with the largest share; ``verdict`` the monitor's sentence.
        losses: rank 0's per-step training losses.
        numerics: the numerics check against the baseline (``asdict`` of :class:`Numerics`).
        peak_mem_bytes: peak device memory (CUDA) or the process's peak resident memory (CPU).
        memory_ok: whether it fitted.
        decision: ``"baseline"``, ``"kept"``, ``"rejected"`` or ``"skipped"``; ``reason`` why.
        seconds: wall seconds the trial took (instantiation included).
        error: the one-line error of a failed trial.
    """

    name: str
    lever: str
    changes: dict[str, Any] = field(default_factory=dict)
    step_s: float | None = None
    ref_step_s: float | None = None
    breakdown: dict[str, float] = field(default_factory=dict)
    dominant: str = ""
    verdict: str = ""
    losses: list[float] = field(default_factory=list)
    numerics: dict[str, Any] | None = None
    peak_mem_bytes: int | None = None
    memory_ok: bool = True
    decision: str = ""
    reason: str = ""
    seconds: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)
