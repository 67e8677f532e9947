"""The pieces of the shared decoder block that differ between model families.

Each function states one family difference and reads it from `ModelArgs`: the norm (LayerNorm,
RMSNorm, Gemma's (1 + w) RMSNorm), the MLP slot (`MLP_BUILDERS`, where a Mixture-of-Experts
MLP registers itself), and the attention core (causal SDPA, sliding windows, soft-capped
logits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.args import ModelArgs


class RMSNorm(nn.Module):
    """RMSNorm in fp32; with `unit_offset` the scale is (1 + weight) and weights start at 0.

    A 16-bit input (bf16 parameters, or FSDP gathering them in bf16) goes through `_RMSNormFn`,
    which keeps the input in its own dtype and the fp32 1/rms per row for backward instead of
    an fp32 copy of the input. It works on DTensors too (sequence-parallel norms: the input
    sharded over the sequence, the weight replicated; its gradient comes out as a partial sum,
    as from the composite). fp32 inputs take the composite `F.rms_norm` (fused on CUDA).
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.bfloat16, torch.float16):
            return _RMSNormFn.apply(x, self.weight, self.eps, self.unit_offset)
        w = self.weight.float()
        if self.unit_offset:
            w = 1.0 + w
        return F.rms_norm(x.float(), (x.shape[-1],), w, self.eps).type_as(x)

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.unit_offset else nn.init.ones_)(self.weight)


class _RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) * w computed in fp32, returned in x's dtype; saves x (its own dtype),
    the fp32 1/rms of each row and the weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float,
                unit_offset: bool) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        w = weight.float() + 1.0 if unit_offset else weight.float()
        ctx.save_for_backward(x, rstd, weight)
        ctx.unit_offset = unit_offset
        return (xf * rstd * w).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, rstd, weight = ctx.saved_tensors
        w = weight.float() + 1.0 if ctx.unit_offset else weight.float()
        normed = x.float() * rstd
        g = grad.float()
        # Summed over the leading dims (not a reshape to 2-D, which a DTensor sharded over the
        # sequence could only do after gathering it).
        grad_w = (g * normed).sum(tuple(range(x.ndim - 1))).to(weight.dtype)
        gw = g * w
        grad_x = rstd * (gw - normed * (gw * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None, None


def make_norm(args: ModelArgs, dim: int | None = None) -> nn.Module:
    """The family's norm over `dim` features (default: the model width)."""
    dim = args.dim if dim is None else dim
    if args.arch == "gpt2":
        return nn.LayerNorm(dim, eps=args.norm_eps)
    return RMSNorm(dim, args.norm_eps, args.norm_unit_offset)


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
# d act(a) / d a times `grad`: the kernels autograd itself runs for these activations (no
# nested autograd in a backward, which torch.compile cannot trace).
_ACT_BACKWARDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": lambda grad, a: torch.ops.aten.silu_backward(grad, a),
    "gelu_tanh": lambda grad, a: torch.ops.aten.gelu_backward(grad, a, approximate="tanh"),
}


class FeedForward(nn.Module):
    """Gated MLP `w2(act(w1 x) * w3 x)` (SwiGLU, GeGLU) for RoPE families; GELU MLP
    `w2(gelu(w1 x))` for GPT-2."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden, bias = args.hidden_dim, args.has_bias
        self.gated = args.arch == "llama"
        self.act_name = args.mlp_act if self.gated else "gelu_tanh"
        self.act = _ACTS[self.act_name]
        self.w1 = nn.Linear(args.dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, args.dim, bias=bias)
        self.w3 = nn.Linear(args.dim, hidden, bias=False) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(_GatedAct.apply(self.w1(x), self.w3(x), self.act_name))
        return self.w2(self.act(self.w1(x)))


class _GatedAct(torch.autograd.Function):
    """act(a) * b that keeps only a and b for backward (act is recomputed there): the eager
    composite keeps a, act(a) and b (three f-wide tensors) besides the down projection's
    input; this keeps two, as Megatron-LM's fused SwiGLU does."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.act = act
        return _ACTS[act](a) * b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        a, b = ctx.saved_tensors
        grad_a = _ACT_BACKWARDS[ctx.act](grad * b, a)
        return grad_a, grad * _ACTS[ctx.act](a), None


# The MLP slot of the block: `args -> module` taking and returning (batch, seq, dim). A family
# with another MLP (e.g. Mixture of Experts) adds a builder and a predicate here.
MLP_BUILDERS: list[tuple[Callable[[ModelArgs], bool], Callable[[ModelArgs], nn.Module]]] = []


def make_mlp(args: ModelArgs) -> nn.Module:
    """The first registered MLP whose predicate accepts `args`, else the dense `FeedForward`."""
    for accepts, build in MLP_BUILDERS:
        if accepts(args):
            return build(args)
    return FeedForward(args)


def band_mask(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """(queries, keys) boolean mask: causal, and inside `window` (q - k < window) when given."""
    diff = queries[:, None] - keys[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed = allowed & (diff < window)
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
           start_pos: int = 0, mask: torch.Tensor | None = None, window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """Causal attention of q (B, H, S, D) over k, v (B, KV, start_pos + S, D).

    `mask`: a boolean (B, 1, S, keys) mask (True = attend) replacing the causal one (packed
    segments, padding); the window still applies on top. Without a window the fused SDPA
    kernel runs with `is_causal`; a window that hides keys adds a boolean band mask (still
    SDPA); soft-capped logits (Gemma 2) are computed explicitly, softmax in fp32.
    """
    n_q, n_k = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if window is not None and n_k <= window:
        window = None  # every key is inside the window: plain causal attention
    if window is not None or (mask is None and (start_pos > 0 or softcap is not None)):
        queries = torch.arange(start_pos, start_pos + n_q, device=q.device)
        band = band_mask(queries, torch.arange(n_k, device=q.device), window)
        mask = band if mask is None else mask & band
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs @ v


__all__ = ["RMSNorm", "make_norm", "FeedForward", "MLP_BUILDERS", "make_mlp", "attend",
           "band_mask"]
