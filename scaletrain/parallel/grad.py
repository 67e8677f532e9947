"""Gradient norm and clipping over parameters that may be DTensors on different meshes, with
any placement DTensor produces (Shard, _StridedShard, Replicate, Partial), spread over pipeline
stages, and on different devices (FSDP's CPU offload keeps gradients in host memory).

Local squared norms come from foreach kernels (one per bucket, device and dtype), summed into one
entry per (mesh, sharded dimensions) bucket; along each process group, the vector of the
buckets sharded there is all-reduced once (a bucket is summed over each group it is sharded
over; replicated buckets are whole already), then the stages of the pipeline group (disjoint
parameters) are summed. Every rank gets the same norm, and nothing is read back to the host.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

try:  # FSDP over a TP-sharded parameter (torch >= 2.5): not an instance of Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = Shard

SHARD_TYPES = (Shard, _StridedShard)


def _group_name(group: dist.ProcessGroup) -> str:
    return group.group_name


def _replicate_partials(params: list[torch.Tensor]) -> None:
    """Gradients with a Partial placement hold summands, not parts: reduce them first (rare:
    DTensor normally resolves them in backward)."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, [Replicate() if isinstance(pl, Partial)
                                                    else pl for pl in g.placements])


Groups = dict[str, dist.ProcessGroup]


def _local_grads(params: Iterable[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[tuple[str, ...]], Groups]:
    """Each gradient's local tensor and the names of the process groups it is sharded over."""
    locals_, sharded, groups = [], [], {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            names = []
            for i, pl in enumerate(g.placements):
                group = g.device_mesh.get_group(i)
                if dist.get_world_size(group) == 1:
                    continue
                groups[_group_name(group)] = group
                if isinstance(pl, SHARD_TYPES):
                    names.append(_group_name(group))
            locals_.append(g.to_local())
            sharded.append(tuple(sorted(names)))
        else:
            locals_.append(g)
            sharded.append(())
    return locals_, sharded, groups


def _bucket_sums(tensors: list[torch.Tensor], keys: list[tuple[str, ...]],
                 order: list[tuple[str, ...]], device: torch.device) -> list[torch.Tensor]:
    """Sum of squared 2-norms per bucket of `order` (fp32 scalars on `device`), one foreach
    kernel per bucket, device and dtype. No index tensors are built, so no host-to-device
    copy (which would synchronize on a GPU) happens."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t, key in zip(tensors, keys):
        groups[(key, t.device, t.dtype)].append(t)
    sums = {key: torch.zeros((), dtype=torch.float32, device=device) for key in order}
    for (key, _, _), ts in groups.items():
        norms = torch._foreach_norm(ts, 2)
        sums[key] = sums[key] + torch.stack(norms).float().pow(2).sum().to(device,
                                                                             non_blocking=True)
    return [sums[key] for key in order]


@torch.no_grad()
def total_grad_norm(params: Iterable[torch.Tensor], pp_group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """The 2-norm of all gradients of the model, the same device tensor on every rank.

    `device` is where the reductions run (the training device: with NCCL the norms travel to
    the GPU even when FSDP offloads gradients to the CPU).
    """
    params = [p for p in params if p.grad is not None]
    _replicate_partials(params)
    locals_, sharded, groups = _local_grads(params)
    if device is None:
        device = locals_[0].device if locals_ else torch.device("cpu")
    if not locals_:
        total = torch.zeros((), dtype=torch.float32, device=device)
    else:
        order = sorted(set(sharded))
        buckets = torch.stack(_bucket_sums(locals_, sharded, order, device))
        parts = list(buckets.unbind())
        for name, group in groups.items():  # one all-reduce per process group
            # Only the buckets sharded along this group: a replicated bucket is already whole
            # here, and a group may overlap another one (expert parallelism's `ep` ranks are
            # part of the flattened `dp_shard` group the other parameters are sharded over).
            members = [i for i, key in enumerate(order) if name in key]
            if not members:
                continue
            part = torch.stack([parts[i] for i in members])
            dist.all_reduce(part, group=group)
            for i, value in zip(members, part.unbind(), strict=True):
                parts[i] = value
        total = torch.stack(parts).sum()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)  # stages hold disjoint parameters
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None,
                   pp_group: dist.ProcessGroup | None = None,
                   device: torch.device | None = None,
                   copies: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm` (None or 0: no clipping);
    return the norm before clipping, as a device tensor (no host synchronization).

    `copies`: tensors of `params` that repeat another stage's (a tied head on the last
    pipeline stage): clipped, but not counted in the norm."""
    params = [p for p in params if p.grad is not None]
    skip = {id(t) for t in copies}
    norm = total_grad_norm([p for p in params if id(p) not in skip], pp_group, device)
    if not max_norm:
        return norm
    coef = (float(max_norm) / (norm + 1e-6)).clamp(max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        by_device[g.device].append(g)
    for dev, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(dev, non_blocking=True))
    return norm
