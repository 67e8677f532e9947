"""`scaletrain train [--config NAME_OR_TOML] [--section.field value ...]`."""

from __future__ import annotations

import logging
import sys
from typing import Any

from scaletrain.commands.train_dry_run import split_flags
from scaletrain.config import ConfigError, load_config

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    argv, dry_run, as_json = split_flags(argv)
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"scaletrain train: {e}", file=sys.stderr)
        return 2
    if dry_run:
        from scaletrain.commands.train_dry_run import dry_run as plan_run

        return plan_run(cfg, as_json)
    from scaletrain.commands._run import run_training

    code, result = run_training("scaletrain train", cfg, lambda: _train(cfg))
    if result is None:
        return code
    losses = result.losses
    if losses:
        log.info("trained %d steps in %.1f s: loss %.4f -> %.4f, validation loss %.4f; %s "
                 "tokens seen (step %d)", len(losses), result.wall_time_s, losses[0],
                 losses[-1], result.val_loss, f"{result.tokens_seen:,}", result.steps)
    if result.checkpoint:
        log.info("checkpoint: %s", result.checkpoint)
    if result.sample:
        log.info("sample (prompt\u2588continuation):\n%s", result.sample)
    return 0


def _train(cfg: Any) -> Any:
    """Build and run the trainer; only its result outlives this call, so the process groups
    its mesh and model hold can be freed before the process exits. A plan far above the
    memory there is stops before set-up; running out of memory is one message
    (`commands._memory_fit`)."""
    from scaletrain.commands._memory_fit import (
        check_before_setup,
        out_of_memory_as_message,
        training_plan,
    )
    from scaletrain.runtime import resolve_device
    from scaletrain.train.trainer import Trainer

    plan, device = training_plan(cfg), resolve_device(cfg.training.device)
    check_before_setup(plan, device, cfg.training.skip_memory_check)
    with out_of_memory_as_message(plan, device):
        return Trainer(cfg).train()
