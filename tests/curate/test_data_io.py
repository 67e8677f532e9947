"""Readers, writers and shard planning of the curation pipeline."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from scaletrain.curate.documents import Document
from scaletrain.curate.io import (
    InputError,
    ReadReport,
    make_writer,
    plan_shards,
    read_documents,
    read_shard,
)
from tests.helpers.curate import fixture_dir, write_jsonl


def _records(n: int) -> list[dict]:
    return [
        {"id": f"d{i}", "text": f"document number {i} " * (i % 5 + 1), "url": f"http://x/{i}"}
        for i in range(n)
    ]


def test_jsonl_plain_gz_zst_and_parquet_roundtrip(tmp_path: Path) -> None:
    docs = [Document.from_dict(r, "?") for r in _records(50)]
    for fmt in ("jsonl", "jsonl.gz", "jsonl.zst", "parquet"):
        out = tmp_path / fmt
        with make_writer(str(out), fmt, max_bytes=600) as w:
            for d in docs:
                w.write(d)
        files = sorted(out.iterdir())
        assert len(files) > 1, f"{fmt}: expected several shards"  # max_bytes rotates files
        assert not [f for f in files if f.name.endswith(".tmp")]
        back = list(read_documents(str(out)))
        assert [(d.id, d.text, d.metadata) for d in back] == [
            (d.id, d.text, d.metadata) for d in docs
        ], fmt
        assert back[3].metadata["url"] == "http://x/3"  # top-level keys become metadata


def test_writer_leaves_no_file_on_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), make_writer(str(tmp_path / "o"), "jsonl") as w:
        w.write(Document("a", "text"))
        raise RuntimeError("boom")
    assert list((tmp_path / "o").iterdir()) == []


def test_malformed_records_counted_with_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "good one"}\n{not json\n{"id": 3}\n["list"]\n{"text": "good two"}\n')
    report = ReadReport()
    docs = list(read_documents(str(p), report))
    assert [d.text for d in docs] == ["good one", "good two"]
    assert report.malformed == 3
    assert report.examples[0].startswith(f"{p}:2:")
    assert any(":3:" in e and "text" in e for e in report.examples)


def test_unreadable_input_is_a_named_malformed_record(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="matches no file"):
        list(read_documents(str(tmp_path / "nope" / "*.jsonl")))
    bad = tmp_path / "x.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    report = ReadReport()
    assert list(read_documents(str(bad), report)) == []  # counted and named, the run goes on
    assert report.malformed == 1 and report.examples[0].startswith(f"{bad}: cannot read")
    with pytest.raises(InputError, match=r"x\.jsonl\.gz: cannot read the file"):
        list(read_documents(str(bad), ReadReport(strict=True)))


def test_large_jsonl_split_into_byte_ranges_reads_every_record_once(tmp_path: Path) -> None:
    recs = _records(500)
    p = write_jsonl(tmp_path / "big.jsonl", recs)
    shards = plan_shards(str(p), target_bytes=p.stat().st_size // 7)
    assert len(shards) >= 7
    ids = [d.id for s in shards for d in read_shard(s)]
    assert ids == [r["id"] for r in recs]


def test_text_directory_ids_are_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.py").write_text("print(1)\n")
    (tmp_path / "a" / "y.txt").write_text("hello\n")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "z.txt").write_text("secret\n")
    docs = {d.id: d.text for d in read_documents(str(tmp_path))}
    assert docs == {"a/b/x.py": "print(1)\n", "a/y.txt": "hello\n"}
    assert {d.id for d in read_documents(str(tmp_path / "**" / "*.py"))} == {"a/b/x.py"}


def test_warc_extraction_of_real_common_crawl_pages() -> None:
    pytest.importorskip("trafilatura")
    pytest.importorskip("warcio")
    report = ReadReport()
    docs = list(read_documents(str(fixture_dir() / "cc_sample-0000.warc.gz"), report))
    # 22 HTML responses in this file; a page may have no main text (counted, not a crash)
    assert 10 <= len(docs) <= 22 and len(docs) + report.malformed == 22
    assert all(d.metadata["url"].startswith("http") and len(d.text) > 0 for d in docs)
    assert not any("<html" in d.text.lower() or "<div" in d.text.lower() for d in docs)


def test_ccnet_fixture_reads_with_metadata() -> None:
    docs = list(read_documents(str(fixture_dir() / "ccnet_en_head-*.jsonl.gz")))
    assert len(docs) == 20
    with gzip.open(fixture_dir() / "ccnet_en_head-0091.jsonl.gz", "rt") as f:
        first = json.loads(f.readline())
    assert docs[0].text == first["text"]
    assert "perplexity" in docs[0].metadata or "perplexity" in docs[0].metadata.get("metadata", {})


def test_fsspec_urls_read_and_write() -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    with fs.open("/curate-test/in/a.jsonl", "wb") as f:
        f.write(b'{"id": "m1", "text": "from memory"}\n{"id": "m2", "text": "second"}\n')
    docs = list(read_documents("memory://curate-test/in/*.jsonl"))
    assert [d.id for d in docs] == ["m1", "m2"]
    with make_writer("memory://curate-test/out", "jsonl.gz") as w:
        for d in docs:
            w.write(d)
    assert [d.text for d in read_documents("memory://curate-test/out")] == ["from memory", "second"]
    assert not [p for p in fs.find("/curate-test/out") if p.endswith(".tmp")]
    fs.rm("/curate-test", recursive=True)


def test_a_large_file_becomes_several_tasks_in_order(tmp_path: Path) -> None:
    from scaletrain.curate.executors import LocalExecutor
    from scaletrain.curate.filters import CountsFilter
    from scaletrain.curate.runner import RunOptions, run_pipeline
    from tests.helpers.curate import read_output

    recs = _records(300)
    p = write_jsonl(tmp_path / "big.jsonl", recs)
    opts = RunOptions(task_bytes=p.stat().st_size // 5)
    s = run_pipeline([CountsFilter(min_words=4)], str(p), str(tmp_path / "o"), LocalExecutor(2),
                     opts)
    assert s["tasks"] >= 5
    expected = [r["id"] for r in recs if len(r["text"].split()) >= 4]
    assert [d["id"] for d in read_output(tmp_path / "o")] == expected
