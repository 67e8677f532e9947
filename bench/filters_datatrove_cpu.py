"""Our heuristic filters against datatrove's on real pages: per rule, how often the verdicts
agree, and for each disagreement which rule of each side decided.

    python bench/filters_datatrove_cpu.py                    # fixtures + Rust docs pages
    python bench/filters_datatrove_cpu.py --max-pages 300    # quicker

Pages: the fixtures' 20 CCNet documents and the HTML pages of the two Common Crawl WARC files
(main text extracted with trafilatura, as `data extract` does), plus the prose pages of the
Rust documentation installed with rustup (the Book, the Reference, the Nomicon, the Edition
guide, Cargo, rustc, embedded, Rust by Example, the error index; `--docs-root`), extracted the
same way; pages under 50 characters of main text are left out. The extracted pages are cached
in `--cache`. Both sides see the same text, one call per page, for gopher_quality,
gopher_repetition, c4 and fineweb_quality with their default thresholds (and once more
fineweb_quality with datatrove at the paper's 0.1 for characters in duplicated lines).
datatrove is not a dependency: install it (with spaCy) into a folder of its own and give it
with `--datatrove-path` (it is appended to sys.path, so this environment's packages win).
Writes JSON (default bench/results/filters_datatrove_cpu.json) and prints a table.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
FIXTURES = Path(os.environ.get("SCALETRAIN_FIXTURES", ROOT.parent / "shared" / "fixtures"))
if not (FIXTURES / "data").is_dir():
    FIXTURES = Path("/work/shared/fixtures")
RESULTS = ROOT / "bench" / "results" / "filters_datatrove_cpu.json"
RUST_DOCS = "~/.rustup/toolchains/stable-x86_64-unknown-linux-gnu/share/doc/rust/html"
BOOKS = ("book", "reference", "nomicon", "edition-guide", "cargo", "rustc", "embedded-book",
         "rust-by-example", "error_codes")


def collect_pages(docs_root: str, max_pages: int, cache: Path) -> list[dict[str, str]]:
    if cache.exists():
        pages = [json.loads(ln) for ln in cache.read_text().splitlines()]
        return pages[:max_pages]
    from scaletrain.curate.io.readers import read_documents
    from scaletrain.curate.io.warc import extract_html

    pages = []
    for name in ("ccnet_en_head-0091.jsonl.gz", "ccnet_en_head-0174.jsonl.gz",
                 "cc_sample-0000.warc.gz", "cc_sample-0001.warc.gz"):
        for d in read_documents(str(FIXTURES / "data" / name)):
            pages.append({"id": f"{name}:{d.id}", "source": "fixtures", "text": d.text})
    root = Path(os.path.expanduser(docs_root))
    files = []
    for book in BOOKS:
        files += sorted(f for f in glob.glob(str(root / book / "**" / "*.html"), recursive=True)
                        if not f.endswith(("print.html", "404.html", "toc.html")))
    step = max(1, len(files) // max(1, max_pages - len(pages)))
    for f in files[::step]:
        text = extract_html(Path(f).read_text(encoding="utf-8", errors="replace"))
        if text and len(text) >= 50:
            pages.append({"id": os.path.relpath(f, root), "source": "rust-docs", "text": text})
    cache.write_text("".join(json.dumps(p) + "\n" for p in pages))
    return pages[:max_pages]


def verdicts(pages: list[dict[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Per rule group: (ours, datatrove) verdicts, 'keep' or the reason of the drop."""
    from datatrove.data import Document as DTDoc
    from datatrove.pipeline import filters as dtf

    from scaletrain.curate.documents import Document
    from scaletrain.curate.filters import (
        C4Filter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    pairs = {
        "gopher_quality": (GopherQualityFilter(), dtf.GopherQualityFilter()),
        "gopher_repetition": (GopherRepetitionFilter(), dtf.GopherRepetitionFilter()),
        "c4": (C4Filter(), dtf.C4QualityFilter()),
        "fineweb_quality": (FineWebQualityFilter(), dtf.FineWebQualityFilter()),
        # datatrove's default for characters in duplicated lines is 0.01; the paper's is 0.1
        "fineweb_quality@0.1": (FineWebQualityFilter(),
                                dtf.FineWebQualityFilter(char_duplicates_ratio=0.1)),
    }
    out: dict[str, list[tuple[str, str]]] = {}
    for rule, (ours, theirs) in pairs.items():
        got = []
        for p in pages:
            r = ours.process(Document(p["id"], p["text"]))
            mine = "keep" if isinstance(r, Document) else str(r)
            t = theirs.filter(DTDoc(text=p["text"], id=p["id"]))
            dt = "keep" if t is True else (t[1] if isinstance(t, tuple) else "drop")
            got.append((mine, dt))
        out[rule] = got
    return out


def summarize(pages: list[dict[str, str]], got: dict[str, list[tuple[str, str]]]
              ) -> dict[str, Any]:
    table = {}
    for rule, pairs in got.items():
        agree = sum((a == "keep") == (b == "keep") for a, b in pairs)
        only_ours = Counter(f"{a} (datatrove keeps)" for a, b in pairs
                            if a != "keep" and b == "keep")
        only_dt = Counter(f"{b} (we keep)" for a, b in pairs if a == "keep" and b != "keep")
        by_source = {}
        for src in sorted({p["source"] for p in pages}):
            idx = [i for i, p in enumerate(pages) if p["source"] == src]
            by_source[src] = {
                "pages": len(idx),
                "agree": sum((pairs[i][0] == "keep") == (pairs[i][1] == "keep") for i in idx),
                "ours_kept": sum(pairs[i][0] == "keep" for i in idx),
                "datatrove_kept": sum(pairs[i][1] == "keep" for i in idx)}
        table[rule] = {
            "pages": len(pairs), "agree": agree, "agree_pct": round(100 * agree / len(pairs), 1),
            "ours_kept": sum(a == "keep" for a, _ in pairs),
            "datatrove_kept": sum(b == "keep" for _, b in pairs),
            "both_drop": sum(a != "keep" and b != "keep" for a, b in pairs),
            "only_we_drop": dict(only_ours.most_common()),
            "only_datatrove_drops": dict(only_dt.most_common()),
            "by_source": by_source,
        }
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs-root", default=RUST_DOCS)
    ap.add_argument("--max-pages", type=int, default=1500)
    ap.add_argument("--cache", default="/tmp/scaletrain-filter-pages.jsonl")
    ap.add_argument("--datatrove-path", default=os.environ.get("DATATROVE_PATH", ""),
                    help="a folder datatrove (and spaCy) were installed into with --target")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.datatrove_path:
        sys.path.append(args.datatrove_path)
    logging.disable(logging.WARNING)
    import datatrove

    t0 = time.perf_counter()
    pages = collect_pages(args.docs_root, args.max_pages, Path(args.cache))
    t1 = time.perf_counter()
    got = verdicts(pages)
    table = summarize(pages, got)
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    body = {"bench": "filters_datatrove_cpu", "datatrove": datatrove.__version__ if hasattr(
        datatrove, "__version__") else "?", "word_tokenizer": type(load_word_tokenizer(
            "eng")).__name__, "pages": len(pages),
        "sources": dict(Counter(p["source"] for p in pages)),
        "extract_s": round(t1 - t0, 1), "compare_s": round(time.perf_counter() - t1, 1),
        "rules": table}
    print(f"{len(pages)} pages {body['sources']}; datatrove word tokenizer "
          f"{body['word_tokenizer']}")
    print(f"{'rule':<20} {'agree':>12} {'ours kept':>10} {'dt kept':>8}  disagreements")
    for rule, r in table.items():
        dis = "; ".join(f"{k} {v}" for k, v in {**r["only_we_drop"],
                                                   **r["only_datatrove_drops"]}.items())
        print(f"{rule:<20} {r['agree']:>5} ({r['agree_pct']:>4}%) {r['ours_kept']:>10} "
              f"{r['datatrove_kept']:>8}  {dis}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(body, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
