"""`scaletrain finetune --base DIR --method full|freeze|lora|qlora --task sft|classification
--data PATH --output DIR [--section.field value ...] [--dry-run [--json]]`.

`--dry-run` plans the run (parameters, memory per component, whether it fits) without reading
weights or building anything (`commands/finetune_dry_run.py`).

The short flags are aliases of `--finetune.base`, `--finetune.method`, `--finetune.task` and
`--finetune.data`; every other field of the config tree (see `--help`) can be set too. The
defaults come from the `finetune` preset (`--config NAME_OR_TOML` picks another); its
`data.seq_len` is lowered to the base model's `max_seq_len` when that is shorter.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from scaletrain.commands.train_dry_run import split_flags
from scaletrain.config import ConfigError, flag_given, load_config

log = logging.getLogger(__name__)

_ALIASES = {"--base": "--finetune.base", "--method": "--finetune.method",
            "--task": "--finetune.task", "--data": "--finetune.data"}


def expand_aliases(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        name = _ALIASES.get(name, name)
        out.append(name + eq + value if eq else name)
    return out


def main(argv: list[str]) -> int:
    argv, dry_run, as_json = split_flags(argv)
    argv = expand_aliases(argv)
    own_config = flag_given(argv, "--config")
    if not own_config:
        argv = ["--config", "finetune", *argv]
    # the preset's data.seq_len is a default: it is fitted to the base model
    fit_seq_len = not own_config and not any(a.split("=")[0] == "--data.seq_len" for a in argv)
    try:
        cfg = load_config(argv, prog="scaletrain finetune")
    except ConfigError as e:
        print(f"scaletrain finetune: {e}", file=sys.stderr)
        return 2
    if dry_run:
        from scaletrain.commands.finetune_dry_run import dry_run as plan_run

        return plan_run(cfg, fit_seq_len, as_json)
    from scaletrain.commands._run import run_training
    from scaletrain.finetune.base import FinetuneError
    from scaletrain.finetune.freeze import FreezeError
    from scaletrain.finetune.lora import LoRAError

    code, out = run_training("scaletrain finetune", cfg, lambda: _finetune(cfg, fit_seq_len),
                             (FinetuneError, LoRAError, FreezeError, ImportError))
    if out is None:
        return code
    result, scores = out
    if result.losses:
        log.info("fine-tuned %d steps in %.1f s: loss %.4f -> %.4f, validation loss %.4f; "
                 "%s tokens seen (step %d)", len(result.losses), result.wall_time_s,
                 result.losses[0], result.losses[-1], result.val_loss,
                 f"{result.tokens_seen:,}", result.steps)
    if scores:
        log.info("validation accuracy %.4f, macro-F1 %.4f", scores["accuracy"],
                 scores["macro_f1"])
    log.info("output: %s", cfg.output)
    return 0


def _finetune(cfg: Any, fit_seq_len: bool) -> tuple[Any, dict[str, float] | None]:
    """Build and run the trainer: (its result, its last validation scores); the trainer itself
    is out of reach after this call, so its process groups can be freed. A plan far above
    the memory there is stops before set-up; running out of memory is one message."""
    from scaletrain.commands._memory_fit import check_before_setup, out_of_memory_as_message
    from scaletrain.commands.finetune_dry_run import plan_finetune
    from scaletrain.finetune.trainer import FinetuneTrainer
    from scaletrain.runtime import resolve_device

    plan, device = lambda: plan_finetune(cfg, fit_seq_len)[0], resolve_device(cfg.training.device)
    check_before_setup(plan, device, cfg.training.skip_memory_check)
    with out_of_memory_as_message(plan, device):
        trainer = FinetuneTrainer(cfg, fit_seq_len=fit_seq_len)
        result = trainer.train()
    return result, getattr(trainer, "last_scores", None)
