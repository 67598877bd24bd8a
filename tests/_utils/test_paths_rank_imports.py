from __future__ import annotations

import pytest

from lightning_accel._utils import (
    global_rank,
    is_global_zero,
    local_rank,
    module_available,
    require,
    safe_join,
    world_size,
)


@pytest.mark.parametrize("key", ["a/b.bin", "x", "deep/er/key-1_2.jpg", "100%.jpg", "a%20b.png", "%2e%2ex/y"])
def test_safe_join_accepts_plain_keys(key: str) -> None:
    assert safe_join("s3://bucket/root/", key) == f"s3://bucket/root/{key}"
    assert safe_join("/tmp/r", key) == f"/tmp/r/{key}"


@pytest.mark.parametrize(
    ("root", "joined"),
    [("/", "/a/b"), ("file:///", "file:///a/b"), ("s3://", "s3://a/b"), ("/data/", "/data/a/b"), ("", "a/b")],
)
def test_safe_join_keeps_the_root_anchor(root: str, joined: str) -> None:
    # the top of a tree stays absolute: stripping its slash would turn `/` + key into a relative path
    assert safe_join(root, "a/b") == joined


@pytest.mark.parametrize(
    "key",
    [
        "../x",
        "a/../../x",
        "/etc/passwd",
        "a\\b",
        "s3://other/k",
        "a/./b",
        "",
        "a\x00b",
        "a::/etc/passwd",
        # percent-encoded: an HTTP client decodes them and collapses the dot segments
        "%2e%2e/secret.txt",
        "a/%2E%2E/%2e%2E/x",
        "..%2fsecret",
        "%252e%252e/x",  # encoded twice
        "%2fetc/passwd",
        "a%5cb",
        "%2e/x",
    ],
)
def test_safe_join_refuses_escapes(key: str) -> None:
    with pytest.raises(ValueError, match="key|Key"):
        safe_join("/tmp/r", key)


def test_a_chained_key_would_alias_another_key() -> None:
    """Why ``::`` is refused: fsspec opens ``root/a::x`` as the file ``root/a``, another key's."""
    import fsspec

    _, path = fsspec.core.url_to_fs("/tmp/r/a::/etc/passwd")
    assert path == "/tmp/r/a"


def test_rank_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (global_rank(), local_rank(), world_size(), is_global_zero()) == (3, 1, 4, False)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert (global_rank(), world_size(), is_global_zero()) == (0, 2, True)


@pytest.mark.parametrize(
    ("env", "zero"),
    [
        ({"LOCAL_RANK": "1", "NODE_RANK": "0"}, False),  # Lightning's launcher, second process of the node
        ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False),  # the first process of the second node
        ({"LOCAL_RANK": "0", "NODE_RANK": "0"}, True),
        ({"LOCAL_RANK": "1", "RANK": "0"}, True),  # a global rank set wins (as torchrun sets both)
        ({}, True),  # not distributed
    ],
)
def test_global_zero_before_a_process_group(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], zero: bool) -> None:
    for k in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "SLURM_LOCALID", "NODE_RANK", "GROUP_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert is_global_zero() is zero


def test_require_names_package_and_fix() -> None:
    assert module_available("torch")
    require("torch", purpose="x")
    with pytest.raises(ModuleNotFoundError, match=r"pip install not-a-real-pkg-xyz"):
        require("not_a_real_pkg_xyz", purpose="The thing", pip_name="not-a-real-pkg-xyz")


def test_an_error_described_on_one_rank_is_rebuilt_on_another():
    import pickle

    from lightning_accel._utils.rank import describe_error, rebuild_error

    for err in (ValueError("`x` must be 1"), FileNotFoundError("`dirpath` '/tmp/d' does not exist")):
        described = pickle.loads(pickle.dumps(describe_error(err)))  # plain data: any rank unpickles it
        again = rebuild_error(described)
        assert type(again) is type(err) and str(again) == str(err)
    # an OSError's filename is not among its args: not rebuilt alike, so a RuntimeError says what it was
    again = rebuild_error(describe_error(NotADirectoryError(20, "Not a directory", "/tmp/f")))
    assert type(again) is RuntimeError and str(again) == "NotADirectoryError: [Errno 20] Not a directory: '/tmp/f'"

    class Local(Exception):  # not importable by its qualified name on another rank
        pass

    again = rebuild_error(describe_error(Local("boom")), where="on rank 0: ")
    assert type(again) is RuntimeError and str(again).startswith("on rank 0: ") and str(again).endswith("Local: boom")
