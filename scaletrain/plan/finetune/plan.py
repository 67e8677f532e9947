"""A plan for fine-tuning, for `scaletrain plan --method`: the model-state rows of the
pretraining plan recomputed for the parameters a method trains (counts from
`scaletrain.plan.finetune.estimate`, the numbers the fine-tuning trainer reports)."""

from __future__ import annotations

import dataclasses
from typing import Any

from scaletrain.models.args import ModelArgs
from scaletrain.plan.estimate import peak_bytes
from scaletrain.plan.finetune.flops import finetune_flops_per_token
from scaletrain.plan.finetune.host import host_load_bytes
from scaletrain.plan.layout import Layout, Plan, PlanError
from scaletrain.plan.memory.states import offload_states, state_bytes

METHODS = ("pretrain", "full", "freeze", "lora", "qlora")


FUSED_LOSS_CLASSIFICATION = (
    "training.fused_loss chunks the language-model head and loss; a classification head has "
    "no vocabulary logits: set training.fused_loss false with --task classification "
    "(plan: drop --fused-loss)")


def finetune_layout_problem(method: str, *, tp: int, pp: int, cp: int, ep: int,
                            data_parallel: str, classification: bool = False) -> str | None:
    """Why fine-tuning cannot run in this layout, or None: the one answer of the trainer,
    `finetune --dry-run` and `plan --method`. Fine-tuning runs DDP or FSDP (ZeRO-2/3) over
    the data-parallel ranks, composed with tensor parallelism for `full`, `freeze` and `lora`."""
    if pp > 1 or cp > 1 or ep > 1:
        return ("fine-tuning runs data parallel (DDP, FSDP ZeRO-2/3) and tensor parallel only: "
                "pipeline, context and expert parallel fine-tuning are not implemented; drop "
                "parallel.pp/cp/ep (plan: --pp/--cp/--ep)")
    if data_parallel not in ("ddp", "zero2", "zero3"):
        return ("fine-tuning's data parallelism is DDP or FSDP: set parallel.data_parallel "
                "ddp, zero2 or zero3 (plan: --zero 0, 2 or 3)")
    if tp > 1 and method == "qlora":
        return ("--method qlora shards its 4-bit base with FSDP (parallel.data_parallel "
                "zero2/zero3), not tensor parallel: drop parallel.tp, or use --method lora")
    if tp > 1 and classification:
        return ("classification under tensor parallelism is not implemented: drop parallel.tp "
                "(FSDP shards the base as well), or fine-tune with --task sft")
    return None


