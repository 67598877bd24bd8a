"""Model factories leave the caller's random state alone; `num_classes="auto"` reads the counts data modules give."""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import ImageClassifier, TinyGPT
from lightning_accel.models.gpt2 import GPT2Embedding, GPT2Head, gpt2_lm
from tests.tiny import trainer


def test_gpt2_lm_leaves_the_global_random_state_alone() -> None:
    """Its weights depend on `seed` alone, and what the caller draws afterwards depends on the caller's seed (it used
    to reseed the global generator: after it, runs seeded 1 and 2 drew the same dropout masks and shuffles)."""
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    a = gpt2_lm(layers=1, seed=5)
    assert torch.equal(torch.rand(4), expected)  # the stream goes on as if gpt2_lm had not been called
    torch.manual_seed(2)
    b = gpt2_lm(layers=1, seed=5)
    assert not torch.equal(torch.rand(4), expected)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    first, last, other = a[0], a[-1], gpt2_lm(layers=1, seed=6)[0]
    assert isinstance(first, GPT2Embedding) and isinstance(last, GPT2Head) and isinstance(other, GPT2Embedding)
    assert not torch.equal(other.wte.weight, first.wte.weight)
    assert last.head.weight is first.wte.weight


class _CountDM(L.LightningDataModule):
    """Five classes of random 8 px images; the count is told as ``num_classes`` (any type) or ``classes``."""

    def __init__(self, num_classes: Any = None, classes: Any = None) -> None:
        super().__init__()
        if num_classes is not None:
            self.num_classes = num_classes
        if classes is not None:
            self.classes = classes

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(10, 3, 8, 8, generator=g), torch.arange(10) % 5), batch_size=5)


@pytest.mark.parametrize(
    "dm",
    [
        _CountDM(num_classes=np.int64(5)),  # e.g. `labels.max() + 1` on a numpy array
        _CountDM(num_classes=torch.tensor(5)),  # ... on a tensor
        _CountDM(classes=np.array(["a", "b", "c", "d", "e"])),  # scikit-learn's LabelEncoder.classes_
    ],
    ids=["numpy-int", "tensor", "numpy-classes"],
)
def test_auto_reads_numpy_and_tensor_counts(dm: _CountDM) -> None:
    """These used to be ignored, and the fit refused with "needs a data module that tells its class count"."""
    model = ImageClassifier(num_classes="auto", width=4, blocks=(1,))
    trainer(max_steps=1).fit(model, datamodule=dm)
    assert model.model.fc.out_features == 5 and model.hparams["num_classes"] == 5
    assert type(model.hparams["num_classes"]) is int  # saved in checkpoints: a plain int


@pytest.mark.parametrize(
    ("dm", "match"),
    [
        (_CountDM(num_classes=1), r"`_CountDM.num_classes` is 1 \(int\)"),
        (_CountDM(num_classes=5.0), r"`_CountDM.num_classes` is 5.0 \(float\)"),
        (_CountDM(classes=["only"]), r"`_CountDM.classes` lists 1: \['only'\]"),
    ],
    ids=["one-class", "float", "one-name"],
)
def test_auto_refuses_an_unusable_count_in_one_line(dm: _CountDM, match: str) -> None:
    """A single class used to build a 1-way head (torchmetrics then failed with its own message); a float count was
    ignored and the fit refused as if the data module had said nothing."""
    model = ImageClassifier(num_classes="auto", width=4, blocks=(1,))
    with pytest.raises(ValueError, match=r"^`num_classes='auto'` needs .*" + match) as exc:
        trainer(max_steps=1).fit(model, datamodule=dm)
    assert "\n" not in str(exc.value)


def test_an_integer_head_still_trains_on_data_that_names_one_class() -> None:
    """The strict reading is for "auto" only: an integer head evaluated on one class's data is not refused."""
    model = ImageClassifier(num_classes=5, width=4, blocks=(1,))
    trainer(max_steps=1).fit(model, datamodule=_CountDM(num_classes=1))
    assert model.model.fc.out_features == 5


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8])
def test_narrow_integer_labels_train_validate_and_test(dtype: torch.dtype) -> None:
    """numpy int32 / uint8 labels collate as such: cross_entropy used to refuse them ("expected target dtype to be
    Long or Byte, but got Int")."""
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(8, 3, 8, 8, generator=g), (torch.arange(8) % 4).to(dtype))
    model = ImageClassifier(num_classes=4, width=4, blocks=(1,))
    t = trainer(max_steps=2, limit_val_batches=None)
    t.fit(model, DataLoader(ds, batch_size=4), DataLoader(ds, batch_size=4))
    assert t.global_step == 2 and torch.isfinite(t.callback_metrics["val_loss"])
    t.test(model, DataLoader(ds, batch_size=4), verbose=False)
    assert 0.0 <= float(t.callback_metrics["test_acc"]) <= 1.0


