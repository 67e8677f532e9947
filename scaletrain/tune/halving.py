"""The tuning rounds: successive halving over the search's layouts inside a time budget.

Round 0 measures the best-predicted variant of each of the first `layouts` layouts (in the
search's order; a variant the dry run refuses is recorded as skipped and the next one taken).
Each later round keeps the faster half of the layouts that ran (at least one) and measures
each survivor's next variant (micro-batch, recomputation, fused loss, in the search's order),
up to `variants` per layout. A trial whose first warm steps are all `stop_ratio` x slower
than the best so far is stopped; a trial that fails or runs out of memory is recorded and the
rounds go on. Before each trial the time left must cover a typical trial (the median of those
run); every trial is killed at the deadline, so the whole tuning ends inside the budget.

Results go to `tune.json` after every trial (written atomically): `--resume` reuses every
finished trial of the same settings instead of running it again, and takes the same decisions
from them.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scaletrain.tune.candidates import TrialSpec, dry_run
from scaletrain.tune.flags import merge
from scaletrain.tune.results import Trial, correlation
from scaletrain.tune.trial import TrialResult, run_trial

log = logging.getLogger(__name__)

FINISHED = ("ok", "oom", "failed", "stopped", "skipped")
"""Statuses `--resume` keeps ("budget": killed at a deadline, is run again)."""
REPORT_RESERVE_S = 2.0


class TuneError(ValueError):
    """A user mistake (one line, exit 2)."""


def previous_results(path: Path) -> dict[str, Any] | None:
    """The tune.json of an earlier tuning, None when there is none."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise TuneError(f"{path}: not readable JSON ({e}); remove it or drop "
                        "--resume") from None


@dataclass
class TuneSetup:
    user_argv: list[str]
    folder: Path
    nproc: int
    device: torch.device
    usable_bytes: float
    budget_s: float
    measure: int = 2
    layouts: int = 4
    variants: int = 3
    stop_ratio: float = 1.25
    peak_tflops: float | None = None
    resume: bool = False
    header: dict[str, Any] = field(default_factory=dict)
    started: float | None = None
    """`time.monotonic()` when the command started (the budget counts from there)."""


RunFn = Callable[[TrialSpec, Path, float, float | None], TrialResult]


