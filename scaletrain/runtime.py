"""Which device and which autocast dtype a run uses.

Shared by the trainer (to build the run) and the planner (`train --dry-run` plans what the
trainer will run), and by the parallel layers and fine-tuning, so it lives below all of them: it
imports only the config.
"""

from __future__ import annotations

import logging

import torch

from scaletrain.config import ConfigError, PrecisionConfig

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """`training.device` as a torch device ("auto": CUDA when available, else CPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"training.device is '{name}' but CUDA is not available; use 'cpu'")
    return device


def cpu_has_fast_bf16() -> bool:
    """True where the CPU has AVX-512 bf16 instructions (elsewhere bf16 can be 17x slower)."""
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


def resolve_dtype(cfg: PrecisionConfig, device: torch.device) -> str:
    """The autocast dtype name ("fp32", "bf16" or "fp16") that `cfg.dtype` means on `device`."""
    if cfg.dtype != "auto":
        if cfg.dtype == "bf16" and device.type == "cpu" and not cpu_has_fast_bf16():
            log.warning("bf16 on a CPU without AVX-512 bf16 is emulated and much slower than fp32")
        return cfg.dtype
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if device.type == "cpu" and cpu_has_fast_bf16() else "fp32"


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `x` runs in here: the autocast dtype when autocast is on for its
    device (and `x` is floating point), else `x`'s own. For autograd Functions that turn
    autocast off inside and cast themselves, as autocast would have."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        return torch.get_autocast_dtype(device)
    return x.dtype

