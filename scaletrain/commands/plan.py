"""`scaletrain plan ...` (estimate one layout) and `scaletrain plan search ...` (find layouts)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from scaletrain.commands._plan_args import (
    add_common_args,
    fill_train_defaults,
    finetune_defaults,
    parse_device,
    parse_model,
    positive_int,
    resolve_kernels,
    resolve_precision,
    train_defaults,
)
from scaletrain.config import resolve_batch
from scaletrain.parallel.feasibility import ZERO_STAGE, resolve_mode
from scaletrain.plan.estimate import estimate
from scaletrain.plan.finetune.plan import METHODS, finetune_plan
from scaletrain.plan.from_config import host_process
from scaletrain.plan.layout import Layout, PlanError, check_dims
from scaletrain.plan.text import plan_report

if TYPE_CHECKING:
    from scaletrain.config import Config
    from scaletrain.plan.hardware import Device


def _estimate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="scaletrain plan", description="Memory, FLOPs and "
                                "communication of one model + layout, for the most loaded rank.")
    add_common_args(p)
    p.add_argument("--mbs", type=positive_int, default=None,
                   help="micro-batch (sequences; default: train's training.micro_batch_size)")
    p.add_argument("--gbs", type=positive_int, default=None, help="global batch (sequences)")
    for name, what in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline"),
                       ("cp", "context")):
        p.add_argument(f"--{name}", type=positive_int, default=1, help=f"{what}-parallel degree")
    p.add_argument("--ep", type=positive_int, default=1,
                   help="expert-parallel degree (MoE; borrowed from the data-parallel shards)")
    p.add_argument("--vpp", type=positive_int, default=1, help="model chunks per pipeline rank")
    p.add_argument("--pp-microbatches", type=positive_int, default=None,
                   help="micro-batches per run of the pipeline schedule (a divisor of the "
                        "accumulation steps; default: all of a step's in one run)")
    # Every default below is `scaletrain train`'s (its config, read in `_layout`), so a plan
    # with only the layout given is what `train` runs on it: `None` means "the trainer's".
    on_off = argparse.BooleanOptionalAction
    p.add_argument("--sequence-parallel", action=on_off, default=None,
                   help="tensor parallel: shard norms and residuals along the sequence "
                        "(default: train's parallel.sequence_parallel)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                   help="ZeRO stage (default: what train's parallel.data_parallel auto runs: "
                        "3 when sharding or with TP/PP, else 0)")
    p.add_argument("--recompute", choices=["none", "partial", "full"], default=None,
                   help="partial: every n-th block (--every), or its attention (--scope); "
                        "default train's activation_checkpoint.mode")
    p.add_argument("--every", type=positive_int, default=None, help="partial: every n-th block")
    p.add_argument("--scope", choices=["block", "attention"], default=None)
    p.add_argument("--fused-loss", action=on_off, default=None,
                   help="head + cross-entropy chunk by chunk, no logits (training.fused_loss)")
    p.add_argument("--loss-chunk", type=positive_int, default=None,
                   help="tokens per fused-loss chunk (training.loss_chunk_tokens)")
    p.add_argument("--offload", action=on_off, default=None,
                   help="one process: optimizer state and masters on CPU (optimizer.offload)")
    p.add_argument("--cpu-offload", action=on_off, default=None,
                   help="ZeRO-2/3: FSDP's offload of every sharded state (parallel.cpu_offload)")
    p.add_argument("--fsdp-param-dtype", choices=["fp32", "bf16"], default=None,
                   help="ZeRO-2/3: dtype FSDP gathers parameters in (parallel.fsdp_param_dtype)")
    p.add_argument("--dp-replicate", type=positive_int, default=None,
                   help="replicas among the --dp ranks (default: all of them for --zero 0, "
                        "else train's parallel.dp_replicate; HSDP for ZeRO-2/3)")
    p.add_argument("--schedule", default=None, help="pipeline schedule (default train's "
                   "parallel.pp_schedule, Interleaved1F1B with --vpp > 1)")
    p.add_argument("--gpus", type=positive_int, default=None, help="world size (default: product "
                                                                "of the degrees)")
    ft = p.add_argument_group("fine-tuning (one device)")
    ft.add_argument("--method", choices=METHODS, default="pretrain",
                    help="model states of a fine-tuning method instead of pretraining")
    ft.add_argument("--lora-rank", type=positive_int, default=8, help="lora/qlora rank")
    ft.add_argument("--lora-targets", default=None,
                    help="lora/qlora: the adapted linears, comma-separated (q,k,v,o,gate,up,"
                         "down, or the Hugging Face names q_proj...; default: all of them, as "
                         "finetune.lora_targets)")
    ft.add_argument("--train-last", type=int, default=None,
                    help="freeze: train only the last k blocks (and the head)")
    ft.add_argument("--freeze-first", type=int, default=0, help="freeze: the first n blocks")
    ft.add_argument("--lora-dropout", type=float, default=0.0,
                    help="lora/qlora dropout (> 0: the adapters run composed, not fused)")
    ft.add_argument("--num-labels", type=positive_int, default=None,
                    help="classification head with this many labels")
    a = p.parse_args(argv)
    args = parse_model(a.model, a.set, pretrain=a.method == "pretrain")
    # pretraining plans what `train` runs, a fine-tuning method what `finetune` runs
    defaults = train_defaults(a.model) if a.method == "pretrain" else finetune_defaults(a.model)
    device = parse_device(a.gpu, a.gpu_mem)
    plan = estimate(args, _layout(a, defaults, device))
    if a.method != "pretrain":
        targets = None
        if a.lora_targets is not None:
            from scaletrain.finetune.lora import parse_targets

            targets = parse_targets(a.lora_targets)
        plan = finetune_plan(plan, a.method, rank=a.lora_rank, train_last=a.train_last,
                             freeze_first=a.freeze_first, num_labels=a.num_labels,
                             targets=targets, lora_dropout=a.lora_dropout)
    print(plan_report(plan, device, a.json))
    if not a.json and device is not None and plan.peak_bytes > device.memory_bytes:
        from scaletrain.plan.search.advice import advice_lines

        print("\n".join(advice_lines(plan, device.memory_bytes)))
    return 0


def _layout(a: argparse.Namespace, cfg: Config, device: Device | None) -> Layout:
    """The layout the options describe, each one not given taken from the trainer's default
    config `cfg` (what `scaletrain train --model.name MODEL` runs on these degrees)."""
    par, tr, ac = cfg.parallel, cfg.training, cfg.activation_checkpoint

    def given(value: object, default: object) -> Any:
        return default if value is None else value

    a.offload = given(a.offload, cfg.optimizer.offload)
    fill_train_defaults(a, cfg, offload=a.offload)
    world = a.gpus or a.dp * a.tp * a.pp * a.cp
    replicate = a.dp_replicate or (a.dp if a.zero == 0 else min(par.dp_replicate, a.dp))
    if a.dp % replicate:
        raise PlanError(f"--dp-replicate ({replicate}) must divide --dp ({a.dp})")
    dims = check_dims(world, pp=a.pp, cp=a.cp, tp=a.tp, dp_replicate=replicate,
                      dp_shard=a.dp // replicate, ep=a.ep)
    if a.zero is None:  # as the trainer resolves parallel.data_parallel on these degrees
        a.zero = ZERO_STAGE[resolve_mode(par.data_parallel, dims)] if dims.world_size > 1 \
            else 0
    kernels = resolve_kernels(a.kernels, cfg, device)
    mbs = a.mbs or tr.micro_batch_size
    gbs = a.gbs or resolve_batch(dataclasses.replace(tr, micro_batch_size=mbs), dims.dp)[0]
    return Layout(
        dims=dims, mbs=mbs, seq_len=a.seq_len or cfg.data.seq_len, gbs=gbs, zero=a.zero,
        sequence_parallel=given(a.sequence_parallel, par.sequence_parallel) and a.tp > 1,
        vpp=a.vpp, schedule=a.schedule or ("Interleaved1F1B" if a.vpp > 1 else par.pp_schedule),
        pp_microbatches=given(a.pp_microbatches, par.pp_microbatches),
        cpu_offload=given(a.cpu_offload, par.cpu_offload),
        fsdp_param_dtype=given(a.fsdp_param_dtype, par.fsdp_param_dtype),
        fsdp_reduce_dtype=par.fsdp_reduce_dtype,
        precision=resolve_precision(a.precision, cfg, device), param_dtype=a.param_dtype,
        grad_convention=a.grad_convention, optimizer=a.optimizer, offload=a.offload,
        recompute=given(a.recompute, ac.mode), every=given(a.every, ac.every),
        scope=given(a.scope, ac.scope), fused_loss=given(a.fused_loss, tr.fused_loss),
        loss_chunk=given(a.loss_chunk, tr.loss_chunk_tokens), kernels=kernels,
        bucket_cap_mb=par.bucket_cap_mb,
        host=host_process(cfg) if kernels == "cpu" and device is None else None)


def main(argv: list[str]) -> int:
    try:
        if argv and argv[0] == "search":
            from scaletrain.commands.plan_search import main as search_main

            return search_main(argv[1:])
        return _estimate_main(argv)
    except (PlanError, KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) else str(e)
        print(f"scaletrain plan: {msg}", file=sys.stderr)
        return 2
