"""`scaletrain profile [--config NAME_OR_TOML] [--section.field value ...]`.

Runs just enough training steps for the profiler schedule (unless `--training.steps` is
given), with `profiling.enabled` on, then diagnoses the traces it wrote: the report goes to the
terminal, `<profile dir>/diagnosis.json` and `<profile dir>/report.html`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from scaletrain.config import ConfigError, load_config
from scaletrain.profiling.analyze import latest_traces
from scaletrain.profiling.capture import FRESH_RUN_FLAGS

log = logging.getLogger(__name__)


def _with_defaults(argv: list[str]) -> list[str]:
    """Profiling on; a short fresh run (no resume, no checkpoint, no sample) unless the user
    says so: a profile measures new steps, and leaves the run directory's checkpoints alone."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    extra = ["--profiling.enabled", "true"]
    for flag, value in FRESH_RUN_FLAGS:
        if flag not in given:
            extra += [flag, value]
    return [*argv, *extra]


def _is_rank0() -> bool:
    """Under torchrun: wait for every rank's trace, then let rank 0 alone analyse them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def main(argv: list[str]) -> int:
    argv = _with_defaults(list(argv))
    try:
        cfg = load_config(argv, prog="scaletrain profile")
    except ConfigError as e:
        print(f"scaletrain profile: {e}", file=sys.stderr)
        return 2
    p = cfg.profiling
    needed = p.wait + p.warmup + p.active * max(p.repeat, 1)
    if "--training.steps" not in {a.split("=", 1)[0] for a in argv}:
        cfg.training.steps = needed
    elif cfg.training.steps < needed:
        log.warning("training.steps (%d) ends before the profiler schedule (%d steps) completes",
                    cfg.training.steps, needed)
    from scaletrain.parallel.mesh import shutdown_process_group
    from scaletrain.profiling import report
    from scaletrain.profiling.analyze import analyze
    from scaletrain.profiling.trace import TraceError
    from scaletrain.train.checkpoint import CheckpointError
    from scaletrain.train.trainer import Trainer

    try:
        trainer = Trainer(cfg)
        trainer.train()
        analyse = _is_rank0()  # before the process group goes: waits for every rank's trace
    except (ConfigError, CheckpointError) as e:
        print(f"scaletrain profile: {e}", file=sys.stderr)
        return 2
    finally:  # also under torchrun: no process group outlives the run (see shutdown_process_group)
        shutdown_process_group()
    if not analyse:
        return 0  # rank 0 diagnoses every rank's trace
    folder = Path(p.output_dir) if p.output_dir else Path(cfg.output) / "profile"
    traces = latest_traces(folder)
    if not traces:
        print(f"scaletrain profile: no trace was written under {folder}/traces; the run ended "
              "before the profiler's active steps", file=sys.stderr)
        return 1
    from scaletrain.commands.diagnose import timelines

    try:  # the trainer diagnosed the window already (for the trackers); else do it here
        result = trainer.diagnosis or analyze(
            traces, memory_timeline=timelines([str(folder)]) or None, cfg=cfg)
    except TraceError as e:
        print(f"scaletrain profile: {e}", file=sys.stderr)
        return 1
    report.write_atomic(folder / "diagnosis.json", report.to_json(result))
    report.write_atomic(folder / "report.html", report.to_html(result))
    print(report.terminal(result))
    print(f"traces: {', '.join(str(t) for t in traces)}\nreport: {folder / 'report.html'}, "
          f"{folder / 'diagnosis.json'}\nopen a trace at https://ui.perfetto.dev or "
          f"`tensorboard --logdir {folder}`")
    return 0
