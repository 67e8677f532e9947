"""FP8 training through torchao's float8 linears (tensorwise or rowwise scaling).

Only where it can run: a CUDA device of compute capability 8.9 or newer (Ada, Hopper and
later), torchao installed, bf16 autocast, one process. Everywhere else `fp8_problem` names why,
and the trainer refuses with a ConfigError (exit 2) before building anything.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

FP8_MODES = ("none", "tensorwise", "rowwise")


def fp8_problem(mode: str, device: torch.device, dtype: str, parallel: bool) -> str | None:
    """Why `precision.fp8 = mode` cannot run here (None when it can, or when mode is none)."""
    if mode == "none":
        return None
    if mode not in FP8_MODES:
        return f"precision.fp8 must be one of {', '.join(FP8_MODES)}, got {mode!r}"
    if device.type != "cuda":
        return (f"precision.fp8 {mode} needs a CUDA GPU of compute capability 8.9 or newer "
                f"(Ada, Hopper); this run is on {device.type}. Set precision.fp8 none")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"precision.fp8 {mode} needs compute capability 8.9 or newer; "
                f"{torch.cuda.get_device_name(device)} has {major}.{minor}. Set precision.fp8 none")
    if importlib.util.find_spec("torchao") is None:
        return (f"precision.fp8 {mode} needs torchao (pip install torchao, a version built for "
                f"torch {torch.__version__}); or set precision.fp8 none")
    if dtype != "bf16":
        return f"precision.fp8 {mode} runs under bf16 autocast; set precision.dtype bf16"
    if parallel:
        return (f"precision.fp8 {mode} runs on one process so far; set precision.fp8 none for "
                "parallel layouts")
    return None


def apply_fp8(model: nn.Module, mode: str) -> None:
    """Swap the model's linears (the output head excepted) for torchao float8 linears."""
    if mode == "none":
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(mode)

    def keep(module: nn.Module, fqn: str) -> bool:  # dims must be multiples of 16; head stays
        if not isinstance(module, nn.Linear) or fqn == "output":
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    log.info("fp8 (%s): linear layers converted to torchao float8", mode)
