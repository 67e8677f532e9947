"""`scaletrain data inspect PATH`: statistics and samples of documents (JSONL, Parquet, text,
WARC). Indexed datasets (PREFIX.idx/.bin) are handled by `data_inspect_indexed`."""

from __future__ import annotations

import argparse
import json
import os
import random
from collections import Counter
from typing import Any

from scaletrain.commands._data_common import guarded


def inspect_documents(
    path: str, samples: int = 3, seed: int = 0, max_docs: int | None = None
) -> dict[str, Any]:
    """Counts, length percentiles, metadata keys and value histograms, and random samples."""
    from scaletrain.curate.io.readers import ReadReport, read_documents

    report = ReadReport()
    chars: list[int] = []
    words: list[int] = []
    keys: Counter[str] = Counter()
    categorical: dict[str, Counter[str]] = {
        "language": Counter(),
        "drop_reason": Counter(),
        "dropped_by": Counter(),
    }
    rng = random.Random(seed)
    reservoir: list[dict[str, Any]] = []
    n = 0
    for doc in read_documents(path, report):
        n += 1
        chars.append(len(doc.text))
        words.append(len(doc.text.split()))
        keys.update(doc.metadata.keys())
        for k, c in categorical.items():
            if k in doc.metadata:
                c[str(doc.metadata[k])] += 1
        item = {"id": doc.id, "text": doc.text[:500], "metadata": doc.metadata}
        if len(reservoir) < samples:
            reservoir.append(item)
        else:
            j = rng.randrange(n)
            if j < samples:
                reservoir[j] = item
        if max_docs and n >= max_docs:
            break

    def pct(xs: list[int], q: float) -> int:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0

    out: dict[str, Any] = {
        "path": path,
        "documents": n,
        "characters": sum(chars),
        "words": sum(words),
        "chars_per_doc": {f"p{int(q * 100)}": pct(chars, q) for q in (0.0, 0.5, 0.9, 0.99)}
        | {"max": max(chars, default=0)},
        "metadata_keys": dict(keys.most_common()),
        "malformed_records": report.malformed,
        "malformed_examples": report.examples[:5],
        "samples": reservoir,
    }
    out.update({k: dict(c.most_common(10)) for k, c in categorical.items() if c})
    stats = os.path.join(path, "stats.json") if os.path.isdir(path) else None
    if stats and os.path.exists(stats):
        with open(stats, encoding="utf-8") as f:
            out["pipeline_stats"] = json.load(f)
    return out


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="scaletrain data inspect", description=__doc__)
    p.add_argument("path", help="a file, folder or glob of documents (a curation output DIR)")
    p.add_argument("--samples", type=int, default=3, help="random documents to show")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    args = p.parse_args(argv)
    info = inspect_documents(args.path, args.samples, args.seed, args.max_docs)
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
        return 0
    print(
        f"{info['path']}: {info['documents']:,} documents, {info['characters']:,} characters, "
        f"{info['words']:,} words"
    )
    print(
        "characters per document: "
        + ", ".join(f"{k} {v:,}" for k, v in info["chars_per_doc"].items())
    )
    if info["metadata_keys"]:
        print("metadata keys: " + ", ".join(f"{k} ({v})" for k, v in info["metadata_keys"].items()))
    for k in ("language", "dropped_by", "drop_reason"):
        if k in info:
            print(f"{k}: " + ", ".join(f"{a} {b}" for a, b in info[k].items()))
    if info["malformed_records"]:
        print(f"malformed records: {info['malformed_records']}")
        for e in info["malformed_examples"]:
            print(f"  {e}")
    if "pipeline_stats" in info:
        from scaletrain.curate.report import terminal_table

        print("\npipeline that wrote it:\n" + terminal_table(info["pipeline_stats"]))
    for s in info["samples"]:
        text = s["text"].replace("\n", "\\n")
        print(
            f"\n--- {s['id']}  {json.dumps(s['metadata'], ensure_ascii=False)[:200]}\n{text[:300]}"
        )
    return 0


def main(argv: list[str]) -> int:
    return guarded(_main, argv)
