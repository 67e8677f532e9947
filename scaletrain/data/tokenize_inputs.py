"""What `data tokenize` reads: the document files of an input (a file, a glob, a curated
folder's kept shards or any directory) and the text of each record (JSON lines, compressed or
not, or Parquet); a malformed record is counted, skipped and named in the `ReadReport` (with
`strict`, the first one stops the run), and a small clean JSON-lines file is read in one read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

from scaletrain.curate.io.paths import InputError, expand_inputs
from scaletrain.curate.io.readers import ReadReport, json_records
from scaletrain.data.small_jsonl import read_small_jsonl
from scaletrain.data.tokenize_parts import FileStat, stat_files

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".ndjson", ".parquet")


class TokenizeError(ValueError):
    """Unusable tokenization input; the message names the file and the fix."""


def input_shards(path: str | Path) -> list[str]:
    """The document files of `path`: a file, a glob, a curated folder (the kept shards its
    manifest lists) or any other directory (searched recursively, `_work/` and `_dropped/`
    of a curation run skipped). Paths as strings: 100,000 `Path` objects cost seconds."""
    p = Path(path).expanduser()
    if not p.exists() and not any(c in str(path) for c in "*?["):
        raise TokenizeError(f"--input: '{p}' does not exist")
    try:
        files = expand_inputs(str(p))
    except InputError as e:
        if not (p.is_dir() and "matches no file" in str(e)):
            raise TokenizeError(f"--input: {e}") from None
        files = []
    if p.is_file():
        return files
    skipped = [f for f in files if not f.endswith(SUFFIXES)]
    if skipped:  # said, not silent: a 'docs.json' of JSON lines would otherwise just vanish
        log.warning("--input: %d file(s) under '%s' are not %s and are not read (e.g. %s)",
                    len(skipped), p, "/".join(SUFFIXES), skipped[0])
    files = [f for f in files if f.endswith(SUFFIXES)]
    if not files:
        raise TokenizeError(f"--input: no {', '.join(SUFFIXES)} files under '{p}'")
    return files


def read_documents(path: str | Path, text_key: str = "text", report: ReadReport | None = None
                   ) -> Iterator[str]:
    """The `text_key` field of each record of a JSONL(.gz/.zst) or Parquet file; malformed
    records go to `report` (skipped, or raised by a strict report). A file that cannot be
    read as its format, or a Parquet file without the column, is malformed as a whole."""
    report = report if report is not None else ReadReport()
    name = os.fspath(path)
    if name.endswith(".parquet"):
        yield from _parquet_texts(path, text_key, report)
        return
    if not name.endswith(SUFFIXES):
        raise TokenizeError(f"{path}: unknown document format (use {', '.join(SUFFIXES)})")
    try:
        for where, _, rec in json_records(str(path), report):
            text = rec.get(text_key)
            if not isinstance(text, str):
                report.add(where, f"no string field '{text_key}' (set --text-key)")
            elif text:
                yield text
            else:
                report.empty += 1
    except (OSError, EOFError) as e:  # not readable from its first byte
        report.add(str(path), f"cannot read the file ({type(e).__name__}: {e}); check that "
                              "it is complete and its suffix matches its compression")


def group_texts(files: list[str], text_key: str, report: ReadReport,
                known: list[tuple[int, int]] | None = None, seen: list[FileStat] | None = None,
                limit: int | None = None) -> Iterator[str]:
    """The documents of `files` in order: a small clean JSON-lines file in one read
    (`read_small_jsonl`), any other through `read_documents`. `known`: each file's (size,
    mtime_ns) as the caller's `stat` found them ((-1, -1): not known). Each file read goes
    to `seen` with its size and modification time; with `limit`, no file is started once
    the files read hold `limit` bytes."""
    read = 0
    for k, f in enumerate(files):
        if limit is not None and k and read >= limit:
            return
        size, mtime_ns = known[k] if known else (-1, -1)
        small = read_small_jsonl(f, text_key, size, mtime_ns)
        if small is None:
            st = next(stat_files([f]))
            read += max(st.size, 0)
            if seen is not None:
                seen.append(st)
            yield from read_documents(f, text_key, report)
        else:
            read += small.size
            if seen is not None:
                seen.append(FileStat(f, small.size, small.mtime_ns))
            report.empty += small.empty
            yield from small.texts


def _parquet_texts(path: str | Path, text_key: str, report: ReadReport) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TokenizeError("reading Parquet needs pyarrow: pip install 'scaletrain[data]'"
                            ) from None
    try:  # pyarrow raises several error types for a file that is not Parquet
        pf = pq.ParquetFile(path)
    except Exception as e:
        report.add(str(path), f"cannot read Parquet file: {e}")
        return
    rows = pf.metadata.num_rows
    if text_key not in pf.schema_arrow.names:
        if rows:
            report.add(str(path), f"no '{text_key}' column (has {pf.schema_arrow.names}; set "
                                  "--text-key)", count=rows)
        return
    row = 0
    try:
        for batch in pf.iter_batches(columns=[text_key], batch_size=4096):
            for t in batch.column(0).to_pylist():
                if not isinstance(t, str):  # as a JSON record without a string text
                    report.add(f"{path}:row{row}", f"no string field '{text_key}' "
                                                   f"({type(t).__name__})")
                elif t:
                    yield t
                else:
                    report.empty += 1
                row += 1
    except (TokenizeError, InputError):  # InputError: a strict report's first record
        raise
    except Exception as e:  # a damaged row group: the rows not read are malformed
        report.add(f"{path}:row{row}", f"cannot read Parquet file at row {row}: {e}",
                   count=max(1, rows - row))
