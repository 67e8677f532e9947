"""`scaletrain data curate [--config PIPELINE.toml]`: a whole curation pipeline.

With no arguments: the default code pipeline (size limits, source-file rules, exact and
MinHash dedup, PII) on the default corpus, the Python standard library's source files.
With --input and no --config: the pipeline is chosen per file -- the code rules for
source files and text that is not prose, the web rules (language, Gopher, C4, FineWeb) for
WARC, WET, HTML, JSON-lines or Parquet documents and prose text files (.txt/.md/... whose
content reads as prose) -- then exact and MinHash dedup and PII over all of them. A step of a
TOML pipeline can be limited to one kind with `only = "code"` or `only = "web"`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from scaletrain.commands._data_common import add_run_options, guarded, run_and_report

EXAMPLE = """\
# PIPELINE.toml
input = ["crawl/*.warc.gz"]          # files, folders or globs
output = "curated/"
output_format = "jsonl"              # jsonl, jsonl.gz, jsonl.zst, parquet
write_dropped = false

[executor]
kind = "local"                       # or "ray" (address = "auto")
workers = 8

[[steps]]
type = "language"
languages = ["en"]

[[steps]]
type = "gopher_quality"
min_words = 50

[[steps]]
type = "minhash_dedup"
preset = "fineweb"
verify = true
"""


def _load_toml(path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"pipeline config '{path}' not found; example:\n{EXAMPLE}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from e


def _default_pipeline(inputs: list[str] | None) -> list[dict[str, Any]]:
    """Without --config: the rules for each input file's kind -- the code pipeline for
    source/text files (and the default corpus), the web pipeline for WARC, HTML, JSON-lines
    and Parquet documents, each on its own files when the input holds both (a repository with
    a package.json and some HTML). A .json file holding one JSON document is a source file."""
    from collections import Counter

    from scaletrain.curate.io.readers import plan_shards
    from scaletrain.curate.registry import DEFAULT_CODE_PIPELINE, default_pipeline_for

    if inputs is None:
        return DEFAULT_CODE_PIPELINE
    formats = Counter(s.format for s in plan_shards(inputs, target_bytes=1 << 62))
    specs, said = default_pipeline_for(formats)
    print(f"default pipeline: {said} (--config PIPELINE.toml for another)", file=sys.stderr)
    return specs


def _main(argv: list[str]) -> int:
    from scaletrain.curate.registry import build_step

    p = argparse.ArgumentParser(
        prog="scaletrain data curate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLE,
    )
    p.add_argument("--config", "-c", help="pipeline TOML (default: the code pipeline for "
                   "source files, the web pipeline for WARC/WET/HTML/JSONL/Parquet and prose)")
    p.add_argument("--input", "-i", nargs="+", help="override the config's input")
    p.add_argument("--output", "-o", help="override the config's output")
    add_run_options(p)
    args = p.parse_args(argv)
    root = None
    if args.config:
        cfg = _load_toml(args.config)
        unknown = set(cfg) - {
            "input",
            "output",
            "steps",
            "executor",
            "output_format",
            "write_dropped",
        }
        if unknown:
            raise ValueError(f"{args.config}: unknown key(s) {sorted(unknown)}; see --help")
        specs = cfg.get("steps") or []
        if not specs:
            raise ValueError(f"{args.config}: no [[steps]]; see --help for an example")
    else:
        cfg, specs = {}, None  # chosen below from the inputs
    inputs = args.input or cfg.get("input")
    output = args.output or cfg.get("output")
    if specs is None:
        specs = _default_pipeline(inputs)
    if inputs is None:
        if args.config:
            raise ValueError(f'{args.config}: no input; set input = "..." or pass --input')
        from scaletrain.config import DataConfig
        from scaletrain.data.corpus import discover_files

        root_path, files = discover_files(DataConfig())
        inputs, root = [str(f.path) for f in files], str(root_path)
        print(
            f"default corpus: {len(files)} Python files of the standard library in {root}",
            file=sys.stderr,
        )
    output = output or "runs/data-curate"
    steps = [build_step(s) for s in specs]
    print("pipeline: " + " -> ".join(s.described() for s in steps), file=sys.stderr)
    return run_and_report(steps, inputs, output, args, root=root, config=cfg)


def main(argv: list[str]) -> int:
    return guarded(_main, argv)
