"""Damaged input is counted, named and skipped, never a run-ending traceback: a WARC cut at
every byte position (gzip and plain), files that are not what their suffix says, binary
files, and runs where nothing is readable (exit 2, one line). Every run accounts for each
input record once: kept + dropped + malformed + skipped = input records."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
from pathlib import Path

import pytest

from scaletrain.commands import data as data_cmd
from scaletrain.curate.io import warc as warc_mod
from scaletrain.curate.io.read_report import MalformedRecord, ReadReport
from scaletrain.curate.io.readers import Shard, read_documents, read_shard
from scaletrain.curate.io.sniff import is_binary
from tests.helpers.curate import fixture_dir, read_output, write_jsonl


def _real_records(n_html: int = 2) -> list[tuple[str, dict, bytes, object]]:
    """(type, WARC headers, payload, HTTP headers) of the fixture's first records: its
    warcinfo, a request, and the start of real HTML pages."""
    from warcio.archiveiterator import ArchiveIterator

    out: list[tuple[str, dict, bytes, object]] = []
    html = 0
    with open(fixture_dir() / "cc_sample-0000.warc.gz", "rb") as f:
        for r in ArchiveIterator(f):
            body = r.content_stream().read()
            heads = dict(r.rec_headers.headers)
            if r.rec_type == "response":
                if html == n_html:
                    break
                html += 1
                body = body[:150] + b"</p></body></html>"  # a real page's start, kept small
            elif len(body) > 400 or (r.rec_type == "request" and html):
                continue
            out.append((r.rec_type, heads, body, r.http_headers))
    return out


def _small_warc(gz: bool) -> bytes:
    """A small WARC of real records: warcinfo, request, HTML response, an image response
    (not HTML), another HTML response."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    buf = io.BytesIO()
    w = WARCWriter(buf, gzip=gz)
    records = _real_records()
    image = ("response", {"WARC-Target-URI": "http://example.com/x.png"}, b"\x89PNG\r\n\x1a\n"
             + bytes(40), StatusAndHeaders("200 OK", [("Content-Type", "image/png")],
                                           protocol="HTTP/1.1"))
    for kind, heads, body, http in [*records[:3], image, *records[3:]]:
        uri = heads.get("WARC-Target-URI", "http://example.com/")
        if kind == "response":  # the body was cut: its length changes
            http = StatusAndHeaders("200 OK", [("Content-Type", http.get_header(
                "Content-Type"))], protocol="HTTP/1.1")
        rec = w.create_warc_record(uri, kind, payload=io.BytesIO(body), http_headers=http,
                                   warc_content_type="application/warc-fields"
                                   if kind == "warcinfo" else None)
        w.write_record(rec)
    return buf.getvalue()


def _record_spans(path: Path) -> list[tuple[int, int]]:
    from warcio.archiveiterator import ArchiveIterator

    spans = []
    with open(path, "rb") as f:
        it = ArchiveIterator(f)
        for r in it:
            r.content_stream().read()
            spans.append((it.get_record_offset(), it.get_record_length()))
    return spans


@pytest.fixture
def plain_extraction(monkeypatch):
    """The page's bytes as its text: the sweep tests the reader, not trafilatura."""
    pytest.importorskip("warcio")
    monkeypatch.setattr(warc_mod, "extract_html", lambda html, url=None: (
        html.decode("utf-8", "replace") if isinstance(html, bytes) else html) or None)


def _sweep(path: Path, blob: bytes, cuts: range | list[int]) -> int:
    """Read `blob` cut at each position; check the counts; returns the cuts with damage."""
    path.write_bytes(blob)
    spans = _record_spans(path)
    whole = [d.text for d in read_documents(str(path))]
    damaged = 0
    logging.disable(logging.WARNING)
    try:  # longest first: shrinking the file is cheap, writing it anew is not (~5 ms here)
        for cut in sorted(cuts, reverse=True):
            os.truncate(path, cut)
            report = ReadReport()
            docs = [d.text for d in read_shard(Shard(str(path)), report)]  # never raises
            started = sum(1 for s, _ in spans if s < cut and blob[s:cut].strip())
            complete = sum(1 for s, n in spans if s + n <= cut)
            assert docs == whole[: len(docs)], cut
            # every record begun before the cut is counted once: document, skipped or
            # malformed; the one cut short (if any) is the malformed one
            assert len(docs) + report.skipped_total + report.malformed == started, cut
            assert report.malformed == started - complete, (cut, report.examples)
            if report.malformed:
                damaged += 1
                assert report.examples[0].startswith(f"{path}@"), cut
            if report.malformed and damaged % 7 == 1:  # strict: the same record stops it
                with pytest.raises(MalformedRecord, match=f"^{path}@"):
                    list(read_shard(Shard(str(path)), ReadReport(strict=True)))
    finally:
        logging.disable(logging.NOTSET)
    return damaged


@pytest.mark.parametrize("gz", [True, False], ids=["warc.gz", "warc"])
def test_warc_cut_at_every_position_is_counted_never_a_crash(
        tmp_path: Path, gz: bool, plain_extraction) -> None:
    blob = _small_warc(gz)
    path = tmp_path / ("t.warc.gz" if gz else "t.warc")
    damaged = _sweep(path, blob, range(len(blob) + 1))
    assert damaged > len(blob) // 2  # nearly every cut falls inside a record


