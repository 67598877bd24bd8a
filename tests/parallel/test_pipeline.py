"""The pipeline core without processes: the balanced split, what a network must provide, and the errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.models.transformer import GPT
from lightning_accel.parallel import select_strategy
from lightning_accel.parallel.pipeline import (
    balance_stages,
    batch_tensors,
    check_no_sync_batchnorm,
    check_stages_train,
    find_pipeline_modules,
    join_outputs,
    keep_only,
    piece_costs,
    pipeline_layout,
    split_batch,
    trainable_pieces,
)


def test_balance_stages_minimises_the_heaviest_stage() -> None:
    assert balance_stages([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert balance_stages([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]  # the heavy piece alone
    assert balance_stages([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [(0, 5), (5, 7), (7, 9)]  # 15, 13, 17
    with pytest.raises(ValueError, match=r"cannot cut 3 pipeline piece\(s\) into 4 stages.*at most 3"):
        balance_stages([1, 1, 1], 4)


def test_world_not_divisible_by_pipeline_size_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by `pipeline_size`=4.*\[1, 2, 3, 6\]"):
        pipeline_layout([1.0] * 8, 6, pipeline_size=4)
    lay = pipeline_layout([1.0] * 8, 4, pipeline_size=2, stages_per_rank=2)
    assert (lay.dp, lay.pp, lay.num_stages) == (2, 2, 4)
    assert lay.stages_of(3) == [1, 3] and lay.rank_of(3, replica=1) == 3


def test_gpt_pieces_compose_to_its_forward_and_costs_are_measured() -> None:
    torch.manual_seed(0)
    gpt = GPT(n_layer=3, n_embd=16, n_head=2, block_size=8, dropout=0.0)
    pieces = find_pipeline_modules(gpt)
    assert len(pieces) == 5
    x = torch.randint(0, 27, (2, 8))
    y = x
    for p in pieces:
        y = p(y)
    torch.testing.assert_close(y, gpt(x))
    costs = piece_costs(pieces, x)
    no_act = piece_costs(pieces)
    assert all(c > n for c, n in zip(costs, no_act, strict=True))  # activations counted
    assert no_act[1] == 16 * sum(p.numel() for p in gpt.blocks[0].parameters())


def test_a_sequential_is_split_and_anything_else_is_named() -> None:
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert find_pipeline_modules(seq) == list(seq)

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = seq

    assert find_pipeline_modules(Holder()) == list(seq)

    class Opaque(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    with pytest.raises(TypeError, match=r"cannot split `Opaque`.*`pipeline_modules\(\)`.*nn.Sequential"):
        find_pipeline_modules(Opaque())


def test_pieces_that_leave_out_a_parameter_of_the_module_are_refused() -> None:
    # an `nn.Sequential` backbone beside a head: its children were taken as the whole network, so the pipeline
    # trained (and saved) the model without the head, and the selector estimated it without the head's parameters
    class BackboneAndHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
            self.head = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.features(x))

    net = BackboneAndHead()
    left_out = r"leave out the parameters `head.weight`, `head.bias`"
    with pytest.raises(
        TypeError, match=r"from the children of its child `Sequential` \(an `nn.Sequential`\) " + left_out
    ):
        find_pipeline_modules(net)
    choice = select_strategy(net, devices=2, device_memory_bytes=10**9)
    assert "leave out the parameters `head.weight`" in choice.estimates["pipeline"].blocker
    net.pipeline_modules = lambda: [*net.features, net.head]  # type: ignore[assignment]
    assert find_pipeline_modules(net) == [*net.features, net.head]  # the fix the error names
    with pytest.raises(
        TypeError, match=r"`BackboneAndHead`: the pieces from its own `pipeline_modules\(\)` " + left_out
    ):
        net.pipeline_modules = lambda: list(net.features)  # type: ignore[assignment]
        find_pipeline_modules(net)


def test_keep_only_drops_what_the_stage_does_not_use_and_keeps_tied_weights() -> None:
    gpt = GPT(n_layer=2, n_embd=16, n_head=2, block_size=8)
    pieces = gpt.pipeline_modules()
    total = sum(p.numel() for p in gpt.parameters())
    dropped = keep_only(gpt, pieces[2:])  # block 1 and the head (whose weight is the token embedding)
    assert gpt.tok_emb.weight is gpt.head.weight and gpt.pos_emb.weight is None and gpt.blocks[0].ln_1.weight is None
    assert dropped + sum(p.numel() for p in gpt.parameters()) == total


def test_split_batch_repeats_a_scalar_tensor() -> None:
    parts = split_batch((torch.arange(4), torch.tensor(0.5)), 2)  # a 0-dim tensor has no batch dimension
    assert [float(p[1]) for p in parts] == [0.5, 0.5] and [p[0].tolist() for p in parts] == [[0, 1], [2, 3]]


def test_split_batch_needs_equal_micro_batches() -> None:
    parts = split_batch([torch.arange(8), {"m": torch.ones(8, 2)}], 4)
    assert len(parts) == 4 and parts[1][0].tolist() == [2, 3] and parts[3][1]["m"].shape == (2, 2)
    with pytest.raises(ValueError, match=r"shape \(6,\) cannot be split into `microbatches`=4"):
        split_batch(torch.arange(6), 4)


def test_join_outputs_rebuilds_a_batch_from_its_micro_batches() -> None:
    from collections import namedtuple

    Out = namedtuple("Out", ["y", "score"])
    parts = [
        {"x": torch.arange(4).view(2, 2) + 4 * k, "o": Out(torch.tensor([k, k]), torch.tensor(float(k))), "ids": [k, k]}
        for k in range(3)
    ]
    joined = join_outputs(parts)
    assert torch.equal(joined["x"], torch.arange(12).view(6, 2))  # concatenated along dim 0, in order
    assert isinstance(joined["o"], Out) and torch.equal(joined["o"].y, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert torch.equal(joined["o"].score, torch.tensor([0.0, 1.0, 2.0]))  # 0-dim: stacked
    assert joined["ids"] == [0, 0, 1, 1, 2, 2]  # lists: one entry per sample
    assert join_outputs(["a", "b"]) == ["a", "b"]  # anything else: one value per micro-batch


def test_split_batch_keeps_namedtuples_and_mapping_types() -> None:
    from collections import OrderedDict, UserDict, defaultdict, namedtuple

    class Encoding(UserDict):  # a tokenizer's `BatchEncoding` is a `UserDict`, not a dict
        pass

    Batch = namedtuple("Batch", ["x", "y"])
    mbs = split_batch(Batch(torch.arange(4), torch.arange(4) + 10), 2)  # a namedtuple is made from its fields
    assert [type(mb) for mb in mbs] == [Batch, Batch] and torch.equal(mbs[1].y, torch.tensor([12, 13]))
    enc = Encoding(input_ids=torch.arange(8).view(4, 2), labels=torch.arange(4))
    assert [t.shape[0] for t in batch_tensors(enc)] == [4, 4]  # its tensors count: the batch's rows
    mbs = split_batch(enc, 2)  # every micro-batch its own rows, not the whole batch
    assert [type(mb) for mb in mbs] == [Encoding, Encoding] and torch.equal(mbs[1]["labels"], torch.tensor([2, 3]))
    mbs = split_batch(defaultdict(list, x=torch.arange(4)), 2)
    assert isinstance(mbs[0], defaultdict) and mbs[0].default_factory is list
    assert torch.equal(mbs[0]["x"], torch.arange(2))
    assert type(split_batch(OrderedDict(x=torch.arange(4)), 2)[0]) is OrderedDict
    joined = join_outputs([Encoding(y=torch.ones(2)), Encoding(y=torch.zeros(2))])
    assert type(joined) is Encoding and torch.equal(joined["y"], torch.tensor([1.0, 1.0, 0.0, 0.0]))


def test_split_batch_splits_a_list_of_names_with_the_rows() -> None:
    batch = {"x": torch.arange(8).view(4, 2), "id": ["a", "b", "c", "d"], "pair": [torch.zeros(4), torch.ones(4)]}
    mbs = split_batch(batch, 2)
    assert [mb["id"] for mb in mbs] == [["a", "b"], ["c", "d"]]  # one name per sample: with its rows
    assert [mb["pair"][1].tolist() for mb in mbs] == [[1.0, 1.0], [1.0, 1.0]]  # a list of tensors is a structure
    assert split_batch({"x": torch.zeros(4), "classes": ["cat", "dog"]}, 2)[1]["classes"] == ["cat", "dog"]


def test_join_outputs_of_steps_that_return_nothing_is_nothing() -> None:
    # a `predict_step` that writes its predictions away: Lightning's default strategy returns None for the batch
    assert join_outputs([None, None, None, None]) is None
    assert join_outputs([{"y": None}, {"y": None}]) == {"y": None}


def test_measuring_the_pieces_leaves_batchnorm_statistics_rng_and_modes_as_they_were() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 2))
    net[2].eval()  # a submodule the user put in eval: it must stay there
    x = torch.randn(16, 8) * 5 + 3
    before = {k: v.clone() for k, v in net.state_dict().items()}
    modes = [m.training for m in net.modules()]
    rng = torch.random.get_rng_state()
    costs = piece_costs(find_pipeline_modules(net), x)
    assert costs[1] > 2 * 16 * 4  # BatchNorm's activations were measured (training mode) ...
    # ... and its running statistics, the RNG the dropout drew from and every module's mode are back
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    tracked = net[1].num_batches_tracked
    assert isinstance(tracked, torch.Tensor) and int(tracked) == 0
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert [m.training for m in net.modules()] == modes


def test_every_stage_gets_a_trainable_piece_when_it_can() -> None:
    # a heavy frozen backbone (pieces 0-2) and light trainable heads: the plain balance gives the backbone a stage
    costs = [100, 100, 100, 1, 1, 1]
    trainable = [False, False, False, True, True, True]
    assert balance_stages(costs, 2)[0] == (0, 2)
    bounds = balance_stages(costs, 2, trainable=trainable)
    assert all(any(trainable[a:b]) for a, b in bounds) and bounds == [(0, 4), (4, 6)]
    check_stages_train(bounds, trainable)  # every stage trains: no error
    bounds3 = balance_stages(costs, 3, trainable=trainable)
    assert bounds3 == [(0, 4), (4, 5), (5, 6)]
    # more stages than trainable pieces: the plain balance, which the strategy refuses to fit, naming the stage
    few = [False, False, False, False, True, False]
    plain = balance_stages(costs, 2, trainable=few)
    assert plain == balance_stages(costs, 2)
    with pytest.raises(ValueError, match=r"stage\(s\) 0 \(pieces 0..1\) of `Net` hold no parameter that trains.*"
                       r"only 1 of the 6 pieces \(\[4\]\) train.*Use at most 1 stage \(") as e:  # fmt: skip
        check_stages_train(plain, few, model="`Net`")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"none of its 6 pieces trains\. Unfreeze"):
        check_stages_train(plain, [False] * 6)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    net[0].requires_grad_(False)
    assert trainable_pieces(list(net)) == [False, False, True]


def test_a_network_with_sync_batchnorm_cannot_be_pipelined() -> None:
    net = nn.Sequential(nn.Linear(8, 16), nn.SyncBatchNorm(16), nn.ReLU(), nn.Linear(16, 8))
    with pytest.raises(ValueError, match=r"it holds `nn.SyncBatchNorm` \(`1`\).*a pipeline stage runs on one rank"):
        check_no_sync_batchnorm(net)
    check_no_sync_batchnorm(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)))  # a plain BatchNorm pipelines
    # the selector never picks (nor times) the pipeline for it
    est = select_strategy(net, devices=2, device_memory_bytes=10**9).estimates["pipeline"]
    assert "SyncBatchNorm" in est.blocker


def test_split_batch_refuses_a_ragged_list_of_per_sample_tensors() -> None:
    ragged = [torch.ones(3, 2), torch.ones(5, 2), torch.ones(4, 2), torch.ones(2, 2)]  # one tensor per sample
    with pytest.raises(ValueError, match=r"^the batch's tensors differ in their first dimension") as e:
        split_batch(ragged, 2)
    assert "[3, 5, 4, 2]" in str(e.value) and "pad_sequence" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"`\['y'\]\[1\]` \(4 rows\)"):  # a nested one names its place in the batch
        split_batch({"x": torch.ones(8, 2), "y": [torch.ones(8), torch.ones(4)]}, 2)
