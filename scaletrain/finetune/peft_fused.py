"""LoRA on projections a checkpoint fuses (Phi-3's `qkv_proj` and `gate_up_proj`).

Our model keeps q/k/v and gate/up apart, each with its own rank-r LoRA. PEFT sees one fused
linear. Export: A = [A_q; A_k; A_v] (rank n*r) and B = blockdiag(B_q, B_k, B_v), with
`rank_pattern` n*r and `alpha_pattern` n*alpha, so B @ A * alpha/r is the stacked per-part
updates exactly. Import: a block-diagonal B of rank n*r is cut back into its blocks; a dense
rank-r adapter trained by PEFT on the fused linear (delta = B A) becomes per-part adapters
sharing A, each with its rows of B, which is the same update.
"""

from __future__ import annotations

import torch


class FusedLoRAError(ValueError):
    """A fused LoRA that cannot be split into per-part adapters; the message says why."""


def fuse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(A_i (r, in), B_i (out_i, r))] -> (A (n r, in), block-diagonal B (sum out_i, n r))."""
    a = torch.cat([p[0] for p in parts], dim=0)
    b = torch.block_diag(*[p[1] for p in parts])
    return a, b


def split(a: torch.Tensor, b: torch.Tensor, sizes: list[int],
          rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-part (A_i, B_i) of rank `rank` whose stacked updates equal B @ A."""
    if b.shape[0] != sum(sizes):
        raise FusedLoRAError(f"fused LoRA B has {b.shape[0]} rows; the model's parts have "
                             f"{sum(sizes)} ({' + '.join(map(str, sizes))})")
    rows = b.split(sizes, dim=0)
    if a.shape[0] == rank:
        return [(a, r) for r in rows]
    n = len(sizes)
    if a.shape[0] == n * rank:
        blocks = [r.split(rank, dim=1) for r in rows]
        off = [blocks[i][j] for i in range(n) for j in range(n) if i != j]
        if all(torch.count_nonzero(x) == 0 for x in off):
            return [(a[i * rank:(i + 1) * rank], blocks[i][i]) for i in range(n)]
    raise FusedLoRAError(f"fused LoRA of rank {a.shape[0]} is neither rank {rank} nor "
                         f"block-diagonal of rank {n} x {rank}; it cannot be split per part")


__all__ = ["fuse", "split", "FusedLoRAError"]
