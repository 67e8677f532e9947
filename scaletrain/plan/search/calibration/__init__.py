"""Published measured training runs (`published_runs.toml`) and the planner's prediction of each.

`load_runs()` reads the table; `predict(run)` builds the run's model and layout and returns the
TFLOP/s per GPU the step-time model of `plan.search` predicts, counted as the source counts
them (model FLOPs, or hardware FLOPs with the recomputed forward).
`tests/plan/search/test_plan_calibration.py` keeps predicted / measured inside `BAND` for every row
and the measured order of the layouts of one group; `bench/plan_calibration.py` prints the table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.models.args import ModelArgs, get_preset
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate
from scaletrain.plan.flops import flops_per_token
from scaletrain.plan.hardware import get_device
from scaletrain.plan.layout import Layout, Plan
from scaletrain.plan.timing.step_time import Cluster, step_time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

TABLE = Path(__file__).with_name("published_runs.toml")
BAND = (0.75, 1.33)
"""predicted / measured stays inside this band for every row (tested)."""
DEEPSPEED_ZERO3_2021 = "deepspeed-zero3-2021"
"""`framework` of the runs measured with DeepSpeed's ZeRO-3 of 2021 (Narayanan et al. 2021,
Table 2): their sharded data-parallel collectives get one NIC per GPU across nodes, whatever
the GPUs per node (fitted: their step time stays constant as the GPUs double at a fixed global
batch, bandwidth-bound at ~21 GB/s per GPU; docs/plan.md). Rows without a `framework` run on
NCCL's rings, as the trainer's FSDP2 does."""
FRAMEWORKS = (DEEPSPEED_ZERO3_2021,)
MEGATRON_DISTOPT = "megatron-distopt"
"""`dp_overlap` of the runs whose ZeRO-1 was Megatron's distributed optimizer with
--overlap-grad-reduce and --overlap-param-gather: `Cluster.distributed_optimizer` (what
Megatron-Core runs, read from its source; not fitted). Rows without it are timed as the
trainer runs ZeRO-1."""
DP_OVERLAPS = (MEGATRON_DISTOPT,)


@dataclass(frozen=True)
class Run:
    """One published measurement with its layout (fields as documented in the TOML)."""

    name: str
    source: str
    model: str | dict[str, Any]
    gpu: str
    gpus: int
    mbs: int
    gbs: int
    flops: str
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    zero: int = 0
    seq_len: int = 2048
    recompute: str = "none"
    every: int = 2
    """recompute "partial": every `every`-th block is recomputed (1 / every of them)."""
    reduce_dtype: str = "fp32"
    """dtype FSDP (zero 2/3) or Megatron's distributed optimizer (`dp_overlap`) reduces
    gradients in: fp32, or bf16 (the run's mixed-precision policy reduces in bf16)."""
    dp_shard: int | None = None
    """HSDP: ranks that shard the model (zero 2/3), replicated over dp / dp_shard groups;
    None: the whole data-parallel group shards (FSDP)."""
    measured_tflops: float | None = None
    measured_tokens_per_s: float | None = None
    gpus_per_node: int = 8
    inter_node_gbs: float | None = None
    memory_gib: float | None = None
    sequence_parallel: bool = False
    group: str | None = None
    assumed: list[str] = field(default_factory=list)
    framework: str | None = None
    tp_comm_overlap: bool = False
    """The run overlapped its tensor-parallel collectives with the GEMMs (Megatron-Core's
    --tp-comm-overlap): `Cluster.tp_comm_overlap`. A property of the run, never of the
    trainer's search."""
    dp_overlap: str | None = None
    """"megatron-distopt": the run's ZeRO-1 was Megatron's distributed optimizer with
    --overlap-grad-reduce --overlap-param-gather (`Cluster.distributed_optimizer`); None: ZeRO-1
    as the trainer runs it. A property of the run, never of the trainer's search."""

    def __post_init__(self) -> None:
        if self.framework is not None and self.framework not in FRAMEWORKS:
            raise ValueError(f"{self.name}: unknown framework '{self.framework}' "
                             f"(known: {', '.join(FRAMEWORKS)})")
        if self.dp_overlap is not None and self.dp_overlap not in DP_OVERLAPS:
            raise ValueError(f"{self.name}: unknown dp_overlap '{self.dp_overlap}' "
                             f"(known: {', '.join(DP_OVERLAPS)})")
        if self.dp_overlap == MEGATRON_DISTOPT and self.zero != 1:
            raise ValueError(f"{self.name}: dp_overlap '{MEGATRON_DISTOPT}' is a ZeRO-1 "
                             f"optimizer (got zero {self.zero})")
        if self.dp_shard is not None and (self.zero < 2 or self.dp % self.dp_shard):
            raise ValueError(f"{self.name}: dp_shard {self.dp_shard} needs zero 2/3 and must "
                             f"divide dp {self.dp}")

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    def model_args(self) -> ModelArgs:
        if isinstance(self.model, str):
            args = get_preset(self.model)
        else:
            fields = dict(self.model)
            if fields.get("arch") == "gpt2":
                fields.setdefault("tie_embeddings", True)
                fields.setdefault("ffn_dim", 4 * fields["dim"])
            args = ModelArgs(**fields)
        return args.replace(max_seq_len=max(args.max_seq_len, self.seq_len))

    def layout(self) -> Layout:
        shard = 1 if self.zero == 0 else (self.dp_shard or self.dp)
        dims = ParallelDims(pp=self.pp, dp_replicate=self.dp // shard, dp_shard=shard,
                            cp=self.cp, tp=self.tp)
        return Layout(dims=dims, mbs=self.mbs, seq_len=self.seq_len, gbs=self.gbs,
                      zero=self.zero, recompute=self.recompute,  # type: ignore[arg-type]
                      every=self.every, fsdp_reduce_dtype=self.reduce_dtype,
                      vpp=self.vpp, schedule="Interleaved1F1B" if self.vpp > 1 else "1F1B",
                      sequence_parallel=self.sequence_parallel, precision="bf16",
                      # the published runs' setup: bf16 weights with fp32 masters
                      param_dtype="bf16", fsdp_param_dtype="bf16")

    def cluster(self) -> Cluster:
        dev = get_device(self.gpu)
        if self.inter_node_gbs is not None:
            dev = dataclasses.replace(dev, inter_node_gbs=self.inter_node_gbs)
        if self.memory_gib is not None:
            dev = dataclasses.replace(dev, memory_gib=self.memory_gib)
        return Cluster(dev, self.gpus, self.gpus_per_node,
                       dp_stripes_nics=self.framework != DEEPSPEED_ZERO3_2021,
                       tp_comm_overlap=self.tp_comm_overlap,
                       distributed_optimizer=self.dp_overlap == MEGATRON_DISTOPT)

    def flops_per_token(self, plan: Plan) -> float:
        return plan.hardware_flops_per_token if self.flops == "hardware" \
            else plan.flops_per_token

    def measured(self) -> float:
        """Measured TFLOP/s per GPU (tokens/s converted with the planner's FLOPs per token)."""
        if self.measured_tflops is not None:
            return self.measured_tflops
        assert self.measured_tokens_per_s is not None
        args = self.model_args()
        per_token = flops_per_token(args, self.seq_len)
        if self.flops == "hardware":
            per_token = estimate(args, self.layout()).hardware_flops_per_token
        return self.measured_tokens_per_s * per_token / 1e12


def load_runs(path: Path = TABLE) -> list[Run]:
    with path.open("rb") as f:
        rows = tomllib.load(f)["run"]
    return [Run(**row) for row in rows]


@dataclass
class Prediction:
    run: Run
    plan: Plan
    step_time_s: float
    times: dict[str, float]
    predicted_tflops: float
    measured_tflops: float

    @property
    def ratio(self) -> float:
        return self.predicted_tflops / self.measured_tflops


def predict(run: Run) -> Prediction:
    """The step-time model's TFLOP/s per GPU for `run`'s published layout."""
    args, lay, cluster = run.model_args(), run.layout(), run.cluster()
    plan = estimate(args, lay)
    tokens = run.gbs * run.seq_len
    t, times = step_time(plan, cluster, tokens)
    tflops = run.flops_per_token(plan) * tokens / (t * run.gpus) / 1e12
    return Prediction(run, plan, t, times, tflops, run.measured())
