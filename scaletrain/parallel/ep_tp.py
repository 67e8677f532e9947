"""Expert parallelism composed with tensor parallelism (EP x TP) for Mixture-of-Experts blocks.

The layout keeps both existing techniques and nests them:

- Attention, norms, embedding, head and shared experts are tensor parallel over `tp` as
  without experts (`parallel/tp.py`, with or without sequence parallelism); FSDP shards
  them over `dp_shard` (which contains the `ep` ranks) as today.
- The routed experts of each MoE layer are split over the 2-D mesh `(ep, tp)`: their stacked
  weights are DTensors `[Shard(0), Shard(0)]`, so rank (i, t) holds the contiguous experts of
  chunk `i * tp + t` (E / (ep * tp) of them). Checkpoints, clipping and the optimizer see
  whole tensors; DCP reshards them to any other layout (one process included). With
  `dp_shard > ep`, FSDP shards each expert chunk further over `dp_shard_mod_ep` (the ranks
  that hold the same experts), as under plain EP.
- Tokens: as under MoE tensor parallelism (`parallel/moe_tp.py`) the block input is gathered
  over the TP group, so every TP rank routes the same tokens identically (replicated router).
  TP rank t then takes only the (token, expert) pairs of the experts whose chunk has TP index
  t (`e // n_local % tp == t`) and sends them over its EP group (the ranks with the same TP
  index in the other data-parallel groups) with the all-to-all of `EPDispatcher`. The outputs
  come back, are placed at their pairs (zeros for the other TP ranks' pairs) and the block's
  output, a partial sum over the TP ranks, is all-reduced (reduce-scattered along the
  sequence under sequence parallelism). In backward the gradients of the tokens entering the
  experts and of the gate weights are summed over the TP ranks (Megatron's copy-to-region).

Each (token, expert) pair of a TP group is computed exactly once, by the rank that owns the
expert; the all-to-all volume per rank is 1/tp of plain EP's (a TP rank sends only its share
of the pairs). Compared with torchtitan's ETP=1 layout (EP ranks drawn from dp_shard x tp,
each TP rank dispatching its own sequence shard) this pays one more TP reduction of the MoE
output, but routing, the balancing loss, the router statistics and the DeepSeek bias updates
stay exactly those of MoE tensor parallelism (every TP rank sees the whole micro-batch), so
nothing downstream of the router changes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from scaletrain.models.moe import GroupedExperts, MoE
from scaletrain.parallel.ep import EPDispatcher
from scaletrain.parallel.moe_tp import TPExpertDispatcher, replicate_routing


def apply_moe_ep_tp(moe: MoE, tp_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh,
                    sequence_parallel: bool) -> None:
    """Split `moe`'s routed experts over the 2-D `ep_tp_mesh` (ep, tp), install the EP x TP
    dispatcher, the replicated router and the TP output reduction (in place, before FSDP;
    called by `apply_tp` for each MoE block)."""
    shard_experts_2d(moe.experts, ep_tp_mesh)
    moe.dispatcher = EPTPDispatcher(ep_tp_mesh, moe.n_experts)
    replicate_routing(moe, tp_mesh, sequence_parallel)


def shard_experts_2d(experts: GroupedExperts, ep_tp_mesh: DeviceMesh) -> None:
    """The stacked expert weights as DTensors `[Shard(0), Shard(0)]` over (ep, tp): rank
    (i, t) holds the contiguous chunk `i * tp + t` of the experts."""
    i, t = ep_tp_mesh.get_coordinate()
    ep, tp = ep_tp_mesh.shape
    for name, p in list(experts.named_parameters(recurse=False)):
        local = p.detach().chunk(ep * tp, dim=0)[i * tp + t]
        dt = DTensor.from_local(local, ep_tp_mesh, [Shard(0), Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(dt, requires_grad=p.requires_grad))


class EPTPDispatcher(TPExpertDispatcher):
    """(tokens sorted by expert, tokens per expert, experts) -> outputs in the same order:
    this TP rank's pairs computed by the EP ranks owning their experts, zero for the pairs of
    the other TP ranks' experts."""

    def __init__(self, ep_tp_mesh: DeviceMesh, n_experts: int) -> None:
        ep, tp = ep_tp_mesh.shape
        super().__init__(ep_tp_mesh.get_group(1), ep_tp_mesh.get_coordinate()[1], tp,
                         n_experts)
        self.ep, self.tp = ep, tp
        self.n_local = n_experts // (ep * tp)
        self.ep_dispatch = EPDispatcher(ep_tp_mesh.get_group(0), ep * self.n_local)

    def __call__(self, x: torch.Tensor, counts: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
        x = self.copy_to_region(x)
        # blocks[i, t']: rows of the chunk of EP rank i, TP rank t' (in sorted order, chunk
        # i * tp + t' follows chunk i * tp + t' - 1)
        per_chunk = counts.view(self.ep, self.tp, self.n_local)
        blocks = per_chunk.sum(2).reshape(-1).tolist()  # one host read
        mine = [b * self.tp + self.rank for b in range(self.ep)]
        pieces = list(torch.split(x, blocks))
        sent = torch.cat([pieces[c] for c in mine])
        y = self.ep_dispatch(sent, per_chunk[:, self.rank].contiguous().view(-1),
                             experts)
        out = list(torch.split(y, [blocks[c] for c in mine]))
        width = y.shape[1]
        parts = [out[c // self.tp] if c % self.tp == self.rank
                 else y.new_zeros(n, width) for c, n in enumerate(blocks)]
        return torch.cat(parts)


__all__ = ["EPTPDispatcher", "apply_moe_ep_tp", "shard_experts_2d"]
