"""WARC -> Documents: HTTP responses with HTML, main text extracted by trafilatura."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from scaletrain.curate.documents import Document
from scaletrain.curate.io.paths import InputError, file_size, open_raw
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


def read_warc(path: str, report: ReadReport) -> Iterator[Document]:
    """One document per HTML `response` record whose main text is not empty.

    Every record is accounted for once. Records that are not HTTP responses with an HTML
    content type (requests, metadata, images) are skipped and counted. A response whose
    extraction fails or is empty, a record shorter than its Content-Length (a truncated
    file), a record whose headers cannot be parsed and bytes after the last whole record are
    malformed records named with the file and byte offset (`FILE@OFFSET`; for .warc.gz the
    offset of the record's gzip member); the documents before them are kept and the rest
    of a damaged file is skipped (its records cannot be found without their lengths).
    """
    _require("warcio")
    from warcio.archiveiterator import ArchiveIterator

    end, size = 0, file_size(path)
    with open_raw(path) as raw:
        it = ArchiveIterator(raw)
        while True:
            try:
                record = next(it)
                doc, problem = _response_document(path, record)
                offset = it.get_record_offset()  # reads to the record's end (warcio)
                length = it.get_record_length()
            except StopIteration:
                break
            except InputError:  # a missing dependency; strict mode's first malformed record
                raise
            except Exception as e:  # warcio raises many types (even AttributeError) on damage
                what = "not a WARC file" if end == 0 else "damaged record"
                report.add(f"{path}@{end}", f"{what} ({type(e).__name__}: {e})"[:300] +
                           "; the rest of the file is skipped")
                return
            if not (record.rec_headers.get_header("Content-Length") or "").strip().isdigit():
                report.add(f"{path}@{offset}", "a record without a Content-Length (mandatory "
                                               "in WARC): its headers are cut short or damaged")
                return
            missing = getattr(record.raw_stream, "limit", 0)
            if not missing and (offset + length > size or (
                    offset + length == size and not _ends_whole(path, offset))):
                short = offset + length - size
                gone = f"{short} bytes of its end" if short > 0 else "the end of its gzip member"
                report.add(f"{path}@{offset}", f"the file ends inside a {record.rec_type} "
                                               f"record ({gone} missing); it is truncated")
                return
            if missing:
                report.add(f"{path}@{offset}", f"truncated {record.rec_type} record: "
                                               f"{missing} bytes of its content are missing")
                return
            if problem:
                report.add(f"{path}@{offset} {doc.id if doc else ''}".rstrip(), problem)
            elif doc is not None:
                yield doc
            else:
                report.skip("WARC records that are not HTML responses", f"{path}@{offset}")
            end = offset + length
    _check_tail(path, end, report)


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
