"""The doc-command table: every command of README.md and docs/*.md, ran / adapted / marked /
failed, as tests/project/test_docs_commands.py runs them (one fresh folder per doc, in order).

    python bench/docs_commands.py [--root CHECKOUT] [--docs README.md docs/data.md ...]
                                  [--output bench/results/docs_commands.txt]

`--root` runs another checkout's docs and code with this runner (how the "before" table was
made: `git archive <commit> | tar -x -C /tmp/base`, then `--root /tmp/base`). Prints the table;
asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.doc_commands import DocSyntaxError, parse_doc  # noqa: E402
from tests.helpers.doc_inputs import describe_inputs  # noqa: E402
from tests.helpers.doc_runner import Outcome, format_table, run_doc  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--docs", nargs="*", help="docs relative to the root (default: all)")
    p.add_argument("--output", type=Path, help="also write the table here")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a command may take before it counts as failed")
    p.add_argument("--not-run", action="append", default=[], metavar="TEXT",
                   help="count commands containing TEXT as failed without running them (for "
                   "an unmarked command too big for this machine, in a 'before' table)")
    args = p.parse_args(argv)
    root = args.root.resolve()
    names = args.docs or ["README.md", *sorted(f"docs/{f.name}" for f in (root / "docs").glob(
        "*.md"))]
    started = time.perf_counter()
    sections, everything = [], []
    with tempfile.TemporaryDirectory(prefix="doc-commands-") as tmp:
        cache = Path(tmp) / "cache"
        for name in names:
            try:
                doc = parse_doc((root / name).read_text(), name)
            except DocSyntaxError as e:
                sections.append(f"## {name}\nmarkers do not parse: {e}")
                continue
            for c in doc.commands:
                if not c.skip_reason and any(t in c.text for t in args.not_run):
                    c.text = f"false  # not run (--not-run): {c.text}"
            t0 = time.perf_counter()
            outcomes: list[Outcome] = run_doc(doc, Path(tmp), cache, repo=root,
                                             timeout_s=args.timeout)
            everything += outcomes
            sections.append(f"## {name} ({time.perf_counter() - t0:.0f} s)\n"
                            + format_table(outcomes))
            print(sections[-1], flush=True)
    total = format_table(everything).splitlines()[-1] if everything else "no commands"
    report = "\n\n".join([
        "# python bench/docs_commands.py --root " + " ".join(
            [str(root), f"--timeout {args.timeout:.0f}"]
            + [f"--not-run '{t}'" for t in args.not_run]),
        *sections,
        f"## inputs made before a doc's commands\n{describe_inputs()}",
        f"## total: {total}; wall {time.perf_counter() - started:.0f} s",
    ])
    print(f"\ntotal: {total}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
