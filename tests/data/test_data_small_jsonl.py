"""The fast path for small JSON-lines files gives exactly what the general reader gives:
the same texts, empty and malformed counts and messages, for clean files and for every kind
of odd one (which it hands to the general reader)."""

from __future__ import annotations

import json
from pathlib import Path

from scaletrain.curate.io.readers import ReadReport
from scaletrain.data.small_jsonl import SMALL_FILE_BYTES, read_small_jsonl
from scaletrain.data.tokenize_inputs import group_texts, read_documents

CLEAN = {
    "one.jsonl": b'{"text": "one line"}\n',
    "no-newline.jsonl": b'{"text": "last line without a newline"}',
    "crlf.jsonl": b'{"text": "a"}\r\n{"text": "b"}\r\n',
    "blank-lines.jsonl": b'\n{"text": "a"}\n  \n\t\n{"text": "b"}\n\n',
    "spaces-around.jsonl": b' {"text": "lead"}\n{"text": "trail"}  \t\n',
    "empty-text.jsonl": b'{"text": ""}\n{"text": "x"}\n',
    "unicode.ndjson": json.dumps({"text": "caf\u00e9 \u2028 \u65e5\u672c \U0001f600"}).encode()
    + b"\n" + '{"text": "raw caf\u00e9 \u00a0 nbsp"}\n'.encode(),
    "other-fields.jsonl": b'{"id": 3, "text": "t", "meta": {"text": 1}}\n',
    "empty-file.jsonl": b"",
}
ODD = {
    "bom.jsonl": b'\xef\xbb\xbf{"text": "after a BOM"}\n',
    "bom-blank.jsonl": b'\xef\xbb\xbf\n{"text": "x"}\n',
    "bad-utf8.jsonl": b'{"text": "ok"}\n{"text": "\xff"}\n',
    "not-json.jsonl": b'{"text": "ok"}\nnot json\n',
    "two-values.jsonl": b'{"text": "a"} {"text": "b"}\n',
    "array.jsonl": b'["text"]\n',
    "no-text.jsonl": b'{"body": "x"}\n',
    "int-text.jsonl": b'{"text": 3}\n',
    "vt-line.jsonl": b'{"text": "a"}\n\x0b{"text": "b"}\n',
    "nbsp-line.jsonl": '{"text": "a"}\n\u00a0\n'.encode(),
    "mid-bom.jsonl": b'{"text": "a"}\n\xef\xbb\xbf{"text": "b"}\n',
    "big.jsonl": (json.dumps({"text": "w " * (SMALL_FILE_BYTES // 2)}) + "\n").encode(),
}


def _read(files: list[Path], fast: bool) -> tuple[list[str], int, int, list[str]]:
    report = ReadReport()
    if fast:
        known = [(f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        texts = list(group_texts([str(f) for f in files], "text", report, known))
        assert texts == list(group_texts([str(f) for f in files], "text", ReadReport()))
    else:
        texts = [t for f in files for t in read_documents(str(f), "text", report)]
    return texts, report.empty, report.malformed, report.examples


def test_the_fast_path_reads_what_the_general_reader_reads(tmp_path: Path) -> None:
    files = []
    for name, data in {**CLEAN, **ODD}.items():
        (tmp_path / name).write_bytes(data)
        files.append(tmp_path / name)
    for name in CLEAN:  # clean files do take the fast path
        got = read_small_jsonl(str(tmp_path / name), "text")
        assert got is not None, name
    for name in ODD:  # odd ones are left to the general reader
        assert read_small_jsonl(str(tmp_path / name), "text") is None, name
    fast, slow = _read(files, fast=True), _read(files, fast=False)
    assert fast == slow
    assert slow[1] == 1 and slow[2] >= 8  # empty and malformed records were there to count


def test_a_file_that_changed_since_its_stat_or_is_gone_is_read_by_the_general_reader(
        tmp_path: Path) -> None:
    f = tmp_path / "a.jsonl"
    f.write_bytes(b'{"text": "now longer than it was"}\n')
    assert read_small_jsonl(str(f), "text", 5, 0) is None  # size differs from the stat's
    got = read_small_jsonl(str(f), "text")  # not known: from the open file
    assert got is not None and (got.size, got.mtime_ns) == (f.stat().st_size,
                                                            f.stat().st_mtime_ns)
    assert read_small_jsonl(str(tmp_path / "gone.jsonl"), "text") is None
    assert read_small_jsonl(str(tmp_path / "a.jsonl.gz"), "text", 10, 0) is None
