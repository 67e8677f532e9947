"""How a WARC file's bytes reach warcio: per-record gzip members, or one gzip stream.

A `.warc.gz` is meant to hold one gzip member per record (so a reader can seek to a record).
A WARC gzipped as a whole (`gzip x.warc`) is one stream: warcio reads its first record, then
fails ("non-chunked gzip") and loses the rest. `one_stream(path)` finds such a file from its
first record; `DecompressedStream` gives warcio its decompressed bytes, so it reads them as
an uncompressed WARC, record by record (offsets are then positions in the decompressed
bytes). warcio writes warnings (a record not followed by a blank line) to stderr;
`captured_stderr` collects them, so the reader can report them as malformed records.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import re
import sys
import zlib
from collections.abc import Iterator
from typing import IO

_CHUNK = 1 << 16
_LENGTH = re.compile(rb"\r?\nContent-Length:[ \t]*(\d+)", re.IGNORECASE)


class StreamCut(Exception):  # noqa: N818 - named for what it means
    """The gzip stream ends early or is damaged (raised through warcio, which would
    otherwise read an `EOFError` as the end of the file and stop without a word)."""


class DecompressedStream:
    """The decompressed bytes of a gzip file (one stream or several members) for warcio:
    `read`, `tell` and `close`; a cut or damaged stream raises `StreamCut`."""

    def __init__(self, raw: IO[bytes]):
        self._raw = raw
        self._gz = gzip.GzipFile(fileobj=raw)

    def read(self, n: int = -1) -> bytes:
        try:
            return self._gz.read(n)
        except (EOFError, OSError, zlib.error) as e:
            raise StreamCut(f"{type(e).__name__}: {e}") from e

    def tell(self) -> int:
        return self._gz.tell()

    def close(self) -> None:
        self._gz.close()
        self._raw.close()

    def __enter__(self) -> DecompressedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def one_stream(raw: IO[bytes]) -> bool:
    """True when the first gzip member of `raw` goes on after its first WARC record (the
    file is gzipped as one stream). Reads the first record only; False for anything that
    is not gzip or whose first record cannot be found (the reader then names the problem)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = b""
    need: int | None = None  # bytes of the first record plus its blank-line separator
    try:
        while True:
            chunk = raw.read(_CHUNK)
            if not chunk:
                return False  # the member ends with the file: at most one record in it
            out += d.decompress(chunk)
            if need is None:
                head = out.find(b"\r\n\r\n")
                if head < 0:
                    if len(out) > (1 << 20):
                        return False  # no record header in the first MiB
                    continue
                m = _LENGTH.search(out, 0, head + 2)
                if m is None:
                    return False
                need = head + 4 + int(m.group(1)) + 4
            if d.eof:
                return len(out) > need and bool(out[need:].strip())
            if len(out) > need and out[need:].strip():
                return True  # the same member holds more than the first record
            if len(out) >= need + 64:
                return False
    except zlib.error:
        return False


@contextlib.contextmanager
def captured_stderr() -> Iterator[io.StringIO]:
    """What is written to `sys.stderr` inside the block (warcio's warnings), kept off it.
    Worker processes read one file at a time, so the swap is not shared with other code."""
    buf = io.StringIO()
    old, sys.stderr = sys.stderr, buf
    try:
        yield buf
    finally:
        sys.stderr = old


def one_line(text: str, limit: int = 240) -> str:
    """A multi-line warning as one line."""
    return " ".join(text.split())[:limit]


__all__ = ["DecompressedStream", "StreamCut", "captured_stderr", "one_line", "one_stream"]
