"""LoRA fused with its base projection: `y = x W^T + b + s (x A^T) B^T` as one autograd node.

What it saves against composing `base(x) + lora_B(lora_A(x) * s)` with autograd:

- the adapter's output is added inside the second GEMM (`addmm_` into the base output) in
  forward, and the adapter's input gradient inside the base's input-gradient GEMM in backward:
  no full-size update tensor, no separate full-size add, one full-size gradient;
- under autocast the frozen base weight is cast for the matmul and NOT kept: autograd keeps the
  cast copy of every linear's weight for backward (autocast caches casts only for weights that
  require gradients, so a frozen weight is cast, and stored, once per call); here backward casts
  the fp32 weight again, which costs one read of the weight instead of holding a 16-bit copy of
  every adapted projection for the whole forward;
- kept for backward: the input (in the compute dtype), the r-wide `x A^T` and the parameters.

QLoRA (a bitsandbytes NF4 base): the weight is dequantized for the forward matmul and dropped,
and dequantized again in backward (as bitsandbytes does), with the adapter fused as above.

Numerics: the matmuls run in the autocast dtype when autocast is on (else the input's dtype;
QLoRA: the layer's compute dtype), like the composed layer; gradients of frozen parameters are
not computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from scaletrain.runtime import matmul_dtype

Dense = Callable[[torch.Tensor], torch.Tensor]
"""Turns the stored base weight into the dense (out, in) matrix (QLoRA: NF4 dequantization)."""


def _dense(weight: torch.Tensor, dense: Dense | None, dtype: torch.dtype) -> torch.Tensor:
    return (weight if dense is None else dense(weight)).to(dtype)


class LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                a: torch.Tensor, b: torch.Tensor, scaling: float, dense: Dense | None,
                compute_dtype: torch.dtype | None) -> torch.Tensor:
        dt = compute_dtype or matmul_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(dt)
            out = F.linear(xc, _dense(weight, dense, dt), None if bias is None else bias.to(dt))
            h = xc @ a.to(dt).t()
            out.view(-1, out.shape[-1]).addmm_(h.view(-1, h.shape[-1]), b.to(dt).t(),
                                               alpha=scaling)
        ctx.save_for_backward(xc, weight, a, b, h)
        ctx.scaling, ctx.x_dtype, ctx.dense = scaling, x.dtype, dense
        ctx.has_bias = bias is not None
        return out if compute_dtype is None else out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xc, weight, a, b, h = ctx.saved_tensors
        dt, s = xc.dtype, ctx.scaling
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        with torch.autocast(xc.device.type, enabled=False):
            g = grad.to(dt).reshape(-1, grad.shape[-1])
            x2 = xc.reshape(-1, xc.shape[-1])
            gb = g @ b.to(dt)  # (tokens, r)
            grad_x = grad_w = grad_bias = grad_a = grad_b = None
            if need_x:
                grad_x = g @ _dense(weight, ctx.dense, dt)
                grad_x.addmm_(gb, a.to(dt), alpha=s)
                grad_x = grad_x.view(xc.shape).to(ctx.x_dtype)
            if need_a:
                grad_a = (gb.t() @ x2).mul_(s).to(a.dtype)
            if need_b:
                grad_b = (g.t() @ h.reshape(-1, h.shape[-1])).mul_(s).to(b.dtype)
            if need_w and ctx.dense is None:  # a trainable dense base (not the usual LoRA)
                grad_w = (g.t() @ x2).to(weight.dtype)
            if need_bias and ctx.has_bias:
                grad_bias = g.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, None, None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                a: torch.Tensor, b: torch.Tensor, scaling: float, dense: Dense | None = None,
                compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`F.linear(x, W, bias) + scaling * (x @ a.T) @ b.T`, fused (module docstring). `W` is
    `weight`, or `dense(weight)` for a quantized base (made for the matmul, then dropped, and
    made again in backward). `compute_dtype` (QLoRA's) overrides autocast, and the output then
    takes the input's dtype, as bitsandbytes' layer does."""
    return LoRALinearFunction.apply(x, weight, bias, a, b, scaling, dense, compute_dtype)
