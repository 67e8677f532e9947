"""A fastText quality classifier: train on positive/negative example files, score documents.

Uses the `fasttext-numpy2-wheel` package (`import fasttext`); the classic `fasttext-wheel`
cannot predict under numpy 2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

from scaletrain.curate.documents import Document
from scaletrain.curate.io.readers import read_documents
from scaletrain.curate.pipeline import Step
from scaletrain.optional import require

_WS = re.compile(r"\s+")


def _fasttext() -> Any:
    return require("fasttext", "fastText quality filtering needs fasttext-numpy2-wheel: pip "
                               "install 'scaletrain[curate]'")


def _line(text: str) -> str:
    return _WS.sub(" ", text).strip().lower()


MAX_BUCKETS = 2_000_000  # fastText's default
MIN_BUCKETS = 10_000


class DocumentTexts:
    """The texts of the documents in several files, folders or globs (for training)."""

    def __init__(self, paths: list[str]):
        self.paths = list(paths)

    def __iter__(self) -> Iterator[str]:
        return (d.text for d in read_documents(self.paths))

    def __repr__(self) -> str:
        return ", ".join(repr(p) for p in self.paths)


def size_buckets(n_ngrams: int) -> int:
    """Hash buckets for `n_ngrams` distinct word n-grams: one per n-gram (fastText's default
    of 2,000,000 is meant for corpora of far more n-grams, so it collides more), between
    MIN_BUCKETS and that default. The input matrix has (words + buckets) x dim floats: the
    default alone is 512 MB at dim 64."""
    return max(MIN_BUCKETS, min(MAX_BUCKETS, n_ngrams))


def train_classifier(
    positive: str | Iterable[str],
    negative: str | Iterable[str],
    output: str,
    epoch: int = 10,
    lr: float = 0.5,
    word_ngrams: int = 2,
    dim: int = 64,
    seed_threads: int = 1,
    chunk_words: int = 100,
    bucket: int | None = None,
) -> str:
    """Train a binary classifier (labels `hq` and `lq`) and save it to `output` (.bin).

    `positive` / `negative`: a path/glob of documents (JSONL, Parquet, text), several of them
    (`DocumentTexts([...])`) or texts. Each document is cut into examples of `chunk_words`
    words: one example per long document gives fastText too few updates to learn from a
    small set. `bucket` (hash buckets of word n-grams) defaults to a size fitted to the
    distinct n-grams of the training data (`size_buckets`), so a model of a few hundred
    documents is megabytes, not the 0.5 GB of fastText's default.
    """
    _fasttext()  # a clear error before any work when fastText is missing
    fd, train_file = tempfile.mkstemp(suffix=".txt")
    ngrams: set[int] = set()
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for label, src in (("hq", positive), ("lq", negative)):
                texts = (d.text for d in read_documents(src)) if isinstance(src, str) else src
                n = 0
                for t in texts:
                    w = _line(t).split()
                    if word_ngrams > 1 and len(ngrams) <= MAX_BUCKETS:
                        ngrams.update(hash(tuple(w[i : i + word_ngrams]))
                                      for i in range(len(w) - word_ngrams + 1))
                    for i in range(0, len(w), chunk_words):
                        f.write(f"__label__{label} {' '.join(w[i : i + chunk_words])}\n")
                        n += 1
                if n == 0:
                    raise ValueError(
                        f"no {label} examples in {src!r}; give documents to learn from"
                    )
        settings = {"input": train_file, "epoch": epoch, "lr": lr, "wordNgrams": word_ngrams,
                    "dim": dim, "thread": seed_threads, "verbose": 0,
                    "bucket": bucket if bucket is not None else size_buckets(len(ngrams))}
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        tmp = output + ".tmp"
        _train_in_fresh_process(settings, tmp)
    finally:
        os.remove(train_file)
    os.replace(tmp, output)
    return output


def _train_in_fresh_process(settings: dict[str, Any], path: str) -> None:
    """fastText keeps state between trainings in one process, and a second small model
    there can diverge ("Encountered NaN"): each model is trained by a new interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import fasttext; "
            "fasttext.train_supervised(**json.loads(sys.argv[2])).save_model(sys.argv[3])")
    proc = subprocess.run([sys.executable, "-c", code, root, json.dumps(settings), path],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise ValueError(f"fastText training failed: {last}")


class FastTextScorer(Step):
    """Stores `metadata[key]` = P(label) from a fastText model file; keeps every document
    (follow it by a ScoreFilter to filter)."""

    name = "fasttext_score"

    def __init__(self, model_path: str, key: str = "fasttext_hq", label: str = "hq"):
        super().__init__()
        if not os.path.isfile(model_path):
            raise FileNotFoundError(
                f"fastText model '{model_path}' not found; train one with "
                "`scaletrain data quality --train-positive ...`"
            )
        self.model_path, self.key, self.label = model_path, key, f"__label__{label}"
        self._model: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_model": None}

    def score(self, text: str) -> float:
        if self._model is None:
            self._model = _fasttext().load_model(self.model_path)
        labels, probs = self._model.predict(_line(text), k=-1)
        return float(dict(zip(labels, probs)).get(self.label, 0.0))

    def process(self, doc: Document) -> Document:
        doc.metadata[self.key] = round(self.score(doc.text), 5)
        return doc

    def describe(self) -> str:
        return f"{self.name}({os.path.basename(self.model_path)} -> {self.key})"
