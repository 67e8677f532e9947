"""`scaletrain data tokenize --input PATH --output PREFIX (--tokenizer FILE_OR_DIR |
--train-tokenizer VOCAB_SIZE)`: documents (JSONL/Parquet with a `text` field) to a
Megatron-compatible indexed dataset PREFIX.bin/.idx (+ PREFIX.tokenizer.json)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain data tokenize", description=__doc__)
    p.add_argument("--input", required=True,
                   help="a .jsonl(.gz)/.parquet file, a glob or a directory of them (one shard "
                        "each); a curated folder gives the kept shards of its manifest.json")
    p.add_argument("--output", required=True, help="output prefix (writes PREFIX.bin/.idx)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer", help="tokenizer.json or a Hugging Face tokenizer directory")
    src.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE",
                     help="train a byte-level BPE with this vocabulary on the input first")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="processes (or Ray tasks) tokenizing shards in parallel")
    p.add_argument("--executor", choices=["local", "ray"], default="local")
    p.add_argument("--text-key", default="text", help="field holding each document's text")
    p.add_argument("--add-bos", action="store_true", help="start each document with BOS")
    p.add_argument("--strict", action="store_true",
                   help="stop (exit 2) at the first malformed record instead of skipping it")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    return p


def _inputs_and_tokenizer(args: argparse.Namespace) -> tuple[list[str], Any]:
    """The input files and the `--tokenizer`, loaded meanwhile in a thread (the Rust loader
    releases the GIL): a folder of 100,000 files takes about as long to list as the
    tokenizer to load. An input error is reported first, as without the thread."""
    from scaletrain.data.tokenize_inputs import input_shards
    from scaletrain.data.tokenizer import TextTokenizer

    if args.tokenizer is None:
        return input_shards(args.input), None
    with ThreadPoolExecutor(1) as pool:
        loading = pool.submit(TextTokenizer.load, args.tokenizer, add_bos=args.add_bos)
        shards = input_shards(args.input)
        return shards, loading.result()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from scaletrain.curate.io.paths import InputError
    from scaletrain.curate.io.readers import ReadReport
    from scaletrain.data.indexed import strip_prefix
    from scaletrain.data.tokenize import tokenize_to_indexed
    from scaletrain.data.tokenize_inputs import TokenizeError, read_documents
    from scaletrain.data.tokenizer import TokenizerError, train_bpe

    prefix = strip_prefix(args.output)
    # a trained tokenizer waits under a temporary name: tokenize_to_indexed puts it beside
    # the dataset, so an interrupted run never pairs it with an earlier run's tokens
    trained = f"{prefix}.trained-tokenizer.tmp.json"
    try:
        shards, tokenizer = _inputs_and_tokenizer(args)
        if args.train_tokenizer is not None:
            t0 = time.perf_counter()
            report = ReadReport(strict=args.strict)
            texts = (t for s in shards for t in read_documents(s, args.text_key, report))
            tok = train_bpe(texts, args.train_tokenizer, progress=sys.stderr.isatty(),
                            bos=args.add_bos)
            prefix.parent.mkdir(parents=True, exist_ok=True)
            tok.save(trained)
            tokenizer = trained
            log.info("trained a byte-level BPE tokenizer (vocab %d) in %.1fs",
                     tok.get_vocab_size(), time.perf_counter() - t0)
        stats = tokenize_to_indexed(shards, prefix, tokenizer, workers=args.workers,
                                    executor=args.executor, add_bos=args.add_bos,
                                    text_key=args.text_key, strict=args.strict)
    except (TokenizeError, TokenizerError, InputError, OSError) as e:
        print(f"scaletrain data tokenize: {e}", file=sys.stderr)
        return 2
    finally:
        if os.path.exists(trained):
            os.remove(trained)
    out = {"output": str(prefix), "shards": len(shards), **stats.to_dict()}
    # every record once: documents + empty + malformed = records
    if stats.empty:
        log.warning("skipped %d record(s) with an empty text (not documents)", stats.empty)
    if stats.malformed:
        log.warning("skipped %d malformed record(s) (--strict stops at the first); e.g. %s",
                    stats.malformed, "; ".join(stats.malformed_examples[:3]))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        log.info("wrote %s.bin/.idx: %d documents, %d tokens from %d files (%d parts) in "
                 "%.1fs (%.0f tokens/s, %.1f tokens per document); records: %d = %d documents "
                 "+ %d empty + %d malformed", prefix, stats.documents, stats.tokens,
                 len(shards), stats.parts, stats.seconds, stats.tokens_per_s,
                 stats.tokens_per_document, stats.records, stats.documents, stats.empty,
                 stats.malformed)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
