"""``eps`` and ``momentum`` of :func:`conv_bn_relu` take what ``nn.BatchNorm2d`` takes: any real number type (a numpy
scalar read from a config included), and refuse what would give NaN or a constant output, in one line."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from lightning_accel.ops.conv_bn_relu import conv_bn_relu

BACKENDS = ["auto", "reference", "eager"]


def _eager(x: torch.Tensor, conv: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d) -> torch.Tensor:
    return torch.relu(bn(conv(x)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("eps", [np.float32(1e-3), np.float64(1e-3), np.float16(1e-3), Fraction(1, 1000)], ids=repr)
def test_eps_of_any_real_number_type_matches_batchnorm(backend: str, training: bool, eps: object) -> None:
    """``nn.BatchNorm2d(eps=np.float32(...))`` works; the function refused the same value as "not a number"."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, bias=False)
    bn = torch.nn.BatchNorm2d(4, eps=float(eps))  # type: ignore[arg-type]
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 1.5)
    bn.train(training)
    x = torch.randn(2, 3, 6, 6)
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    got = conv_bn_relu(x, conv.weight, None, bn.weight, bn.bias, rm, rv, training, 0.1, eps, backend=backend)  # type: ignore[arg-type]
    torch.testing.assert_close(got, _eager(x, conv, bn))
    torch.testing.assert_close(rm, bn.running_mean)
    torch.testing.assert_close(rv, bn.running_var)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("momentum", [np.float32(0.25), Fraction(1, 4)], ids=repr)
def test_momentum_of_any_real_number_type_updates_running_statistics_like_batchnorm(
    backend: str, momentum: object
) -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, bias=False)
    bn = torch.nn.BatchNorm2d(4, momentum=0.25)
    x = torch.randn(2, 3, 6, 6)
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    got = conv_bn_relu(x, conv.weight, None, bn.weight, bn.bias, rm, rv, True, momentum, 1e-5, backend=backend)  # type: ignore[arg-type]
    torch.testing.assert_close(got, _eager(x, conv, bn))
    torch.testing.assert_close(rm, bn.running_mean)
    torch.testing.assert_close(rv, bn.running_var)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize(
    ("eps", "kind"),
    [
        (True, TypeError),
        (np.bool_(True), TypeError),
        ("1e-5", TypeError),
        (None, TypeError),
        (math.nan, ValueError),
        (np.float32("nan"), ValueError),
        (math.inf, ValueError),
        (np.float64("inf"), ValueError),
    ],
    ids=repr,
)
def test_eps_that_is_not_a_finite_number_is_refused_in_one_line(
    backend: str, training: bool, eps: object, kind: type[Exception]
) -> None:
    """NaN in eval mode (running statistics folded into the weights) gave a NaN output without a word, and an infinite
    eps a constant output (``x / sqrt(inf)`` is 0) in both modes."""
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    rm, rv = torch.zeros(4), torch.ones(4)
    with pytest.raises(kind, match=r"^`eps` must be a finite number.*, got .*nn\.BatchNorm2d\.eps") as err:
        conv_bn_relu(x, w, None, None, None, rm, rv, training, 0.1, eps, backend=backend)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)
    assert rm.eq(0).all() and rv.eq(1).all()  # nothing was updated before the error


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eps", [0, 0.0, -1e-5, np.float32(-1.0)], ids=repr)
def test_eps_not_above_zero_is_refused_with_batch_statistics(backend: str, eps: object) -> None:
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    with pytest.raises(ValueError, match=r"^`eps` must be a finite number > 0, got"):
        conv_bn_relu(x, w, None, None, None, None, None, True, 0.1, eps, backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["reference", "eager"])
@pytest.mark.parametrize("momentum", [math.nan, math.inf, np.float32("nan"), True, np.bool_(False)], ids=repr)
def test_momentum_that_is_not_a_finite_number_is_refused_before_updating(backend: str, momentum: object) -> None:
    """A NaN momentum turned both running statistics into NaN for good, without a word."""
    x, w = torch.randn(2, 3, 4, 4), torch.randn(4, 3, 3, 3)
    rm, rv = torch.zeros(4), torch.ones(4)
    with pytest.raises((TypeError, ValueError), match=r"^`momentum` must be a finite number, got"):
        conv_bn_relu(x, w, None, None, None, rm, rv, True, momentum, 1e-5, backend=backend)  # type: ignore[arg-type]
    assert rm.eq(0).all() and rv.eq(1).all()


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize(
    "conv_kwargs",
    [
        {"stride": np.int64(2)},
        {"padding": np.int32(1)},
        {"dilation": np.int64(2)},
        {"stride": (np.int64(2), np.int64(1)), "padding": [np.int64(1), 0]},
        {"stride": (2,), "padding": (1,), "dilation": (2,)},
    ],
    ids=repr,
)
def test_numpy_integer_and_one_element_conv_arguments_train_like_eager(backend: str, conv_kwargs: dict) -> None:
    """``F.conv2d`` takes a numpy integer ``stride``/``padding``/``dilation`` (a value read from a numpy config): the
    forward ran, and the backward failed with ``'numpy.int64' object is not iterable``, naming no argument."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    g, b = torch.rand(4, requires_grad=True), torch.randn(4, requires_grad=True)
    outs, grads = [], []
    for be in ("eager", backend):
        y = conv_bn_relu(x, w, None, g, b, None, None, True, 0.1, 1e-5, backend=be, **conv_kwargs)
        outs.append(y)
        grads.append(torch.autograd.grad(y.square().sum(), (x, w, g, b)))
    torch.testing.assert_close(outs[1], outs[0])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want)
