"""`scaletrain data inspect PREFIX [--json] [--tokenizer FILE] [--sample N]`: an indexed
dataset's documents, sequences, tokens and dtype, and one decoded document."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain data inspect", description=__doc__)
    p.add_argument("prefix", help="PREFIX of PREFIX.bin/.idx (or either file)")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.add_argument("--tokenizer", help="tokenizer.json to decode with "
                   "(default: PREFIX.tokenizer.json when present)")
    p.add_argument("--sample", type=int, default=0, help="which document to show")
    p.add_argument("--chars", type=int, default=400, help="characters of it to show")
    return p


def describe(prefix: str | Path, tokenizer: str | None = None, sample: int = 0,
             chars: int = 400) -> dict[str, Any]:
    import numpy as np

    from scaletrain.data.indexed import IndexedDataset
    from scaletrain.data.tokenize import sidecar_tokenizer

    ds = IndexedDataset(prefix)
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    docs = np.asarray(ds.document_indices, dtype=np.int64)
    doc_tokens = np.add.reduceat(lengths, docs[:-1]) if len(lengths) and ds.num_documents \
        else np.zeros(0, dtype=np.int64)
    out: dict[str, Any] = {
        "prefix": str(ds.prefix), "documents": ds.num_documents, "sequences": len(ds),
        "tokens": ds.num_tokens, "dtype": ds.dtype.name,
        "bytes": Path(f"{ds.prefix}.bin").stat().st_size,
        "tokens_per_document": {
            "mean": round(float(doc_tokens.mean()), 2) if len(doc_tokens) else 0.0,
            "min": int(doc_tokens.min()) if len(doc_tokens) else 0,
            "max": int(doc_tokens.max()) if len(doc_tokens) else 0,
        },
    }
    if ds.num_documents:
        d = min(max(sample, 0), ds.num_documents - 1)
        ids = np.concatenate([ds.get(s) for s in range(int(docs[d]), int(docs[d + 1]))]) \
            if docs[d + 1] > docs[d] else np.zeros(0, dtype=ds.dtype)
        tok_file = tokenizer or sidecar_tokenizer(ds.prefix)
        out["sample"] = {"document": d, "tokens": int(len(ids)),
                         "ids": [int(t) for t in ids[:32]]}
        if tok_file:
            from scaletrain.data.tokenizer import TextTokenizer

            out["sample"]["text"] = TextTokenizer.load(tok_file).decode(ids)[:chars]
    return out


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from scaletrain.data.indexed import IndexedDatasetError
    from scaletrain.data.tokenizer import TokenizerError

    try:
        info = describe(args.prefix, args.tokenizer, args.sample, args.chars)
    except (IndexedDatasetError, TokenizerError) as e:
        print(f"scaletrain data inspect: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1, ensure_ascii=False))
        return 0
    tpd = info["tokens_per_document"]
    print(f"{info['prefix']}: {info['documents']:,} documents, {info['sequences']:,} sequences, "
          f"{info['tokens']:,} tokens ({info['dtype']}, {info['bytes']:,} bytes)")
    print(f"tokens per document: mean {tpd['mean']}, min {tpd['min']}, max {tpd['max']}")
    if "sample" in info:
        s = info["sample"]
        print(f"\ndocument {s['document']} ({s['tokens']} tokens), first ids {s['ids'][:16]}")
        if "text" in s:
            print(s["text"])
        else:
            print("(give --tokenizer to decode it)")
    return 0
