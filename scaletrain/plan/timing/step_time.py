"""Step time of a planned layout on a cluster: compute at the device's attainable matmul and
attention rates (`compute_time`), plus the tensor, context, expert and pipeline communication
that is exposed, times (1 + bubble), plus the data-parallel communication not hidden behind
compute (`step_time`); collectives by the alpha-beta model of `plan.timing.collectives`.
Calibrated against published measured runs: `plan/search/calibration/`, docs/plan.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.plan.flops import attention_forward_flops
from scaletrain.plan.hardware import Device
from scaletrain.plan.layout import DDP_BUCKET_BYTES, Layout, Plan, PlanError
from scaletrain.plan.memory.activations import DTYPE_BYTES
from scaletrain.plan.memory.states import StageParams, stage_params
from scaletrain.plan.timing.collectives import Fabric, per_node


@dataclass(frozen=True)
class Cluster:
    device: Device
    gpus: int
    gpus_per_node: int = 8
    headroom: float = 0.08
    """Share of device memory kept free for the CUDA context, NCCL and fragmentation."""
    efficiency: float | None = None
    """Fraction of peak a large matmul reaches; None: the device's `gemm_efficiency`."""
    dp_stripes_nics: bool = True
    """Data-parallel collectives across nodes get the NICs of the group's GPUs in a node
    (NCCL, what the trainer's FSDP2 and DDP run); False: one NIC per rank, as DeepSpeed's 2021
    ZeRO-3 measured (`plan/search/calibration/`, docs/plan.md)."""
    tp_comm_overlap: bool = False
    """Tensor-parallel collectives run beside the GEMMs that consume or produce them, paying
    only the contention cost (Megatron-Core's --tp-comm-overlap, Transformer Engine
    userbuffers: a property of published runs, `plan/search/calibration/`). The trainer does not
    overlap them: False for every search."""
    distributed_optimizer: bool = False
    """ZeRO-1 timed as Megatron's distributed optimizer with --overlap-grad-reduce and
    --overlap-param-gather (`_distopt_exposed`): bucketed reduce-scatter behind the last
    micro-batch's backward, bucketed all-gather of the updated weights behind the next step's
    first forward. A property of published runs (`plan/search/calibration/`); the trainer's ZeRO-1
    all-reduces and broadcasts (`train/zero1.py`): False for every search."""

    @property
    def usable_bytes(self) -> float:
        return self.device.memory_bytes * (1 - self.headroom)


TOKENS_HALF = 32
"""Tokens per micro-batch (on a rank) at which matmuls reach half their attainable rate."""
ELEMENTWISE_DIM = 1536
"""Memory-bound work per layer (norms, activations, residuals, RoPE, dropout) grows with the
width h, matmul work with h^2: their ratio is ELEMENTWISE_DIM / h. Fitted, with the devices'
`gemm_efficiency` and CONTENTION, to the calibration table (a grid search minimizing the
largest |log(predicted / measured)| with every group's measured order kept)."""


def attention_hardware_flops(plan: Plan) -> float:
    """Attention-core FLOPs per token (scores and values): forward, backward (2x), and the
    recomputed forward of the layers recomputation re-runs."""
    lay, args = plan.layout, plan.args
    fwd = attention_forward_flops(args, lay.seq_len)
    if lay.recompute == "full":
        again = 1.0
    elif lay.recompute == "partial":
        again = sum(1 for i in range(args.n_layers) if i % lay.every == lay.every - 1) \
            / args.n_layers
    else:
        again = 0.0
    return fwd * (3 + again)


def compute_time(plan: Plan, cluster: Cluster, gbs_tokens: int) -> float:
    """Seconds of arithmetic per step on one GPU: matmuls at the device's attainable fraction
    of peak, lowered for few tokens per micro-batch and for the memory-bound work around them
    (relatively more in narrow models); the attention core at the device's attention efficiency."""
    lay, args = plan.layout, plan.args
    d = lay.dims
    peak = cluster.device.peak_tflops.get(lay.precision)
    if not peak:
        raise PlanError(f"no peak FLOP/s for {cluster.device.name} in {lay.precision}")
    tokens_mb = lay.mbs * lay.seq_len / d.cp
    gemm_eff = (cluster.efficiency or cluster.device.gemm_efficiency) \
        * tokens_mb / (tokens_mb + TOKENS_HALF) / (1 + ELEMENTWISE_DIM / args.dim)
    attn = attention_hardware_flops(plan)
    gemm = plan.hardware_flops_per_token - attn
    per_gpu = gbs_tokens / cluster.gpus
    return per_gpu * (gemm / gemm_eff + attn / cluster.device.attention_efficiency) \
        / (peak * 1e12)


