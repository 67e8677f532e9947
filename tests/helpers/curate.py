"""Shared helpers of the curation tests: the real-data fixtures and small readers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
_CANDIDATES = [
    os.environ.get("SCALETRAIN_FIXTURES", ""),
    str(_REPO.parent / "shared" / "fixtures"),
    "/work/shared/fixtures",
]


def fixture_dir() -> Path:
    """shared/fixtures/data (beside the repository in CI), or skip with the reason."""
    for c in _CANDIDATES:
        if c and (Path(c) / "data" / "README.md").exists():
            return Path(c) / "data"
    pytest.skip("shared/fixtures/data not found (set SCALETRAIN_FIXTURES to shared/fixtures)")


def read_output(out_dir: Path) -> list[dict]:
    """Every kept document of a run directory, in file order."""
    docs = []
    for f in sorted(out_dir.glob("part-*.jsonl")):
        docs += [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()]
    return docs


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
