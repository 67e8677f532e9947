"""Where a layout leaves the regime the calibration table measured.

The step-time model is held to published runs (`published_runs.toml`); a layout beyond all of
them is an extrapolation, and `plan` and `plan search` say so in one line per layout. The
regime checked: a sharded data-parallel group (ZeRO-2/3, FSDP; for HSDP every data-parallel
rank its replicas span) larger than the largest one the table measured on NCCL's rings (rows
without a `framework`), the rings whose NIC striping the model credits. The limit is read from
the table, so a new measured row moves it. The line names the nearest measured evidence beyond
it: a sharded run on a larger group (another framework) beside the fastest other layout
measured in its comparison group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from scaletrain.plan.layout import Layout
from scaletrain.plan.search.calibration import DEEPSPEED_ZERO3_2021, Run, load_runs

FRAMEWORK_LABELS = {DEEPSPEED_ZERO3_2021: "DeepSpeed ZeRO-3", None: "FSDP"}


def sharded_group(run: Run) -> int:
    """Ranks that shard the model state of `run` under ZeRO-2/3 (0: not sharded that way)."""
    if run.zero < 2:
        return 0
    return (run.dp_shard or run.dp) * run.cp


@dataclass(frozen=True)
class MeasuredRange:
    """What the calibration table measured, as far as the notes need it."""

    runs: tuple[Run, ...]

    @property
    def largest_fsdp(self) -> Run | None:
        """The run with the largest sharded group measured on NCCL's striped rings."""
        striped = [r for r in self.runs if r.framework is None and sharded_group(r) > 0]
        return max(striped, key=sharded_group, default=None)

    def note(self, lay: Layout) -> str | None:
        """One line when `lay` relies on a regime the table did not measure, else None."""
        # HSDP's collectives reach every data-parallel rank (the all-reduce across replicas):
        # its span is dp x cp, not the shard group
        d = lay.dims
        n = d.dp * d.cp if lay.fsdp else 0
        largest = self.largest_fsdp
        limit = sharded_group(largest) if largest is not None else 0
        if n <= limit:
            return None
        kind = f"FSDP over {n:,} ranks" if d.dp_replicate == 1 else \
            f"HSDP over {n:,} ranks ({d.dp_replicate} replicas of FSDP over {lay.shard_group:,})"
        text = f"{kind}: beyond the largest measured FSDP run " + (
            f"({limit:,} GPUs)" if largest is not None else "(none in the table)")
        evidence = self._nearest_beyond(n, limit)
        return text if evidence is None else f"{text}; {evidence}"

    def _nearest_beyond(self, n: int, limit: int) -> str | None:
        """The sharded run on a group larger than `limit` nearest to `n` ranks, against the
        fastest other layout of its comparison group."""
        beyond = [r for r in self.runs if sharded_group(r) > limit]
        if not beyond:
            return None
        run = min(beyond, key=lambda r: (abs(math.log(sharded_group(r) / n)), -r.gpus))
        label = FRAMEWORK_LABELS.get(run.framework, run.framework)
        gpu = run.gpu.split("-")[0]
        text = (f"{label} measured {run.measured():.0f} TFLOP/s at {run.gpus:,} {gpu}s")
        rivals = [r for r in self.runs if r.group is not None and r.group == run.group
                  and r is not run]
        if rivals:
            best = max(rivals, key=lambda r: r.measured())
            text += f" vs {best.measured():.0f} for {_degrees(best)}"
        return f"{text} ({run.source.split(',')[0]})"


def _degrees(run: Run) -> str:
    parts = [f"{name} {v}" for name, v in (("TP", run.tp), ("PP", run.pp), ("CP", run.cp))
             if v > 1]
    return " x ".join(parts) or f"DP {run.dp}"


@lru_cache(maxsize=1)
def measured_range() -> MeasuredRange:
    """The range of the table shipped with the package (read once)."""
    return MeasuredRange(tuple(load_runs()))


def calibration_note(lay: Layout) -> str | None:
    """`MeasuredRange.note` against the shipped table."""
    return measured_range().note(lay)
