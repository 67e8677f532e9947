"""A task's documents as the steps receive them: positioned, given their kind, and files over
a document limit dropped before they are read.

The first step that applies to a kind of document, when it has a character limit
(`Step.max_chars()`: `counts` with `max_chars`), is a limit the reader can check from a
file's size: a text file with more bytes than 4 per allowed character (UTF-8's most) is
over it without being opened, and one that is not is read in pieces and stopped past the
limit. Such a file is counted as that step's `too_many_chars`, as if it had been read
whole; no earlier step could have changed its text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from scaletrain.curate.documents import Document
from scaletrain.curate.drop_profile import DropProfile
from scaletrain.curate.io.readers import ReadReport, Shard, TooLong, read_shard
from scaletrain.curate.pipeline import Step, StepStats

KINDS = ("code", "web")
DropSink = Callable[[str, Document, str], None]


def kind_of(fmt: str) -> str:
    """'code' for source files and text that is not prose, 'web' for every other document."""
    return "code" if fmt == "text" else "web"


def read_limits(steps: list[Step]) -> dict[str, tuple[int, int]]:
    """kind -> (index of the step, its limit) where the first step applying to documents of
    that kind has a character limit (`counts` with `max_chars`)."""
    limits = {}
    for kind in KINDS:
        for i, s in enumerate(steps):
            if s.only not in (None, kind):
                continue
            hi = s.max_chars()
            if hi is not None:
                limits[kind] = (i, hi)
            break
    return limits


def positioned(
    shards: list[Shard],
    first: int,
    report: ReadReport,
    read: list[int],
    *,
    steps: list[Step] | None = None,
    stats: list[StepStats] | None = None,
    on_drop: DropSink | None = None,
    profile: DropProfile | None = None,
) -> Iterator[Document]:
    """The shards' documents with their position and kind; `read[0]` counts them. With
    `steps` and their `stats`, files over a leading character limit are counted as dropped
    by that step (and given to `on_drop`) instead of being read whole."""
    limits = read_limits(steps) if steps is not None and stats is not None else {}
    for k, s in enumerate(shards):
        kind = kind_of(s.format)
        at, max_chars = limits.get(kind, (-1, None))
        for p, doc in enumerate(read_shard(s, report, max_chars)):
            doc.pos, doc.kind = f"{first + k}:{p}", kind
            read[0] += 1
            if profile is not None:
                profile.read(k)
            if isinstance(doc, TooLong) and stats is not None and steps is not None:
                st = stats[at]
                st.seen += 1
                st.dropped["too_many_chars"] += 1
                if on_drop is not None:
                    on_drop(steps[at].name, doc, "too_many_chars")
                continue
            yield doc


__all__ = ["KINDS", "kind_of", "positioned", "read_limits"]
