"""WARC -> Documents: HTTP responses with HTML, main text extracted by trafilatura."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from scaletrain.data.documents import Document
from scaletrain.data.io.paths import InputError, open_raw
from scaletrain.data.optional import require

if TYPE_CHECKING:
    from scaletrain.data.io.readers import ReadReport

log = logging.getLogger("scaletrain.data.io")


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
    images) are skipped silently; a response whose extraction fails or is empty is counted
    as malformed with its record id.
    """
    warcio = _require("warcio")
    from warcio.archiveiterator import ArchiveIterator

    del warcio
    with open_raw(path) as raw:
        try:
            for record in ArchiveIterator(raw):
                if record.rec_type != "response" or record.http_headers is None:
                    continue
                ctype = record.http_headers.get_header("Content-Type") or ""
                if "html" not in ctype.lower():
                    continue
                rid = record.rec_headers.get_header("WARC-Record-ID") or ""
                url = record.rec_headers.get_header("WARC-Target-URI")
                body = record.content_stream().read()
                try:
                    text = extract_html(body, url=url)
                except Exception as e:  # an extractor failure is one bad record, not a crash
                    report.add(f"{path}:{rid}", f"HTML extraction failed: {e}")
                    continue
                if not text:
                    report.add(f"{path}:{rid}", "no main text extracted")
                    continue
                meta = {
                    "url": url,
                    "date": record.rec_headers.get_header("WARC-Date"),
                    "warc_file": path.rsplit("/", 1)[-1],
                }
                yield Document(id=rid.strip("<>") or f"{path}:{url}", text=text, metadata=meta)
        except Exception as e:
            if type(e).__name__ == "ArchiveLoadFailed":
                raise InputError(f"'{path}' is not a readable WARC file: {e}") from e
            raise
