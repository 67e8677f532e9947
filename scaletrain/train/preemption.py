"""Stopping cleanly when the cluster asks, and saving on a clock.

A preemption signal (`checkpoint.signals`, SIGTERM and SIGUSR1 by default: what Slurm sends
before it kills a job, and what torchrun forwards to its workers) only sets a flag. At the next
step boundary every rank learns whether any rank received one, so all stop after the same step,
save a checkpoint and exit with `EXIT_PREEMPTED` (75, sysexits' EX_TEMPFAIL: "try again"); rank
0 leaves `preempted.json` in the run directory for the job script, which requeues the job. The
same agreement decides the time-based checkpoints (`checkpoint.interval_minutes`, by rank 0's
clock), so every rank saves at the same step.

The agreement is one all-reduce of two integers per step on a gloo group of its own (host
memory: no device synchronization, and never interleaved with the training's collectives).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75
MARKER_NAME = "preempted.json"


class Preempted(Exception):
    """The run stopped on a preemption signal after saving `checkpoint` at `step` (or, with
    `during_startup`, before its first step, `checkpoint` being the one it started from)."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path | None,
                 during_startup: bool = False) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        if during_startup:
            where = f"during start-up, before step {step + 1}"
            saved = f"it continues from {checkpoint}" if checkpoint else "nothing was trained"
        else:
            where = f"after step {step}"
            saved = f"checkpoint {checkpoint} saved" if checkpoint else "no checkpoint saved"
        super().__init__(f"stopped by {signal_name} {where}; {saved}: run the same command "
                         "again to continue (checkpoint.resume auto)")


class _StartupSignals:
    """The preemption signals between the command's start and the training loop (loading a
    large base can take minutes of a short grace period): a signal is remembered for the
    loop, which stops before its first step, and rank 0 writes the marker at once, so a job
    killed before the loop starts is still requeued."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[signal.Signals, object] = {}
        self.output: Path | None = None

    def install(self, signals: tuple[str, ...], output: Path | None) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.output = output
        for sig in (signal.Signals[name] for name in signals):
            self.previous.setdefault(sig, signal.signal(sig, self._on_signal))

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is not None:
            return
        self.received = signum
        if self.output is not None:
            with contextlib.suppress(OSError):
                self.output.mkdir(parents=True, exist_ok=True)
                write_marker(self.output, signal.Signals(signum).name, None, None)

    def hand_over(self) -> tuple[int | None, dict[signal.Signals, object]]:
        """(the signal received so far, the handlers before start-up); start-up is over."""
        out = self.received, dict(self.previous)
        self.received, self.previous, self.output = None, {}, None
        return out


_STARTUP = _StartupSignals()


def catch_during_startup(signals: tuple[str, ...], output: Path, is_main: bool) -> None:
    """Catch `signals` from now on; the training loop's `StepBoundary` takes them over."""
    _STARTUP.install(signals, output if is_main else None)


def end_startup() -> None:
    """The handlers before `catch_during_startup` again, where the loop did not take them
    over (the run failed before its loop)."""
    _, before = _STARTUP.hand_over()
    for sig, handler in before.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]


class StepBoundary:
    """The decisions every rank takes together after each step: stop (a signal arrived on
    some rank) and save (`interval_minutes` passed on rank 0 since the last save)."""

    def __init__(self, signals: tuple[str, ...], interval_minutes: float,
                 distributed: bool, is_main: bool) -> None:
        self.signals = [signal.Signals[name] for name in signals]
        self.interval_s = interval_minutes * 60.0
        self.is_main = is_main
        self.received: int | None = None
        self._previous: dict[signal.Signals, object] = {}
        self.last_save = time.monotonic()
        self.active = bool(self.signals) or self.interval_s > 0
        # Every rank has the same settings, so every rank creates the group or none does.
        self.group = dist.new_group(backend="gloo") if distributed and self.active else None

    def install(self) -> None:
        """Catch the preemption signals (only the main thread may set handlers)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("checkpoint.signals: not the main thread, signals keep their defaults")
            return
        early, before = _STARTUP.hand_over()
        if early is not None and self.received is None:
            self.received = early
        for sig in self.signals:
            previous = signal.signal(sig, self._on_signal)
            self._previous[sig] = before.get(sig, previous)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def saved(self) -> None:
        """A checkpoint was just written: the clock restarts."""
        self.last_save = time.monotonic()

    def decide(self) -> tuple[str | None, bool]:
        """(name of the signal that stops the run or None, whether a timed save is due), the
        same on every rank."""
        if not self.active:
            return None, False
        due = self.is_main and self.interval_s > 0 \
            and time.monotonic() - self.last_save >= self.interval_s
        flags = [self.received or 0, int(due)]
        if self.group is not None:
            t = torch.tensor(flags, dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            flags = t.tolist()
        name = signal.Signals(flags[0]).name if flags[0] else None
        return name, bool(flags[1])


def write_marker(output: Path, signal_name: str, step: int | None,
                 checkpoint: Path | None) -> None:
    """`preempted.json`: tells the job script the run stopped to be continued (requeue)."""
    info = {"signal": signal_name, "step": step,
            "checkpoint": str(checkpoint) if checkpoint else None, "time": time.time()}
    tmp = output / (MARKER_NAME + ".tmp")
    tmp.write_text(json.dumps(info) + "\n")
    tmp.replace(output / MARKER_NAME)


def clear_marker(output: Path) -> None:
    (output / MARKER_NAME).unlink(missing_ok=True)
