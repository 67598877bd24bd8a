"""The tune loop with a scripted trial runner: which trials it runs and what it decides (no training)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

from lightning_accel.tune import core, runner, tuner
from lightning_accel.tune.levers import job_precision
from lightning_accel.tune.runner import TrialMeasure
from tests.helpers import ctrl_c_by_default

LOSSES = [2.3, 2.1, 1.9, 1.8, 1.7, 1.6, 1.5, 1.45, 1.4, 1.35, 1.3, 1.25]
JOB: dict[str, Any] = {
    "seed_everything": 0,
    "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 1},
    "model": {"class_path": "lightning_accel.models.ImageClassifier", "init_args": {"width": 4}},
}


def _script(times: list[float]) -> tuple[list[str], Any]:
    """A ``run_trial`` that returns ``times`` in order and records each trial's precision."""
    seen: list[str] = []
    left = list(times)

    def fake(job: dict[str, Any], *, warmup: int, steps: int, root: str | Path) -> TrialMeasure:
        m = TrialMeasure()
        m.step_s, m.losses, m.seconds, m.dominant = left.pop(0), list(LOSSES), 1.0, "compute"
        seen.append(job_precision(job))
        return m

    return seen, fake


def _tune(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, times: list[float]) -> tuple[list[str], tuner.TuneResult]:
    seen, fake = _script(times)
    monkeypatch.setattr(tuner, "run_trial", fake)
    res = tuner.tune_job(
        JOB,
        budget="10m",
        out=None,
        levers=["precision"],
        skip=["Fused"],  # the one option left: bf16-mixed
        use_cache=False,
        cache_dir=tmp_path,
        verbose=False,
    )
    return seen, res


def test_a_candidate_is_compared_with_the_best_job_measured_around_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the baseline ran under load (100 ms); the candidate (90 ms) beats that stale time by 10 %, but the baseline's
    # trial right after it takes 82 ms: against the faster of the two the candidate is slower
    seen, res = _tune(monkeypatch, tmp_path, [0.100, 0.090, 0.082])
    assert seen == ["32-true", "bf16-mixed", "32-true"]  # baseline, candidate, the best job again
    trial = res.trials[1]
    assert trial.ref_step_s == pytest.approx(0.082)
    assert trial.decision == "rejected" and "slower than the best so far" in trial.reason
    assert res.chosen == {}


def test_a_stall_in_the_reference_trial_after_a_candidate_does_not_keep_a_slower_candidate(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the job takes 42 ms, the candidate 49 ms, and the job's trial right after it stalls at 76 ms: against their mean
    # (59 ms) the slower candidate counted as 17 % faster and was kept
    seen, res = _tune(monkeypatch, tmp_path, [0.042, 0.049, 0.076])
    assert res.trials[1].ref_step_s == pytest.approx(0.042)
    assert res.trials[1].decision == "rejected" and res.chosen == {}


def test_a_candidate_that_holds_its_gain_against_the_fresh_time_is_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen, res = _tune(monkeypatch, tmp_path, [0.100, 0.080, 0.098])
    assert len(seen) == 3
    assert res.trials[1].ref_step_s == pytest.approx(0.098) and res.trials[1].decision == "kept"
    assert res.chosen == {"precision": res.trials[1].name}


def test_the_grid_keeps_each_rows_fastest_round_and_gives_a_twin_extra_its_rows_times(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # rows: as configured, bf16-mixed; extras: the bf16 job again (a twin, not measured) and an fp64 job (measured)
    seen, fake = _script([0.100, 0.080, 0.300, 0.300, 0.070, 0.090])
    monkeypatch.setattr(tuner, "run_trial", fake)
    bf16 = tuner._options("precision", JOB, ["Fused"])[0].apply(JOB)
    other = {**JOB, "trainer": {**JOB["trainer"], "precision": "64-true"}}
    rows = tuner.exhaustive(
        JOB, ["precision"], skip=["Fused"], rounds=2, extra={"tuned": bf16, "other": other}, root=tmp_path / "g"
    )
    assert seen == ["32-true", "bf16-mixed", "64-true", "64-true", "bf16-mixed", "32-true"]  # forward, then back
    plain, fast, twin, odd = rows
    assert plain["step_s"] == 0.090 and fast["step_s"] == 0.070 and odd["step_s"] == 0.300
    assert twin["same_as"] == ["precision: bf16-mixed"] and twin["step_s"] == 0.070 and twin["runs"] == [0.080, 0.070]


@pytest.mark.parametrize("interrupted", [False, True], ids=["done", "ctrl-c"])
def test_the_grid_removes_only_its_own_folder_under_root(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, interrupted: bool
) -> None:
    # `root` was removed as a whole at the end: given the user's project folder, the grid deleted every file in it
    roots: list[Path] = []

    def fake(job: dict[str, Any], *, warmup: int, steps: int, root: str | Path) -> TrialMeasure:
        Path(root).mkdir(parents=True)
        (Path(root) / "trial.ckpt").write_text("a trial's file")
        roots.append(Path(root))
        if interrupted and len(roots) == 2:
            raise KeyboardInterrupt
        m = TrialMeasure()
        m.step_s, m.losses, m.seconds, m.dominant = 0.1, list(LOSSES), 1.0, "compute"
        return m

    monkeypatch.setattr(tuner, "run_trial", fake)
    project, fresh = tmp_path / "project", tmp_path / "fresh" / "grid"
    project.mkdir()
    (project / "train.py").write_text("# the user's script\n")
    for root in (project, fresh):
        roots.clear()
        if interrupted:
            with pytest.raises(KeyboardInterrupt):
                tuner.exhaustive(JOB, ["precision"], skip=["Fused"], rounds=1, root=root)
        else:
            assert len(tuner.exhaustive(JOB, ["precision"], skip=["Fused"], rounds=1, root=root)) == 2
        assert roots and all(r.parent.parent == root and r.parent.name.startswith(".tune-grid-") for r in roots)
        assert not any(r.exists() for r in roots)
    assert sorted(p.name for p in project.iterdir()) == ["train.py"]
    assert (project / "train.py").read_text() == "# the user's script\n"
    assert not fresh.exists()  # the folder the grid made for itself is gone


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"levers": ["precison"]},
            "`levers` must name levers from data, precision, host_memory, strategy, checkpoint, batch, got 'precison'",
        ),
        ({"levers": ["batch"]}, "`levers` names 'batch', which is tried only with `allow_batch_change=True`"),
        ({"skip": [""]}, "`skip` must hold non-blank words of option names, got ''"),
        ({"margin": 3}, "`margin` must be a number >= 0 and < 1, got 3"),
        ({"k": 0}, "`k` must be an integer >= 1, got 0"),
        # a job that saves leaves its save's step period out: 2 timed steps left one period, and no trial had a time
        ({"steps": 2}, "`steps` must be an integer >= 3, got 2. A trial times at least 2 steps besides"),
    ],
)
def test_bad_arguments_are_refused_before_any_trial(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    seen, fake = _script([0.1] * 9)
    monkeypatch.setattr(tuner, "run_trial", fake)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=match):
        tuner.tune_job(JOB, out=None, use_cache=False, cache_dir=tmp_path, verbose=False, **kwargs)
    assert seen == []


