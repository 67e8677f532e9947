"""Language identification with py3langid, whose model ships inside the wheel (offline)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scaletrain.curate.documents import Document
from scaletrain.curate.pipeline import Step

_SAMPLE_CHARS = 4000  # the identifier reads the first characters (long documents: speed)


class LanguageFilter(Step):
    """Stores `language` and `language_score` in metadata and keeps documents in
    `languages` (None: keep all) with a score of at least `min_score`."""

    name = "language"

    def __init__(self, languages: Sequence[str] | None = ("en",), min_score: float = 0.65):
        super().__init__()
        self.languages = frozenset(languages) if languages else None
        self.min_score = min_score
        self._identifier: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_identifier"] = None
        return state

    def _load(self) -> Any:
        if self._identifier is None:
            try:
                from py3langid.langid import MODEL_FILE, LanguageIdentifier
            except ImportError as e:
                raise RuntimeError(
                    "the language filter needs py3langid: pip install 'scaletrain[curate]'"
                ) from e
            self._identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        return self._identifier

    def identify(self, text: str) -> tuple[str, float]:
        lang, score = self._load().classify(text[:_SAMPLE_CHARS].replace("\n", " "))
        return str(lang), float(score)

    def process(self, doc: Document) -> Document | str:
        lang, score = self.identify(doc.text)
        doc.metadata["language"] = lang
        doc.metadata["language_score"] = round(score, 4)
        if self.languages is not None and lang not in self.languages:
            return f"language_{lang}" if len(self.languages) == 1 else "language_other"
        if score < self.min_score:
            return "language_low_score"
        return doc

    def describe(self) -> str:
        langs = sorted(self.languages) if self.languages else "any"
        return f"{self.name}({langs}, score >= {self.min_score})"
