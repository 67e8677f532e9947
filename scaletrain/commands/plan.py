"""`scaletrain plan ...` (estimate one layout) and `scaletrain plan search ...` (find layouts)."""

from __future__ import annotations

import argparse
import json
import sys

from scaletrain.commands._plan_args import (
    GB,
    GIB,
    add_common_args,
    parse_device,
    parse_model,
    positive_int,
    resolve_precision,
    train_defaults,
)
from scaletrain.models.args import ModelArgs, count_active_params
from scaletrain.plan.estimate import Layout, Plan, PlanError, check_dims, estimate, plan_json
from scaletrain.plan.finetune import METHODS, finetune_plan
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
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0)
    p.add_argument("--recompute", choices=["none", "partial", "full"], default="none",
                   help="partial: every n-th block (--every), or its attention (--scope)")
    p.add_argument("--every", type=positive_int, default=2, help="partial: every n-th block")
    p.add_argument("--scope", choices=["block", "attention"], default="block")
    p.add_argument("--fused-loss", action="store_true",
                   help="head + cross-entropy chunk by chunk, no logits (training.fused_loss)")
    p.add_argument("--loss-chunk", type=positive_int, default=4096,
                   help="tokens per fused-loss chunk (training.loss_chunk_tokens)")
    p.add_argument("--offload", action="store_true",
                   help="one process: optimizer state and masters on CPU (optimizer.offload)")
    p.add_argument("--cpu-offload", action="store_true",
                   help="ZeRO-2/3: FSDP's offload of every sharded state (parallel.cpu_offload)")
    p.add_argument("--fsdp-param-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="ZeRO-2/3: dtype FSDP gathers parameters in (parallel.fsdp_param_dtype)")
    p.add_argument("--dp-replicate", type=positive_int, default=None,
                   help="replicas among the --dp ranks (default: all of them for --zero 0, "
                        "else 1; HSDP for ZeRO-2/3)")
    p.add_argument("--schedule", default=None, help="pipeline schedule (default 1F1B, "
                   "Interleaved1F1B with --vpp > 1)")
    p.add_argument("--gpus", type=positive_int, default=None, help="world size (default: product "
                                                                "of the degrees)")
    ft = p.add_argument_group("fine-tuning (one device)")
    ft.add_argument("--method", choices=METHODS, default="pretrain",
                    help="model states of a fine-tuning method instead of pretraining")
    ft.add_argument("--lora-rank", type=positive_int, default=8, help="lora/qlora rank")
    ft.add_argument("--train-last", type=int, default=None,
                    help="freeze: train only the last k blocks (and the head)")
    ft.add_argument("--freeze-first", type=int, default=0, help="freeze: the first n blocks")
    ft.add_argument("--lora-dropout", type=float, default=0.0,
                    help="lora/qlora dropout (> 0: the adapters run composed, not fused)")
    ft.add_argument("--num-labels", type=positive_int, default=None,
                    help="classification head with this many labels")
    a = p.parse_args(argv)
    args = parse_model(a.model, a.set)
    defaults = train_defaults(a.model)
    device = parse_device(a.gpu, a.gpu_mem)
    a.seq_len = a.seq_len or defaults.data.seq_len
    a.mbs = a.mbs or defaults.training.micro_batch_size
    a.precision = resolve_precision(a.precision, defaults, device)
    world = a.gpus or a.dp * a.tp * a.pp * a.cp
    replicate = a.dp_replicate or (a.dp if a.zero == 0 else 1)
    if a.dp % replicate:
        raise PlanError(f"--dp-replicate ({replicate}) must divide --dp ({a.dp})")
    dims = check_dims(world, pp=a.pp, cp=a.cp, tp=a.tp, dp_replicate=replicate,
                      dp_shard=a.dp // replicate, ep=a.ep)
    lay = Layout(dims=dims, mbs=a.mbs, seq_len=a.seq_len, gbs=a.gbs, zero=a.zero,
                 sequence_parallel=a.sequence_parallel, vpp=a.vpp,
                 schedule=a.schedule or ("Interleaved1F1B" if a.vpp > 1 else "1F1B"),
                 cpu_offload=a.cpu_offload, fsdp_param_dtype=a.fsdp_param_dtype,
                 precision=a.precision,
                 param_dtype=a.param_dtype, grad_convention=a.grad_convention,
                 optimizer=a.optimizer, offload=a.offload, recompute=a.recompute,
                 fused_loss=a.fused_loss, loss_chunk=a.loss_chunk,
                 every=a.every, scope=a.scope, kernels=a.kernels)
    plan = estimate(args, lay)
    if a.method != "pretrain":
        plan = finetune_plan(plan, a.method, rank=a.lora_rank, train_last=a.train_last,
                             freeze_first=a.freeze_first, num_labels=a.num_labels,
                             lora_dropout=a.lora_dropout)
    if a.json:
        print(json.dumps(plan_json(plan, device), indent=2))
    else:
        print(format_plan(plan, device))
        if device is not None and plan.peak_bytes > device.memory_bytes:
            from scaletrain.plan.advice import advice_lines

            print("\n".join(advice_lines(plan, device.memory_bytes)))
    return 0


def _active_note(args: ModelArgs) -> str:
    """For Mixture-of-Experts models: the parameters one token goes through."""
    if not args.is_moe:
        return ""
    return (f"; {count_active_params(args):,} active per token ({args.n_experts_per_token} of "
            f"{args.n_experts} experts; FLOPs and MFU count these)")


def format_plan(plan: Plan, device: Device | None = None) -> str:
    """The human-readable plan."""
    lay, d = plan.layout, plan.layout.dims
    lines = [
        f"layout: pp={d.pp} (vpp={lay.vpp}) dp={d.dp} (replicate {d.dp_replicate} x shard "
        f"{d.dp_shard}) cp={d.cp} tp={d.tp}{' +SP' if lay.sequence_parallel else ''}"
        f"{f' ep={d.ep}' if d.ep > 1 else ''} "
        f"zero={lay.zero}  mbs={lay.mbs} ga={lay.grad_accum} seq={lay.seq_len}  "
        f"{lay.precision} (params {lay.stored_dtype}"
        f"{', grads ' + lay.grad_convention if lay.stored_dtype != 'fp32' else ''})  "
        f"recompute={_recompute_label(lay)}",
        f"parameters: {plan.params:,} total, {plan.params_per_rank:,} on the most loaded rank "
        f"(pipeline stage {plan.stage})" + _active_note(plan.args),
        *_finetune_lines(plan),
        f"FLOPs per token: {plan.flops_per_token:.4g} model ({_flops_rule(plan)}), "
        f"{plan.hardware_flops_per_token:.4g} hardware (with recomputation)",
        f"pipeline bubble: {plan.bubble_fraction:.1%} of compute; activations of "
        f"{plan.in_flight_microbatches:g} micro-batch(es) in flight",
        "",
        f"{'memory (most loaded rank)':<28}{'bytes':>18}{'GiB':>10}{'GB':>10}",
    ]
    for k, v in plan.memory_bytes.items():
        if k == "total":
            lines.append("-" * 66)
        lines.append(f"{k:<28}{v:>18,}{v / GIB:>10.2f}{v / GB:>10.2f}")
    if lay.zero == 3 and lay.blocks_stay_gathered:
        lines.append(f"(ZeRO-3 under {lay.schedule}: the blocks stay gathered from forward to "
                     "backward, as in ZeRO-2, for the split backward: gathered_weights)")
    if plan.cpu_offload_bytes:
        lines.append(f"{'(offloaded to CPU)':<28}{plan.cpu_offload_bytes:>18,}"
                     f"{plan.cpu_offload_bytes / GIB:>10.2f}")
    if device is not None:
        fits = plan.peak_bytes <= device.memory_bytes
        lines.append(f"device {device.name}: {device.memory_gib:.1f} GiB -> "
                     f"{'fits' if fits else 'DOES NOT FIT'} "
                     f"({plan.peak_bytes / device.memory_bytes:.0%} of memory)")
    comm = ", ".join(f"{k} {v / GB:.3g} GB" for k, v in plan.comm_bytes_per_step.items() if v)
    lines += ["", f"communication per step (this rank): {comm or 'none'}"]
    if plan.trainer_problems:
        lines += ["", "scaletrain train cannot run this layout:",
                  *(f"  - {p}" for p in plan.trainer_problems)]
    return "\n".join(lines)


def _recompute_label(lay: Layout) -> str:
    """`partial` recomputation in words: which blocks, whole or attention part."""
    if lay.recompute != "partial":
        return lay.recompute
    what = "block" if lay.scope == "block" else "attention part of the block"
    nth = {1: "every", 2: "every 2nd", 3: "every 3rd"}.get(lay.every, f"every {lay.every}th")
    return f"partial ({what}, {nth} block)"


def _flops_rule(plan: Plan) -> str:
    if not plan.finetune:
        return "6N + attention"
    return "forward + input gradients + weight gradients of what trains"


def _finetune_lines(plan: Plan) -> list[str]:
    if not plan.finetune:
        return []
    f = plan.finetune
    rank = f" r={f['lora_rank']}" if f["lora_rank"] else ""
    return [f"fine-tuning {f['method']}{rank}: {f['trainable']:,} trainable of {f['total']:,} "
            f"({f['trainable'] / f['total']:.2%}); activations as for full training (an upper "
            "bound when blocks are frozen)"]


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
