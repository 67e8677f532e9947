"""The package's shape: lines per room, the room-level import graph (cycles named) and the
cold import time of `scaletrain` and of each verb's module (`python -X importtime`).

    python bench/layout_report.py [--package-dir scaletrain] [--repeat 3]

Every import counts, also those inside functions (they run when the function does); those
under `TYPE_CHECKING` are left out (they never run). Prints tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path


def _modules(package_dir: Path) -> dict[str, Path]:
    out = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def module_edges(package_dir: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (grimp's graph, the one import-linter checks:
    imports at any depth, TYPE_CHECKING ones left out)."""
    import grimp  # with import-linter: `pip install -e ".[dev]"`

    sys.path.insert(0, str(package_dir.parent))  # this folder's package, not an installed one
    try:
        graph = grimp.build_graph(package_dir.name, exclude_type_checking_imports=True,
                                  cache_dir=None)
    finally:
        sys.path.remove(str(package_dir.parent))
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def room_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if room(a) != room(b) and room(b) != room(a).split(".")[0]:
                out[room(a)].add(room(b))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def import_time_ms(module: str, cwd: Path, repeat: int) -> float:
    """Median cumulative import time of `module` in a fresh interpreter (bytecode cached)."""
    times = []
    for _ in range(repeat):
        res = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                             cwd=cwd, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(cwd)})
        for line in res.stderr.splitlines():
            cols = [c.strip() for c in line.split("|")]
            if len(cols) == 3 and cols[2] == module:
                times.append(int(cols[1]) / 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package-dir", default="scaletrain", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    package_dir = args.package_dir.resolve()

    lines: dict[str, int] = defaultdict(int)
    for mod, path in _modules(package_dir).items():
        lines[room(mod)] += len(path.read_text().splitlines())
    total = sum(lines.values())
    print(f"{'room':<28}{'lines':>8}{'share':>8}")
    for name, n in sorted(lines.items(), key=lambda kv: -kv[1]):
        print(f"{name:<28}{n:>8}{n / total:>8.1%}")
    print(f"{'total':<28}{total:>8}")

    edges = module_edges(package_dir)
    graph = room_edges(edges)
    print("\nroom imports:")
    for name in sorted(graph):
        print(f"  {name} -> {', '.join(sorted(graph[name]))}")
    print(f"room cycles: {cycles(graph) or 'none'}")
    print(f"module cycles: {cycles(edges) or 'none'}")

    cwd = package_dir.parent
    verbs = sorted(p.stem for p in (package_dir / "commands").glob("*.py")
                   if not p.stem.startswith("_"))
    print(f"\ncold import time (median of {args.repeat}, ms):")
    for mod in ["scaletrain", "scaletrain.cli", *[f"scaletrain.commands.{v}" for v in verbs]]:
        print(f"  {mod:<40}{import_time_ms(mod, cwd, args.repeat):>9.1f}")


if __name__ == "__main__":
    main()