class Tuner:
    def __init__(self, setup: TuneSetup, specs: list[TrialSpec], run: RunFn | None = None):
        self.setup = setup
        self.specs = specs
        self.trials: list[Trial] = []
        self.previous = self._load_previous() if setup.resume else {}
        self._run = run or self._run_trial
        self.start = setup.started if setup.started is not None else time.monotonic()
        self.deadline = self.start + setup.budget_s - REPORT_RESERVE_S
        self.not_run: list[str] = []

    # --- the rounds --------------------------------------------------------------------------
    def run(self) -> list[Trial]:
        groups: dict[str, list[TrialSpec]] = {}
        for s in self.specs:
            groups.setdefault(s.layout, []).append(s)
        tried: dict[str, int] = {k: 0 for k in groups}
        alive = list(groups)[: self.setup.layouts]
        rnd = 0
        while alive:
            ran_any = False
            for name in alive:
                if self._variant(groups[name], tried, name, rnd):
                    ran_any = True
                if self.out_of_time():
                    self._note_unrun(groups, tried, alive)
                    return self.trials
            if not ran_any:
                break
            ranked = sorted((n for n in alive if self.best_of(n) is not None), key=self.best_of)
            keep = max(1, math.ceil(len(ranked) / 2))
            alive = [n for n in ranked[:keep] if tried[n] < min(self.setup.variants,
                                                                    len(groups[n]))]
            rnd += 1
        return self.trials

    def _variant(self, specs: list[TrialSpec], tried: dict[str, int], name: str,
                 rnd: int) -> bool:
        """Measure the layout's next variant the dry run accepts; False when none is left."""
        while tried[name] < min(self.setup.variants, len(specs)):
            spec = specs[tried[name]]
            tried[name] += 1
            trial = self.measure(spec, rnd)
            if trial.result.status != "skipped":
                return True
        return False

    def run_user(self, specs: list[TrialSpec]) -> None:
        """The user's own candidates, each measured once (before the rounds)."""
        for spec in specs:
            if self.out_of_time():
                self.not_run.append(f"{spec.variant} (as given)")
                continue
            self.measure(spec, 0)

    def measure(self, spec: TrialSpec, rnd: int) -> Trial:
        prev = self.previous.get(spec.id)
        if prev is not None:
            spec.planned_peak_bytes = prev.get("planned_peak_bytes")
            spec.skip_reason = prev.get("skip_reason")
            trial = Trial(spec, TrialResult.from_json(prev), reused=True, round=rnd)
            log.info("trial %s (%s, %s): finished before, %s", spec.id, spec.layout,
                     spec.variant, trial.result.status)
        else:
            cfg = dry_run(self.setup.user_argv, spec, self.setup.device, self.setup.nproc,
                          self.setup.usable_bytes)
            if cfg is None:
                result = TrialResult("skipped", message=spec.skip_reason)
                log.info("trial %s (%s, %s): skipped, %s", spec.id, spec.layout, spec.variant,
                         spec.skip_reason)
            else:
                log.info("trial %s (%s, %s): running", spec.id, spec.layout, spec.variant)
                result = self._run(spec, self.setup.folder / "trials" / spec.id, self.deadline,
                                   self.best_step())
                log.info("trial %s: %s%s", spec.id, result.status,
                         f", {result.step_time_s:.3f} s/step" if result.step_time_s else
                         f" ({result.message})" if result.message else "")
            trial = Trial(spec, result, round=rnd)
        self.trials.append(trial)
        self.save()
        return trial

    def _run_trial(self, spec: TrialSpec, out: Path, deadline: float,
                   best: float | None) -> TrialResult:
        return run_trial(merge(self.setup.user_argv, spec.flags), out, self.setup.nproc,
                         self.setup.measure, deadline, best, self.setup.stop_ratio,
                         self.setup.peak_tflops)

    # --- bookkeeping -------------------------------------------------------------------------
    def best_step(self) -> float | None:
        times = [t.result.step_time_s for t in self.trials if t.result.status == "ok"]
        return min(times) if times else None

    def best_of(self, layout: str) -> float | None:
        times = [t.result.step_time_s for t in self.trials
                 if t.spec.layout == layout and t.result.status == "ok"]
        return min(times) if times else None

    def winner(self) -> Trial | None:
        ok = [t for t in self.trials if t.result.status == "ok"]
        return min(ok, key=lambda t: t.result.step_time_s) if ok else None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def out_of_time(self) -> bool:
        """No time for another typical trial (the median wall time of those that ran)."""
        left = self.deadline - time.monotonic()
        walls = [t.result.wall_s for t in self.trials if not t.reused and t.result.wall_s]
        return left <= (statistics.median(walls) if walls else 0.0)

    def _note_unrun(self, groups: dict[str, list[TrialSpec]], tried: dict[str, int],
                    alive: list[str]) -> None:
        """The layouts still in the running, and how many of their variants were not tried."""
        for name in alive:
            left = min(self.setup.variants, len(groups[name])) - tried[name]
            if left > 0:
                self.not_run.append(f"{name} ({left} variant{'s' if left > 1 else ''})")

    def _load_previous(self) -> dict[str, dict[str, Any]]:
        path = self.setup.folder / "tune.json"
        data = previous_results(path)
        if data is None:
            return {}
        if data.get("header", {}).get("user_argv") != self.setup.user_argv or \
                data.get("header", {}).get("world_size") != self.setup.nproc:
            raise TuneError(f"{path} holds a tuning of other settings (train flags or world "
                            "size); tune into another --output, or run without --resume")
        return {t["id"]: t for t in data.get("trials", []) if t.get("status") in FINISHED}

    def save(self) -> None:
        from scaletrain.profiling.report import write_atomic

        write_atomic(self.setup.folder / "tune.json", json.dumps(results_json(self), indent=2))


def results_json(tuner: Tuner) -> dict[str, Any]:
    win = tuner.winner()
    return {"header": tuner.setup.header, "budget_s": tuner.setup.budget_s,
            "elapsed_s": tuner.elapsed(), "trials": [t.to_json() for t in tuner.trials],
            "winner": win.spec.id if win else None, "not_run": tuner.not_run,
            "correlation": correlation(tuner.trials)}