def finetune_plan(plan: Plan, method: str, *, rank: int = 8, train_last: int | None = None,
                  freeze_first: int = 0, num_labels: int | None = None,
                  targets: tuple[str, ...] | None = None, train_norms: bool = False,
                  freeze_embeddings: bool = True, lora_dropout: float = 0.0) -> Plan:
    """`plan` (one device, DDP replicas or FSDP shards as the fine-tuning trainer runs them)
    with the weights of every parameter (QLoRA: block linears as 4-bit NF4 with double
    quantization) and gradients, master weights and optimizer state of the trainable ones
    only, in the layout's precision convention (FSDP: all of them sharded); DDP and FSDP
    reduce the trainable gradients only, FSDP gathers every weight.

    Activations, kept weight casts and the logits/loss buffers are what the method keeps
    for backward (`plan.finetune.activations`, equal to the measured saved bytes): frozen
    blocks in front of the first trainable one keep nothing, frozen linears keep no input,
    adapters keep their r-wide intermediate, a classification head keeps (batch x labels)
    logits instead of (tokens x vocabulary). `full` language modelling is pretraining's
    estimate. Models outside `finetune_activations.supported` (MoE, Qwen3, Gemma 2, GPT-2)
    keep the pretraining activations, an upper bound.
    """
    from scaletrain.models.args import count_params
    from scaletrain.models.linears import BLOCK_LINEARS as TARGETS
    from scaletrain.plan.finetune.estimate import estimate, lora_params_per_rank

    lay = plan.layout
    d = lay.dims
    if d.world_size > 1:
        problem = finetune_layout_problem(
            method, tp=d.tp, pp=d.pp, cp=d.cp, ep=d.ep,
            data_parallel="zero1" if lay.zero == 1 else "ddp" if not lay.fsdp else "zero3",
            classification=num_labels is not None)
        if problem:
            raise PlanError(problem)
    if lay.fused_loss and num_labels is not None:
        raise PlanError(FUSED_LOSS_CLASSIFICATION)
    per = state_bytes(lay.precision, lay.stored_dtype, lay.optimizer, lay.grad_convention)
    # 16-bit parameters: frozen weights are stored in 16 bits in every layout (no master:
    # `finetune/frozen_dtype.py`). FSDP keeps fp32 shards of the trainable ones and gathers
    # every weight in 16 bits (`Parallelism.fsdp_param_dtype`): those shards are the master
    # weights, as in pre-training; elsewhere trainable weights are 16-bit with fp32 masters.
    fsdp16 = lay.fsdp and lay.stored_dtype != "fp32"
    try:
        ft = estimate(plan.args, method, rank=rank, train_last=train_last,
                      freeze_first=freeze_first, num_labels=num_labels,
                      targets=targets or tuple(TARGETS), train_norms=train_norms,
                      freeze_embeddings=freeze_embeddings,
                      weight_bytes=int(per.weights))
    except ValueError as e:
        raise PlanError(str(e)) from None
    # Tensor parallelism splits the weights as in pre-training (the embedding, head and block
    # projections; norms whole) and LoRA adapters with their base (`finetune/lora_tp.py`);
    # FSDP (ZeRO-2/3) then shards every weight, frozen ones too, and the trainable states.
    tp_share = plan.params_per_rank / count_params(plan.args).total
    trainable = ft.trainable
    if d.tp > 1:
        trainable = int(ft.trainable * tp_share)
        if method in ("lora", "qlora"):
            trainable = lora_params_per_rank(plan.args, rank, targets or tuple(TARGETS), d.tp)
            trainable += ft.trainable - lora_params_per_rank(plan.args, rank,
                                                             targets or tuple(TARGETS), 1)
    shard = lay.shard_group if lay.fsdp else 1
    weight_bytes = int(ft.weight_bytes * tp_share)
    if fsdp16:  # the trainable fp32 shards count as master weights, not as weights
        weight_bytes = max(weight_bytes - int(trainable * per.weights), 0)
    states = {"weights": weight_bytes // shard,
              "gradients": int(trainable * per.gradients / shard),
              "master_weights": int(trainable * (4 if fsdp16 else per.master_weights) / shard),
              "optimizer": int(trainable * per.optimizer / shard)}
    offloaded = offload_states(states, lay.offload)
    if lay.cpu_offload and lay.fsdp:  # FSDP's offload: every sharded state to the host
        offloaded += sum(states.values())
        states = dict.fromkeys(states, 0)
    mem = {k: v for k, v in plan.memory_bytes.items() if k not in ("total", "peak")}
    mem.update(states)
    if lay.fsdp and method in ("lora", "qlora"):
        mem["comm_buffers"] = int(mem["comm_buffers"] * _adapted_block_share(
            plan.args, method, rank, targets or tuple(TARGETS), lay.gather_dtype))
    options = {"rank": rank, "train_last": train_last, "freeze_first": freeze_first,
               "num_labels": num_labels, "targets": targets, "train_norms": train_norms,
               "freeze_embeddings": freeze_embeddings, "lora_dropout": lora_dropout}
    breakdown, own_activations = _activations(plan, method, options, mem)
    mem["total"] = sum(mem.values())
    mem["peak"] = peak_bytes(mem, lay.grad_accum, grads_resident=lay.ddp_wrapped,
                             comm_at_step_only=not lay.fsdp)
    info = {"method": method, "trainable": ft.trainable, "total": ft.total,
            "lora_rank": rank if method in ("lora", "qlora") else None,
            "options": options,
            # whether the activations are the method's own (`finetune_activations`) or
            # pre-training's (full fine-tuning's, an upper bound for frozen parts)
            "method_activations": own_activations,
            # TP ranks read their shards too (the replicated norms, KiB, counted as split);
            # QLoRA quantizes while it reads
            "host_load_bytes": host_load_bytes(plan.args, method, shard * d.tp,
                                               param_bytes=_sharded_base_bytes(method, lay))}
    # DDP all-reduces and FSDP reduce-scatters the gradients of trainable parameters only;
    # FSDP all-gathers every weight.
    share = trainable / plan.params_per_rank
    comm = {k: int(v if k == "all_gather" else v * share)
            for k, v in plan.comm_bytes_per_step.items()}
    ratio = sum(comm.values()) / max(sum(plan.comm_bytes_per_step.values()), 1)
    by_dim = {k: int(v * ratio) for k, v in plan.comm_bytes_by_dim.items()}
    flops = finetune_flops_per_token(plan.args, lay.seq_len, method, rank=rank,
                                     targets=targets, train_last=train_last,
                                     freeze_first=freeze_first,
                                     freeze_embeddings=freeze_embeddings,
                                     train_norms=train_norms, num_labels=num_labels)
    recompute = plan.hardware_flops_per_token - plan.flops_per_token
    return dataclasses.replace(plan, memory_bytes=mem, params=ft.total,
                               params_per_rank=int(ft.total * tp_share),
                               flops_per_token=flops, hardware_flops_per_token=flops + recompute,
                               cpu_offload_bytes=offloaded, finetune=info,
                               activation_breakdown=breakdown,
                               comm_bytes_per_step=comm, comm_bytes_by_dim=by_dim)


