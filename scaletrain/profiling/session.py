"""Profile any training loop the way `scaletrain profile` profiles ours, then diagnose it.

    import scaletrain.profiling as sp

    with sp.profile("runs/mine/profile") as prof:     # wait 1, warmup 1, active 3 steps
        for batch in loader:
            with prof.phase("forward"):               # optional named ranges
                loss = model(batch).loss
            loss.backward(); opt.step(); opt.zero_grad()
            prof.step()                               # once per training step
    print(prof.verdict)                               # also printed when the window closes

The same StepProfiler the trainer uses (`capture.StepProfiler`) writes the same files:
`traces/rank{R}.step{N}.pt.trace.json.gz`, the memory timeline with `memory_timeline=True`,
and, once the window's last cycle is written, `diagnosis.json` and `report.html` with the
verdict `scaletrain diagnose` gives. The HF Trainer and Lightning callbacks
(`scaletrain.integrations`) drive this same session from their hooks.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

from scaletrain.config_sections import ProfilingConfig
from scaletrain.profiling import report
from scaletrain.profiling.analyze import analyze, latest_traces
from scaletrain.profiling.capture import StepProfiler, phase
from scaletrain.profiling.folders import memory_timelines
from scaletrain.profiling.summary import headline

log = logging.getLogger(__name__)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def stream(report: TextIO | str | None) -> TextIO | None:
    """The stream a `report` option names: "stdout" is `sys.stdout` at the time of printing
    (a default bound at import would outlive a redirected or captured stdout)."""
    if isinstance(report, str):
        if report != "stdout":
            raise ValueError(f'report: a stream, "stdout" or None (got {report!r})')
        return sys.stdout
    return report


def _dist() -> tuple[bool, int]:
    dist = torch.distributed
    on = dist.is_available() and dist.is_initialized()
    return on, dist.get_rank() if on else 0


class ProfileSession:
    """torch.profiler over a wait/warmup/active window of a loop's steps, then the diagnosis.

    `report`: where the verdict is printed when the window closes (a stream; "stdout", the
    default: the `sys.stdout` of that moment; None: nowhere; the result
    is in `.result` and in `<output>/diagnosis.json` either way). Under torch.distributed every
    rank writes its trace and rank 0 diagnoses all of them (a barrier waits for the others)."""

    def __init__(self, output: str | Path = "profile", *, wait: int = 1, warmup: int = 1,
                 active: int = 3, repeat: int = 1, record_shapes: bool = True,
                 profile_memory: bool = True, with_stack: bool = False,
                 memory_timeline: bool = False, device: torch.device | str | None = None,
                 report: TextIO | str | None = "stdout", html: bool = True) -> None:
        if min(wait, warmup) < 0 or active < 1 or repeat < 1:
            raise ValueError("profile: need wait >= 0, warmup >= 0, active >= 1, repeat >= 1 "
                             f"(got wait={wait}, warmup={warmup}, active={active}, "
                             f"repeat={repeat})")
        self.dir = Path(output)
        self.cfg = ProfilingConfig(
            enabled=True, wait=wait, warmup=warmup, active=active, repeat=repeat,
            record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack,
            memory_timeline=memory_timeline, output_dir=str(self.dir))
        self.device = torch.device(device) if device is not None else _default_device()
        self.report_to = report
        self.html = html
        self.profiler = StepProfiler(self.cfg, self.dir, self.device)
        self.result: dict[str, Any] | None = None
        self._open = False

    # --- the loop's side ---------------------------------------------------------------------
    def __enter__(self) -> ProfileSession:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop(failed=exc[0] is not None)

    def start(self) -> ProfileSession:
        self.profiler.start()
        self._open = True
        return self

    def step(self) -> None:
        """Call once after each training step. After the window's last active step the profiler
        is stopped (no overhead on the steps after it) and the traces are diagnosed."""
        if not self._open:
            return
        self.profiler.step()
        if len(self.profiler.traces) >= self.cfg.repeat:
            self.stop()

    def stop(self, failed: bool = False) -> None:
        """End profiling; diagnose what was written unless the loop failed."""
        if not self._open:
            return
        self._open = False
        self.profiler.stop()
        if not failed and self.result is None:
            self.result = self.diagnose()

    @property
    def window_steps(self) -> int:
        """Steps the window takes: after this many `step()` calls the diagnosis is ready."""
        c = self.cfg
        return (c.wait + c.warmup + c.active) * c.repeat

    @property
    def active(self) -> bool:
        """Profiling: started and its window not over yet."""
        return self._open

    @property
    def done(self) -> bool:
        return self.result is not None

    @staticmethod
    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        """A named range (`data`, `forward`, `backward`, `optimizer`, ...), as the trainer
        marks its phases; `diagnose` splits the step time by them."""
        with phase(name):
            yield

    # --- the diagnosis -----------------------------------------------------------------------
    def diagnose(self) -> dict[str, Any] | None:
        """The report of `scaletrain diagnose` on the traces written (every rank's, on rank 0;
        None on the other ranks, or when no trace was written: the loop stopped before the
        window's active steps)."""
        on, rank = _dist()
        if on:
            torch.distributed.barrier()  # every rank's trace is on disk
            if rank != 0:
                return None
        traces = latest_traces(self.dir)
        if not traces:
            log.warning("profile: no trace under %s/traces; the loop stopped after %d steps, "
                        "before the window's active steps (%d steps in all)", self.dir,
                        self.profiler.step_num, self.window_steps)
            return None
        result = analyze(traces, memory_timeline=memory_timelines(self.dir) or None)
        report.write_atomic(self.dir / "diagnosis.json", report.to_json(result))
        if self.html:
            report.write_atomic(self.dir / "report.html", report.to_html(result))
        out = stream(self.report_to)
        if out is not None:
            print(report.terminal(result), file=out)
            print(f"diagnosis: {self.dir / 'diagnosis.json'}", file=out)
        log.info("profile: %s", headline(result))
        return result

    @property
    def verdict(self) -> str | None:
        return None if self.result is None else self.result["verdict"]


def profile(output: str | Path = "profile", **options: Any) -> ProfileSession:
    """A `ProfileSession` (use it as a context manager and call `.step()` once per step)."""
    return ProfileSession(output, **options)
