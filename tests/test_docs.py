"""Execute the ```python code blocks of README.md and docs/*.md, so the docs stay true.

Every block runs on its own, in a fresh namespace (a reader copies one block, not the page), in order, in one fresh
temporary working directory per file (so a block may read a file an earlier block of the page wrote). A block
preceded by the line ``<!-- docs-test: skip -->`` is not run (for examples that need a GPU or real cloud credentials).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?P<skip><!-- docs-test: skip -->\s*\n)?```python[^\n]*\n(?P<code>.*?)\n```", re.S)


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(line number, code, skipped)`` for each ```python block of a markdown text."""
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        out.append((line, m.group("code"), m.group("skip") is not None))
    return out


def test_block_parser_finds_and_skips() -> None:
    text = "a\n```python\nx = 1\n```\n<!-- docs-test: skip -->\n```python\nraise SystemExit\n```\n```bash\nls\n```\n"
    blocks = python_blocks(text)
    assert [(code, skip) for _, code, skip in blocks] == [("x = 1", False), ("raise SystemExit", True)]


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_doc_code_blocks_run(doc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [b for b in python_blocks(doc.read_text()) if not b[2]]
    if not blocks:
        pytest.skip(f"{doc.name} has no executable python blocks")
    monkeypatch.chdir(tmp_path)
    for line, code, _ in blocks:
        namespace: dict[str, object] = {"__name__": "__docs__"}
        try:
            exec(compile(code, f"{doc.name}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{doc.relative_to(REPO)} block at line {line} failed: {e!r}") from e
