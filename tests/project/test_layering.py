"""The rooms' import rules (shared/DESIGN.md, docs/api.md), declared as import-linter contracts
in pyproject.toml: they hold, they would catch an upward import or a cycle, and every room is
placed in the layers."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import scaletrain

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PACKAGE = Path(scaletrain.__file__).parent
ROOT = PACKAGE.parent
LINT = Path(sys.executable).parent / "lint-imports"
needs_linter = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed")


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_every_room_is_in_a_layer() -> None:
    layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
    placed = {m.strip() for layer in layers for m in layer.split("|")}
    rooms = {f"scaletrain.{p.stem if p.suffix else p.name}" for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())
             and p.name not in ("__init__.py", "__main__.py")}
    assert rooms == placed, rooms ^ placed


def test_every_planner_sub_room_is_in_a_layer() -> None:
    contract = next(c for c in _contracts() if c.get("containers") == ["scaletrain.plan"])
    placed = {m.strip() for layer in contract["layers"] for m in layer.split("|")}
    plan = PACKAGE / "plan"
    rooms = {p.stem if p.suffix else p.name for p in plan.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    assert rooms == placed, rooms ^ placed


@needs_linter
def test_contracts_hold() -> None:
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout[-3000:]
    assert f"{len(_contracts())} kept, 0 broken" in res.stdout


@needs_linter
@pytest.mark.parametrize(("module", "line", "contract"), [
    ("models/files.py", "from scaletrain.train import step", "Rooms are layered"),
    ("inference/chat.py", "from scaletrain.data import tokenizer", "The inference layer"),
    ("curate/pii.py", "from scaletrain.io_never import x", None),  # unknown: not a breach
    ("profiling/load.py", "from scaletrain.profiling import analyze", "No import cycles"),
    ("plan/memory/host.py", "from scaletrain.plan.timing import comm", "The planner's sub-rooms"),
])
def test_contracts_catch_a_breach(tmp_path: Path, module: str, line: str,
                                  contract: str | None) -> None:
    shutil.copytree(PACKAGE, tmp_path / "scaletrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with (tmp_path / "scaletrain" / module).open("a") as f:
        f.write(f"\n{line}  # noqa\n")
    res = _lint(tmp_path)
    if contract is None:
        assert res.returncode == 0, res.stdout[-3000:]
        return
    assert res.returncode != 0
    assert "Broken contracts" in res.stdout, res.stdout[-3000:]
    assert contract in res.stdout.split("Broken contracts")[1], res.stdout[-3000:]


def test_data_never_imports_torch_nn() -> None:
    bad = {f"{p.name}: {m}" for p in (PACKAGE / "data").rglob("*.py") for m in _imports(p)
           if m == "torch.nn" or m.startswith("torch.nn.")}
    assert not bad, bad


def test_layout_report_finds_cycles_and_sees_none_here(tmp_path: Path) -> None:
    """bench/layout_report.py (the issue's measurement) counts lazy imports and skips
    TYPE_CHECKING ones; it finds a cycle through a function-level import."""
    spec = importlib.util.spec_from_file_location("layout_report",
                                                  ROOT / "bench" / "layout_report.py")
    assert spec is not None and spec.loader is not None
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    edges = report.module_edges(PACKAGE)
    assert report.cycles(edges) == [] and report.cycles(report.room_edges(edges)) == []
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f() -> None:\n    from pkg import b\n")
    (pkg / "b.py").write_text("from pkg.a import f\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                              "    from pkg import a\n")
    scratch = report.module_edges(pkg)
    assert report.cycles(scratch) == [["pkg.a", "pkg.b"]]
    assert not scratch.get("pkg.c")


def test_layout_report_runs_as_documented() -> None:
    """docs/benchmarks.md's command: tables, no cycles, an import time for every verb."""
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "layout_report.py"),
                          "--repeat", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "room cycles: none" in out and "module cycles: none" in out
    verbs = [p.stem for p in (PACKAGE / "commands").glob("*.py") if not p.stem.startswith("_")]
    for verb in verbs:
        assert f"scaletrain.commands.{verb} " in out, verb
