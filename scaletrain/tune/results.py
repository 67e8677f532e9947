"""The measured trials: each trial (its spec, result and round), which of them have a measured
step time, and how the search's order matches the measured one (the rank correlation that
`tune.json`, the summary and the HTML page report)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scaletrain.tune.candidates import TrialSpec
from scaletrain.tune.ranking import spearman
from scaletrain.tune.trial import TrialResult

STATUS_COLORS = {"ok": "#2e7d32", "stopped": "#ef6c00"}


@dataclass
class Trial:
    spec: TrialSpec
    result: TrialResult
    reused: bool = False
    round: int = 0

    def to_json(self) -> dict[str, Any]:
        return {**self.spec.to_json(), **self.result.to_json(), "skip_reason":
                self.spec.skip_reason, "reused": self.reused, "round": self.round}


def measured(trials: list[Trial]) -> list[Trial]:
    """Trials with a measured step time: those that ran to the end, and those stopped early
    (the fastest of their warm steps before the stop)."""
    return [t for t in trials if t.result.status in STATUS_COLORS and t.result.step_time_s]


def correlation(trials: list[Trial]) -> dict[str, Any]:
    """The search's order (its rank: step time, ties to the simpler layout) vs the measured
    order of the measured trials; Spearman's rho of the two, and of the predicted and measured
    step times (the cost model alone, equal predictions sharing a rank)."""
    both = [t for t in measured(trials) if t.spec.search_rank is not None
            and t.spec.predicted_step_s is not None]
    by_search = sorted(both, key=lambda t: t.spec.search_rank)
    by_meas = sorted(both, key=lambda t: t.result.step_time_s)
    meas = [t.result.step_time_s for t in both]
    return {"spearman": spearman([t.spec.search_rank for t in both], meas),
            "spearman_predicted_time": spearman([t.spec.predicted_step_s for t in both], meas),
            "pairs": len(both), "search_order": [t.spec.id for t in by_search],
            "measured_order": [t.spec.id for t in by_meas]}
