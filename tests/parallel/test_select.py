"""select_strategy's decisions under fake device memory, and the rules policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_accel.parallel import onebit_break_even_gbps, select_strategy

P = 4 * 256 * 256  # parameters of mlp()
MB = 1_000_000


def mlp(layers: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(layers)])


def pick(mem: int, devices: int = 4, **kw):
    return select_strategy(mlp(), devices=devices, device_memory_bytes=mem, headroom=0.0, **kw)


def test_memory_policy_walks_ddp_fsdp_pipeline() -> None:
    ddp_need = 16 * P  # 4.19 MB, no activations without an example batch
    fsdp_need = 16 * P // 4 + 4 * 256 * 256  # 1.31 MB
    pipe_need = 16 * 256 * 256  # one layer per stage: 1.05 MB
    c = pick(ddp_need)
    assert (c.strategy, c.plan, c.fits) == ("ddp", "ddp", True)
    assert "not measured" in c.explanation  # says the estimate is a lower bound
    c = pick(ddp_need - 1)
    assert (c.strategy, c.plan, c.fits) == ("fsdp", "fsdp", True)
    assert c.estimates["fsdp"].total == fsdp_need
    c = pick(fsdp_need - 1)  # a plain Linear stack has no column/row pairs: tensor parallel splits nothing
    assert c.estimates["tp"].total >= c.estimates["ddp"].total
    assert (c.strategy, c.plan, c.fits) == ("pipeline", "pipeline", True)
    assert c.estimates["pipeline"].total == pipe_need
    c = pick(pipe_need - 1)
    assert not c.fits and "Nothing fits" in c.explanation and c.strategy == "pipeline"
    assert "pipeline 1.05 MB" in c.explanation  # says so with the estimates


def test_headroom_and_activations_count() -> None:
    x = torch.randn(64, 256)
    acts = 4 * 64 * 256 * 4
    need = 16 * P + acts
    assert select_strategy(mlp(), devices=2, device_memory_bytes=need, example_batch=x, headroom=0.0).strategy == "ddp"
    c = select_strategy(mlp(), devices=2, device_memory_bytes=need, example_batch=x, headroom=0.2)
    assert c.strategy == "fsdp" and c.facts["activations"] == acts
    assert "measured" in c.explanation
    scaled = select_strategy(mlp(), devices=2, device_memory_bytes=need * 10, example_batch=x, activation_scale=4.0)
    assert scaled.facts["activations"] == 4 * acts


def test_single_device() -> None:
    c = pick(16 * P, devices=1)
    assert (c.strategy, c.plan, c.fits) == ("auto", "single", True)
    c = pick(16 * P - 1, devices=1)
    assert c.strategy == "auto" and not c.fits  # sharding over one device does not help: say so


def test_onebit_across_slow_nodes() -> None:
    kw = dict(devices=2, num_nodes=2, onebit_break_even=25.0)
    s, why = pick(100 * MB, inter_node_gbps=10.0, **kw)
    assert s == "ddp_1bit" and "below the 25.0 Gbit/s break-even" in why
    assert pick(100 * MB, inter_node_gbps=100.0, **kw).strategy == "ddp"
    assert pick(100 * MB, inter_node_gbps=None, **kw).strategy == "ddp"
    assert pick(100 * MB, devices=8, inter_node_gbps=1.0, onebit_break_even=25.0).strategy == "ddp"  # one node


def test_break_even_is_measured_from_the_backward_pass() -> None:
    # ring allreduce: 2(N-1)/N * 4 bytes * P per device; hidden while it takes less than backward
    assert onebit_break_even_gbps(1_000_000, 4, 0.01) == pytest.approx(2 * 3 / 4 * 4e6 * 8 / 0.01 / 1e9)
    assert onebit_break_even_gbps(1_000_000, 1, 0.01) == 0.0
    c = pick(100 * MB, devices=2, num_nodes=2, example_batch=torch.randn(4, 256), inter_node_gbps=1e6)
    assert c.facts["onebit_break_even_gbps"] > 0 and "measured from the example backward" in c.explanation


def test_rules_policy() -> None:
    with torch.device("meta"):  # 1.2 B parameters without allocating them
        big = nn.Linear(40_000, 30_000)
    c = select_strategy(big, devices=8, policy="rules")
    assert (c.strategy, c.plan) == ("fsdp", "fsdp") and "1.20 B parameters > 1 B" in c.explanation
    deep = nn.Sequential(*[nn.Linear(2, 2) for _ in range(60)])
    c = select_strategy(deep, devices=8, policy="rules")
    assert (c.plan, c.strategy) == ("pipeline", "pipeline") and "60 layers > 50" in c.explanation
    assert select_strategy(deep, devices=1, policy="rules").strategy == "auto"  # no pipeline on one device
    assert select_strategy(mlp(), devices=8, policy="rules").strategy == "ddp"
    assert select_strategy(mlp(), devices=1, policy="rules").strategy == "auto"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "fast"}, "`policy`"),
        ({"devices": 0}, "`devices`"),
        ({"num_nodes": 0}, "`num_nodes`"),
        ({"headroom": 1.0}, "`headroom`"),
        ({"inter_node_gbps": 0}, "`inter_node_gbps`"),
        ({"device_memory_bytes": -1}, "`device_memory_bytes`"),
        ({"activation_scale": 0}, "`activation_scale`"),
        ({"microbatches": 0}, "`microbatches`"),
        ({"microbatches": -1}, "`microbatches`"),
        ({"bytes_per_param": -16}, "`bytes_per_param`"),
        ({"onebit_break_even": -5}, "`onebit_break_even`"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"devices": 2, "device_memory_bytes": 10**9, **kwargs}
    with pytest.raises(ValueError, match=match):
        select_strategy(mlp(), **args)


def test_a_loss_fn_that_is_not_callable_is_refused_not_measured_as_nothing() -> None:
    # it failed inside the measurement, which fell back to no activations at all with a warning
    x = torch.randn(4, 256)
    with pytest.raises(TypeError, match=r"`loss_fn` must be a function `output -> scalar loss` or None, got 'mse'"):
        select_strategy(mlp(), devices=2, device_memory_bytes=10**9, example_batch=x, loss_fn="mse")  # type: ignore[arg-type]
    from lightning_accel.parallel import measure_activation_bytes

    with pytest.raises(TypeError, match=r"`loss_fn` must be .* got 'mse' \(str\)"):
        measure_activation_bytes(mlp(), x, loss_fn="mse")  # type: ignore[arg-type]


def test_unknown_device_memory_on_cpu_says_what_to_pass() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA provides the device memory")
    with pytest.raises(ValueError, match="device_memory_bytes=80"):
        select_strategy(mlp(), devices=2)


def test_trial_cache_publishes_its_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import lightning_accel._utils.atomic as atomic
    from lightning_accel.parallel.select import TrialCache

    path = tmp_path / "sub" / "trials.json"
    writes: list[str] = []
    real = atomic.atomic_write_bytes
    monkeypatch.setattr(
        atomic, "atomic_write_bytes", lambda p, data, **kw: (writes.append(str(p)), real(p, data, **kw))
    )
    cache = TrialCache(str(path))
    cache.put("k", {"ddp": 1.5})
    cache.put("j", {"fsdp": 2.0})
    assert writes == [str(path)] * 2 and sorted(p.name for p in path.parent.iterdir()) == ["trials.json"]
    assert json.loads(path.read_text()) == {"j": {"fsdp": 2.0}, "k": {"ddp": 1.5}}
    assert TrialCache(str(path)).get("k") == {"ddp": 1.5}


@pytest.mark.parametrize(
    "content",
    ["[1, 2]", '"a string"', '{"k": {"ddp": "fast"}}', '{"k": {"ddp": null}}', '{"k": [1.5]}', "7"],
)
def test_trial_cache_reads_a_file_that_is_not_a_cache_as_empty(tmp_path: Path, content: str) -> None:
    from lightning_accel.parallel.select import TrialCache

    path = tmp_path / "trials.json"
    path.write_text(content)
    assert TrialCache(str(path)).get("k") is None  # measured again, never a crash


def test_trial_cache_keeps_the_file_entries_it_does_not_own(tmp_path: Path) -> None:
    import json

    from lightning_accel.parallel.select import TrialCache

    path = tmp_path / "trials.json"
    path.write_text('{"note": "mine", "bad": {"ddp": "x"}, "k": {"ddp": 0.5}}')
    TrialCache(str(path)).put("j", {"fsdp": 2.0})
    assert json.loads(path.read_text()) == {"note": "mine", "bad": {"ddp": "x"}, "k": {"ddp": 0.5}, "j": {"fsdp": 2.0}}
    path.write_text("[1, 2]")
    with pytest.warns(UserWarning, match="`trial_cache` file .* not a trial cache"):
        TrialCache(str(path)).put("j", {"fsdp": 2.0})
    assert path.read_text() == "[1, 2]"


def test_trial_cache_that_cannot_be_written_warns_and_keeps_the_times_in_memory(tmp_path: Path) -> None:
    from lightning_accel.parallel.select import TrialCache

    (tmp_path / "plain").write_text("mine")
    cache = TrialCache(str(tmp_path / "plain" / "trials.json"))  # its folder is a file: nothing can be written there
    with pytest.warns(UserWarning, match="`trial_cache` file .* cannot be written .*FileExistsError"):
        cache.put("j", {"fsdp": 2.0})  # after the trial, on rank 0 alone: a warning, never an error
    assert cache.get("j") == {"fsdp": 2.0} and (tmp_path / "plain").read_text() == "mine"


@pytest.mark.parametrize("content", ["my notes: keep them\n", '{"k": {"ddp": 0.5}'])
def test_trial_cache_never_overwrites_a_file_that_is_not_json(tmp_path: Path, content: str) -> None:
    from lightning_accel.parallel.select import TrialCache

    path = tmp_path / "trials.json"  # a file of the user's (or a cache an editor left half-written) at that path
    path.write_text(content)
    with pytest.warns(UserWarning, match="`trial_cache` file .* does not hold JSON, so it is not a trial cache"):
        TrialCache(str(path)).put("j", {"fsdp": 2.0})
    assert path.read_text() == content
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.warns(UserWarning, match="cannot be read .*IsADirectoryError"):
        TrialCache(str(folder)).put("j", {"fsdp": 2.0})  # a warning on the rank that writes, never an error
    empty = tmp_path / "empty.json"
    empty.touch()  # nothing in it to lose: the cache starts there
    TrialCache(str(empty)).put("j", {"fsdp": 2.0})
    assert TrialCache(str(empty)).get("j") == {"fsdp": 2.0}


@pytest.mark.parametrize(
    "kwargs",
    [{"devices": True}, {"num_nodes": 1.0}, {"headroom": "0.2"}, {"microbatches": "4"}, {"bytes_per_param": "16"}],
)
def test_wrong_argument_types_are_type_errors(kwargs: dict) -> None:
    with pytest.raises(TypeError, match=f"`{next(iter(kwargs))}` must be"):
        select_strategy(mlp(), **{"devices": 2, "device_memory_bytes": 10**9, **kwargs})


def test_a_plan_that_cannot_run_the_model_never_fits() -> None:
    class Opaque(nn.Module):  # neither a Sequential nor `pipeline_modules()`; no column/row pair either
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({"a": nn.Linear(256, 256), "b": nn.Linear(256, 256)})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers["b"](self.layers["a"](x))

    c = select_strategy(Opaque(), devices=2, device_memory_bytes=10**9)
    assert c.estimates["pipeline"].blocker.startswith("cannot split: PipelineStrategy cannot split `Opaque`")
    assert c.estimates["tp"].blocker.startswith("cannot split: tensor parallel found 0 parallelisable")
    rows = {r.split("|")[1].strip(): r for r in c.table().splitlines()[2:]}
    assert "| no | - |  | cannot split: PipelineStrategy" in rows["pipeline"] and "| yes |" in rows["ddp"]
    # too little memory for DDP and FSDP: the unsplittable pipeline is not offered, even though its estimate is lower
    tight = select_strategy(Opaque(), devices=2, device_memory_bytes=16 * 2 * 256 * 257 // 2, headroom=0.0)
    assert tight.plan != "pipeline" and not tight.fits


def test_a_failing_trial_is_dropped_with_its_error() -> None:
    from lightning_accel.parallel.select import TrialFailed, choose_by_trial

    choice = pick(100 * MB, devices=2)

    tried: list[str] = []

    def trial(plan: str) -> float:
        tried.append(plan)
        if plan == "fsdp":
            raise RuntimeError("boom in the first step")
        if plan == "pipeline":
            raise TrialFailed("rank 1: ValueError: bad split")
        return 0.2

    out = choose_by_trial(choice, trial, candidates=["ddp", "fsdp", "tp", "pipeline"])
    assert tried == ["ddp", "fsdp", "pipeline"]  # a plain Linear stack has nothing to split: tp is never tried
    assert out.plan == "ddp" and set(out.measured) == {"ddp"}
    assert out.dropped == {"fsdp": "RuntimeError: boom in the first step", "pipeline": "rank 1: ValueError: bad split"}
    assert "trial dropped: RuntimeError: boom in the first step" in out.table()
    assert "Dropped 'pipeline' (rank 1: ValueError: bad split)" in out.explanation
    everything_fails = choose_by_trial(choice, lambda p: 1 / 0, candidates=["ddp", "fsdp"])
    assert everything_fails.plan == choice.plan and set(everything_fails.dropped) == {"ddp", "fsdp"}


def test_meta_device_activations_are_estimated_not_measured() -> None:
    from lightning_accel.models.transformer import GPT
    from lightning_accel.parallel.estimate import estimate_activation_bytes

    with torch.device("meta"):
        gpt = GPT(vocab_size=100, block_size=64, n_layer=3, n_head=4, n_embd=64)
    batch = torch.zeros(8, 64, dtype=torch.long, device="meta")
    c = select_strategy(gpt, devices=2, device_memory_bytes=10**10, example_batch=batch)
    want = estimate_activation_bytes(layers=3, hidden=64, seq=64, batch=8, heads=4, bytes_per_value=4)
    assert want == 3 * (64 * 8 * 64 * 34 + 5 * 4 * 64 * 64 * 8) * 2
    assert c.facts["activations"] == want and c.facts["activations_source"] == "estimated"
    assert "estimated (meta device: 3 layers" in c.explanation and "measured" not in c.explanation
    from lightning_accel.parallel.estimate import measure_activation_bytes

    with pytest.raises(ValueError, match="on the meta device: nothing runs there. Use `estimate_activation_bytes"):
        measure_activation_bytes(gpt, batch)


def test_a_model_that_cannot_run_before_setup_gets_a_lower_bound_and_a_warning() -> None:
    # the demo classifier with `num_classes="auto"` sizes its head in `setup()`: a strategy chosen before the Trainer
    # exists (the CLI chooses then) could not run its forward; it stopped the whole command with a traceback
    from lightning_accel.models import ImageClassifier

    model = ImageClassifier(num_classes="auto", width=4)
    with pytest.warns(RuntimeWarning, match=r"activations not measured \(the example batch's forward/backward failed"):
        c = select_strategy(model, devices=2, device_memory_bytes=10**10, example_batch=torch.zeros(4, 3, 8, 8))
    assert c.facts["activations"] == 0
    assert "sizes its head in `setup()`" in c.explanation and "a lower bound" in c.explanation
    assert all(not p.requires_grad or p.grad is None for p in model.parameters())


def test_autocast_weight_copies_are_not_activations() -> None:
    from lightning_accel.parallel.estimate import measure_activation_bytes

    net = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])  # weights (4 MB) dwarf the activations
    x = torch.randn(8, 512)
    fp32 = measure_activation_bytes(net, x).activation_bytes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = measure_activation_bytes(net, x).activation_bytes
    assert fp32 == 4 * 8 * 512 * 4  # each Linear's input
    assert bf16 == fp32 // 2  # the inputs in bf16; the bf16 weight copies (2 MB) are model state, not activations


def test_a_frozen_backbone_keeps_data_parallel_where_it_fits() -> None:
    m = mlp()
    for p in m[:3].parameters():  # fine-tuning: a frozen backbone, one trainable layer
        p.requires_grad_(False)
    layer = 256 * 256
    need = 16 * layer + 4 * 3 * layer  # the head's full Adam state, the backbone's fp32 weights alone
    c = select_strategy(m, devices=2, device_memory_bytes=need, headroom=0.0)
    assert (c.plan, c.fits) == ("ddp", True) and c.estimates["ddp"].total == need
    assert c.facts["trainable_params"] == layer and c.facts["frozen_bytes"] == 12 * layer
    assert c.estimates["fsdp"].model_state == need // 2
    # the pipeline's stages: three frozen layers' weights on one, the trainable layer's state on the other; the first
    # would hold nothing to train, which `PipelineStrategy` refuses to fit, so the estimate never offers it
    pipe = c.estimates["pipeline"]
    assert pipe.model_state == 16 * layer
    assert pipe.blocker.startswith("cannot split: pipeline stage(s) 0 (pieces 0..2) of `Sequential` hold no parameter")


def test_a_weight_tied_between_stages_counts_on_each() -> None:
    from lightning_accel.models.transformer import GPT

    g = GPT(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    assert g.head.weight is g.tok_emb.weight  # the embedding and the head share their weight
    c = select_strategy(g, devices=2, device_memory_bytes=10**9)
    pieces = g.pipeline_modules()
    first = sum(p.numel() for piece in pieces[:2] for p in piece.parameters())  # the embedding and a block
    last = sum(p.numel() for piece in pieces[2:] for p in piece.parameters())  # a block and the (tied) head
    assert first + last > sum(p.numel() for p in g.parameters())  # the tied weight is held twice
    assert c.estimates["pipeline"].model_state == 16 * max(first, last)


def test_the_pipeline_estimate_runs_the_batch_and_micro_batches_of_the_plan() -> None:
    x = torch.randn(64, 256)
    acts = 4 * 64 * 256 * 4
    c = select_strategy(mlp(), devices=2, device_memory_bytes=10**9, example_batch=x)
    # `strategy="pipeline"`: the per-device batch, in 2 x 2 micro-batches of which 2 are in flight on a stage
    assert c.facts["pipeline_microbatches"] == 4 and c.facts["pipeline_activations"] == acts
    assert c.estimates["pipeline"].activations == acts // 2 * 2 // 4
    w = select_strategy(mlp(), devices=2, device_memory_bytes=10**9, example_batch=x, batch_split="world")
    assert w.facts["pipeline_activations"] == 2 * acts  # both devices' batches gathered into the pipeline's
    assert w.estimates["pipeline"].activations == 2 * acts // 2 * 2 // 4
    m8 = select_strategy(mlp(), devices=2, device_memory_bytes=10**9, example_batch=x, microbatches=8)
    assert m8.estimates["pipeline"].activations == acts // 2 * 2 // 8
    with pytest.raises(ValueError, match="`batch_split`"):
        select_strategy(mlp(), devices=2, device_memory_bytes=10**9, batch_split="pipeline")


def test_the_pipeline_estimate_is_the_pipeline_of_its_size_and_schedule() -> None:
    x = torch.randn(64, 256)
    full = select_strategy(mlp(layers=8), devices=4, device_memory_bytes=10**9, example_batch=x, batch_split="world")
    half = select_strategy(
        mlp(layers=8), devices=4, device_memory_bytes=10**9, example_batch=x, batch_split="world", pipeline_size=2
    )
    # 2 ranks per pipeline (2 replicas): 2 stages of the 8 layers, each holding twice the state of 4 stages; its
    # batch is its 2 ranks' batches gathered, in 2 x 2 micro-batches
    assert full.facts["pipeline_size"] == 4 and half.facts["pipeline_size"] == 2
    assert half.estimates["pipeline"].model_state == 2 * full.estimates["pipeline"].model_state
    assert (
        half.facts["pipeline_microbatches"] == 4 and half.facts["pipeline_activations"] == 2 * half.facts["activations"]
    )
    gpipe = select_strategy(mlp(layers=8), devices=4, device_memory_bytes=10**9, example_batch=x, schedule="gpipe")
    f1b = select_strategy(mlp(layers=8), devices=4, device_memory_bytes=10**9, example_batch=x)
    assert gpipe.estimates["pipeline"].activations == 2 * f1b.estimates["pipeline"].activations  # 8 in flight, not 4
    inter = select_strategy(
        mlp(layers=8), devices=4, device_memory_bytes=10**9, example_batch=x, schedule="interleaved1f1b"
    )
    assert inter.facts["stages_per_rank"] == 2 and "2·(16·P_stage)" in inter.estimates["pipeline"].formula
    with pytest.raises(ValueError, match="`pipeline_size`=3 does not divide the 4 device"):
        select_strategy(mlp(), devices=4, device_memory_bytes=10**9, pipeline_size=3)
    with pytest.raises(ValueError, match="`stages_per_rank`=1 with `schedule`='interleaved1f1b'"):
        select_strategy(mlp(), devices=4, device_memory_bytes=10**9, schedule="interleaved1f1b", stages_per_rank=1)


def test_a_cached_trial_holds_for_the_same_pipeline_only() -> None:
    from lightning_accel.parallel.select import trial_key

    args = (mlp(), 2, "cpu", (8, 256), ["ddp", "pipeline"])
    assert trial_key(*args) == trial_key(*args, "")  # written before the pipeline's settings were part of it
    assert trial_key(*args, "1f1b,m=None,v=None") != trial_key(*args, "gpipe,m=None,v=None")


def test_the_tensor_parallel_estimate_splits_over_one_node_and_runs_its_batch() -> None:
    from lightning_accel.models.transformer import GPT

    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
    x = torch.randint(0, 64, (4, 16))
    one = select_strategy(model, devices=4, device_memory_bytes=10**10, example_batch=x)
    two = select_strategy(model, devices=2, num_nodes=2, device_memory_bytes=10**10, example_batch=x)
    # the plan AutoStrategy builds splits over the devices of one node: 4 ways on one node, 2 ways on two
    assert one.facts["tp_size"] == 4 and two.facts["tp_size"] == 2
    assert one.estimates["tp"].model_state < two.estimates["tp"].model_state
    assert one.estimates["tp"].activations == two.estimates["tp"].activations == one.facts["activations"]
    # `batch_split="world"`: the group runs its devices' batches gathered into one
    w = select_strategy(model, devices=2, num_nodes=2, device_memory_bytes=10**10, example_batch=x, batch_split="world")
    assert w.estimates["tp"].activations == 2 * w.facts["activations"]


def test_a_timed_plan_reduces_its_time_on_the_model_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_accel.parallel import trials

    asked, reduced = [], []
    real_tensor = torch.tensor

    def tensor(data, **kw):  # records the device asked for, builds on the CPU so that the time can be read back
        asked.append(kw.pop("device", None))
        return real_tensor(data, **kw)

    monkeypatch.setattr(trials.torch, "tensor", tensor)
    monkeypatch.setattr(trials.dist, "all_reduce", lambda t, op=None, group=None: reduced.append(t))
    model = nn.Linear(2, 2, device="meta")  # stands for a model on the GPU: NCCL reduces device tensors only
    stepper = trials.Stepper("ddp", model, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), lambda: 0.0)
    trials.time_plan(stepper, steps=2, warmup=0)
    assert asked == [torch.device("meta")] and len(reduced) == 1


def test_the_estimates_hold_the_buffers_of_a_real_network() -> None:
    torchvision = pytest.importorskip("torchvision")
    net = torchvision.models.resnet18(num_classes=10)
    params = sum(p.numel() for p in net.parameters())
    buffers = 2 * 4800 * 4 + 20 * 8  # its BatchNorm layers' running statistics and step counters
    c = select_strategy(net, devices=2, device_memory_bytes=10**10, bytes_per_param=12)  # SGD with momentum
    assert c.facts["buffer_bytes"] == buffers
    assert c.estimates["ddp"].model_state == 12 * params + buffers
    assert c.estimates["fsdp"].model_state == -(-12 * params // 2) + buffers  # replicated, not sharded
    assert c.estimates["tp"].model_state == 12 * params + buffers  # a CNN: nothing split

    class Masked(nn.Sequential):  # a registered table in one piece: held by the stage that runs it
        def __init__(self) -> None:
            super().__init__(nn.Linear(64, 64), nn.Linear(64, 64))
            self[1].register_buffer("mask", torch.ones(64, 1000))

    c = select_strategy(Masked(), devices=2, device_memory_bytes=10**10)
    per_layer = 16 * (64 * 64 + 64)
    assert c.estimates["pipeline"].model_state == per_layer + 64 * 1000 * 4
    assert c.estimates["ddp"].model_state == 2 * per_layer + 64 * 1000 * 4


def test_the_fsdp_estimate_gathers_the_largest_unit_the_strategy_wraps() -> None:
    torchvision = pytest.importorskip("torchvision")
    net = torchvision.models.resnet18(num_classes=10)
    c = select_strategy(net, devices=8, device_memory_bytes=10**10)
    # layer4 (a direct child outside the one repeated stack, a stage's two blocks) is gathered whole, not a block
    assert c.estimates["fsdp"].working == 4 * sum(p.numel() for p in net.layer4.parameters())


def _put_many(rank: int, world: int, path: str, count: int) -> int:
    from lightning_accel.parallel.select import TrialCache

    cache = TrialCache(path)  # one cache per process, as two jobs (or two ranks) sharing a file have
    for i in range(count):
        cache.put(f"rank{rank}/{i}", {"ddp": float(i)})
    return count


def test_trial_cache_shared_by_two_processes_keeps_every_entry(tmp_path: Path) -> None:
    import json

    from tests.helpers import run_in_processes

    path = tmp_path / "trials.json"
    # without a lock, both read the file, each adds its entry and writes it back: one of the two entries is lost
    run_in_processes(_put_many, 2, (str(path), 40), init_process_group=False, timeout=120)
    data = json.loads(path.read_text())
    assert sorted(data) == sorted(f"rank{r}/{i}" for r in range(2) for i in range(40))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trials.json"]  # no lock or temporary file left
