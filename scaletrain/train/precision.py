"""Mixed precision: which autocast dtype to use, the autocast context and the fp16 loss scaler."""

from __future__ import annotations

import contextlib

import torch

from scaletrain.runtime import cpu_has_fast_bf16, resolve_dtype

__all__ = ["DTYPES", "autocast", "cpu_has_fast_bf16", "grad_scaler", "resolve_dtype"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """Autocast context for forward (and loss); a no-op for fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def grad_scaler(device: torch.device, dtype: str) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler for fp16 (bf16 and fp32 have the range to need none)."""
    if dtype != "fp16":
        return None
    return torch.amp.GradScaler(device.type)
