"""Keep documents by a score stored in metadata (by any scorer, or by the input itself)."""

from __future__ import annotations

from scaletrain.curate.documents import Document
from scaletrain.curate.pipeline import Filter


class ScoreFilter(Filter):
    """Keeps documents with `min_score <= metadata[key] <= max_score` (either bound may be
    None). A missing or non-numeric score drops the document unless `keep_missing`."""

    name = "score_filter"

    def __init__(
        self,
        key: str,
        min_score: float | None = None,
        max_score: float | None = None,
        keep_missing: bool = False,
    ):
        super().__init__()
        if min_score is None and max_score is None:
            raise ValueError(f"score filter on '{key}': give min_score and/or max_score")
        self.key, self.min_score, self.max_score = key, min_score, max_score
        self.keep_missing = keep_missing
        self.name = f"score_filter[{key}]"

    def reason(self, doc: Document) -> str | None:
        value = doc.metadata.get(self.key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None if self.keep_missing else f"{self.key}_missing"
        if self.min_score is not None and value < self.min_score:
            return f"{self.key}_below_{self.min_score}"
        if self.max_score is not None and value > self.max_score:
            return f"{self.key}_above_{self.max_score}"
        return None

    def describe(self) -> str:
        return f"{self.name}({self.min_score} <= {self.key} <= {self.max_score})"
