"""AutoStrategy inside a Trainer: keeps DDP when it fits, swaps to the chosen strategy at setup, and from the CLI is
resolved before the Trainer is built."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ParallelStrategy, StrategyRegistry
from torch import nn

import lightning_accel.parallel.strategies.auto as auto_mod
from lightning_accel._utils.patching import patch
from lightning_accel.parallel import AutoStrategy, PipelineStrategy, ShardedStrategy
from lightning_accel.parallel.callbacks import ChoiceCheck
from lightning_accel.parallel.select import StrategyChoice
from lightning_accel.parallel.strategies import resolve_trainer_kwargs, trainer_devices


class Deep(pl.LightningModule):
    """60 tiny layers: the rules policy calls for a pipeline (runnable as FSDP)."""

    def __init__(self, depth: int = 60) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)])
        self.example_input_array = torch.zeros(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=4)


def trainer(strategy: Any, callbacks: list[Callback] | None = None, **kw: Any) -> pl.Trainer:
    args: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    args.update(kw)
    return pl.Trainer(strategy=strategy, callbacks=callbacks or [], **args)


def test_keeps_ddp_when_it_fits() -> None:
    st = AutoStrategy(device_memory_bytes=10**9, example_batch_size=16)
    t = trainer(st)
    t.fit(Deep(depth=3), loader())
    assert t.strategy is st and isinstance(t.strategy, DDPStrategy)
    assert st.choice is not None and st.choice.strategy == "auto" and st.choice.fits
    assert st.choice.facts["activations"] > 0  # measured on example_input_array, scaled to the real batch
    assert t.global_step == 3


class Stop(Exception):
    pass


class Inspect(Callback):
    """Records the strategy the Trainer uses after setup_environment, then stops before FSDP wraps (needs a GPU)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        s = trainer.strategy
        assert isinstance(s, ParallelStrategy)
        self.seen = (type(s), type(s.precision_plugin).__name__, s.parallel_devices, s.launcher, s.lightning_module)
        raise Stop


def _force(st: AutoStrategy, name: str) -> AutoStrategy:
    """Make ``st`` choose ``name`` (the estimate itself is tested in test_select.py)."""
    forced = StrategyChoice(name, name, True, f"forced {name}", "memory")
    patch(st, "_choose", lambda p: lambda *a, **k: forced)
    return st


def test_swaps_to_fsdp_at_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto_mod, "_fsdp_runs_on", lambda device: True)  # torch's FSDP1 itself needs a GPU
    st = _force(AutoStrategy(fsdp_kwargs={"cpu_offload": False}), "fsdp")
    spy = Inspect()
    t = trainer(st, [spy])
    model = Deep()
    with pytest.raises(Stop):
        t.fit(model, loader())
    cls, prec, devices, launcher, module = spy.seen
    assert cls is FSDPStrategy and prec == "FSDPPrecision"
    assert devices == st.parallel_devices and launcher is st.launcher and module is model
    assert st.choice is not None and st.choice.plan == "fsdp" and st.chosen is t.strategy


def test_swaps_to_the_sharded_strategy_on_cpu() -> None:
    st = _force(AutoStrategy(), "fsdp")
    t = trainer(st)
    t.fit(Deep(depth=3), loader())
    assert isinstance(t.strategy, ShardedStrategy) and t.strategy.applied == {"fsdp_units": 3} and t.global_step == 3


def test_the_tensor_parallel_sizes_of_sharded_kwargs_leave_a_chosen_fsdp_sharded_over_every_rank() -> None:
    kwargs = {"tensor_parallel_size": 2, "tp_plan": {"net.0": "colwise"}, "reshard_after_forward": False}
    fsdp = _force(AutoStrategy(sharded_kwargs=kwargs), "fsdp").resolve(Deep(depth=3), accelerator="cpu", devices=2)
    # what the "fsdp" estimate and trial describe (a tensor-parallel run before), with the other keywords kept
    assert isinstance(fsdp, ShardedStrategy) and (fsdp.tensor_parallel_size, fsdp.data_parallel_size) == (1, None)
    assert fsdp.tp_plan is None and fsdp.reshard_after_forward is False
    tp = _force(AutoStrategy(sharded_kwargs=kwargs), "tp").resolve(Deep(depth=3), accelerator="cpu", devices=2)
    assert isinstance(tp, ShardedStrategy) and tp.tensor_parallel_size == 2 and tp.tp_plan == {"net.0": "colwise"}


