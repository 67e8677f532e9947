"""Readers: JSON lines (plain/.gz/.zst), Parquet, text/source files and WARC -> Documents.

`read_documents(path_or_glob)` is the simple public entry point. Executors read `Shard`s: a
file or a part of one (a byte range of an uncompressed JSONL file, a range of Parquet row
groups), so one large file is not one task. A malformed record is counted in a `ReadReport`
with its file and line and skipped; a file that cannot be opened raises `InputError`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.curate.documents import Document
from scaletrain.curate.io.paths import (
    InputError,
    compression_of,
    expand_inputs,
    file_size,
    format_of,
    open_decompressed,
    open_raw,
)

log = logging.getLogger("scaletrain.curate.io")

try:  # a damaged .zst stream raises zstandard's own error type
    from zstandard import ZstdError as _ZstdError
except ImportError:  # pragma: no cover - zstandard is optional
    _ZstdError = OSError  # type: ignore[assignment,misc]

MAX_EXAMPLES = 20  # malformed records kept (file:line + message) for the report


@dataclass(frozen=True)
class Shard:
    """A whole file (`start == 0`, `end is None`) or a part of one.

    For JSONL the part is a byte range: the records whose first byte lies in [start, end).
    For Parquet it is a range of row groups. `root` is the input directory the file was
    found under (ids of text files are paths relative to it).
    """

    path: str
    start: int = 0
    end: int | None = None
    root: str = ""

    @property
    def format(self) -> str:
        return format_of(self.path)


class MalformedRecord(InputError):
    """A malformed record met in strict mode; the message is `FILE:LINE: what is wrong`."""


@dataclass
class ReadReport:
    """Malformed records seen while reading: counted, skipped and named (file and line or
    byte offset). With `strict`, the first one raises `MalformedRecord` with the same text."""

    malformed: int = 0
    examples: list[str] = field(default_factory=list)
    strict: bool = False
    empty: int = 0  # well-formed records with an empty text (tokenize skips them)

    def add(self, where: str, message: str) -> None:
        if self.strict:
            raise MalformedRecord(f"{where}: {message}")
        self.malformed += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {message}")
        # the first ones are logged; the rest only counted (a file that is not JSON lines
        # at all would otherwise log one line per line of it)
        if self.malformed <= MAX_EXAMPLES:
            log.warning("skipping malformed record at %s: %s", where, message)
        elif self.malformed == MAX_EXAMPLES + 1:
            log.warning("more malformed records (from %s on) are counted, not logged",
                        where)

    def merge(self, other: ReadReport) -> None:
        self.malformed += other.malformed
        self.empty += other.empty
        self.examples = (self.examples + other.examples)[:MAX_EXAMPLES]


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
            raise InputError(f"cannot read Parquet file '{shard.path}': {e}") from e
        if "text" not in pf.schema_arrow.names:
            raise InputError(
                f"'{shard.path}' has no 'text' column (columns: {pf.schema_arrow.names})"
            )
        end = pf.num_row_groups if shard.end is None else min(shard.end, pf.num_row_groups)
        for rg in range(shard.start, end):
            rows = pf.read_row_group(rg).to_pylist()
            for i, record in enumerate(rows):
                try:
                    yield Document.from_dict(record, default_id=f"{name}/{rg}/{i}")
                except ValueError as e:
                    report.add(f"{shard.path}:rowgroup{rg}:row{i}", str(e))


def _read_text(shard: Shard, report: ReadReport) -> Iterator[Document]:
    with open_decompressed(shard.path) as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        report.add(shard.path, "not valid UTF-8; undecodable bytes replaced by U+FFFD")
    rel = _rel_id(shard)
    if shard.format == "html":
        from scaletrain.curate.io.warc import extract_html

        extracted = extract_html(text)
        if not extracted:
            report.add(shard.path, "no main text extracted from HTML")
            return
        text = extracted
    yield Document(id=rel, text=text, metadata={"source": rel})


def read_shard(shard: Shard, report: ReadReport | None = None) -> Iterator[Document]:
    """The documents of one shard, in file order."""
    report = report if report is not None else ReadReport()
    fmt = shard.format
    try:
        if fmt == "jsonl":
            yield from _read_jsonl(shard, report)
        elif fmt == "parquet":
            yield from _read_parquet(shard, report)
        elif fmt == "warc":
            from scaletrain.curate.io.warc import read_warc

            yield from read_warc(shard.path, report)
        else:
            yield from _read_text(shard, report)
    except InputError:
        raise
    except (OSError, EOFError, _ZstdError) as e:  # damaged gzip/zstd stream, truncated file
        raise InputError(
            f"cannot read '{shard.path}' ({type(e).__name__}: {e}); check that the file is "
            "complete and its suffix matches its compression"
        ) from e


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
            fmt = format_of(path)
            size = file_size(path)
            if fmt == "jsonl" and compression_of(path) is None and size > target_bytes:
                n = -(-size // target_bytes)
                step = -(-size // n)
                shards += [Shard(path, a, min(a + step, size), root) for a in range(0, size, step)]
            elif fmt == "parquet" and size > target_bytes:
                shards += _parquet_shards(path, size, target_bytes, root)
            else:
                shards.append(Shard(path, root=root))
    return shards


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
