"""Crawl files as Common Crawl ships them: WET files (`conversion` records of extracted text)
under CC's names or named `.warc.gz`, and WARCs gzipped as one stream (`gzip x.warc`), read
record by record with exact counts and nothing from warcio on stderr."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
from pathlib import Path

import pytest

from scaletrain.commands import data as data_cmd
from scaletrain.curate.io.paths import format_of
from scaletrain.curate.io.read_report import ReadReport
from scaletrain.curate.io.readers import read_documents
from tests.helpers.curate import fixture_dir, read_output
from tests.helpers.wet import fixture_pages, write_wet


def _curate(inputs: list[Path], out: Path) -> tuple[dict, str, list[dict]]:
    argv = ["curate", "--input", *map(str, inputs), "--output", str(out), "--workers", "1",
            "--json"]
    err, std = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        assert data_cmd.main(argv) == 0, err.getvalue()
    return json.loads(std.getvalue()), err.getvalue(), read_output(out)


@pytest.fixture(scope="module")
def crawl(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fixtures' WARCs curated, and a WET file of the same pages (their text as the
    WARC reader extracts it) curated under CC's name and under a `.warc.gz` name."""
    base = tmp_path_factory.mktemp("wet")
    warcs = sorted(fixture_dir().glob("*.warc.gz"))
    pages = fixture_pages(warcs)
    wet = write_wet(base / "CC-MAIN-20240101-00000.warc.wet.gz", pages)
    as_warc = base / "conversions.warc.gz"
    as_warc.write_bytes(wet.read_bytes())
    return {"pages": pages, "warc": _curate(warcs, base / "out_warc"),
            "wet": _curate([wet], base / "out_wet"),
            "wet_as_warc": _curate([as_warc], base / "out_wet_as_warc")}


def test_cc_names_are_wet_not_source_code() -> None:
    for name in ("CC-MAIN-x.warc.wet.gz", "x.wet.gz", "x.wet", "X.WARC.WET.GZ"):
        assert format_of(name) == "wet", name
    assert format_of("x.warc.gz") == "warc" and format_of("notes.txt") == "text"


@pytest.mark.parametrize("name", ["wet", "wet_as_warc"])
def test_wet_curates_to_the_documents_of_the_html_extraction(crawl: dict, name: str) -> None:
    (warc, _, warc_docs), (wet, log, wet_docs) = crawl["warc"], crawl[name]
    pages = [p for p in crawl["pages"] if p["text"]]
    assert wet["docs_in"] == warc["docs_in"] == len(pages) > 30
    assert sorted(d["metadata"]["url"] for d in wet_docs) == \
        sorted(d["metadata"]["url"] for d in warc_docs)
    assert wet["kept"] == warc["kept"] > 0 and wet["dropped"] == warc["dropped"]
    # the same filters ran on the WET text (not skipped because it is already text)
    assert [s["name"] for s in wet["steps"]] == [s["name"] for s in warc["steps"]]
    assert wet["steps"][0]["seen"] == len(pages)
    dates = {(p["url"], p["date"]) for p in pages}
    for d in wet_docs:  # the record's URL and date
        assert (d["metadata"]["url"], d["metadata"]["date"]) in dates
    # the text used as it is (no extraction), then the same rules: the same kept texts
    assert sorted(d["text"] for d in wet_docs) == sorted(d["text"] for d in warc_docs)
    # the WET file's warcinfo record and its empty conversion records are skipped, counted
    assert wet["input_records"] == 1 + len(crawl["pages"]) == wet["kept"] + wet["dropped"] + \
        wet["skipped"] + wet["malformed"]
    if name == "wet":
        assert "web rules for 1 wet files" in log


def test_one_stream_gzip_warc_read_record_by_record(tmp_path: Path,
                                                    capfd: pytest.CaptureFixture) -> None:
    from warcio.archiveiterator import ArchiveIterator

    for src in sorted(fixture_dir().glob("*.warc.gz")):
        with open(src, "rb") as f:
            records = [(r.rec_type, r.rec_headers.get_header("WARC-Target-URI"))
                       for r in ArchiveIterator(f)]
        whole = tmp_path / f"onestream-{src.name}"
        whole.write_bytes(gzip.compress(gzip.decompress(src.read_bytes())))  # `gzip x.warc`
        capfd.readouterr()
        got, expected = ReadReport(), ReadReport()
        docs = list(read_documents(str(whole), got))
        assert capfd.readouterr().err == ""  # no warcio warning, no malformed record logged
        want = list(read_documents(str(src), expected))
        assert [d.metadata["url"] for d in docs] == [d.metadata["url"] for d in want]
        responses = sum(t == "response" for t, _ in records)
        assert len(docs) + got.malformed == responses and got.malformed == 0
        assert len(docs) + got.malformed + got.skipped_total == len(records)


def test_one_stream_gzip_cut_short_is_named_without_negative_offsets(tmp_path: Path) -> None:
    src = fixture_dir() / "cc_sample-0000.warc.gz"
    data = gzip.compress(gzip.decompress(src.read_bytes()))
    for cut in (len(data) // 3, len(data) - 20):
        path = tmp_path / f"cut-{cut}.warc.gz"
        path.write_bytes(data[:cut])
        report = ReadReport()
        docs = list(read_documents(str(path), report))
        assert report.malformed == 1 and 0 < len(docs) < 22
        where = report.examples[0].split(": ", 1)[0]
        assert int(where.rsplit("@", 1)[1]) >= 0
        assert "ends early" in report.examples[0]


def test_curate_counts_a_one_stream_warc_exactly(tmp_path: Path) -> None:
    src = fixture_dir() / "cc_sample-0000.warc.gz"
    whole = tmp_path / "in" / "onestream-0000.warc.gz"
    whole.parent.mkdir()
    whole.write_bytes(gzip.compress(gzip.decompress(src.read_bytes())))
    summary, log, _ = _curate([whole], tmp_path / "out")
    assert summary["input_records"] == 48 and summary["docs_in"] == 22  # 22 HTML responses
    assert summary["malformed"] == 0 and "WARNING" not in log and "recompress" not in log
