from pathlib import Path

import pytest

from scaletrain.commands import data


def test_usage_and_unknown_subverb(capsys: pytest.CaptureFixture[str]) -> None:
    assert data.main([]) == 0
    assert "tokenize" in capsys.readouterr().out
    assert data.main(["tokenise"]) == 2
    assert "Did you mean 'tokenize'" in capsys.readouterr().err


def test_inspect_routes_indexed_prefixes(tmp_path: Path) -> None:
    (tmp_path / "corpus.idx").write_bytes(b"")
    assert data._module("inspect", [str(tmp_path / "corpus")]).endswith("data_inspect_indexed")
    assert data._module("inspect", [str(tmp_path / "corpus.bin")]).endswith("inspect_indexed")
    assert data._module("inspect", [str(tmp_path / "docs.jsonl")]).endswith("data_inspect")
