"""Only kept documents reach training: curate real documents with dropped documents written,
tokenize the curated folder, train on it; an unfinished run's folder is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from scaletrain.commands import data as data_cmd
from scaletrain.data.indexed import IndexedDataset
from scaletrain.data.tokenizer import TextTokenizer
from scaletrain.train.trainer import Trainer
from tests.helpers.curate import fixture_dir
from tests.helpers.trainer import tiny_config

PIPELINE = """
write_dropped = true
[[steps]]
type = "gopher_quality"
[[steps]]
type = "exact_dedup"
"""


def _curate(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src"
    src.mkdir()
    for f in sorted(fixture_dir().glob("ccnet_en_head-*.jsonl.gz")):
        shutil.copy(f, src / f.name)
    shutil.copy(src / "ccnet_en_head-0091.jsonl.gz", src / "copy-0091.jsonl.gz")  # duplicates
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text(PIPELINE)
    out = tmp_path / "cur"
    assert data_cmd.main(["curate", "--config", str(cfg), "--input", str(src),
                          "--output", str(out), "--workers", "2", "--tasks", "3"]) == 0
    return src, out


def test_only_kept_documents_are_tokenized_and_trained(tmp_path: Path, capsys) -> None:
    _, out = _curate(tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    stats = json.loads((out / "stats.json").read_text())
    dropped = list((out / "_dropped").rglob("*.jsonl"))
    assert dropped and stats["docs_out"] < stats["docs_in"]  # documents were dropped and written
    assert manifest["documents"] == stats["docs_out"]
    kept = [json.loads(line)["text"] for e in manifest["files"]
            for line in (out / e["path"]).read_text().splitlines()]
    assert len(kept) == stats["docs_out"]
    # the report: tasks per stage, a few kept and dropped documents per reason
    ran = [len(list((out / "_work" / f"job-{k}" / "done").iterdir())) for k in range(2)]
    assert [st["tasks"] for st in stats["stages"]] == ran and stats["tasks"] == sum(ran)
    assert f"({sum(ran)} tasks: stage 1 {ran[0]}, stage 2 {ran[1]})" in capsys.readouterr().out
    samples = stats["samples"]
    assert [d["text"][:50] for d in samples["kept"]] == [t[:50] for t in kept[:3]]
    assert "exact_dedup: exact_duplicate" in samples["dropped"]
    assert any(k.startswith("gopher_quality: ") for k in samples["dropped"])
    assert all(1 <= len(v) <= 3 for v in samples["dropped"].values())
    assert "Dropped documents (samples per reason)" in (out / "report.html").read_text()

    prefix = tmp_path / "tok" / "cur"
    assert data_cmd.main(["tokenize", "--input", str(out), "--output", str(prefix),
                          "--train-tokenizer", "400", "--workers", "2"]) == 0
    ds = IndexedDataset(prefix)
    tok = TextTokenizer.load(f"{prefix}.tokenizer.json")
    got = [tok.decode(ds[i][:-1]) for i in range(ds.num_documents)]  # byte-level BPE: exact
    assert got == kept  # exactly the kept documents, in manifest order, none of _dropped/
    capsys.readouterr()

    trainer = Trainer(tiny_config(tmp_path / "run", tmp_path / "cache", "--data.paths",
                                  str(prefix), "--data.split", "80,20,0", "--training.steps",
                                  "2", "--checkpoint.save_final", "false"))
    result = trainer.train()
    assert len(result.losses) == 2 and all(0 < x < 20 for x in result.losses)


def test_an_unfinished_run_is_refused_with_the_fix(tmp_path: Path, capsys) -> None:
    _, out = _curate(tmp_path)
    (out / "manifest.json").unlink()  # as a run killed before its end leaves the folder
    capsys.readouterr()
    code = data_cmd.main(["tokenize", "--input", str(out), "--output", str(tmp_path / "t"),
                          "--tokenizer", str(fixture_dir() / "gpt-neox-tokenizer.json")])
    err = capsys.readouterr().err
    assert code == 2 and "unfinished curation run" in err and "run the same curate" in err
