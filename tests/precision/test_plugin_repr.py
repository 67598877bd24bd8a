"""What a user sees when printing ``FusedPrecision`` and its ``FusionReport``: the settings, what surgery fused and
what it skipped with why, and never a dump of parameter values."""

from __future__ import annotations

import pickle

import torch
from torch import nn

from lightning_accel.models.transformer import GPT
from lightning_accel.precision import FusedPrecision, apply_fusions


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(GPT(27, 16, 1, 4, 32), nn.Linear(3, 3), nn.Dropout(0.1))


def test_plugin_repr_shows_its_settings() -> None:
    plugin = FusedPrecision(
        "bf16-mixed", device="cpu", fusions=["norm", "qkv"], ignore_modules=["0.blocks.0"], backend="reference"
    )
    text = repr(plugin)
    assert text.startswith("FusedPrecision(")
    for part in (
        "precision='bf16-mixed'",
        "device='cpu'",
        "fusions=['norm', 'qkv']",
        "ignore_modules=['0.blocks.0']",
        "backend='reference'",
        "memory_format='preserve'",
        "compile=False",
    ):
        assert part in text, (part, text)
    assert "report" not in text  # nothing converted yet
    assert "fusions=all" in repr(FusedPrecision(device="cpu"))
    assert "ignore_modules=[LayerNorm, 'head']" in repr(
        FusedPrecision(device="cpu", ignore_modules=[nn.LayerNorm, "head"])
    )
    assert "fusions=[]" in repr(FusedPrecision(device="cpu", fusions=[]))
    compiled = repr(FusedPrecision(device="cpu", compile=True, compile_kwargs={"dynamic": False}))
    assert "compile=True" in compiled and "compile_kwargs={'dynamic': False}" in compiled


def test_plugin_repr_after_surgery_says_what_was_fused_and_skipped() -> None:
    plugin = FusedPrecision(device="cpu", ignore_modules=["0.blocks.0.ln_1"])
    model = _model()  # the plugin holds it weakly
    plugin.convert_module(model)
    text = repr(plugin)
    assert "6/7 eligible modules fused" in text, text
    assert "skipped: 0.blocks.0.ln_1 (norm: ignored (`ignore_modules`))" in text, text
    assert "tensor(" not in text and "\n" not in text
    assert plugin.switch_off("too slow")
    assert "switched off: too slow" in repr(plugin)


def test_report_repr_is_the_summary_not_the_parameters() -> None:
    report = apply_fusions(_model(), ignore_modules=["0.blocks.0.ln_1"])
    text = repr(report)
    assert "tensor(" not in text and "Parameter" not in text, text
    assert text.startswith("FusionReport(") and report.summary() in text
    assert "skipped=['0.blocks.0.ln_1']" in text
    assert str(report) == text


def test_plugin_pickles_after_converting_a_model() -> None:
    """A converted plugin holds its model and the replaced parameters weakly; a pickled copy (a Trainer pickled for
    ``ddp_spawn``, a saved config) keeps the settings and the report, and converts a model of its own."""
    plugin = FusedPrecision(device="cpu", fusions=["qkv", "norm"], backend="reference")
    model = _model()
    plugin.convert_module(model)
    copy = pickle.loads(pickle.dumps(plugin))
    assert repr(copy) == repr(plugin)
    assert not copy.lever_active  # no model in this process yet
    other = _model()
    copy.convert_module(other)
    assert copy.lever_active and plugin.lever_active
