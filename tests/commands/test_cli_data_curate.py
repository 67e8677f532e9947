"""The `scaletrain data` curation sub-verbs end to end (outputs, stats.json, errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.commands import data
from tests.helpers.curate import fixture_dir, read_output


def _stats(out: Path) -> dict:
    return json.loads((out / "stats.json").read_text())


def test_curate_from_toml_on_real_documents(tmp_path: Path, capsys) -> None:
    fx = fixture_dir()
    cfg = tmp_path / "pipe.toml"
    cfg.write_text(f"""
input = ["{fx}/ccnet_en_head-*.jsonl.gz"]
output = "{tmp_path / "out"}"
write_dropped = true
[executor]
workers = 2
[[steps]]
type = "language"
languages = ["en"]
[[steps]]
type = "gopher_quality"
[[steps]]
type = "exact_dedup"
[[steps]]
type = "pii"
""")
    assert data.main(["curate", "--config", str(cfg)]) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "out"
    st = _stats(out)
    assert st["docs_in"] == 20 and st["docs_out"] == len(read_output(out))
    assert [s["name"] for s in st["steps"]] == ["language", "gopher_quality", "exact_dedup", "pii"]
    gq = st["steps"][1]
    assert gq["seen"] == gq["kept"] + sum(gq["dropped"].values())
    assert "gopher_quality" in printed and (out / "report.html").exists()
    dropped = [
        json.loads(x)
        for f in (out / "_dropped").rglob("*.jsonl")
        for x in f.read_text().splitlines()
    ]
    assert len(dropped) == 20 - st["docs_out"]
    assert all(d["metadata"]["drop_reason"] for d in dropped)
    assert all(set(d) == {"id", "text", "metadata"} for d in read_output(out))


def test_stage_verbs(tmp_path: Path, capsys) -> None:
    fx = fixture_dir()
    ccnet = str(fx / "ccnet_en_head-*.jsonl.gz")
    assert (
        data.main(
            [
                "extract",
                "--input",
                str(fx / "cc_sample-0001.warc.gz"),
                "--output",
                str(tmp_path / "ex"),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert 5 <= _stats(tmp_path / "ex")["docs_out"] <= 15
    assert (
        data.main(
            [
                "filter",
                "--input",
                ccnet,
                "--output",
                str(tmp_path / "f"),
                "--filters",
                "gopher,c4",
                "--set",
                "gopher_quality.min_words=10",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    names = [s["name"] for s in _stats(tmp_path / "f")["steps"]]
    assert names == ["gopher_quality", "c4"]
    assert (
        data.main(
            [
                "dedup",
                "--input",
                str(tmp_path / "f"),
                str(tmp_path / "f"),
                "--output",
                str(tmp_path / "d"),
                "--method",
                "exact",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    st = _stats(tmp_path / "d")
    assert st["docs_out"] == st["docs_in"] // 2  # the input given twice: every copy removed
    assert (
        data.main(["pii", "--input", ccnet, "--output", str(tmp_path / "p"), "--workers", "1"]) == 0
    )
    assert data.main(["inspect", str(tmp_path / "p"), "--samples", "2"]) == 0
    shown = capsys.readouterr().out
    assert "20 documents" in shown and "pipeline that wrote it" in shown


def test_quality_verb_trains_and_filters(tmp_path: Path) -> None:
    pytest.importorskip("fasttext")
    fx = fixture_dir()
    model = tmp_path / "m.bin"
    assert (
        data.main(
            [
                "quality",
                "--train-positive",
                str(fx / "ccnet_en_head-0091.jsonl.gz"),
                "--train-negative",
                str(fx / "cc_sample-0000.warc.gz"),
                "--fasttext",
                str(model),
                "--input",
                str(fx / "ccnet_en_head-0174.jsonl.gz"),
                "--output",
                str(tmp_path / "q"),
                "--min-score",
                "0.5",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    st = _stats(tmp_path / "q")
    assert [s["name"] for s in st["steps"]] == ["fasttext_score", "score_filter[fasttext_hq]"]
    assert all("fasttext_hq" in d["metadata"] for d in read_output(tmp_path / "q"))


def test_errors_are_one_clear_line(tmp_path: Path, capsys) -> None:
    assert (
        data.main(
            ["filter", "--input", str(tmp_path / "none*.jsonl"), "--output", str(tmp_path / "o")]
        )
        == 2
    )
    assert "matches no file" in capsys.readouterr().err
    cfg = tmp_path / "bad.toml"
    cfg.write_text('input = "x"\n[[steps]]\ntype = "gopher_qualty"\n')
    assert data.main(["curate", "--config", str(cfg)]) == 2
    assert "Did you mean 'gopher_quality'" in capsys.readouterr().err
    cfg.write_text('input = "x"\n[[steps]]\ntype = "c4"\nmin_sentence = 3\n')
    assert data.main(["curate", "--config", str(cfg)]) == 2
    assert "unknown parameter" in capsys.readouterr().err


def test_curate_without_arguments_runs_the_stdlib_pipeline(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    assert data.main(["curate", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    st = _stats(tmp_path / "runs" / "data-curate")
    assert [s["name"] for s in st["steps"]] == [
        "counts",
        "code",
        "exact_dedup",
        "minhash_dedup",
        "pii",
    ]
    assert st["docs_in"] > 500 and 0 < st["docs_out"] < st["docs_in"]
    exact = st["steps"][2]
    assert exact["dropped"].get("exact_duplicate", 0) > 0  # the stdlib has copies
    assert "exact_duplicate" in out and "replaced_email" in out
