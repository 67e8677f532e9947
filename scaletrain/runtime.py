"""Which device and which autocast dtype a run uses.

Shared by the trainer (to build the run) and the planner (`train --dry-run` plans what the
trainer will run), so it lives below both: it imports only the config.
"""

from __future__ import annotations

import logging

import torch

from scaletrain.config import Config, ConfigError, PrecisionConfig
from scaletrain.models.args import ModelArgs

log = logging.getLogger("scaletrain")


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


def resolve_model_args(cfg: Config) -> ModelArgs:
    """The model a training run builds: the preset with the `model.*` overrides; without
    `model.vocab_size`, a tokenizer larger than the preset's vocabulary widens it to the
    tokenizer's (a smaller one leaves the preset as it is, so the model matches
    `scaletrain plan --model PRESET`)."""
    args = cfg.model.to_model_args()
    if cfg.model.vocab_size is None:
        from scaletrain.data.sources import expected_vocab_size

        vocab = expected_vocab_size(cfg.data)
        if vocab is not None and vocab > args.vocab_size:
            log.info("model vocabulary: %d, the tokenizer's (larger than the preset's %d; set "
                     "--model.vocab_size to override)", vocab, args.vocab_size)
            args = args.replace(vocab_size=vocab)
    return args
