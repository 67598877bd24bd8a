"""``lightning-accel tune --config job.yaml [--budget 5m] [--out tuned.yaml] [--allow-batch-change] [--force]``.

Tunes the job a ``lightning-accel fit`` config describes (see :func:`lightning_accel.tune.tune_job`) and writes
``tuned.yaml`` (which ``lightning-accel fit --config tuned.yaml`` runs unchanged) and ``tune_report.{json,md,png}``
beside it; files there that ``tune`` did not write are left alone unless ``--force``, and ``--out`` is never the
``--config`` itself. A multi-device job (``trainer.devices`` / ``num_nodes``) tunes under its own processes:
Lightning starts them as for ``fit``, by running this same command line in each.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

from lightning_accel._utils.errors import one_line

__all__ = ["main"]


# reStructuredText in the docstring that a terminal shows as is: a role (:func:`~a.b`) and a literal (``x``)
_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_RST_LITERAL = re.compile(r"``([^`]+)``")


def plain_help(text: str) -> str:
    """``text`` (reStructuredText from a docstring) as ``--help`` shows it: roles become the name they point at,
    double-backtick literals take single backticks (as the options' help quotes a command), lines are joined."""
    text = _RST_ROLE.sub(r"\1", text)
    return " ".join(_RST_LITERAL.sub(r"`\1`", text).split())


def build_parser(prog: str = "lightning-accel tune") -> argparse.ArgumentParser:
    """The argument parser of ``tune``; its description is the module docstring's second paragraph, in plain text."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, description=plain_help(__doc__.split("\n\n")[1]))
    p.add_argument("--config", "-c", required=True, help="the job's YAML, as `lightning-accel fit --config` takes")
    p.add_argument(
        "--budget", default="5m", help="wall-clock limit of the whole tune, with its unit (90s, 5m, 1h; default 5m)"
    )
    p.add_argument("--out", default="tuned.yaml", help="the tuned config (reports beside it; default tuned.yaml)")
    p.add_argument(
        "--allow-batch-change", action="store_true", help="also try 2x the per-device batch + LinearScalingLR"
    )
    p.add_argument("--margin", type=float, default=None, help="fraction a lever must beat the best step by (0.03)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per trial (default 3)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per trial (>= 3; default 12)")
    p.add_argument(
        "--levers", default=None, help="comma-separated subset of data,precision,host_memory,strategy,checkpoint,batch"
    )
    p.add_argument("--skip", default=None, help="comma-separated words: leave out options named so (e.g. compile)")
    p.add_argument("--no-cache", action="store_true", help="measure again even when this job was tuned before")
    p.add_argument("--cache-dir", default=None, help="where results are cached (default ~/.cache/lightning_accel/tune)")
    p.add_argument(
        "--force", action="store_true", help="overwrite files at --out and beside it that tune did not write"
    )
    return p


def _same_file(a: str, b: str) -> bool:
    a, b = os.path.expanduser(a), os.path.expanduser(b)  # `--out=~/job.yaml` reaches us unexpanded
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare the paths
        return os.path.realpath(a) == os.path.realpath(b)


def _comma_list(flag: str, value: str, example: str) -> list[str]:
    """The entries of the comma-separated ``value`` of ``flag``, stripped (``[]`` for an empty or blank value).

    Raises:
        ValueError: an empty entry (a leading, trailing or doubled comma). A stray comma is a typo whose intent is
            unknown (a name left out?), so every comma-separated flag refuses it rather than guess.
    """
    if not value.strip():
        return []
    words = [w.strip() for w in value.split(",")]
    if "" in words:
        raise ValueError(
            f"`{flag}` must be names separated by single commas, got {value!r}, which holds an empty entry (a "
            f"leading, trailing or doubled comma). Pass e.g. `{flag} {example}`."
        )
    return words


def _glue_negative_budget(argv: list[str]) -> list[str]:
    """``argv`` with ``--budget -1m`` written as ``--budget=-1m``: argparse takes a value that starts with ``-`` and
    is no plain number for a flag and answered "argument --budget: expected one argument", which hides that the
    budget is negative (``parse_duration`` then says so)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--budget" and i + 1 < len(argv) and re.fullmatch(r"-[0-9.].*", argv[i + 1]):
            out.append(f"--budget={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None, prog: str = "lightning-accel tune") -> int:
    """Run ``tune``; 0 on success, 2 with one ``error:`` line on a user mistake, 130 when interrupted (Ctrl-C); a
    SIGTERM raises ``SystemExit(143)`` (the trial folder removed, nothing written)."""
    from lightning_accel.tune.core import DEFAULT_MARGIN, named_as_flags
    from lightning_accel.tune.tuner import load_job, tune_job

    args = build_parser(prog).parse_args(_glue_negative_budget(sys.argv[1:] if argv is None else list(argv)))
    try:
        if _same_file(args.out, args.config):
            raise ValueError(
                f"`--out` {args.out!r} is the `--config` it tunes: writing the tuned config there would replace the "
                "job. Pass another `--out`, e.g. tuned.yaml."
            )
        # `--levers ""` (an empty shell variable) names no lever: refused as `levers=[]` is, not taken as "all levers"
        levers = _comma_list("--levers", args.levers, "precision") if args.levers is not None else None
        skip = _comma_list("--skip", args.skip, "compile") if args.skip is not None else []
        # the refusals name this command's flags (`--config`, `--budget`), not load_job's / tune_job's keywords
        with named_as_flags():
            job = load_job(args.config)
            res = tune_job(
                job,
                budget=args.budget,
                out=args.out,
                allow_batch_change=args.allow_batch_change,
                margin=DEFAULT_MARGIN if args.margin is None else args.margin,
                warmup=args.warmup,
                steps=args.steps,
                levers=levers,
                skip=skip,
                cache_dir=args.cache_dir,
                use_cache=not args.no_cache,
                force=args.force,
            )
    # OSError: outputs that could not be written (a full disk), FileNotFoundError among them
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the tune stops where it was (its trial folder removed), no traceback
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:  # SIGTERM: stopped as by Ctrl-C, with the status SIGTERM gives
            print(f"{prog}: terminated", file=sys.stderr)
        raise
    if res.paths:
        print(f"tuned config: {res.paths['tuned']}; report: {res.paths['md']}")
    return 0
