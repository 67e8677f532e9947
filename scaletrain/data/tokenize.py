"""Documents (JSONL / Parquet with a `text` field) -> a Megatron indexed dataset, in parallel.

Input files (those of `--input`, in sorted order) are packed into groups (`tokenize_parts`)
and tokenized by a pool of processes (or Ray tasks), each group into partial `.bin/.idx`
files (the tokenizer is loaded once per worker; forked workers get the driver's); the parts
are then appended in file order, so the output is byte-identical whatever the number of
workers or files. A small clean JSON-lines file is read in one read (`small_jsonl`). An
interrupted run's finished parts are reused by the next run where their files are
unchanged. Each document becomes one sequence (= one document in the index): [BOS] tokens
EOS.

Malformed input is treated as curation treats it: a bad record (invalid UTF-8 or JSON, no
text field, a compressed file that ends early) is counted, skipped and named with its file
and line in the statistics; with `strict` the first one stops the run with that message
(the files and records are read by `tokenize_inputs`).
A curated folder (`scaletrain data curate`) is read through its manifest: the kept shards only.
A very long document is encoded in pieces cut at spaces between words (where byte-level and
metaspace pre-tokenizers split anyway), so its memory stays bounded by the piece size.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.curate.io.paths import InputError
from scaletrain.curate.io.readers import MAX_EXAMPLES, ReadReport
from scaletrain.data import tokenize_parts as parts_plan
from scaletrain.data.indexed import IndexedDatasetWriter, strip_prefix
from scaletrain.data.tokenize_inputs import TokenizeError, group_texts
from scaletrain.data.tokenize_parts import (
    FileStat,
    PartsDir,
    finished_parts,
    mark_finished,
    part_name,
    plan_groups,
    run_fingerprint,
)
from scaletrain.data.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

_BATCH_CHARS = 4 << 20  # text per encode_batch call
_PIECE_CHARS = 1 << 20  # a longer document is encoded in pieces of about this size
_ENCODED_HERE = False  # whether this process has encoded (its tokenizer threads started)


@dataclass
class TokenizeStats:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    malformed: int = 0
    malformed_examples: list[str] = field(default_factory=list)
    empty: int = 0  # records with an empty text, skipped
    files: int = 0  # input files
    parts: int = 0  # jobs (groups of files), each one partial dataset

    @property
    def records(self) -> int:
        """Every record read: documents + empty + malformed."""
        return self.documents + self.empty + self.malformed

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
        self.malformed += other.malformed
        self.empty += other.empty
        self.malformed_examples = (self.malformed_examples + other.malformed_examples)[
            :MAX_EXAMPLES]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "records": self.records,
                "tokens_per_s": round(self.tokens_per_s, 1),
                "tokens_per_document": round(self.tokens_per_document, 2)}


# --- writing ----------------------------------------------------------------------------------
def _pieces(text: str, size: int) -> Iterator[str]:
    """`text` cut before a space that follows a non-space and precedes one, about every
    `size` characters: byte-level BPE ('Ġword') and metaspace pre-tokenizers split there
    anyway, so encoding the pieces gives the tokens of the whole. Text without such a
    space for a long stretch is cut at the next one found."""
    start = 0
    n = len(text)
    while n - start > size:
        cut = text.find(" ", start + size)
        while cut != -1 and (text[cut - 1].isspace() or cut + 1 >= n or text[cut + 1].isspace()):
            cut = text.find(" ", cut + 1)
        if cut == -1:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def _encode_long(tok: TextTokenizer, text: str) -> np.ndarray:
    """One long document's ids (with separators), encoded piece by piece."""
    parts = [tok.encode_documents([p])[0][:-1] for p in _pieces(text, _PIECE_CHARS)]
    if tok.add_bos:  # every piece got BOS first; keep the first one only
        parts = [parts[0]] + [p[1:] for p in parts[1:]]
    return np.concatenate([*parts, np.asarray([tok.eos_id], dtype=tok.dtype)])


