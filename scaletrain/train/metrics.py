"""Per-step metrics to the terminal (progress bar + log lines), metrics.jsonl and the experiment
trackers of `metrics.loggers` (TensorBoard, W&B, MLflow: `trackers.py`).

Convention (torchtitan's): `tokens_per_s` is the job's (every data-parallel rank's tokens);
`tokens_per_s_per_device`, `tflops` and `mfu` are per device, i.e. the job's figures divided by
the world size (tensor, pipeline and context ranks share their data-parallel rank's tokens).
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from scaletrain.host import current_rss_bytes, file_rss_bytes, peak_rss_bytes, reset_peak_rss
from scaletrain.train.trackers import Tracker

log = logging.getLogger(__name__)


@dataclass
class StepMetrics:
    """Exactly the keys of one metrics.jsonl line."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    """The job's tokens per second."""
    tokens_per_s_per_device: float
    tflops: float
    """Achieved model TFLOP/s of one device."""
    mfu: float | None
    """`tflops` over one device's peak (None where the device has no table entry)."""
    peak_mem_gib: float
    """Peak memory above `mem_baseline_gib` (what `train --dry-run` estimates)."""
    mem_baseline_gib: float
    """Memory in use before the model was built (CPU: the process's private memory:
    interpreter, libraries' own data and the training data; `MemoryBaseline`)."""
    step_time_s: float
    data_wait_s: float
    mfu_fp8: float | None = None
    """With `precision.fp8`: `tflops` over the device's fp8 peak, alongside `mfu` (which stays
    against the bf16 peak, so fp8 and bf16 runs compare); absent otherwise."""
    moe: dict[str, Any] | None = None
    """Mixture-of-Experts models, at log steps: per-layer tokens per expert over the log
    interval (all data-parallel ranks), their max/mean, router entropy and auxiliary loss, and
    the averages over layers (`train/moe_metrics.py`)."""


def step_metrics(*, step: int, loss: float, lr: float, grad_norm: float, tokens: int,
                 step_time_s: float, data_wait_s: float, world_size: int,
                 flops_per_token: float, peak_flops: float | None,
                 baseline: MemoryBaseline, moe: dict[str, Any] | None = None,
                 peak_flops_fp8: float | None = None) -> StepMetrics:
    """One step's metrics under the per-device convention; `tokens` are the job's tokens of
    the step (global batch x sequence length)."""
    tps = tokens / step_time_s
    per_device = tps / world_size
    achieved = flops_per_token * per_device
    return StepMetrics(
        step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tps,
        tokens_per_s_per_device=per_device, tflops=achieved / 1e12,
        mfu=None if peak_flops is None else achieved / peak_flops,
        mfu_fp8=None if peak_flops_fp8 is None else achieved / peak_flops_fp8,
        peak_mem_gib=baseline.peak_above_gib(), mem_baseline_gib=baseline.gib,
        step_time_s=step_time_s, data_wait_s=data_wait_s, moe=moe,
    )


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated CUDA memory; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_bytes() / 2**30


class MemoryBaseline:
    """Memory in use at one moment (before the model is built), so that later peaks can be
    reported above it: on CPU the resident set includes the interpreter, the libraries and the
    data, which no plan counts.

    On CPU what is counted is the process's private memory (anonymous and shared-memory pages:
    what it allocates), not its file-backed pages (`host.file_rss_bytes`: library code,
    memory-mapped files). The kernel drops those under memory pressure and the process faults
    them in again when it next runs that code, so counting them made the peak depend on the
    host: on a CI machine under memory pressure, library pages reclaimed before the baseline
    and faulted back by the first training step added about 20 MiB to a 177 MiB plan
    (reproduced: 19-27 MiB; docs/plan.md, "What the CPU peak counts"). Linux keeps a
    high-water mark only of the whole resident set (VmHWM), so the private peak of each interval
    between two reads is that mark less the file-backed pages (the larger of their counts at
    the interval's two ends), and the mark is restarted for the next interval (`clear_refs`);
    the reported peak is the largest over the intervals. File pages mapped or dropped inside an
    interval are the only error, and they settle after the first step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._private_peak = 0
        if device.type == "cuda":
            self.bytes = torch.cuda.memory_allocated(device)
            return
        self._file_at_reset = file_rss_bytes()
        reset_peak_rss()
        rss = current_rss_bytes()
        if rss is None:
            self.bytes, self._file_at_reset = peak_rss_bytes(), None
        elif self._file_at_reset is None:
            self.bytes = rss
        else:
            self.bytes = rss - self._file_at_reset

    @property
    def gib(self) -> float:
        return self.bytes / 2**30

    def _cpu_peak_bytes(self) -> int:
        """The private peak so far (class docstring); restarts the high-water mark."""
        file_now = file_rss_bytes() if self._file_at_reset is not None else None
        if file_now is None or self._file_at_reset is None:
            return peak_rss_bytes()  # no /proc split: the whole resident set's peak
        interval = peak_rss_bytes() - max(self._file_at_reset, file_now)
        self._file_at_reset = file_now
        reset_peak_rss()
        self._private_peak = max(self._private_peak, interval)
        return self._private_peak

    def peak_above_gib(self) -> float:
        """The peak above the baseline so far. On CPU each call closes an interval and restarts
        the high-water mark (class docstring): the trainer calls it once per step."""
        if self.device.type == "cuda":
            return max(0.0, peak_memory_gib(self.device) - self.gib)
        return max(0.0, (self._cpu_peak_bytes() - self.bytes) / 2**30)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Remove the records with step > last_step from a JSON-lines file of a run directory (a
    resumed run writes them again; a fresh run, `last_step` 0, starts the file anew)."""
    if path.exists():
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= last_step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash
        path.write_text("".join(k + "\n" for k in keep))


