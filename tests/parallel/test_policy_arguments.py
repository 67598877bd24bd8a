"""Arguments a policy does not read are said to be unused, once, instead of being silently ignored: the memory
estimate's with ``policy="rules"`` (it decides by parameter and layer counts alone), the trial's without
``policy="measure"``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_accel.models import ImageClassifier
from lightning_accel.parallel import select_strategy
from lightning_accel.parallel.strategies import AutoStrategy


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"device_memory_bytes": 80 * 2**30}, "`device_memory_bytes`"),
        ({"example_batch_size": 64, "headroom": 0.1}, "`headroom`, `example_batch_size`"),
        ({"bytes_per_param": 8, "inter_node_gbps": 10.0, "allow_unfit": True}, "`inter_node_gbps`, `bytes_per_param`"),
    ],
)
def test_auto_strategy_says_which_arguments_rules_do_not_use(kwargs: dict[str, object], named: str) -> None:
    with pytest.warns(
        UserWarning, match=rf"^AutoStrategy: {named}.* used only by policy='memory' and 'measure'"
    ) as rec:
        AutoStrategy(policy="rules", **kwargs)  # type: ignore[arg-type]
    assert len(rec) == 1 and "\n" not in str(rec[0].message)


def test_auto_strategy_rules_with_its_own_arguments_is_quiet() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # `pipeline_kwargs` build a chosen pipeline under every policy; the memory arguments are the memory policy's
        AutoStrategy(policy="rules", pipeline_kwargs={"microbatches": 4})
        AutoStrategy(policy="memory", device_memory_bytes=2**30, example_batch_size=8)
        strategy = AutoStrategy(policy="rules")
        model = ImageClassifier(width=4)
        model.example_input_array = torch.randn(2, 3, 8, 8)
        strategy.resolve(model, accelerator="cpu", devices=1)  # the memory it would look up is not asked for
    assert strategy.choice is not None and strategy.choice.policy == "rules"


def test_select_strategy_says_which_arguments_rules_do_not_use() -> None:
    with pytest.warns(
        UserWarning, match=r"^`device_memory_bytes`, `example_batch`, `microbatches` are used only by policy='memory'"
    ) as rec:
        c = select_strategy(
            _mlp(),
            devices=2,
            policy="rules",
            device_memory_bytes=2**30,
            example_batch=torch.randn(2, 4),
            microbatches=4,
        )
    assert c.strategy == "ddp" and len(rec) == 1 and "\n" not in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select_strategy(_mlp(), devices=2, policy="rules")
        select_strategy(_mlp(), devices=2, policy="memory", device_memory_bytes=2**30, example_batch=torch.randn(2, 4))


@pytest.mark.parametrize("policy", ["memory", "rules"])
def test_trial_arguments_without_the_measuring_policy_are_said_to_be_unused(policy: str, tmp_path) -> None:
    cache = tmp_path / "trials.json"
    with pytest.warns(
        UserWarning, match=r"^AutoStrategy: `trial_steps`, `trial_cache` are used only by policy='me"
    ) as r:
        AutoStrategy(policy=policy, trial_steps=5, trial_cache=cache)
    assert len(r) == 1 and "\n" not in str(r[0].message) and f"policy={policy!r}" in str(r[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AutoStrategy(policy="measure", trial_steps=5, trial_cache=cache)
        AutoStrategy(policy=policy)