def write_texts(tok: TextTokenizer, texts: Iterable[str], writer: IndexedDatasetWriter
                ) -> TokenizeStats:
    """Tokenize `texts` (one document each) into `writer`; returns the counts."""
    global _ENCODED_HERE
    _ENCODED_HERE = True
    stats = TokenizeStats()

    def add(batch: list[str], docs: list[np.ndarray]) -> None:
        writer.add_documents(docs)
        stats.documents += len(docs)
        stats.tokens += sum(len(d) for d in docs)
        stats.bytes += sum(len(t.encode("utf-8", "surrogatepass")) for t in batch)

    batch: list[str] = []
    size = 0
    for t in texts:
        if len(t) > _PIECE_CHARS:  # flush the short ones first: document order is kept
            if batch:
                add(batch, tok.encode_documents(batch))
                batch, size = [], 0
            add([t], [_encode_long(tok, t)])
            continue
        batch.append(t)
        size += len(t)
        if size >= _BATCH_CHARS:
            add(batch, tok.encode_documents(batch))
            batch, size = [], 0
    if batch:
        add(batch, tok.encode_documents(batch))
    return stats


_TOKENIZERS: dict[tuple[str, bool, str], TextTokenizer] = {}  # per worker: loaded once


def _tokenizer_key(path: str, add_bos: bool) -> tuple[str, bool, str]:
    """By content: a file rewritten at the same path (a retrained tokenizer) is another."""
    p = Path(path)
    return path, add_bos, hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""


def _worker_tokenizer(path: str, add_bos: bool) -> TextTokenizer:
    """The tokenizer at `path`, loaded once per process."""
    key = _tokenizer_key(path, add_bos)
    if key not in _TOKENIZERS:
        _TOKENIZERS.clear()  # one run's tokenizer at a time
        _TOKENIZERS[key] = TextTokenizer.load(path, add_bos=add_bos)
    return _TOKENIZERS[key]


def _tokenize_group(job: tuple) -> dict[str, Any]:
    """One group of files (a worker process or Ray task) into partial datasets of at most
    about GROUP_MAX_BYTES of input each, cut between files as they are read, each with its
    marker; the texts of small files are batched together. The parts an earlier run finished
    from the same files (sizes and modification times unchanged) are reused as they are.
    `known`: each file's (size, mtime_ns) as the driver's `stat` found them, or (-1, -1)."""
    files, tok_path, add_bos, group, text_key, strict, known = job
    done = finished_parts(group, files)
    stats = TokenizeStats()
    made = [part for part, _, _ in done]
    for _, _, r in done:
        stats.add(TokenizeStats(**r))
    pos = done[-1][1] if done else 0
    report = ReadReport(strict=strict)  # one per group: it logs the first few malformed
    tok = _worker_tokenizer(tok_path, add_bos) if pos < len(files) else None
    while tok is not None and pos < len(files):
        part = part_name(group, len(made))
        before = (report.malformed, len(report.examples), report.empty)
        seen: list[FileStat] = []
        texts = group_texts(files[pos:], text_key, report, known[pos:] if known else None,
                            seen, parts_plan.GROUP_MAX_BYTES)
        with IndexedDatasetWriter(part, tok.dtype) as w:
            part_stats = write_texts(tok, texts, w)
        part_stats.malformed = report.malformed - before[0]
        part_stats.malformed_examples = report.examples[before[1]:]
        part_stats.empty = report.empty - before[2]
        part_stats.files = len(seen)
        mark_finished(part, pos, seen, asdict(part_stats))
        stats.add(part_stats)
        made.append(part)
        pos += len(seen)
    return {"stats": asdict(stats), "parts": made, "reused": len(done)}


def _init_worker(workers: int) -> None:
    """A pool worker: ends with its driver, and encodes with this machine's share of cores
    (the pool is the parallelism; a thread pool per worker on top only contends)."""
    from scaletrain.curate.executors.lifeline import bind_to_parent

    bind_to_parent()
    if "TOKENIZERS_PARALLELISM" not in os.environ and "RAYON_NUM_THREADS" not in os.environ:
        share = (os.cpu_count() or 1) // max(workers, 1)
        if share <= 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        else:  # read when the (Rust) thread pool starts: at this worker's first encode
            os.environ["RAYON_NUM_THREADS"] = str(share)


