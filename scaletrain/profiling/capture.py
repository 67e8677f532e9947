"""Capture: torch.profiler around the training loop, named ranges, memory snapshots, nsys hooks.

The trainer uses three things and nothing else:

    with StepProfiler(cfg.profiling, output, device, rank) as prof:   # the loop
        with phase("forward"): ...                                  # named ranges
        prof.step()                                                 # once per step
        prof.on_oom(cfg)                                            # in an OOM handler

Outputs under `<output>/profile` (or `profiling.output_dir`):
- `traces/rank{R}.step{N}.pt.trace.json.gz`: one Chrome trace per rank and profiling cycle
  (opens in Perfetto / chrome://tracing; the folder is a TensorBoard profile run directory);
- `memory_timeline_rank{R}.raw.json.gz` (+ `.html` when matplotlib is installed) with
  `profiling.memory_timeline`;
- `memory_snapshot_rank{R}.pickle` on CUDA (PyTorch's memory_viz), and
  `oom_snapshot_rank{R}.pickle` + `oom_rank{R}.json` (with the plan's estimate) on an OOM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

FRESH_RUN_FLAGS: tuple[tuple[str, str], ...] = (
    ("--checkpoint.save_final", "false"), ("--training.sample_tokens", "0"),
    ("--checkpoint.interval", "0"), ("--training.eval_interval", "0"),
    ("--training.eval_sequences", "4"), ("--checkpoint.resume", "false"),
    ("--checkpoint.interval_minutes", "0"))
"""What a profiling run of `scaletrain train` sets unless told otherwise (`scaletrain profile`,
`scaletrain tune`'s trials): a short fresh run, no resume, no checkpoint, no sample, so it
measures new steps and leaves the run directory's checkpoints alone."""

log = logging.getLogger(__name__)

PREFIX = "scaletrain/"


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A named range in the profiler trace (record_function) and, on CUDA, in Nsight Systems
    (NVTX). Cheap when no profiler runs: record_function is a no-op then."""
    nvtx = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.profiler.record_function(PREFIX + name):
        if nvtx:
            torch.cuda.nvtx.range_push(PREFIX + name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()


def _atomic_export(export: Any, path: Path) -> None:
    """Run `export(tmp_path)` and rename the result to `path` only when it is complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp{os.getpid()}.{path.name}")  # same suffixes: they pick formats
    export(str(tmp))
    os.replace(tmp, path)


class StepProfiler:
    """torch.profiler with a wait/warmup/active/repeat schedule, driven by `step()`."""

    def __init__(self, cfg: Any, output: str | Path, device: torch.device,
                 rank: int | None = None, start_step: int = 0) -> None:
        if rank is None:
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.cfg = cfg
        self.enabled = bool(cfg.enabled)
        self.dir = Path(cfg.output_dir) if cfg.output_dir else Path(output) / "profile"
        self.device = device
        self.rank = rank
        self.step_num = start_step
        self.cuda = device.type == "cuda"
        self.traces: list[Path] = []
        self._prof: torch.profiler.profile | None = None
        self._nsys_on = False
        self._history = False
        self._first_step = start_step

    # --- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> StepProfiler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop(*exc)

    def start(self) -> StepProfiler:
        if not self.enabled:
            return self
        if self.cuda:
            self._start_history()  # allocation stacks for the snapshots
        c = self.cfg
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=c.wait, warmup=c.warmup, active=c.active,
                                             repeat=c.repeat),
            on_trace_ready=self._trace_ready,
            record_shapes=c.record_shapes,
            profile_memory=c.profile_memory,
            with_stack=c.with_stack or c.memory_timeline,
        )
        self._prof.step_num = self.step_num  # ProfilerStep#N carries the training step
        self._prof.__enter__()
        self._first_step = self.step_num
        log.info("profiling: wait %d, warmup %d, active %d steps (repeat %d) -> %s", c.wait,
                 c.warmup, c.active, c.repeat, self.dir)
        self._nsys_update()
        return self

    def stop(self, *exc: Any) -> None:
        self._step_range(None)
        if self._nsys_on:
            torch.cuda.profiler.stop()
            self._nsys_on = False
        if self._prof is not None:
            self._prof.__exit__(*(exc or (None, None, None)))
            self._prof = None
        if self._history:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._history = False

    def step(self) -> None:
        """Call once after each training step."""
        self.step_num += 1
        if self._prof is not None:
            self._prof.step()
            self._nsys_update()

    @contextlib.contextmanager
    def oom_guard(self, run_cfg: Any = None) -> Iterator[None]:
        """Write the allocator snapshot (and the plan's estimate) if the block runs out of memory,
        then let the error propagate."""
        try:
            yield
        except torch.OutOfMemoryError:
            self.on_oom(run_cfg)
            raise

    def _step_range(self, step: int | None) -> None:
        """An NVTX range per step while nsys capture is on (Nsight Systems has no ProfilerStep)."""
        if getattr(self, "_nvtx_step", False):
            torch.cuda.nvtx.range_pop()
            self._nvtx_step = False
        if step is not None and self._nsys_on:
            torch.cuda.nvtx.range_push(f"{PREFIX}step#{step}")
            self._nvtx_step = True

    # --- outputs ------------------------------------------------------------------------------
    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        path = self.dir / "traces" / f"rank{self.rank}.step{prof.step_num}.pt.trace.json.gz"
        _atomic_export(prof.export_chrome_trace, path)
        self.traces.append(path)
        log.info("profiling: trace %s", path)
        if self.cfg.memory_timeline:
            self._memory_timeline(prof)
        if self._history:
            snap = self.dir / f"memory_snapshot_rank{self.rank}.pickle"
            _atomic_export(torch.cuda.memory._dump_snapshot, snap)
            log.info("profiling: CUDA allocator snapshot %s (open it at pytorch.org/memory_viz)",
                     snap)

    def _memory_timeline(self, prof: torch.profiler.profile) -> None:
        device = f"cuda:{self.device.index or 0}" if self.cuda else "cpu"
        path = self.dir / f"memory_timeline_rank{self.rank}.raw.json.gz"
        try:
            with warnings.catch_warnings():  # deprecated in favour of CUDA snapshots; CPU has none
                warnings.simplefilter("ignore", FutureWarning)
                _atomic_export(lambda p: prof.export_memory_timeline(p, device=device), path)
            log.info("profiling: memory timeline %s", path)
            import matplotlib  # noqa: F401

            html_path = path.with_name(f"memory_timeline_rank{self.rank}.html")
            _atomic_export(lambda p: prof.export_memory_timeline(p, device=device), html_path)
        except ImportError:
            log.info("profiling: matplotlib is not installed; no HTML memory timeline plot")
        except Exception as e:  # the memory profiler is best-effort in PyTorch itself
            log.warning("profiling: memory timeline export failed: %s", e)

    @property
    def memory_timeline(self) -> Path | None:
        p = self.dir / f"memory_timeline_rank{self.rank}.raw.json.gz"
        return p if p.exists() else None

    # --- nsys ---------------------------------------------------------------------------------
    def _nsys_update(self) -> None:
        """cudaProfilerStart/Stop around the active steps, for
        `nsys profile --capture-range=cudaProfilerApi`."""
        if not (self.cfg.nsys and self.cuda and self._prof is not None):
            return
        c = self.cfg
        cycle = c.wait + c.warmup + c.active
        pos = self.step_num - self._first_step
        in_range = (c.repeat == 0 or pos < cycle * c.repeat) and pos % cycle >= c.wait + c.warmup
        if in_range and not self._nsys_on:
            torch.cuda.profiler.start()
            self._nsys_on = True
        elif not in_range and self._nsys_on:
            self._step_range(None)
            torch.cuda.profiler.stop()
            self._nsys_on = False
        self._step_range(self.step_num + 1 if self._nsys_on else None)

    # --- memory snapshots ---------------------------------------------------------------------
    def _start_history(self) -> None:
        try:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._history = True
        except (RuntimeError, AttributeError) as e:
            log.warning("profiling: cannot record CUDA allocator history: %s", e)

    def on_oom(self, run_cfg: Any = None) -> Path | None:
        """Write the allocator snapshot (the state at the failure; with allocation stacks when
        profiling records history) and the plan's estimate after an out-of-memory error."""
        if not (self.cuda and self.cfg.oom_snapshot):
            return None
        snap = self.dir / f"oom_snapshot_rank{self.rank}.pickle"
        _atomic_export(dump_snapshot, snap)
        info: dict[str, Any] = {"step": self.step_num + 1, "snapshot": str(snap),
                                **cuda_memory_stats(self.device)}
        estimate = plan_estimate(run_cfg)
        if estimate is not None:
            info["plan_estimate"] = estimate
        _atomic_export(lambda p: Path(p).write_text(json.dumps(info, indent=2, default=str)),
                       self.dir / f"oom_rank{self.rank}.json")
        log.error("out of memory at step %d: allocator snapshot %s (pytorch.org/memory_viz), "
                  "summary %s", info["step"], snap, self.dir / f"oom_rank{self.rank}.json")
        return snap


def dump_snapshot(path: str) -> None:
    """The CUDA caching allocator's history and state, for pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)


def cuda_memory_stats(device: torch.device) -> dict[str, int]:
    return {
        "max_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "device_total_bytes": torch.cuda.get_device_properties(device).total_memory,
    }


def plan_estimate(run_cfg: Any) -> dict[str, Any] | None:
    """The planner's estimate for this config (`plan.from_config.estimate_for_config`); any
    failure leaves the field out: an estimate must never hide the OOM itself."""
    if run_cfg is None:
        return None
    from scaletrain.plan import from_config

    try:
        return from_config.estimate_for_config(run_cfg)
    except Exception as e:
        log.warning("plan estimate failed: %s", e)
        return None
