"""The built-in corpus through the curation pipeline before it is tokenized.

`scaletrain train` without `data.paths` reads a directory of source files; with `data.curate`
(the default) their documents first go through `DEFAULT_CODE_PIPELINE` (size limits,
source-file rules, exact and MinHash dedup, PII), run by the same runner and local executor as
`scaletrain data curate`. Kept documents stay in their original order.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from scaletrain.curate.io.readers import read_documents

log = logging.getLogger(__name__)

INPUT_FILES = 4  # contiguous chunks, so the local executor runs tasks in parallel


def curation_spec() -> list[dict[str, Any]]:
    """The steps (as `[[steps]]` tables) the corpus goes through; part of the cache key."""
    from scaletrain.curate.registry import DEFAULT_CODE_PIPELINE

    return DEFAULT_CODE_PIPELINE


def curate_documents(texts: list[str], names: list[str], work_dir: Path,
                     workers: int | None = None) -> tuple[list[str], list[str], dict[str, Any]]:
    """(kept texts, their names, a summary) after the default code pipeline; `work_dir` holds
    the run's input, output and statistics (the caller deletes it)."""
    from scaletrain.curate.executors.local import LocalExecutor
    from scaletrain.curate.registry import build_step
    from scaletrain.curate.runner import RunOptions, run_pipeline

    inputs = _write_inputs(texts, names, work_dir / "in")
    steps = [build_step(dict(s)) for s in curation_spec()]
    summary = run_pipeline(steps, inputs, str(work_dir / "out"), LocalExecutor(workers),
                           RunOptions(tasks=len(inputs)), overwrite=True)
    kept_texts, kept_names = [], []
    for doc in read_documents(summary["output_files"]):
        kept_texts.append(doc.text)
        kept_names.append(doc.id)
    dropped: dict[str, int] = {}
    for step in summary["steps"]:
        for reason, n in step["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + n
    digest = {"documents_in": summary["docs_in"], "documents_out": summary["docs_out"],
              "dropped": dropped}
    log.info("curation: %d -> %d documents (%s)", digest["documents_in"],
             digest["documents_out"], ", ".join(f"{k} {v}" for k, v in dropped.items()) or
             "none dropped")
    return kept_texts, kept_names, digest


def _write_inputs(texts: list[str], names: list[str], folder: Path) -> list[str]:
    """The documents as about INPUT_FILES JSON-lines files, in order (the curation writer)."""
    from scaletrain.curate.documents import Document
    from scaletrain.curate.io.writers import JsonlWriter

    size = sum(len(t.encode("utf-8")) for t in texts)
    writer = JsonlWriter(str(folder), prefix="docs", max_bytes=size // INPUT_FILES + 1)
    try:
        for text, name in zip(texts, names, strict=True):
            writer.write(Document(id=name, text=text))
    except BaseException:
        writer.abort()
        raise
    return writer.close()
