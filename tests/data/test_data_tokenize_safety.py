"""Tokenize output that a later step can trust: an interrupted re-run over an existing dataset
never leaves tokens beside a tokenizer they were not made with; datasets tokenized with
different tokenizers are not blended; unreadable Parquet input is a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import scaletrain.data.tokenize as tokenize_mod
import scaletrain.data.tokenize_inputs as tokenize_inputs
from scaletrain.commands import data as data_cmd
from scaletrain.data import indexed
from scaletrain.data.indexed import IndexedDataset
from scaletrain.data.sources import DataSourceError, build_sources
from scaletrain.data.tokenizer import TextTokenizer
from tests.helpers.curate import fixture_dir, write_jsonl

TEXTS = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7}." for i in range(40)]


def _tokenize(src: Path, prefix: Path, *tok_args: str) -> int:
    return data_cmd.main(["tokenize", "--input", str(src), "--output", str(prefix),
                          "--workers", "1", *tok_args])


def _decoded(prefix: Path) -> list[str]:
    ds = IndexedDataset(prefix)
    tok = TextTokenizer.load(f"{prefix}.tokenizer.json")
    return [tok.decode(ds[i][:-1]) for i in range(ds.num_documents)]


class _Interrupt(BaseException):
    """Stands for Ctrl-C / a kill in the middle of the tokenization."""


@pytest.mark.parametrize("how", ["--train-tokenizer", "--tokenizer"])
def test_interrupted_rerun_leaves_no_dataset_with_a_foreign_tokenizer(
        tmp_path: Path, monkeypatch, how: str) -> None:
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    prefix = tmp_path / "tok" / "web"
    assert _tokenize(src, prefix, "--train-tokenizer", "300") == 0
    assert _decoded(prefix) == TEXTS  # byte-level BPE: exact

    def interrupted(*_a, **_k):
        raise _Interrupt
    monkeypatch.setattr(tokenize_mod, "write_texts", interrupted)
    second = (["--train-tokenizer", "280"] if how == "--train-tokenizer"
              else ["--tokenizer", str(fixture_dir() / "gpt-neox-tokenizer.json")])
    with pytest.raises(_Interrupt):
        _tokenize(src, prefix, *second)
    # either the old dataset with its own tokenizer, or no dataset at all: never a mix
    if indexed.exists(prefix):
        assert _decoded(prefix) == TEXTS
    assert not list(prefix.parent.glob("*tmp*"))
    monkeypatch.undo()
    assert _tokenize(src, prefix, *second) == 0  # the re-run completes
    assert _decoded(prefix) == TEXTS


def test_retokenizing_with_the_sidecar_tokenizer_keeps_it(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    prefix = tmp_path / "web"
    assert _tokenize(src, prefix, "--train-tokenizer", "300") == 0
    before = Path(f"{prefix}.tokenizer.json").read_bytes()
    assert _tokenize(src, prefix, "--tokenizer", f"{prefix}.tokenizer.json") == 0
    assert Path(f"{prefix}.tokenizer.json").read_bytes() == before
    assert _decoded(prefix) == TEXTS


def _data_cfg(paths: list[Path], **kw):
    from scaletrain.config import DataConfig

    return DataConfig(paths=[str(p) for p in paths], split="50,50,0", seq_len=16, **kw)


def test_blending_datasets_of_different_tokenizers_is_refused(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    assert _tokenize(a, tmp_path / "a", "--train-tokenizer", "300") == 0
    assert _tokenize(a, tmp_path / "b", "--train-tokenizer", "280") == 0
    shutil.copy(f"{tmp_path}/a.tokenizer.json", f"{tmp_path}/c.tokenizer.json")
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{tmp_path}/a{suffix}", f"{tmp_path}/c{suffix}")
    cache = tmp_path / "cache"
    build_sources(_data_cfg([tmp_path / "a", tmp_path / "c"], cache_dir=str(cache)), 0)  # same
    with pytest.raises(DataSourceError, match=r"different tokenizer.*b\.tokenizer\.json"):
        build_sources(_data_cfg([tmp_path / "a", tmp_path / "b"], cache_dir=str(cache)), 0)
    with pytest.raises(DataSourceError, match="different tokenizer"):
        build_sources(_data_cfg([tmp_path / "a"], cache_dir=str(cache),
                                tokenizer=f"{tmp_path}/b.tokenizer.json"), 0)


@pytest.mark.parametrize("table", ["garbage", "int_text"])
def test_unreadable_parquet_is_counted_and_all_malformed_is_exit_2(
        tmp_path: Path, capsys, table) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "in.parquet"
    if table == "garbage":
        path.write_bytes(b"not parquet at all\n")
    else:
        pq.write_table(pa.table({"text": [1, 2]}), path)
    write_jsonl(tmp_path / "ok.jsonl", [{"text": "a fine document"}])
    code = _tokenize(tmp_path, tmp_path / "out" / "x", "--json", "--tokenizer",
                     str(fixture_dir() / "gpt-neox-tokenizer.json"))
    out, err = capsys.readouterr()
    # a file that is not Parquet is one malformed record, a non-string text one per row, as
    # in JSON lines; the readable documents are tokenized
    assert code == 0 and json.loads(out)["malformed"] == (1 if table == "garbage" else 2)
    assert "in.parquet" in json.loads(out)["malformed_examples"][0]
    if table == "garbage":
        assert "cannot read Parquet file" in json.loads(out)["malformed_examples"][0]
    assert IndexedDataset(tmp_path / "out" / "x").num_documents == 1
    path.unlink()  # alone, it is a run that read no document: exit 2, one line
    (tmp_path / "ok.jsonl").unlink()
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "only.parquet")
    assert _tokenize(tmp_path, tmp_path / "out" / "y", "--tokenizer",
                     str(fixture_dir() / "gpt-neox-tokenizer.json")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("scaletrain data tokenize: no document to tokenize in 1 file")
    assert "only.parquet:row0" in err[-1] and not list((tmp_path / "out").glob("y*"))


def test_a_file_of_malformed_lines_logs_a_few_and_counts_all(tmp_path: Path, caplog) -> None:
    from scaletrain.curate.io.readers import MAX_EXAMPLES, ReadReport, read_documents

    bad = tmp_path / "config.jsonl"  # a pretty-printed JSON file named as JSON lines
    bad.write_text(json.dumps({f"k{i}": i for i in range(500)}, indent=1))
    report = ReadReport()
    with caplog.at_level("WARNING", logger="scaletrain.curate.io"):
        assert list(read_documents(str(bad), report)) == []
    assert report.malformed == 502 and len(report.examples) == MAX_EXAMPLES
    assert MAX_EXAMPLES < len(caplog.records) <= MAX_EXAMPLES + 1
    assert "counted, not logged" in caplog.records[-1].getMessage()


def test_add_bos_with_a_trained_tokenizer(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    prefix = tmp_path / "bos"
    assert _tokenize(src, prefix, "--train-tokenizer", "300", "--add-bos") == 0
    ds = IndexedDataset(prefix)
    tok = TextTokenizer.load(f"{prefix}.tokenizer.json")
    bos = tok.tokenizer.token_to_id("<|begin_of_text|>")
    eos = tok.tokenizer.token_to_id("<|endoftext|>")
    assert bos is not None and ds.num_documents == len(TEXTS)
    for i, text in enumerate(TEXTS):  # BOS text EOS, nothing else special inside
        ids = ds[i].tolist()
        assert ids[0] == bos and ids[-1] == eos and bos not in ids[1:] and eos not in ids[:-1]
        assert tok.decode(ids[1:-1]) == text


def test_a_curation_that_kept_nothing_is_named_as_such(tmp_path: Path, capsys) -> None:
    write_jsonl(tmp_path / "in.jsonl", [{"text": "too short"}])
    out = tmp_path / "cur"
    assert data_cmd.main(["curate", "--input", str(tmp_path / "in.jsonl"), "--output",
                          str(out), "--workers", "1"]) == 0
    capsys.readouterr()
    assert _tokenize(out, tmp_path / "t", "--train-tokenizer", "300") == 2
    err = capsys.readouterr().err
    assert "kept 0 documents" in err and "stats.json" in err


def test_ctrl_c_is_one_line_and_exit_130(tmp_path: Path, monkeypatch, capsys) -> None:
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt
    monkeypatch.setattr(tokenize_mod, "write_texts", interrupted)
    assert _tokenize(src, tmp_path / "x", "--train-tokenizer", "300") == 130
    err = capsys.readouterr().err
    assert "interrupted; run the same command again" in err and "Traceback" not in err
    assert not indexed.exists(tmp_path / "x") and not list(tmp_path.glob("x.*"))


def test_files_a_folder_holds_but_tokenize_cannot_read_are_named(tmp_path: Path, caplog) -> None:
    from scaletrain.data.tokenize_inputs import input_shards

    write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": "x"}])
    write_jsonl(tmp_path / "d" / "b.json", [{"text": "y"}])
    with caplog.at_level("WARNING", logger="scaletrain.data"):
        assert input_shards(tmp_path / "d") == [str(tmp_path / "d" / "a.jsonl")]
    assert "1 file(s)" in caplog.text and "b.json" in caplog.text


def test_a_split_too_small_for_validation_names_one_that_works(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS[:15]])
    assert _tokenize(src, tmp_path / "small", "--train-tokenizer", "300") == 0
    cfg = _data_cfg([tmp_path / "small"], cache_dir=str(tmp_path / "cache"))
    cfg.split = "98,2,0"  # the default, with 15 documents
    with pytest.raises(DataSourceError, match=r"of 15 document\(s\) rounds to 0") as e:
        build_sources(cfg, 0)
    suggested = str(e.value).rsplit("--data.split ", 1)[1]
    cfg.split = suggested
    build_sources(cfg, 0)  # the suggestion gives a validation document
    assert suggested == "96,4,0"


def test_bad_utf8_is_named_as_such_and_a_bom_is_read(tmp_path: Path) -> None:
    from scaletrain.curate.io.readers import ReadReport, read_documents

    p = tmp_path / "in.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"text": "after a BOM"}\n\xff\xfe{"text": "x"}\n'
                  b'{"text": "caf\xe9"}\n{"text": "fine"}\n')
    report = ReadReport()
    assert [d.text for d in read_documents(str(p), report)] == ["after a BOM", "fine"]
    assert report.malformed == 2
    assert all("not valid UTF-8" in e for e in report.examples), report.examples
    assert report.examples[0].startswith(f"{p}:2:") and report.examples[1].startswith(f"{p}:3:")


def test_empty_texts_are_counted_not_lost_silently(tmp_path: Path, capsys) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": ""}, {"text": "a document"},
                                              {"text": ""}, {"text": "another one"}])
    assert _tokenize(src, tmp_path / "t", "--json", "--train-tokenizer", "300") == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["documents"], out["empty"], out["malformed"]) == (2, 2, 0)
    assert _decoded(tmp_path / "t") == ["a document", "another one"]


def _die_on_second(job: tuple) -> dict:
    """A tokenize job that kills its own worker (as the OOM killer would) for file s1."""
    import os
    import signal

    if any(f.endswith("s1.jsonl") for f in job[0]):
        os.kill(os.getpid(), signal.SIGKILL)
    return tokenize_mod._tokenize_group(job)


def test_a_killed_worker_is_an_error_not_a_hang(tmp_path: Path) -> None:
    shards = [write_jsonl(tmp_path / f"s{k}.jsonl", [{"text": t} for t in TEXTS])
              for k in range(3)]
    tok = fixture_dir() / "gpt-neox-tokenizer.json"
    jobs = [([str(s)], str(tok), False, str(tmp_path / f"part-{k}"), "text", False, None)
            for k, s in enumerate(shards)]
    import threading

    outcome: list[BaseException] = []

    def run() -> None:
        try:
            list(tokenize_mod._run_jobs(jobs, 2, "local", fn=_die_on_second))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)
    t = threading.Thread(target=run, daemon=True)  # multiprocessing.Pool waited for ever
    t.start()
    t.join(60)
    assert not t.is_alive(), "tokenize hangs after a worker was killed"
    assert isinstance(outcome[0], tokenize_inputs.TokenizeError)
    assert "a worker process died" in str(outcome[0]) and "run again" in str(outcome[0])


def test_curate_without_config_picks_the_pipeline_for_its_inputs(tmp_path: Path, capsys) -> None:
    """Web pages get the web pipeline (the code rules dropped 40 of 57 fixture pages as
    'avg_line_too_long'); source files keep the code pipeline."""
    web = fixture_dir() / "ccnet_en_head-0174.jsonl.gz"
    assert data_cmd.main(["curate", "--input", str(web), "--output", str(tmp_path / "web"),
                          "--workers", "1"]) == 0
    steps = [s["name"] for s in json.loads((tmp_path / "web" / "stats.json").read_text())["steps"]]
    assert steps == ["language", "gopher_repetition", "gopher_quality", "c4", "fineweb_quality",
                     "exact_dedup", "minhash_dedup", "pii"]
    assert "default pipeline: web rules for 1 jsonl files" in capsys.readouterr().err
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("def f(x):\n    return x + 1\n" * 10)
    assert data_cmd.main(["curate", "--input", str(tmp_path / "src"), "--output",
                          str(tmp_path / "code"), "--workers", "1"]) == 0
    steps = [s["name"] for s in json.loads((tmp_path / "code" / "stats.json").read_text())["steps"]]
    assert steps == ["counts", "code", "exact_dedup", "minhash_dedup", "pii"]
    assert "default pipeline: code rules for 1 source/text files" in capsys.readouterr().err
