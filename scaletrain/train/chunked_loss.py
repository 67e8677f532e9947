"""Linear head + cross-entropy computed chunk by chunk over tokens, never holding the full
(tokens x vocabulary) logits.

Forward runs the head on `chunk` tokens at a time, takes the summed cross-entropy of the chunk
and, while the chunk's logits exist, the gradients of that chunk's loss with respect to the
hidden states and the head weight (softmax minus one-hot, through Gemma 2's final soft-cap when
set). Backward only scales the stored gradients by the incoming gradient. Peak extra memory is
one chunk of logits (fp32) plus the gradients of the hidden states and the weight, instead of
the (tokens x vocabulary) logits, their fp32 copy and the softmax that the plain path keeps.

Numerics follow the plain path (`Transformer.logits` then `cross_entropy_sum`): the matmul in
the autocast dtype when autocast is on (else the inputs' dtype), soft-cap and softmax in fp32,
the sum of token losses with IGNORE_INDEX targets not counted.

Vocabulary-parallel use (`chunked_loss_tp.py`): `weight` is this rank's rows
[start, start + rows) of the head and `shard` names the group holding the others. Each chunk's
log-sum-exp and target logit are then combined over the group (one all-gather per chunk) and
the gradient of the hidden states left in the forward is this rank's partial sum, which the
caller reduces over the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.config_sections import TrainingConfig
from scaletrain.runtime import matmul_dtype
from scaletrain.train.loss import IGNORE_INDEX

DEFAULT_CHUNK = TrainingConfig.loss_chunk_tokens


@dataclass(frozen=True)
class VocabShard:
    """This rank holds vocabulary rows [start, start + its weight's rows); `group` holds the
    rest, each rank one contiguous slice."""

    start: int
    group: dist.ProcessGroup

    def combine(self, lse: torch.Tensor, picked: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-sum-exp over the whole vocabulary from each rank's (the log-sum-exp of the
        ranks' values) and the target logit (held by one rank, zero on the others: a sum)."""
        mine = torch.stack([lse, picked])
        ranks = dist.get_world_size(self.group)
        parts = mine.new_empty((ranks * 2, mine.shape[1]))  # gloo: the ranks along dim 0
        dist.all_gather_into_tensor(parts, mine, group=self.group)
        parts = parts.view(ranks, 2, -1)
        return torch.logsumexp(parts[:, 0], dim=0), parts[:, 1].sum(dim=0)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """loss = sum over valid tokens of CE(cap(h @ W^T), target); see the module docstring."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int, softcap: float | None, shard: VocabShard | None) -> torch.Tensor:
        dt = matmul_dtype(h)
        h2 = h.reshape(-1, h.shape[-1])
        y = targets.reshape(-1)
        w = weight.to(dt)
        first, rows = (0 if shard is None else shard.start), weight.shape[0]
        grad_h = torch.empty(h2.shape, dtype=h.dtype, device=h.device) \
            if h.requires_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for start in range(0, h2.shape[0], chunk):
                hc = h2[start:start + chunk].to(dt)
                yc = y[start:start + chunk]
                logits = (hc @ w.t()).float()
                tanh = None
                if softcap is not None:
                    tanh = torch.tanh(logits / softcap)
                    logits = tanh * softcap
                valid = yc != IGNORE_INDEX
                row = yc - first  # the target's row in this weight (or outside it)
                mine = valid & (row >= 0) & (row < rows)
                safe = torch.where(mine, row, 0)
                lse = torch.logsumexp(logits, dim=-1)
                picked = torch.where(mine, logits.gather(1, safe[:, None]).squeeze(1), 0.0)
                if shard is not None:
                    lse, picked = shard.combine(lse, picked)
                total += torch.where(valid, lse - picked, 0.0).sum()
                if grad_h is None and grad_w is None:
                    continue
                # d(sum CE)/d logits = softmax - onehot on valid rows, 0 on ignored rows
                g = torch.exp(logits - lse[:, None])
                g.scatter_add_(1, safe[:, None], -mine.to(g.dtype)[:, None])
                g *= valid[:, None]
                if tanh is not None:
                    g *= 1 - tanh * tanh
                g = g.to(dt)
                if grad_h is not None:
                    grad_h[start:start + chunk] = (g @ w).to(h.dtype)
                if grad_w is not None:
                    grad_w += (g.t() @ hc).float()
        ctx.h_shape = h.shape
        ctx.w_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else (grad_h * grad_out).reshape(ctx.h_shape)
        gw = None if grad_w is None else (grad_w * grad_out).to(ctx.w_dtype)
        return gh, gw, None, None, None, None


def chunked_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 chunk: int = DEFAULT_CHUNK,
                                 softcap: float | None = None,
                                 shard: VocabShard | None = None) -> torch.Tensor:
    """Sum of token cross-entropies of the logits `softcap(h @ weight^T)` (fp32 scalar), the
    logits built `chunk` tokens at a time. `h` (..., dim) are the final-norm hidden states,
    `weight` (vocab, dim) the output head (the embedding when tied), `targets` (...) the token
    ids with IGNORE_INDEX where a token does not count. With `shard`, `weight` is one
    rank's vocabulary slice (see the module docstring)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if not torch.is_grad_enabled():  # evaluation: no gradient buffers (the weight's own
        h, weight = h.detach(), weight.detach()  # requires_grad does not say so)
    return ChunkedLinearCrossEntropy.apply(h, weight, targets, chunk, softcap, shard)
