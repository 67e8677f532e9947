"""Context parallelism: the sequence is split across `cp` ranks; attention runs as a ring.

Layout: the sequence is cut into `2 x cp` equal chunks. With head-tail load balancing rank r
holds chunks r and 2cp-1-r (one early, one late), so under a causal mask every rank has the
same amount of attention work; without it rank r holds chunks 2r and 2r+1.

Ring attention: each rank computes attention of its queries against the K/V chunks it holds,
then passes K/V to the next rank, `cp` times in all. Partial results are merged with their
log-sum-exp: out = sum_i out_i * exp(lse_i - lse), lse = logsumexp_i(lse_i). Chunk pairs that
the causal mask hides entirely are skipped. The K/V hand-over is an `all_to_all_single` with
autograd (from torch's functional collectives), whose backward sends the gradients the other
way round the ring.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


def chunk_ids(rank: int, cp: int, load_balance: bool) -> tuple[int, int]:
    """The two sequence chunks (of 2 x cp) that context-parallel rank `rank` holds."""
    return (rank, 2 * cp - 1 - rank) if load_balance else (2 * rank, 2 * rank + 1)


def local_positions(seq_len: int, rank: int, cp: int, load_balance: bool,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Absolute positions of this rank's tokens (its two chunks, in order)."""
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in chunk_ids(rank, cp, load_balance)])


def shard_sequence(t: torch.Tensor, rank: int, cp: int, load_balance: bool) -> torch.Tensor:
    """This rank's part of `t` (batch, seq, ...) along dimension 1."""
    return t[:, local_positions(t.shape[1], rank, cp, load_balance, t.device)]


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query chunk over one key chunk: (output, log-sum-exp), fp32."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        n = scores.shape[-1]
        hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def _merge(acc: tuple[torch.Tensor, torch.Tensor] | None,
           new: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if acc is None:
        return new
    (o1, l1), (o2, l2) = acc, new
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse) + o2 * torch.exp(l2 - lse), lse


class RingAttention:
    """Causal attention over a sequence split across the ranks of `cp_mesh` (a callable for
    `Attention.attention_fn`). q: (batch, heads, local_seq, head_dim); k, v may have fewer
    (grouped) heads."""

    def __init__(self, cp_mesh: DeviceMesh, load_balance: bool) -> None:
        self.group = cp_mesh.get_group()
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.load_balance = load_balance

    def _pass_on(self, kv: torch.Tensor) -> torch.Tensor:
        """Send `kv` to the next rank of the ring and receive the previous rank's."""
        n = kv.shape[0]
        send = [0] * self.cp
        recv = [0] * self.cp
        send[(self.rank + 1) % self.cp] = n
        recv[(self.rank - 1) % self.cp] = n
        return all_to_all_single_autograd(kv.contiguous(), recv, send, self.group)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dtype = q.dtype
        rep = q.shape[1] // k.shape[1]
        q32 = q.float()
        half = q.shape[2] // 2
        q_chunks = chunk_ids(self.rank, self.cp, self.load_balance)
        q_parts = (q32[:, :, :half], q32[:, :, half:])
        acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        kv = torch.stack([k, v])
        unused: list[torch.Tensor] = []
        for step in range(self.cp):
            used = False
            source = (self.rank - step) % self.cp
            k_full = kv[0].float().repeat_interleave(rep, dim=1)
            v_full = kv[1].float().repeat_interleave(rep, dim=1)
            k_parts = (k_full[:, :, :half], k_full[:, :, half:])
            v_parts = (v_full[:, :, :half], v_full[:, :, half:])
            k_chunks = chunk_ids(source, self.cp, self.load_balance)
            for i, qc in enumerate(q_chunks):
                for j, kc in enumerate(k_chunks):
                    if kc > qc:  # every key is in the future of every query
                        continue
                    acc[i] = _merge(acc[i], _block(q_parts[i], k_parts[j], v_parts[j],
                                                   causal=kc == qc))
                    used = True
            if not used:
                unused.append(kv)
            if step < self.cp - 1:
                kv = self._pass_on(kv)
        out = torch.cat([a[0] for a in acc if a is not None], dim=2)
        # A received block the mask hides entirely still joins the graph (with weight 0) so
        # that every rank runs the backward of every hand-over: collectives must match.
        for block in unused:
            out = out + 0.0 * block.sum()
        return out.to(dtype)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, load_balance: bool) -> None:
    """Route every attention layer of `model` through ring attention over `cp_mesh`."""
    ring = RingAttention(cp_mesh, load_balance)
    for block in model.layers.values():
        block.attention.attention_fn = ring
    log.info("context parallel over %d ranks (head-tail load balancing %s)", cp_mesh.size(),
             load_balance)
