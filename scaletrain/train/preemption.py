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

import json
import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger("scaletrain.train")

EXIT_PREEMPTED = 75
MARKER_NAME = "preempted.json"


class Preempted(Exception):
    """The run stopped on a preemption signal after saving `checkpoint` at `step`."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path | None) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        saved = f"checkpoint {checkpoint} saved" if checkpoint else "no checkpoint saved"
        super().__init__(f"stopped by {signal_name} after step {step}; {saved}: run the same "
                         "command again to continue (checkpoint.resume auto)")


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
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

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


def write_marker(output: Path, signal_name: str, step: int, checkpoint: Path | None) -> None:
    """`preempted.json`: tells the job script the run stopped to be continued (requeue)."""
    info = {"signal": signal_name, "step": step,
            "checkpoint": str(checkpoint) if checkpoint else None, "time": time.time()}
    tmp = output / (MARKER_NAME + ".tmp")
    tmp.write_text(json.dumps(info) + "\n")
    tmp.replace(output / MARKER_NAME)


def clear_marker(output: Path) -> None:
    (output / MARKER_NAME).unlink(missing_ok=True)