def _open_truncated(path: Path, last_step: int) -> Any:
    """Open a JSON-lines file for appending after removing the records with step > last_step."""
    truncate_jsonl(path, last_step)
    return path.open("a")


class MetricsLogger:
    def __init__(self, output: Path, total_steps: int, log_interval: int,
                 trackers: list[Tracker], progress_bar: bool, start_step: int = 0) -> None:
        self.output = output
        self.log_interval = log_interval
        self.start_step, self.total_steps = start_step, total_steps
        # A resumed run drops lines past its checkpoint, so every step appears exactly once.
        self.jsonl = _open_truncated(output / "metrics.jsonl", start_step)
        self.eval_jsonl = _open_truncated(output / "eval.jsonl", start_step)
        self.trackers = trackers
        self.progress = None
        if progress_bar and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total}"),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                               info="")
            self.progress.start()

    def _scalars(self, values: dict[str, float], step: int) -> None:
        for t in self.trackers:
            t.scalars(values, step)

    def log_text(self, key: str, text: str, step: int,
                 values: dict[str, float] | None = None) -> None:
        """A report (the plan, the profiler's verdict) and its figures to every tracker."""
        for t in self.trackers:
            t.text(key, text, step)
            if values:
                t.scalars(values, step)

    def log_step(self, m: StepMetrics) -> None:
        row = asdict(m)
        for key in ("moe", "mfu_fp8"):
            if row[key] is None:
                del row[key]
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self.trackers:
            values = {f"train/{k}": v for k, v in row.items()
                      if k not in ("step", "moe") and v is not None}
            values.update({f"moe/{k}": v for k, v in (m.moe or {}).items()
                           if k != "layers" and v is not None})
            self._scalars(values, m.step)
        if self.progress is not None:
            self.progress.update(self.task, completed=m.step,
                                 info=f"loss {m.loss:.3f} {m.tokens_per_s:,.0f} tok/s")
        if m.step % self.log_interval == 0 or m.step in (self.start_step + 1, self.total_steps):
            mfu = "n/a" if m.mfu is None else f"{100 * m.mfu:.1f}%"
            if m.mfu_fp8 is not None:
                mfu += f" (of the fp8 peak {100 * m.mfu_fp8:.1f}%)"
            log.info(
                "step %5d | loss %.4f | lr %.2e | grad %.3f | %8.0f tok/s | %.2f TFLOP/s/device | "
                "mfu %s | mem %.2f GiB (+%.2f baseline) | %.3f s (data %.3f s)",
                m.step, m.loss, m.lr, m.grad_norm, m.tokens_per_s, m.tflops, mfu,
                m.peak_mem_gib, m.mem_baseline_gib, m.step_time_s, m.data_wait_s,
            )

    def log_eval(self, step: int, val_loss: float) -> None:
        self.eval_jsonl.write(json.dumps({"step": step, "val_loss": val_loss}) + "\n")
        self.eval_jsonl.flush()
        self._scalars({"val/loss": val_loss}, step)
        log.info("step %5d | validation loss %.4f", step, val_loss)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:  # a tracker's upload must not fail a finished run
                log.warning("closing the %s logger failed: %s", t.name, e)
        self.jsonl.close()
        self.eval_jsonl.close()
