"""Readers: JSON lines (plain/.gz/.zst), Parquet, text/source files and WARC -> Documents.

`read_documents(path_or_glob)` is the simple public entry point. Executors read `Shard`s: a
file or a part of one (a byte range of an uncompressed JSONL file, a range of Parquet row
groups), so one large file is not one task. A malformed record (or a file that cannot be
read as its format) is counted in a `ReadReport` with its file and line and skipped; binary
files are skipped and counted; a missing dependency raises `InputError`.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scaletrain.curate.documents import Document
from scaletrain.curate.io.errors import DamagedInput
from scaletrain.curate.io.paths import (
    InputError,
    compression_of,
    expand_inputs,
    file_size,
    format_of,
    open_decompressed,
    open_raw,
)
from scaletrain.curate.io.read_report import MAX_EXAMPLES, MalformedRecord, ReadReport
from scaletrain.curate.io.sniff import (
    SNIFF_BYTES,
    binary_suffix,
    is_binary,
    json_kind,
    looks_like_prose,
    prose_candidate,
)

log = logging.getLogger(__name__)

try:  # a damaged .zst stream raises zstandard's own error type
    from zstandard import ZstdError as _ZstdError
except ImportError:  # pragma: no cover - zstandard is optional
    _ZstdError = OSError  # type: ignore[assignment,misc]

_DAMAGED_STREAM = (OSError, EOFError, _ZstdError, DamagedInput)


@dataclass(frozen=True)
class Shard:
    """A whole file (`start == 0`, `end is None`) or a part of one.

    For JSONL the part is a byte range: the records whose first byte lies in [start, end).
    For Parquet it is a range of row groups. `root` is the input directory the file was
    found under (ids of text files are paths relative to it). `fmt` is the format found by
    `plan_shards` when the suffix alone does not say it (a `.json` file holding one JSON
    document is 'text'); empty: the suffix's format.
    """

    path: str
    start: int = 0
    end: int | None = None
    root: str = ""
    fmt: str = ""

    @property
    def format(self) -> str:
        return self.fmt or format_of(self.path)


@dataclass
class TooLong(Document):
    """A text file over a document limit of `max_chars` characters, not read (its size on
    disk already says so: UTF-8 takes at most 4 bytes a character) or read only until the
    limit was passed. Its text is empty; `chars_at_least` is what is known of its length.
    Yielded only when `read_shard` is given `max_chars`; the runner counts it as dropped by
    the step whose limit it is."""

    chars_at_least: int = 0


_READ_BYTES = 1 << 20  # text files are decoded in pieces of this size


def _rel_id(shard: Shard) -> str:
    if shard.root:
        try:
            return Path(shard.path).relative_to(shard.root).as_posix()
        except ValueError:
            pass
    return shard.path  # no input directory: the path keeps ids unique


def json_records(
    path: str, report: ReadReport, start: int = 0, end: int | None = None
) -> Iterator[tuple[str, int, dict]]:
    """(where, byte offset, record) for each JSON object line of a JSONL(.gz/.zst) file.

    Bad lines (invalid UTF-8 or JSON, not an object) are reported with `FILE:LINE` and
    skipped. A compressed stream that ends early (a truncated file) is reported at the line
    where it ends and the rest of the file is skipped; a file that is not readable from its
    first byte raises. `start`/`end` select the records beginning in [start, end).
    """
    with open_decompressed(path) as f:
        offset, line_no = 0, 0
        if start > 0:  # start at the first record beginning at or after `start`
            f.seek(start - 1)
            offset = start - 1 + len(f.readline())
            line_no = -1  # line numbers unknown in a split file: report byte offsets
        while True:
            try:
                raw = f.readline()
            except (OSError, EOFError, _ZstdError) as e:
                if offset == 0:
                    raise
                where = f"{path}:{line_no + 1}" if line_no >= 0 else f"{path}@byte{offset}"
                report.add(where, f"the file ends early ({type(e).__name__}: {e}); "
                                  "the rest of it is skipped")
                return
            if not raw or (end is not None and offset >= end):
                return
            here, offset = offset, offset + len(raw)
            line_no = line_no + 1 if line_no >= 0 else -1
            where = f"{path}:{line_no}" if line_no > 0 else f"{path}@byte{here}"
            if not raw.strip():
                continue
            try:  # decoded here: json.loads(bytes) guesses UTF-16/32 from the first bytes
                text = raw.decode("utf-8-sig" if here == 0 else "utf-8")
            except UnicodeDecodeError as e:
                report.add(where, f"not valid UTF-8 (byte {e.start} of the line: "
                                  f"{e.object[e.start:e.start + 1]!r})")
                continue
            try:
                record = json.loads(text)
            except ValueError as e:
                report.add(where, str(e)[:200])
                continue
            if not isinstance(record, dict):
                report.add(where, "not a JSON object")
                continue
            yield where, here, record


def _read_jsonl(shard: Shard, report: ReadReport) -> Iterator[Document]:
    name = _rel_id(shard)
    for where, here, record in json_records(shard.path, report, shard.start, shard.end):
        try:
            doc = Document.from_dict(record, default_id=f"{name}/{here}")
        except ValueError as e:
            report.add(where, str(e)[:200])
            continue
        yield doc


def _read_parquet(shard: Shard, report: ReadReport) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise InputError(f"'{shard.path}' is Parquet: pip install pyarrow") from e
    name = _rel_id(shard)
    with open_raw(shard.path) as raw:
        try:
            pf = pq.ParquetFile(raw)
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise DamagedInput(f"not a readable Parquet file ({e})") from e
        end = pf.num_row_groups if shard.end is None else min(shard.end, pf.num_row_groups)
        if "text" not in pf.schema_arrow.names:  # every row of it is unusable
            rows = sum(pf.metadata.row_group(rg).num_rows for rg in range(shard.start, end))
            if rows:
                report.add(shard.path, f"no 'text' column (columns: {pf.schema_arrow.names})",
                           count=rows)
            return
        for rg in range(shard.start, end):
            try:
                rows = pf.read_row_group(rg).to_pylist()
            except MalformedRecord:
                raise
            except Exception as e:  # a damaged row group: its rows are malformed
                report.add(f"{shard.path}:rowgroup{rg}", f"damaged row group ({e})"[:300],
                           count=max(1, pf.metadata.row_group(rg).num_rows))
                continue
            for i, record in enumerate(rows):
                try:
                    yield Document.from_dict(record, default_id=f"{name}/{rg}/{i}")
                except ValueError as e:
                    report.add(f"{shard.path}:rowgroup{rg}:row{i}", str(e))


def _read_text(shard: Shard, report: ReadReport, max_chars: int | None = None
               ) -> Iterator[Document]:
    """One document per file; binary content (a NUL byte or a known signature in its first
    bytes) is skipped and counted, never read as text. With `max_chars`, a file over that
    many characters is a `TooLong`: from its size alone when it is more than 4 bytes a
    character allows (never opened), else read in pieces and stopped past the limit, so
    memory stays bounded by the limit, not by the file."""
    rel = _rel_id(shard)
    meta = {"source": rel}
    if max_chars is not None and compression_of(shard.path) is None:
        size = file_size(shard.path)
        if size > 4 * max_chars:
            yield TooLong(id=rel, text="", metadata={**meta, "bytes": size, "read": False},
                          chars_at_least=-(-size // 4))
            return
    try:
        text = _decoded(shard.path, "strict", max_chars, report)
    except UnicodeDecodeError:  # text in another encoding: kept, the bytes replaced
        text = _decoded(shard.path, "replace", max_chars, report)
        if isinstance(text, str):
            report.note("files not valid UTF-8 (undecodable bytes replaced by U+FFFD)",
                        shard.path)
    if text is None:  # binary: skipped and counted
        return
    if isinstance(text, int):
        yield TooLong(id=rel, text="", metadata={**meta, "read": "partly"}, chars_at_least=text)
        return
    if shard.format == "html":
        from scaletrain.curate.io.warc import extract_html

        extracted = extract_html(text)
        if not extracted:
            report.add(shard.path, "no main text extracted from HTML")
            return
        text = extracted
    yield Document(id=rel, text=text, metadata=meta)


def _decoded(path: str, errors: str, max_chars: int | None, report: ReadReport
             ) -> str | int | None:
    """The file's text, decoded piece by piece; None for binary content (counted); the
    characters read so far (an int) once more than `max_chars` have been read."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    parts: list[str] = []
    n = 0
    with open_decompressed(path) as f:
        chunk = f.read(SNIFF_BYTES)
        if is_binary(chunk):
            report.skip("binary files", path)
            return None
        while True:
            piece = decoder.decode(chunk, final=not chunk)
            if piece:
                parts.append(piece)
                n += len(piece)
                if max_chars is not None and n > max_chars:
                    return n
            if not chunk:
                break
            chunk = f.read(_READ_BYTES)
    return "".join(parts)


