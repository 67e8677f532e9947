"""The rooms' import rules (DESIGN.md): plan/ never imports train/ or profiling/."""

from __future__ import annotations

import ast
from pathlib import Path

import scaletrain

PACKAGE = Path(scaletrain.__file__).parent


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_plan_imports_nothing_from_train_or_profiling() -> None:
    bad = {f"{p.name}: {m}" for p in (PACKAGE / "plan").glob("*.py") for m in _imports(p)
           if m.startswith(("scaletrain.train", "scaletrain.profiling"))}
    assert not bad, bad
