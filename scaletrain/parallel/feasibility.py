"""Can this layout run, and if not, why: the one answer for the trainer, the planner, the
layout search and `train --dry-run`.

`RunLayout` is what the trainer will run (degrees, data-parallel mode, pipeline schedule,
precision and offload); `layout_problems` lists every reason it cannot, each naming the setting
and the fix. It imports no torch.distributed, so the planner can ask it without a process group.
The search never proposes a layout with problems: what stays refused here is never proposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.models.args import ModelArgs
from scaletrain.parallel.dims import ParallelDims

DATA_PARALLEL_MODES = ("ddp", "zero1", "zero2", "zero3")
ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
SCHEDULE_NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                  "ZBVZeroBubble")
SINGLE_STAGE = ("GPipe", "1F1B")
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble")
"""Schedules that split each micro-batch's backward into an input-gradient pass and a later
weight-gradient pass."""


def resolve_mode(data_parallel: str, dims: ParallelDims) -> str:
    """`parallel.data_parallel` with `auto` resolved: zero3 when sharding or with tensor or
    pipeline parallelism, else ddp."""
    if data_parallel != "auto":
        return data_parallel
    return "zero3" if dims.dp_shard > 1 or dims.tp > 1 or dims.pp > 1 else "ddp"


def runs_torch_ddp(replicated: bool, tp: int, pp: int, param_dtype: str) -> bool:
    """Whether data parallelism runs as torch's DDP, whose hooks all-reduce buckets during the
    backward: replicated weights (ZeRO-0/1) of the whole model (no tensor or pipeline
    parallelism) with fp32 parameters. Otherwise ZeRO-0/1 replicas' gradients are summed after
    the backward (`Parallelism.sync_gradients`), nothing behind which to hide."""
    return replicated and tp == 1 and pp == 1 and param_dtype == "fp32"


def pipeline_microbatches_problem(micro: int, grad_accum: int) -> str | None:
    """Why `parallel.pp_microbatches` = `micro` cannot run with `grad_accum` accumulation steps
    (None when it can): a step runs the schedule over that many micro-batches at a time."""
    if micro <= 0 or grad_accum % micro:
        return (f"parallel.pp_microbatches ({micro}) must divide the accumulation steps "
                f"({grad_accum}): a step runs the schedule over that many micro-batches at "
                "a time")
    return None


def reshards_after_forward(mode: str, pp: int, pp_schedule: str) -> bool:
    """Whether FSDP frees each block's gathered parameters after its forward (ZeRO-3).

    Not under a zero-bubble schedule: its input-gradient pass finds the weights whose gradients
    the later weight pass computes among the stage's parameters *at that moment*, and after a
    reshard those are FSDP's sharded parameters, not the gathered ones the forward used, so the
    weight pass would compute nothing for them (wrong gradients, silently). There the blocks of
    the rank's stages stay gathered from forward to backward, as under ZeRO-2 (torchtitan keeps
    them gathered under every pipeline schedule); the planner counts that memory."""
    return mode == "zero3" and not (pp > 1 and pp_schedule in SPLIT_BACKWARD)


def mode_for_zero(zero: int, dims: ParallelDims) -> str:
    """The trainer's data-parallel mode that runs ZeRO stage `zero` (0: DDP). With nothing to
    shard or replicate (dp x cp = 1) the stage makes no difference and `auto` decides."""
    if dims.dp * dims.cp == 1:
        return resolve_mode("auto", dims)
    return DATA_PARALLEL_MODES[zero]


@dataclass(frozen=True)
class RunLayout:
    """Everything about a run that decides whether it can start."""

    dims: ParallelDims
    mode: str
    """Resolved `parallel.data_parallel`: ddp, zero1, zero2 or zero3."""
    seq_len: int
    grad_accum: int
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = 1
    pp_microbatches: int | None = None
    cpu_offload: bool = False
    """`parallel.cpu_offload` (FSDP's host-memory offload)."""
    sequence_parallel: bool = True
    """`parallel.sequence_parallel` (matters with tensor parallelism)."""
    precision: str = "fp32"
    """The autocast dtype: fp32, bf16 or fp16."""
    param_dtype: str = "fp32"
    """`precision.param_dtype`: bf16 parameters with fp32 master weights (with several
    processes sharded like the optimizer state: ZeRO-1's partitioned optimizer, FSDP's fp32
    shards under ZeRO-2/3)."""
    optimizer_offload: bool = False
    """`optimizer.offload` (single-process master weights and state in host memory)."""
    fp8: str = "none"
    """`precision.fp8`: none, tensorwise or rowwise (torchao float8 linears)."""


def schedule_problems(name: str, pp: int, virtual: int, microbatches: int) -> list[str]:
    """What is wrong with a pipeline schedule for these stages and micro-batches."""
    out = []
    if name not in SCHEDULE_NAMES:
        out.append(f"parallel.pp_schedule '{name}' is unknown; choose one of "
                   f"{', '.join(SCHEDULE_NAMES)}")
        return out
    if name in SINGLE_STAGE and virtual != 1:
        out.append(f"parallel.pp_schedule {name} runs one stage per rank: set "
                   "parallel.pp_virtual_stages 1 or pick Interleaved1F1B / InterleavedZeroBubble")
    if name == "ZBVZeroBubble" and virtual != 2:
        out.append("parallel.pp_schedule ZBVZeroBubble needs parallel.pp_virtual_stages 2")
    if name == "1F1B" and microbatches < pp:  # torch's Schedule1F1B refuses fewer
        out.append(f"parallel.pp_schedule 1F1B needs at least parallel.pp ({pp}) micro-batches "
                   f"per step, got {microbatches}: raise training.grad_accum_steps (or "
                   "global_batch_size) or use --parallel.pp_schedule GPipe")
    if name not in SINGLE_STAGE and name != "LoopedBFS" and microbatches % pp:
        out.append(f"parallel.pp_schedule {name} needs the micro-batch count ({microbatches}) "
                   f"to be a multiple of parallel.pp ({pp})")
    return out


def fp8_problems(lay: RunLayout) -> list[str]:
    """The layouts `precision.fp8` does not combine with (yet). Whether the device and the
    dtype can run fp8 at all is `parallel.fp8.fp8_problem`."""
    if lay.fp8 == "none" or lay.dims.world_size == 1:
        return []
    out = []
    if lay.cpu_offload:
        out.append("precision.fp8 with parallel.cpu_offload is not supported yet; set one of "
                   "them off")
    if lay.dims.ep > 1:
        out.append("precision.fp8 with expert parallelism (parallel.ep) is not supported yet; "
                   "set precision.fp8 none or parallel.ep 1")
    return out


def layout_problems(args: ModelArgs, lay: RunLayout) -> list[str]:
    """Every reason the trainer cannot run `lay` on `args` (empty: it can)."""
    d = lay.dims
    out = d.model_problems(args, lay.seq_len, lay.pp_virtual_stages)
    if lay.mode not in DATA_PARALLEL_MODES:
        out.append(f"parallel.data_parallel '{lay.mode}' is unknown; choose auto or one of "
                   f"{', '.join(DATA_PARALLEL_MODES)}")
        return out
    if lay.mode in ("zero2", "zero3") and d.dp_shard == 1 and d.dp_replicate > 1 \
            and d.tp == 1 and d.pp == 1 and d.cp == 1:
        out.append(f"parallel.data_parallel {lay.mode} shards over parallel.dp_shard, which "
                   "is 1; set --parallel.dp_shard -1 (or use ddp/zero1 for pure replicas)")
    if d.ep > 1:
        if lay.mode not in ("zero2", "zero3"):
            out.append(f"parallel.ep needs data_parallel zero2 or zero3 (FSDP), not "
                       f"{lay.mode}")
        if d.cp > 1 or d.dp_replicate > 1:
            out.append("parallel.ep is implemented with parallel.cp 1 and "
                       "parallel.dp_replicate 1 (experts sharded over dp_shard only)")
        if lay.cpu_offload:
            out.append("parallel.ep does not support parallel.cpu_offload yet")
        if d.tp > 1 and d.pp > 1:
            out.append("parallel.ep with parallel.tp > 1 is implemented without pipeline "
                       "parallelism (parallel.pp 1); drop one of ep, tp or pp")
    if args.is_moe and args.moe_aux_loss_coef > 0 and args.moe_aux_loss_scope == "micro_batch" \
            and d.dp * d.cp > 1 and lay.grad_accum > 1:
        out.append("model.moe_aux_loss_scope micro_batch with data or context parallelism and "
                   "accumulation (training.grad_accum_steps > 1) drifts from one process after "
                   "the first step (measured: 2.4e-5 relative in the gradient norm by step 3; "
                   "not explained yet); use the default scope sequence, or grad_accum_steps 1")
    if d.tp > 1 and args.dropout > 0:
        out.append(f"model.dropout {args.dropout} is not supported with tensor parallelism "
                   "(parallel.tp > 1): the tensor-parallel ranks would need identical masks on "
                   "replicated activations and DTensor's RNG tracker on sequence-sharded ones; "
                   "set --model.dropout 0 or --parallel.tp 1")
    if d.cp > 1 and args.arch != "llama":
        out.append(f"context parallelism is not implemented for arch '{args.arch}' (only "
                   "'llama'); use data, tensor or pipeline parallelism")
    if d.pp > 1:
        micro = lay.pp_microbatches or lay.grad_accum
        out += schedule_problems(lay.pp_schedule, d.pp, lay.pp_virtual_stages, micro)
        fsdp = lay.mode in ("zero2", "zero3") and d.dp_replicate * d.dp_shard * d.cp > 1
        if args.tie_embeddings and lay.pp_schedule == "ZBVZeroBubble" and fsdp:
            out.append("a tied head (model.tie_embeddings) under ZBVZeroBubble puts the "
                       "embedding and the head on one rank in two FSDP roots, which cannot share "
                       "the weight; use another pipeline schedule, data_parallel ddp/zero1, or "
                       "an untied model")
        problem = pipeline_microbatches_problem(micro, lay.grad_accum)
        if problem:
            out.append(problem)
    out += fp8_problems(lay)
    if lay.cpu_offload and lay.mode not in ("zero2", "zero3"):
        out.append("parallel.cpu_offload needs data_parallel zero2 or zero3")
    if lay.param_dtype not in ("fp32", "bf16"):
        out.append(f"precision.param_dtype {lay.param_dtype} is not supported (plan: "
                   "--param-dtype); use bf16 (fp32 master weights) or fp32 (autocast)")
    if lay.param_dtype == "bf16" and lay.precision == "fp16":
        out.append("precision.param_dtype bf16 cannot be combined with fp16 autocast; use "
                   "precision.dtype bf16")
    if d.world_size > 1:  # fp16 runs in every layout (the step's sharded loss scaler)
        if lay.optimizer_offload:
            out.append("optimizer.offload (plan: --offload) is a single-process option; with "
                       "several processes use parallel.cpu_offload with zero2/zero3 (plan: "
                       "--cpu-offload)")
    elif lay.optimizer_offload and lay.precision == "fp16":
        out.append("optimizer.offload does not support fp16 loss scaling; use "
                   "precision.dtype bf16 or fp32")
    return out
