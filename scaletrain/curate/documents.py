"""The document record that flows through the curation pipeline."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Document:
    """One document: a stable `id`, its `text` and free-form `metadata` (JSON-serializable).

    Steps may rewrite `text` (PII removal, line-level filters) and add metadata (scores,
    language); the id never changes, so a document can be traced from input to output.
    """

    id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    # where the document sits in a run's input ("shard:position"; set by the runner, never
    # written): global steps decide by position, so repeated ids cannot confuse them
    pos: str | None = field(default=None, repr=False, compare=False)
    # "code" (read from a source file or plain text that is not prose) or "web" (WARC, WET,
    # HTML, JSON lines, Parquet records, prose text files); set by the runner from the
    # file's format, never written
    kind: str | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "metadata": self.metadata}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, record: dict[str, Any], default_id: str) -> Document:
        """Build from a record with at least `text` (str); `id` defaults to `default_id`.

        Every other top-level key of a record without a `metadata` object is kept as metadata
        (CCNet, RedPajama and Dolma put `url`, `source`, ... at the top level).
        """
        text = record.get("text")
        if not isinstance(text, str):
            raise ValueError("record has no string field 'text'")
        rid = record.get("id")
        meta = record.get("metadata")
        if isinstance(meta, str):  # Parquet written by us stores metadata as a JSON string
            with contextlib.suppress(ValueError):
                meta = json.loads(meta)
        extra = {k: v for k, v in record.items() if k not in ("id", "text", "metadata")}
        if isinstance(meta, dict):
            meta = {**extra, **meta}
        else:
            meta = extra if meta is None else {**extra, "metadata": meta}
        return cls(id=str(rid) if rid is not None else default_id, text=text, metadata=meta)
