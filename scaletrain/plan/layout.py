"""The planner's two types: a `Layout` (everything besides the model that decides one training
step's memory and time) with the checks of it, and its `Plan` (the estimate of the most loaded
rank, made by `plan.estimate`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from scaletrain.config_sections import ParallelConfig, PrecisionConfig, TrainingConfig
from scaletrain.models.args import ModelArgs, count_active_params
from scaletrain.parallel.dims import ParallelDims, ParallelDimsError
from scaletrain.parallel.feasibility import (
    RunLayout,
    mode_for_zero,
    pipeline_microbatches_problem,
    reshards_after_forward,
    runs_torch_ddp,
)
from scaletrain.parallel.feasibility import layout_problems as run_problems
from scaletrain.plan.memory.activations import (
    DTYPE_BYTES,
)
from scaletrain.plan.memory.host import (
    HostProcess,
)
from scaletrain.plan.memory.states import (
    GradConvention,
)

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
    data loader's batches count too (`plan/memory/host.py`)."""

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
        (`tests/plan/memory/distributed/test_pp_fsdp_memory.py` measures both)."""
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


def check_dims(world_size: int, **degrees: int) -> ParallelDims:
    """`ParallelDims.resolve` with its error turned into a PlanError."""
    try:
        return ParallelDims.resolve(world_size, **degrees)
    except ParallelDimsError as e:
        raise PlanError(str(e)) from None