def test_a_lone_string_is_one_lever_or_one_skip_word(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen, fake = _script([0.100, 0.200] * 4)
    monkeypatch.setattr(tuner, "run_trial", fake)
    monkeypatch.chdir(tmp_path)
    res = tuner.tune_job(
        JOB, out=None, levers="precision", skip="Fused", use_cache=False, cache_dir=tmp_path, verbose=False
    )
    # not the words 'F', 'u', 's', 'e', 'd' (which skip every option) nor the levers 'p', 'r', ...
    assert [t.name for t in res.trials] == ["baseline", "precision: bf16-mixed"]


def test_a_cache_entry_of_another_layout_is_a_miss(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {"out": None, "levers": ["precision"], "skip": ["Fused"], "cache_dir": tmp_path}
    seen, fake = _script([0.100, 0.200, 0.100] * 5)
    monkeypatch.setattr(tuner, "run_trial", fake)
    monkeypatch.chdir(tmp_path)
    first = tuner.tune_job(JOB, verbose=False, **kwargs)
    entry = tmp_path / f"{first.fingerprint}.json"
    good = json.loads(entry.read_text())
    newer = json.loads(json.dumps(good))
    newer["trials"][0]["a_field_of_another_version"] = 1
    damaged: list[Any] = [newer, {"config": {}}, {"config": {}, "trials": "x", "chosen": {}}, []]
    for data in damaged:
        entry.write_text(json.dumps(data))
        res = tuner.tune_job(JOB, verbose=False, **kwargs)
        assert not res.cached and res.trials[0].name == "baseline"  # measured again
    assert len(seen) == 5 * 3
    assert tuner.tune_job(JOB, verbose=False, **kwargs).cached  # the entry the last tune stored


def test_the_fingerprint_holds_the_package_version_and_no_host_name() -> None:
    import lightning_accel

    env = tuner._env(JOB)
    assert env["lightning_accel"] == lightning_accel.__version__ and "host" not in env


def _tool_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.parent.iterdir()) if p.is_file()}


