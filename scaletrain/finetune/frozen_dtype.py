"""Frozen base weights in 16 bits: with `precision.param_dtype bf16` the parameters a method
leaves frozen are stored in bf16 in every layout (one process, DDP, FSDP ZeRO-2/3, TP). They
never update, so they need no fp32 master copy. Trainable parameters (adapters, heads, the
trained part of full/freeze) keep pre-training's convention for 16-bit parameters: bf16 with
fp32 masters in the optimizer (one process, DDP, TP), or FSDP's fp32 shards as the masters,
gathered in bf16 (ZeRO-2/3).

Cast before the layout is applied: on the meta device (sharded loading) the base is then
allocated and read straight into bf16 (`base_sharded.materialize` casts to each parameter's
dtype), and FSDP/TP shard bf16 tensors.
"""

from __future__ import annotations

from torch import nn

from scaletrain.train.precision import DTYPES, cast_params_


def store_frozen(model: nn.Module, param_dtype: str) -> int:
    """Store the frozen floating-point parameters of `model` in `param_dtype` (a no-op for
    fp32); returns how many parameters were cast. Integer tensors (4-bit codes) are left."""
    if param_dtype == "fp32":
        return 0
    dtype = DTYPES[param_dtype]
    frozen = [p for p in model.parameters()
              if not p.requires_grad and p.is_floating_point() and p.dtype != dtype]
    cast_params_(frozen, dtype)
    return len(frozen)


__all__ = ["store_frozen"]
