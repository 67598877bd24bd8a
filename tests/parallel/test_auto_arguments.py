"""``AutoStrategy`` argument checks that need no Trainer: one line at construction, naming the argument."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_accel.parallel.strategies import AutoStrategy


@pytest.mark.parametrize("empty", [[], ()])
def test_an_empty_candidates_list_is_refused_with_the_fix(empty: Any) -> None:
    # it meant "every plan", like None, while reading as "time no plan"
    with pytest.raises(ValueError, match=r"^`candidates` must be a non-empty list of plan names \(of 'ddp', ") as e:
        AutoStrategy(policy="measure", candidates=empty)
    msg = str(e.value)
    assert "\n" not in msg and f"got {empty!r}. Use None to time every plan the memory estimate lets fit." in msg


def test_none_and_a_list_of_plans_are_accepted() -> None:
    assert AutoStrategy(policy="measure", candidates=None).candidates is None
    assert AutoStrategy(policy="measure", candidates=["ddp", "fsdp"]).candidates == ["ddp", "fsdp"]


def test_candidates_without_the_measuring_policy_are_said_to_be_unused() -> None:
    # kept and never read: the default policy plans from the memory estimate
    with pytest.warns(UserWarning, match=r"`candidates` \['ddp'\] are timed only with policy='measure'") as rec:
        AutoStrategy(candidates=["ddp"])
    assert len(rec) == 1 and "\n" not in str(rec[0].message)


def test_a_plan_listed_twice_in_candidates_is_refused_with_the_list_to_pass() -> None:
    # the trial would time it twice (real training steps each) and list it twice in its table
    with pytest.raises(ValueError, match=r"^`candidates` must name each plan once, got \['ddp', 'fsdp', 'ddp'\]") as e:
        AutoStrategy(policy="measure", candidates=["ddp", "fsdp", "ddp"])
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("('ddp' more than once). Pass ['ddp', 'fsdp'].")
    assert AutoStrategy(policy="measure", candidates=["fsdp", "ddp"]).candidates == ["fsdp", "ddp"]


@pytest.mark.parametrize(
    ("path", "what"), [("", "an empty path"), (" ", "an empty path"), ("FOLDER", "an existing folder")]
)
def test_a_trial_cache_that_cannot_be_a_file_is_refused_in_init(path: str, what: str, tmp_path: Path) -> None:
    # the trial would run its timed steps and then keep nothing, with only a warning after it
    path = str(tmp_path) if path == "FOLDER" else path
    with pytest.raises(ValueError, match=r"^`trial_cache` must be a path to a JSON file or None, got ") as e:
        AutoStrategy(policy="measure", trial_cache=path)
    msg = str(e.value)
    assert "\n" not in msg and f"got {path!r} ({what}). Pass a file path, e.g. `trial_cache='trials.json'`." in msg
    assert AutoStrategy(policy="measure", trial_cache=tmp_path / "trials.json").trial_cache.path is not None
