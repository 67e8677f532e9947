"""Tensor parallelism of Mixture-of-Experts blocks: the experts split over the TP ranks.

Every TP rank sees the same tokens (the block input is gathered to the whole sequence), routes
them identically (the router weight is a replicated DTensor) and computes only the
(token, expert) pairs of the experts it holds (`Shard(0)` of the stacked expert weights, as
under expert parallelism, so checkpoints and clipping see whole tensors). The combined outputs
are partial sums over the experts: they are summed over the TP ranks, and under sequence
parallelism scattered along the sequence, like the output of a row-parallel layer. In backward
the gradients of the tokens entering the experts and of the gate weights of their outputs are
summed over the TP ranks (each rank's experts contribute a part of them), as Megatron's
copy-to-tensor-parallel region does.
Shared experts are an ordinary column/row-parallel MLP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from scaletrain.models.moe import MoE
from scaletrain.parallel.ep import shard_experts


def apply_moe_tp(moe: MoE, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split `moe`'s routed experts over `tp_mesh` and install the TP dispatcher and output
    reduction (in place, before FSDP)."""
    shard_experts(moe.experts, tp_mesh)
    moe.dispatcher = TPExpertDispatcher(tp_mesh.get_group(), tp_mesh.get_local_rank(),
                                        tp_mesh.size(), moe.n_experts)
    replicate_routing(moe, tp_mesh, sequence_parallel)


def replicate_routing(moe: MoE, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """The router weight replicated over `tp_mesh` (every TP rank routes the same tokens) and
    the output reduction of the TP ranks' partial sums (also used by EP x TP, `ep_tp.py`)."""
    gate = moe.router.gate
    gate.weight = nn.Parameter(DTensor.from_local(gate.weight.detach(), tp_mesh, [Replicate()],
                                                  run_check=False))
    group = tp_mesh.get_group()
    # Sum the partial outputs over the TP ranks; under sequence parallelism each keeps its
    # slice of the sequence (the residual stream's layout), else the whole (replicated) sum.
    reduce = _ReduceScatterSeq if sequence_parallel else _AllReduce
    moe.output_reduce = lambda out: reduce.apply(out, group)


class TPExpertDispatcher:
    """(tokens sorted by expert, tokens per expert, experts) -> outputs, zero for the pairs
    of experts held by other TP ranks."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, n_experts: int) -> None:
        self.group, self.rank = group, rank
        self.n_local = n_experts // size

    def copy_to_region(self, t: torch.Tensor) -> torch.Tensor:
        """`t` unchanged; its gradient summed over the TP ranks (it feeds rank-partial
        computations: the experts, the weights of their outputs)."""
        return _CopyToRegion.apply(t, self.group)

    def __call__(self, x: torch.Tensor, counts: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
        x = self.copy_to_region(x)
        first = self.rank * self.n_local
        bounds = torch.cumsum(counts, 0)
        lo, hi = (int(v) for v in torch.stack([bounds[first] - counts[first],
                                               bounds[first + self.n_local - 1]]).tolist())
        y = experts(x[lo:hi], counts[first:first + self.n_local])
        zeros = y.new_zeros
        return torch.cat([zeros(lo, y.shape[1]), y, zeros(x.shape[0] - hi, y.shape[1])])


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None  # every rank holds the whole (replicated) gradient


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        full = x.contiguous().clone()
        dist.all_reduce(full, group=group)
        return full.chunk(size, dim=1)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size = dist.get_world_size(ctx.group)
        parts = [torch.empty_like(grad) for _ in range(size)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=1), None


__all__ = ["apply_moe_tp", "replicate_routing", "TPExpertDispatcher"]