def test_real_warc_cut_around_every_record_boundary(tmp_path: Path, plain_extraction) -> None:
    """The fixture itself (its first 60 kB), cut around each gzip member's start and end
    (in its header warcio's parser raised AttributeError) and inside each member."""
    blob = (fixture_dir() / "cc_sample-0000.warc.gz").read_bytes()
    path = tmp_path / "cc.warc.gz"
    path.write_bytes(blob)
    cuts = set()
    for s, n in _record_spans(path):
        if s < 60_000:
            cuts.update((s - 1, s, s + 1, s + 5, s + 20, s + 40, s + n // 2, s + n - 4))
    _sweep(path, blob, sorted(c for c in cuts if 0 <= c <= len(blob)))


def test_curate_counts_add_up_on_a_cut_warc_and_strict_stops(tmp_path: Path, capsys) -> None:
    pytest.importorskip("trafilatura")
    blob = (fixture_dir() / "cc_sample-0001.warc.gz").read_bytes()
    src = tmp_path / "in"
    src.mkdir()
    (src / "cut.warc.gz").write_bytes(blob[: len(blob) // 3])
    out = tmp_path / "out"
    assert data_cmd.main(["curate", "--input", str(src), "--output", str(out), "--workers",
                          "1", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["malformed"] == 1 and s["kept"] == len(read_output(out))
    assert s["kept"] + s["dropped"] + s["malformed"] + s["skipped"] == s["input_records"]
    started = sum(1 for st, _ in _record_spans(src / "cut.warc.gz") if st < len(blob) // 3)
    assert s["input_records"] == started
    assert "WARC records that are not HTML responses or WET conversions" in s["skipped_reasons"]
    assert data_cmd.main(["extract", "--input", str(src), "--output", str(tmp_path / "o2"),
                          "--workers", "1", "--strict"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"scaletrain data extract: {src / 'cut.warc.gz'}@")
    assert "Traceback" not in "".join(err)


def test_binary_content_is_detected() -> None:
    assert is_binary(b"!<arch>\n/               0           0     0     0       4\n")
    assert is_binary(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    assert is_binary(b"some text\x00with a NUL byte")
    assert not is_binary("déjà vu: plain UTF-8 text\n".encode())
    assert not is_binary("caf\xe9 in Latin-1\n".encode("latin-1"))


def _write_bad_inputs(d: Path) -> dict[str, int]:
    """One file of each kind of damage; returns the records each holds."""
    d.mkdir(parents=True, exist_ok=True)
    ok = [{"text": f"a good document number {i}"} for i in range(3)]
    write_jsonl(d / "ok.jsonl", ok)
    (d / "notgzip.jsonl.gz").write_bytes(b"this is not gzip")
    many = [{"text": f"document {i}: " + os.urandom(300).hex()} for i in range(600)]
    full = gzip.compress("".join(json.dumps(r) + "\n" for r in many).encode())
    (d / "cut.jsonl.gz").write_bytes(full[: len(full) // 2])
    (d / "garbage.parquet").write_bytes(b"PAR1 not really")
    (d / "lib.a").write_bytes(b"!<arch>\n" + bytes(range(256)) * 4)  # binary by suffix
    (d / "blob").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(100))  # binary by content
    (d / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1"))
    return {"ok": 3, "files": 7}


def test_damaged_files_are_records_and_binaries_are_skipped(tmp_path: Path, capsys) -> None:
    _write_bad_inputs(tmp_path / "in")
    out = tmp_path / "out"
    argv = ["filter", "--input", str(tmp_path / "in"), "--output", str(out), "--filters",
            "counts", "--workers", "1", "--json"]
    assert data_cmd.main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["skipped_reasons"] == {"binary files": 2}
    names = " ".join(s["malformed_examples"])
    for bad in ("notgzip.jsonl.gz", "cut.jsonl.gz", "garbage.parquet"):
        assert bad in names
    assert s["malformed"] == 3
    # the readable part of the cut file, the good file and the Latin-1 text (kept, said)
    n_cut = s["docs_in"] - 3 - 1
    assert 0 < n_cut < 600
    assert s["kept"] + s["dropped"] + s["malformed"] + s["skipped"] == s["input_records"]
    assert s["input_records"] == s["docs_in"] + 3 + 2
    assert any("not valid UTF-8" in k for k in s["notes"])
    assert not any("lib.a" in d["id"] or d["id"].endswith("blob") for d in read_output(out))


def test_curate_of_only_malformed_input_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "in" / "ints.parquet")
    argv = ["curate", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "o"),
            "--workers", "1"]
    assert data_cmd.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("scaletrain data curate: no document could be read")
    assert "malformed 3" in err[-1] and "ints.parquet:rowgroup0:row0" in err[-1]
    (tmp_path / "bin").mkdir()  # nothing but binary files: also no document
    (tmp_path / "bin" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    assert data_cmd.main(["curate", "--input", str(tmp_path / "bin"), "--output",
                          str(tmp_path / "o2"), "--workers", "1"]) == 2
    assert "skipped 1 (binary files 1)" in capsys.readouterr().err


def test_strict_stops_curation_at_the_first_malformed_record(tmp_path: Path, capsys) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "fine"}\n{"text": broken\n{"text": "fine too"}\n')
    argv = ["filter", "--input", str(p), "--output", str(tmp_path / "o"), "--filters",
            "counts", "--strict"]
    assert data_cmd.main([*argv, "--workers", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"scaletrain data filter: {p}:2: ")
