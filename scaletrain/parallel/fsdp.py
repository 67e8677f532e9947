"""apply_fsdp: ZeRO-2/3 and HSDP with FSDP2 `fully_shard`, one unit per transformer block.

- ZeRO-3: parameters, gradients and optimizer state sharded; parameters are gathered for each
  block's forward and freed after it (`reshard_after_forward=True`), gathered again in backward.
- ZeRO-2: same, but parameters stay gathered between forward and backward
  (`reshard_after_forward=False`): less communication, more memory.
- HSDP: a 2-D mesh (replicate, shard): shard inside a group, all-reduce across groups.

Gradients are summed, not averaged (`set_gradient_divide_factor(1.0)`): the loss is already
divided by the global valid-token count.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from scaletrain.models.moe import moe_layers

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool,
               param_dtype: str = "fp32", reduce_dtype: str = "fp32",
               cpu_offload: bool = False, expert_mesh: DeviceMesh | None = None,
               expert_parallel: bool = False, layers: nn.ModuleDict | None = None) -> None:
    """`fully_shard` each block of `model.layers` (or of `layers`: a wrapper's backbone's), then
    the remaining parameters.

    `model` is a Transformer or a pipeline stage (which has `layers` too). With expert
    parallelism the routed experts (already sharded over the `ep` ranks) are FSDP units of
    their own over `expert_mesh` (the dp_shard ranks holding the same experts); when no other
    rank holds them (`expert_mesh` None) FSDP leaves them alone: each expert's gradient
    already sums the tokens of every rank.
    """
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype],
                                          reduce_dtype=DTYPES[reduce_dtype]),
        # pinned host memory needs an accelerator; a CPU-only run offloads to pageable memory
        "offload_policy": (CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
                           if cpu_offload else None),
    }
    if kwargs["offload_policy"] is None:
        del kwargs["offload_policy"]
    units: list[FSDPModule] = []
    ignored = None
    if expert_parallel and expert_mesh is None:
        ignored = {p for _, m in moe_layers(model) for p in m.experts.parameters()}
    for block in (model.layers if layers is None else layers).values():
        if expert_parallel and expert_mesh is not None:
            for _, moe in moe_layers(block):
                units.append(fully_shard(moe.experts, reshard_after_forward=reshard_after_forward,
                                         **{**kwargs, "mesh": expert_mesh}))
        units.append(fully_shard(block, reshard_after_forward=reshard_after_forward,
                                 ignored_params=ignored, **kwargs))
    # The root's parameters (embedding, norm, head) are used last in backward: keep them
    # gathered after forward whatever the stage.
    units.append(fully_shard(model, reshard_after_forward=False, ignored_params=ignored,
                             **kwargs))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    log.info("FSDP over mesh %s: %d units, reshard_after_forward=%s, params %s, reduce %s%s",
             dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True)), len(units),
             reshard_after_forward, param_dtype, reduce_dtype,
             ", CPU offload" if cpu_offload else "")
