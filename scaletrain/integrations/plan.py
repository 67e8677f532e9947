"""The plan of a model a framework trains, from its Hugging Face config, for the run's batch,
sequence length, precision and data-parallel world: what `scaletrain plan` prints."""

from __future__ import annotations

import logging
from typing import Any

import torch

from scaletrain.models.hf import model_args_from_hf_config
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate, plan_json
from scaletrain.plan.from_config import device_for
from scaletrain.plan.layout import Layout, Plan
from scaletrain.plan.text import format_plan

log = logging.getLogger(__name__)


def hf_config_dict(config: Any) -> dict[str, Any]:
    """A transformers `PretrainedConfig` (or a plain dict) as the dict of its config.json."""
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"not a Hugging Face config: {type(config).__name__}")


def plan_for(config: Any, *, micro_batch: int, seq_len: int, grad_accum: int = 1,
             precision: str = "fp32", world_size: int = 1,
             device: torch.device | None = None) -> tuple[Plan, Any]:
    """The estimate for data-parallel training (DDP: every rank holds the whole model) of the
    model `config` describes; a ValueError when the planner cannot represent the model."""
    args = model_args_from_hf_config(hf_config_dict(config))
    dims = ParallelDims(dp_replicate=world_size)
    device = device or torch.device("cpu")
    lay = Layout(dims=dims, mbs=micro_batch, seq_len=seq_len,
                 gbs=micro_batch * grad_accum * world_size, precision=precision,
                 kernels="cuda" if device.type == "cuda" else "cpu")
    return estimate(args, lay), device_for(device)


def plan_text(config: Any, **layout: Any) -> tuple[str, dict[str, Any] | None]:
    """The printed plan and its JSON (None when the model cannot be planned: the text says
    why)."""
    try:
        plan, device = plan_for(config, **layout)
    except (ValueError, KeyError, TypeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) else str(e)
        return f"scaletrain plan: cannot plan this model: {msg}", None
    header = ("scaletrain plan of the model being trained (mbs {micro_batch}, seq {seq_len}, "
              "accumulation {grad_accum}, {precision}, {world_size} data-parallel rank(s)):"
              ).format(**{"grad_accum": 1, "precision": "fp32", "world_size": 1, **layout})
    return header + "\n" + format_plan(plan, device), plan_json(plan, device)


def precision_name(bf16: bool, fp16: bool) -> str:
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"
