"""The project speaks only of itself: no references to planning documents in code, docs or benchmarks."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_PATTERN = re.compile(r"brief|issue [0-9]", re.IGNORECASE)
_SCANNED = ["lightning_accel", "docs", "benchmarks", "examples", "README.md", "CHANGELOG.md"]
_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt"}


def _files() -> list[Path]:
    out: list[Path] = []
    for entry in _SCANNED:
        p = REPO / entry
        out += [p] if p.is_file() else [f for f in sorted(p.rglob("*")) if f.suffix in _SUFFIXES and f.is_file()]
    return out


def test_no_references_to_planning_documents() -> None:
    hits = [
        f"{f.relative_to(REPO)}:{n}: {line.strip()}"
        for f in _files()
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
        if _PATTERN.search(line)
    ]
    assert not hits, "the project must speak only of itself:\n" + "\n".join(hits)


def test_no_config_dump_at_the_repository_root() -> None:
    assert not (REPO / "config.yaml").exists(), "config.yaml at the repository root is a LightningCLI dump"