class WorkerDied(TokenizeError):
    """A worker process was killed (out of memory?); the finished parts are kept."""


def _start_method() -> str:
    """'fork' where it is safe and available: a forked worker starts in milliseconds with the
    driver's tokenizer already loaded, where a spawned one imports and loads it again (about
    a second, which 100,000 tiny files notice). 'spawn' once this process has encoded a
    batch: the tokenizers thread pool it started does not survive a fork."""
    import multiprocessing as mp

    if _ENCODED_HERE or "fork" not in mp.get_all_start_methods():
        return "spawn"
    return "fork"


def _run_jobs(jobs: Iterable[tuple], workers: int, executor: str, fn: Any = None
              ) -> Iterator[dict[str, Any]]:
    """`fn` (default: `_tokenize_group`) of each job; results in job order. Jobs may still
    be coming (a stream): each is started as soon as it arrives, and a result is given as
    soon as it and those before it are finished. One job runs in this process (no worker to
    start). A worker process that dies (killed, out of memory) is a `WorkerDied` error, not a
    wait for ever."""
    fn = fn or _tokenize_group
    if executor == "ray":
        yield from _run_ray(list(jobs), workers, fn)
        return
    if executor != "local":
        raise TokenizeError(f"--executor: unknown executor '{executor}' (local or ray)")
    stream = iter(jobs)
    if workers <= 1:
        yield from map(fn, stream)
        return
    first = list(itertools.islice(stream, 2))
    if len(first) < 2:
        yield from map(fn, first)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    def result(job: tuple, fut: Any) -> dict[str, Any]:
        try:
            return fut.result()
        except BrokenProcessPool:
            first_file = job[0][0] if isinstance(job[0], list) and job[0] else job[0]
            raise WorkerDied(
                f"a worker process died (killed, or out of memory?) while tokenizing "
                f"'{first_file}' or files beside it; the finished parts are kept: run again "
                "to go on, with fewer --workers if memory is short") from None

    # (multiprocessing.Pool would wait for ever for the job of a worker that was killed;
    # this pool reports it.)
    pool = ProcessPoolExecutor(workers, mp.get_context(_start_method()),
                               initializer=_init_worker, initargs=(workers,))
    pending: deque[tuple[tuple, Any]] = deque()
    try:
        for job in itertools.chain(first, stream):
            pending.append((job, pool.submit(fn, job)))
            while pending and pending[0][1].done():
                yield result(*pending.popleft())
        while pending:
            yield result(*pending.popleft())
    finally:  # on an error, the jobs not started are not started
        pool.shutdown(wait=True, cancel_futures=True)