def read_shard(shard: Shard, report: ReadReport | None = None, max_chars: int | None = None
               ) -> Iterator[Document]:
    """The documents of one shard, in file order. `max_chars`: a text file longer than that
    is a `TooLong` document (not read, or read only up to the limit).

    A file that cannot be read as its format (damaged from its first byte, not gzip, not
    Parquet) is one malformed record named by its path; the documents read before damage
    further in are kept. A binary file is skipped and counted (`report.skipped`)."""
    report = report if report is not None else ReadReport()
    fmt = shard.format
    if fmt in ("text", "prose", "html") and binary_suffix(shard.path):
        report.skip("binary files", shard.path)
        return
    try:
        if fmt == "jsonl":
            yield from _read_jsonl(shard, report)
        elif fmt == "parquet":
            yield from _read_parquet(shard, report)
        elif fmt in ("warc", "wet"):
            from scaletrain.curate.io.warc import read_warc

            yield from read_warc(shard.path, report)
        else:
            yield from _read_text(shard, report, max_chars if fmt != "html" else None)
    except MalformedRecord:
        raise
    except _DAMAGED_STREAM as e:  # damaged gzip/zstd stream, truncated or unreadable file
        what = str(e) if isinstance(e, DamagedInput) else f"{type(e).__name__}: {e}"
        report.add(shard.path, f"cannot read the file ({what}); check that it is complete "
                               "and its suffix matches its compression")


