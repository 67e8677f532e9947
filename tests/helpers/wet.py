"""WET files made from the fixtures' WARC pages, as Common Crawl writes them: a `warcinfo`
record, then one `conversion` record (text/plain, the page's extracted text) per HTML
response, with the response's URL, date and record id (`WARC-Refers-To`)."""

from __future__ import annotations

import io
from pathlib import Path


def fixture_pages(warcs: list[Path]) -> list[dict[str, str]]:
    """Every HTML response of the WARC files, in order: url, date, id and the text the
    WARC reader extracts from it ('' where it extracts none)."""
    from warcio.archiveiterator import ArchiveIterator

    from scaletrain.curate.io.warc import extract_html

    pages = []
    for path in warcs:
        with open(path, "rb") as f:
            for r in ArchiveIterator(f):
                if r.rec_type != "response" or r.http_headers is None:
                    continue
                if "html" not in (r.http_headers.get_header("Content-Type") or "").lower():
                    continue
                url = r.rec_headers.get_header("WARC-Target-URI")
                pages.append({"url": url, "date": r.rec_headers.get_header("WARC-Date"),
                              "id": r.rec_headers.get_header("WARC-Record-ID"),
                              "text": extract_html(r.content_stream().read(), url=url) or ""})
    return pages


def write_wet(path: Path, pages: list[dict[str, str]], gz: bool = True) -> Path:
    """A WET file of the pages (one gzip member per record when `gz`)."""
    from warcio.warcwriter import WARCWriter

    buf = io.BytesIO()
    w = WARCWriter(buf, gzip=gz, warc_version="1.0")
    info = w.create_warcinfo_record(path.name, {"software": "tests/helpers/wet.py",
                                                "description": "Wet files from fixtures"})
    w.write_record(info)
    for p in pages:
        w.write_record(w.create_warc_record(
            p["url"], "conversion", payload=io.BytesIO(p["text"].encode("utf-8")),
            warc_content_type="text/plain",
            warc_headers_dict={"WARC-Date": p["date"], "WARC-Refers-To": p["id"],
                               "WARC-Identified-Content-Language": "eng"}))
    path.write_bytes(buf.getvalue())
    return path
