"""Mixed precision: which autocast dtype to use, the autocast context and the fp16 loss scaler."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from scaletrain.runtime import cpu_has_fast_bf16, resolve_dtype

__all__ = ["DTYPES", "autocast", "cast_params_", "cpu_has_fast_bf16", "grad_scaler",
           "resolve_dtype"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """Autocast context for forward (and loss); a no-op for fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


@torch.no_grad()
def cast_params_(params: list[torch.nn.Parameter], dtype: torch.dtype) -> None:
    """Store `params` in `dtype`, in place (the modules keep the same parameter objects). A
    DTensor's contents are swapped whole: assigning `.data` would change its dtype but not its
    local shard's. Hooks registered on a DTensor parameter before the swap do not follow it."""
    for p in params:
        if p.dtype == dtype:
            continue
        if isinstance(p, DTensor):
            torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().to(dtype),
                                                           requires_grad=p.requires_grad))
        else:
            p.data = p.data.to(dtype)


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
        def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                            found_inf: torch.Tensor, allow_fp16: bool = True
                            ) -> dict[torch.device, torch.Tensor]:
            """torch's, on each gradient's local tensor: one foreach call cannot mix DTensor
            and plain gradients, and tensor parallelism without sequence parallelism keeps
            plain (replicated) norm weights beside its DTensors."""
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                        groups.setdefault((g.device, g.dtype), []).append(g)
            found: dict[torch.device, torch.Tensor] = {}
            with torch.no_grad():
                for (device, _), grads in groups.items():
                    flag = found.setdefault(device, found_inf.to(device))
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag,
                                                                     inv_scale.to(device))
            return found or {found_inf.device: found_inf}

        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            super().unscale_(optimizer)
            state = self._per_optimizer_states[id(optimizer)]
            state["found_inf_per_device"] = {
                d: t.reshape(()) for d, t in state["found_inf_per_device"].items()}

    return Scaler(device.type)
