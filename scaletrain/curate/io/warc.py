"""WARC and WET -> Documents: HTML responses (main text extracted by trafilatura) and WET
`conversion` records (Common Crawl's extracted text, used as it is)."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from scaletrain.curate.documents import Document
from scaletrain.curate.io.paths import InputError, file_size, open_raw
from scaletrain.curate.io.warc_stream import (
    DecompressedStream,
    StreamCut,
    captured_stderr,
    one_line,
    one_stream,
)
from scaletrain.optional import require

if TYPE_CHECKING:
    from scaletrain.curate.io.read_report import ReadReport

log = logging.getLogger(__name__)


def _require(name: str) -> Any:
    return require(name, f"reading WARC needs {name}: pip install 'scaletrain[curate]'",
                   InputError)


def extract_html(html: str | bytes, url: str | None = None) -> str | None:
    """The main text of an HTML page (boilerplate, menus and ads removed), or None."""
    trafilatura = _require("trafilatura")
    return trafilatura.extract(html, url=url, include_comments=False, include_tables=True)


NOT_DOCUMENTS = "WARC records that are not HTML responses or WET conversions"
EMPTY_WET = "WET conversion records without text"


def read_warc(path: str, report: ReadReport) -> Iterator[Document]:
    """One document per HTML `response` record whose main text is not empty, and one per
    WET `conversion` record (Common Crawl's extracted plain text, used as it is) with text.

    Every record is accounted for once. Records that are neither (requests, metadata,
    images, warcinfo) are skipped and counted. A response whose extraction fails or is
    empty, a record shorter than its Content-Length (a truncated file), a record whose
    headers cannot be parsed, a record warcio warns about (its Content-Length does not end
    it) and bytes after the last whole record are malformed records named with the file and
    byte offset (`FILE@OFFSET`; for .warc.gz the offset of the record's gzip member); the
    documents before them are kept and the rest of a damaged file is skipped (its records
    cannot be found without their lengths). A .warc.gz gzipped as one stream (`gzip x.warc`)
    is read record by record from its decompressed bytes; its offsets are positions in them.
    """
    _require("warcio")
    from warcio.archiveiterator import ArchiveIterator

    whole = False
    if path.endswith(".gz"):
        with open_raw(path) as raw:
            whole = one_stream(raw)
    if whole:
        log.info("%s is gzipped as one stream: read from its decompressed bytes (`warcio "
                 "recompress` makes it one gzip member per record, seekable)", path)
    at = " (an offset in the decompressed bytes: the file is gzipped as one stream)" if whole \
        else ""
    end, size = 0, file_size(path)
    with DecompressedStream(open_raw(path)) if whole else open_raw(path) as stream:
        it = ArchiveIterator(stream)
        while True:
            with captured_stderr() as err:
                try:
                    record = next(it)
                    doc, problem = _record_document(path, record)
                    offset = it.get_record_offset()  # reads to the record's end (warcio)
                    length = it.get_record_length()
                except StopIteration:
                    break
                except InputError:  # a missing dependency; strict mode's first malformed one
                    raise
                except Exception as e:  # warcio raises many types (even AttributeError)
                    what = ("the gzip stream ends early or is damaged" if isinstance(e, StreamCut)
                            else "not a WARC file" if end == 0 else "damaged record")
                    warned = f"; warcio: {one_line(err.getvalue())}" if err.getvalue() else ""
                    report.add(f"{path}@{end}", f"{what} ({type(e).__name__}: {e})"[:300] +
                               warned + at + "; the rest of the file is skipped")
                    return
            if not (record.rec_headers.get_header("Content-Length") or "").strip().isdigit():
                report.add(f"{path}@{offset}", "a record without a Content-Length (mandatory in "
                                               "WARC): its headers are cut short or damaged" + at)
                return
            missing = getattr(record.raw_stream, "limit", 0)
            if not whole and not missing and (offset + length > size or (
                    offset + length == size and not _ends_whole(path, offset))):
                short = offset + length - size
                gone = f"{short} bytes of its end" if short > 0 else "the end of its gzip member"
                report.add(f"{path}@{offset}", f"the file ends inside a {record.rec_type} "
                                               f"record ({gone} missing); it is truncated")
                return
            if missing:
                report.add(f"{path}@{offset}", f"truncated {record.rec_type} record: "
                                               f"{missing} bytes of its content are missing" + at)
                return
            end = offset + length
            if err.getvalue():  # warcio's warning about this record, instead of stderr
                report.add(f"{path}@{offset}", f"warcio: {one_line(err.getvalue())}" + at)
            elif problem:
                report.add(f"{path}@{offset} {doc.id if doc else ''}".rstrip(), problem)
            elif doc is not None:
                yield doc
            else:
                report.skip(EMPTY_WET if record.rec_type == "conversion" else NOT_DOCUMENTS,
                            f"{path}@{offset}")
    if not whole:
        _check_tail(path, end, report)


def _record_document(path: str, record: Any) -> tuple[Document | None, str | None]:
    """(the record's document, None), (None, None) for a record that is not a document
    (not an HTML response nor a WET conversion with text), or (a document without text,
    what went wrong)."""
    if record.rec_type == "conversion":
        return _conversion_document(path, record)
    if record.rec_type != "response" or record.http_headers is None:
        return None, None
    ctype = record.http_headers.get_header("Content-Type") or ""
    if "html" not in ctype.lower():
        return None, None
    doc = _new_document(path, record)
    body = record.content_stream().read()
    if getattr(record.raw_stream, "limit", 0):
        return None, None  # truncated: reported by the caller
    try:
        text = extract_html(body, url=doc.metadata["url"])
    except Exception as e:  # an extractor failure is one bad record, not a crash
        return doc, f"HTML extraction failed: {e}"
    if not text:
        return doc, "no main text extracted"
    doc.text = text
    return doc, None


def _conversion_document(path: str, record: Any) -> tuple[Document | None, str | None]:
    """A WET record: the page's text as Common Crawl extracted it (no HTML extraction)."""
    body = record.content_stream().read()
    if getattr(record.raw_stream, "limit", 0):
        return None, None  # truncated: reported by the caller
    text = body.decode("utf-8", errors="replace").strip()
    if not text:
        return None, None
    doc = _new_document(path, record)
    doc.text = text
    lang = record.rec_headers.get_header("WARC-Identified-Content-Language")
    if lang:
        doc.metadata["content_languages"] = lang
    return doc, None


def _new_document(path: str, record: Any) -> Document:
    rid = record.rec_headers.get_header("WARC-Record-ID") or ""
    url = record.rec_headers.get_header("WARC-Target-URI")
    meta = {
        "url": url,
        "date": record.rec_headers.get_header("WARC-Date"),
        "warc_file": path.rsplit("/", 1)[-1],
    }
    return Document(id=rid.strip("<>") or f"{path}:{url}", text="", metadata=meta)


def _ends_whole(path: str, offset: int) -> bool:
    """For a .warc.gz, whether the gzip member from `offset` to the end of the file is whole
    (warcio reads a member that lacks its last bytes without a word). True for a .warc."""
    if not path.endswith(".gz"):
        return True
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    with open_raw(path) as raw:
        raw.seek(offset)
        while not d.eof:
            chunk = raw.read(1 << 16)
            if not chunk:
                return False
            d.decompress(chunk)
    return True


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
