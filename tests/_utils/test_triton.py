"""The Triton switch: one reading of ``TRITON_INTERPRET``, one ``backend`` check, one resolution rule."""

from __future__ import annotations

import pytest
import torch

from lightning_accel._utils import triton as switch
from lightning_accel._utils.triton import BACKENDS, check_backend, interpreter_active, resolve_backend, use_triton

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # only `device.type` is read: no GPU needed


@pytest.mark.parametrize(
    ("value", "active"),
    [("1", True), ("true", True), ("TRUE", True), ("on", True), ("yes", True), (" 1 ", True)]
    + [("0", False), ("", False), ("no", False), ("off", False), ("false", False), ("2", False)],
)
def test_interpreter_reads_the_variable_as_triton_does(
    monkeypatch: pytest.MonkeyPatch, value: str, active: bool
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_active() is active


def test_interpreter_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not interpreter_active()


def test_check_backend_names_argument_value_expected_and_fix() -> None:
    for b in BACKENDS:
        check_backend(b)
    with pytest.raises(ValueError, match=r"`backend` must be one of 'auto', 'triton', 'reference', got 'eager'"):
        check_backend("eager", ("auto", "triton", "reference"))
    with pytest.raises(TypeError, match=r"got True \(bool\)\. Use 'auto'"):
        check_backend(True)
    with pytest.raises(ValueError, match=r"`kernel` must be"):
        check_backend("cuda", name="kernel")


@pytest.mark.parametrize("installed", [True, False])
def test_auto_resolution(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    monkeypatch.setattr(switch, "triton_available", lambda: installed)
    assert resolve_backend(CUDA, "auto") == ("triton" if installed else "reference")
    assert resolve_backend(CPU, "auto") == "eager"  # off CUDA: the unfused ops, where the caller has them
    assert resolve_backend(CPU, "auto", ("auto", "triton", "reference")) == "reference"  # ... else its torch path
    assert resolve_backend(torch.zeros(1), "reference") == "reference"
    assert resolve_backend(torch.zeros(1), "eager") == "eager"
    assert use_triton(CUDA, "auto") is installed and not use_triton(CPU, "auto")


def test_forced_triton_needs_the_package_and_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(switch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="`backend='triton'` needs the `triton` package"):
        resolve_backend(CUDA, "triton")
    monkeypatch.setattr(switch, "triton_available", lambda: True)
    assert resolve_backend(CUDA, "triton") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="got a tensor on cpu.*`TRITON_INTERPRET=1`.*backend='auto'"):
        use_triton(torch.zeros(1), "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(torch.zeros(1), "triton")
