"""What reading the inputs met besides documents: malformed records and skipped input.

Every record of the input is accounted for once: it becomes a document, or it is
*malformed* (damaged or unreadable: counted and named with its file and line or byte
offset), or it is *skipped* (not a document by design: a binary file, a WARC record that is
not an HTML response), counted per reason. Documents then are kept or dropped by the
steps, so `kept + dropped + malformed + skipped = input records` for every run.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from scaletrain.curate.io.errors import InputError

log = logging.getLogger(__name__)

MAX_EXAMPLES = 20  # malformed records kept (file:line + message) for the report


class MalformedRecord(InputError):
    """A malformed record met in strict mode; the message is `FILE:LINE: what is wrong`."""


@dataclass
class ReadReport:
    """Malformed records (counted, skipped and named) and skipped input (counted per reason).

    With `strict`, the first malformed record raises `MalformedRecord` with the same text.
    """

    malformed: int = 0
    examples: list[str] = field(default_factory=list)
    strict: bool = False
    empty: int = 0  # well-formed records with an empty text (tokenize skips them)
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> records
    notes: Counter[str] = field(default_factory=Counter)  # kept, but worth saying (reason -> n)
    _logged: int = field(default=0, repr=False)

    def add(self, where: str, message: str, count: int = 1) -> None:
        """`count` malformed records at `where` (a file whose every row is unusable: its rows)."""
        if self.strict:
            raise MalformedRecord(f"{where}: {message}")
        self.malformed += count
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {message}" + (f" ({count} records)" if count > 1
                                                          else ""))
        # the first ones are logged; the rest only counted (a file that is not JSON lines
        # at all would otherwise log one line per line of it)
        if self._logged < MAX_EXAMPLES:
            log.warning("skipping malformed record at %s: %s", where, message)
        elif self._logged == MAX_EXAMPLES:
            log.warning("more malformed records (from %s on) are counted, not logged", where)
        self._logged += 1

    def skip(self, reason: str, where: str = "", count: int = 1) -> None:
        """`count` input records that are not documents by design (never an error)."""
        if reason not in self.skipped:
            log.info("skipping %s (first: %s)", reason, where or "-")
        self.skipped[reason] += count

    def note(self, what: str, where: str) -> None:
        if what not in self.notes:
            log.warning("%s: %s (counted in the report)", where, what)
        self.notes[what] += 1

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def merge(self, other: ReadReport) -> None:
        self.malformed += other.malformed
        self.empty += other.empty
        self.skipped.update(other.skipped)
        self.notes.update(other.notes)
        self.examples = (self.examples + other.examples)[:MAX_EXAMPLES]

    def to_dict(self) -> dict[str, Any]:
        return {"malformed": self.malformed, "malformed_examples": list(self.examples),
                "skipped": dict(sorted(self.skipped.items())),
                "notes": dict(sorted(self.notes.items()))}


__all__ = ["MAX_EXAMPLES", "MalformedRecord", "ReadReport"]
