"""Perplexity of each document under a KenLM n-gram model from a local ARPA or binary file
(CCNet's quality signal). `kenlm` is optional (it builds from source)."""

from __future__ import annotations

import os
import re
from typing import Any

from scaletrain.curate.documents import Document
from scaletrain.curate.pipeline import Step
from scaletrain.optional import require

_TOKEN = re.compile(r"\w+|[^\w\s]")


def kenlm_module() -> Any:
    return require("kenlm", "the perplexity filter needs kenlm: pip install kenlm (builds from "
                            "source, needs a C++ compiler)")


def normalize_for_lm(line: str) -> str:
    """Lower case, punctuation split from words, one space between tokens."""
    return " ".join(_TOKEN.findall(line.lower()))


class PerplexityScorer(Step):
    """Stores `metadata[key]` = perplexity (per token, line by line as CCNet does)."""

    name = "perplexity"

    def __init__(self, model_path: str, key: str = "perplexity"):
        super().__init__()
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"KenLM model '{model_path}' not found (an .arpa or .bin file)")
        self.model_path, self.key = model_path, key
        self._model: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_model": None}

    def perplexity(self, text: str) -> float:
        if self._model is None:
            self._model = kenlm_module().Model(self.model_path)
        log10, n = 0.0, 0
        for line in text.split("\n"):
            norm = normalize_for_lm(line)
            if norm:
                log10 += self._model.score(norm, bos=True, eos=True)
                n += len(norm.split()) + 1
        return 10.0 ** (-log10 / n) if n else float("inf")

    def process(self, doc: Document) -> Document:
        doc.metadata[self.key] = round(self.perplexity(doc.text), 3)
        return doc
