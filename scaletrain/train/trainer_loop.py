"""The training loop of `Trainer.train`, the same for every layout: the steps, the log steps
(pending steps read back in one transfer, then each step's metrics), evaluation and checkpoint
cadence, the stop agreement on a preemption signal, the profiled window and the end of the run
(final evaluation, checkpoint and sample); what it returns is a `TrainResult`.

`TrainingLoop` is a part of `Trainer` (`train/trainer.py`), which builds what the loop runs:
the step, the data stream, the metrics settings, the checkpointer and the parallelism.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scaletrain.profiling.capture import StepProfiler
from scaletrain.train.metrics import MetricsLogger, step_metrics
from scaletrain.train.moe_metrics import collect_moe_stats
from scaletrain.train.run_reports import diagnose_window, log_plan, run_trackers
from scaletrain.train.step import StepOutput

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    checkpoint: Path | None = None
    sample: str | None = None
    wall_time_s: float = 0.0
    tokens_seen: int = 0
    """Tokens of the training batches the run has consumed in all, earlier runs it resumed
    included (samples x sequence length; padding of fine-tuning rows included)."""


class TrainingLoop:
    """`Trainer.train` and what only the loop uses."""

    def train(self) -> TrainResult:
        """The loop, the same for every layout. Steps run without reading values back to the
        host; at log steps (the run's first step, every `metrics.log_interval`, before an
        evaluation or checkpoint, and at the end) the pending steps' losses and norms are read
        in one transfer, written to the metrics (each step's own values), and a non-finite step
        acts on `on_nan`.

        After each step every rank agrees whether to stop (a preemption signal: checkpoint,
        then `Preempted`) and whether a timed checkpoint is due (`train/preemption.py`). Once
        the first step has run, collectives are bounded by `parallel.step_timeout_s` and a step
        that outlasts it leaves every rank's stack under `<output>/stacks/`."""
        from scaletrain.train.preemption import Preempted, StepBoundary, clear_marker, write_marker

        cfg = self.cfg
        if self.resume_from is not None and self.step >= cfg.training.steps:
            log.info("the run is complete: %s is at step %d of %d, nothing to train (more steps: "
                     "raise --training.steps; a new run: another --output)", self.resume_from,
                     self.step, cfg.training.steps)
            return TrainResult(steps=self.step, checkpoint=self.resume_from,
                               tokens_seen=self._tokens_seen())
        start = time.perf_counter()
        result = TrainResult(steps=self.step)
        first = self.step + 1  # logged alone: the run shows life, warm-up stays out of the means
        heartbeat = self.par.heartbeat()
        boundary = StepBoundary(cfg.checkpoint.signals, cfg.checkpoint.interval_minutes,
                                self.par.enabled, self.is_main)
        boundary.install()
        stop, _ = boundary.decide()  # a signal during start-up: stop before the first step
        if stop is not None:
            boundary.uninstall()
            self.checkpointer.close()
            if heartbeat is not None:
                heartbeat.stop()
            if self.is_main:
                write_marker(self.output, stop, self.step, self.resume_from)
            raise Preempted(stop, self.step, self.resume_from, during_startup=True)
        stacks = self._stack_dumps()
        metrics: Any = _NoMetrics()
        if self.is_main:  # one rank writes metrics, logs and the progress bar
            clear_marker(self.output)
            metrics = MetricsLogger(self.output, cfg.training.steps, cfg.metrics.log_interval,
                                    run_trackers(cfg, self.output), cfg.metrics.progress_bar,
                                    start_step=self.step)
            log_plan(metrics, cfg, self.device, self.step)
        pending = _Pending(time.perf_counter())
        prof = StepProfiler(cfg.profiling, self.output, self.device, start_step=self.step).start()
        try:
            while self.step < cfg.training.steps:
                self._where(heartbeat, "training step")
                if stacks is not None and self.step >= first:
                    stacks.arm(0.9 * cfg.parallel.step_timeout_s)
                t0 = time.perf_counter()
                batches = self.next_batches()
                data_wait = time.perf_counter() - t0
                with prof.oom_guard(cfg):
                    out = self._guarded_step(batches, heartbeat)
                self.step += 1
                if self.step == first and self.par.enabled:  # start-up is over
                    self.collective_timeout(cfg.parallel.step_timeout_s)
                stop, timed_save = boundary.decide()
                if stacks is not None:
                    stacks.disarm()
                prof.step()
                pending.steps.append((self.step, out, data_wait))
                last = self.step == cfg.training.steps
                evaluate = bool(cfg.training.eval_interval) and not last and stop is None \
                    and self.step % cfg.training.eval_interval == 0
                save = not last and (bool(stop) or timed_save or (
                    bool(cfg.checkpoint.interval) and self.step % cfg.checkpoint.interval == 0))
                if (last or evaluate or save or self.step == first
                        or self.step % cfg.metrics.log_interval == 0):
                    self._log_pending(pending, metrics, result)
                if evaluate:
                    self._where(heartbeat, "evaluation")
                    metrics.log_eval(self.step, self.evaluate())
                    pending.since = time.perf_counter()  # evaluation time is not step time
                if save:
                    self._where(heartbeat, "saving a checkpoint")
                    result.checkpoint = self.save_checkpoint()
                    boundary.saved()
                    pending.since = time.perf_counter()
                if stop is not None and not last:  # the last step ends the run as usual
                    result.checkpoint = self.checkpointer.wait() or result.checkpoint
                    if self.is_main:
                        write_marker(self.output, stop, self.step, result.checkpoint)
                    raise Preempted(stop, self.step, result.checkpoint)
            prof.stop()  # evaluation and the final checkpoint stay out of the trace
            self.diagnosis = diagnose_window(prof, cfg, metrics, self.step, self.par.enabled,
                                             self.is_main)
            self._where(heartbeat, "final evaluation")
            result.val_loss = self.evaluate()
            metrics.log_eval(self.step, result.val_loss)
            # The last step is saved by `save_final`, or as any step of `interval` is.
            on_interval = bool(cfg.checkpoint.interval) and self.step > result.steps \
                and self.step % cfg.checkpoint.interval == 0
            if cfg.checkpoint.save_final or on_interval:
                self._where(heartbeat, "saving the final checkpoint")
                result.checkpoint = self.save_checkpoint()
            result.checkpoint = self.checkpointer.wait() or result.checkpoint
        finally:
            boundary.uninstall()
            if stacks is not None:
                stacks.close()
            prof.stop()
            metrics.close()
            self.checkpointer.close()
            if heartbeat is not None:
                heartbeat.stop()
        result.steps = self.step
        result.tokens_seen = self._tokens_seen()
        result.wall_time_s = time.perf_counter() - start
        if cfg.training.sample_tokens:
            result.sample = self.sample(cfg.training.sample_tokens)
        return result

    def _tokens_seen(self) -> int:
        return self.train_stream.state_dict()["consumed_samples"] * self.cfg.data.seq_len

    def _stack_dumps(self) -> Any:
        """Stack dumps of a hung step (several processes only; `parallel/stacks.py`)."""
        if not self.par.enabled:
            return None
        from scaletrain.parallel.stacks import StackDumps

        return StackDumps(self.output / "stacks", self.par.rank,
                          on_demand="SIGUSR2" not in self.cfg.checkpoint.signals)

    def _where(self, heartbeat: Any, doing: str) -> None:
        """Tell the heartbeat where this rank is (named if it stops answering)."""
        if heartbeat is not None:
            heartbeat.at(f"step {self.step + 1}: {doing}" if doing == "training step"
                         else f"after step {self.step}: {doing}")

    def _log_pending(self, pending: _Pending, metrics: Any, result: TrainResult) -> None:
        """Read the pending steps back (one transfer; the only host synchronization of the
        loop), log each step's metrics and apply `training.on_nan`."""
        if not pending.steps:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        values = torch.stack([torch.stack([o.loss.float(), o.grad_norm.float(),
                                           o.skipped.float()]) for _, o, _ in pending.steps])
        rows = values.cpu().tolist()
        # Steps are not synchronized one by one: each gets the interval's mean step time.
        step_time = (now - pending.since) / len(pending.steps)
        tokens = self.ga * self.mbs * self.dp_size * self.cfg.data.seq_len
        steps, pending.steps, pending.since = pending.steps, [], now
        moe = collect_moe_stats(self.model, self.par) if self.has_moe else None
        for (step, _, data_wait), (loss, norm, skipped) in zip(steps, rows, strict=True):
            if skipped:
                self._on_nonfinite(loss, step)
                norm = float("nan")
            result.losses.append(loss)
            metrics.log_step(step_metrics(
                step=step, loss=loss, lr=self.schedule.lr_at(step - 1), grad_norm=norm,
                tokens=tokens, step_time_s=step_time, data_wait_s=data_wait,
                world_size=self.par.dims.world_size, flops_per_token=self.flops_per_token,
                peak_flops=self.peak_flops, baseline=self.mem_baseline,
                peak_flops_fp8=self.peak_flops_fp8,
                moe=moe if step == steps[-1][0] else None))


@dataclass
class _Pending:
    """Steps run but not yet read back: (step, outputs, data wait), since when."""

    since: float
    steps: list[tuple[int, StepOutput, float]] = field(default_factory=list)


class _NoMetrics:
    """What ranks other than 0 log: nothing."""

    def log_step(self, *_: Any) -> None: ...

    def log_eval(self, *_: Any) -> None: ...

    def close(self) -> None: ...
