"""The plan of a training config, as `scaletrain train --dry-run` prints it before building."""

from __future__ import annotations

import os
from typing import Any

import torch

from scaletrain.config import Config, resolve_batch
from scaletrain.host import host_ram_bytes
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.feasibility import ZERO_STAGE, resolve_mode
from scaletrain.plan.estimate import estimate, plan_json
from scaletrain.plan.hardware import Device, match_device
from scaletrain.plan.layout import Layout, Plan, check_dims
from scaletrain.plan.memory.host import HostProcess
from scaletrain.plan.memory.states import GradConvention


def dims_from_config(cfg: Config, world_size: int) -> ParallelDims:
    """The parallel degrees of `cfg.parallel` on `world_size` ranks (-1 resolved), or a
    PlanError saying why they do not divide it."""
    par = cfg.parallel
    return check_dims(world_size, pp=par.pp, dp_replicate=par.dp_replicate,
                      dp_shard=par.dp_shard, cp=par.cp, tp=par.tp, ep=par.ep)


def layout_from_config(cfg: Config, device: torch.device, world_size: int) -> Layout:
    """The Layout the trainer will run: the same ParallelDims, batch, data-parallel mode (DDP,
    ZeRO-1, FSDP's ZeRO-2/3), FSDP parameter dtype and offload, precision, parameter dtype,
    optimizer offload, recomputation and pipeline schedule."""
    from scaletrain.runtime import resolve_dtype

    par = cfg.parallel
    dims = dims_from_config(cfg, world_size)
    gbs, _ = resolve_batch(cfg.training, dims.dp)
    dtype = resolve_dtype(cfg.precision, device)
    mode = resolve_mode(par.data_parallel, dims)
    distributed = dims.world_size > 1
    ac = cfg.activation_checkpoint
    return Layout(
        dims=dims, mbs=cfg.training.micro_batch_size, seq_len=cfg.data.seq_len, gbs=gbs,
        zero=ZERO_STAGE.get(mode, 3) if distributed else 0,
        sequence_parallel=par.sequence_parallel and dims.tp > 1,
        vpp=max(1, par.pp_virtual_stages), schedule=par.pp_schedule,
        pp_microbatches=par.pp_microbatches, precision=dtype,
        param_dtype=cfg.precision.param_dtype, grad_convention=_grad_convention(cfg),
        optimizer=cfg.optimizer.name,
        offload=cfg.optimizer.offload, cpu_offload=par.cpu_offload and distributed,
        fsdp_param_dtype=par.fsdp_param_dtype, fsdp_reduce_dtype=par.fsdp_reduce_dtype,
        recompute=ac.mode, every=ac.every,
        scope=ac.scope, kernels="cuda" if device.type == "cuda" else "cpu",
        fused_loss=cfg.training.fused_loss, loss_chunk=cfg.training.loss_chunk_tokens,
        fp8=cfg.precision.fp8, bucket_cap_mb=par.bucket_cap_mb,
        host=host_process(cfg) if device.type == "cpu" else None,
    )


def host_process(cfg: Config) -> HostProcess:
    """A CPU run's own memory counts: the device is the host's RAM (its loader as `cfg`'s)."""
    return HostProcess(loader_workers=cfg.data.num_workers,
                       prefetch_factor=cfg.data.prefetch_factor)


def _grad_convention(cfg: Config) -> GradConvention:
    """How the trainer keeps the gradients of 16-bit parameters (`precision.param_dtype bf16`,
    `train/optim.py` MasterWeightOptimizer): each micro-batch's 16-bit gradient is added into an
    fp32 buffer and freed at once, so the device holds the fp32 sums, 4 B per parameter
    (Megatron's main_grad); with `optimizer.offload` those sums live in host memory with the
    master weights, and the device holds only 16-bit gradients in flight (at most 2 B). With
    fp32 parameters the convention does not count; the planner's default (`megatron`) is
    kept. With several processes the partitioned optimizer keeps the same fp32 sums
    (`train/zero1.py`) and FSDP its fp32 gradient shards."""
    return trainer_grad_convention(cfg.precision.param_dtype, cfg.optimizer.offload)


def trainer_grad_convention(param_dtype: str, offload: bool) -> GradConvention:
    """`_grad_convention` of a run storing parameters in `param_dtype`, the optimizer state in
    host memory or not (`plan` asks it for its default)."""
    return "bf16" if offload and param_dtype != "fp32" else "megatron"


def device_for(device: torch.device) -> Device | None:
    """The table entry of the CUDA device, or for a CPU run the host's RAM, each rank's share
    of it: the ranks on one host (`LOCAL_WORLD_SIZE` under torchrun, else `WORLD_SIZE` as
    `--dry-run` is given it) add their peaks up in the same RAM."""
    if device.type == "cuda":
        return match_device(torch.cuda.get_device_name(device))
    try:
        ram = host_ram_bytes()
    except (ValueError, OSError, AttributeError):
        return None
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))
    if ranks == 1:
        return Device("cpu (host RAM)", ram / 2**30)
    return Device(f"cpu (host RAM / {ranks} ranks)", ram / 2**30 / ranks)


def plan_config(cfg: Config, device: torch.device) -> tuple[Plan, Device | None]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    lay = layout_from_config(cfg, device, world)
    from scaletrain.data.sources import resolve_model_args

    return estimate(resolve_model_args(cfg), lay), device_for(device)


def estimate_for_config(cfg: Any) -> dict[str, Any]:
    """The plan of a training `Config` as JSON-ready data (the profiler's OOM summary uses it;
    `scaletrain train --dry-run --json` prints the same)."""
    from scaletrain.runtime import resolve_device

    plan, device = plan_config(cfg, resolve_device(cfg.training.device))
    return plan_json(plan, device)
