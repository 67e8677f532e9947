"""`estimate(args, layout)`: memory, FLOPs, bubble and communication of the most loaded rank."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from scaletrain.config_sections import ParallelConfig, PrecisionConfig, TrainingConfig
from scaletrain.models.args import ModelArgs, count_active_params, count_params
from scaletrain.parallel.dims import ParallelDims, ParallelDimsError
from scaletrain.parallel.feasibility import (
    RunLayout,
    mode_for_zero,
    pipeline_microbatches_problem,
    reshards_after_forward,
    runs_torch_ddp,
)
from scaletrain.parallel.feasibility import layout_problems as run_problems
from scaletrain.plan.activations import (
    DTYPE_BYTES,
    ActivationSpec,
    held_logits_bytes,
    logits_buffer_bytes,
)
from scaletrain.plan.comm import comm_bytes, expert_params
from scaletrain.plan.flops import attention_forward_flops, flops_per_token
from scaletrain.plan.host_memory import (
    LOADER_WORKER_BYTES,
    RUNTIME_BYTES,
    HostProcess,
    batch_bytes,
)
from scaletrain.plan.memory import (
    GradConvention,
    StageParams,
    StateBytes,
    grad_sync_bucket_bytes,
    offload_states,
    sharded_state,
    stage_params,
    state_bytes,
)
from scaletrain.plan.stage_activations import StageActivations, stage_activations

DDP_BUCKET_BYTES = 25 * 2**20
Schedule = str
"""A pipeline schedule name (`parallel.feasibility.SCHEDULE_NAMES`)."""

TRAINER_PRECISION = PrecisionConfig()
TRAINER_PARALLEL = ParallelConfig()
"""The trainer's own config defaults (`config_sections`): a Layout left at its defaults plans
what `scaletrain train` runs with no flags, not a restatement of it."""


class PlanError(ValueError):
    """A layout or input the planner cannot estimate; the message names the fix."""


@dataclass(frozen=True)
class Layout:
    """Everything besides the model that decides memory and time of one training step."""

    dims: ParallelDims = field(default_factory=ParallelDims)
    mbs: int = 1
    seq_len: int = 2048
    gbs: int | None = None
    """Sequences per optimizer step (None: one micro-batch per data-parallel rank)."""
    zero: int = 0
    sequence_parallel: bool = True
    vpp: int = 1
    schedule: Schedule = TRAINER_PARALLEL.pp_schedule
    precision: str = "bf16"
    param_dtype: str = TRAINER_PRECISION.param_dtype
    """Dtype the parameters are stored in (`precision.param_dtype`; default the trainer's:
    autocast over fp32 parameters). `bf16` is 16-bit parameters with fp32 master weights (sharded
    over the data-parallel ranks under ZeRO-1/2/3): the setup of the ZeRO paper's tables."""
    grad_convention: GradConvention = "megatron"
    """Gradient bytes of 16-bit parameters; `megatron` (fp32 sums only) is what the trainer
    keeps."""
    optimizer: str = "adamw"
    offload: bool = False
    """Optimizer state and master weights in host memory (one process: `optimizer.offload`)."""
    cpu_offload: bool = False
    """FSDP's offload (`parallel.cpu_offload`, ZeRO-2/3): sharded weights, gradients and
    optimizer state in host memory; the device keeps the gathered blocks."""
    fsdp_param_dtype: str = TRAINER_PARALLEL.fsdp_param_dtype
    """ZeRO-2/3: dtype FSDP gathers the fp32 shards in (`parallel.fsdp_param_dtype`); bf16
    needs no autocast weight copies and halves the all-gathers."""
    fsdp_reduce_dtype: str = TRAINER_PARALLEL.fsdp_reduce_dtype
    """ZeRO-2/3: dtype FSDP reduce-scatters (and HSDP all-reduces) gradients in
    (`parallel.fsdp_reduce_dtype`); step time only."""
    pp_microbatches: int | None = None
    recompute: Literal["none", "partial", "full"] = "none"
    every: int = 2
    scope: Literal["block", "attention"] = "block"
    kernels: Literal["cpu", "cuda"] = "cuda"
    fused_loss: bool = False
    """`training.fused_loss`: no logits tensor; one chunk of `loss_chunk` tokens at a time."""
    loss_chunk: int = TrainingConfig.loss_chunk_tokens
    fp8: str = "none"
    """`precision.fp8` (carried for the trainer's layout check; memory and time are estimated
    as for `precision`)."""
    bucket_cap_mb: float = TRAINER_PARALLEL.bucket_cap_mb
    """`parallel.bucket_cap_mb`: DDP's gradient buckets (their count; their bytes are the
    gradients'), and the flat buckets data parallelism all-reduces next to TP/PP."""
    host: HostProcess | None = None
    """Set when the device is this host's RAM (a CPU run): the process's own memory and the
    data loader's batches count too (`plan/host_memory.py`)."""

    @property
    def stored_dtype(self) -> str:
        """The dtype the parameters are stored in (`param_dtype`)."""
        return self.param_dtype

    @property
    def gather_dtype(self) -> str:
        """The dtype FSDP gathers in: `fsdp_param_dtype`, or the 16-bit parameter dtype (the
        trainer's FSDP computes 16-bit parameters from its fp32 shards)."""
        return self.fsdp_param_dtype if self.stored_dtype == "fp32" else self.stored_dtype

    @property
    def grad_accum(self) -> int:
        per_step = self.mbs * self.dims.dp
        if self.gbs is None:
            return 1
        return self.gbs // per_step

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches of one run of the pipeline schedule (`parallel.pp_microbatches`, by
        default all of the step's)."""
        return self.pp_microbatches or self.grad_accum

    @property
    def pipeline_runs(self) -> int:
        """Runs of the pipeline schedule per step (1 without pipeline parallelism)."""
        return max(1, self.grad_accum // self.pipeline_microbatches) if self.dims.pp > 1 else 1

    @property
    def gradient_reductions(self) -> int:
        """FSDP's gradient reductions (reduce-scatters) per step: one per micro-batch, or
        under pipeline parallelism one per schedule run (torch defers them to a run's last
        backward)."""
        return self.pipeline_runs if self.dims.pp > 1 else self.grad_accum

    @property
    def replica_all_reduces(self) -> int:
        """HSDP's all-reduces across the replicas per step: one (the last micro-batch's:
        `Parallelism.micro_batch_sync`), or one per schedule run under pipeline parallelism."""
        return self.pipeline_runs

    @property
    def shard_group(self) -> int:
        """Ranks that shard the model state under ZeRO: FSDP (ZeRO-2/3) shards over
        dp_shard x cp (replicating across dp_replicate: HSDP); ZeRO-1 shards the optimizer over
        every data-parallel and context-parallel rank."""
        if self.zero >= 2:
            return self.dims.dp_shard * self.dims.cp
        return self.dims.dp * self.dims.cp

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards this layout (ZeRO-2/3 over more than one rank)."""
        return self.zero >= 2 and self.shard_group > 1

    @property
    def blocks_stay_gathered(self) -> bool:
        """FSDP keeps every block of the rank's stages gathered from its forward to its
        backward: ZeRO-2, and ZeRO-3 under a zero-bubble schedule (whose split backward needs
        the gathered weights; `parallel.feasibility.reshards_after_forward`)."""
        return self.fsdp and not reshards_after_forward(self.data_parallel, self.dims.pp,
                                                        self.schedule)

    @property
    def grads_stay_unsharded(self) -> bool:
        """FSDP under pipeline parallelism: torch's schedules accumulate each stage's gradients
        unsharded over the micro-batches and reduce them after the stage's last backward
        (`perform_reduce_grad`), leaving the stage's blocks gathered after each backward
        (`set_reshard_after_backward(False)`): at the end of a backward the rank holds the
        whole stage's weights gathered and its gradients unsharded
        (`tests/distributed/test_pp_fsdp_memory.py` measures both)."""
        return self.fsdp and self.dims.pp > 1

    @property
    def ddp_wrapped(self) -> bool:
        """torch's DDP holds the model (ZeRO-0/1 without TP or PP, fp32 parameters: the
        trainer's `Parallelism.ddp_wrapped`); otherwise the step all-reduces flat buckets."""
        return runs_torch_ddp(self.zero <= 1, self.dims.tp, self.dims.pp, self.stored_dtype) \
            and self.dims.dp * self.dims.cp > 1

    @property
    def data_parallel(self) -> str:
        """The trainer's `parallel.data_parallel` mode that runs this layout."""
        return mode_for_zero(self.zero, self.dims)

    def run_layout(self) -> RunLayout:
        """This layout as the trainer's feasibility check sees it."""
        return RunLayout(
            dims=self.dims, mode=self.data_parallel, seq_len=self.seq_len,
            grad_accum=self.grad_accum, pp_schedule=self.schedule,
            pp_virtual_stages=self.vpp, pp_microbatches=self.pp_microbatches,
            cpu_offload=self.cpu_offload, sequence_parallel=self.sequence_parallel,
            precision=self.precision,
            param_dtype=self.stored_dtype, optimizer_offload=self.offload, fp8=self.fp8)

    def replace(self, **changes: Any) -> Layout:
        return dataclasses.replace(self, **changes)


def layout_problems(args: ModelArgs, lay: Layout) -> list[str]:
    """Every reason `lay` cannot run `args`, each naming the value and the fix."""
    out: list[str] = []
    for name in ("mbs", "seq_len", "vpp", "every"):
        if getattr(lay, name) <= 0:
            out.append(f"{name} must be positive (got {getattr(lay, name)})")
    if lay.gbs is not None and lay.gbs <= 0:
        out.append(f"gbs must be positive (got {lay.gbs})")
    if out:
        return out
    if lay.precision not in DTYPE_BYTES or lay.stored_dtype not in ("fp32", "bf16", "fp16"):
        out.append(f"precision must be fp32, bf16 or fp16 (got {lay.precision})")
    # The planner estimates tied embeddings under pipeline parallelism as Megatron runs them
    # (first and last stage each hold the embedding; `memory.stage_params`, `comm.py`):
    # whether the trainer runs them is `trainer_problems`' question, not the estimate's.
    out += [p for p in lay.dims.model_problems(args, lay.seq_len, lay.vpp)
            if not p.startswith("model.tie_embeddings")]
    if lay.gbs is not None and lay.gbs % (lay.mbs * lay.dims.dp):
        out.append(f"the global batch ({lay.gbs} sequences) must be divisible by micro-batch x "
                   f"data parallel ({lay.mbs} x {lay.dims.dp})")
    if lay.vpp > 1 and lay.dims.pp == 1:
        out.append("virtual pipeline stages (--vpp) need pipeline parallelism (--pp > 1)")
    problem = (pipeline_microbatches_problem(lay.pp_microbatches, lay.grad_accum)
               if lay.pp_microbatches is not None else None)
    if problem:
        out.append(problem)
    if lay.seq_len > args.max_seq_len:
        out.append(f"seq_len ({lay.seq_len}) exceeds the model's max_seq_len "
                   f"({args.max_seq_len}); pass --set model.max_seq_len={lay.seq_len}")
    if lay.fsdp_param_dtype not in ("fp32", "bf16"):
        out.append(f"fsdp_param_dtype must be fp32 or bf16 (got {lay.fsdp_param_dtype})")
    return out


def trainer_problems(args: ModelArgs, lay: Layout) -> list[str]:
    """Why `scaletrain train` cannot run `lay` (the trainer's own feasibility check); empty when
    it can. The planner still estimates such layouts; the search never proposes them."""
    return run_problems(args, lay.run_layout())


@dataclass
class Plan:
    """The estimate for the most loaded rank (`stage` is its pipeline stage)."""

    args: ModelArgs
    layout: Layout
    params: int
    params_per_rank: int
    stage: int
    flops_per_token: float
    hardware_flops_per_token: float
    memory_bytes: dict[str, int]
    bubble_fraction: float
    in_flight_microbatches: float
    comm_bytes_per_step: dict[str, int]
    comm_bytes_by_dim: dict[str, int]
    activation_breakdown: dict[str, int]
    cpu_offload_bytes: int = 0
    trainer_problems: list[str] = field(default_factory=list)
    """Why `scaletrain train` cannot run this layout (empty: it can)."""
    finetune: dict[str, Any] | None = None
    """Set by `plan.finetune.finetune_plan`: method, trainable and total parameters."""
    stages: list[dict[str, Any]] = field(default_factory=list)
    """Under pipeline parallelism, every stage's memory (`memory_bytes`, its `peak`), layers,
    parameters and the micro-batches it holds at its peak; `memory_bytes` above is the stage
    with the highest peak."""

    @property
    def peak_bytes(self) -> int:
        """What must fit on the device: the larger of the two fullest moments of a step."""
        return self.memory_bytes["peak"]

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "model": self.args.to_dict(),
            "layout": {
                **lay.dims.mesh_shape, "dp": lay.dims.dp, "zero": lay.zero, "mbs": lay.mbs,
                "ga": lay.grad_accum, "seq_len": lay.seq_len, "vpp": lay.vpp,
                "sequence_parallel": lay.sequence_parallel, "precision": lay.precision,
                "param_dtype": lay.stored_dtype, "grad_convention": lay.grad_convention,
                "optimizer": lay.optimizer, "offload": lay.offload,
                "data_parallel": lay.data_parallel, "cpu_offload": lay.cpu_offload,
                "fsdp_param_dtype": lay.fsdp_param_dtype, "recompute": lay.recompute,
                "every": lay.every, "scope": lay.scope, "schedule": lay.schedule,
            },
            "params": self.params,
            "active_params": count_active_params(self.args),
            "params_per_rank": self.params_per_rank,
            "most_loaded_stage": self.stage,
            **({"stages": self.stages} if self.stages else {}),
            "flops_per_token": self.flops_per_token,
            "hardware_flops_per_token": self.hardware_flops_per_token,
            "memory_bytes": self.memory_bytes,
            "activation_bytes": self.activation_breakdown,
            "cpu_offload_bytes": self.cpu_offload_bytes,
            "trainer_runs": not self.trainer_problems,
            "trainer_problems": self.trainer_problems,
            "bubble_fraction": self.bubble_fraction,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "comm_bytes_by_dim": self.comm_bytes_by_dim,
            # torch's DDP: its buckets are the gradients (views into them), filled in order
            # until one reaches the cap (the first: 1 MiB); they add no bytes of their own.
            **({"ddp_buckets": {"bytes": self.memory_bytes["gradients"],
                                "bucket_cap_bytes": int(lay.bucket_cap_mb * 2**20)}}
               if lay.ddp_wrapped else {}),
            **({"finetune": self.finetune} if self.finetune else {}),
        }


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
    simulation (tests/pipeline_reference.py, tests/test_plan_bubble.py): equal for every
    schedule with equal T_F, T_B, T_W; ZB1P also for unequal ones."""
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


def check_dims(world_size: int, **degrees: int) -> ParallelDims:
    """`ParallelDims.resolve` with its error turned into a PlanError."""
    try:
        return ParallelDims.resolve(world_size, **degrees)
    except ParallelDimsError as e:
        raise PlanError(str(e)) from None


def plan_json(plan: Plan, device: Any = None) -> dict[str, Any]:
    """The JSON of `plan --json` and `train --dry-run --json` (one function, one format)."""
    out = plan.to_json()
    if device is not None:
        out["device"] = {"name": device.name, "memory_bytes": device.memory_bytes,
                         "fits": plan.peak_bytes <= device.memory_bytes}
    return out