def test_fsdp1_on_cpu_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="cannot run on `cpu`"):
        trainer(_force(AutoStrategy(fsdp_kwargs={"cpu_offload": False}), "fsdp")).fit(Deep(), loader())


def test_a_plan_that_fits_nowhere_is_refused_with_the_estimate() -> None:
    st = AutoStrategy(device_memory_bytes=500)
    with pytest.raises(ValueError, match=r"no plan fits in memory.*Nothing fits in .*allow_unfit=True"):
        st.resolve(Deep(depth=3), accelerator="cpu", devices=2)
    loose = AutoStrategy(device_memory_bytes=500, allow_unfit=True)
    with pytest.warns(UserWarning, match="no plan fits"):
        built = loose.resolve(Deep(depth=3), accelerator="cpu", devices=2)
    assert loose.choice is not None
    ests = loose.choice.estimates
    # the smallest estimate runs: FSDP here, the pipeline's activations being those of the global batch it runs
    assert loose.choice.plan == min((k for k in ests if not ests[k].blocker), key=lambda k: ests[k].total) == "fsdp"
    assert isinstance(built, ShardedStrategy)


def test_pipeline_registered_and_bad_arguments() -> None:
    import lightning_accel  # noqa: F401  (registers the name)

    assert "pipeline" in StrategyRegistry
    with pytest.raises(ValueError, match="`schedule`"):
        PipelineStrategy(schedule="zigzag")
    with pytest.raises(ValueError, match=r"`stages_per_rank`=1 with `schedule`='interleaved1f1b'"):
        PipelineStrategy(schedule="interleaved1f1b", stages_per_rank=1)
    with pytest.raises(ValueError, match="`tensor_parallel_size`"):
        ShardedStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="`trial_steps`"):
        AutoStrategy(policy="measure", trial_steps=0)


def test_pipeline_on_an_unsplittable_module_names_it() -> None:
    class Opaque(Deep):
        def __init__(self) -> None:
            super().__init__(depth=2)
            self.net = nn.ModuleDict({"a": nn.Linear(8, 8)})  # type: ignore[assignment]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net["a"](x)  # type: ignore[call-overload]

    with pytest.raises(TypeError, match=r"cannot split `Opaque`: it needs the pieces of its forward"):
        trainer(PipelineStrategy()).fit(Opaque(), loader())


def test_ddp_1bit_resolves_by_registered_name(monkeypatch: pytest.MonkeyPatch) -> None:
    st = AutoStrategy()
    if "ddp_1bit" not in StrategyRegistry:

        class Fake1Bit(DDPStrategy):
            pass

        monkeypatch.setitem(StrategyRegistry, "ddp_1bit", {"strategy": Fake1Bit, "init_params": {}, "description": ""})
    built = st._build("ddp_1bit", None)
    assert isinstance(built, DDPStrategy)
    # Not monkeypatch.delitem: it saves the old value with `registry.get(name)`, which the registry overrides to
    # *instantiate* the strategy, so the "restored" entry would be a strategy object instead of its record.
    saved = dict.pop(StrategyRegistry, "ddp_1bit")
    try:
        with pytest.warns(UserWarning, match="no strategy of that name is registered"):
            assert st._build("ddp_1bit", None) is None
    finally:
        dict.__setitem__(StrategyRegistry, "ddp_1bit", saved)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`policy`"):
        AutoStrategy(policy="magic")
    with pytest.raises(ValueError, match="`example_batch_size`"):
        AutoStrategy(example_batch_size=0)
    # checked where they are written, on every rank (the choice itself runs on rank 0 only)
    for kwargs in ({"headroom": 1.5}, {"device_memory_bytes": -1}, {"inter_node_gbps": 0}, {"bytes_per_param": 0}):
        with pytest.raises(ValueError, match=f"`{next(iter(kwargs))}`"):
            AutoStrategy(**kwargs)
    with pytest.raises(TypeError, match="`bytes_per_param`"):
        AutoStrategy(bytes_per_param="16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`microbatches`"):
        AutoStrategy(pipeline_kwargs={"microbatches": 0})
    with pytest.raises(ValueError, match="`stages_per_rank`=2 with `schedule`='gpipe'"):
        AutoStrategy(pipeline_kwargs={"schedule": "gpipe", "stages_per_rank": 2})
    with pytest.raises(ValueError, match="`pipeline_size`"):
        AutoStrategy(pipeline_kwargs={"pipeline_size": 0})


