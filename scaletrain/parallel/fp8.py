"""FP8 training through torchao's float8 linears (tensorwise or rowwise scaling).

Where it runs: a CUDA device of compute capability 8.9 or newer (Ada, Hopper and later), and
the CPU for correctness checks and tests: there torchao's emulation quantizes inputs, weights
and gradients to fp8 with the same scales and multiplies the fp8 values in fp32 (bit-equal to
torch's CPU `_scaled_mm`, which is ~100x slower). It needs torchao and bf16 autocast (fp32
runs too: fp8 matmuls, everything else fp32). Everywhere else `fp8_problem` names why, and
the trainer refuses with a ConfigError (exit 2) before building anything. Which parallel
layouts combine with fp8 is a layout question: `parallel/feasibility.py`.

Every linear but the output head (and any whose dimensions are not multiples of 16) becomes a
`Float8Linear`; its `weight` and `bias` keep their names, so checkpoints, initialization and
the optimizer see the same parameters. Under FSDP2 with tensorwise scaling the weights are
all-gathered in fp8 (`enable_fsdp_float8_all_gather`; half the bytes of bf16), and their scales
are computed for the next step right after each optimizer step, with one all-reduce
(`precompute_scales`). Rowwise scaling has no fp8 all-gather in torchao: FSDP gathers the
fp32 (or `fsdp_param_dtype`) weights and each matmul casts them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

FP8_MODES = ("none", "tensorwise", "rowwise")
INSTALL = "pip install 'scaletrain[fp8]'"
_cpu_logged = False


def fp8_problem(mode: str, device: torch.device, dtype: str) -> str | None:
    """Why `precision.fp8 = mode` cannot run on `device` (None when it can, or when mode is
    none). The parallel layouts fp8 combines with are checked by `layout_problems`."""
    if mode == "none":
        return None
    if mode not in FP8_MODES:
        return f"precision.fp8 must be one of {', '.join(FP8_MODES)}, got {mode!r}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"precision.fp8 {mode} needs a GPU of compute capability 8.9 or newer (Ada, "
                    f"Hopper); {torch.cuda.get_device_name(device)} has {major}.{minor}. Set "
                    "precision.fp8 none")
    elif device.type != "cpu":
        return (f"precision.fp8 {mode} runs on CUDA GPUs of compute capability 8.9 or newer "
                f"(and on the CPU, for correctness checks); this run is on {device.type}. Set "
                "precision.fp8 none")
    if importlib.util.find_spec("torchao") is None:
        return f"precision.fp8 {mode} needs torchao ({INSTALL}); or set precision.fp8 none"
    if dtype == "fp16":  # torchao's recipes are built for bf16 (fp32 runs, for checks)
        return (f"precision.fp8 {mode} runs under bf16 autocast (or fp32), not fp16 with its "
                "loss scaling; set precision.dtype bf16")
    return None


def fsdp_all_gather(mode: str) -> bool:
    """Whether FSDP all-gathers this recipe's weights in fp8 (tensorwise only)."""
    return mode == "tensorwise"


def _keep(module: nn.Module, fqn: str) -> bool:
    """The linears that become fp8: all but the head and MoE routers (whose weights they read
    directly, in fp32), dimensions multiples of 16."""
    parts = fqn.split(".")
    if not isinstance(module, nn.Linear) or parts[-1] == "output" or "router" in parts:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: nn.Module, mode: str, device: torch.device | None = None, *,
              fsdp: bool = False) -> int:
    """Swap the model's linears (the output head excepted) for torchao float8 linears, in
    place (on a meta-device model too, before any parallel wrapping). With `fsdp` and the
    tensorwise recipe the weights become fp8 all-gather tensors. Returns how many linears were
    converted."""
    if mode == "none":
        return 0
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    global _cpu_logged
    cpu = device is not None and device.type == "cpu"
    if cpu and not _cpu_logged:
        _cpu_logged = True
        log.warning("fp8 on the CPU is emulated (values and scales as on a GPU, matmuls in "
                    "fp32): use it to check correctness, not for speed")
    if mode == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    else:
        config = Float8LinearConfig.from_recipe_name(mode)
    if cpu:  # torch's CPU _scaled_mm gives the same values ~100x slower than the emulation
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=_keep)
    n = sum(isinstance(m, Float8Linear) for m in model.modules())
    log.info("fp8 (%s): %d linear layers converted to torchao float8%s", mode, n,
             ", weights all-gathered in fp8" if fsdp and config.enable_fsdp_float8_all_gather
             else "")
    return n


def precompute_scales(model: nn.Module) -> None:
    """After an optimizer step under FSDP with fp8 all-gather: the weights' scales for the next
    forward, from the updated full weights (one all-reduce of their amaxes)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
