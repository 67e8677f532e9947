"""Mixed precision: which autocast dtype to use, the autocast context and the fp16 loss scaler."""

from __future__ import annotations

import contextlib
import logging

import torch

from scaletrain.config import PrecisionConfig

log = logging.getLogger("scaletrain.train")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """Autocast context for forward (and loss); a no-op for fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def grad_scaler(device: torch.device, dtype: str,
                sharded: bool = False) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler for fp16 (bf16 and fp32 have the range to need none).

    `sharded`: gradients differ between ranks (FSDP, tensor or pipeline parallel), so whether
    one is inf/NaN is agreed over all ranks (torch's ShardedGradScaler); DDP's reduced
    gradients are the same everywhere and take the plain scaler.
    """
    if dtype != "fp16":
        return None
    if sharded:
        return _sharded_scaler(device)
    return torch.amp.GradScaler(device.type)


def _sharded_scaler(device: torch.device) -> torch.amp.GradScaler:
    """torch's ShardedGradScaler (inf/NaN agreed over all ranks), whose found-inf flags are
    made scalars: fused optimizers take them as a step-count decrement of shape []."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    class Scaler(ShardedGradScaler):
        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            super().unscale_(optimizer)
            state = self._per_optimizer_states[id(optimizer)]
            state["found_inf_per_device"] = {
                d: t.reshape(()) for d, t in state["found_inf_per_device"].items()}

    return Scaler(device.type)