def _root_of(spec: str) -> str:
    """The directory part of a spec before any glob character ('' for a single file)."""
    if os.path.isdir(spec):
        return spec
    parts = Path(spec).parts
    for k, part in enumerate(parts):
        if any(c in part for c in "*?["):
            return str(Path(*parts[:k])) if k else ""
    return ""


def plan_shards(
    spec: str | list[str], target_bytes: int = 64 << 20, root: str | None = None
) -> list[Shard]:
    """Split the inputs into shards of about `target_bytes` (splittable files only).

    Uncompressed JSONL files are cut into byte ranges and Parquet files into row-group
    ranges; compressed JSONL, WARC and text files are one shard each. Ids of text files are
    their paths relative to `root` (default: the directory part of each spec).
    """
    specs = [spec] if isinstance(spec, str) else list(spec)
    shards: list[Shard] = []
    fixed_root = root
    for s in specs:
        root = fixed_root if fixed_root is not None else _root_of(s)
        for path in expand_inputs(s):
            fmt = sniff_format(path)
            size = file_size(path)
            if fmt == "jsonl" and compression_of(path) is None and size > target_bytes:
                n = -(-size // target_bytes)
                step = -(-size // n)
                shards += [Shard(path, a, min(a + step, size), root) for a in range(0, size, step)]
            elif fmt == "parquet" and size > target_bytes:
                shards += _parquet_shards(path, size, target_bytes, root)
            else:
                shards.append(Shard(path, root=root, fmt=fmt if fmt != format_of(path) else ""))
    return shards


def sniff_format(path: str) -> str:
    """`format_of(path)`, except that a `.json` file holding one JSON document (such as
    package.json) rather than JSON lines is 'text': one document, the file itself; and that
    a plain-text file (`.txt`, `.md`, ..., or no suffix) whose first bytes read as prose
    (`looks_like_prose`) is 'prose': it gets the rules for natural-language text."""
    fmt = format_of(path)
    if fmt == "text" and prose_candidate(path):
        try:
            with open_decompressed(path) as f:
                head = f.read(SNIFF_BYTES)
        except (*_DAMAGED_STREAM, InputError):
            return fmt  # unreadable: the reader names it
        prose = not is_binary(head) and looks_like_prose(head.decode("utf-8", "replace"))
        return "prose" if prose else fmt
    name = path.lower().removesuffix(".gz").removesuffix(".zst")
    if fmt != "jsonl" or not name.endswith(".json"):
        return fmt
    try:
        with open_decompressed(path) as f:
            return "jsonl" if json_kind(f) == "jsonl" else "text"
    except (*_DAMAGED_STREAM, InputError):
        return fmt  # unreadable: the JSONL reader names it


def _parquet_shards(path: str, size: int, target_bytes: int, root: str) -> list[Shard]:
    import pyarrow.parquet as pq

    with open_raw(path) as raw:
        n_groups = pq.ParquetFile(raw).num_row_groups
    per = max(1, round(n_groups * target_bytes / max(size, 1)))
    return [Shard(path, a, min(a + per, n_groups), root) for a in range(0, n_groups, per)]


def read_documents(spec: str | list[str], report: ReadReport | None = None) -> Iterator[Document]:
    """Every document of a file, a directory or a glob (JSONL, Parquet, WARC, text)."""
    for shard in plan_shards(spec, target_bytes=1 << 62):
        yield from read_shard(shard, report)


__all__ = ["MAX_EXAMPLES", "MalformedRecord", "ReadReport", "Shard", "TooLong", "json_records",
           "plan_shards", "read_documents", "read_shard", "sniff_format"]
