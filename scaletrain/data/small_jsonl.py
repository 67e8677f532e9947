"""A fast path for the many small, clean, uncompressed JSON-lines files of a crawl.

Reading a file through the general reader (`json_records`: a buffered stream, a generator and
a place name per line) costs about 10 us per file before its first byte, which 100,000
one-line files notice more than their tokens. Here a small local `.jsonl`/`.ndjson` file is
read in one `read` and its lines parsed in a loop; its size and modification time come
from the open file (`fstat`) unless the caller has them.

Only a clean file takes this path: every non-blank line valid UTF-8, a JSON object with a
string `text_key`. Anything else (a bad line, a missing field, a file that cannot be opened
or is larger than `SMALL_FILE_BYTES`) returns None and the caller reads the file through the
general reader, which counts and names the problem exactly as it always has; so the records,
counts and messages are the same whichever path a file takes.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

SMALL_FILE_BYTES = 1 << 20
PLAIN_JSONL = (".jsonl", ".ndjson")
_ASCII_SPACE = " \t\n\r\x0b\x0c"  # what bytes.strip() strips (str.strip() strips more)
_BOM = b"\xef\xbb\xbf"
_JSON_SPACE = " \t\n\r"  # what json.loads allows around a value
_scan_once = json.decoder.JSONDecoder().scan_once  # json.loads = this + the checks below
_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


class SmallFile(NamedTuple):
    texts: list[str]  # the non-empty texts, in file order
    empty: int  # records with an empty text
    size: int
    mtime_ns: int


def read_small_jsonl(path: str, text_key: str, size: int = -1, mtime_ns: int = -1
                     ) -> SmallFile | None:
    """The texts of a small, clean, local, uncompressed JSON-lines file, or None when the
    file is not one (the general reader then reads it and names what is wrong). `size` and
    `mtime_ns`: as the caller's `stat` found them; if not known (-1), from the open file."""
    if size > SMALL_FILE_BYTES or not path.endswith(PLAIN_JSONL):
        return None
    try:
        fd = os.open(path, _O_FLAGS)
    except OSError:
        return None
    try:
        if size < 0:
            st = os.fstat(fd)
            size, mtime_ns = st.st_size, st.st_mtime_ns
            if size > SMALL_FILE_BYTES:
                return None
        data = os.read(fd, size + 1)  # one byte more: a file that grew is seen
        while len(data) < size:  # a short read (rare); b"" at the end of the file
            more = os.read(fd, size + 1 - len(data))
            if not more:
                break
            data += more
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) != size or data.startswith(_BOM):
        return None  # changed since its stat; or a BOM, which the general reader strips
    try:  # valid UTF-8 as a whole <=> every line is (b"\n" is never inside a character)
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    texts: list[str] = []
    empty = 0
    for line in text.split("\n"):
        if not line.strip(_ASCII_SPACE):
            continue  # a blank line, skipped by the general reader too
        record = _json_object(line)
        if record is None:
            return None
        t = record.get(text_key)
        if type(t) is not str:
            return None
        if t:
            texts.append(t)
        else:
            empty += 1
    return SmallFile(texts, empty, size, mtime_ns)


def _json_object(line: str) -> dict | None:
    """`json.loads(line)` when that is a JSON object, else None; without its per-call
    layers (a third of the cost of a one-line file) where the line starts with the value."""
    try:
        if line[0] in _JSON_SPACE:
            record = json.loads(line)
        else:
            record, end = _scan_once(line, 0)
            if end != len(line) and line[end:].strip(_JSON_SPACE):
                return None  # extra data after the value
    except (ValueError, StopIteration):  # StopIteration: no JSON value at the start
        return None
    return record if type(record) is dict else None
