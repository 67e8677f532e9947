"""Where a run's drops come from: the top drop reasons per kind of input file, and a hint
when one rule drops most of a folder (a folder of prose notes under the code rules, short
notes under the web rules' minimum word count).

Counted for the steps of the first stage (the per-kind rules all run there: `only` steps
must come before the first dedup step); a document is attributed to the file it was read
from: its kind (`code` for source files, `prose` for plain-text files that read as prose,
else the format: `warc`, `wet`, `jsonl`, `parquet`, `html`) and its folder.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from scaletrain.curate.io.readers import Shard

TOP = 3  # drop reasons listed per kind
HINT_SHARE = 0.5  # one step: reason dropping at least this share of a folder's documents
HINT_MIN_DOCS = 10  # ... of a folder of at least this many documents


def file_kind(fmt: str) -> str:
    return "code" if fmt == "text" else fmt


def _folder(s: Shard) -> str:
    parent = Path(s.path).parent
    if s.root:
        try:
            rel = parent.relative_to(s.root).as_posix()
            return "./" if rel == "." else rel + "/"
        except ValueError:
            pass
    return parent.as_posix() + "/"


class DropProfile:
    """Documents read and dropped (`step: reason`) per file kind and per folder, for the
    shards of one task (indexed as the task lists them)."""

    def __init__(self, shards: list[Shard]):
        self._kinds = [file_kind(s.format) for s in shards]
        self._folders = [_folder(s) for s in shards]
        self.kinds: dict[str, dict[str, Any]] = {}
        self.folders: dict[str, dict[str, Any]] = {}

    def _entries(self, k: int) -> list[dict[str, Any]]:
        return [table.setdefault(key, {"documents": 0, "kinds": Counter(), "dropped": Counter()})
                for table, key in ((self.kinds, self._kinds[k]), (self.folders, self._folders[k]))]

    def read(self, k: int) -> None:
        for e in self._entries(k):
            e["documents"] += 1
            e["kinds"][self._kinds[k]] += 1

    def drop(self, k: int, step: str, reason: str) -> None:
        for e in self._entries(k):
            e["dropped"][f"{step}: {reason}"] += 1

    def to_dict(self) -> dict[str, Any]:
        return {"kinds": _plain(self.kinds), "folders": _plain(self.folders)}


def _plain(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: {"documents": e["documents"], "kinds": dict(e["kinds"]),
                "dropped": dict(e["dropped"])} for k, e in table.items()}


def _merge(dicts: list[dict[str, Any]], part: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for d in dicts:
        for key, e in (d.get(part) or {}).items():
            m = out.setdefault(key, {"documents": 0, "kinds": Counter(), "dropped": Counter()})
            m["documents"] += e["documents"]
            m["kinds"].update(e["kinds"])
            m["dropped"].update(e["dropped"])
    return out


def summarize_profiles(profiles: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """(per kind: documents, dropped and the top reasons; the hints) from the tasks'
    profiles."""
    by_kind = {}
    for kind, e in sorted(_merge(profiles, "kinds").items()):
        by_kind[kind] = {"documents": e["documents"], "dropped": sum(e["dropped"].values()),
                         "top_reasons": [[r, n] for r, n in e["dropped"].most_common(TOP)]}
    hints = []
    for folder, e in sorted(_merge(profiles, "folders").items()):
        if e["documents"] < HINT_MIN_DOCS or not e["dropped"]:
            continue
        why, n = e["dropped"].most_common(1)[0]
        if n < HINT_SHARE * e["documents"]:
            continue
        step = why.split(": ", 1)[0]
        kinds = ", ".join(f"{c:,} {k}" for k, c in e["kinds"].most_common())
        share = 100 * n / e["documents"]
        hints.append(
            f"{why} dropped {n:,} of the {e['documents']:,} documents ({share:.0f} %) of "
            f"{folder} ({kinds}): if these files are worth keeping, the rule does not "
            f"suit them; change its settings (a TOML [[steps]] entry for '{step}', --set "
            f"{step}.PARAM=VALUE in `data filter`) or limit it to one kind with `only`; "
            "--write-dropped shows the dropped documents")
    return by_kind, hints


__all__ = ["DropProfile", "file_kind", "summarize_profiles"]
