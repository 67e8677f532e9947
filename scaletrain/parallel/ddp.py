"""apply_ddp: replicated data parallelism (ZeRO-1 partitions the optimizer: `train/zero1.py`).

DDP all-reduces gradients in buckets (`bucket_cap_mb`) from hooks that fire during backward,
so communication overlaps the rest of the backward pass. Its built-in hook averages over the
ranks; scaletrain's loss is already divided by the *global* number of valid tokens, so the
hook installed here sums instead (averaging would divide twice).
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)


def _sum_allreduce_hook(group, bucket):  # noqa: ANN001, ANN202 (DDP checks real annotations)
    """All-reduce one gradient bucket with SUM (the loss carries the global normalization)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, bucket_cap_mb: float) -> nn.Module:
    """Wrap `model` (already materialized) in DDP over `dp_mesh` with a summing comm hook."""
    group = dp_mesh.get_group()
    with warnings.catch_warnings():
        # torch 2.13 deprecates `broadcast_buffers` but advises keeping `False` (no buffer
        # sync, also not at init: RoPE tables are computed on each rank) until its replacement
        # can express that; the warning would print once per rank on every run.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*deprecated",
                                category=FutureWarning)
        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_cap_mb,
                                      gradient_as_bucket_view=True, broadcast_buffers=False)
    ddp.register_comm_hook(group, _sum_allreduce_hook)
    log.info("DDP over %d ranks, buckets of %.0f MB", dp_mesh.size(), bucket_cap_mb)
    return ddp


# DDP validates the hook's annotations at runtime; under `from __future__ import annotations`
# they would be strings, so set the real types here.
_sum_allreduce_hook.__annotations__ = {"group": dist.ProcessGroup, "bucket": dist.GradBucket,
                                       "return": torch.futures.Future[torch.Tensor]}
