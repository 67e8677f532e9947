"""`estimate(args, layout)`: memory, FLOPs, bubble and communication of the most loaded rank."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from scaletrain import _moved
from scaletrain.models.args import ModelArgs, count_active_params, count_params
from scaletrain.plan.flops import attention_forward_flops, flops_per_token
from scaletrain.plan.layout import Layout, Plan, PlanError, layout_problems, trainer_problems
from scaletrain.plan.memory.activations import (
    DTYPE_BYTES,
    ActivationSpec,
    held_logits_bytes,
    logits_buffer_bytes,
)
from scaletrain.plan.memory.host import (
    LOADER_WORKER_BYTES,
    RUNTIME_BYTES,
    batch_bytes,
)
from scaletrain.plan.memory.stage_activations import StageActivations, stage_activations
from scaletrain.plan.memory.states import (
    StageParams,
    StateBytes,
    grad_sync_bucket_bytes,
    offload_states,
    sharded_state,
    stage_params,
    state_bytes,
)
from scaletrain.plan.timing.comm import comm_bytes, expert_params


def peak_bytes(mem: dict[str, int], grad_accum: int, grads_resident: bool = False,
               comm_at_step_only: bool = False) -> int:
    """The larger of the two moments of a step that hold the most (`total`, every component
    at once, is an upper bound that never happens):

    - the end of a forward pass: activations, logits/loss buffers and 16-bit weight copies
      live (under FSDP, the gathered root unit too); gradients only when an earlier
      micro-batch of the same step left them (`zero_grad(set_to_none=True)` frees them after
      each optimizer step) or when they live in buckets that outlast the step
      (`grads_resident`: torch's DDP);
    - the optimizer step: every gradient, no activations; with `comm_at_step_only` the
      communication buffers exist only here (the flat gradient buckets of `sync_gradients`).

    A CPU run adds the process's own memory and its loader's (`host_runtime`, `batches`,
    `loader_workers`) to both, a pipeline stage its receive buffers (`pipeline_buffers`) to
    both and the sends its schedule holds until the step ends (`pipeline_sends`) to the first.

    Measured on an H200 (bench/plan_gpu.py): within 5 % for llama3.2-1b without and with
    partial recomputation (then named selective), +10 % with full recomputation; `total` was
    15-31 % high. On CPU: bench/cpu_peak_vs_plan.py.
    """
    comm = mem["comm_buffers"]
    states = (mem["weights"] + mem["master_weights"] + mem["optimizer"]
              + mem.get("host_runtime", 0) + mem.get("batches", 0)
              + mem.get("loader_workers", 0) + mem.get("pipeline_buffers", 0))
    forward = (states + mem["activations"] + mem["logits_loss"] + mem["cast_weights"]
               + mem.get("pipeline_sends", 0)
               + mem.get("gathered_weights", 0) + mem.get("root_gathered", 0)
               + (0 if comm_at_step_only else comm)
               + (mem["gradients"] if grad_accum > 1 or grads_resident else 0))
    return max(forward, states + comm + mem["gradients"])


ZERO_BUBBLE_COSTS = (1.0, 1.0, 1.0)
"""Relative times of a micro-batch's forward, input-gradient and weight-gradient passes on a
stage (T_F, T_B, T_W): equal, the assumption of the zero-bubble paper (Qi et al. 2023,
arXiv 2401.10241, §2) and close to a transformer block's FLOPs (each of the three is one pass
over the block's matmuls; attention's backward sits in the input gradient)."""


def bubble_fraction(pp: int, microbatches: int, vpp: int = 1, schedule: str = "1F1B",
                    costs: tuple[float, float, float] = ZERO_BUBBLE_COSTS) -> float:
    """Idle time over busy compute time of a pipeline step, for the schedule torch runs:

    - GPipe, 1F1B: (p-1)/m; Interleaved1F1B and LoopedBFS with v chunks per rank: (p-1)/(v m)
      (Narayanan et al. 2021, §2.2);
    - InterleavedZeroBubble (torch's ZB1P, v chunks): the backward split into an input-gradient
      pass B and a weight-gradient pass W that fills the bubbles, (p-1)(T_F + T_B - T_W) /
      (v m (T_F + T_B + T_W)): 1/3 of 1F1B's with equal times (ZB-H1, Qi et al. 2023, §2.1);
    - ZBVZeroBubble (2 chunks in a V): ZB1P's formula with v = 2 once m >= 2p, with v = 1 at
      m = p (torch's V schedule, not the paper's zero-bubble ZB-V).

    Checked against the action order of torch's own schedule classes, timed by an event
    simulation (tests/helpers/pipeline_reference.py, tests/plan/test_plan_bubble.py): equal for
    every schedule with equal T_F, T_B, T_W; ZB1P also for unequal ones."""
    if pp <= 1:
        return 0.0
    m = microbatches
    if schedule in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        f, b, w = costs
        v = vpp if schedule == "InterleavedZeroBubble" else (2 if m >= 2 * pp else 1)
        return (pp - 1) * (f + b - w) / (v * m * (f + b + w))
    v = vpp if schedule in ("Interleaved1F1B", "LoopedBFS") or vpp > 1 else 1
    return (pp - 1) / (v * m)


def _spec(args: ModelArgs, lay: Layout) -> ActivationSpec:
    return ActivationSpec(
        mbs=lay.mbs, seq_len=lay.seq_len, compute_dtype=lay.precision,
        residual_dtype=lay.stored_dtype, tp=lay.dims.tp,
        sequence_parallel=lay.sequence_parallel, cp=lay.dims.cp, recompute=lay.recompute,
        every=lay.every, scope=lay.scope, kernels=lay.kernels, fused_loss=lay.fused_loss,
        loss_chunk=lay.loss_chunk,
    )


def hardware_flops_per_token(args: ModelArgs, lay: Layout) -> float:
    """Model FLOPs plus the forward of every recomputed region."""
    return _hardware_flops(args, lay.seq_len, lay.recompute, lay.every, lay.scope)


@lru_cache(maxsize=1024)
def _hardware_flops(args: ModelArgs, seq_len: int, recompute: str, every: int,
                    scope: str) -> float:
    """`hardware_flops_per_token` of hashable inputs (the search asks thousands of times)."""
    lay = Layout(seq_len=seq_len, recompute=recompute, every=every,  # type: ignore[arg-type]
                 scope=scope)  # type: ignore[arg-type]
    model = flops_per_token(args, lay.seq_len)
    if lay.recompute == "none":
        return model
    c = count_params(args)
    attn_core = attention_forward_flops(args, lay.seq_len) / args.n_layers  # layer average
    mlp_active = c.mlp - (c.total - count_active_params(args))  # MoE: experts a token uses
    layer_fwd = 2 * (c.attention + mlp_active) / args.n_layers + attn_core
    attn_fwd = 2 * c.attention / args.n_layers + attn_core
    if lay.recompute == "full":
        return model + args.n_layers * layer_fwd
    wrapped = sum(1 for i in range(args.n_layers) if i % lay.every == lay.every - 1)
    return model + wrapped * (layer_fwd if lay.scope == "block" else attn_fwd)


def estimate(args: ModelArgs, lay: Layout) -> Plan:
    """The plan of the most loaded rank; raises PlanError for a layout that cannot run."""
    problems = layout_problems(args, lay)
    if problems:
        raise PlanError("invalid layout:\n  - " + "\n  - ".join(problems))
    dims = lay.dims
    try:
        per_param = state_bytes(lay.precision, lay.stored_dtype, lay.optimizer,
                                lay.grad_convention)
    except ValueError as e:
        raise PlanError(str(e)) from None
    spec = _spec(args, lay)
    m = lay.pipeline_microbatches  # of one schedule run: what a stage holds at once
    per_stage: list[tuple[int, dict[str, int], StageParams, StageActivations, int]] = []
    for stage in range(dims.pp):
        sp = stage_params(args, dims.pp, dims.tp, stage, lay.vpp, lay.schedule)
        act = stage_activations(args, spec, dims.pp, lay.vpp, lay.schedule, m, stage)
        mem, offloaded = _stage_memory(args, lay, per_param, spec, sp, act)
        per_stage.append((stage, mem, sp, act, offloaded))
    stage, mem, sp, act, offloaded = max(per_stage, key=lambda row: row[1]["peak"])
    pa = act.per_microbatch
    best = Plan(
        args=args, layout=lay, params=count_params(args).total, params_per_rank=sp.total,
        stage=stage, flops_per_token=flops_per_token(args, lay.seq_len),
        hardware_flops_per_token=hardware_flops_per_token(args, lay),
        memory_bytes=mem, bubble_fraction=bubble_fraction(dims.pp, m, lay.vpp, lay.schedule),
        in_flight_microbatches=act.in_flight, comm_bytes_per_step={}, comm_bytes_by_dim={},
        activation_breakdown={**pa.layers, "embedding": pa.embedding,
                              "rope_tables": pa.rope_tables, "head": pa.head,
                              "loss": pa.loss, "recompute": pa.recompute},
        cpu_offload_bytes=offloaded, trainer_problems=trainer_problems(args, lay),
        stages=[_stage_summary(*row) for row in per_stage] if dims.pp > 1 else [],
    )
    by_kind, by_dim = comm_bytes(args, lay, sp.total, sp.layers, per_param.weights,
                                 per_param.gradients)
    best.comm_bytes_per_step, best.comm_bytes_by_dim = by_kind, by_dim
    return best


def _stage_summary(stage: int, mem: dict[str, int], sp: StageParams, act: StageActivations,
                   offloaded: int) -> dict[str, Any]:
    """One pipeline stage's line of `Plan.stages`."""
    return {"stage": stage, "layers": sp.layers, "params": sp.total,
            "embedding": sp.embedding > 0, "head": sp.head > 0,
            "in_flight_microbatches": act.in_flight, "held_at_peak": act.held,
            "memory_bytes": dict(mem)}


def _stage_memory(args: ModelArgs, lay: Layout, per_param: StateBytes, spec: ActivationSpec,
                  sp: StageParams, act: StageActivations) -> tuple[dict[str, int], int]:
    """(each component's bytes on one rank of a stage, with its `total` and `peak`; the bytes
    offloaded to the host)."""
    dims = lay.dims
    m = lay.grad_accum
    # FSDP2 (the trainer's ZeRO-2 and ZeRO-3) keeps the weights sharded at rest too.
    zero = 3 if lay.fsdp else lay.zero
    states = sharded_state(per_param, sp.total, zero, lay.shard_group)
    if lay.grads_stay_unsharded:  # accumulated unsharded, in FSDP's reduce dtype, beside
        # the reduced shards of the step's earlier schedule runs
        earlier_runs = states["gradients"] if lay.pipeline_runs > 1 else 0
        states["gradients"] = DTYPE_BYTES[lay.fsdp_reduce_dtype] * sp.total + earlier_runs
    if lay.fsdp and lay.stored_dtype != "fp32":
        # 16-bit parameters under FSDP: its fp32 shards are the master weights and the
        # 16-bit weights exist only gathered (`gathered_weights`, `comm_buffers`)
        states["weights"] = 0.0
    offloaded = offload_states(states, lay.offload)
    if lay.cpu_offload and lay.fsdp:  # FSDP's offload: every sharded state to the host
        offloaded += int(sum(states.values()))
        states = dict.fromkeys(states, 0.0)
    c = DTYPE_BYTES[lay.precision]
    mem = {k: int(v) for k, v in states.items()}
    mem["activations"] = act.bytes
    if act.p2p_buffers:
        mem["pipeline_buffers"] = act.p2p_buffers
    if act.held_sends:
        mem["pipeline_sends"] = act.held_sends
    mem["logits_loss"] = 0
    if dims.pp == 1:
        mem["logits_loss"] = logits_buffer_bytes(args, spec)
    elif sp.head > 0:  # the logits are the stage's output, held with its activations
        mem["logits_loss"] = logits_buffer_bytes(args, spec) - held_logits_bytes(args, spec)
    w = per_param.weights
    gathered = DTYPE_BYTES[lay.gather_dtype] if lay.fsdp else w
    # Autocast keeps a 16-bit copy of every fp32 weight it used until backward; FSDP
    # gathering in bf16 hands it 16-bit weights already.
    cast = lay.stored_dtype == "fp32" and c < 4 and gathered == 4
    mem["cast_weights"] = sp.total * c if cast else 0
    # ZeRO-2 under FSDP (reshard_after_forward=False), and ZeRO-3 under a zero-bubble
    # schedule: every block stays gathered from its forward to its backward; under any
    # pipeline schedule the stage stays gathered after each backward (`grads_stay_unsharded`).
    # Expert parallelism: FSDP gathers a rank's own experts only (1/ep of each layer's;
    # composed with TP, 1/(ep x tp): the experts are split over both, `parallel/ep_tp.py`).
    not_local = (1 - 1 / dims.ep) * expert_params(args, 1) / dims.tp
    unsharded = sp.total - sp.layers * not_local
    stage_gathered = lay.blocks_stay_gathered or lay.grads_stay_unsharded
    mem["gathered_weights"] = int(unsharded * gathered) if stage_gathered else 0
    if lay.fsdp and not stage_gathered:
        # The root unit (`apply_fsdp`'s last `fully_shard`: embedding, final norm, head)
        # reshards only after backward: gathered from the forward's start to its backward.
        mem["root_gathered"] = int((sp.embedding + sp.head) * gathered)
    if lay.fsdp:
        # The unsharded block being computed and the prefetched next one, plus the
        # unsharded gradients of one block before its reduce-scatter.
        mem["comm_buffers"] = int((sp.per_layer - not_local) * (2 * gathered + gathered))
    elif (dims.dp > 1 or dims.cp > 1) and not lay.ddp_wrapped:
        # TP/PP next to data parallelism: one flat bucket at a time, before the step.
        counts = count_params(args)  # the largest gradient: embedding, head, MLP matrix
        largest = max(counts.embedding, counts.head, args.hidden_dim * args.dim) // dims.tp
        mem["comm_buffers"] = grad_sync_bucket_bytes(
            states["gradients"], lay.bucket_cap_mb, largest * per_param.gradients)
    else:  # one process, or torch's DDP: its buckets are the gradients, reduced in place
        mem["comm_buffers"] = 0
    if lay.host is not None:
        mem["host_runtime"] = RUNTIME_BYTES
        mem["batches"] = batch_bytes(lay.host, lay.mbs, lay.seq_len, m)
        mem["loader_workers"] = lay.host.loader_workers * LOADER_WORKER_BYTES
    mem["total"] = sum(mem.values())
    mem["peak"] = peak_bytes(mem, m, grads_resident=lay.ddp_wrapped,
                             comm_at_step_only=not lay.fsdp)
    return mem, offloaded


def plan_json(plan: Plan, device: Any = None) -> dict[str, Any]:
    """The JSON of `plan --json` and `train --dry-run --json` (one function, one format)."""
    out = plan.to_json()
    if device is not None:
        out["device"] = {"name": device.name, "memory_bytes": device.memory_bytes,
                         "fits": plan.peak_bytes <= device.memory_bytes}
    return out


__getattr__ = _moved.forward(__name__)  # Layout, Plan, ... moved to plan.layout (one release)
