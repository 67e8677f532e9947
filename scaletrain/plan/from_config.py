"""The plan of a training config, as `scaletrain train --dry-run` prints it before building."""

from __future__ import annotations

import os

import torch

from scaletrain.config import Config, resolve_batch
from scaletrain.plan.estimate import Layout, Plan, check_dims, estimate
from scaletrain.plan.hardware import Device, match_device


def layout_from_config(cfg: Config, device: torch.device, world_size: int) -> Layout:
    """The Layout the trainer will run: same ParallelDims, batch, precision and recompute.

    Data-parallel sharding (dp_shard > 1) is FSDP2's fully_shard, i.e. ZeRO-3; autocast over
    fp32 parameters keeps fp32 weights, bf16 parameters get fp32 master weights and fp32
    gradients at the optimizer step (the `playbook` convention).
    """
    from scaletrain.runtime import resolve_dtype

    par = cfg.parallel
    dims = check_dims(world_size, pp=par.pp, dp_replicate=par.dp_replicate,
                      dp_shard=par.dp_shard, cp=par.cp, tp=par.tp)
    gbs, _ = resolve_batch(cfg.training, dims.dp)
    dtype = resolve_dtype(cfg.precision, device)
    vpp = max(1, getattr(par, "pp_virtual_stages", 1))
    ac = cfg.activation_checkpoint
    return Layout(
        dims=dims, mbs=cfg.training.micro_batch_size, seq_len=cfg.data.seq_len, gbs=gbs,
        zero=3 if dims.dp_shard > 1 else 0,
        sequence_parallel=bool(getattr(par, "sequence_parallel", True)) and dims.tp > 1,
        vpp=vpp, schedule="Interleaved1F1B" if vpp > 1 else "1F1B", precision=dtype,
        param_dtype=cfg.precision.param_dtype if dtype != "fp32" else "fp32",
        optimizer=cfg.optimizer.name, offload=cfg.optimizer.offload, recompute=ac.mode,
        every=ac.every, scope=ac.scope, kernels="cuda" if device.type == "cuda" else "cpu",
    )


def device_for(device: torch.device) -> Device | None:
    """The table entry of the CUDA device, or the host's RAM for a CPU run."""
    if device.type == "cuda":
        return match_device(torch.cuda.get_device_name(device))
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return Device("cpu (host RAM)", ram / 2**30)


def plan_config(cfg: Config, device: torch.device) -> tuple[Plan, Device | None]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    lay = layout_from_config(cfg, device, world)
    return estimate(cfg.model.to_model_args(), lay), device_for(device)
