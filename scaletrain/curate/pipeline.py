"""A pipeline is a list of steps over a stream of documents; every step keeps statistics.

A `Step` either keeps a document (possibly rewritten) or drops it with a reason. Subclasses
implement `process(doc)`; steps that work better on batches (model scorers) override
`process_batch`. `Pipeline.run(docs)` chains the steps lazily and records, per step, the
documents seen, kept and dropped per reason, counters (PII replaced per type, ...), and the
time spent inside the step. Dropped documents can be handed to a writer, reason attached.

A pipeline and its steps must be picklable: executors ship them to worker processes or Ray.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from scaletrain.curate.documents import Document

DroppedSink = Callable[[str, Document, str], None]  # (step name, document, reason)


@dataclass
class StepStats:
    """What one step did: documents seen/kept/dropped (per reason), counters and seconds."""

    name: str
    seen: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    counters: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    bytes_in: int = 0

    def merge(self, other: StepStats) -> None:
        self.seen += other.seen
        self.kept += other.kept
        self.dropped.update(other.dropped)
        self.counters.update(other.counters)
        self.seconds += other.seconds
        self.bytes_in += other.bytes_in

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seen": self.seen,
            "kept": self.kept,
            "dropped": dict(sorted(self.dropped.items())),
            "counters": dict(sorted(self.counters.items())),
            "seconds": round(self.seconds, 4),
            "bytes_in": self.bytes_in,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepStats:
        return cls(
            d["name"],
            d["seen"],
            d["kept"],
            Counter(d["dropped"]),
            Counter(d["counters"]),
            d["seconds"],
            d.get("bytes_in", 0),
        )


class Step:
    """One stage of a pipeline. Override `process` (or `process_batch` for batched steps).

    `process` returns the document to keep it (it may change `text` or `metadata`) or a
    short reason string to drop it. `self.counters` may be incremented inside `process`.
    """

    name: str = "step"
    batch_size: int = 1  # > 1: documents are handed to process_batch in lists of this size
    # None: every document; "code" or "web": only documents of that kind (`Document.kind`),
    # the others pass by untouched and uncounted (set with `only = "code"` in a TOML step)
    only: str | None = None

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()

    def process(self, doc: Document) -> Document | str:
        raise NotImplementedError

    def process_batch(self, docs: list[Document]) -> list[Document | str]:
        return [self.process(d) for d in docs]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["counters"] = Counter()
        return state

    def _apply(
        self, docs: list[Document], stats: StepStats
    ) -> Iterator[tuple[Document, str | None]]:
        t0 = time.perf_counter()
        stats.seen += len(docs)
        stats.bytes_in += sum(len(d.text) for d in docs)
        results = self.process_batch(docs) if len(docs) > 1 else [self.process(docs[0])]
        stats.seconds += time.perf_counter() - t0
        stats.counters.update(self.counters)
        self.counters.clear()
        for doc, res in zip(docs, results):
            if isinstance(res, Document):
                stats.kept += 1
                yield res, None
            else:
                stats.dropped[res] += 1
                yield doc, res

    def run(
        self, docs: Iterable[Document], stats: StepStats, on_drop: DroppedSink | None = None
    ) -> Iterator[Document]:
        batch: list[Document] = []
        for doc in docs:
            if self.only is not None and doc.kind != self.only:  # not this step's kind
                if batch:  # documents keep their order
                    yield from self._emit(batch, stats, on_drop)
                    batch = []
                yield doc
                continue
            batch.append(doc)
            if len(batch) >= self.batch_size:
                yield from self._emit(batch, stats, on_drop)
                batch = []
        if batch:
            yield from self._emit(batch, stats, on_drop)

    def _emit(
        self, batch: list[Document], stats: StepStats, on_drop: DroppedSink | None
    ) -> Iterator[Document]:
        for doc, reason in self._apply(batch, stats):
            if reason is None:
                yield doc
            elif on_drop is not None:
                on_drop(self.name, doc, reason)

    def max_chars(self) -> int | None:
        """A character limit the reader may check before reading a document: the step
        drops every longer document as `too_many_chars` whatever else it holds (None: none)."""
        return None

    def describe(self) -> str:
        """One line for reports: the step and its settings."""
        return self.name

    def described(self) -> str:
        """`describe()` with the kind of documents the step applies to, if limited."""
        return self.describe() + (f" [{self.only} only]" if self.only else "")


class Filter(Step):
    """A step that only keeps or drops: override `reason(doc) -> str | None` (None = keep)."""

    def reason(self, doc: Document) -> str | None:
        raise NotImplementedError

    def process(self, doc: Document) -> Document | str:
        why = self.reason(doc)
        return doc if why is None else why


class Pipeline:
    """An ordered list of steps with unique names; `run` applies them lazily."""

    def __init__(self, steps: list[Step]):
        names = [s.name for s in steps]
        dup = {n for n in names if names.count(n) > 1}
        if dup:  # give repeated steps distinct names so their statistics stay apart
            seen: Counter[str] = Counter()
            for s in steps:
                if s.name in dup:
                    seen[s.name] += 1
                    s.name = f"{s.name}#{seen[s.name]}"
        self.steps = steps

    def new_stats(self) -> list[StepStats]:
        return [StepStats(s.name) for s in self.steps]

    def run(
        self, docs: Iterable[Document], stats: list[StepStats], on_drop: DroppedSink | None = None
    ) -> Iterator[Document]:
        stream: Iterable[Document] = docs
        for step, st in zip(self.steps, stats):
            stream = step.run(stream, st, on_drop)
        return iter(stream)

    def __len__(self) -> int:
        return len(self.steps)


def merge_stats(per_task: Iterable[list[StepStats]]) -> list[StepStats]:
    """Add up the statistics of several tasks step by step."""
    total: list[StepStats] = []
    for stats in per_task:
        if not total:
            total = [StepStats(s.name) for s in stats]
        for t, s in zip(total, stats):
            t.merge(s)
    return total
