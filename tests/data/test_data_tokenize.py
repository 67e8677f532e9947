"""Documents -> indexed dataset: equal to calling `tokenizers` directly, parallel = serial,
JSONL = Parquet; the tokenize and inspect verbs."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from scaletrain.commands import data as data_cmd
from scaletrain.curate.io.readers import MalformedRecord
from scaletrain.data.indexed import IndexedDataset
from scaletrain.data.tokenize import tokenize_to_indexed
from scaletrain.data.tokenize_inputs import TokenizeError, input_shards

FIXTURES = Path(__file__).resolve().parents[2] / "../shared/fixtures/data"
if not FIXTURES.is_dir():
    FIXTURES = Path("/work/shared/fixtures/data")
NEOX = FIXTURES / "gpt-neox-tokenizer.json"
pytestmark = pytest.mark.skipif(not NEOX.is_file(), reason="shared fixtures not present")


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    for f in sorted(FIXTURES.glob("ccnet_en_head-*.jsonl.gz")):
        shutil.copy(f, folder / f.name)
    return folder


def _texts(folder: Path) -> list[str]:
    out = []
    for f in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(f, "rt") as fh:
            out += [json.loads(line)["text"] for line in fh if line.strip()]
    return out


def test_tokens_equal_the_tokenizer_called_directly(shards: Path, tmp_path: Path) -> None:
    stats = tokenize_to_indexed(input_shards(shards), tmp_path / "out/cc", NEOX, workers=1)
    ds = IndexedDataset(tmp_path / "out/cc")
    tok = Tokenizer.from_file(str(NEOX))
    eos = tok.token_to_id("<|endoftext|>")
    texts = _texts(shards)
    assert ds.num_documents == len(ds) == len(texts) == stats.documents == 20
    assert ds.dtype == np.uint16  # 50k vocabulary fits
    for i, text in enumerate(texts):
        assert ds[i].tolist() == tok.encode(text, add_special_tokens=False).ids + [eos]
    assert stats.tokens == ds.num_tokens and stats.tokens_per_document == ds.num_tokens / 20
    assert Path(f"{tmp_path}/out/cc.tokenizer.json").read_bytes() == NEOX.read_bytes()
    assert not list((tmp_path / "out").glob("*tmp*"))


def test_parallel_output_is_byte_identical(shards: Path, tmp_path: Path) -> None:
    files = input_shards(shards)
    tokenize_to_indexed(files, tmp_path / "serial", NEOX, workers=1)
    tokenize_to_indexed(files, tmp_path / "parallel", NEOX, workers=2)
    for ext in (".bin", ".idx"):
        assert Path(f"{tmp_path}/serial{ext}").read_bytes() == \
            Path(f"{tmp_path}/parallel{ext}").read_bytes()


def test_parquet_input_gives_the_same_dataset(shards: Path, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = _texts(shards)
    pq.write_table(pa.table({"id": list(range(20)), "text": texts}), tmp_path / "d.parquet")
    tokenize_to_indexed([tmp_path / "d.parquet"], tmp_path / "pq", NEOX)
    tokenize_to_indexed(input_shards(shards), tmp_path / "js", NEOX)
    assert Path(f"{tmp_path}/pq.bin").read_bytes() == Path(f"{tmp_path}/js.bin").read_bytes()


def test_zstd_jsonl_gives_the_same_dataset(shards: Path, tmp_path: Path) -> None:
    zstd = pytest.importorskip("zstandard")
    lines = "".join(json.dumps({"text": t}) + "\n" for t in _texts(shards))
    (tmp_path / "d.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(lines.encode()))
    tokenize_to_indexed(input_shards(tmp_path / "d.jsonl.zst"), tmp_path / "zs", NEOX)
    tokenize_to_indexed(input_shards(shards), tmp_path / "js", NEOX)
    assert Path(f"{tmp_path}/zs.bin").read_bytes() == Path(f"{tmp_path}/js.bin").read_bytes()


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"content": "no text field"}\n')
    with pytest.raises(MalformedRecord, match=r"x.jsonl:1: no string field 'text'"):
        tokenize_to_indexed([tmp_path / "x.jsonl"], tmp_path / "o", NEOX, strict=True)
    with pytest.raises(TokenizeError, match=r"no document to tokenize in 1 file\(s\): 1 "
                       r"malformed .*x.jsonl:1: no string field 'text'"):
        tokenize_to_indexed([tmp_path / "x.jsonl"], tmp_path / "o", NEOX)
    assert not list(tmp_path.glob("o.*"))  # nothing written, no parts left
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizeError, match="no .jsonl"):
        input_shards(tmp_path / "empty")


def test_tokenize_and_inspect_verbs(shards: Path, tmp_path: Path, capsys) -> None:
    prefix = tmp_path / "cli/cc"
    argv = ["tokenize", "--input", str(shards), "--output", str(prefix),
            "--train-tokenizer", "400", "--workers", "2", "--json"]
    assert data_cmd.main(argv) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["documents"] == 20 and stats["tokens"] > 0 and stats["tokens_per_s"] > 0
    assert data_cmd.main(["inspect", str(prefix), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {k: info[k] for k in ("documents", "sequences", "dtype")} == \
        {"documents": 20, "sequences": 20, "dtype": "uint16"}
    assert info["tokens"] == stats["tokens"]
    assert _texts(shards)[0].startswith(info["sample"]["text"][:100])  # decodes (own BPE)
    assert data_cmd.main(["inspect", f"{prefix}.bin"]) == 0
    assert "20 documents" in capsys.readouterr().out
    assert data_cmd.main(["tokenize", "--input", str(tmp_path / "nope"), "--output", "x",
                          "--tokenizer", str(NEOX)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_ray_executor_gives_the_same_bytes(shards: Path, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    files = input_shards(shards)
    tokenize_to_indexed(files, tmp_path / "local", NEOX, workers=1)
    try:
        tokenize_to_indexed(files, tmp_path / "ray", NEOX, workers=2, executor="ray")
    finally:
        ray.shutdown()
    for ext in (".bin", ".idx"):
        assert Path(f"{tmp_path}/ray{ext}").read_bytes() == \
            Path(f"{tmp_path}/local{ext}").read_bytes()


def test_bos_and_eos_frame_each_document(tmp_path: Path) -> None:
    from scaletrain.data.tokenizer import TextTokenizer, TokenizerError, train_bpe

    tok = train_bpe(["hello world, hello tokens"] * 5, 300)
    tok.save(str(tmp_path / "plain.json"))
    with pytest.raises(TokenizerError, match="no begin-of-document token"):
        TextTokenizer.load(tmp_path / "plain.json", add_bos=True)
    tok.add_special_tokens(["<s>"])
    tok.save(str(tmp_path / "bos.json"))
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n{"text": "world"}\n')
    tokenize_to_indexed([tmp_path / "d.jsonl"], tmp_path / "o", tmp_path / "bos.json",
                        add_bos=True)
    ds = IndexedDataset(tmp_path / "o")
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("<|endoftext|>")
    for i, text in enumerate(["hello", "world"]):
        assert ds[i].tolist() == [bos, *tok.encode(text).ids, eos]
