"""Malformed input is counted, skipped and named (file and line or byte offset) by tokenize
and the WARC reader as by the curation readers; --strict stops with exit 2 and the same
message; long documents are encoded in pieces to the same tokens."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from scaletrain.commands import data as data_cmd
from scaletrain.curate.io.readers import ReadReport, read_documents
from scaletrain.data.indexed import IndexedDataset
from scaletrain.data.tokenize import _pieces, tokenize_to_indexed
from scaletrain.data.tokenizer import TextTokenizer
from tests.helpers.curate import fixture_dir


def _ccnet_texts() -> list[str]:
    with gzip.open(fixture_dir() / "ccnet_en_head-0091.jsonl.gz", "rt") as f:
        return [json.loads(line)["text"] for line in f]


def _bad_inputs(tmp_path: Path) -> tuple[Path, list[str]]:
    """A folder with a bad byte (line 2), bad JSON (line 4) and a truncated .gz."""
    texts = _ccnet_texts()
    d = tmp_path / "in"
    d.mkdir()
    lines = [json.dumps({"text": t}).encode() for t in texts[:4]]
    lines[1] = lines[1][:20] + b"\xff" + lines[1][20:]
    lines[3] = lines[3][:-5]
    (d / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    full = gzip.compress(("".join(json.dumps({"text": t}) + "\n" for t in texts)).encode())
    (d / "b.jsonl.gz").write_bytes(full[: len(full) * 2 // 3])
    return d, texts


def test_tokenize_skips_and_names_bad_records(tmp_path: Path, capsys) -> None:
    d, texts = _bad_inputs(tmp_path)
    neox = str(fixture_dir() / "gpt-neox-tokenizer.json")
    argv = ["tokenize", "--input", str(d), "--output", str(tmp_path / "o"), "--tokenizer", neox,
            "--workers", "1", "--json"]
    assert data_cmd.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ex = out["malformed_examples"]
    assert out["malformed"] == 3
    assert ex[0].startswith(f"{d / 'a.jsonl'}:2:") and ex[1].startswith(f"{d / 'a.jsonl'}:4:")
    assert ex[2].startswith(f"{d / 'b.jsonl.gz'}:") and "ends early" in ex[2]
    ds = IndexedDataset(tmp_path / "o")
    n_b = out["documents"] - 2  # the records of b before the cut are kept
    assert 0 < n_b < len(texts)
    tok = TextTokenizer.load(neox)
    want = [texts[0], texts[2]] + texts[:n_b]
    assert [list(ds[i]) for i in range(ds.num_documents)] == \
        [list(a) for a in tok.encode_documents(want)]

    assert data_cmd.main([*argv, "--strict"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("scaletrain data tokenize: ") and err.endswith(ex[0])
    assert "Traceback" not in err


def test_long_document_pieces_give_the_same_tokens(tmp_path: Path, monkeypatch) -> None:
    import scaletrain.data.tokenize as tk

    text = "\n\n".join(_ccnet_texts()) + "  two  spaces\tand tabs " * 50
    pieces = list(_pieces(text, 500))
    assert "".join(pieces) == text and len(pieces) > 10
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": text}) + "\n" +
                                      json.dumps({"text": "short one."}) + "\n")
    neox = fixture_dir() / "gpt-neox-tokenizer.json"
    whole = tokenize_to_indexed([tmp_path / "d.jsonl"], tmp_path / "whole", neox)
    monkeypatch.setattr(tk, "_PIECE_CHARS", 500)
    pieced = tokenize_to_indexed([tmp_path / "d.jsonl"], tmp_path / "pieced", neox)
    assert whole.documents == pieced.documents == 2
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"pieced{ext}").read_bytes() == (tmp_path / f"whole{ext}").read_bytes()


@pytest.fixture(scope="module")
def whole_warc() -> list[str]:
    pytest.importorskip("warcio")
    pytest.importorskip("trafilatura")
    return [d.text for d in read_documents(str(fixture_dir() / "cc_sample-0000.warc.gz"))]


@pytest.mark.parametrize("cut", [0.3, 0.8])
def test_truncated_warc_records_are_counted_with_their_offset(
    tmp_path: Path, cut: float, whole_warc: list[str]
) -> None:
    src = fixture_dir() / "cc_sample-0000.warc.gz"
    whole = whole_warc
    data = src.read_bytes()
    for name, blob in (("t.warc.gz", data), ("t.warc", gzip.decompress(data))):
        p = tmp_path / name
        p.write_bytes(blob[: int(len(blob) * cut)])
        report = ReadReport()
        docs = list(read_documents(str(p), report))
        assert report.malformed == 1, report.examples
        assert report.examples[0].startswith(f"{p}@")
        offset = int(report.examples[0].split("@", 1)[1].split(":", 1)[0])
        assert 0 < offset < len(blob) * cut
        assert [d.text for d in docs] == whole[: len(docs)]
        assert len(docs) < len(whole)
        with pytest.raises(ValueError, match=rf"{p.name}@{offset}: "):
            list(read_documents(str(p), ReadReport(strict=True)))


def test_whole_warc_has_no_malformed_records() -> None:
    pytest.importorskip("warcio")
    report = ReadReport()
    docs = list(read_documents(str(fixture_dir() / "cc_sample-0001.warc.gz"), report))
    assert len(docs) == 15 and report.malformed == 0
    assert np.all([d.text for d in docs])