def test_a_misspelled_fsdp_keyword_is_refused_where_it_is_written() -> None:
    # FSDP is built at setup on GPUs only: without this check the key would fail there, or never
    with pytest.raises(ValueError, match=r"`fsdp_kwargs`.*`cpu_oflload`=True.*`cpu_oflload` -> `cpu_offload`"):
        AutoStrategy(fsdp_kwargs={"cpu_oflload": True})
    with pytest.raises(ValueError, match="`device_id`"):  # FSDPStrategy passes it itself: it would arrive twice
        AutoStrategy(fsdp_kwargs={"device_id": 0})
    # FSDPStrategy's own keywords and FullyShardedDataParallel's, where its **kwargs go
    st = AutoStrategy(fsdp_kwargs={"cpu_offload": False, "sharding_strategy": "FULL_SHARD", "limit_all_gathers": True})
    assert st.fsdp_kwargs["limit_all_gathers"] is True


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fsdp_kwargs": ["cpu_offload"]}, r"`fsdp_kwargs` must be a dict .*got \['cpu_offload'\] \(list\)"),
        ({"pipeline_kwargs": "gpipe"}, r"`pipeline_kwargs` must be a dict .*got 'gpipe' \(str\)"),
        ({"sharded_kwargs": [("tensor_parallel_size", 2)]}, r"`sharded_kwargs` must be a dict"),
        ({"sharded_kwargs": {"reshard_after_forward": "no"}}, r"`reshard_after_forward` must be True or False"),
    ],
)
def test_keyword_dicts_of_the_wrong_type_are_refused_naming_the_argument(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        AutoStrategy(**kwargs)


def test_lightning_cli_instantiates_it(tmp_path: Path) -> None:
    from lightning_accel.cli import AccelCLI

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n"
        "  strategy:\n    class_path: lightning_accel.parallel.AutoStrategy\n"
        "    init_args: {policy: memory, device_memory_bytes: 1000000000, example_batch_size: 64}\n"
        "model:\n  class_path: lightning_accel.models.ImageClassifier\n  init_args: {width: 8}\n"
        "data:\n  class_path: lightning_accel.datasets.DigitsDataModule\n"
        f"  init_args: {{data_dir: {tmp_path / 'd'}}}\n"
    )
    cli = AccelCLI(args=["--config", str(cfg)], run=False)
    st = cli.trainer.strategy
    assert isinstance(st, AutoStrategy) and st.device_memory_bytes == 10**9 and st.example_batch_size == 64


def _cli_config(tmp_path: Path, trainer: str, strategy_args: str) -> Path:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"trainer:\n  accelerator: cpu\n  logger: false\n{trainer}"
        "  strategy:\n    class_path: lightning_accel.parallel.AutoStrategy\n"
        f"    init_args: {{{strategy_args}}}\n"
        "model:\n  class_path: tests.parallel.test_strategy_integration.Deep\n  init_args: {depth: 3}\n"
        "data:\n  class_path: lightning.pytorch.demos.boring_classes.BoringDataModule\n"
    )
    return cfg


def test_cli_resolves_before_the_trainer_is_built(tmp_path: Path) -> None:
    from lightning_accel.cli import AccelCLI
    from lightning_accel.comm.strategy import OneBitDDPStrategy

    # two nodes on a very slow link: DDP fits, and 1-bit compression pays off
    cfg = _cli_config(
        tmp_path, "  devices: 1\n  num_nodes: 2\n", "device_memory_bytes: 1000000000, inter_node_gbps: 1.0e-9"
    )
    cli = AccelCLI(args=["--config", str(cfg)], run=False)
    auto = cli.config_init["trainer"]["strategy"]
    assert isinstance(auto, AutoStrategy) and auto.choice is not None and auto.choice.strategy == "ddp_1bit"
    # the Trainer was built with the chosen strategy: no swap at setup, no private Lightning API
    assert isinstance(cli.trainer.strategy, OneBitDDPStrategy) and auto.chosen is cli.trainer.strategy
    assert cli.trainer.num_nodes == 2
    checks = [c for c in cli.trainer.callbacks if isinstance(c, ChoiceCheck)]  # type: ignore[attr-defined]
    assert len(checks) == 1 and checks[0].strategy == "ddp_1bit"


def test_cli_resolves_the_pipeline_plan_before_building_the_trainer(tmp_path: Path) -> None:
    from lightning_accel.cli import AccelCLI

    cfg = _cli_config(tmp_path, "  devices: 2\n", "policy: rules")
    cfg.write_text(cfg.read_text().replace("{depth: 3}", "{depth: 60}"))
    cli = AccelCLI(args=["--config", str(cfg)], run=False)
    assert isinstance(cli.trainer.strategy, PipelineStrategy)


