"""Process group from the torchrun environment and the named DeviceMesh of a layout.

The mesh has the dimensions of `MESH_ORDER` (`pp, dp_replicate, dp_shard, cp, tp`, tensor
parallel innermost) plus flattened views used by the techniques:

- `dp`: `dp_replicate x dp_shard`, the ranks that see different data (loader split, DDP).
- `dp_shard_cp`: `dp_shard x cp`, the ranks FSDP shards over (context-parallel ranks hold the
  same weights, so their gradients are reduced with the data-parallel ones).
- `dp_cp`: `dp_replicate x dp_shard x cp`, the ranks whose token counts and losses are summed.

With expert parallelism `dp_shard` is itself split into `dp_shard_mod_ep x ep` (and flattened
back into `dp_shard`).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scaletrain.parallel.dims import MESH_ORDER, ParallelDims

log = logging.getLogger(__name__)


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the torchrun environment; (0, 1, 0) without it."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def init_process_group(device: torch.device, timeout_s: float) -> None:
    """Start the default process group (NCCL on CUDA, gloo on CPU) from torchrun's variables.

    `timeout_s` bounds every collective: a rank that stops answering makes the others fail
    after at most this long instead of hanging.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(env_world()[2])
    dist.init_process_group(backend=backend,
                            timeout=datetime.timedelta(seconds=timeout_s))
    log.info("process group: %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size())


def set_collective_timeout(timeout_s: float,
                           skip: tuple[dist.ProcessGroup, ...] = ()) -> None:
    """Bound every collective of every process group of this rank (but `skip`) by
    `timeout_s` from now on: the trainer shortens the start-up timeout once the first step has
    run and lengthens it again around checkpoint saves."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in list(dist.distributed_c10d._world.pg_map):
        if group in skip or dist.distributed_c10d._rank_not_in_group(group):
            continue
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def shutdown_process_group() -> None:
    """Destroy every process group of this process (a no-op in one process), on every way out
    of a run: a process that exits with its groups alive can abort in interpreter shutdown
    ("terminate called without an active exception").

    `destroy_process_group` does not end the threads of a gloo group that something still
    refers to (a DeviceMesh; torch's DTensor caches keep a trained model's meshes until exit).
    The collection below frees the groups that only reference cycles hold (a dropped trainer's
    modules), so their threads end now rather than in interpreter shutdown.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


class ParallelMesh:
    """The 5-D named mesh plus the flattened `dp`, `dp_shard_cp` and `dp_cp` views."""

    def __init__(self, dims: ParallelDims, device_type: str) -> None:
        self.dims = dims
        # Expert parallelism splits dp_shard into (dp_shard_mod_ep, ep): the ranks of an `ep`
        # group hold different experts, those of `dp_shard_mod_ep` the same ones.
        shard = ("dp_shard_mod_ep", "ep") if dims.ep > 1 else ("dp_shard",)
        names = tuple(n for name in MESH_ORDER for n in (shard if name == "dp_shard" else (name,)))
        sizes = {**dims.mesh_shape, "dp_shard_mod_ep": dims.dp_shard_mod_ep, "ep": dims.ep}
        self.root = init_device_mesh(device_type, tuple(sizes[n] for n in names),
                                     mesh_dim_names=names)
        self.flat = {
            "dp": self.root[("dp_replicate", *shard)]._flatten("dp"),
            "dp_shard_cp": self.root[(*shard, "cp")]._flatten("dp_shard_cp"),
            "dp_cp": self.root[("dp_replicate", *shard, "cp")]._flatten("dp_cp"),
        }
        if dims.ep > 1:
            self.flat["dp_shard"] = self.root[shard]._flatten("dp_shard")

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(name, str) and name in self.flat:
            return self.flat[name]
        return self.root[name]

    def coordinate(self, name: str) -> tuple[int, int]:
        """(this rank's index, size) along dimension `name` (flattened ones included)."""
        sub = self[name]
        return sub.get_local_rank(), sub.size()

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    def all_groups(self) -> list[dist.ProcessGroup]:
        """This rank's groups of every dimension, flattened ones included."""
        return [*self.root.get_all_groups(), *(m.get_group() for m in self.flat.values())]
