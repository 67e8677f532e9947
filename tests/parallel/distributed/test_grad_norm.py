"""Gradient norm and clipping for every DTensor placement (Shard, _StridedShard, Replicate,
Partial) on both dimensions of a 2 x 2 mesh: the norm of the full gradients, the same on every
rank, with one all-reduce per mesh dimension (4 gloo processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from tests.helpers.proc import run_ranks

MAX_NORM = 1.0


class Holder:
    """Stands in for a parameter: the norm functions read and write `.grad` only."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def _grads(mesh: object) -> tuple[list[Holder], list[torch.Tensor]]:
    torch.manual_seed(0)
    fulls = [torch.randn(8, 6) for _ in range(6)] + [torch.randn(5)]
    placements = [
        [Shard(0), Shard(1)],
        [Replicate(), Shard(0)],
        [Shard(1), Replicate()],
        [Replicate(), Replicate()],
        # FSDP (dim 0 of the mesh) over a tensor-parallel Shard(0) (dim 1): torch's layout
        [_StridedShard(0, split_factor=2), Shard(0)],
    ]
    holders = [Holder(distribute_tensor(f, mesh, p)) for f, p in zip(fulls, placements)]
    # A Partial gradient: the full tensor is the sum of the ranks' local tensors along dim 0.
    holders.append(Holder(DTensor.from_local(fulls[5] / 2, mesh, [Partial(), Replicate()])))
    holders.append(Holder(fulls[6].clone()))  # a plain (replicated) tensor
    return holders, fulls


def _entry(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from scaletrain.parallel.grad import clip_grad_norm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    holders, fulls = _grads(mesh)
    for h, f in zip(holders[:5], fulls[:5]):  # the placements hold what was meant
        assert torch.equal(h.grad.full_tensor(), f)
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        norm = clip_grad_norm(holders, MAX_NORM)
    finally:
        dist.all_reduce = original
    after = [h.grad.full_tensor() if isinstance(h.grad, DTensor) else h.grad for h in holders]
    clipped = torch.linalg.vector_norm(torch.cat([t.flatten() for t in after]))
    torch.save({"norm": float(norm), "calls": len(calls), "clipped": float(clipped)},
               Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_norm_of_every_placement_on_every_mesh_dimension(tmp_path: Path) -> None:
    run_ranks(_entry, 4, str(tmp_path))
    torch.manual_seed(0)
    fulls = [torch.randn(8, 6) for _ in range(6)] + [torch.randn(5)]
    expected = float(torch.linalg.vector_norm(torch.cat([f.flatten() for f in fulls])))
    for r in range(4):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["norm"] == pytest.approx(expected, rel=1e-6), (r, got)
        assert got["calls"] == 2, got  # one all-reduce per mesh dimension
        assert expected > MAX_NORM and got["clipped"] == pytest.approx(MAX_NORM, rel=1e-5)
