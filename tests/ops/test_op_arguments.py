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


@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
@pytest.mark.parametrize("training", [True, False])
def test_a_mistyped_relu_name_is_refused_naming_relu(backend: str, training: bool) -> None:
    """``relu="no"`` was refused as `activation`, an argument the caller never passed."""
    x, w, relu = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3), "no"
    running = (torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match=r"^`relu` must be True, False or one of 'none', 'relu'.*got 'no'") as err:
        conv_bn_relu(x, w, None, None, None, *running, training, 0.1, 1e-5, relu=relu, backend=backend)  # type: ignore[arg-type]
    assert "`activation`" not in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("relu", [1, 0.0, [True]], ids=repr)
def test_relu_that_is_not_a_bool_or_a_name_is_refused(relu: object) -> None:
    """``relu=1`` read as True and ``relu=0.0`` as False without a word."""
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    with pytest.raises(TypeError, match=r"^`relu` must be True, False or one of 'none', 'relu'.*got"):
        conv_bn_relu(x, w, None, None, None, None, None, True, 0.1, 1e-5, relu=relu)  # type: ignore[arg-type]


def test_a_mistyped_activation_still_names_activation() -> None:
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    with pytest.raises(ValueError, match=r"^`activation` must be one of .*got 'Relu'"):
        conv_bn_relu(x, w, None, None, None, None, None, True, 0.1, 1e-5, activation="Relu")  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
@pytest.mark.parametrize("eps", ["1e-5", None], ids=repr)
def test_conv_bn_relu_eps_must_be_a_number(backend: str, eps: object) -> None:
    """It failed inside the batch norm (``'<=' not supported between instances of 'str' and 'float'``)."""
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    with pytest.raises(TypeError, match=r"^`eps` must be a finite number > 0, got"):
        conv_bn_relu(x, w, None, None, None, None, None, True, 0.1, eps, backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
def test_conv_bn_relu_eps_must_be_positive_with_batch_statistics(backend: str) -> None:
    """The torch path took eps=-1 and normalised by ``rsqrt(var - 1)`` (NaN where var < 1); eager refuses it."""
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    with pytest.raises(ValueError, match=r"^`eps` must be a finite number > 0, got -1.0"):
        conv_bn_relu(x, w, None, None, None, None, None, True, 0.1, -1.0, backend=backend)
