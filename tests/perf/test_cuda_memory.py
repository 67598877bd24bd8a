"""Allocator settings, fragmentation and snapshots, with injected environment/stats (runs on CPU)."""

from __future__ import annotations

import pickle

import pytest

from lightning_accel.perf import (
    AllocatorSettings,
    apply_allocator_settings,
    dump_memory_snapshot,
    fragmentation_stats,
    should_release,
)
from lightning_accel.perf.cuda_memory import merge_alloc_conf, parse_alloc_conf

GB = 1 << 30


def test_settings_string_and_validation() -> None:
    s = AllocatorSettings()
    assert s.as_dict() == {
        "expandable_segments": "True",
        "max_split_size_mb": "256",
        "garbage_collection_threshold": "0.8",
    }
    assert AllocatorSettings(None, None, None).as_dict() == {}
    with pytest.raises(ValueError, match="`max_split_size_mb`.*got 4"):
        AllocatorSettings(max_split_size_mb=4)
    with pytest.raises(ValueError, match="`garbage_collection_threshold`"):
        AllocatorSettings(garbage_collection_threshold=1.5)
    # a string from YAML is truthy: it must be refused, never read as "on"
    with pytest.raises(TypeError, match="`expandable_segments` must be True or False, got 'false'"):
        AllocatorSettings(expandable_segments="false")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`expandable_segments` must be True or False, got 0"):
        AllocatorSettings(expandable_segments=0)  # type: ignore[arg-type]


def test_parse_and_merge() -> None:
    assert parse_alloc_conf("a:1, b:2,") == {"a": "1", "b": "2"}
    with pytest.raises(ValueError, match="key:value"):
        parse_alloc_conf("expandable_segments")
    conf, over = merge_alloc_conf("backend:native,max_split_size_mb:128", {"max_split_size_mb": "256"})
    assert conf == "backend:native,max_split_size_mb:256" and over == ["max_split_size_mb"]


def test_apply_before_cuda_init_sets_env_and_runtime() -> None:
    env: dict[str, str] = {"PYTORCH_CUDA_ALLOC_CONF": "backend:native"}
    seen: list[str] = []
    res = apply_allocator_settings(
        AllocatorSettings(), environ=env, cuda_initialized=lambda: False, runtime_setter=seen.append
    )
    want = "backend:native,expandable_segments:True,max_split_size_mb:256,garbage_collection_threshold:0.8"
    assert env["PYTORCH_ALLOC_CONF"] == want and env["PYTORCH_CUDA_ALLOC_CONF"] == want
    assert seen == [want]
    assert res.env_set and res.runtime_set and not res.cuda_was_initialized and res.messages == []


def test_apply_after_cuda_init_says_what_did_not_take_effect() -> None:
    env: dict[str, str] = {}
    res = apply_allocator_settings(
        AllocatorSettings(expandable_segments=None), environ=env, cuda_initialized=lambda: True, runtime_setter=len
    )
    assert env == {}  # the allocator already read the environment: writing it would be a lie
    assert res.runtime_set and not res.env_set
    assert any("already initialised" in m and "PYTORCH_ALLOC_CONF=" in m for m in res.messages)


def test_apply_reports_a_rejecting_runtime_setter() -> None:
    def reject(conf: str) -> None:
        raise RuntimeError("Unrecognized key")

    res = apply_allocator_settings(
        AllocatorSettings(), environ={}, cuda_initialized=lambda: True, runtime_setter=reject
    )
    assert not res.runtime_set
    assert any("rejected" in m for m in res.messages)


def test_fragmentation_from_memory_stats_dict() -> None:
    stats = {
        "allocated_bytes.all.current": 3 * GB,
        "reserved_bytes.all.current": 4 * GB,
        "inactive_split_bytes.all.current": GB // 2,
        "num_alloc_retries": 7,
        "num_ooms": 1,
    }
    f = fragmentation_stats(stats)
    assert f.fragmentation == pytest.approx(0.25)
    assert (f.inactive_split, f.alloc_retries, f.ooms) == (GB // 2, 7, 1)
    m = f.as_metrics()
    assert m["mem/reserved_gb"] == pytest.approx(4 * GB / 1e9) and m["mem/alloc_retries"] == 7.0
    assert fragmentation_stats({}).fragmentation == 0.0
    assert should_release(f, threshold=0.2)
    assert not should_release(f, threshold=0.3)
    assert not should_release(f, threshold=None)
    assert not should_release(f, threshold=0.2, min_reserved_bytes=8 * GB)


def test_dump_snapshot_is_atomic_pickle(tmp_path) -> None:
    snap = {"segments": [], "device_traces": []}
    p = dump_memory_snapshot(tmp_path / "oom.pickle", snapshot=lambda: snap)
    with open(p, "rb") as f:
        assert pickle.load(f) == snap  # our own file, written just now by the test
    assert [x.name for x in tmp_path.iterdir()] == ["oom.pickle"]


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_malformed_environment_conf_names_its_variable(name: str) -> None:
    """`expandable_segments=True` (an `=` for the `:`) in the environment failed with a message that named neither
    the variable nor where the string came from."""
    env = {name: "expandable_segments=True"}
    with pytest.raises(ValueError, match=rf"^`{name}` in the environment is 'expandable_segments=True', which is not"):
        apply_allocator_settings(
            AllocatorSettings(), environ=env, cuda_initialized=lambda: False, runtime_setter=lambda conf: None
        )
    assert env == {name: "expandable_segments=True"}  # left as it was
