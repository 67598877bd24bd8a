"""The shared argument checks, the one-line error helper and the patching handle."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_accel._utils.checks import (
    check_bool,
    check_bytes,
    check_choice,
    check_int,
    check_number,
    check_seed,
)
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.patching import active_patch, patch, restore_all, swap_class


@pytest.mark.parametrize(
    ("call", "kind", "message"),
    [
        (lambda: check_int("steps", True, low=0), TypeError, "`steps` must be an integer >= 0, got True (bool)."),
        (lambda: check_int("steps", 1.0, low=0), TypeError, "got 1.0 (float)"),
        (
            lambda: check_int("steps", -1, low=0, fix="Use 0."),
            ValueError,
            "`steps` must be an integer >= 0, got -1. Use 0.",
        ),
        (lambda: check_int("k", 9, low=1, high=8), ValueError, "an integer >= 1 and <= 8, got 9"),
        (lambda: check_number("lr", 0, low=0, low_open=True), ValueError, "`lr` must be a number > 0, got 0."),
        (lambda: check_number("lr", float("nan"), low=0), ValueError, "got nan"),
        (lambda: check_number("lr", "1e-3"), TypeError, "got '1e-3' (str)"),
        (lambda: check_number("p", False, low=0.0, high=1.0), TypeError, "got False (bool)"),
        (
            lambda: check_choice("mode", "x", ("a", "b", "c")),
            ValueError,
            "`mode` must be one of 'a', 'b', 'c', got 'x'.",
        ),
        (lambda: check_choice("mode", 3, ("a", "b")), TypeError, "`mode` must be 'a' or 'b', got 3 (int)."),
        (lambda: check_choice("k", True, (1, 2)), TypeError, "got True (bool)"),
        (lambda: check_bool("full", 1), TypeError, "`full` must be True or False, got 1 (int)."),
        (lambda: check_bytes("ram", "5XB"), ValueError, "`ram` must be a byte count"),
        (lambda: check_bytes("ram", 1.5), TypeError, "got 1.5 (float)"),
        (lambda: check_bytes("ram", 10, low=100), ValueError, "an integer >= 100"),
        (
            lambda: check_seed("seed", 2**32, what="the split"),
            ValueError,
            "`seed` must be an integer >= 0 and <= 4294967295, got 4294967296. It seeds the split; any seed "
            "`lightning.seed_everything` takes (0 .. 2**32 - 1) works.",
        ),
        (lambda: check_seed("photo_seed", -1, what="the photos"), ValueError, "`photo_seed` must be an integer >= 0"),
        (
            lambda: check_seed("seed", "1", what="x"),
            TypeError,
            "`seed` must be an integer >= 0 and <= 4294967295, got '1' (str).",
        ),
    ],
)
def test_checks_raise_one_line_naming_argument_value_and_fix(call, kind, message):
    with pytest.raises(kind) as info:
        call()
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_checks_return_the_normalised_value():
    assert check_int("n", 3, low=1) == 3
    assert check_int("n", None, allow_none=True) is None
    assert check_number("x", 2, low=0) == 2.0 and isinstance(check_number("x", 2), float)
    assert check_choice("m", "b", ("a", "b")) == "b"
    assert check_choice("k", 2, (1, 2)) == 2
    assert check_bool("b", False) is False
    assert check_bytes("r", "1GiB") == 1 << 30
    assert check_bytes("r", "512MB") == 512 * 10**6
    assert check_bytes("r", None, allow_none=True) is None


def test_checks_refuse_numpy_scalars_with_the_fix():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"`n` must be an integer >= 1, got np.int64\(3\) \(int64\)") as exc:
        check_int("n", np.int64(3), low=1, fix="It counts steps.")
    # the fix is said, before the caller's own
    assert str(exc.value).endswith(
        ". Pass a Python value: `int(...)`, `float(...)` or `str(...)` of the numpy scalar. It counts steps."
    )
    with pytest.raises(TypeError, match=r"`x` must be a number"):
        check_number("x", np.float32(0.5))
    # these three subclass float / str or compare equal to an int choice: isinstance and == alone let them through
    with pytest.raises(TypeError, match=r"`x` must be a number, got np.float64\(0.5\) \(float64\)"):
        check_number("x", np.float64(0.5))
    with pytest.raises(TypeError, match=r"`bits` must be 8 or 4, got np.int64\(8\) \(int64\)"):
        check_choice("bits", np.int64(8), (8, 4))
    with pytest.raises(TypeError, match=r"`mode` must be 'a' or 'b', got np.str_\('a'\) \(str_\)"):
        check_choice("mode", np.str_("a"), ("a", "b"))


def test_huge_numbers_are_a_value_error_or_exact() -> None:
    with pytest.raises(ValueError, match=r"`x` must be a number >= 0, got 1000"):
        check_number("x", 10**400, low=0)
    assert check_bytes("b", "1" + "0" * 400) == 10**400  # exact, no float on the way
    assert check_bytes("b", "2.01KB") == 2010  # through a float: 2.01 * 1000 = 2009.9999999999998 -> 2009


def test_one_line_joins_lines_names_unexpected_types_and_keeps_the_first_line_on_request():
    assert one_line(ValueError("a\n  b")) == "a b"
    assert one_line(OSError("disk\nfull"), expected=(ValueError,)) == "OSError: disk full"
    assert one_line(ValueError("x"), expected=(ValueError,)) == "x"
    assert one_line(RuntimeError("top\nsecond"), first=True) == "top"
    assert one_line(KeyError()) == "KeyError"
    assert one_line("  spaced \n text ") == "spaced text"


class _Thing:
    def step(self, x: int) -> int:
        return x + 1


def test_patch_wraps_restores_the_class_method_and_is_idempotent():
    t = _Thing()
    calls = []

    def make(p):
        def step(x):
            calls.append(x)
            return p.original(x) * 10

        return step

    p = patch(t, "step", make)
    assert t.step(1) == 20 and calls == [1]
    assert patch(t, "step", make) is p  # a second install returns the live patch, no double wrap
    assert t.step(1) == 20 and calls == [1, 1]
    assert active_patch(t, "step") is p
    p.restore()
    assert "step" not in vars(t) and t.step(1) == 2  # the class's method shows through again
    p.restore()  # idempotent
    assert active_patch(t, "step") is None


def test_patch_restores_an_instance_attribute_and_restore_all_undoes_every_patch():
    t = _Thing()
    own = lambda x: x - 1  # noqa: E731
    t.step = own  # type: ignore[method-assign]
    patch(t, "step", lambda p: lambda x: p.original(x) * 2)
    patch(t, "step", lambda p: lambda x: 0, key="second")  # a second key stacks on top; restore_all undoes both
    assert t.step(3) == 0
    restore_all(t)
    assert t.step is own


@pytest.mark.parametrize("order", ["oldest_first", "newest_first"])
def test_patches_on_one_attribute_restore_in_any_order(order: str):
    t = _Thing()
    a = patch(t, "step", lambda p: lambda x: p.original(x) * 10, key="a")
    b = patch(t, "step", lambda p: lambda x: p.original(x) + 100, key="b")
    assert t.step(1) == 120
    first, second = (a, b) if order == "oldest_first" else (b, a)
    first.restore()
    assert t.step(1) == (102 if order == "oldest_first" else 20)  # only the live patch still applies
    second.restore()
    assert t.step(1) == 2
    assert "step" not in vars(t)  # the class method shows through again
    assert active_patch(t, "a") is None and active_patch(t, "b") is None


def test_an_out_of_order_restore_puts_back_an_instance_attribute():
    t = _Thing()
    own = lambda x: x - 1  # noqa: E731
    t.step = own  # type: ignore[method-assign]
    a = patch(t, "step", lambda p: lambda x: p.original(x) * 2, key="a")
    b = patch(t, "step", lambda p: lambda x: p.original(x) * 3, key="b")
    a.restore()
    assert t.step(5) == 12
    b.restore()
    assert t.step is own


def test_patch_refuses_a_missing_attribute_naming_it():
    with pytest.raises(AttributeError, match=r"`_Thing.stpe`"):
        patch(_Thing(), "stpe", lambda p: None)


def test_patch_on_an_optimizer_and_a_module_round_trips():
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    seen = []
    p = patch(opt, "step", lambda p: lambda *a, **k: (seen.append(1), p.original(*a, **k))[1])
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert seen == [1]
    p.restore()
    assert "step" not in vars(opt)
    f = patch(m, "forward", lambda p: lambda x: p.original(x) * 0)
    assert m(torch.ones(1, 2)).abs().sum() == 0
    f.restore()
    assert "forward" not in vars(m)
    pickle.dumps(m)  # nothing of the patch is left on the module


def test_swap_class_returns_the_previous_class():
    class Sub(torch.nn.Linear):
        pass

    m = torch.nn.Linear(1, 1)
    prev = swap_class(m, Sub)
    assert type(m) is Sub and prev is torch.nn.Linear
    swap_class(m, prev)
    assert type(m) is torch.nn.Linear
