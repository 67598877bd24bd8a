"""The levers as config edits: each option sets what it says on a copy of the job and leaves the rest alone."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.tune.levers import has_checkpoints, job_precision, options_for, world_of

JOB: dict[str, Any] = {
    "seed_everything": 0,
    "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_epochs": 1},
    "model": {"class_path": "lightning_accel.models.ImageClassifier", "init_args": {"width": 4}},
    "data": {
        "class_path": "lightning_accel.datasets.DigitsDataModule",
        "init_args": {"data_dir": "digits", "batch_size": 16, "num_workers": 0},
    },
}


def _by_name(lever: str, job: dict[str, Any]) -> dict[str, Any]:
    return {o.name: o for o in options_for(lever, job)}


def test_precision_options_and_the_job_left_alone() -> None:
    before = copy.deepcopy(JOB)
    opts = _by_name("precision", JOB)
    assert list(opts) == [
        "precision: bf16-mixed",
        "precision: FusedPrecision(bf16-mixed)",
        "precision: FusedPrecision(bf16-mixed, channels_last)",
        "precision: FusedPrecision(bf16-mixed, compile)",
    ]
    nhwc = opts["precision: FusedPrecision(bf16-mixed, channels_last)"].apply(JOB)
    assert nhwc["trainer"]["plugins"][0]["init_args"] == {"precision": "bf16-mixed", "memory_format": "channels_last"}
    bf16 = opts["precision: bf16-mixed"].apply(JOB)
    assert bf16["trainer"]["precision"] == "bf16-mixed" and job_precision(bf16) == "bf16-mixed"
    fused = opts["precision: FusedPrecision(bf16-mixed, compile)"].apply(bf16)
    assert "precision" not in fused["trainer"]  # the plugin carries it; Trainer(precision=..., plugins=[it]) raises
    assert fused["trainer"]["plugins"] == [
        {
            "class_path": "lightning_accel.plugins.FusedPrecision",
            "init_args": {"precision": "bf16-mixed", "compile": True},
        }
    ]
    assert "precision: 32-true" in _by_name("precision", bf16)
    assert before == JOB


def test_strategy_options_only_name_what_is_not_configured() -> None:
    opts = _by_name("strategy", JOB)
    assert list(opts) == ["strategy: ddp_1bit", 'strategy: AutoStrategy(policy="measure")']
    auto = opts['strategy: AutoStrategy(policy="measure")'].apply(JOB)
    assert auto["trainer"]["strategy"] == {
        "class_path": "lightning_accel.strategies.AutoStrategy",
        "init_args": {"policy": "measure"},
    }
    assert world_of(JOB) == 2 and world_of({"trainer": {"devices": 1, "num_nodes": 3}}) == 3


def test_checkpoint_options_replace_the_checkpoint_io() -> None:
    assert has_checkpoints(JOB) and not has_checkpoints({"trainer": {"enable_checkpointing": False}})
    opts = _by_name("checkpoint", JOB)
    assert list(opts) == [
        "checkpoint: DeltaCheckpointIO(async_save=False)",
        "checkpoint: DeltaCheckpointIO(async_save=True)",
    ]
    delta = opts["checkpoint: DeltaCheckpointIO(async_save=True)"].apply(JOB)
    assert delta["trainer"]["plugins"] == [
        {"class_path": "lightning_accel.plugins.DeltaCheckpointIO", "init_args": {"async_save": True}}
    ]
    back = _by_name("checkpoint", delta)["checkpoint: torch.save"].apply(delta)
    assert "plugins" not in back["trainer"]


def test_data_options_swap_an_image_folder_for_the_cache_and_try_workers(tmp_path: Path) -> None:
    opts = _by_name("data", JOB)
    assert "data: CachedDataModule over the image folder" in opts and "data: num_workers=0" not in opts
    swapped = opts["data: CachedDataModule over the image folder"].apply(JOB)
    init = swapped["data"]["init_args"]
    assert swapped["data"]["class_path"] == "lightning_accel.data.CachedDataModule"
    assert init["origin"] == str(Path("digits").resolve()) and init["batch_size"] == 16 and init["num_workers"] == 0
    assert init["mean"] == [0.188, 0.188, 0.188]  # the digits' statistics, as the module it replaces normalises
    assert opts["data: CachedDataModule over the image folder"].reorders
    # a plain torchvision-style folder of class folders, read by a module of any class with a `data_dir`
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.jpg").write_bytes(b"\xff\xd8")
    other = {"data": {"class_path": "benchmarks._tune_jobs.ImageFolderData", "init_args": {"data_dir": str(tmp_path)}}}
    assert "data: CachedDataModule over the image folder" in _by_name("data", other)


def test_batch_option_doubles_the_batch_and_scales_the_learning_rate() -> None:
    (opt,) = options_for("batch", JOB)
    assert opt.samples_ratio == 2
    big = opt.apply(JOB)
    assert big["data"]["init_args"]["batch_size"] == 32
    assert big["trainer"]["callbacks"] == [
        {"class_path": "lightning_accel.callbacks.LinearScalingLR", "init_args": {"base_batch_size": 32}}
    ]  # the configured global batch: 16 per device x 2 devices


def test_batch_option_keeps_the_jobs_own_linear_scaling_base() -> None:
    # the job's rate was tuned for a global batch of 256 and scaled by 32 / 256; twice the batch must scale it by
    # 64 / 256 -- a base of the current global batch (32) would scale the already scaled rate again
    own = {"class_path": "lightning_accel.callbacks.LinearScalingLR", "init_args": {"base_batch_size": 256}}
    given = {
        "class_path": "lightning_accel.callbacks.LinearScalingLR",
        "init_args": {"base_batch_size": 8, "batch_size": 16},
    }
    for cb, after in ((own, own["init_args"]), (given, {"base_batch_size": 8, "batch_size": 32})):
        job = {**JOB, "trainer": {**JOB["trainer"], "callbacks": [cb]}}
        (opt,) = options_for("batch", job)
        big = opt.apply(job)
        assert big["data"]["init_args"]["batch_size"] == 32
        assert big["trainer"]["callbacks"] == [{"class_path": cb["class_path"], "init_args": after}]
        assert job["trainer"]["callbacks"] == [cb]  # the job itself left alone


def test_an_unknown_lever_is_refused() -> None:
    with pytest.raises(ValueError, match="`lever` must be one of"):
        options_for("magic", JOB)


def test_lever_options_edit_the_users_own_plugin_and_keep_its_other_arguments() -> None:
    io = {
        "class_path": "lightning_accel.plugins.DeltaCheckpointIO",
        "init_args": {"async_save": True, "quantize": "int8", "redundancy": 2, "storage_options": {"anon": True}},
    }
    fp = {
        "class_path": "lightning_accel.plugins.FusedPrecision",
        "init_args": {"precision": "bf16-mixed", "ignore_modules": ["head"], "fusions": ["conv_bn"]},
    }
    job = {**JOB, "trainer": {**JOB["trainer"], "plugins": [fp, io]}}
    before = copy.deepcopy(job)
    sync = _by_name("checkpoint", job)["checkpoint: DeltaCheckpointIO(async_save=False)"].apply(job)
    assert sync["trainer"]["plugins"] == [fp, {**io, "init_args": {**io["init_args"], "async_save": False}}]
    nhwc = _by_name("precision", job)["precision: FusedPrecision(bf16-mixed, channels_last)"].apply(job)
    assert nhwc["trainer"]["plugins"] == [
        {**fp, "init_args": {**fp["init_args"], "memory_format": "channels_last"}},
        io,
    ]
    compiled = _by_name("precision", nhwc)["precision: FusedPrecision(bf16-mixed, compile)"].apply(nhwc)
    assert compiled["trainer"]["plugins"][0]["init_args"] == {**fp["init_args"], "compile": True}
    assert job == before


FUSED = "lightning_accel.plugins.FusedPrecision"


@pytest.mark.parametrize(
    ("trainer", "left_out"),
    [
        ({"precision": 32}, "precision: 32-true"),
        ({"precision": "32"}, "precision: 32-true"),
        ({"precision": "bf16"}, "precision: bf16-mixed"),
        (
            {"plugins": [{"class_path": FUSED, "init_args": {"precision": "bf16-mixed"}}]},
            "precision: FusedPrecision(bf16-mixed)",
        ),
        (
            {"plugins": [FUSED]},  # a bare class path: the plugin's defaults
            "precision: FusedPrecision(bf16-mixed)",
        ),
    ],
)
def test_the_precision_lever_never_offers_the_jobs_own_setting(trainer: dict[str, Any], left_out: str) -> None:
    names = list(_by_name("precision", {**JOB, "trainer": trainer}))
    assert left_out not in names and len(names) == 4


@pytest.mark.parametrize(
    ("devices", "world"), [("0,1", 2), ("0,1,2,3", 4), ("1,", 1), (" 3 ", 3), ([0, 1], 2), ("auto", 1), (-1, 1)]
)
def test_world_of_reads_devices_as_lightning_does(devices: Any, world: int) -> None:
    assert world_of({"trainer": {"accelerator": "gpu", "devices": devices}}) == world
    assert world_of({"trainer": {"devices": devices, "num_nodes": 2}}) == 2 * world


def test_host_memory_option_adds_the_callback_on_a_cpu_job_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_accel._utils import malloc

    monkeypatch.setattr(malloc, "can_keep_freed_memory", lambda: True)
    job = copy.deepcopy(JOB)
    job["trainer"]["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}]
    (opt,) = options_for("host_memory", job)
    tuned = opt.apply(job)
    assert [c["class_path"] for c in tuned["trainer"]["callbacks"]] == [
        "lightning.pytorch.callbacks.LearningRateMonitor",
        "lightning_accel.callbacks.HostMemoryManager",
    ]
    assert job["trainer"]["callbacks"] == [{"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}]
    # nothing to try: the job has one already, trains on a GPU, or the C library is not glibc
    assert options_for("host_memory", tuned) == []
    assert options_for("host_memory", {**job, "trainer": {**job["trainer"], "accelerator": "gpu"}}) == []
    monkeypatch.setattr(malloc, "can_keep_freed_memory", lambda: False)
    assert options_for("host_memory", job) == []


def test_the_host_memory_callback_the_option_adds_is_built_by_the_cli(tmp_path: Path) -> None:
    """The entry the option writes is a `class_path:` the CLI resolves, with the callback's defaults."""
    from lightning_accel._utils.imports import import_object
    from lightning_accel.callbacks import HostMemoryManager

    (opt,) = [o for o in options_for("host_memory", JOB)] or [None]
    if opt is None:
        pytest.skip("not glibc: the option is not offered here")
    entry = opt.apply(copy.deepcopy(JOB))["trainer"]["callbacks"][-1]
    assert import_object(entry["class_path"]) is HostMemoryManager
