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

Numerics: the matmuls run in the autocast dtype when autocast is on (else the input's dtype),
like the composed layer; gradients of frozen parameters are not computed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
        dt = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(dt)
            out = F.linear(xc, weight.to(dt), None if bias is None else bias.to(dt))
            h = xc @ a.to(dt).t()
            out.view(-1, out.shape[-1]).addmm_(h.view(-1, h.shape[-1]), b.to(dt).t(),
                                               alpha=scaling)
        ctx.save_for_backward(xc, weight, a, b, h)
        ctx.scaling, ctx.x_dtype, ctx.has_bias = scaling, x.dtype, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xc, weight, a, b, h = ctx.saved_tensors
        dt, s = xc.dtype, ctx.scaling
        need_x, need_w, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        with torch.autocast(xc.device.type, enabled=False):
            g = grad.to(dt).reshape(-1, grad.shape[-1])
            x2 = xc.reshape(-1, xc.shape[-1])
            gb = g @ b.to(dt)  # (tokens, r)
            grad_x = grad_w = grad_bias = grad_a = grad_b = None
            if need_x:
                grad_x = g @ weight.to(dt)
                grad_x.addmm_(gb, a.to(dt), alpha=s)
                grad_x = grad_x.view(xc.shape).to(ctx.x_dtype)
            if need_a:
                grad_a = (gb.t() @ x2).mul_(s).to(a.dtype)
            if need_b:
                grad_b = (g.t() @ h.reshape(-1, h.shape[-1])).mul_(s).to(b.dtype)
            if need_w:  # a trainable base (not the usual LoRA set-up)
                grad_w = (g.t() @ x2).to(weight.dtype)
            if need_bias and ctx.has_bias:
                grad_bias = g.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`F.linear(x, weight, bias) + scaling * (x @ a.T) @ b.T`, fused (module docstring)."""
    return LoRALinearFunction.apply(x, weight, bias, a, b, scaling)
