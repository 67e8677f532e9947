"""WARC -> Documents: HTTP responses with HTML, main text extracted by trafilatura."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from scaletrain.curate.documents import Document
from scaletrain.curate.io.paths import InputError, file_size, open_raw
from scaletrain.optional import require

if TYPE_CHECKING:
    from scaletrain.curate.io.readers import ReadReport

log = logging.getLogger("scaletrain.curate.io")


def _require(name: str) -> Any:
    return require(name, f"reading WARC needs {name}: pip install 'scaletrain[curate]'",
                   InputError)


def extract_html(html: str | bytes, url: str | None = None) -> str | None:
    """The main text of an HTML page (boilerplate, menus and ads removed), or None."""
    trafilatura = _require("trafilatura")
    return trafilatura.extract(html, url=url, include_comments=False, include_tables=True)


def read_warc(path: str, report: ReadReport) -> Iterator[Document]:
    """One document per HTML `response` record whose main text is not empty.

    Records that are not HTTP responses with an HTML content type (requests, metadata,
    images) are skipped silently. A response whose extraction fails or is empty, a record
    shorter than its Content-Length (a truncated file), a damaged record and bytes after the
    last whole record are counted as malformed with the file and byte offset (`FILE@OFFSET`;
    for .warc.gz the offset of the record's gzip member); the documents before them are kept.
    """
    _require("warcio")
    from warcio.archiveiterator import ArchiveIterator

    records, end = 0, 0
    with open_raw(path) as raw:
        it = ArchiveIterator(raw)
        try:
            for record in it:
                records += 1
                doc, problem = _response_document(path, record)
                offset = it.get_record_offset()  # reads to the record's end (warcio)
                missing = getattr(record.raw_stream, "limit", 0)
                if missing:
                    report.add(f"{path}@{offset}", f"truncated {record.rec_type} record: "
                                                   f"{missing} bytes of its content are missing")
                    return
                if problem:
                    report.add(f"{path}@{offset} {doc.id if doc else ''}".rstrip(), problem)
                elif doc is not None:
                    yield doc
                end = offset + it.get_record_length()
        except Exception as e:
            if type(e).__name__ not in _DAMAGED and not isinstance(e, (OSError, EOFError)):
                raise
            if records == 0:
                raise InputError(f"'{path}' is not a readable WARC file: {e}") from e
            report.add(f"{path}@{end}", f"damaged record ({type(e).__name__}: {e}); "
                                        "the rest of the file is skipped")
            return
    _check_tail(path, end, report)


_DAMAGED = ("ArchiveLoadFailed", "StatusAndHeadersParserException", "error")  # zlib.error


def _response_document(path: str, record: Any) -> tuple[Document | None, str | None]:
    """(the page's document, None), (None, None) for a record that is not an HTML response,
    or (a document without text, what went wrong)."""
    if record.rec_type != "response" or record.http_headers is None:
        return None, None
    ctype = record.http_headers.get_header("Content-Type") or ""
    if "html" not in ctype.lower():
        return None, None
    rid = record.rec_headers.get_header("WARC-Record-ID") or ""
    url = record.rec_headers.get_header("WARC-Target-URI")
    meta = {
        "url": url,
        "date": record.rec_headers.get_header("WARC-Date"),
        "warc_file": path.rsplit("/", 1)[-1],
    }
    doc = Document(id=rid.strip("<>") or f"{path}:{url}", text="", metadata=meta)
    body = record.content_stream().read()
    if getattr(record.raw_stream, "limit", 0):
        return None, None  # truncated: reported by the caller
    try:
        text = extract_html(body, url=url)
    except Exception as e:  # an extractor failure is one bad record, not a crash
        return doc, f"HTML extraction failed: {e}"
    if not text:
        return doc, "no main text extracted"
    doc.text = text
    return doc, None


def _check_tail(path: str, end: int, report: ReadReport) -> None:
    """Bytes after the last whole record (other than the blank-line separator) are a record
    cut short: the iterator ends there without a word."""
    size = file_size(path)
    if size <= end:
        return
    with open_raw(path) as raw:
        raw.seek(end)
        tail = raw.read(min(size - end, 1 << 16))
    if tail.strip():
        report.add(f"{path}@{end}", f"the file ends inside a record ({size - end} bytes that "
                                    "are not a whole record); it is truncated")
