"""`scaletrain data <sub-verb> ...`: the corpus pipeline, one module per sub-verb.

Sub-verb modules live next to this one as `data_<name>.py` with `main(argv) -> int`, imported
only when used. `inspect` serves both kinds of data: an indexed dataset prefix (PREFIX.idx and
PREFIX.bin exist) goes to `data_inspect_indexed`, anything else (documents) to `data_inspect`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

SUBVERBS: dict[str, str] = {
    "curate": "run a curation pipeline from TOML (no arguments: the default corpus)",
    "extract": "WARC/HTML to documents",
    "filter": "heuristic filters (gopher, c4, fineweb, language, ...)",
    "dedup": "exact, MinHash or semantic deduplication",
    "quality": "model-based quality scores and filtering",
    "pii": "remove personal data and secrets",
    "tokenize": "documents to Megatron-compatible indexed datasets (.bin/.idx)",
    "inspect": "samples and statistics of documents or an indexed dataset",
    "synth": "synthetic data: generate with an LLM, critique, filter (resumable)",
}


def _usage() -> str:
    lines = ["usage: scaletrain data <sub-verb> [options]", "", "sub-verbs:"]
    lines += [f"  {name:<10} {help_}" for name, help_ in SUBVERBS.items()]
    return "\n".join(lines)


def _module(sub: str, rest: list[str]) -> str:
    if sub == "inspect" and rest and not rest[0].startswith("-"):
        prefix = Path(rest[0])
        stem = prefix.with_suffix("") if prefix.suffix in (".bin", ".idx") else prefix
        if Path(f"{stem}.idx").exists():
            return "scaletrain.commands.data_inspect_indexed"
    return f"scaletrain.commands.data_{sub}"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    sub, rest = argv[0], argv[1:]
    if sub not in SUBVERBS:
        import difflib

        near = difflib.get_close_matches(sub, SUBVERBS, n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        print(f"scaletrain data: unknown sub-verb '{sub}'.{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    name = _module(sub, rest)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        print(f"scaletrain data {sub}: not available in this version", file=sys.stderr)
        return 2
    try:
        return int(module.main(rest))
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; 130 as shells report it
        again = {"curate": "its finished tasks are kept", "synth": "it resumes",
                 "tokenize": "its finished parts are reused"}.get(
            sub, "it starts over; nothing half-written is left as output")
        print(f"\nscaletrain data {sub}: interrupted; run the same command again ({again})",
              file=sys.stderr)
        return 130