def _run_ray(jobs: list[tuple], workers: int, fn: Any) -> Iterator[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise TokenizeError("--executor ray needs ray: pip install 'ray[data]'") from None
    if not ray.is_initialized():
        ray.init(num_cpus=workers or None, include_dashboard=False, log_to_driver=False)
    task = ray.remote(fn)
    refs = [task.remote(j) for j in jobs]
    for r in refs:
        try:
            yield ray.get(r)
        except Exception as e:
            cause = getattr(e, "cause", e)
            if isinstance(cause, InputError):  # --strict: the malformed record, as is
                raise InputError(str(cause)) from None
            raise


def tokenize_to_indexed(
    inputs: list[str] | list[Path],
    output: str | Path,
    tokenizer: str | Path | TextTokenizer,
    workers: int = 1,
    executor: str = "local",
    add_bos: bool = False,
    text_key: str = "text",
    strict: bool = False,
) -> TokenizeStats:
    """Tokenize every input file into the indexed dataset `output` (PREFIX.bin/.idx).

    Files are tokenized in groups (`plan_groups`), each into partial datasets in
    `PREFIX.parts-tmp/`, then appended in file order: the output is the same whatever the
    number of workers or groups. An interrupted run leaves its finished parts; the same
    command again reuses those whose files are unchanged. `tokenizer`: a path, or a
    `TextTokenizer` loaded with this `add_bos`. Malformed records are skipped and counted
    (`stats.malformed`, examples with file and line); with `strict` the first one raises
    `MalformedRecord`. A run that reads no document raises `TokenizeError`; in both cases
    nothing is written."""
    if isinstance(tokenizer, TextTokenizer):  # loaded by the caller (with this add_bos)
        tok = tokenizer
    else:
        tok = TextTokenizer.load(tokenizer, add_bos=add_bos)  # fail early on a bad one
    prefix = strip_prefix(output)
    sidecar = Path(f"{prefix}.tokenizer.json")
    # An earlier dataset at this prefix goes first: an interrupted run then leaves no
    # dataset at all, never old tokens beside a new tokenizer (or new tokens beside an old
    # one). The sidecar is replaced before the index, which is renamed last.
    for old in (Path(f"{prefix}.idx"), Path(f"{prefix}.bin")):
        old.unlink(missing_ok=True)
    paths = [os.fspath(f) for f in inputs]
    parts = PartsDir(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    found = parts.open(run_fingerprint(tok.path, {"add_bos": add_bos, "text_key": text_key,
                                                  "dtype": str(tok.dtype)}))
    if tok.path is not None:  # this process's worker (workers=1) needs no second load
        _TOKENIZERS.clear()
        _TOKENIZERS[_tokenizer_key(str(tok.path), add_bos)] = tok
    planned: list[int] = []  # files per group, as the groups are made
    planned_all = False

    def jobs() -> Iterator[tuple]:
        nonlocal planned_all
        for i, g in enumerate(plan_groups(paths, workers)):
            planned.append(len(g))
            yield ([f.path for f in g], str(tok.path), add_bos, parts.group(i), text_key,
                   strict, [(f.size, f.mtime_ns) for f in g])
        planned_all = True

    stats = TokenizeStats()
    made: list[list[str]] = []  # each group's parts
    reused = 0
    t0 = time.perf_counter()
    keep_parts = False
    try:
        for i, r in enumerate(_run_jobs(jobs(), workers, executor)):
            stats.add(TokenizeStats(**r["stats"]))
            made.append(r["parts"])
            reused += r["reused"]
            dt = time.perf_counter() - t0
            log.info("tokenized group %d%s (%d files, %d parts%s): %d documents, %d tokens so "
                     "far (%.0f tokens/s)", i + 1, f"/{len(planned)}" if planned_all else "",
                     planned[i], len(r["parts"]),
                     f", {r['reused']} reused" if r["reused"] else "", stats.documents,
                     stats.tokens, stats.tokens / max(dt, 1e-9))
        if found:
            log.info("resumed: %d of %d parts were finished by an earlier run", reused,
                     sum(map(len, made)))
        if stats.documents == 0:
            raise TokenizeError(nothing_read(stats, len(inputs)))
        if tok.path is not None and tok.path.resolve() != sidecar.resolve():
            shutil.copyfile(tok.path, f"{sidecar}.tmp")
            os.replace(f"{sidecar}.tmp", sidecar)
        with IndexedDatasetWriter(prefix, tok.dtype) as w:  # .bin, then .idx, renamed last
            for part in itertools.chain.from_iterable(made):
                w.append_dataset(part)
    except (KeyboardInterrupt, WorkerDied):
        # the next run goes on from the finished parts (if any finished)
        keep_parts = parts.any_finished()
        raise
    finally:
        if not keep_parts:
            parts.remove()
    stats.seconds = time.perf_counter() - t0
    stats.files, stats.parts = len(inputs), sum(map(len, made))
    return stats


def nothing_read(stats: TokenizeStats, files: int) -> str:
    """One line for a run that read no document from its input files."""
    first = f"; first: {stats.malformed_examples[0]}" if stats.malformed_examples else ""
    return (f"no document to tokenize in {files} file(s): {stats.malformed} malformed and "
            f"{stats.empty} empty record(s){first}")


def sidecar_tokenizer(prefix: str | Path) -> Path | None:
    """The tokenizer saved next to an indexed dataset by `tokenize_to_indexed`, if any."""
    p = Path(f"{strip_prefix(prefix)}.tokenizer.json")
    return p if p.is_file() else None
