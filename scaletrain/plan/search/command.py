"""The `torchrun ... -m scaletrain train ...` line that runs a planned layout.

Every setting that decides the plan is spelled out: model (and its overrides), sequence length,
micro-batch, accumulation, the parallel degrees, the data-parallel mode (ZeRO stage), FSDP's
parameter dtype, the pipeline schedule, recomputation, precision, the parameter dtype and the
optimizer (the last two even where they are the trainer's defaults).
"""

from __future__ import annotations

import shlex

from scaletrain.models.args import ModelArgs
from scaletrain.models.source import load_model_args
from scaletrain.plan.layout import Layout

# The ModelArgs fields `--model.FIELD` can override (scaletrain.config_sections.ModelConfig).
MODEL_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                   "max_seq_len", "tie_embeddings", "rope_theta", "n_experts",
                   "n_experts_per_token", "moe_ffn_dim", "n_shared_experts", "moe_aux_loss_coef",
                   "moe_aux_loss_scope", "moe_bias_update_rate", "moe_capacity_factor",
                   "expert_compute", "dropout")


def _value(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def model_flags(model: str, args: ModelArgs) -> list[str]:
    """`--model.name` plus the overrides that turn the named model into `args`."""
    flags = ["--model.name", model]
    try:
        base = load_model_args(model)
    except (KeyError, ValueError, OSError):
        base = None
    for name in MODEL_OVERRIDES:
        value = getattr(args, name)
        if (base is None or getattr(base, name) != value) and value is not None:
            flags += [f"--model.{name}", _value(value)]
    return flags


def launcher(gpus: int, gpus_per_node: int) -> list[str]:
    """torchrun for one node, or the per-node line of a multi-node job."""
    if gpus <= gpus_per_node:
        return ["torchrun", "--standalone", "--nproc_per_node", str(gpus)]
    nodes = -(-gpus // gpus_per_node)
    return ["torchrun", "--nnodes", str(nodes), "--nproc_per_node", str(gpus_per_node),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", "$MASTER_ADDR:29500"]


def train_flags(model: str, args: ModelArgs, lay: Layout) -> list[str]:
    """The `scaletrain train` arguments that run `lay` (no launcher)."""
    d = lay.dims
    flags = [*model_flags(model, args), "--data.seq_len", str(lay.seq_len),
             "--training.micro_batch_size", str(lay.mbs),
             "--training.grad_accum_steps", str(lay.grad_accum),
             "--precision.dtype", lay.precision]
    if lay.seq_len > args.max_seq_len and "--model.max_seq_len" not in flags:
        flags += ["--model.max_seq_len", str(lay.seq_len)]
    if d.world_size > 1:
        flags += ["--parallel.dp_replicate", str(d.dp_replicate), "--parallel.dp_shard",
                  str(d.dp_shard), "--parallel.tp", str(d.tp), "--parallel.pp", str(d.pp),
                  "--parallel.cp", str(d.cp), "--parallel.data_parallel", lay.data_parallel]
        if d.ep > 1:
            flags += ["--parallel.ep", str(d.ep)]
        if lay.fsdp:
            flags += ["--parallel.fsdp_param_dtype", lay.fsdp_param_dtype]
            if lay.fsdp_reduce_dtype != "fp32":
                flags += ["--parallel.fsdp_reduce_dtype", lay.fsdp_reduce_dtype]
        if lay.cpu_offload:
            flags += ["--parallel.cpu_offload", "true"]
        if d.tp > 1:
            flags += ["--parallel.sequence_parallel", _value(lay.sequence_parallel)]
        if d.pp > 1:
            flags += ["--parallel.pp_schedule", lay.schedule,
                      "--parallel.pp_virtual_stages", str(lay.vpp)]
            if lay.pp_microbatches is not None:
                flags += ["--parallel.pp_microbatches", str(lay.pp_microbatches)]
    elif lay.offload:
        flags += ["--optimizer.offload", "true"]
    # Always spelled out, whatever the trainer's defaults: they decide the planned bytes per
    # parameter (16-bit parameters with fp32 masters, or autocast over fp32 parameters).
    flags += ["--precision.param_dtype", lay.stored_dtype, "--optimizer.name", lay.optimizer]
    if lay.fused_loss:
        flags += ["--training.fused_loss", "true", "--training.loss_chunk_tokens",
                  str(lay.loss_chunk)]
    flags += ["--activation_checkpoint.mode", lay.recompute]
    if lay.recompute == "partial":
        flags += ["--activation_checkpoint.every", str(lay.every),
                  "--activation_checkpoint.scope", lay.scope]
    return flags


def train_command(model: str, args: ModelArgs, lay: Layout, gpus: int,
                  gpus_per_node: int = 8) -> str:
    """The whole command line, shell-quoted."""
    parts = [*launcher(gpus, gpus_per_node), "-m", "scaletrain", "train",
             *train_flags(model, args, lay)]
    return " ".join(p if p.startswith("$") or ":29500" in p else shlex.quote(p) for p in parts)