def _sharded_base_bytes(method: str, lay: Layout) -> int:
    """Bytes per element of the base a sharded load keeps on each rank: 2 for LoRA with
    16-bit parameters (its base is frozen, stored in bf16: `finetune/frozen_dtype.py`),
    else fp32 (trainable parameters; `freeze`'s frozen parts counted at 4, an upper bound)."""
    return 2 if method == "lora" and lay.stored_dtype != "fp32" else 4


def _adapted_block_share(args: ModelArgs, method: str, rank: int,
                         targets: tuple[str, ...], gather_dtype: str) -> float:
    """FSDP's block buffers of a LoRA/QLoRA run over pre-training's (`estimate`: the block
    being computed, the prefetched one, and one block's unsharded gradients, 3 blocks in the
    gather dtype): the two gathered blocks hold the base (QLoRA: its block linears as 4-bit
    codes and 8-bit absmax, as `finetune_estimate` counts them) plus the adapters, and only
    the adapters have gradients."""
    from scaletrain.models.args import count_params
    from scaletrain.plan.finetune.estimate import (
        NF4_BLOCK_SIZE,
        _linear_shapes,
        lora_params_per_rank,
    )
    from scaletrain.plan.memory.activations import DTYPE_BYTES

    pc = count_params(args)
    final_norm = 2 * args.dim if args.arch == "gpt2" else args.dim
    block = (pc.attention + pc.mlp + pc.norms - final_norm) / args.n_layers
    lora = lora_params_per_rank(args, rank, targets, 1) / args.n_layers
    base = block
    if method == "qlora":  # in gathered elements: an NF4 code is half a byte
        linear = sum(i * o for i, o in _linear_shapes(args).values())
        nf4_bytes = linear / 2 + linear / NF4_BLOCK_SIZE
        base = block - linear + nf4_bytes / DTYPE_BYTES[gather_dtype]
    return (2 * (base + lora) + lora) / (3 * block)


def _activations(plan: Plan, method: str, options: dict[str, Any],
                 mem: dict[str, int]) -> tuple[dict[str, int], bool]:
    """Set `mem`'s activations, cast_weights and logits_loss for the method (see
    `finetune_plan`); returns the activation breakdown and whether it is the method's own
    (False: pre-training's)."""
    from scaletrain.models.linears import BLOCK_LINEARS as TARGETS
    from scaletrain.plan.estimate import _spec
    from scaletrain.plan.finetune.activations import (
        finetune_activation_bytes,
        kept_weight_casts,
        method_blocks,
        supported,
    )
    from scaletrain.plan.memory.activations import DTYPE_BYTES

    args, lay = plan.args, plan.layout
    spec = _spec(args, lay)
    labels = options["num_labels"]
    if labels is not None:  # the (batch, labels) logits and two fp32 gradient buffers
        mem["logits_loss"] = (DTYPE_BYTES[spec.compute_dtype] + 8) * spec.mbs * labels
    if (method == "full" and labels is None) or not supported(args, spec):
        if method in ("lora", "qlora"):
            mem["cast_weights"] = 0  # (the fused base layers keep no casts)
        return plan.activation_breakdown, method == "full" and labels is None
    kw = method_blocks(args, method, train_last=options["train_last"],
                       freeze_first=options["freeze_first"],
                       targets=tuple(options["targets"] or TARGETS),
                       train_norms=options["train_norms"],
                       freeze_embeddings=options["freeze_embeddings"], num_labels=labels,
                       lora_dropout=options["lora_dropout"] if method in ("lora", "qlora")
                       else 0.0)
    kw.update(num_labels=labels, rank=options["rank"])
    act = finetune_activation_bytes(args, spec, **kw)
    mem["activations"] = act.saved + act.recompute
    mem["cast_weights"] = kept_weight_casts(args, spec, **kw)
    return {**act.layers, "embedding": act.embedding, "rope_tables": act.rope_tables,
            "head": act.head, "loss": act.loss, "recompute": act.recompute}, True


def like(plan: Plan, reference: Plan) -> Plan:
    """`plan` (a pretraining estimate) as the fine-tuning run `reference` describes, or
    unchanged when `reference` is a pretraining plan: the advice re-plans each change this way."""
    if reference.finetune is None:
        return plan
    info = reference.finetune
    return finetune_plan(plan, info["method"], **info["options"])
