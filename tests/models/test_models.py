from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_accel.models import GPT, GPTBlock, ImageClassifier, SmallResNet, TinyGPT


@pytest.mark.parametrize("size", [8, 32, 33])
def test_resnet_shapes_and_backward(size: int) -> None:
    net = SmallResNet(num_classes=10, width=8, blocks=(1, 2))
    out = net(torch.randn(3, 3, size, size))
    assert out.shape == (3, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_resnet_bad_sizes() -> None:
    with pytest.raises(ValueError, match="`width` must be an integer >= 1, got 0"):
        SmallResNet(width=0)
    with pytest.raises(ValueError, match="`num_classes` must be an integer >= 2, got 1"):
        SmallResNet(num_classes=1)
    with pytest.raises(TypeError, match="`width`"):
        SmallResNet(width=True)
    with pytest.raises(ValueError, match="`blocks` must be a non-empty list"):
        SmallResNet(blocks=())


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    net = GPT(vocab_size=11, block_size=9, n_layer=1, n_head=2, n_embd=16, dropout=0.0).eval()
    idx = torch.randint(0, 11, (2, 9))
    a = net(idx)
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % 11
    b = net(idx2)
    assert a.shape == (2, 9, 11)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])  # changing the last token never changes earlier outputs
    with pytest.raises(ValueError, match="block_size"):
        net(torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        GPTBlock(10, 3)


def test_lightning_modules_learn_one_batch() -> None:
    torch.manual_seed(0)
    clf = ImageClassifier(width=8, lr=1e-2)
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 10
    opt = torch.optim.Adam(clf.parameters(), lr=1e-2)
    first = None
    for _ in range(15):
        loss = torch.nn.functional.cross_entropy(clf(x), y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first * 0.5
    gpt = TinyGPT(n_layer=1, n_embd=16, n_head=2)
    tokens = torch.randint(0, 27, (4, 65))
    assert gpt._loss(tokens).ndim == 0


def test_image_classifier_sizes_its_example_input_like_the_data() -> None:
    """The model summary (and StructuredPruning's trace) see the data's image size, not a fixed 64 px."""
    from tests.tiny import TinyDigits, trainer

    class Sized(TinyDigits):
        image_size = 8

    model = ImageClassifier(width=4)
    trainer(fast_dev_run=1).fit(model, datamodule=Sized(batch_size=8, n=16))
    assert tuple(model.example_input_array.shape) == (2, 3, 8, 8)


def test_image_classifier_steps_through_an_empty_batch() -> None:
    """A batch whose samples all failed to decode arrives empty: the step still reaches every parameter (DDP needs
    every rank to step) with a zero loss, and evaluation skips it."""
    model = ImageClassifier(num_classes=10, width=8, blocks=(1,))
    empty = (torch.zeros(0, 3, 16, 16), torch.zeros(0, dtype=torch.long))
    loss = model.training_step(empty, 0)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    model.validation_step(empty, 0)
    model.test_step(empty, 0)
    assert model.val_acc.update_count == 0 and model.test_acc.update_count == 0


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: ImageClassifier(lr=-1), ValueError, r"`lr` must be a number > 0, got -1"),
        (lambda: ImageClassifier(weight_decay="x"), TypeError, r"`weight_decay` must be a number >= 0, got 'x'"),
        (lambda: TinyGPT(lr=0), ValueError, r"`lr` must be a number > 0, got 0"),
        (lambda: TinyGPT(n_embd=100, n_head=3), ValueError, r"`n_embd` must be a multiple of `n_head`.*n_embd=99"),
        (lambda: TinyGPT(dropout=1.0), ValueError, r"`dropout` must be a number >= 0 and < 1, got 1.0"),
        (lambda: GPT(vocab_size=0), ValueError, r"`vocab_size` must be an integer >= 1, got 0"),
    ],
)
def test_bad_model_arguments_are_refused_when_built(build: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        build()