def test_outputs_never_overwrite_a_file_tune_did_not_write(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _, fake = _script([0.100, 0.200, 0.100] * 6)
    monkeypatch.setattr(tuner, "run_trial", fake)
    out = tmp_path / "tuned.yaml"
    kwargs: dict[str, Any] = {"levers": ["precision"], "skip": ["Fused"], "use_cache": False, "verbose": False}
    res = tuner.tune_job(JOB, out=out, cache_dir=tmp_path / "c", **kwargs)
    assert set(res.paths) >= {"tuned", "json", "md"}
    assert tuner.tune_job(JOB, out=out, cache_dir=tmp_path / "c", **kwargs).paths  # tune's own files: overwritten
    if "png" in res.paths:
        assert b"lightning-accel tune" in Path(res.paths["png"]).read_bytes()
    for name in ("tuned.yaml", "tune_report.md", "tune_report.json", "tune_report.png"):
        before = _tool_files(out)
        (tmp_path / name).write_bytes(b"the user's own file\n")
        mine = _tool_files(out)
        with pytest.raises(ValueError, match="did not write .* refusing to overwrite it. Pass another `out`") as e:
            tuner.tune_job(JOB, out=out, cache_dir=tmp_path / "c", **kwargs)
        assert "\n" not in str(e.value) and _tool_files(out) == mine  # nothing written
        res = tuner.tune_job(JOB, out=out, cache_dir=tmp_path / "c", force=True, **kwargs)
        if name != "tune_report.png" or "png" in res.paths:  # the chart needs matplotlib
            assert (tmp_path / name).read_bytes() != b"the user's own file\n"
        assert set(_tool_files(out)) == set(before)


def test_tune_cli_refuses_an_out_that_is_the_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_accel.tune.cli import main

    seen, fake = _script([0.1] * 9)
    monkeypatch.setattr(tuner, "run_trial", fake)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("# the user's job\n" + json.dumps(JOB))
    text = cfg.read_text()
    assert main(["--config", str(cfg), "--out", str(cfg), "--levers", "precision", "--force"]) == 2
    assert "`--out` " in capsys.readouterr().err and cfg.read_text() == text and seen == []


def _rank_on_its_own_host(rank: int, world: int, root: str) -> tuple[bool, list[str]]:
    import platform

    platform.node = lambda: f"node{rank}"  # as on a job of two nodes
    _, fake = _script([0.1, 0.2, 0.1])
    tuner.run_trial = fake
    res = tuner.tune_job(
        JOB, out=f"{root}/tuned.yaml", cache_dir=f"{root}/c", levers=["precision"], skip=["Fused"], verbose=False
    )
    return res.cached, sorted(p.name for p in Path(root).iterdir())


def test_every_node_takes_the_same_cache_decision_and_leaves_no_work_folder(tmp_path: Path) -> None:
    from tests.helpers import run_in_processes

    first = run_in_processes(_rank_on_its_own_host, 2, (str(tmp_path),), timeout=120)
    assert [cached for cached, _ in first] == [False, False]
    assert not [n for n in sorted(p.name for p in tmp_path.iterdir()) if n.startswith(".tune-")]
    again = run_in_processes(_rank_on_its_own_host, 2, (str(tmp_path),), timeout=120)
    assert [cached for cached, _ in again] == [True, True]  # before: rank 1 measured, rank 0 returned


def _one_rank_fails_before_the_trials(rank: int, world: int, root: str, failing: int, kind: str) -> str:
    import platform

    platform.node = lambda: f"node{rank}"
    os.environ["LOCAL_RANK"] = "0"  # each rank leads its own node, as on a job of two nodes
    _, fake = _script([0.1, 0.2, 0.1])
    tuner.run_trial = fake
    claim = tuner._claim_work

    def claim_on(work: Path, out: Any, *, grid: bool = False) -> str | None:
        if rank == failing:
            if kind == "error":
                raise PermissionError(13, "Permission denied", str(work))
            return f"the trial folder on node{rank} is taken"
        return claim(work, out, grid=grid)

    tuner._claim_work = claim_on
    try:
        tuner.tune_job(JOB, out=f"{root}/tuned.yaml", cache_dir=f"{root}/c", levers=["precision"], verbose=False)
    except Exception as e:  # noqa: BLE001 - the test reads what every rank raised
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("kind", ["error", "refusal"])
def test_a_failure_on_one_node_before_the_trials_raises_on_every_rank(tmp_path: Path, failing: int, kind: str) -> None:
    """A node leader that could not claim its trial folder (a PermissionError) or refused it raised alone; the other
    rank went on into the next collective, which waited for it (until the process group's timeout while the failed
    rank's process lived on) or failed with gloo's "Connection closed by peer", naming neither rank nor cause."""
    from tests.helpers import run_in_processes

    got = run_in_processes(_one_rank_fails_before_the_trials, 2, (str(tmp_path), failing, kind), timeout=120)
    other = 1 - failing
    if kind == "error":
        assert got[failing].startswith("PermissionError: [Errno 13] Permission denied"), got
        assert got[other].startswith(f"RuntimeError: tune: rank {failing} failed before the first trial: "), got
        assert "PermissionError" in got[other]
    else:
        assert got == [f"ValueError: the trial folder on node{failing} is taken"] * 2, got


DATA_JOB: dict[str, Any] = {
    **JOB,
    "data": {
        "class_path": "lightning_accel.datasets.DigitsDataModule",
        "init_args": {"data_dir": "digits", "batch_size": 32},
    },
}


def _data_tune(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, times: list[float], shift: float
) -> tuple[tuner.TuneResult, str]:
    """The data lever on DATA_JOB with CachedDataModule and num_workers=0 as its options; the cached job's losses are
    ``shift`` times the baseline's (another sample order)."""
    left = list(times)

    def fake(job: dict[str, Any], *, warmup: int, steps: int, root: str | Path) -> TrialMeasure:
        m = TrialMeasure()
        cached = "CachedDataModule" in job["data"]["class_path"]
        m.losses = [x * (shift if cached else 1.0) for x in LOSSES]
        m.step_s, m.seconds, m.dominant = left.pop(0), 1.0, "data"
        return m

    monkeypatch.setattr(tuner, "run_trial", fake)
    out = tmp_path / "tuned.yaml"
    skip = [f"workers={n}" for n in range(1, 5)]  # whatever the CPU count: num_workers=0 is the one workers option
    res = tuner.tune_job(
        DATA_JOB,
        budget="10m",
        out=out,
        levers=["data"],
        skip=skip,
        use_cache=False,
        cache_dir=tmp_path / "c",
        verbose=False,
    )
    assert [t.name for t in res.trials] == [
        "baseline",
        "data: CachedDataModule over the image folder",
        "data: num_workers=0",
    ]
    return res, out.read_text().splitlines()[0]


def test_an_option_on_a_kept_reordering_job_keeps_the_order_allowance(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the cached order moves the loss by 4 % (within 2 % + the 5 % order allowance); num_workers=0 runs on the cached
    # job, in its order, and must be judged with the same allowance (it was rejected for numerics)
    res, _ = _data_tune(monkeypatch, tmp_path, [0.100, 0.080, 0.100, 0.060, 0.080], shift=1.04)
    assert [t.decision for t in res.trials] == ["baseline", "kept", "kept"]
    assert res.config["data"]["class_path"] == "lightning_accel.data.CachedDataModule"
    assert res.config["data"]["init_args"]["num_workers"] == 0


def test_every_kept_option_of_a_lever_still_in_the_config_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    res, header = _data_tune(monkeypatch, tmp_path, [0.100, 0.080, 0.100, 0.060, 0.080], shift=1.01)
    both = "data: CachedDataModule over the image folder, data: num_workers=0"
    assert res.chosen == {"data": both} and header.endswith(f"kept: {both}")


def test_a_kept_option_a_later_one_replaced_is_not_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # bf16-mixed kept, then FusedPrecision kept on it: the tuned config holds the plugin alone
    _, fake = _script([0.100, 0.080, 0.100, 0.060, 0.080])
    monkeypatch.setattr(tuner, "run_trial", fake)
    res = tuner.tune_job(
        JOB,
        out=None,
        levers=["precision"],
        skip=["compile", "channels_last"],
        use_cache=False,
        cache_dir=tmp_path,
        verbose=False,
    )
    assert [t.decision for t in res.trials] == ["baseline", "kept", "kept"]
    assert res.chosen == {"precision": "precision: FusedPrecision(bf16-mixed)"}


def test_a_cached_tune_cut_short_by_its_budget_is_measured_again_with_a_larger_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen, fake = _script([0.1] * 20)
    monkeypatch.setattr(tuner, "run_trial", fake)
    kwargs: dict[str, Any] = {"out": None, "levers": ["precision"], "skip": ["Fused"], "cache_dir": tmp_path}
    monkeypatch.setattr(tuner, "Budget", lambda s: core.Budget(s, clock=lambda: 0.0))
    short = tuner.tune_job(JOB, budget="2s", verbose=False, **kwargs)  # a 1 s baseline: ~5 s per option
    assert [t.decision for t in short.trials] == ["baseline", "skipped"] and len(seen) == 1
    assert tuner.tune_job(JOB, budget="2s", verbose=False, **kwargs).cached  # the same budget: the same answer
    longer = tuner.tune_job(JOB, budget="10m", verbose=False, **kwargs)
    assert not longer.cached and [t.decision for t in longer.trials] == ["baseline", "rejected"]
    assert tuner.tune_job(JOB, budget="2s", verbose=False, **kwargs).cached  # a complete result serves any budget


@pytest.mark.parametrize(
    ("field", "value"),
    [("breakdown", None), ("numerics", True), ("losses", ["x"]), ("step_s", "fast"), ("memory_ok", 1)],
)
def test_a_cache_entry_with_a_field_of_another_type_is_a_miss(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, field: str, value: Any
) -> None:
    seen, fake = _script([0.100, 0.200, 0.100] * 2)
    monkeypatch.setattr(tuner, "run_trial", fake)
    kwargs: dict[str, Any] = {"levers": ["precision"], "skip": ["Fused"], "cache_dir": tmp_path / "c"}
    first = tuner.tune_job(JOB, out=None, verbose=False, **kwargs)
    entry = tmp_path / "c" / f"{first.fingerprint}.json"
    data = json.loads(entry.read_text())
    data["trials"][1][field] = value
    entry.write_text(json.dumps(data))
    res = tuner.tune_job(JOB, out=tmp_path / "o" / "tuned.yaml", verbose=False, **kwargs)
    assert not res.cached and len(seen) == 6 and (tmp_path / "o" / "tune_report.md").is_file()


def test_the_cached_trial_fields_are_the_trial_results() -> None:
    from dataclasses import fields

    assert set(tuner._TRIAL_FIELDS) == {f.name for f in fields(core.TrialResult)}


def test_the_written_config_keeps_the_jobs_own_seed_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen_seeds: list[Any] = []

    def fake(job: dict[str, Any], *, warmup: int, steps: int, root: str | Path) -> TrialMeasure:
        seen_seeds.append(job.get("seed_everything"))
        m = TrialMeasure()
        m.step_s, m.losses, m.seconds, m.dominant = 0.1, list(LOSSES), 1.0, "compute"
        return m

    monkeypatch.setattr(tuner, "run_trial", fake)
    unseeded = {k: v for k, v in JOB.items() if k != "seed_everything"}
    for i, (job, written) in enumerate((({**JOB, "seed_everything": True}, True), (unseeded, None))):
        out = tmp_path / str(i) / "tuned.yaml"
        res = tuner.tune_job(
            job, out=out, levers=["precision"], skip=["Fused"], cache_dir=tmp_path / "c", verbose=False
        )
        assert res.config.get("seed_everything", None) is written and ("seed_everything" in res.config) is (i == 0)
        assert yaml.safe_load(out.read_text()).get("seed_everything") is written
    assert set(seen_seeds) == {0}  # every trial on one pinned seed


def test_a_jobs_ckpt_path_stays_in_the_config_and_the_report_says_trials_start_fresh(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen, fake = _script([0.1, 0.2, 0.1])
    monkeypatch.setattr(tuner, "run_trial", fake)
    job = {**JOB, "ckpt_path": "last.ckpt", "weights_only": None}
    res = tuner.tune_job(job, out=None, levers=["precision"], skip=["Fused"], use_cache=False, cache_dir=tmp_path)
    assert res.config["ckpt_path"] == "last.ckpt" and "not from the job's `ckpt_path`" in res.trials[0].reason
    trial = runner._trial_job(job, warmup=1, steps=2, root=str(tmp_path), save=False)
    assert "ckpt_path" not in trial and "weights_only" not in trial  # AccelCLI without a subcommand refuses them


def test_folders_that_cannot_be_written_are_refused_before_any_trial(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen, fake = _script([0.1] * 9)
    monkeypatch.setattr(tuner, "run_trial", fake)
    a_file = tmp_path / "job.yaml"
    a_file.write_text("model: {}\n")
    for kwargs, match in (
        ({"out": a_file / "tuned.yaml", "cache_dir": tmp_path / "c"}, r"`out` .* cannot be written: .* is a file"),
        ({"out": None, "cache_dir": a_file / "cache"}, r"`cache_dir` .* cannot hold the tune cache: .* is a file"),
    ):
        with pytest.raises(ValueError, match=match) as e:
            tuner.tune_job(JOB, levers=["precision"], verbose=False, **kwargs)
        assert "\n" not in str(e.value)
    assert seen == []


def test_a_cache_that_cannot_be_stored_is_a_warning_after_the_outputs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, fake = _script([0.1, 0.2, 0.1])
    monkeypatch.setattr(tuner, "run_trial", fake)

    def full_disk(self: core.TuneCache, key: str, result: Any) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(core.TuneCache, "store", full_disk)
    out = tmp_path / "o" / "tuned.yaml"
    with pytest.warns(UserWarning, match="could not be stored in the cache .* result stands"):
        res = tuner.tune_job(JOB, out=out, levers=["precision"], skip=["Fused"], cache_dir=tmp_path, verbose=False)
    assert out.is_file() and res.paths["tuned"] == str(out)


@pytest.mark.parametrize(
    ("lever", "trainer", "words"),
    [
        (
            "strategy",
            {},
            "which is tried on a job of several processes, and this one's `trainer.devices` x `num_nodes` is 1",
        ),
        (
            "checkpoint",
            {"enable_checkpointing": False},
            "which is tried on a job that saves checkpoints, and this one sets `enable_checkpointing: false`",
        ),
        ("data", {}, "which is tried on a data module given as `class_path:` under `data:`, and this job gives none"),
        (
            "host_memory",
            {"callbacks": [{"class_path": "lightning_accel.callbacks.HostMemoryManager"}]},
            "which is tried on a job that trains on the CPU (`trainer.accelerator: cpu`, or `auto` without a GPU) "
            "under glibc and has no HostMemoryManager callback yet, and this one does not",
        ),
    ],
)
def test_a_lever_with_nothing_to_try_on_the_job_is_refused_before_any_trial(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, lever: str, trainer: dict[str, Any], words: str
) -> None:
    # the tune left such a lever out without a word: it ran the baseline alone and said "kept: nothing"
    seen, fake = _script([0.1, 0.2, 0.1])
    monkeypatch.setattr(tuner, "run_trial", fake)
    job = {**JOB, "trainer": {**JOB["trainer"], **trainer}}
    with pytest.raises(ValueError, match=rf"^`levers` names '{lever}', {re.escape(words)}.*: it would try nothing\."):
        tuner.tune_job(job, out=None, levers=[lever, "precision"], use_cache=False, cache_dir=tmp_path, verbose=False)
    assert seen == []


def test_outputs_a_full_disk_refuses_are_one_line_and_the_result_is_cached_for_the_next_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_accel._utils import atomic
    from lightning_accel.tune.cli import main

    seen, fake = _script([0.1, 0.2, 0.1])
    monkeypatch.setattr(tuner, "run_trial", fake)
    cache, out = tmp_path / "cache", tmp_path / "o" / "tuned.yaml"
    real = atomic.atomic_write_text

    def full_disk(path: Any, text: str, *args: Any, **kwargs: Any) -> Any:
        if not Path(path).is_relative_to(cache):  # the outputs' disk is full, the cache's is not
            raise OSError(28, "No space left on device")
        return real(path, text, *args, **kwargs)

    monkeypatch.setattr(atomic, "atomic_write_text", full_disk)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    argv = ["--config", str(job), "--out", str(out), "--cache-dir", str(cache), "--levers", "precision"]
    argv += ["--skip", "Fused"]
    capsys.readouterr()
    assert main([*argv, "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"lightning-accel tune: error: `--out` {str(out)!r}: the tuned config and its reports could not be written "
        "([Errno 28] No space left on device). Free space in its folder or pass another `--out`; the result is "
        "cached: run the same tune again without `--no-cache` to write it without measuring."
    )
    assert len(seen) == 3 and len(list(cache.glob("*.json"))) == 1
    # space freed: the same tune writes the outputs from the cache, with no trial
    monkeypatch.setattr(atomic, "atomic_write_text", real)
    assert main(argv) == 0
    assert len(seen) == 3 and out.read_text().startswith(tuner.HEADER)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("trainer:\n  devices: [1\nmodel: x\n", "is not valid YAML: while parsing a flow sequence (line 2, column 12)"),
        ("", "is empty"),
        ("- a\n- b\n", "must hold a mapping of settings"),
        (None, "is a folder, not a YAML file"),
    ],
)
def test_tune_cli_refuses_a_config_that_is_no_yaml_job_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, words: str
) -> None:
    from lightning_accel.tune.cli import main

    seen, fake = _script([0.1] * 9)
    monkeypatch.setattr(tuner, "run_trial", fake)
    cfg = tmp_path / "cfg"
    if content is None:
        cfg.mkdir()
    else:
        cfg.write_text(content)
    assert main(["--config", str(cfg), "--out", str(tmp_path / "o" / "tuned.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"`--config` {str(cfg)!r} " in err and words in err and seen == []


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "is a folder, not a YAML file. Pass one of its YAML files (a.yaml), e.g. `path="),
        ("missing", "does not exist"),
        ("model: [1\n", "is not valid YAML"),
        ("", "is empty"),
        ("trainer: {}\n", "holds no job"),
        ("model:\n  init_args:\n    root: ${DATA}/x\n", "set it in the loaded job from `os.environ`"),
    ],
    ids=["folder", "missing", "yaml", "empty", "no-model", "variable"],
)
def test_load_job_names_its_keyword_from_python_and_the_flag_from_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, words: str
) -> None:
    # `load_job(path)` from Python was told about `--config`, a flag its caller never typed
    from lightning_accel.tune.cli import main

    cfg = tmp_path / "job.yaml"
    if content is None:
        cfg.mkdir()
        (cfg / "a.yaml").write_text("model: {}\n")
    elif content != "missing":
        cfg.write_text(content)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        tuner.load_job(cfg)
    assert f"`path` {str(cfg)!r} " in str(e.value) and words in str(e.value)
    assert "--config" not in str(e.value) and "command line" not in str(e.value)
    assert main(["--config", str(cfg), "--out", str(tmp_path / "o" / "tuned.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"`--config` {str(cfg)!r} " in err and "`path`" not in err, err
    # `tune` takes no `--model.init_args.root=...` flag: its refusal must not suggest one
    assert "os.environ" not in err and "--model." not in err


def test_tune_names_the_argument_and_key_of_a_value_yaml_cannot_hold() -> None:
    class Model:
        hparams = {"width": 4, "vocab_file": Path("vocab.txt")}

    with pytest.raises(TypeError, match=r"`model` hyper-parameter 'vocab_file' is of type PosixPath") as e:
        tuner.job_from_objects({"accelerator": "cpu"}, Model(), None)
    assert "trainer_kwargs" not in str(e.value)
    with pytest.raises(TypeError, match=r"`trainer_kwargs` value 'plugins\[0\]' is of type object"):
        tuner.job_from_objects({"plugins": [object()]}, JOB["model"], None)


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        ("trainner: not an option; did you mean 'trainer'?", "did you mean 'trainer'? Check that"),
        ("RuntimeError: boom", "RuntimeError: boom. Check that"),
    ],
)
def test_a_failed_baseline_is_one_sentence_per_part(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: str, shown: str
) -> None:
    def fail(job: dict[str, Any], *, warmup: int, steps: int, root: str | Path) -> TrialMeasure:
        m = TrialMeasure()
        m.error = error
        return m

    monkeypatch.setattr(tuner, "run_trial", fail)
    with pytest.raises(RuntimeError, match="baseline trial of the job failed") as e:
        tuner.tune_job(
            JOB, budget="10m", out=None, levers=["precision"], use_cache=False, cache_dir=tmp_path, verbose=False
        )
    assert shown in str(e.value) and "?." not in str(e.value)


def test_a_guard_the_job_names_by_a_bare_class_path_is_not_added_twice() -> None:
    # `fit` takes a callback as a bare class path; a second guard beside it made tuned.yaml fail to load (Lightning
    # refuses two stateful callbacks of one type)
    from lightning_accel.cli import AccelCLI

    job = {
        "trainer": {"accelerator": "cpu", "logger": False, "callbacks": ["lightning_accel.callbacks.RollbackGuard"]},
        "model": {"class_path": "lightning_accel.models.ImageClassifier", "init_args": {"width": 4}},
        "data": {"class_path": "tests.tiny.TinyDigits", "init_args": {"batch_size": 16, "n": 64}},
    }
    config = tuner.with_guard(job)
    assert config["trainer"]["callbacks"] == ["lightning_accel.callbacks.RollbackGuard"]
    cli = AccelCLI(args=config, run=False)
    assert sum(type(c).__name__ == "RollbackGuard" for c in cli.trainer.callbacks) == 1  # type: ignore[attr-defined]


def test_an_out_under_the_home_directory_is_written_there_and_checked_there(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--out=~/tuned/tuned.yaml` reaches tune unexpanded: it wrote a folder named `~` in the working directory, and
    # the user's file at ~/tuned/tuned.yaml was never looked at
    from lightning_accel.tune.cli import main

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    seen, fake = _script([0.100, 0.200, 0.100] * 6)
    monkeypatch.setattr(tuner, "run_trial", fake)
    kwargs: dict[str, Any] = {"levers": ["precision"], "skip": ["Fused"], "use_cache": False, "verbose": False}
    res = tuner.tune_job(JOB, out="~/tuned/tuned.yaml", cache_dir=tmp_path / "c", **kwargs)
    assert Path(res.paths["tuned"]) == home / "tuned" / "tuned.yaml" and (home / "tuned" / "tuned.yaml").is_file()
    assert list(cwd.iterdir()) == []
    (home / "tuned" / "tuned.yaml").write_text("the user's own file\n")
    with pytest.raises(ValueError, match="refusing to overwrite it"):
        tuner.tune_job(JOB, out="~/tuned/tuned.yaml", cache_dir=tmp_path / "c", **kwargs)
    cfg = home / "job.yaml"
    cfg.write_text(json.dumps(JOB))
    n = len(seen)
    assert main(["--config", str(cfg), "--out=~/job.yaml", "--levers", "precision", "--force"]) == 2
    assert "is the `--config` it tunes" in capsys.readouterr().err and len(seen) == n


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"levers": []}, ValueError, r"`levers` must name at least one lever .*, got an empty list"),
        ({"allow_batch_change": "no"}, TypeError, r"`allow_batch_change` must be True or False, got 'no' \(str\)"),
        ({"use_cache": "false"}, TypeError, r"`use_cache` must be True or False, got 'false' \(str\)"),
        ({"verbose": 0}, TypeError, r"`verbose` must be True or False, got 0 \(int\)"),
        ({"out": 123}, TypeError, r"`out` must be a path \(str or os.PathLike\) or None, got 123 \(int\)\. Pass"),
        ({"cache_dir": 7}, TypeError, r"`cache_dir` must be a path \(str or os.PathLike\) or None, got 7 \(int\)"),
    ],
)
def test_arguments_of_another_kind_are_refused_before_any_trial(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    # an empty `levers` tried every lever; a string flag ("no") is truthy and tried the batch lever / skipped the cache
    seen, fake = _script([0.1] * 9)
    monkeypatch.setattr(tuner, "run_trial", fake)
    monkeypatch.chdir(tmp_path)
    args: dict[str, Any] = {"out": None, "use_cache": False, "cache_dir": tmp_path, "verbose": False, **kwargs}
    with pytest.raises(error, match=match):
        tuner.tune_job(JOB, **args)
    assert seen == []


@pytest.mark.parametrize("name", ["tune_report.json", "tune_report.md", "tune_report.png"])
@pytest.mark.parametrize("force", [False, True])
def test_an_out_named_as_a_report_is_refused_before_any_trial(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, force: bool
) -> None:
    # the report of that name is written beside `out` after it: the tuned config was replaced by the report
    seen, fake = _script([0.1] * 9)
    monkeypatch.setattr(tuner, "run_trial", fake)
    with pytest.raises(ValueError, match=f"`out` .* is named as the report '{name}' that `tune` writes beside it"):
        tuner.tune_job(JOB, out=tmp_path / name, force=force, use_cache=False, cache_dir=tmp_path, verbose=False)
    assert seen == [] and not list(tmp_path.iterdir())


def test_a_data_cache_the_tune_put_in_place_lives_in_its_work_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the data lever's CachedDataModule (no `cache_dir` of its own) cached the decoded data set into
    # .cache/lightning_accel in the working folder and a RAM tier in /dev/shm, left there after the tune
    monkeypatch.setenv("LIGHTNING_ACCEL_RAM_ROOT", str(tmp_path / "shm"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    data = {"class_path": "lightning_accel.datasets.DigitsDataModule", "init_args": {"data_dir": str(tmp_path / "d")}}
    seen: list[dict[str, Any]] = []
    times = [0.100, 0.050, 0.100]

    def fake(job: dict[str, Any], *, warmup: int, steps: int, root: str | Path) -> TrialMeasure:
        init = job["data"].get("init_args") or {}
        seen.append(dict(init))
        for key in ("cache_dir", "ram_dir"):  # what the data module creates there
            if key in init:
                Path(init[key]).mkdir(parents=True, exist_ok=True)
        m = TrialMeasure()
        m.step_s, m.losses, m.seconds, m.dominant = times.pop(0), list(LOSSES), 1.0, "data"
        return m

    monkeypatch.setattr(tuner, "run_trial", fake)
    out = tmp_path / "out" / "tuned.yaml"
    res = tuner.tune_job(
        {**JOB, "data": data}, out=out, levers=["data"], skip=["num_workers"], cache_dir=tmp_path / "c", verbose=False
    )
    assert [t.decision for t in res.trials] == ["baseline", "kept"] and len(seen) == 3
    cached = seen[1]
    assert Path(cached["cache_dir"]).parent.parent == out.parent  # <out folder>/.tune-<key>/data-cache
    assert Path(cached["ram_dir"]).parent == tmp_path / "shm"
    assert not Path(cached["cache_dir"]).exists() and not Path(cached["ram_dir"]).exists()  # removed with the trials
    assert list((tmp_path / "cwd").iterdir()) == []
    # the written config keeps the module's own defaults
    assert res.config["data"]["class_path"].endswith("CachedDataModule")
    assert "cache_dir" not in res.config["data"]["init_args"] and "ram_dir" not in res.config["data"]["init_args"]
    own = {**JOB, "data": {"class_path": "lightning_accel.data.CachedDataModule", "init_args": {"origin": "x"}}}
    assert tuner._scratch_cache(own, own, tmp_path) == own  # the job's own cache: its trials use it, as `fit` does


def test_a_job_whose_trainer_section_is_empty_is_tuned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # `trainer:` with every line under it commented out is YAML's null, which `fit` runs: the levers' edits and the
    # trials failed on it (AttributeError: 'NoneType' object has no attribute ...)
    seen: list[Any] = []
    _, script = _script([0.100, 0.050, 0.100])

    def fake(job: dict[str, Any], **kwargs: Any) -> TrialMeasure:
        seen.append(job["trainer"])
        return script(job, **kwargs)

    monkeypatch.setattr(tuner, "run_trial", fake)
    job = {**JOB, "trainer": None}
    res = tuner.tune_job(job, out=None, levers=["precision"], skip=["Fused"], cache_dir=tmp_path, verbose=False)
    assert [t.decision for t in res.trials] == ["baseline", "kept"] and all(isinstance(t, dict) for t in seen)
    assert res.config["trainer"] == {"precision": "bf16-mixed", "callbacks": [{"class_path": tuner.GUARD_CLASS_PATH}]}
    assert job["trainer"] is None  # the caller's job is left as it was


@pytest.mark.parametrize(
    ("kwargs", "flags", "from_python", "from_the_command"),
    [
        ({"budget": "soon"}, ["--budget", "soon"], "`budget` must be a duration", "`--budget` must be a duration"),
        ({"budget": "0s"}, ["--budget", "0s"], "Pass e.g. `budget='5m'`.", "Pass e.g. `--budget 5m`."),
        # argparse took "-1m" for a flag: "argument --budget: expected one argument", with the usage
        ({"budget": "-1m"}, ["--budget", "-1m"], "`budget` must be positive", "`--budget` must be positive, got '-1m'"),
        ({"budget": "5"}, ["--budget", "5"], "Pass e.g. `budget='5m'` or", "Pass e.g. `--budget 5m` or `--budget 5s`."),
        ({"steps": 2}, ["--steps", "2"], "`steps` must be an integer >= 3", "`--steps` must be an integer >= 3"),
        ({"margin": 1.5}, ["--margin", "1.5"], "`margin` must be a number", "`--margin` must be a number"),
        (
            {"levers": ["batch"]},
            ["--levers", "batch"],
            "`levers` names 'batch', which is tried only with `allow_batch_change=True`.",
            "`--levers` names 'batch', which is tried only with `--allow-batch-change`.",
        ),
        ({"skip": [""]}, ["--skip", ","], "Pass e.g. `skip=['compile']`.", "Pass e.g. `--skip compile`."),
        (
            {"cache_dir": "afile/cache"},
            ["--cache-dir", "afile/cache"],
            "Pass a folder you can write as `cache_dir`.",
            "Pass a folder you can write as `--cache-dir`.",
        ),
        (
            {"out": "mine.yaml"},
            ["--out", "mine.yaml"],
            "Pass another `out`, or `force=True` to overwrite it.",
            "Pass another `--out`, or `--force` to overwrite it.",
        ),
    ],
    ids=[
        "budget",
        "budget-zero",
        "budget-negative",
        "budget-no-unit",
        "steps",
        "margin",
        "levers",
        "skip",
        "cache-dir",
        "out",
    ],
)
def test_refusals_name_the_keyword_from_python_and_the_flag_from_the_command(
    kwargs: dict[str, Any],
    flags: list[str],
    from_python: str,
    from_the_command: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `tune_job(budget="soon")` was told about `--budget`, a flag a Python caller never typed, and the command was
    # told about `steps` / `cache_dir=`, keywords it has no use for
    from lightning_accel.tune.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("a file where the cache folder would go\n")
    (tmp_path / "mine.yaml").write_text("the user's own file\n")
    seen, fake = _script([0.1] * 9)
    monkeypatch.setattr(tuner, "run_trial", fake)
    settings: dict[str, Any] = {"out": "tuned.yaml", "cache_dir": "cache", "levers": ["precision"], **kwargs}
    with pytest.raises((ValueError, TypeError)) as e:
        tuner.tune_job(JOB, verbose=False, **settings)
    assert from_python in str(e.value)
    assert "`--" not in str(e.value)  # no flag of the command
    (tmp_path / "job.yaml").write_text(json.dumps(JOB))
    argv = ["--config", "job.yaml", "--out", "tuned.yaml", "--cache-dir", "cache", "--levers", "precision", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and from_the_command in err, err
    assert "=True" not in err and "`cache_dir`" not in err and "`steps`" not in err  # no keyword of the Python API
    assert seen == []  # refused before any trial
    assert (tmp_path / "mine.yaml").read_text() == "the user's own file\n"


def test_the_report_picture_leaves_the_processs_matplotlib_backend_as_the_user_set_it() -> None:
    """Drawing the trials' chart switched the process to the Agg backend: after a tune in a notebook, its inline
    figures no longer showed."""
    matplotlib = pytest.importorskip("matplotlib")
    from lightning_accel.tune.core import TrialResult

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend other than Agg, as a notebook's inline one is
    try:
        trials = [
            TrialResult(name="baseline", lever="baseline", step_s=0.1, decision="baseline"),
            TrialResult(name="precision: bf16-mixed", lever="precision", step_s=0.08, decision="kept"),
        ]
        png = tuner.report_png(trials)
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    assert png is not None and png.startswith(b"\x89PNG\r\n\x1a\n")


def test_a_second_tune_of_the_job_in_the_same_folder_is_refused_while_the_first_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the second tune starts while the first one's baseline runs (same job and settings: one trial folder)
    _, fake = _script([0.1, 0.2, 0.1, 0.1, 0.2, 0.1])
    second: list[BaseException] = []
    started: list[bool] = []

    def first_trial(job: dict[str, Any], *, warmup: int, steps: int, root: str | Path) -> TrialMeasure:
        if not started:
            started.append(True)
            try:
                tuner.tune_job(JOB, out=tmp_path / "b.yaml", cache_dir=tmp_path / "c", use_cache=False, **settings)
            except ValueError as e:
                second.append(e)
            else:  # before: it ran its trials in the first one's folder, then removed it
                second.append(AssertionError("the second tune ran"))
        assert Path(root).parent.is_dir()  # the first tune's folder is still there
        return fake(job, warmup=warmup, steps=steps, root=root)

    settings: dict[str, Any] = {"levers": ["precision"], "skip": ["Fused"], "verbose": False}
    monkeypatch.setattr(tuner, "run_trial", first_trial)
    res = tuner.tune_job(JOB, out=tmp_path / "a.yaml", cache_dir=tmp_path / "c", use_cache=False, **settings)
    assert isinstance(second[0], ValueError), second
    message = str(second[0])
    assert "\n" not in message and f"pid {__import__('os').getpid()}" in message
    assert message.startswith("another `lightning-accel tune` of this job")
    assert message.endswith("Wait for it to end, or pass an `out` in another folder.")
    assert [t.decision for t in res.trials][0] == "baseline" and (tmp_path / "a.yaml").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tune-")]  # the first one's, removed at its end


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_trial_folder_a_killed_tune_left_is_removed_and_a_users_folder_is_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import platform

    dead = {"written_by": "lightning-accel tune", "host": platform.node(), "pid": _dead_pid(), "start": "1"}
    left = tmp_path / ".tune-0123456789abcdef"  # a killed tune's (another job), with a trial's checkpoint in it
    (left / "t1" / "ckpt").mkdir(parents=True)
    (left / "t1" / "ckpt" / "warm.ckpt").write_bytes(b"x" * 100)
    (left / "owner-node0.json").write_text(json.dumps(dead))
    users = tmp_path / ".tune-fedcba9876543210"  # named like one, but no tune claimed it: the user's
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    alive = tmp_path / ".tune-00000000000000aa"  # a running tune's (this process)
    alive.mkdir()
    (alive / "owner-node0.json").write_text(json.dumps({**dead, "pid": __import__("os").getpid(), "start": None}))
    _, fake = _script([0.1, 0.2, 0.1])
    monkeypatch.setattr(tuner, "run_trial", fake)
    tuner.tune_job(
        JOB, out=tmp_path / "a.yaml", cache_dir=tmp_path / "c", levers=["precision"], skip=["Fused"], verbose=False
    )
    assert not left.exists()  # before: left there for good, checkpoints and all
    assert (users / "notes.txt").read_text() == "mine" and (alive / "owner-node0.json").is_file()

    # the same job's own folder, left by a killed run of it, is taken over (not refused) by the next run
    monkeypatch.setattr(tuner, "run_trial", _script([0.1, 0.2, 0.1])[1])
    res = tuner.tune_job(
        JOB, out=tmp_path / "a.yaml", cache_dir=tmp_path / "c2", levers=["precision"], skip=["Fused"], verbose=False
    )
    own = tmp_path / f".tune-{res.fingerprint}"
    (own / "t0").mkdir(parents=True)
    (own / "owner-node0.json").write_text(json.dumps(dead))
    monkeypatch.setattr(tuner, "run_trial", _script([0.1, 0.2, 0.1])[1])
    again = tuner.tune_job(
        JOB,
        out=tmp_path / "a.yaml",
        cache_dir=tmp_path / "c2",
        use_cache=False,
        levers=["precision"],
        skip=["Fused"],
        verbose=False,
    )
    assert again.trials[0].decision == "baseline" and not own.exists()


@pytest.mark.parametrize(
    ("trainer_kwargs", "seed", "kind", "message"),
    [
        ({}, "seven", TypeError, "`seed` must be an integer >= 0 and <= 4294967295, got 'seven' (str)."),
        ({}, -3, ValueError, "`seed` must be an integer >= 0 and <= 4294967295, got -3."),
        ("cpu", 0, TypeError, "`trainer_kwargs` must be a mapping of Trainer arguments or None, got str ('cpu')."),
    ],
)
def test_tune_refuses_a_bad_seed_or_trainer_kwargs_in_one_line_before_any_trial(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trainer_kwargs: Any, seed: Any, kind: type, message: str
) -> None:
    # before: a bad seed failed the baseline trial as "`seed_everything` ... Given value: seven" or numpy's bounds
    # error, and trainer_kwargs="cpu" raised "dictionary update sequence element #0 has length 1; 2 is required"
    seen, fake = _script([0.1])
    monkeypatch.setattr(tuner, "run_trial", fake)
    with pytest.raises(kind) as e:
        tuner.tune(trainer_kwargs, JOB["model"], None, seed=seed, out=None, cache_dir=tmp_path, verbose=False)
    assert str(e.value).startswith(message) and "\n" not in str(e.value) and seen == []


def test_tune_cli_refuses_an_empty_levers_list_and_an_out_named_as_a_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before: `--levers ""` (an empty shell variable) tried every lever, and `--out results/` wrote the tuned config
    # as a file named `results`, its reports in the folder above
    from lightning_accel.tune.cli import main

    seen, fake = _script([0.1] * 9)
    monkeypatch.setattr(tuner, "run_trial", fake)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(json.dumps(JOB))
    base = ["--config", "job.yaml", "--cache-dir", str(tmp_path / "c")]
    assert main([*base, "--levers", "", "--out", "tuned.yaml"]) == 2
    err = capsys.readouterr().err
    assert "`--levers` must name at least one lever" in err and err.count("\n") == 1
    assert main([*base, "--levers", "precision", "--out", "results/"]) == 2
    err = capsys.readouterr().err
    assert (
        "`--out` 'results/' names a folder. Pass the path of the YAML to write in it, e.g. `--out results/tuned.yaml`."
        in err
    )
    assert seen == [] and sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]
    with pytest.raises(ValueError, match=r"^`out` 'results/' names a folder"):
        tuner.tune_job(JOB, out="results/", levers=["precision"], cache_dir=tmp_path / "c", verbose=False)


def test_ctrl_c_while_the_outputs_are_written_leaves_them_whole(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # a Ctrl-C right after tuned.yaml was written stopped the tune before its reports: the new tuned.yaml stood
    # beside the reports of the tune before it
    import signal

    from lightning_accel._utils import atomic

    out = tmp_path / "tuned.yaml"
    first = _tune(monkeypatch, tmp_path, [0.1, 0.2, 0.1])[1]
    tuner.write_outputs(first, out)  # the reports of an earlier tune of this folder
    before = {p.name: p.read_bytes() for p in tmp_path.glob("tune_report.*")}
    real, writes = atomic.atomic_write_text, []

    def write_then_interrupt(path: Any, text: str, **kwargs: Any) -> None:
        real(path, text, **kwargs)
        writes.append(Path(path).name)
        if len(writes) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C between the first file and the next

    second = _tune(monkeypatch, tmp_path, [0.1, 0.05, 0.1])[1]
    assert second.chosen != first.chosen
    monkeypatch.setattr(atomic, "atomic_write_text", write_then_interrupt)
    with ctrl_c_by_default(), pytest.raises(KeyboardInterrupt):
        tuner.write_outputs(second, out)
    assert writes == ["tuned.yaml", "tune_report.json", "tune_report.md"]  # the set went out whole, then Ctrl-C
    report = json.loads((tmp_path / "tune_report.json").read_text())
    assert report["chosen"] == second.chosen and "kept: precision" in out.read_text().splitlines()[0]
    assert (tmp_path / "tune_report.png").read_bytes() != before["tune_report.png"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("flag", "keyword", "said"),
    [("--cache-dir", "cache_dir", "or leave `--cache-dir` out"), ("--out", "out", "e.g. 'tuned/tuned.yaml'.")],
)
def test_an_empty_path_is_refused_not_taken_for_the_default(
    flag: str, keyword: str, said: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    # `--cache-dir "$CACHE"` with CACHE unset: the results went to ~/.cache without a word
    from lightning_accel.tune.cli import main

    monkeypatch.chdir(tmp_path)
    seen, fake = _script([0.1] * 9)
    monkeypatch.setattr(tuner, "run_trial", fake)
    with pytest.raises(ValueError, match=f"`{keyword}` must be a path, got ''"):
        tuner.tune_job(JOB, **{"out": None, "cache_dir": "c", keyword: ""}, verbose=False)
    (tmp_path / "job.yaml").write_text(json.dumps(JOB))
    argv = ["--config", "job.yaml", "--out", "tuned.yaml", "--cache-dir", "c", "--levers", "precision"]
    argv[argv.index(flag) + 1] = ""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"`{flag}` must be a path, got ''" in err and said in err, err
    assert seen == [] and sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]
