"""apply_ep: expert parallelism for Mixture-of-Experts blocks (`models/moe.py`).

Each MoE layer's routed experts are split over the `ep` mesh dimension: their stacked weights
become DTensors `Shard(0)` over the experts (rank i holds experts i*E/ep .. (i+1)*E/ep - 1),
so checkpoints, clipping and the optimizer see the whole tensors and DCP reshards them across
EP degrees. Routing stays on every rank (the router is an ordinary, data-parallel parameter).

A rank's (token, expert) pairs, sorted by expert, travel to the ranks owning those experts and
back with two all-to-alls (`EPDispatcher`): first the token counts per expert are exchanged
(the split sizes are read on the host, one synchronisation per MoE layer and pass, as in every
all-to-all-v implementation), then the tokens. Received tokens are regrouped by local expert,
run through the local experts as one grouped GEMM, put back in arrival order and returned.
Autograd goes through both all-to-alls, so each expert's gradient sums the contributions of
the tokens of every rank of the EP group.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from scaletrain.models.moe import GroupedExperts, MoE, moe_layers

log = logging.getLogger(__name__)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard the routed experts of every MoE layer of `model` over `ep_mesh` and install the
    all-to-all dispatcher (in place; before FSDP, on the meta device or not)."""
    layers = list(moe_layers(model))
    for _, moe in layers:
        shard_experts(moe.experts, ep_mesh)
        moe.dispatcher = EPDispatcher(ep_mesh.get_group(), moe.n_experts)
    log.info("expert parallel over %d ranks: %d MoE layers", ep_mesh.size(), len(layers))


def shard_experts(experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
    """The stacked expert weights as DTensors `Shard(0)` (contiguous experts per rank)."""
    rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
    for name, p in list(experts.named_parameters(recurse=False)):
        local = p.detach().chunk(size, dim=0)[rank]
        dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(dt, requires_grad=p.requires_grad))


class EPDispatcher:
    """(tokens sorted by global expert, tokens per global expert, experts) -> outputs in the
    same order, the experts living on the ranks of `group`."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.n_local = n_experts // self.size

    def __call__(self, x: torch.Tensor, counts: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
        ep, n_local = self.size, self.n_local
        # recv[j, l]: tokens rank j sends to my local expert l
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        send_rows = counts.view(ep, n_local).sum(1)
        recv = recv.view(ep, n_local)
        splits = torch.stack([send_rows, recv.sum(1)]).tolist()  # one host read
        send_splits, recv_splits = splits[0], splits[1]
        received = _all_to_all(x, recv_splits, send_splits, self.group)
        # Arrival order is (source rank, local expert); the experts want (local expert, rank).
        by_expert = _regroup_order(recv, sum(recv_splits))
        y = experts(received[by_expert], recv.sum(0))
        back = torch.empty_like(y).index_copy_(0, by_expert, y)
        return _all_to_all(back, send_splits, recv_splits, self.group)


def _regroup_order(recv: torch.Tensor, total: int) -> torch.Tensor:
    """Indices that reorder rows arriving as (rank j, expert l) blocks of `recv[j, l]` rows
    into (expert l, rank j) blocks."""
    ep, n_local = recv.shape
    flat = recv.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # start of block (j, l) in arrival order
    block_of = torch.arange(ep * n_local, device=recv.device).view(ep, n_local).t().reshape(-1)
    sizes = flat[block_of]
    first = starts[block_of]
    offsets = torch.arange(total, device=recv.device) - torch.repeat_interleave(
        torch.cumsum(sizes, 0) - sizes, sizes, output_size=total)
    return torch.repeat_interleave(first, sizes, output_size=total) + offsets


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all of rows: `in_splits[j]` rows to rank j, `out_splits[j]`
    rows from rank j."""
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    return dist_fn.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The routed-expert weights of `model`'s MoE layers (FSDP shards them apart)."""
    return {p for _, m in moe_layers(model) for p in m.experts.parameters()}


__all__ = ["apply_ep", "EPDispatcher", "expert_parameters", "shard_experts", "MoE"]