def test_resolve_keeps_itself_when_ddp_fits_and_setup_does_not_choose_again() -> None:
    st = AutoStrategy(device_memory_bytes=10**9, example_batch_size=16)
    model = Deep(depth=3)
    assert st.resolve(model, accelerator="cpu", devices=1) is st and st.chosen is st
    first = st.choice
    assert first is not None and first.strategy == "auto"
    t = trainer(st)
    t.fit(model, loader())
    assert t.strategy is st and st.choice is first and t.global_step == 3


class CountsTrials(AutoStrategy):
    trials = 0

    def _measure(self, model: pl.LightningModule, memory_choice: StrategyChoice) -> StrategyChoice:
        self.trials += 1
        return super()._measure(model, memory_choice)


class DeepValidates(Deep):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[0]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


def test_validate_test_and_predict_after_fit_keep_the_choice_without_timing_again() -> None:
    st = CountsTrials("measure", device_memory_bytes=10**9, trial_steps=1, candidates=["ddp"])
    model = DeepValidates(depth=3)
    t = trainer(st)
    t.fit(model, loader())
    first = st.choice
    assert first is not None and first.policy == "measure" and first.measured and st.trials == 1
    t.validate(model, loader(), verbose=False)
    t.predict(model, loader())
    t.fit(model, loader())  # a second fit of the same module (max_steps reached: nothing more to train)
    # the trained module keeps the plan it was trained with: a second trial could time another plan faster
    assert st.trials == 1 and st.choice is first and t.strategy is st
    t.fit(DeepValidates(depth=3), loader())  # another module is chosen for afresh
    assert st.trials == 2 and st.choice is not first


def test_resolve_trainer_kwargs_leaves_other_strategies_alone() -> None:
    assert resolve_trainer_kwargs({"strategy": "ddp"}, Deep(depth=3)) == {}
    assert resolve_trainer_kwargs({"strategy": AutoStrategy()}, nn.Linear(2, 2)) == {}  # not a LightningModule
    st = AutoStrategy(device_memory_bytes=10**9)
    cb = Callback()
    out = resolve_trainer_kwargs({"strategy": st, "accelerator": "cpu", "devices": 1, "callbacks": cb}, Deep(depth=3))
    assert out["strategy"] is st and out["callbacks"][0] is cb and isinstance(out["callbacks"][1], ChoiceCheck)


def test_choice_check_stops_every_rank_when_the_choices_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    ChoiceCheck("ddp").setup(None, None, "fit")  # type: ignore[arg-type]  # no process group: nothing to compare
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)

    def gather(out: list[Any], obj: Any, group: Any = None) -> None:
        out[:] = [obj, "ddp_1bit"]

    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    ChoiceCheck("ddp_1bit").setup(None, None, "fit")  # type: ignore[arg-type]  # same choice: passes
    with pytest.raises(ValueError, match=r"chose different strategies \(rank 0: 'ddp', rank 1: 'ddp_1bit'\)"):
        ChoiceCheck("ddp").setup(None, None, "fit")  # type: ignore[arg-type]


def test_trainer_devices_resolves_like_the_trainer() -> None:
    assert trainer_devices("cpu", 2) == [torch.device("cpu")] * 2
    assert trainer_devices("cpu", "3") == [torch.device("cpu")] * 3
    assert trainer_devices("cpu") == [torch.device("cpu")]  # devices="auto": one CPU process
    if not torch.cuda.is_available():
        assert trainer_devices("auto", "auto") == [torch.device("cpu")]
    with pytest.raises(ValueError, match="`accelerator`"):
        trainer_devices("abacus", 1)


@pytest.mark.gpu
def test_real_fsdp_swap_on_gpu() -> None:
    st = _force(AutoStrategy(fsdp_kwargs={"cpu_offload": False}), "fsdp")
    t = trainer(st, accelerator="cuda", devices=1)
    t.fit(Deep(), loader())
    assert isinstance(t.strategy, FSDPStrategy) and t.global_step == 3


class FailsToChoose(AutoStrategy):
    """Its choice raises (only rank 0 chooses): a model the estimate cannot take, a file it cannot read."""

    def _choose(self, *args: Any, **kwargs: Any) -> StrategyChoice:
        raise ValueError("the estimate cannot take this model")


