"""The cached, tokenized corpus: discovery, tokenizer, EOS layout, split, cache, errors."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from scaletrain.config import DataConfig
from scaletrain.data import corpus as corpus_mod
from scaletrain.data.corpus import CorpusError, TokenizedCorpus, discover_files, prepare_corpus

DOCS = {
    f"part{i % 3}/doc{i:02d}.txt": (
        f"Document {i}: the quick brown fox jumps over {i} lazy dogs.\n"
        + f"    def f(x):\n        return x * {i}  # résumé ✓ 🦊\n" * (3 + i % 4)
        + ("\ttabs and  double  spaces\r\n" if i % 2 else "")
    )
    for i in range(12)
}


def _write(root: Path, docs: dict[str, str]) -> Path:
    for rel, text in docs.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return root


def _cfg(tmp_path: Path, **kw) -> DataConfig:
    base = dict(
        dataset="text_dir",
        path=str(tmp_path / "text"),
        file_glob="**/*.txt",
        cache_dir=str(tmp_path / "cache"),
        vocab_size=300,
        val_fraction=0.25,
        curate=False,  # the corpus mechanics; curation has its own test below
    )
    base.update(kw)
    return DataConfig(**base)


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    return _write(tmp_path / "text", DOCS)


def _split_docs(c: TokenizedCorpus, stream: np.ndarray) -> list[str]:
    """Decode a token stream back into its documents (each one ends with EOS)."""
    tok = c.load_tokenizer()
    ids = stream.tolist()
    assert ids[-1] == c.eos_id
    docs, cur = [], []
    for t in ids:
        if t == c.eos_id:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    return docs


def test_tokenizer_round_trips_any_text(text_dir: Path, tmp_path: Path) -> None:
    c = prepare_corpus(_cfg(tmp_path), progress=False)
    tok = c.load_tokenizer()
    for text in [*DOCS.values(), "  leading spaces\n\n\ttab", "ünïcödé 漢字 🦊 \x00\x7f", ""]:
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.token_to_id("<|endoftext|>") == c.eos_id
    assert c.vocab_size == tok.get_vocab_size() <= 300
    assert c.train.dtype == np.uint16 and c.val.dtype == np.uint16
    assert int(c.train.max()) < c.vocab_size


def test_streams_hold_documents_separated_by_eos_and_split_by_document(
    text_dir: Path, tmp_path: Path
) -> None:
    c = prepare_corpus(_cfg(tmp_path), progress=False)
    train_docs, val_docs = _split_docs(c, c.train), _split_docs(c, c.val)
    assert len(val_docs) >= 3 and len(train_docs) + len(val_docs) == 12  # whole documents
    assert sum(map(len, val_docs)) >= 0.25 * sum(map(len, DOCS.values()))
    assert not set(train_docs) & set(val_docs)
    assert sorted(train_docs + val_docs) == sorted(DOCS.values())
    # Documents keep the sorted file order within each split.
    order = [DOCS[k] for k in sorted(DOCS)]
    assert train_docs == [d for d in order if d in train_docs]
    meta = json.loads((c.cache_dir / "meta.json").read_text())
    assert sorted(meta["val_documents"]) == sorted(k for k, v in DOCS.items() if v in val_docs)


def test_val_split_is_deterministic_and_never_empty() -> None:
    sizes = [100] * 12
    a = corpus_mod.split_documents(sizes, 0.25)
    assert len(a) == 3 and a.tolist() == corpus_mod.split_documents(sizes, 0.25).tolist()
    assert len(corpus_mod.split_documents([5, 5], 0.001)) == 1  # at least one val doc
    assert len(corpus_mod.split_documents([5, 5], 0.999)) == 1  # at least one train doc
    # Tiny documents alone cannot make the validation split: it also gets its share of text.
    sizes = [10] * 99 + [10_000]
    val = corpus_mod.split_documents(sizes, 0.02)
    assert sum(sizes[i] for i in val) >= 0.02 * sum(sizes) and len(val) < 99


def test_cache_hit_loads_without_rebuilding(
    text_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(tmp_path)
    first = prepare_corpus(cfg, progress=False)
    meta = first.cache_dir / "meta.json"
    mtime = meta.stat().st_mtime_ns

    def no_training(*a, **k):
        raise AssertionError("tokenizer trained again on a cache hit")

    monkeypatch.setattr(corpus_mod, "train_tokenizer", no_training)
    monkeypatch.setattr(corpus_mod, "write_texts", no_training)
    second = prepare_corpus(cfg, progress=False)
    assert second.cache_dir == first.cache_dir
    assert meta.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(second.train, first.train)
    np.testing.assert_array_equal(second.val, first.val)
    assert isinstance(second.train, np.memmap) and not second.train.flags.writeable
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.cache_dir.name]


def test_cache_key_follows_content(text_dir: Path, tmp_path: Path) -> None:
    a = prepare_corpus(_cfg(tmp_path), progress=False).cache_dir
    assert prepare_corpus(_cfg(tmp_path, vocab_size=301), progress=False).cache_dir != a
    assert prepare_corpus(_cfg(tmp_path, val_fraction=0.5), progress=False).cache_dir != a
    (text_dir / "part0/doc00.txt").write_text("changed document text\n")
    assert prepare_corpus(_cfg(tmp_path), progress=False).cache_dir != a


def test_incomplete_entry_is_rebuilt(text_dir: Path, tmp_path: Path) -> None:
    c = prepare_corpus(_cfg(tmp_path), progress=False)
    expected = np.array(c.train)
    (c.cache_dir / "meta.json").unlink()  # e.g. a cache copied half-way
    again = prepare_corpus(_cfg(tmp_path), progress=False)
    np.testing.assert_array_equal(again.train, expected)
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_losing_a_build_race_uses_the_winners_entry(
    text_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build = corpus_mod._build

    def build_then_lose(cfg, root, files, tok_file, tmp, key, progress):
        meta = real_build(cfg, root, files, tok_file, tmp, key, progress)
        winner = tmp.parent / f"{cfg.dataset}-{key}"  # another process renames first
        shutil.copytree(tmp, winner)
        (winner / "winner.txt").write_text("")
        return meta

    monkeypatch.setattr(corpus_mod, "_build", build_then_lose)
    c = prepare_corpus(_cfg(tmp_path), progress=False)
    assert (c.cache_dir / "winner.txt").exists()
    assert _split_docs(c, c.val) and len(c.train) > 0
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [c.cache_dir.name]


def test_max_bytes_caps_in_sorted_order(text_dir: Path, tmp_path: Path) -> None:
    sizes = [len(DOCS[k].encode()) for k in sorted(DOCS)]
    cap = sizes[0] + sizes[1] + sizes[2] + 10
    _, files = discover_files(_cfg(tmp_path, max_bytes=cap))
    assert [f.rel for f in files] == sorted(DOCS)[:4]
    assert sum(f.read_bytes for f in files) == cap and files[-1].read_bytes == 10


def test_existing_tokenizer_is_used(text_dir: Path, tmp_path: Path) -> None:
    first = prepare_corpus(_cfg(tmp_path), progress=False)
    _write(tmp_path / "other", {"a.txt": "some other text\n" * 20, "b.txt": "more text\n" * 20})
    cfg = _cfg(tmp_path, path=str(tmp_path / "other"), tokenizer=str(first.cache_dir))
    c = prepare_corpus(cfg, progress=False)
    assert c.vocab_size == first.vocab_size and c.eos_id == first.eos_id
    assert c.tokenizer_path.read_bytes() == first.tokenizer_path.read_bytes()
    with pytest.raises(CorpusError, match="tokenizer.json"):
        prepare_corpus(_cfg(tmp_path, tokenizer=str(tmp_path / "nope")), progress=False)


def test_clear_errors_for_unusable_corpora(tmp_path: Path) -> None:
    (tmp_path / "text").mkdir()
    with pytest.raises(CorpusError, match="no files match"):
        prepare_corpus(_cfg(tmp_path), progress=False)
    with pytest.raises(CorpusError, match="not a directory"):
        prepare_corpus(_cfg(tmp_path, path=str(tmp_path / "missing")), progress=False)
    _write(tmp_path / "text", {"only.txt": "just one document\n", "blank.txt": "  \n"})
    with pytest.raises(CorpusError, match="at least 2"):
        prepare_corpus(_cfg(tmp_path), progress=False)
    _write(tmp_path / "text", {"second.txt": "another document\n"})
    with pytest.raises(CorpusError, match="vocab_size must be at least 257"):
        prepare_corpus(_cfg(tmp_path, vocab_size=100), progress=False)
    assert not list((tmp_path / "cache").glob(".tmp-*"))  # failed builds leave nothing


def test_glob_semantics() -> None:
    rx = corpus_mod._glob_regex("**/*.txt")
    assert rx.match("a.txt") and rx.match("x/y/a.txt") and not rx.match("a.txt.bak")
    flat = corpus_mod._glob_regex("*.txt")
    assert flat.match("a.txt") and not flat.match("x/a.txt")


def test_token_dtype_widens_for_large_vocabularies() -> None:
    assert corpus_mod._token_dtype(65536) == np.uint16
    assert corpus_mod._token_dtype(65537) == np.int32


def test_stdlib_discovery_and_small_build(tmp_path: Path) -> None:
    root, files = discover_files(DataConfig(dataset="stdlib"))
    assert root == Path(sysconfig.get_paths()["stdlib"])
    rels = [f.rel for f in files]
    assert rels == sorted(rels) and len(rels) > 300
    assert {"os.py", "json/__init__.py", "collections/__init__.py"} <= set(rels)
    assert not any({"site-packages", "dist-packages"} & set(r.split("/")[:-1]) for r in rels)
    assert all(r.endswith(".py") for r in rels)
    tests = {"test", "tests", "idle_test"}
    _, no_tests = discover_files(DataConfig(dataset="stdlib", stdlib_tests=False))
    assert not any(tests & set(f.rel.split("/")[:-1]) for f in no_tests)
    assert len(no_tests) < len(files)

    cfg = DataConfig(dataset="stdlib", max_bytes=300_000, vocab_size=512, cache_dir=str(tmp_path))
    c = prepare_corpus(cfg, progress=False)
    meta = json.loads((c.cache_dir / "meta.json").read_text())
    assert meta["bytes"] == 300_000 and meta["files"] == len(discover_files(cfg)[1])
    assert len(c.train) > 50_000 and len(c.val) > 0
    text = c.load_tokenizer().decode(c.train[:2000].tolist())
    assert "import" in text or "def " in text
    cur = meta["curation"]  # data.curate is on by default
    assert cur["documents_out"] == meta["documents"] <= cur["documents_in"] <= meta["files"]


def test_curation_drops_duplicates_and_keys_the_cache(tmp_path: Path) -> None:
    body = "def f{0}(x):\n    return x * {0} + {0}  # a function that is long enough\n"
    docs = {f"m{i}.txt": body.format(i) * 4 for i in range(6)}
    docs["copy.txt"] = docs["m3.txt"]
    _write(tmp_path / "text", docs)
    curated = prepare_corpus(_cfg(tmp_path, curate=True), progress=False)
    meta = json.loads((curated.cache_dir / "meta.json").read_text())
    assert meta["curation"]["dropped"] == {"exact_duplicate": 1}
    assert meta["documents"] == 6 and meta["curation"]["documents_in"] == 7
    _write(tmp_path / "short", {"a.txt": "x = 1\n", "b.txt": "y = 2\n"})
    with pytest.raises(CorpusError, match="curation kept 0 of 2 documents"):
        prepare_corpus(_cfg(tmp_path, curate=True, path=str(tmp_path / "short")), progress=False)
    plain = prepare_corpus(_cfg(tmp_path), progress=False)
    assert plain.cache_dir != curated.cache_dir
    assert json.loads((plain.cache_dir / "meta.json").read_text())["documents"] == 7
