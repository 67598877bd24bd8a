"""Arguments of the fused ops that were misread or failed deep inside with an error naming no argument."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.ops.conv_bn_relu import conv_bn_relu
from lightning_accel.ops.linear_dropout import linear_dropout


@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
@pytest.mark.parametrize("training", ["no", 1, None], ids=repr)
def test_training_must_be_a_bool(backend: str, training: object) -> None:
    """A string is truthy: ``training="no"`` applied dropout; ``F.dropout`` itself refuses it."""
    x, w = torch.randn(4, 5), torch.randn(3, 5)
    with pytest.raises(TypeError, match=r"`training` must be True or False, got"):
        linear_dropout(x, w, None, 0.5, training, backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
def test_a_0d_input_is_refused_naming_x(backend: str) -> None:
    """It stopped with an IndexError from ``x.shape[-1]``."""
    with pytest.raises(ValueError, match=r"`x` must have at least one dimension \(\.\.\., K\), got a 0-d tensor"):
        linear_dropout(torch.tensor(1.0), torch.ones(3, 1), backend=backend)  # type: ignore[arg-type]


def test_a_1d_input_still_works_as_f_linear() -> None:
    x, w, b = torch.randn(5), torch.randn(3, 5), torch.randn(3)
    torch.testing.assert_close(linear_dropout(x, w, b, backend="reference"), torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
def test_conv_bn_relu_training_must_be_a_bool(backend: str) -> None:
    """``training="no"`` normalised with batch statistics and updated the running ones on the torch path."""
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    running_mean, running_var = torch.zeros(4), torch.ones(4)
    with pytest.raises(TypeError, match=r"`training` must be True or False, got 'no'"):
        conv_bn_relu(x, w, None, None, None, running_mean, running_var, "no", 0.1, 1e-5, backend=backend)  # type: ignore[arg-type]
    assert running_mean.eq(0).all() and running_var.eq(1).all()