def _fail_to_choose(rank: int, world: int) -> str:
    from datetime import timedelta

    try:
        trainer(FailsToChoose(timeout=timedelta(seconds=60)), devices=2).fit(Deep(depth=3), loader())
    except ValueError as e:
        return str(e)
    return "fit"


def test_an_error_while_choosing_raises_on_every_rank() -> None:
    from tests.helpers import run_in_processes

    got = run_in_processes(_fail_to_choose, 2, init_process_group=False, timeout=120)
    assert got == ["the estimate cannot take this model"] * 2  # rank 1 raises it too, instead of waiting


def test_resolve_estimates_the_pipeline_micro_batches_it_builds() -> None:
    st = AutoStrategy(device_memory_bytes=10**9, example_batch_size=16, pipeline_kwargs={"microbatches": 8})
    st.resolve(Deep(depth=4), accelerator="cpu", devices=2)
    assert st.choice is not None
    facts = st.choice.facts
    assert facts["pipeline_microbatches"] == 8  # the `microbatches` the built PipelineStrategy runs
    assert facts["pipeline_activations"] == 2 * facts["activations"]  # its batch: both devices' batches gathered
    gpipe = AutoStrategy(device_memory_bytes=10**9, example_batch_size=16, pipeline_kwargs={"schedule": "gpipe"})
    gpipe.resolve(Deep(depth=4), accelerator="cpu", devices=2)
    assert gpipe.choice is not None and gpipe.choice.facts["pipeline_schedule"] == "gpipe"
    ests = gpipe.choice.estimates["pipeline"], st.choice.estimates["pipeline"]
    # all 4 micro-batches in flight (of 2 x 2), against 2 of 8 for the 1F1B pipeline above
    assert ests[0].activations == pytest.approx(ests[1].activations * (4 / 4) / (2 / 8), rel=1e-3)


class RecordsMicroBatches(Deep):
    def __init__(self) -> None:
        super().__init__(depth=8)
        self.rows: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.rows.append(int(batch[0].shape[0]))  # the pipeline calls it with micro-batches only
        return super().training_step(batch, batch_idx)


def _estimated_and_built_pipeline(rank: int, world: int) -> dict[str, Any]:
    from lightning_accel.parallel import select_strategy

    torch.set_num_threads(1)
    model = RecordsMicroBatches()
    # the memory that fits the pipeline AutoStrategy estimates, and neither DDP nor FSDP
    probe = select_strategy(
        model, devices=2, device_memory_bytes=10**9, example_batch=model.example_input_array, batch_split="world"
    )
    st = AutoStrategy(device_memory_bytes=probe.estimates["pipeline"].total, headroom=0.0, example_batch_size=4)
    t = trainer(st, devices=2, max_steps=1)
    t.fit(model, loader())
    assert st.choice is not None and isinstance(t.strategy, PipelineStrategy) and t.strategy.runner is not None
    return {
        "plan": st.choice.plan,
        "estimated_microbatches": st.choice.facts["pipeline_microbatches"],
        "estimated_activations": st.choice.facts["pipeline_activations"],
        "activations": st.choice.facts["activations"],
        "run_microbatches": t.strategy.runner.microbatches,
        "rows": model.rows,
    }


