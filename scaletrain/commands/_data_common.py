"""Shared options and the run-and-report path of the `scaletrain data` stage verbs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from scaletrain.curate.io.paths import InputError
from scaletrain.curate.pipeline import Step

log = logging.getLogger(__name__)


def stage_parser(
    prog: str, description: str, input_required: bool = True
) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"scaletrain data {prog}", description=description)
    p.add_argument(
        "--input",
        "-i",
        nargs="+",
        required=input_required,
        metavar="PATH",
        help="files, folders or globs of JSONL(.gz/.zst)/Parquet/text/WARC documents",
    )
    p.add_argument(
        "--output",
        "-o",
        required=input_required,
        metavar="DIR",
        help="where the kept documents (JSONL shards) and stats.json go",
    )
    add_run_options(p)
    return p


def add_run_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("execution")
    g.add_argument(
        "--executor",
        choices=("local", "ray"),
        default=None,
        help="local worker processes (default) or a Ray cluster",
    )
    g.add_argument("--workers", type=int, default=None, help="worker processes (default: CPUs)")
    g.add_argument("--ray-address", default=None, help="Ray cluster address (default: local)")
    g.add_argument(
        "--tasks", type=int, default=None, help="number of tasks (default: one per ~32 MB of input)"
    )
    g.add_argument(
        "--format",
        dest="output_format",
        default=None,
        choices=("jsonl", "jsonl.gz", "jsonl.zst", "parquet"),
        help="output format",
    )
    g.add_argument(
        "--write-dropped",
        action="store_true",
        default=None,
        help="also write dropped documents with their reason to DIR/_dropped/",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="stop (exit 2) at the first malformed record instead of counting and skipping it",
    )
    g.add_argument("--json", action="store_true",
                   help="print the run's statistics (stats.json) as JSON instead of the table")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="delete DIR first (otherwise a re-run resumes the run in DIR)",
    )


def run_and_report(
    steps: list[Step],
    inputs: Any,
    output: str,
    args: argparse.Namespace,
    root: str | None = None,
    config: dict[str, Any] | None = None,
) -> int:
    """Run the steps, print the per-step table, write stats.json and report.html."""
    from scaletrain.curate.executors import make_executor
    from scaletrain.curate.report import html_report, terminal_table
    from scaletrain.curate.runner import RunOptions, run_pipeline

    cfg = config or {}
    ex_cfg = cfg.get("executor", {})
    kind = args.executor or ex_cfg.get("kind", "local")
    workers = args.workers or ex_cfg.get("workers")
    executor = make_executor(kind, workers, args.ray_address or ex_cfg.get("address"))
    opts = RunOptions(
        tasks=args.tasks or ex_cfg.get("tasks"),
        output_format=args.output_format or cfg.get("output_format", "jsonl"),
        write_dropped=bool(args.write_dropped or cfg.get("write_dropped", False)),
        strict=bool(args.strict),
    )
    summary = run_pipeline(
        steps, inputs, output, executor, opts, overwrite=args.overwrite, root=root
    )
    with open(os.path.join(output, "report.html"), "w", encoding="utf-8") as f:
        f.write(html_report(summary))
    if args.json:
        print(json.dumps(summary, indent=1, ensure_ascii=False))
    else:
        print(terminal_table(summary))
        print(
            f"\nkept documents: {output}/part-*.{opts.output_format}; statistics: "
            f"{output}/stats.json; report: {output}/report.html"
        )
    if summary["docs_in"] == 0:  # nothing usable was read: not a successful run
        raise InputError(nothing_read(summary))
    return 0


def nothing_read(summary: dict[str, Any]) -> str:
    """One line for a run that read no document: what it met instead."""
    from scaletrain.curate.report import accounting

    first = summary.get("malformed_examples") or []
    return ("no document could be read from the input (" + accounting(summary) + ")" +
            (f"; first malformed: {first[0]}" if first else ""))


def guarded(fn: Any, argv: list[str]) -> int:
    """Run a verb body; bad inputs and settings print one clear line and exit 2."""
    try:
        return int(fn(argv))
    except (InputError, ValueError, FileNotFoundError, RuntimeError) as e:
        verb = fn.__module__.rsplit(".", 1)[-1].replace("data_", "data ", 1)
        print(f"scaletrain {verb}: {e}", file=sys.stderr)  # as every other verb says it
        return 2


def parse_params(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """`STEP.PARAM=VALUE` (VALUE parsed as JSON when it can be) -> {STEP: {PARAM: VALUE}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(
                f"--set '{item}': write STEP.PARAM=VALUE, e.g. gopher_quality.min_words=30"
            )
        key, value = item.split("=", 1)
        step, param = key.split(".", 1)
        try:
            parsed: Any = json.loads(value)
        except ValueError:
            parsed = value
        out.setdefault(step, {})[param] = parsed
    return out
