"""Model-based quality: fastText classifier, KenLM perplexity, HF classifier, score filter."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from scaletrain.curate.documents import Document
from scaletrain.curate.io import read_documents
from scaletrain.curate.quality import ScoreFilter
from tests.helpers.curate import fixture_dir


def test_score_filter_bounds_and_missing() -> None:
    f = ScoreFilter("edu", min_score=2.5)
    assert isinstance(f.process(Document("a", "t", {"edu": 3.0})), Document)
    assert f.process(Document("a", "t", {"edu": 1.0})) == "edu_below_2.5"
    assert f.process(Document("a", "t", {})) == "edu_missing"
    assert isinstance(
        ScoreFilter("edu", 1, keep_missing=True).process(Document("a", "t")), Document
    )
    # CCNet's own perplexity is in the real fixture's metadata: filter on it directly
    docs = list(read_documents(str(fixture_dir() / "ccnet_en_head-*.jsonl.gz")))
    ppl = sorted(d.metadata["perplexity"] for d in docs)
    cut = ppl[len(ppl) // 2]
    kept = [
        d for d in docs if isinstance(ScoreFilter("perplexity", max_score=cut).process(d), Document)
    ]
    assert len(kept) == sum(p <= cut for p in ppl) and 0 < len(kept) < len(docs)
    with pytest.raises(ValueError, match="min_score"):
        ScoreFilter("x")


def test_fasttext_classifier_separates_prose_from_code(tmp_path: Path) -> None:
    pytest.importorskip("fasttext")
    import sysconfig

    from scaletrain.curate.quality import FastTextScorer, train_classifier

    prose = [d.text for d in read_documents(str(fixture_dir() / "ccnet_en_head-*.jsonl.gz"))]
    prose += [d.text for d in read_documents(str(fixture_dir() / "cc_sample-0000.warc.gz"))]
    lib = Path(sysconfig.get_paths()["stdlib"])
    code = [p.read_text() for p in sorted(lib.glob("*.py"))[:60]]
    model = str(tmp_path / "clf.bin")
    train_classifier(prose[::2], code[::2], model, epoch=20)
    scorer = FastTextScorer(model)
    p_scores = [scorer.process(Document("p", t)).metadata["fasttext_hq"] for t in prose[1::2]]
    c_scores = [scorer.process(Document("c", t)).metadata["fasttext_hq"] for t in code[1::2]]
    assert sum(p_scores) / len(p_scores) > 0.7 and sum(c_scores) / len(c_scores) < 0.3
    assert min(p_scores) > max(c_scores) or sum(s > 0.5 for s in p_scores) >= 0.9 * len(p_scores)


def test_kenlm_perplexity_matches_a_hand_computed_bigram_model(tmp_path: Path) -> None:
    try:
        import kenlm  # noqa: F401
    except ImportError:
        pytest.skip("kenlm is not installed (optional: pip install kenlm, builds from source)")
    from scaletrain.curate.quality import PerplexityScorer

    # a bigram ARPA model (KenLM needs order >= 2) with every bigram the text uses
    uni = {"<s>": None, "</s>": 0.2, "<unk>": 0.1, "the": 0.4, "cat": 0.3}
    bi = {"<s> the": 0.5, "the cat": 0.6, "cat </s>": 0.7, "the the": 0.3, "the </s>": 0.4}
    arpa = ["\\data\\", f"ngram 1={len(uni)}", f"ngram 2={len(bi)}", "", "\\1-grams:"]
    arpa += [f"{-99 if p is None else math.log10(p):.6f}\t{w}\t0" for w, p in uni.items()]
    arpa += ["", "\\2-grams:"] + [f"{math.log10(p):.6f}\t{w}" for w, p in bi.items()]
    arpa += ["", "\\end\\", ""]
    path = tmp_path / "bi.arpa"
    path.write_text("\n".join(arpa))
    scorer = PerplexityScorer(str(path))
    ppl = scorer.process(Document("d", "The cat\nthe the")).metadata["perplexity"]
    # two lines, each scored from <s> to </s>: 6 predicted tokens
    expected = (0.5 * 0.6 * 0.7 * 0.5 * 0.3 * 0.4) ** (-1 / 6)
    assert ppl == pytest.approx(expected, rel=1e-4)


def test_hf_classifier_scores_in_batches(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    from scaletrain.curate.quality import HFClassifierScorer

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(fixture_dir() / "gpt-neox-tokenizer.json"), pad_token="<|padding|>"
    )
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=len(tok),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=2,
        max_position_embeddings=128,
        id2label={0: "low", 1: "high"},
        label2id={"low": 0, "high": 1},
    )
    BertForSequenceClassification(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    texts = ["a short one", "a much longer document " * 8, "medium length text here", "x"]
    batched = HFClassifierScorer(str(tmp_path / "m"), label="high", batch_size=4, device="cpu")
    one = HFClassifierScorer(str(tmp_path / "m"), label="high", batch_size=1, device="cpu")
    b = batched.process_batch([Document(str(i), t) for i, t in enumerate(texts)])
    s = [one.process(Document(str(i), t)) for i, t in enumerate(texts)]
    sb = [d.metadata["hf_score"] for d in b]
    assert all(0.0 <= x <= 1.0 for x in sb)
    assert sb == pytest.approx([d.metadata["hf_score"] for d in s], abs=1e-4)  # padding-safe


def test_fasttext_model_is_sized_to_its_data_and_takes_several_inputs(tmp_path: Path,
                                                                      capsys) -> None:
    """Two positive and two negative inputs; the model's n-gram buckets follow the data, so
    a model of a few dozen documents is megabytes (fastText's default bucket count alone
    makes 512 MB at dim 64)."""
    pytest.importorskip("fasttext")
    import json as json_mod
    import sysconfig

    from scaletrain.commands import data as data_cmd
    from scaletrain.curate.quality.fasttext_clf import MAX_BUCKETS, FastTextScorer
    from tests.helpers.curate import fixture_dir

    fx = fixture_dir()
    std = Path(sysconfig.get_paths()["stdlib"])
    model = tmp_path / "m.bin"
    argv = ["quality", "--train-positive", str(fx / "ccnet_en_head-0091.jsonl.gz"),
            str(fx / "ccnet_en_head-0174.jsonl.gz"), "--train-negative",
            str(Path(json_mod.__file__).parent), str(std / "email" / "*.py"),
            "--fasttext", str(model)]
    assert data_cmd.main(argv) == 0
    size = model.stat().st_size
    assert size < 64 * 4 * MAX_BUCKETS / 20  # far below the default's 512 MB
    scorer = FastTextScorer(str(model))
    prose = scorer.score(" ".join(["The town council met on Monday to discuss the new park."
                                   " Residents said they would like more trees and benches."]))
    code = scorer.score((std / "csv.py").read_text())
    assert prose > 0.5 > code
    capsys.readouterr()