def test_float_labels_are_refused_in_one_line() -> None:
    model = ImageClassifier(num_classes=4, width=4, blocks=(1,))
    with pytest.raises(TypeError, match=r"^The batch's labels must be integer indices, got a torch.float32 tensor"):
        model.training_step((torch.randn(2, 3, 8, 8), torch.tensor([0.0, 1.0])), 0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.int16])
def test_tiny_gpt_takes_narrow_integer_tokens(dtype: torch.dtype) -> None:
    """A token file's int32 / uint8 / int16 tokens: the embedding took int32 but the loss refused it, and the
    embedding refused uint8 and int16."""
    torch.manual_seed(0)
    model = TinyGPT(n_layer=1, n_embd=16, n_head=2, dropout=0.0).eval()
    tokens = torch.randint(0, 27, (2, 65), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model._loss(tokens.to(dtype)), model._loss(tokens))
    assert torch.equal(model._loss((tokens.to(dtype), torch.zeros(2))), model._loss(tokens))


@pytest.mark.parametrize("length", [1, 67])
def test_tiny_gpt_names_a_sequence_it_cannot_learn_from(length: int) -> None:
    """One token has no next token to predict (it stopped in the attention with "cannot reshape tensor of 0
    elements"); 67 tokens feed 66 to a model of block_size 65, which the error now says in terms of the batch."""
    model = TinyGPT(n_layer=1, n_embd=16, n_head=2, block_size=65)
    tokens = torch.randint(0, 27, (2, length))
    with pytest.raises(ValueError, match=rf"^`TinyGPT` trains on .* 2 <= T <= block_size \+ 1 = 66 .*\(2, {length}\)"):
        model.training_step(tokens, 0)
    model.training_step(torch.randint(0, 27, (2, 2)), 0)  # the shortest sequence it learns from


def test_resuming_on_another_class_count_is_one_line(tmp_path: Any) -> None:
    """torch's load_state_dict used to answer with a multi-line "size mismatch for model.fc.weight ..."."""
    model = ImageClassifier(num_classes="auto", width=4, blocks=(1,))
    t = trainer(max_steps=1, default_root_dir=str(tmp_path))
    t.fit(model, datamodule=_CountDM(num_classes=5))
    t.save_checkpoint(tmp_path / "five.ckpt")
    for fresh, said in (
        (ImageClassifier(num_classes="auto", width=4, blocks=(1,)), "`num_classes=auto` read from the data module"),
        (ImageClassifier(num_classes=6, width=4, blocks=(1,)), "`num_classes=6`"),
    ):
        with pytest.raises(
            ValueError,
            match=r"^The checkpoint was trained on 5 classes, but this `ImageClassifier` has 6 outputs \(" + said,
        ) as exc:
            trainer(max_steps=2, default_root_dir=str(tmp_path)).fit(
                fresh, datamodule=_CountDM(num_classes=6), ckpt_path=tmp_path / "five.ckpt"
            )
        assert "\n" not in str(exc.value)
    resumed = ImageClassifier(num_classes="auto", width=4, blocks=(1,))  # the same count: resumes
    trainer(max_steps=2, default_root_dir=str(tmp_path)).fit(
        resumed, datamodule=_CountDM(num_classes=5), ckpt_path=tmp_path / "five.ckpt"
    )
    assert resumed.model.fc.out_features == 5


def test_gpt2_lm_names_a_sequence_longer_than_seq() -> None:
    """The position embedding used to fail with a bare "IndexError: index out of range in self"."""
    net = gpt2_lm(seq=16, layers=1)
    assert net(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 64)
    with pytest.raises(ValueError, match=r"^Sequence length 17 exceeds `seq` 16"):
        net(torch.zeros(2, 17, dtype=torch.long))
