from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_accel.models import GPT, BasicBlock, CausalSelfAttention, GPTBlock, ImageClassifier, SmallResNet, TinyGPT
from lightning_accel.models.gpt2 import GPT2MLP, GPT2Attention, GPT2Block, GPT2Embedding, GPT2Head, gpt2_lm


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


def test_gpt_names_an_empty_sequence() -> None:
    """No token at all used to stop in the attention with "cannot reshape tensor of 0 elements"."""
    net = GPT(vocab_size=11, block_size=9, n_layer=1, n_head=2, n_embd=16)
    with pytest.raises(ValueError, match=r"^Sequence length 0 is outside 1\.\.9: .*`block_size`"):
        net(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^Sequence length 0 is outside 1\.\.9: "):
        net.pipeline_modules()[0](torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^Sequence length 0: the model embeds 1 to `seq` tokens"):
        gpt2_lm(seq=9)(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^`n_embd` must be a multiple of `n_head`, got n_embd=10, n_head=3\. "):
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
    assert first is not None and loss.item() < first * 0.5
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
    assert isinstance(model.example_input_array, torch.Tensor)
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
        (lambda: ImageClassifier(lr=-1), ValueError, r"`lr` must be a number > 0 and < inf, got -1"),
        (
            lambda: ImageClassifier(weight_decay="x"),  # type: ignore[arg-type]
            TypeError,
            r"`weight_decay` must be a number >= 0 and < inf, got 'x'",
        ),
        (lambda: TinyGPT(lr=0), ValueError, r"`lr` must be a number > 0 and < inf, got 0"),
        # an infinite rate or decay used to be accepted: every weight NaN after the first step
        (lambda: ImageClassifier(lr=float("inf")), ValueError, r"^`lr` must be a number > 0 and < inf, got inf\. "),
        (lambda: TinyGPT(weight_decay=float("inf")), ValueError, r"^`weight_decay` must be a number >= 0 and < inf"),
        (lambda: SmallResNet(in_channels=0), ValueError, r"^`in_channels` must be an integer >= 1, got 0\. "),
        (
            lambda: gpt2_lm(seed=2**64),
            ValueError,
            r"^`seed` must be an integer >= 0 and <= 4294967295, got 18446744073709551616\. It seeds the initial",
        ),
        (lambda: TinyGPT(n_embd=100, n_head=3), ValueError, r"`n_embd` must be a multiple of `n_head`.*n_embd=99"),
        (lambda: TinyGPT(dropout=1.0), ValueError, r"`dropout` must be a number >= 0 and < 1, got 1.0"),
        (lambda: GPT(vocab_size=0), ValueError, r"`vocab_size` must be an integer >= 1, got 0"),
        # a stage of < 1 block used to be skipped silently: a smaller network than asked for
        (lambda: ImageClassifier(blocks=(1, -1)), ValueError, r"^`blocks\[1\]` must be an integer >= 1, got -1\. "),
        (lambda: ImageClassifier(blocks=(0, 0)), ValueError, r"^`blocks\[0\]` must be an integer >= 1, got 0"),
        (
            lambda: ImageClassifier(blocks=3),  # type: ignore[arg-type]
            TypeError,
            r"^`blocks` must be a list of blocks per stage.*got 3 \(int\)",
        ),
        (lambda: SmallResNet(blocks=(1, True)), TypeError, r"^`blocks\[1\]` must be an integer >= 1, got True"),
        (lambda: gpt2_lm(layers=-1), ValueError, r"^`layers` must be an integer >= 1, got -1\.$"),
        (lambda: gpt2_lm(dropout=2.0), ValueError, r"^`dropout` must be a number >= 0 and < 1, got 2\.0"),
        (lambda: gpt2_lm(width=30, heads=4), ValueError, r"^`width` must be a multiple of `heads`.*width=32\.$"),
    ],
)
def test_bad_model_arguments_are_refused_when_built(build: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        # a head count of 0 stopped with a bare ZeroDivisionError; a negative one divides the width, and the layer
        # failed only in its first forward
        (lambda: CausalSelfAttention(64, 0), ValueError, r"^`n_head` must be an integer >= 1, got 0\. "),
        (lambda: CausalSelfAttention(64, -2), ValueError, r"^`n_head` must be an integer >= 1, got -2\. "),
        (lambda: GPT2Attention(32, 0), ValueError, r"^`n_head` must be an integer >= 1, got 0\. "),
        (lambda: GPT2Block(32, 0), ValueError, r"^`n_head` must be an integer >= 1, got 0\. "),
        (
            lambda: GPTBlock(32, 2.0),  # type: ignore[arg-type]
            TypeError,
            r"^`n_head` must be an integer >= 1, got 2\.0 \(float\)",
        ),
        # an MLP of no hidden units was built and trained as a block without one
        (lambda: GPTBlock(32, 2, mlp_ratio=0), ValueError, r"^`mlp_ratio` must be an integer >= 1, got 0\. "),
        (lambda: GPT2MLP(32, hidden=0), ValueError, r"^`hidden` must be an integer >= 1 or None, got 0\. "),
        (lambda: CausalSelfAttention(32, 2, dropout=1.5), ValueError, r"^`dropout` must be a number >= 0 and < 1"),
        # a negative width stopped in the first LayerNorm with torch's "negative dimension", naming no argument
        (lambda: GPTBlock(-1, 1), ValueError, r"^`n_embd` must be an integer >= 1, got -1\.$"),
        (lambda: GPT2Block(-4, 2), ValueError, r"^`n_embd` must be an integer >= 1, got -4\.$"),
        # torch's own "dropout probability has to be between 0 and 1", naming no argument
        (lambda: GPT2MLP(32, dropout=5.0), ValueError, r"^`dropout` must be a number >= 0 and < 1, got 5\.0\. "),
        # a truthy string built the biases it asked to leave out
        (
            lambda: GPTBlock(32, 2, bias="no"),  # type: ignore[arg-type]
            TypeError,
            r"^`bias` must be True or False, got 'no' \(str\)",
        ),
        # accepted: a layer of no tokens, channels or stride, failing only in its first forward
        (lambda: GPT2Embedding(0, 4, 8), ValueError, r"^`vocab` must be an integer >= 1, got 0\.$"),
        (lambda: GPT2Head(4, 0), ValueError, r"^`n_embd` must be an integer >= 1, got 0\.$"),
        (lambda: BasicBlock(0, 4), ValueError, r"^`in_ch` must be an integer >= 1, got 0\. "),
        (lambda: BasicBlock(4, 4, stride=0), ValueError, r"^`stride` must be an integer >= 1, got 0\. "),
    ],
)
def test_bad_block_arguments_are_refused_in_one_line(build: Any, error: type[Exception], match: str) -> None:
    """The building blocks are public: they check their own arguments, as GPT and gpt2_lm do."""
    with pytest.raises(error, match=match) as exc:
        build()
    assert "\n" not in str(exc.value)


