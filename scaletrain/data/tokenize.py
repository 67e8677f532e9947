"""Documents (JSONL / Parquet with a `text` field) -> a Megatron indexed dataset, in parallel.

Input shards (the files of `--input`, in sorted order) are tokenized by a pool of processes
(or Ray tasks), each into its own partial `.bin/.idx`; the parts are then appended in shard
order, so the output is byte-identical whatever the number of workers. Each document becomes
one sequence (= one document in the index): [BOS] tokens EOS.

Unlike the curation readers, which skip and count a malformed record, tokenization stops at
one with its file and line: a training set should not lose documents silently. Curated output
(`scaletrain data curate`) is valid input.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scaletrain.data.indexed import IndexedDatasetWriter, strip_prefix
from scaletrain.data.io.paths import open_decompressed
from scaletrain.data.tokenizer import TextTokenizer

log = logging.getLogger("scaletrain.data")

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".ndjson", ".parquet")
_BATCH_CHARS = 4 << 20  # text per encode_batch call


class TokenizeError(ValueError):
    """Unusable tokenization input; the message names the file and the fix."""


@dataclass
class TokenizeStats:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def tokens_per_document(self) -> float:
        return self.tokens / max(self.documents, 1)

    def add(self, other: TokenizeStats) -> None:
        self.documents += other.documents
        self.tokens += other.tokens
        self.bytes += other.bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1),
                "tokens_per_document": round(self.tokens_per_document, 2)}


# --- reading ----------------------------------------------------------------------------------
def input_shards(path: str | Path) -> list[Path]:
    """The document files under `path` (a file, or a directory searched recursively)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise TokenizeError(f"--input: '{p}' does not exist")
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(SUFFIXES))
    if not files:
        raise TokenizeError(f"--input: no {', '.join(SUFFIXES)} files under '{p}'")
    return files


def read_documents(path: Path, text_key: str = "text") -> Iterator[str]:
    """The `text_key` field of each record of a JSONL(.gz) or Parquet file."""
    name = path.name
    if name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise TokenizeError("reading Parquet needs pyarrow: pip install 'scaletrain[data]'"
                                ) from None
        pf = pq.ParquetFile(path)
        if text_key not in pf.schema_arrow.names:
            raise TokenizeError(f"{path}: no '{text_key}' column (has {pf.schema_arrow.names})")
        for batch in pf.iter_batches(columns=[text_key], batch_size=4096):
            yield from (t for t in batch.column(0).to_pylist() if t)
        return
    if not name.endswith(SUFFIXES):
        raise TokenizeError(f"{path}: unknown document format (use {', '.join(SUFFIXES)})")
    with open_decompressed(str(path)) as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TokenizeError(f"{path}:{lineno}: not valid JSON ({e})") from None
            text = rec.get(text_key) if isinstance(rec, dict) else None
            if not isinstance(text, str):
                raise TokenizeError(f"{path}:{lineno}: no string field '{text_key}' "
                                    "(set --text-key)")
            if text:
                yield text


# --- writing ----------------------------------------------------------------------------------
def _batches(texts: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= _BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def write_texts(tok: TextTokenizer, texts: Iterable[str], writer: IndexedDatasetWriter
                ) -> TokenizeStats:
    """Tokenize `texts` (one document each) into `writer`; returns the counts."""
    stats = TokenizeStats()
    for batch in _batches(texts):
        docs = tok.encode_documents(batch)
        writer.add_documents(docs)
        stats.documents += len(docs)
        stats.tokens += sum(len(d) for d in docs)
        stats.bytes += sum(len(t.encode("utf-8", "surrogatepass")) for t in batch)
    return stats


def _tokenize_shard(job: tuple[str, str, bool, str, str]) -> dict[str, Any]:
    """One shard into one partial dataset (runs in a worker process or Ray task)."""
    shard, tok_path, add_bos, out_prefix, text_key = job
    tok = TextTokenizer.load(tok_path, add_bos=add_bos)
    with IndexedDatasetWriter(out_prefix, tok.dtype) as w:
        stats = write_texts(tok, read_documents(Path(shard), text_key), w)
    return asdict(stats)


def _run_jobs(jobs: list[tuple], workers: int, executor: str) -> Iterator[dict[str, Any]]:
    """Results in job order."""
    if executor == "ray":
        try:
            import ray
        except ImportError:
            raise TokenizeError("--executor ray needs ray: pip install 'ray[data]'") from None
        if not ray.is_initialized():
            ray.init(num_cpus=workers or None, include_dashboard=False, log_to_driver=False)
        task = ray.remote(_tokenize_shard)
        refs = [task.remote(j) for j in jobs]
        for r in refs:
            yield ray.get(r)
        return
    if executor != "local":
        raise TokenizeError(f"--executor: unknown executor '{executor}' (local or ray)")
    if workers <= 1 or len(jobs) == 1:
        yield from map(_tokenize_shard, jobs)
        return
    import multiprocessing as mp

    # spawn: tokenizers' thread pool does not survive fork.
    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        yield from pool.imap(_tokenize_shard, jobs)


def tokenize_to_indexed(
    inputs: list[Path],
    output: str | Path,
    tokenizer: str | Path,
    workers: int = 1,
    executor: str = "local",
    add_bos: bool = False,
    text_key: str = "text",
) -> TokenizeStats:
    """Tokenize every input shard into the indexed dataset `output` (PREFIX.bin/.idx)."""
    tok = TextTokenizer.load(tokenizer, add_bos=add_bos)  # fail early on a bad tokenizer
    prefix = strip_prefix(output)
    parts = Path(f"{prefix}.parts-tmp")
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir(parents=True)
    jobs = [(str(s), str(tok.path), add_bos, str(parts / f"part-{i:05d}"), text_key)
            for i, s in enumerate(inputs)]
    stats = TokenizeStats()
    t0 = time.perf_counter()
    try:
        for i, r in enumerate(_run_jobs(jobs, workers, executor)):
            stats.add(TokenizeStats(**r))
            dt = time.perf_counter() - t0
            log.info("tokenized shard %d/%d: %d documents, %d tokens so far (%.0f tokens/s)",
                     i + 1, len(jobs), stats.documents, stats.tokens, stats.tokens / max(dt, 1e-9))
        with IndexedDatasetWriter(prefix, tok.dtype) as w:
            for _, _, _, part, _ in jobs:
                w.append_dataset(part)
    finally:
        shutil.rmtree(parts, ignore_errors=True)
    stats.seconds = time.perf_counter() - t0
    if tok.path != Path(f"{prefix}.tokenizer.json"):
        shutil.copyfile(tok.path, f"{prefix}.tokenizer.json.tmp")
        os.replace(f"{prefix}.tokenizer.json.tmp", f"{prefix}.tokenizer.json")
    return stats


def sidecar_tokenizer(prefix: str | Path) -> Path | None:
    """The tokenizer saved next to an indexed dataset by `tokenize_to_indexed`, if any."""
    p = Path(f"{strip_prefix(prefix)}.tokenizer.json")
    return p if p.is_file() else None
