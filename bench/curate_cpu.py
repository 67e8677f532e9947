"""Curation throughput per stage on one CPU core: scaletrain against datatrove's equivalent
blocks on the same documents, and MinHash candidate precision/recall against true Jaccard.

    python bench/curate_cpu.py                 # 200 MB of input (the issue's "few hundred MB")
    python bench/curate_cpu.py --mb 20         # a quick run

Input: the standard library's .py files plus the real fixtures (CCNet documents, text
extracted from the Common Crawl WARC files), replicated until `--mb` MB; every replica after
the first has 1-4% of its words edited, so the corpus holds real exact and near duplicates.
Stages (one process each, so figures are per core):
  gopher_quality, gopher_repetition   in memory, one call per document on both sides
  minhash_signatures                  in memory: shingles + 112 MinHash values per document
  exact_dedup, minhash_dedup          end to end through each library's own executor with one
                                      task: read JSONL, decide, write the kept documents
MinHash quality: signatures of both libraries are banded the same way (14 x 8); a candidate
pair is one sharing a band. Precision = candidates with true Jaccard (word 5-grams) >=
threshold / candidates; recall = such pairs found / all such pairs (all pairs of a sample,
computed exactly with a sparse product). Our verified mode is reported too.
Requires the bench extra (`pip install -c constraints.txt -e '.[bench]'`): datatrove + spacy.
Results: a table, and JSON in bench/results/curate_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "curate_cpu.json"
FIXTURES = [
    Path(os.environ.get("SCALETRAIN_FIXTURES", ROOT.parent / "shared" / "fixtures")),
    Path("/work/shared/fixtures"),
]


def _fixture_dir() -> Path | None:
    return next((p / "data" for p in FIXTURES if (p / "data" / "README.md").exists()), None)


def build_corpus(mb: float, out: Path, seed: int = 0) -> tuple[Path, list[dict[str, str]]]:
    """The base documents replicated with small edits to `mb` MB, as JSONL."""
    from scaletrain.config import DataConfig
    from scaletrain.curate.io import read_documents
    from scaletrain.data.corpus import discover_files

    _, files = discover_files(DataConfig())
    base: list[dict[str, str]] = []
    fx = _fixture_dir()
    if fx is not None:  # the real web text first, so every size has some
        for pat in ("ccnet_en_head-*.jsonl.gz", "cc_sample-*.warc.gz"):
            base += [{"id": d.id, "text": d.text} for d in read_documents(str(fx / pat))]
    base += [{"id": f.rel, "text": f.path.read_text(errors="replace")} for f in files]
    base = [d for d in base if d["text"].strip()]
    rng = random.Random(seed)
    docs, size, rep = [], 0, 0
    target = int(mb * 1e6)
    while size < target:
        for d in base:
            text = d["text"] if rep == 0 else _edit(d["text"], rng.uniform(0.01, 0.04), rng)
            docs.append({"id": f"{d['id']}#{rep}", "text": text})
            size += len(text.encode())
            if size >= target:
                break
        rep += 1
    out.mkdir(parents=True, exist_ok=True)
    path = out / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    return path, docs


def _edit(text: str, rate: float, rng: random.Random) -> str:
    words = text.split(" ")
    for _ in range(max(1, int(rate * len(words)))):
        i = rng.randrange(len(words))
        new = rng.choice(("data", "value", "result", "item", "x"))
        words[i] = new if rng.random() < 0.7 else ""
    return " ".join(words)


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_filters(docs: list[dict[str, str]]) -> dict[str, dict[str, float]]:
    from datatrove.data import Document as DTDoc
    from datatrove.pipeline.filters import GopherQualityFilter as DTQ
    from datatrove.pipeline.filters import GopherRepetitionFilter as DTR

    from scaletrain.curate.documents import Document
    from scaletrain.curate.filters import GopherQualityFilter, GopherRepetitionFilter

    ours = [Document(d["id"], d["text"]) for d in docs]
    theirs = [DTDoc(text=d["text"], id=d["id"]) for d in docs]
    out = {}
    for name, mine, dt in (
        ("gopher_quality", GopherQualityFilter(), DTQ()),
        ("gopher_repetition", GopherRepetitionFilter(), DTR()),
    ):
        dt.filter(theirs[0])  # load the tokenizer outside the timing
        t_ours = _timed(lambda m=mine: [m.reason(d) for d in ours])
        t_dt = _timed(lambda f=dt: [f.filter(d) for d in theirs])
        kept_ours = sum(mine.reason(d) is None for d in ours)
        kept_dt = sum(dt.filter(d) is True for d in theirs)
        out[name] = {
            "ours_s": t_ours,
            "datatrove_s": t_dt,
            "ours_kept": kept_ours,
            "datatrove_kept": kept_dt,
        }
    return out


def bench_signatures(docs: list[dict[str, str]]) -> tuple[dict[str, float], Any, Any]:
    import numpy as np
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature

    from scaletrain.curate.dedup import MinHashDedup

    texts = [d["text"] for d in docs]
    mine = MinHashDedup("fineweb")
    sig_ours: list[Any] = []
    t_ours = _timed(
        lambda: sig_ours.append(
            np.concatenate([mine.signatures(texts[i : i + 256]) for i in range(0, len(texts), 256)])
        )
    )
    dt = MinhashDedupSignature(tempfile.mkdtemp(), config=MinhashConfig())
    empty = np.full(112, np.iinfo(np.int64).max, np.int64)

    def dt_sig(t: str) -> Any:  # datatrove skips texts shorter than one shingle
        sh = dt.get_shingles(t)
        return np.asarray(dt.get_signature(sh), np.int64).reshape(-1) if len(sh) else empty

    sig_dt: list[Any] = []
    t_dt = _timed(lambda: sig_dt.extend(dt_sig(t) for t in texts))
    # datatrove's values are 64-bit: keep them exact (a float detour would merge them)
    return {"ours_s": t_ours, "datatrove_s": t_dt}, sig_ours[0], np.stack(sig_dt).view(np.uint64)


def _count_jsonl(folder: Path) -> int:
    import gzip

    n = 0
    for f in folder.rglob("*.jsonl*"):
        with gzip.open(f, "rt") if f.suffix == ".gz" else open(f) as fh:
            n += sum(1 for _ in fh)
    return n


def _normalized(doc: Any) -> str:
    """The same normalization as ours (lower case, whitespace runs collapsed)."""
    return " ".join(doc.text.lower().split())


def bench_end_to_end(path: Path, work: Path) -> dict[str, dict[str, float]]:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        ExactDedupConfig,
        ExactDedupFilter,
        ExactDedupSignature,
        ExactFindDedups,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter as DTWriter

    from scaletrain.curate.dedup import ExactDedup, MinHashDedup
    from scaletrain.curate.executors import LocalExecutor
    from scaletrain.curate.runner import RunOptions, run_pipeline

    def dt_run(pipeline: list[Any], name: str, tasks: int = 1) -> float:
        return _timed(
            lambda: LocalPipelineExecutor(
                pipeline=pipeline,
                tasks=tasks,
                workers=1,
                logging_dir=str(work / "dtlogs" / name),
                skip_completed=False,
            ).run()
        )

    def reader() -> Any:
        return JsonlReader(str(path.parent), glob_pattern=path.name)

    out: dict[str, dict[str, float]] = {}
    opts = RunOptions(tasks=1)
    s = run_pipeline([ExactDedup()], str(path), str(work / "ours_exact"), LocalExecutor(1), opts)
    t_ours = s["seconds"]
    d = work / "dt_exact"
    ec = ExactDedupConfig(content_getter=_normalized)
    t_dt = dt_run([reader(), ExactDedupSignature(str(d / "sigs"), config=ec)], "e1")
    t_dt += dt_run([ExactFindDedups(str(d / "sigs"), str(d / "dups"), config=ec)], "e2")
    t_dt += dt_run(
        [reader(), ExactDedupFilter(str(d / "dups"), config=ec), DTWriter(str(d / "out"))], "e3"
    )
    out["exact_dedup"] = {
        "ours_s": t_ours,
        "datatrove_s": t_dt,
        "ours_kept": s["docs_out"],
        "datatrove_kept": _count_jsonl(d / "out"),
    }

    s = run_pipeline(
        [MinHashDedup("fineweb")], str(path), str(work / "ours_mh"), LocalExecutor(1), opts
    )
    out_mh = {"ours_s": s["seconds"], "ours_kept": s["docs_out"]}
    cfg = MinhashConfig()
    d = work / "dt_mh"
    t_sig = dt_run([reader(), MinhashDedupSignature(str(d / "sigs"), config=cfg)], "m1")
    t_b = dt_run(
        [MinhashDedupBuckets(str(d / "sigs"), str(d / "buckets"), config=cfg)],
        "m2",
        tasks=cfg.num_buckets,
    )  # one task per band, run one after another
    t_c = dt_run([MinhashDedupCluster(str(d / "buckets"), str(d / "remove"), config=cfg)], "m3")
    t_f = dt_run([reader(), MinhashDedupFilter(str(d / "remove")), DTWriter(str(d / "out"))], "m4")
    out_mh.update(
        {
            "datatrove_s": t_sig + t_b + t_c + t_f,
            "datatrove_kept": _count_jsonl(d / "out"),
            "datatrove_signatures_s": t_sig,
            "datatrove_buckets_s": t_b,
            "datatrove_cluster_s": t_c,
            "datatrove_filter_s": t_f,
        }
    )
    out["minhash_dedup"] = out_mh
    return out


def minhash_quality(
    docs: list[dict[str, str]],
    sig_ours: Any,
    sig_dt: Any,
    sample: int,
    threshold: float,
    seed: int = 0,
) -> dict[str, Any]:
    """Candidate precision/recall of both signatures against exact word-5-gram Jaccard."""
    import numpy as np
    from scipy import sparse

    from scaletrain.curate.dedup import MinHashDedup
    from scaletrain.curate.dedup.shingles import word_ngram_shingles

    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(len(docs), size=min(sample, len(docs)), replace=False))
    sh = [word_ngram_shingles(docs[i]["text"], 5) for i in idx]
    vocab, inv = np.unique(np.concatenate(sh), return_inverse=True)
    rows = np.repeat(np.arange(len(sh)), [len(s) for s in sh])
    x = sparse.csr_matrix(
        (np.ones(len(rows), np.float32), (rows, inv)), shape=(len(sh), len(vocab))
    )
    inter = (x @ x.T).tocoo()
    sizes = np.array([len(s) for s in sh])
    keep = inter.row < inter.col
    r, c, v = inter.row[keep], inter.col[keep], inter.data[keep]
    jac = v / (sizes[r] + sizes[c] - v)
    truth = {(int(a), int(b)) for a, b, j in zip(r, c, jac) if j >= threshold}
    jmap = {(int(a), int(b)): float(j) for a, b, j in zip(r, c, jac)}
    step = MinHashDedup("fineweb")
    out: dict[str, Any] = {
        "sample_docs": int(len(idx)),
        "true_pairs": len(truth),
        "threshold": threshold,
    }
    for name, sig in (("ours", sig_ours), ("datatrove", sig_dt)):
        s = np.ascontiguousarray(sig[idx])
        edges = step.candidate_edges(s)
        # candidate_edges links members to their bucket's first document; expand buckets to
        # all pairs so both sides are judged on every pair that shares a band
        cand = _all_bucket_pairs(step, s)
        tp = len(cand & truth)
        out[name] = {
            "candidates": len(cand),
            "star_edges": int(len(edges)),
            "precision": tp / len(cand) if cand else 1.0,
            "recall": tp / len(truth) if truth else 1.0,
        }
    cand = _all_bucket_pairs(step, np.ascontiguousarray(sig_ours[idx]))
    verified = {p for p in cand if jmap.get(p, 0.0) >= threshold}
    out["ours_verified"] = {
        "candidates": len(verified),
        "precision": 1.0 if verified else 1.0,
        "recall": len(verified & truth) / len(truth) if truth else 1.0,
    }
    return out


def _all_bucket_pairs(step: Any, sig: Any) -> set[tuple[int, int]]:
    import numpy as np

    from scaletrain.curate.dedup.shingles import splitmix64

    pairs: set[tuple[int, int]] = set()
    for k in range(step.bands):
        band = sig[:, k * step.rows : (k + 1) * step.rows].astype(np.uint64)
        key = np.zeros(len(sig), np.uint64)
        for r in range(step.rows):
            key = splitmix64(key ^ band[:, r])
        groups: dict[int, list[int]] = {}
        for i, kk in enumerate(key.tolist()):
            groups.setdefault(kk, []).append(i)
        for g in groups.values():
            if 1 < len(g) <= 200:
                pairs.update((a, b) for ai, a in enumerate(g) for b in g[ai + 1 :])
    return pairs


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mb", type=float, default=200.0, help="input size in MB")
    ap.add_argument("--sample", type=int, default=3000, help="documents for MinHash P/R")
    ap.add_argument("--threshold", type=float, default=0.75)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    try:
        import datatrove  # noqa: F401
    except ImportError:
        print("datatrove is not installed: pip install -c constraints.txt -e '.[bench]'")
        return 2
    work = Path(tempfile.mkdtemp(prefix="curate_bench_"))
    try:
        path, docs = build_corpus(args.mb, work / "in")
        mb = path.stat().st_size / 1e6
        n = len(docs)
        chars_mb = sum(len(d["text"].encode()) for d in docs) / 1e6
        stages = bench_filters(docs)
        sig_t, sig_ours, sig_dt = bench_signatures(docs)
        stages["minhash_signatures"] = sig_t
        stages.update(bench_end_to_end(path, work))
        quality = minhash_quality(docs, sig_ours, sig_dt, args.sample, args.threshold)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"input: {n:,} documents, {chars_mb:.1f} MB of text ({mb:.1f} MB JSONL); one process")
    print(
        f"{'stage':<20}{'ours docs/s':>13}{'ours MB/s':>11}{'dt docs/s':>12}{'dt MB/s':>10}"
        f"{'speed-up':>10}{'kept ours/dt':>16}"
    )
    for name, st in stages.items():
        o, t = st["ours_s"], st["datatrove_s"]
        kept = f"{st.get('ours_kept', '-')}/{st.get('datatrove_kept', '-')}"
        print(
            f"{name:<20}{n / o:>13,.0f}{chars_mb / o:>11.2f}{n / t:>12,.0f}{chars_mb / t:>10.2f}"
            f"{t / o:>9.2f}x{kept:>16}"
        )
    print(
        f"\nMinHash 14x8 candidates vs true Jaccard >= {args.threshold} "
        f"({quality['sample_docs']} docs, {quality['true_pairs']} true pairs):"
    )
    for name in ("ours", "datatrove", "ours_verified"):
        q = quality[name]
        print(
            f"  {name:<14} precision {q['precision']:.3f}  recall {q['recall']:.3f}  "
            f"({q['candidates']} candidate pairs)"
        )
    result = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "documents": n,
        "text_mb": chars_mb,
        "jsonl_mb": mb,
        "stages": stages,
        "minhash_quality": quality,
        "note": "one process per side; shared 2-core machine, timings are noisy",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
