"""QLoRA's base: every linear layer of the transformer blocks stored as 4-bit NF4 with double
quantization (the per-block scales are quantized again), via bitsandbytes (CPU and CUDA).

Embeddings, norms and the output head stay in full precision, as in the QLoRA recipe. In MoE
blocks the router stays in full precision too (it reads its weight as a dense matrix, and it is
small), and so do the routed experts: they are stacked 3-D parameters, for which bitsandbytes has
no 4-bit layer, so QLoRA on an MoE model quantizes the attention only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from scaletrain.plan.finetune.estimate import NF4_BLOCK_SIZE

log = logging.getLogger(__name__)

BLOCK_SIZE = NF4_BLOCK_SIZE  # elements sharing one absmax; the plan counts the same


def _bnb():
    try:
        import bitsandbytes as bnb
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "--method qlora needs bitsandbytes: pip install 'scaletrain[quant]'"
        ) from e
    return bnb


def check_cpu_rows(in_features: int) -> None:
    """Refuse a layer bitsandbytes cannot quantize right on the CPU (where QLoRA quantizes)."""
    if in_features % BLOCK_SIZE:
        # bitsandbytes 0.50's CPU kernel takes the wrong block scale when a row of the weight
        # does not end on a block boundary (seen: errors of 13x the block's absmax).
        raise ValueError(
            f"QLoRA on CPU needs layer input sizes divisible by {BLOCK_SIZE}; this model has a "
            f"linear layer with {in_features} inputs (bitsandbytes' CPU 4-bit kernel "
            "mis-reads such rows); use --method lora, or a GPU"
        )


def to_nf4(linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    """A bitsandbytes `Linear4bit` (NF4, double quantization) holding `linear`'s weights."""
    bnb = _bnb()
    weight = linear.weight.detach()
    if weight.device.type == "cpu":
        check_cpu_rows(linear.in_features)
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=compute_dtype, compress_statistics=True,
                          quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(weight.float().cpu(), requires_grad=False,
                                 compress_statistics=True, quant_type="nf4",
                                 blocksize=BLOCK_SIZE)
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return q.to(weight.device)  # bitsandbytes quantizes on the move to a device


def quantize_blocks(model: nn.Module, compute_dtype: torch.dtype,
                    make: Callable[[nn.Linear, torch.dtype], nn.Module] | None = None) -> int:
    """Replace every `nn.Linear` inside `model.layers` by its NF4 version (`make`, `to_nf4`
    by default; a model on the meta device: `qlora_load.empty_nf4`); returns the count."""
    count = 0
    moe = False
    for block in model.layers.values():
        for name, module in list(block.named_modules()):
            if name.endswith("router.gate"):
                moe = True
                continue
            if type(module) is nn.Linear:
                parent_name, _, attr = name.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                setattr(parent, attr, (make or to_nf4)(module, compute_dtype))
                count += 1
    log.info("QLoRA: %d linear layers stored as NF4 (double quantization), compute in %s",
             count, str(compute_dtype).removeprefix("torch."))
    if moe:
        log.warning("QLoRA on an MoE model: the routers and the routed experts stay in full "
                    "precision (bitsandbytes has no 4-bit layer for stacked expert weights)")
    return count


def is_nf4(module: nn.Module) -> bool:
    """A bitsandbytes 4-bit layer (False when bitsandbytes is not installed)."""
    try:
        bnb = _bnb()
    except ImportError:
        return False
    return isinstance(module, bnb.nn.Linear4bit)


def dequantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """The dense (out, in) matrix an NF4 parameter stands for (bitsandbytes' dtype)."""
    import bitsandbytes.functional as F

    return F.dequantize_4bit(weight.data, weight.quant_state)


def dequantize(module: nn.Module) -> torch.Tensor:
    """The dense (out, in) fp32 weight an NF4 layer stands for."""
    return dequantize_weight(module.weight).float()


__all__ = ["to_nf4", "check_cpu_rows", "quantize_blocks", "is_nf4", "dequantize",
           "dequantize_weight", "BLOCK_SIZE"]
