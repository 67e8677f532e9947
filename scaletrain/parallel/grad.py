"""Gradient norm and clipping over parameters that may be DTensors on different meshes and
spread over pipeline stages."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def total_grad_norm(params: Iterable[torch.Tensor],
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of all gradients of the model (every rank gets the same value).

    Local squared norms are summed per set of sharded mesh dimensions and all-reduced once over
    those dimensions (replicated dimensions are not summed); pipeline stages hold disjoint
    parameters, so their squares are summed over `pp_group`.
    """
    buckets: dict[tuple, torch.Tensor] = {}
    groups: dict[tuple, list[dist.ProcessGroup]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            dims = tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, Shard))
            key = (id(mesh), dims)
            groups[key] = [mesh.get_group(i) for i in dims]
            local = g.to_local()
        else:
            key, local = ((), ()), g
            groups[key] = []
        sq = torch.linalg.vector_norm(local.float(), 2) ** 2
        buckets[key] = buckets.get(key, 0) + sq.to("cpu" if local.device.type == "cpu"
                                                    else local.device)
    total = torch.zeros((), dtype=torch.float32)
    for key, sq in buckets.items():
        for group in groups[key]:
            dist.all_reduce(sq, group=group)
        total = total.to(sq.device) + sq
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float,
                   pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before."""
    norm = total_grad_norm(params, pp_group)
    coef = float(max_norm) / (float(norm) + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
