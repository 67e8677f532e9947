"""Run `scaletrain ARGS...` and, at exit, write this rank's peak resident set above its memory
baseline (the trainer's `peak_mem_gib`, which only rank 0 logs) to $RANK_PEAK_DIR/rank{R}.json.

For bench/pp_schedule_memory_cpu.py: under `torchrun ... bench/_rank_peak.py train ...` every
pipeline stage's peak is read, not only the first one's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from scaletrain import cli
from scaletrain.train import metrics

_baselines: list[metrics.MemoryBaseline] = []
_init = metrics.MemoryBaseline.__init__


def _recording_init(self, device) -> None:  # type: ignore[no-untyped-def]
    _init(self, device)
    _baselines.append(self)


def _report() -> None:
    if not _baselines:
        return
    peak = int(_baselines[-1].peak_above_gib() * 2**30)  # what the trainer logs
    out = Path(os.environ["RANK_PEAK_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps({"peak_above_bytes": peak}))


metrics.MemoryBaseline.__init__ = _recording_init  # type: ignore[method-assign]
_main = cli.main


def _reporting_main(argv: list[str]) -> int:
    """The verb, then the report (`cli.entry` leaves with os._exit under torchrun)."""
    rc = _main(argv)
    _report()
    return rc


cli.main = _reporting_main
sys.argv = ["scaletrain", *sys.argv[1:]]
cli.entry()
