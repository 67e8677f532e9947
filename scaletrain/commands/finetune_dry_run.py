"""`scaletrain finetune --dry-run [--json]`: plan the fine-tuning run `finetune` would start,
without reading weights or building a model.

The base's dimensions come from its config (`loader.model_args_of`), the layout from the same
config fields as `train --dry-run`, and the model states from the method, its LoRA targets,
trained norms, frozen blocks and (classification) the label set of the data
(`plan.finetune.finetune_plan`): the parameter counts equal the ones `finetune` reports in
`finetune.json`. Exit codes as `train --dry-run`: 0 fits, 3 does not fit, 2 refused.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import TYPE_CHECKING

from scaletrain.config import Config, ConfigError

if TYPE_CHECKING:
    from scaletrain.plan.hardware import Device
    from scaletrain.plan.layout import Plan

PROG = "scaletrain finetune --dry-run"


def plan_finetune(cfg: Config, fit: bool = False) -> tuple[Plan, Device | None]:
    """The plan of `scaletrain finetune` with `cfg` (see the module docstring)."""
    from scaletrain.finetune import data as ftdata
    from scaletrain.finetune.lora import parse_targets
    from scaletrain.finetune.trainer import check_config, fit_seq_len, with_ddp_default
    from scaletrain.inference.loader import model_args_of
    from scaletrain.plan.estimate import estimate
    from scaletrain.plan.finetune.plan import finetune_plan
    from scaletrain.plan.from_config import device_for, layout_from_config
    from scaletrain.runtime import resolve_device

    check_config(cfg)
    cfg = copy.deepcopy(cfg)
    ft = cfg.finetune
    args = model_args_of(ft.base)
    cfg.data.seq_len = fit_seq_len(cfg.data.seq_len, args.max_seq_len, fit)
    num_labels = None
    if ft.task == "classification":
        records = ftdata.read_jsonl(ft.data)
        if ft.val_data:
            records += ftdata.read_jsonl(ft.val_data)
        num_labels = len(ftdata.label_set(records, ft.labels))
    cfg = with_ddp_default(cfg)  # the fine-tuning trainer's data parallelism
    device = resolve_device(cfg.training.device)
    lay = layout_from_config(cfg, device, int(os.environ.get("WORLD_SIZE", "1")))
    lora = ft.method in ("lora", "qlora")
    plan = finetune_plan(estimate(args, lay), ft.method, rank=ft.lora_rank,
                         train_last=ft.train_last, freeze_first=ft.freeze_first,
                         num_labels=num_labels, targets=parse_targets(ft.lora_targets),
                         train_norms=ft.train_norms and lora,
                         freeze_embeddings=ft.freeze_embeddings, lora_dropout=ft.lora_dropout)
    return plan, device_for(device)


def dry_run(cfg: Config, fit_seq_len: bool = False, as_json: bool = False) -> int:
    from scaletrain.commands.train_dry_run import report
    from scaletrain.finetune.base import FinetuneError
    from scaletrain.finetune.lora import LoRAError
    from scaletrain.plan.layout import PlanError
    from scaletrain.train.checkpoint import CheckpointError

    try:
        plan, device = plan_finetune(cfg, fit_seq_len)
    except (ConfigError, PlanError, FinetuneError, LoRAError, CheckpointError, OSError,
            KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) else str(e)
        print(f"{PROG}: {msg}", file=sys.stderr)
        return 2
    return report(plan, device, as_json, PROG)