def step_time(plan: Plan, cluster: Cluster, gbs_tokens: int) -> tuple[float, dict[str, float]]:
    """Estimated seconds per optimizer step and its parts.

    Communication uses the alpha-beta model of `plan.timing.collectives` (ring or tree, NVLink
    inside a node, across nodes the NICs of the group's GPUs in each node). Tensor, context, expert
    and pipeline communication is on the critical path (the trainer does not overlap it;
    `Cluster.tp_comm_overlap` hides TP's for published runs that did).
    Data-parallel communication: `_dp_exposed` (FSDP per block with a prefetch depth of one,
    DDP behind the last backward, and the contention cost of what hides).
    """
    lay, args = plan.layout, plan.args
    d = lay.dims
    gpn = cluster.gpus_per_node
    fabric = Fabric(cluster.device, gpn)
    m = lay.grad_accum
    tokens_mb = lay.mbs * lay.seq_len / d.cp
    compute = compute_time(plan, cluster, gbs_tokens)
    sp = stage_params(args, d.pp, d.tp, plan.stage, lay.vpp, lay.schedule)
    layers = max(1, sp.layers)
    c = DTYPE_BYTES[lay.precision]
    # Tensor parallel: per layer and micro-batch 4 all-reduce-equivalents (6 with full
    # recomputation) of the (b s h) activation; under SP each is an all-gather + reduce-scatter,
    # plus the backward re-gathers of the attention and MLP inputs (as `plan/timing/comm.py`
    # counts).
    tp = 0.0
    if d.tp > 1:
        act = tokens_mb * args.dim * c
        k = per_node(1, d.tp, gpn)
        count = 4 + (2 if lay.recompute == "full" else 0)
        if lay.sequence_parallel:
            gather = fabric.time("all_gather", act, d.tp, k)
            tp = layers * m * (count * (gather + fabric.time("reduce_scatter", act, d.tp, k))
                               + 2 * gather)
        else:
            tp = layers * m * count * fabric.time("all_reduce", act, d.tp, k)
        if cluster.tp_comm_overlap:  # hidden behind the GEMMs around them (tp < compute)
            tp = _overlap(tp, compute)
    cp = 0.0
    if d.cp > 1:
        kv = 2 * lay.mbs * lay.seq_len * (args.kv_heads // d.tp) * args.head_dim * c
        k = per_node(d.tp, d.cp, gpn)
        cp = layers * m * (fabric.time("all_gather", kv, d.cp, k)
                           + fabric.time("reduce_scatter", kv, d.cp, k))
    ep = 0.0
    if d.ep > 1 and args.is_moe:
        # Expert parallel: per MoE layer and micro-batch, dispatch + combine in forward and
        # backward (and a recomputed forward), not overlapped. An all-to-all of the routed
        # tokens moves (ep - 1) / ep of them per rank, like an all-gather of the same bytes;
        # composed with TP, each TP rank sends the pairs of its 1/tp of the experts.
        routed = tokens_mb * args.n_experts_per_token * args.dim * c / d.tp
        k = per_node(d.tp * d.cp, d.ep, gpn)
        ep = layers * m * (4 + (2 if lay.recompute == "full" else 0)) \
            * fabric.time("all_gather", routed, d.ep, k)
    pp = 0.0
    if d.pp > 1:
        act = tokens_mb * args.dim * c / (d.tp if lay.sequence_parallel else 1)
        across = d.tp * d.cp * d.dp >= gpn
        pp = 2 * m * lay.vpp * fabric.p2p(act, across)
        if args.tie_embeddings:  # the embedding's gradient: first <-> last stage, exposed
            tied = 4.0 * args.vocab_size * args.dim / d.tp
            pp += fabric.time("all_reduce", tied, 2, 1 if across or d.pp > gpn else 2)
    dp = dp_comm_exposed(plan, cluster, compute, sp)
    busy = compute + tp + cp + ep + pp
    bubble = busy * plan.bubble_fraction
    times = {"compute": compute, "tp_comm": tp, "cp_comm": cp, "ep_comm": ep, "pp_comm": pp,
             "bubble": bubble, "dp_comm_exposed": dp}
    return busy + bubble + dp, times


def dp_comm_exposed(plan: Plan, cluster: Cluster, compute: float, sp: StageParams) -> float:
    """Seconds of data-parallel communication per step not hidden behind `compute` (the
    step's compute seconds) for the parameters `sp` of the plan's stage (`_dp_exposed`)."""
    fabric = Fabric(cluster.device, cluster.gpus_per_node, stripe_nics=cluster.dp_stripes_nics)
    return _dp_exposed(plan, fabric, compute, max(1, sp.layers), sp.total,
                       distributed_optimizer=cluster.distributed_optimizer)


CONTENTION = 0.1
"""Compute slowed by communication it hides: NCCL kernels running beside compute kernels take
SMs and memory bandwidth from them, so each hidden second of data-parallel communication costs
CONTENTION seconds of compute (fitted to the calibration table: ZeRO-3 at 384 A100s measured
slower than Megatron's TP x PP although its traffic hides behind compute)."""


def _overlap(comm: float, window: float) -> float:
    """Seconds a collective of `comm` seconds adds when `window` seconds of compute run beside
    it: what sticks out, plus the contention cost of the part hidden."""
    return max(0.0, comm - window) + CONTENTION * min(comm, window)


MEGATRON_BUCKET_PARAMS = 40_000_000
"""Megatron-Core's default data-parallel bucket: max(40M, 1M x dp) parameters
(`megatron/core/distributed/distributed_data_parallel.py`)."""


def _distopt_exposed(lay: Layout, fabric: Fabric, compute: float, params: int, n: int,
                     k: int) -> float:
    """Seconds of ZeRO-1 traffic per step that compute does not hide, for Megatron's
    distributed optimizer with --overlap-grad-reduce and --overlap-param-gather (what the
    Megatron-LM rows of the calibration table ran; the trainer does not).

    Gradients are reduce-scattered bucket by bucket as the last micro-batch's backward makes
    each bucket ready (`megatron/core/distributed/param_and_grad_buffer.py`; earlier
    micro-batches do not sync), in the gradient reduce dtype (`fsdp_reduce_dtype`: fp32, which
    Megatron's `arguments.py` forces for bf16); the last bucket's only starts when the backward
    ends. After the step each rank all-gathers the updated parameters in their dtype (bf16),
    the first bucket dispatched at once and each next one when the forward reaches the bucket
    before it (`megatron/core/optimizer/distrib_optimizer.py`): the first bucket is exposed,
    the rest run beside the first micro-batch's forward. Each hidden part pays the contention
    cost (`_overlap`). Buckets of `MEGATRON_BUCKET_PARAMS` (stage 0's bucketing: Megatron
    gives later pipeline stages one bucket, their traffic being off the critical path)."""
    m = lay.grad_accum
    buckets = max(1, math.ceil(params / max(MEGATRON_BUCKET_PARAMS, 1_000_000 * n)))
    rs = fabric.time("reduce_scatter", DTYPE_BYTES[lay.fsdp_reduce_dtype] * params / buckets,
                     n, k)
    ag = fabric.time("all_gather", DTYPE_BYTES[lay.stored_dtype] * params / buckets, n, k)
    backward = 2 / 3 * compute / m  # the last micro-batch's backward
    forward = compute / (3 * m)  # the next step's first micro-batch's forward
    return (rs + _overlap((buckets - 1) * rs, backward)
            + ag + _overlap((buckets - 1) * ag, forward))


def _dp_exposed(plan: Plan, fabric: Fabric, compute: float, layers: int,
                params: int, distributed_optimizer: bool = False) -> float:
    """Seconds of data-parallel communication per step that compute does not hide.

    FSDP2 (`parallel/fsdp.py`, one unit per block) prefetches one block ahead: in forward the
    all-gather of block i+1 runs during block i's forward; in backward the all-gather of the
    next block and the reduce-scatter of the previous one run during a block's backward (and
    its recomputed forward). Each block's exposed time is what its own compute cannot cover;
    the first gather and the last reduce-scatter are never covered; HSDP's all-reduce across
    the replicas runs in the last micro-batch only. Under pipeline parallelism torch's schedule
    reduces each stage's gradients once per schedule run (`Layout.pipeline_runs`: one by
    default), after the stage's last backward of the run, exposed.
    DDP's bucketed all-reduce runs during the last micro-batch's backward (no sync before it),
    but for its last bucket; where the trainer does not run torch's DDP (TP, PP or 16-bit
    parameters: `Layout.ddp_wrapped`) the replicas' gradients are summed after the backward,
    exposed. ZeRO-1's gather of the updated weights (`train/zero1.py`: each owner broadcasts
    them in the parameters' dtype, bf16 with 16-bit parameters) runs after the optimizer step,
    exposed. `distributed_optimizer`: ZeRO-1 as Megatron's distributed optimizer runs it
    (`_distopt_exposed`).
    """
    lay = plan.layout
    d = lay.dims
    gpn = fabric.gpus_per_node
    m = lay.grad_accum
    grad_wire = 4.0  # fp32 gradients (autocast over fp32 parameters; FSDP's reduce dtype)
    if lay.fsdp:
        grad_wire = DTYPE_BYTES[lay.fsdp_reduce_dtype]
        n = lay.shard_group
        k = per_node(d.tp, n, gpn)
        gather = DTYPE_BYTES[lay.fsdp_param_dtype] * params / layers
        ag = fabric.time("all_gather", gather, n, k)
        rs = fabric.time("reduce_scatter", grad_wire * params / layers, n, k)
        fwd = compute / (3 * m * layers)  # one block's forward of one micro-batch
        bwd = compute / (m * layers) - fwd  # its backward (and recomputed forward)
        ar = 0.0
        if d.dp_replicate > 1:  # HSDP: each block's shard all-reduced across the replicas
            kr = per_node(d.tp * n, d.dp_replicate, gpn)
            ar = fabric.time("all_reduce", grad_wire * params / (n * layers), d.dp_replicate, kr)
        backward_ag = ag if not lay.blocks_stay_gathered else 0.0  # ZeRO-3 gathers again
        if d.pp > 1:
            # torch's pipeline schedules keep the gradients unsharded over the micro-batches
            # and reduce each stage's once, after its last backward (`perform_reduce_grad`):
            # the gathers as without PP, the reduce-scatter (and HSDP's all-reduce) exposed
            per_mb = layers * (_overlap(ag, fwd) + _overlap(backward_ag, bwd)) + ag
            return m * per_mb + layers * (lay.gradient_reductions * rs
                                          + lay.replica_all_reduces * ar)

        def micro_batch(ar: float) -> float:
            # a block's reduce-scatter (and HSDP's all-reduce after it) runs during the
            # backward of the block before it, on the same stream
            return (layers * (_overlap(ag, fwd) + _overlap(backward_ag + rs + ar, bwd))
                    + ag + rs + ar)

        # HSDP all-reduces in the last micro-batch only (`Parallelism.micro_batch_sync`)
        return (m - 1) * micro_batch(0.0) + micro_batch(ar)
    n = d.dp * d.cp
    if n <= 1:
        return 0.0
    k = per_node(d.tp, n, gpn)
    if lay.zero == 1 and distributed_optimizer:
        return _distopt_exposed(lay, fabric, compute, params, n, k)
    buckets = max(1, math.ceil(grad_wire * params / DDP_BUCKET_BYTES))
    one = fabric.time("all_reduce", grad_wire * params / buckets, n, k)
    if lay.ddp_wrapped:
        # DDP's hooks: every bucket but the last during the last micro-batch's backward (no
        # sync before it); the last bucket is ready when the backward ends
        backward = 2 / 3 * compute / m
        exposed = _overlap((buckets - 1) * one, backward) + one
    else:  # the replicas' sum after the backward (`Parallelism.sync_gradients`)
        exposed = buckets * one
    if lay.zero == 1:  # each owner broadcasts its updated parameters, in their stored dtype
        exposed += fabric.time("all_gather", DTYPE_BYTES[lay.stored_dtype] * params, n, k)
    return exposed
