"""One trial: a fresh `torchrun ... -m scaletrain train` with the profiler on, a few warm
steps measured, the traces diagnosed as `scaletrain profile` diagnoses them.

Steps: 1 (cold: allocations, first collectives) + `measure` warm steps outside the profiler,
whose median step time is the measured step time; then the profiler's warmup step and 2
active steps, whose traces give the verdict. metrics.jsonl gets every step (log interval 1).
A trial ends early (stopped) when its first warm steps (two, or `measure` if fewer) are all
`stop_ratio` x slower than the best so far, and is killed at the budget's deadline.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.profiling.capture import FRESH_RUN_FLAGS

log = logging.getLogger(__name__)

# What torchrun puts in a rank's environment: a tune started under torchrun must not hand
# them to the trials' own torchrun.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
_OOM = re.compile(r"out of memory|can't allocate memory|DefaultCPUAllocator", re.IGNORECASE)
EXIT_OUT_OF_MEMORY = 3  # `scaletrain train`'s exit for a run that does not fit or ran out
PROFILED_STEPS = 3  # profiler warmup 1 + active 2


@dataclass
class TrialResult:
    """What a trial measured, or why it has no measurement."""

    status: str
    """ok | oom | failed | stopped (early: slower than the best) | budget (killed at the
    deadline) | skipped (the dry run refused it)."""
    step_time_s: float | None = None
    tokens_per_s_per_device: float | None = None
    mfu: float | None = None
    mfu_source: str | None = None
    peak_mem_bytes: float | None = None
    verdict: str | None = None
    remedy: str | None = None
    message: str | None = None
    wall_s: float = 0.0
    steps_measured: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrialResult:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def trial_flags(out: Path, measure: int) -> list[str]:
    """The run settings of a trial (after the layout's): profiler schedule, fresh short run
    (the defaults `scaletrain profile` sets), every step in metrics.jsonl."""
    wait = 1 + measure
    return ["--output", str(out), "--training.steps", str(wait + PROFILED_STEPS),
            "--profiling.enabled", "true", "--profiling.wait", str(wait),
            "--profiling.warmup", "1", "--profiling.active", "2", "--profiling.repeat", "1",
            "--metrics.log_interval", "1", "--metrics.tensorboard", "false",
            "--metrics.progress_bar", "false",
            *(a for flag_value in FRESH_RUN_FLAGS for a in flag_value)]


def launch_command(nproc: int, argv: list[str]) -> list[str]:
    """torchrun (through this interpreter) starting `scaletrain train` on `nproc` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(nproc), "-m", "scaletrain", "train", *argv]


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def read_steps(metrics: Path) -> list[dict[str, Any]]:
    """The complete lines of metrics.jsonl (rank 0's), by step."""
    rows = []
    try:
        text = metrics.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return rows


def run_trial(argv: list[str], out: Path, nproc: int, measure: int, deadline: float,
              best_step_s: float | None, stop_ratio: float,
              peak_tflops: float | None) -> TrialResult:
    """Run one trial to the end (or stop it); `argv` are the train flags (user's + layout's)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = launch_command(nproc, [*argv, *trial_flags(out, measure)])
    (out / "command.txt").write_text(" ".join(cmd) + "\n")
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    start = time.monotonic()
    with open(out / "trial.log", "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)
        ended = None
        while proc.poll() is None:
            time.sleep(0.25)
            if time.monotonic() > deadline:
                ended = TrialResult("budget", message="killed at the end of the time budget")
            elif best_step_s is not None:
                ended = _too_slow(read_steps(metrics), measure, best_step_s, stop_ratio)
            if ended is not None:
                _kill(proc)
                ended.wall_s = time.monotonic() - start
                return ended
    wall = time.monotonic() - start
    text = (out / "trial.log").read_text(errors="replace")
    if proc.returncode != 0:
        oom = proc.returncode == EXIT_OUT_OF_MEMORY or bool(_OOM.search(text))
        return TrialResult("oom" if oom else "failed", message=_error_line(text), wall_s=wall)
    result = measured(read_steps(metrics), measure, peak_tflops)
    result.wall_s = wall
    result.verdict, result.remedy = diagnose(out)
    return result


def _too_slow(rows: list[dict[str, Any]], measure: int, best_step_s: float,
              stop_ratio: float) -> TrialResult | None:
    """Stopped, when even the fastest of the first warm steps (two, or `measure` if fewer) is
    `stop_ratio` x slower than the best so far: it cannot win (the fastest, so that one step
    slowed by the host's other work does not stop a good layout)."""
    warm = [r["step_time_s"] for r in rows if 2 <= r["step"] <= 1 + measure]
    if len(warm) < min(2, measure) or min(warm) <= stop_ratio * best_step_s:
        return None
    return TrialResult("stopped", step_time_s=min(warm), steps_measured=warm,
                       message=f"stopped early: its warm steps ({min(warm):.3f} s at best) are "
                               f"over {stop_ratio:g} x the best so far ({best_step_s:.3f} s)")


def _kill(proc: subprocess.Popen) -> None:
    """End the trial's process group (torchrun and its ranks), which this process started."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _error_line(text: str) -> str:
    """The run's own one-line error (`scaletrain train: ...`), else the last error-looking
    line of the log."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("scaletrain train:"):
            return ln
    for ln in reversed(lines):
        if re.search(r"Error|error:", ln):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def measured(rows: list[dict[str, Any]], measure: int, peak_tflops: float | None
             ) -> TrialResult:
    """The median of the warm unprofiled steps; memory is the peak through them."""
    warm = [r for r in rows if 2 <= r["step"] <= 1 + measure]
    if not warm:
        return TrialResult("failed", message="the run wrote no warm step to metrics.jsonl")
    step = statistics.median(r["step_time_s"] for r in warm)
    tps = statistics.median(r["tokens_per_s_per_device"] for r in warm)
    tflops = statistics.median(r["tflops"] for r in warm)
    mfu, source = None, None
    if warm[-1].get("mfu") is not None:
        mfu, source = statistics.median(r["mfu"] for r in warm), "trainer (device table)"
    elif peak_tflops:
        mfu, source = tflops / peak_tflops, "tune's device peak"
    peak = max(r["peak_mem_gib"] for r in warm) * 2**30
    return TrialResult("ok", step_time_s=step, tokens_per_s_per_device=tps, mfu=mfu,
                       mfu_source=source, peak_mem_bytes=peak,
                       steps_measured=[r["step_time_s"] for r in warm])


def diagnose(out: Path) -> tuple[str | None, str | None]:
    """`scaletrain profile`'s analysis of the trial's traces: (verdict, first remedy), with
    diagnosis.json and report.html written beside them."""
    from scaletrain.config import read_toml
    from scaletrain.profiling import report
    from scaletrain.profiling.analyze import analyze, latest_traces
    from scaletrain.profiling.trace import TraceError

    folder = out / "profile"
    traces = latest_traces(folder)
    if not traces:
        return None, None
    try:
        cfg = read_toml(out / "config.toml")
    except Exception:  # the verdict does not need the config; only its remedies' values do
        cfg = None
    try:
        r = analyze(traces, cfg=cfg)
    except TraceError as e:
        return f"no verdict ({e})", None
    report.write_atomic(folder / "diagnosis.json", report.to_json(r))
    report.write_atomic(folder / "report.html", report.to_html(r))
    remedies = r.get("remedies") or []
    first = None
    if remedies:
        rem = remedies[0]
        first = f"{rem.get('flag') or rem.get('key', '')}: {rem.get('change', '')}".strip(": ")
    return r.get("verdict"), first
