"""The whole data path by its verbs: curate source files, tokenize the kept documents, train."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from scaletrain.commands import data as data_cmd
from scaletrain.data.indexed import IndexedDataset
from scaletrain.train.trainer import Trainer
from tests.helpers.trainer import tiny_config


def test_curate_then_tokenize_then_train(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    shutil.copytree(Path(json.__file__).parent, src, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(src / "decoder.py", src / "decoder_copy.py")  # an exact duplicate to drop
    n_files = len(list(src.glob("*.py")))

    assert data_cmd.main(["curate", "--input", str(src), "--output", str(tmp_path / "cur"),
                          "--workers", "1"]) == 0
    stats = json.loads((tmp_path / "cur" / "stats.json").read_text())
    assert stats["docs_in"] == n_files and stats["docs_out"] == n_files - 1

    assert data_cmd.main(["tokenize", "--input", str(tmp_path / "cur"), "--output",
                          str(tmp_path / "tok" / "code"), "--train-tokenizer", "400",
                          "--workers", "1"]) == 0
    assert IndexedDataset(tmp_path / "tok" / "code").num_documents == n_files - 1
    capsys.readouterr()

    trainer = Trainer(tiny_config(tmp_path / "run", tmp_path / "cache",
                                  "--data.paths", str(tmp_path / "tok" / "code"),
                                  "--data.split", "80,20,0", "--training.steps", "2",
                                  "--checkpoint.save_final", "false"))
    result = trainer.train()
    assert len(result.losses) == 2 and all(0 < x < 20 for x in result.losses)
