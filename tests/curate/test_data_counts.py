"""The web pipeline of docs/curate.md on the real fixtures (WARC + CCNet, one file copied), in
several tasks: every input document is either kept or dropped exactly once, each step's
counts chain (seen = kept + dropped, the next step sees what this one kept), the dropped
folder holds exactly the counted drops, duplicates point at the first copy in input order,
and the tokenized dataset is the kept documents encoded by `tokenizers` directly."""

from __future__ import annotations

import gzip
import json
import shutil
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer

from scaletrain.commands import data as data_cmd
from scaletrain.data.indexed import IndexedDataset
from tests.helpers.curate import fixture_dir

PIPELINE = """
write_dropped = true
[[steps]]
type = "language"
languages = ["en"]
[[steps]]
type = "gopher_repetition"
[[steps]]
type = "gopher_quality"
[[steps]]
type = "c4"
[[steps]]
type = "fineweb_quality"
[[steps]]
type = "exact_dedup"
[[steps]]
type = "minhash_dedup"
verify = true
[[steps]]
type = "pii"
"""
WARC_PAGES = 22 + 15  # HTML responses of the two WARC files (fixtures README)


def _jsonl(files: list[Path]) -> list[dict]:
    return [json.loads(line) for f in files for line in f.read_text("utf-8").splitlines()]


def test_every_document_is_kept_or_dropped_once_and_tokens_match(tmp_path: Path) -> None:
    fx = fixture_dir()
    src = tmp_path / "src"
    src.mkdir()
    for f in sorted(fx.glob("*.gz")):
        shutil.copy(f, src / f.name)
    shutil.copy(fx / "ccnet_en_head-0091.jsonl.gz", src / "zz-copy.jsonl.gz")  # read last
    ccnet = {f.name: [json.loads(x) for x in gzip.decompress(f.read_bytes()).splitlines()]
             for f in sorted(src.glob("*.jsonl.gz"))}
    (tmp_path / "p.toml").write_text(PIPELINE)
    out = tmp_path / "cur"
    assert data_cmd.main(["curate", "--config", str(tmp_path / "p.toml"), "--input", str(src),
                          "--output", str(out), "--workers", "1", "--tasks", "3"]) == 0

    stats = json.loads((out / "stats.json").read_text())
    assert stats["docs_in"] == WARC_PAGES + sum(len(v) for v in ccnet.values())
    seen = stats["docs_in"]
    for step in stats["steps"]:
        assert step["seen"] == seen == step["kept"] + sum(step["dropped"].values()), step
        seen = step["kept"]
    assert seen == stats["docs_out"]

    manifest = json.loads((out / "manifest.json").read_text())
    kept = _jsonl([out / e["path"] for e in manifest["files"]])
    dropped = _jsonl(sorted((out / "_dropped").rglob("*.jsonl")))
    assert len(kept) == stats["docs_out"] == manifest["documents"]
    assert len(kept) + len(dropped) == stats["docs_in"]
    by_reason = Counter((d["metadata"]["dropped_by"], d["metadata"]["drop_reason"])
                        for d in dropped)
    assert by_reason == Counter({(s["name"], r): n for s in stats["steps"]
                                 for r, n in s["dropped"].items()})
    # the copied file's documents are dropped as duplicates of the originals, which stay
    # unless a filter dropped them first (then their copies went the same way)
    copies = {r["id"] for r in ccnet["zz-copy.jsonl.gz"]}
    dup = [d for d in dropped if d["metadata"]["drop_reason"] == "exact_duplicate"]
    filtered = {d["id"] for d in dropped if d["metadata"]["dropped_by"] != "exact_dedup"}
    assert {d["id"] for d in dup} >= copies - filtered
    assert all(d["metadata"]["duplicate_of"] == d["id"] for d in dup if d["id"] in copies)
    kept_ids = Counter(d["id"] for d in kept)
    assert all(kept_ids[i] == 1 for i in copies - filtered)  # exactly one of each pair

    prefix = tmp_path / "tok" / "web"
    neox = fx / "gpt-neox-tokenizer.json"
    assert data_cmd.main(["tokenize", "--input", str(out), "--output", str(prefix),
                          "--tokenizer", str(neox), "--workers", "1"]) == 0
    ds = IndexedDataset(prefix)
    tok = Tokenizer.from_file(str(neox))
    eos = tok.token_to_id("<|endoftext|>")
    assert ds.num_documents == len(kept)
    for i, d in enumerate(kept):  # manifest order, EOS after each document, nothing else
        assert ds[i].tolist() == tok.encode(d["text"], add_special_tokens=False).ids + [eos]
