"""`scaletrain train` on `data.paths`: two tokenized datasets blended by weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.commands import data as data_cmd
from scaletrain.config import ConfigError
from scaletrain.train.trainer import Trainer
from tests.helpers.trainer import tiny_config

FIXTURES = Path("/work/shared/fixtures/data")
for _cand in (Path(__file__).resolve().parents[2] / "../shared/fixtures/data", FIXTURES):
    if _cand.is_dir():
        FIXTURES = _cand
        break
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared fixtures not present")


def test_train_on_blended_indexed_datasets(tmp_path: Path, capsys) -> None:
    files = sorted(FIXTURES.glob("ccnet_en_head-*.jsonl.gz"))
    tok = tmp_path / "a.tokenizer.json"
    for i, f in enumerate(files):
        argv = ["tokenize", "--input", str(f), "--output", str(tmp_path / "ab"[i]),
                "--workers", "1"]
        argv += ["--train-tokenizer", "500"] if i == 0 else ["--tokenizer", str(tok)]
        assert data_cmd.main(argv) == 0
    capsys.readouterr()
    extra = ["--data.paths", str(tmp_path / "a"), str(tmp_path / "b"),
             "--data.weights", "0.25", "0.75", "--data.split", "80,20,0",
             "--training.steps", "3", "--checkpoint.interval", "2",
             "--checkpoint.save_final", "false"]
    trainer = Trainer(tiny_config(tmp_path / "run", tmp_path / "cache", *extra))
    assert trainer.corpus.tokenizer_path == tok
    assert [m["realized"] for m in trainer.corpus.mixture] == [0.25, 0.75]
    result = trainer.train()
    assert len(result.losses) == 3 and result.val_loss is not None
    # Resume from the step-2 checkpoint with 2 loader workers: step 3 sees the same batch.
    resumed = Trainer(tiny_config(tmp_path / "run", tmp_path / "cache", *extra,
                                  "--checkpoint.resume", "true", "--data.num_workers", "2"))
    assert resumed.step == 2 and resumed.train().losses == result.losses[2:]
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert all(r["data_wait_s"] >= 0 for r in rows if "data_wait_s" in r)
    with pytest.raises(ConfigError, match="one weight per path"):
        tiny_config(tmp_path / "x", tmp_path / "cache", "--data.paths", "a", "b",
                    "--data.weights", "1")
    with pytest.raises(ConfigError, match="data.paths"):
        Trainer(tiny_config(tmp_path / "y", tmp_path / "cache", "--data.paths",
                            str(tmp_path / "missing"), "--data.tokenizer", str(tok)))


def test_missing_and_empty_datasets_are_named(tmp_path: Path, capsys) -> None:
    from scaletrain.commands import train as train_cmd
    from tests.helpers.trainer import tiny_argv

    missing = tmp_path / "nonexistent"
    argv = tiny_argv(tmp_path / "run", tmp_path / "cache", "--data.paths", str(missing))
    assert train_cmd.main(argv) == 2
    err = capsys.readouterr().err
    assert f"'{missing}' is not an indexed dataset" in err and "tokenizer" not in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.jsonl").write_text('{"text": ""}\n')
    assert data_cmd.main(["tokenize", "--input", str(tmp_path / "empty"), "--output",
                          str(tmp_path / "tok"), "--tokenizer",
                          str(FIXTURES / "gpt-neox-tokenizer.json")]) == 2  # no document
    assert "no document to tokenize" in capsys.readouterr().err
    import shutil

    import numpy as np

    from scaletrain.data.indexed import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "tok", np.uint16):  # an empty dataset all the same
        pass
    shutil.copyfile(FIXTURES / "gpt-neox-tokenizer.json", tmp_path / "tok.tokenizer.json")
    argv = tiny_argv(tmp_path / "run", tmp_path / "cache", "--data.paths", str(tmp_path / "tok"))
    assert train_cmd.main(argv) == 2
    err = capsys.readouterr().err
    assert "holds 0 documents" in err and "Traceback" not in err


def test_model_vocabulary_follows_the_tokenizer(tmp_path: Path, capsys) -> None:
    """Without --model.vocab_size the model takes the data tokenizer's vocabulary (GPT-NeoX's
    50k, far above the debug preset's 8192), and the dry run plans that same model."""
    from tokenizers import Tokenizer

    from scaletrain.commands import train as train_cmd
    from scaletrain.config import load_config
    from tests.helpers.trainer import tiny_argv

    tok = FIXTURES / "gpt-neox-tokenizer.json"
    vocab = Tokenizer.from_file(str(tok)).get_vocab_size(with_added_tokens=True)
    first = sorted(FIXTURES.glob("ccnet_en_head-*.jsonl.gz"))[0]
    assert data_cmd.main(["tokenize", "--input", str(first), "--output", str(tmp_path / "d"),
                          "--tokenizer", str(tok), "--workers", "1"]) == 0
    argv = tiny_argv(tmp_path / "run", tmp_path / "cache", "--data.paths", str(tmp_path / "d"),
                     "--data.split", "90,10,0", "--training.steps", "1")
    at = argv.index("--model.vocab_size")
    del argv[at:at + 2]
    capsys.readouterr()
    assert train_cmd.main([*argv, "--dry-run", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["params"]
    trainer = Trainer(load_config(argv))
    assert trainer.model_args.vocab_size == vocab > 8192
    assert sum(p.numel() for p in trainer.model.parameters()) == planned
    assert len(trainer.train().losses) == 1
    with pytest.raises(ConfigError, match=f"the tokenizer has {vocab} tokens"):
        Trainer(load_config([*argv, "--model.vocab_size", "8192"]))