def test_the_pipeline_estimate_describes_the_plan_that_runs() -> None:
    from tests.helpers import run_in_processes

    for got in run_in_processes(_estimated_and_built_pipeline, 2, init_process_group=False, timeout=300):
        assert got["plan"] == "pipeline"
        assert got["run_microbatches"] == got["estimated_microbatches"] == 4  # 2 x 2 ranks
        # the estimate's batch is the one the plan runs: 2 ranks x 4 samples, cut into micro-batches of 8 / 4 rows
        assert got["estimated_activations"] == 2 * got["activations"]
        assert set(got["rows"]) == {2 * 4 // got["estimated_microbatches"]}


def test_misspelled_keywords_are_refused_when_the_strategy_is_built() -> None:
    # before, `micro_batches=8` went on to DDPStrategy, which keeps it for a DDP wrapper the pipeline never builds
    for bad, close in ({"micro_batches": 8}, "microbatches"), ({"schedual": "gpipe"}, "schedule"):
        key = next(iter(bad))
        expected = rf"unknown keyword argument\(s\) `{key}`.*`microbatches`.*`process_group_backend`.*-> `{close}`"
        with pytest.raises(TypeError, match=rf"PipelineStrategy got {expected}") as e:
            PipelineStrategy(**bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"AutoStrategy `pipeline_kwargs` got unknown keyword argument\(s\) "
                       r"`micro_batches`.*`microbatches`"):  # fmt: skip
        AutoStrategy(pipeline_kwargs={"micro_batches": 8})
    with pytest.raises(ValueError, match=r"AutoStrategy `sharded_kwargs` got unknown keyword argument\(s\) "
                       r"`tensor_paralel_size`.*-> `tensor_parallel_size`"):  # fmt: skip
        AutoStrategy(sharded_kwargs={"tensor_paralel_size": 2})
    # the right names pass, DDPStrategy's own included; DistributedDataParallel's pass too (LightningCLI fills every
    # one in at its default, below), with a warning when set, since no DDP wrapper is built
    PipelineStrategy(microbatches=8, schedule="gpipe", process_group_backend="gloo", find_unused_parameters=False)
    with pytest.warns(UserWarning, match=r"PipelineStrategy ignores `find_unused_parameters`: the pipeline's stages"):
        PipelineStrategy(find_unused_parameters=True)
    AutoStrategy(pipeline_kwargs={"microbatches": 8, "timeout": None}, sharded_kwargs={"tp_plan": None})


def test_the_cli_builds_a_pipeline_strategy_with_every_ddp_keyword_filled_in(tmp_path: Path) -> None:
    from lightning_accel.cli import AccelCLI

    cfg = _cli_config(tmp_path, "  devices: 1\n", "")
    text = cfg.read_text().replace("lightning_accel.parallel.AutoStrategy", "lightning_accel.parallel.PipelineStrategy")
    cfg.write_text(text.replace("init_args: {}", "init_args: {schedule: gpipe, process_group_backend: gloo}"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="PipelineStrategy ignores")  # the filled-in defaults change nothing
        cli = AccelCLI(args=["--config", str(cfg)], run=False)
    st = cli.trainer.strategy
    assert isinstance(st, PipelineStrategy) and st.schedule == "gpipe"


def test_the_measure_policy_resolved_before_the_trainer_still_times_the_plans(tmp_path: Path) -> None:
    from lightning_accel.cli import AccelCLI

    # the CLI resolves every AutoStrategy before building the Trainer: with policy "measure" it must stay unresolved
    run = f"  devices: 1\n  max_steps: 1\n  enable_checkpointing: false\n  default_root_dir: {tmp_path}\n"
    auto_args = "policy: measure, device_memory_bytes: 1000000000, trial_steps: 1, candidates: [ddp]"
    cfg = _cli_config(tmp_path, run, auto_args)
    cli = AccelCLI(args=["--config", str(cfg)], run=False)
    auto = cli.trainer.strategy
    assert isinstance(auto, AutoStrategy) and auto.choice is None and not auto._resolved
    assert not any(isinstance(c, ChoiceCheck) for c in cli.trainer.callbacks)  # type: ignore[attr-defined]
    cli.trainer.fit(cli.model, loader())
    assert auto.choice is not None and auto.choice.policy == "measure" and set(auto.choice.measured) == {"ddp"}
    # a plain `resolve` call too
    st = AutoStrategy(policy="measure", device_memory_bytes=10**9)
    assert st.resolve(Deep(depth=3), accelerator="cpu", devices=2) is st and st.choice is None


def test_misspelled_or_mistyped_arguments_are_refused_in_init() -> None:
    # a misspelled argument of its own went on to DistributedDataParallel, which refused it only when wrapping the
    # model (after the choice was made without it)
    with pytest.raises(TypeError, match=r"`device_memory`=1073741824.*`device_memory` -> `device_memory_bytes`"):
        AutoStrategy(device_memory=2**30)
    AutoStrategy(find_unused_parameters=True, process_group_backend="gloo")  # DDP's keywords still pass
    with pytest.raises(TypeError, match=r"`candidates` must be a list of plan names .* got 'ddp' \(str\)"):
        AutoStrategy(candidates="ddp")  # type: ignore[arg-type]  # was checked letter by letter: "got 'd'"
    for name in ("allow_unfit", "use_example_input"):
        with pytest.raises(TypeError, match=f"`{name}` must be True or False, got 'no'"):
            AutoStrategy(**{name: "no"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`trial_cache` must be a path"):
        AutoStrategy(trial_cache=3)  # type: ignore[arg-type]  # a file descriptor to `open`
    with pytest.raises(ValueError, match="`tensor_parallel_size`"):
        AutoStrategy(sharded_kwargs={"tensor_parallel_size": 0})
