"""What a run reports to its experiment trackers besides the step metrics: the plan before the
first step and, when `profiling.enabled`, the diagnosis of the profiled window."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from scaletrain.config import Config
from scaletrain.train.metrics import MetricsLogger
from scaletrain.train.trackers import Tracker, open_trackers

log = logging.getLogger(__name__)


def run_trackers(cfg: Config, output: Any) -> list[Tracker]:
    """The trackers of `metrics.loggers`, the resolved config logged to each."""
    m = cfg.metrics
    return open_trackers(m.active_loggers, output, run_name=str(cfg.output),
                         config=dataclasses.asdict(cfg), wandb_project=m.wandb_project,
                         mlflow_uri=m.mlflow_tracking_uri, mlflow_experiment=m.mlflow_experiment)


def log_plan(metrics: MetricsLogger, cfg: Config, device: torch.device, step: int) -> None:
    """The planner's estimate for this run (`scaletrain train --dry-run`) as text and figures;
    a config the planner cannot estimate is logged and skipped."""
    if not metrics.trackers:
        return
    from scaletrain.plan.estimate import plan_json
    from scaletrain.plan.from_config import plan_config
    from scaletrain.plan.text import format_plan

    try:
        plan, dev = plan_config(cfg, device)
    except Exception as e:  # the estimate must never stop a run
        log.warning("plan: no estimate for the trackers: %s", e)
        return
    metrics.log_text("plan", format_plan(plan, dev), step, plan_scalars(plan_json(plan, dev)))


def plan_scalars(plan: dict[str, Any]) -> dict[str, float]:
    """`plan/...` figures of `plan_json`: parameters, FLOPs per token, memory by component."""
    out = {f"plan/{k}": float(plan[k]) for k in ("params", "flops_per_token", "peak_bytes")
           if isinstance(plan.get(k), (int, float))}
    for k, v in (plan.get("memory_bytes") or {}).items():
        if isinstance(v, (int, float)):
            out[f"plan/memory_gib/{k}"] = v / 2**30
    return out


def diagnose_window(prof: Any, cfg: Config, metrics: MetricsLogger, step: int,
                    distributed: bool, is_main: bool) -> dict[str, Any] | None:
    """After the profiler stopped: rank 0 diagnoses every rank's newest trace (as `scaletrain
    profile` does) and sends the verdict and breakdown to the trackers. Every rank calls it."""
    if not prof.enabled:
        return None
    if distributed:
        torch.distributed.barrier()  # every rank's trace is on disk
    if not is_main:
        return None
    from scaletrain.profiling import report
    from scaletrain.profiling.analyze import analyze, latest_traces
    from scaletrain.profiling.folders import memory_timelines
    from scaletrain.profiling.summary import headline, scalars
    from scaletrain.profiling.trace import TraceError

    traces = latest_traces(prof.dir)
    if not traces:
        return None
    try:
        result = analyze(traces, memory_timeline=memory_timelines(prof.dir) or None, cfg=cfg)
    except (TraceError, ValueError) as e:
        log.warning("profiling: the traces could not be diagnosed: %s", e)
        return None
    log.info("profiling: %s", headline(result))
    metrics.log_text("profile/verdict", result["verdict"], step)
    metrics.log_text("profile/report", report.terminal(result), step, scalars(result))
    return result
