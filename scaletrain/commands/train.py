"""`scaletrain train [--config NAME_OR_TOML] [--section.field value ...]`."""

from __future__ import annotations

import logging
import sys

from scaletrain.config import ConfigError, load_config

log = logging.getLogger("scaletrain")


def main(argv: list[str]) -> int:
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"scaletrain train: {e}", file=sys.stderr)
        return 2
    if dry_run:
        return _dry_run(cfg)
    from scaletrain.parallel.dims import ParallelDimsError
    from scaletrain.parallel.failure import DistributedFailure
    from scaletrain.train.checkpoint import CheckpointError
    from scaletrain.train.trainer import Trainer, TrainingDiverged

    try:
        trainer = Trainer(cfg)
        result = trainer.train()
    except (ConfigError, CheckpointError, ParallelDimsError) as e:
        print(f"scaletrain train: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"scaletrain train: {e}", file=sys.stderr)
        return 1
    except DistributedFailure as e:
        print(f"scaletrain train: {e}", file=sys.stderr)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    losses = result.losses
    if losses:
        log.info("trained %d steps in %.1f s: loss %.4f -> %.4f, validation loss %.4f",
                 len(losses), result.wall_time_s, losses[0], losses[-1], result.val_loss)
    if result.checkpoint:
        log.info("checkpoint: %s", result.checkpoint)
    if result.sample:
        log.info("sample (prompt\u2588continuation):\n%s", result.sample)
    return 0


def _dry_run(cfg) -> int:
    """Print the plan of this config and whether it fits the device; build nothing."""
    from scaletrain.commands.plan import format_plan
    from scaletrain.plan.estimate import PlanError
    from scaletrain.plan.from_config import plan_config
    from scaletrain.runtime import resolve_device

    try:
        plan, device = plan_config(cfg, resolve_device(cfg.training.device))
    except (ConfigError, PlanError) as e:
        print(f"scaletrain train --dry-run: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan, device))
    if device is None:
        print("device: not in the device table; cannot say whether it fits")
    return 0
