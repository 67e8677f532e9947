"""Bytes one rank communicates per optimizer step, by collective kind and by mesh dimension.

Volumes are what a ring algorithm moves through each rank: an all-reduce of S bytes over n
ranks 2 (n-1)/n S, an all-gather or reduce-scatter (n-1)/n S (of the full size S), a pipeline
send the tensor itself.

- data parallel (over dp x cp ranks, which share the parameters), as the trainer runs it: DDP
  all-reduces gradients once per step (no sync during accumulation); ZeRO-1 (partitioned
  optimizer) does the same and then broadcasts each rank's updated parameters (an all-gather's
  bytes); FSDP's
  ZeRO-2 all-gathers weights in forward only (they stay gathered until backward), ZeRO-3 in
  forward and backward, and both reduce-scatter gradients for every micro-batch. The gathers
  move `fsdp_param_dtype` bytes.
- tensor parallel: per layer and micro-batch two all-reduces of the (b s h) activation in
  forward and two in backward; with sequence parallelism each becomes an all-gather plus a
  reduce-scatter, which move the same bytes as the all-reduce (ring all-reduce =
  reduce-scatter + all-gather), and backward all-gathers the attention and MLP inputs once
  more (the projections keep only their sequence shard: `parallel/sp_regather.py`), two more
  all-gathers. Full recomputation repeats the forward ones.
- context parallel (all-gather KV): keys and values gathered in forward, their gradients
  reduce-scattered in backward, per layer and micro-batch.
- pipeline: each micro-batch sends its activation forward and its gradient back, once per
  model chunk (v times when interleaved); tied embeddings add one all-reduce of the
  embedding's gradient between the first and the last stage per step (Megatron's scheme).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain.models.args import ModelArgs
from scaletrain.plan.memory.activations import DTYPE_BYTES

if TYPE_CHECKING:
    from scaletrain.plan.layout import Layout


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def expert_params(args: ModelArgs, layers: int) -> int:
    """Routed-expert parameters of `layers` MoE blocks (0 for a dense model)."""
    if not args.is_moe:
        return 0
    return layers * args.n_experts * 3 * args.dim * args.expert_hidden_dim


def comm_bytes(args: ModelArgs, lay: Layout, stage_params: int, layers: int, w_bytes: float,
               g_bytes: float) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes by collective kind, bytes by mesh dimension) for one rank and one step."""
    dims, m = lay.dims, lay.grad_accum
    c = DTYPE_BYTES[lay.precision]
    kinds = {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0, "send_recv": 0.0,
             "all_to_all": 0.0}
    by_dim = {"dp": 0.0, "tp": 0.0, "cp": 0.0, "pp": 0.0, "ep": 0.0}
    # Gradients travel in the dtype they are kept in (fp32 under the Megatron convention).
    grad_wire = 4.0 if g_bytes == 4.0 else w_bytes
    n = dims.dp * dims.cp
    if n > 1:
        if lay.zero == 0:
            v = {"all_reduce": 2 * _ring(n) * stage_params * grad_wire}
        elif lay.zero == 1 or not lay.fsdp:
            v = {"all_reduce": 2 * _ring(n) * stage_params * grad_wire,
                 "all_gather": _ring(n) * stage_params * w_bytes}
        else:
            gather = DTYPE_BYTES[lay.gather_dtype]
            k = lay.shard_group  # HSDP: gathers inside the shard group only
            # Expert parallelism: a rank gathers only its own experts (1/ep of them) and only
            # over the dp_shard / ep ranks that hold the same ones (with TP, of the 1/tp of
            # the experts `stage_params` counts).
            experts = expert_params(args, layers) / dims.tp
            fsdp_bytes = _ring(k) * (stage_params - experts) \
                + _ring(k // dims.ep) * experts / dims.ep
            # ZeRO-3 gathers each block again in backward unless it stays gathered
            v = {"all_gather": (1 if lay.blocks_stay_gathered else 2) * m * fsdp_bytes * gather,
                 "reduce_scatter": lay.gradient_reductions * fsdp_bytes * grad_wire}
            if dims.dp_replicate > 1:  # HSDP: the shards are all-reduced across replicas
                v["all_reduce"] = lay.replica_all_reduces * 2 * _ring(dims.dp_replicate) \
                    * stage_params / k * grad_wire
        for k, x in v.items():
            kinds[k] += x
            by_dim["dp"] += x
    tokens = lay.mbs * lay.seq_len // dims.cp
    if dims.tp > 1:
        per_collective = _ring(dims.tp) * tokens * args.dim * c
        count = 4 + (2 if lay.recompute == "full" else 0)
        total = layers * m * count * 2 * per_collective  # an all-reduce is 2 x (n-1)/n S
        if lay.sequence_parallel:
            regather = layers * m * 2 * per_collective  # backward: attention and MLP inputs
            kinds["all_gather"] += total / 2 + regather
            kinds["reduce_scatter"] += total / 2
            total += regather
        else:
            kinds["all_reduce"] += total
        by_dim["tp"] += total
    if dims.cp > 1:
        kv = 2 * lay.mbs * lay.seq_len * args.kv_heads // dims.tp * args.head_dim * c
        per_layer = _ring(dims.cp) * kv
        kinds["all_gather"] += layers * m * per_layer
        kinds["reduce_scatter"] += layers * m * per_layer
        by_dim["cp"] += 2 * layers * m * per_layer
    if dims.ep > 1 and args.is_moe:
        # Per MoE layer and micro-batch: dispatch and combine in forward and again in backward
        # (and once more in a recomputed forward), each moving the tokens' k copies of which
        # (ep - 1) / ep go to other ranks under even routing. Composed with TP, a TP rank
        # sends only the pairs of its 1/tp of the experts (`parallel/ep_tp.py`).
        count = 4 + (2 if lay.recompute == "full" else 0)
        x = layers * m * count * _ring(dims.ep) * tokens * args.n_experts_per_token \
            * args.dim * c / dims.tp
        kinds["all_to_all"] += x
        by_dim["ep"] += x
    if dims.pp > 1:
        shard = dims.tp if lay.sequence_parallel else 1
        x = 2 * m * lay.vpp * tokens * args.dim * c / shard
        kinds["send_recv"] += x
        by_dim["pp"] += x
        if args.tie_embeddings:
            # Megatron's tied embeddings under PP: the first and the last stage each hold the
            # embedding (1/tp of it) and all-reduce its gradient between them once per step.
            tied = 2 * _ring(2) * args.vocab_size * args.dim / dims.tp * grad_wire
            kinds["all_reduce"] += tied
            by_dim["pp"] += tied
    return ({k: int(v) for k, v in kinds.items()}, {k: int(v) for k, v in by_dim.items()})