class _StopAfter(Callback):
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


class _Stream(IterableDataset):
    """Token sequences without a length: the Trainer cannot know how many steps an epoch has."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        for _ in range(12):
            yield torch.randint(0, 27, (17,), generator=g)


def test_a_fit_without_a_step_bound_trains_at_a_constant_lr() -> None:
    """Only `max_time`, `max_epochs=-1` or a stream bound the fit: `estimated_stepping_batches` is infinite (the
    default schedule crashed on `int(inf)`) or -1 for a loader without a length (the cosine ended after one step);
    the learning rate now stays at `lr`."""
    from tests.tiny import LRProbe, classifier, loader, trainer

    probe = LRProbe()
    t = trainer(max_epochs=-1, limit_train_batches=3, callbacks=[probe, _StopAfter(5)])
    assert t.estimated_stepping_batches == float("inf")
    t.fit(classifier(width=4, lr=0.02), loader(8, 24))
    assert t.global_step == 5 and probe.lrs == [0.02] * 5
    assert t.optimizers[0].param_groups[0]["lr"] == 0.02

    probe = LRProbe()
    t = trainer(max_epochs=1, limit_train_batches=None, callbacks=[probe])
    t.fit(TinyGPT(n_layer=1, n_embd=16, n_head=2, block_size=16, lr=3e-3), DataLoader(_Stream(), batch_size=4))
    assert t.global_step == 3 and probe.lrs == [3e-3] * 3


def test_a_bounded_fit_keeps_the_cosine() -> None:
    from tests.tiny import LRProbe, classifier, loader, trainer

    probe = LRProbe()
    trainer(max_epochs=2, limit_train_batches=3, callbacks=[probe]).fit(classifier(width=4, lr=0.02), loader(8, 24))
    assert probe.lrs[0] == 0.02 and probe.lrs == sorted(probe.lrs, reverse=True) and probe.lrs[-1] < 0.01


def _labelled_by(model: ImageClassifier, n: int) -> DataLoader:
    """The first ``n`` digits labelled with ``model``'s own predictions: accuracy 1 there, whatever it learnt."""
    from tests.tiny import digits_tensors

    x, _ = digits_tensors(n).tensors
    with torch.no_grad():
        y = model.eval()(x).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def test_several_validation_and_test_loaders_are_measured_each_on_its_own() -> None:
    """Two loaders used to crash (no `dataloader_idx`); each now has its own accuracy (one shared metric would mix
    their counts), logged under Lightning's per-loader names, equal to what each loader alone gives."""
    from tests.tiny import classifier, loader, trainer

    torch.manual_seed(0)
    model = classifier(width=4)
    trainer(max_epochs=1, limit_train_batches=8).fit(model, loader(32, 256))
    a, b = loader(16, 64), _labelled_by(model, 48)
    t = trainer(limit_val_batches=1.0, limit_test_batches=1.0)
    alone = [t.validate(model, dl, verbose=False)[0] for dl in (a, b)]
    assert set(alone[0]) == {"val_acc", "val_loss"}  # one loader: the plain names
    both = t.validate(model, [a, b], verbose=False)
    for i in (0, 1):
        assert both[i][f"val_acc/dataloader_idx_{i}"] == pytest.approx(alone[i]["val_acc"], abs=1e-6)
        assert both[i][f"val_loss/dataloader_idx_{i}"] == pytest.approx(alone[i]["val_loss"], rel=1e-5)
    assert alone[1]["val_acc"] == 1.0 and alone[0]["val_acc"] < 0.9  # the two loaders do differ
    tested = t.test(model, [a, b], verbose=False)
    assert [r[f"test_acc/dataloader_idx_{i}"] for i, r in enumerate(tested)] == pytest.approx(
        [r["val_acc"] for r in alone], abs=1e-6
    )
    # and inside fit, validating both loaders every epoch
    fit = trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=1.0, num_sanity_val_steps=1)
    fit.fit(model, loader(32, 64), [a, b])
    assert {"val_acc/dataloader_idx_0", "val_acc/dataloader_idx_1"} <= set(fit.callback_metrics)

    gpt = TinyGPT(n_layer=1, n_embd=16, n_head=2, block_size=16)
    streams: list[DataLoader[torch.Tensor]] = [
        DataLoader(list(_Stream()), batch_size=4),  # type: ignore[arg-type]  # a list is a map-style dataset
        DataLoader(list(_Stream())[:4], batch_size=4),  # type: ignore[arg-type]
    ]
    t = trainer(limit_val_batches=1.0)
    one = [t.validate(gpt, dl, verbose=False)[0]["val_loss"] for dl in streams]
    two = t.validate(gpt, streams, verbose=False)
    assert [r[f"val_loss/dataloader_idx_{i}"] for i, r in enumerate(two)] == pytest.approx(one, rel=1e-5)
