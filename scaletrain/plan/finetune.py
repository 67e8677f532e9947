"""A plan for fine-tuning, for `scaletrain plan --method`: the model-state rows of the
pretraining plan recomputed for the parameters a method trains (counts from
`scaletrain.finetune.estimate`, the numbers the fine-tuning trainer reports)."""

from __future__ import annotations

import dataclasses

from scaletrain.plan.estimate import Plan, PlanError, peak_bytes
from scaletrain.plan.memory import offload_states, state_bytes

METHODS = ("pretrain", "full", "freeze", "lora", "qlora")


def finetune_plan(plan: Plan, method: str, *, rank: int = 8, train_last: int | None = None,
                  freeze_first: int = 0, num_labels: int | None = None,
                  targets: tuple[str, ...] | None = None, train_norms: bool = False,
                  freeze_embeddings: bool = True) -> Plan:
    """`plan` (one device, or DDP replicas as the fine-tuning trainer runs them) with the
    weights of every parameter (QLoRA: block linears as 4-bit NF4 with double quantization)
    and gradients, master weights and optimizer state of the trainable ones only, in the
    layout's precision convention; DDP communicates the trainable gradients only.

    Activations keep the full-training estimate: exact for `full`, an upper bound for the
    others (frozen blocks in front of the first trainable one save nothing for backward).
    """
    from scaletrain.finetune.estimate import estimate
    from scaletrain.finetune.lora import TARGETS

    lay = plan.layout
    d = lay.dims
    if d.world_size > 1:
        if d.tp * d.pp * d.cp * d.ep > 1 or lay.zero != 0:
            raise PlanError("fine-tuning runs data parallel with DDP only: plan it with --dp "
                            "and --zero 0, without --tp/--pp/--cp/--ep")
        if method == "qlora":
            raise PlanError("qlora runs on one device (its 4-bit weights are not "
                            "DDP-broadcastable); plan lora for data-parallel fine-tuning")
    per = state_bytes(lay.precision, lay.stored_dtype, lay.optimizer, lay.grad_convention)
    try:
        ft = estimate(plan.args, method, rank=rank, train_last=train_last,
                      freeze_first=freeze_first, num_labels=num_labels,
                      targets=targets or tuple(TARGETS), train_norms=train_norms,
                      freeze_embeddings=freeze_embeddings, weight_bytes=int(per.weights))
    except ValueError as e:
        raise PlanError(str(e)) from None
    states = {"weights": ft.weight_bytes,
              "gradients": int(ft.trainable * per.gradients),
              "master_weights": int(ft.trainable * per.master_weights),
              "optimizer": int(ft.trainable * per.optimizer)}
    offloaded = offload_states(states, lay.offload)
    mem = {k: v for k, v in plan.memory_bytes.items() if k not in ("total", "peak")}
    mem.update(states)
    if method in ("lora", "qlora"):
        mem["cast_weights"] = 0  # autocast caches casts of weights that require grad only
    mem["total"] = sum(mem.values())
    mem["peak"] = peak_bytes(mem, lay.grad_accum)
    info = {"method": method, "trainable": ft.trainable, "total": ft.total,
            "lora_rank": rank if method in ("lora", "qlora") else None,
            "options": {"rank": rank, "train_last": train_last, "freeze_first": freeze_first,
                        "num_labels": num_labels, "targets": targets, "train_norms": train_norms,
                        "freeze_embeddings": freeze_embeddings}}
    # DDP all-reduces the gradients of trainable parameters only
    share = ft.trainable / plan.params_per_rank
    comm = {k: int(v * share) for k, v in plan.comm_bytes_per_step.items()}
    by_dim = {k: int(v * share) for k, v in plan.comm_bytes_by_dim.items()}
    return dataclasses.replace(plan, memory_bytes=mem, params=ft.total, params_per_rank=ft.total,
                               cpu_offload_bytes=offloaded, finetune=info,
                               comm_bytes_per_step=comm, comm_bytes_by_dim=by_dim)


def like(plan: Plan, reference: Plan) -> Plan:
    """`plan` (a pretraining estimate) as the fine-tuning run `reference` describes, or
    unchanged when `reference` is a pretraining plan: the advice re-plans each change this way."""
    if reference.finetune is None:
        return plan
    info = reference.finetune
    return finetune_plan(plan, info["method"], **info["options"])
