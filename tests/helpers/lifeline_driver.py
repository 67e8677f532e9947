"""A curation driver for tests/curate/test_data_lifeline.py:
`python -m tests.helpers.lifeline_driver OUT INPUT...` runs a slow step on 2 worker processes (so it
can be killed mid-stage)."""

from __future__ import annotations

import sys
import time

from scaletrain.curate.documents import Document
from scaletrain.curate.executors import LocalExecutor
from scaletrain.curate.filters.gopher import GopherQualityFilter
from scaletrain.curate.pipeline import Step
from scaletrain.curate.runner import RunOptions, run_pipeline


class SlowStep(Step):
    """Keeps every document, 0.15 s each."""

    name = "slow"

    def process(self, doc: Document) -> Document:
        time.sleep(0.15)
        return doc


if __name__ == "__main__":
    out, *inputs = sys.argv[1:]
    run_pipeline([SlowStep(), GopherQualityFilter()], inputs, out, LocalExecutor(2),
                 RunOptions(tasks=4, write_dropped=True))
