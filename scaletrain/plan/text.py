"""The plan as text: what `scaletrain plan`, `train --dry-run` and the framework callbacks
(`scaletrain.integrations`) print."""

from __future__ import annotations

import json

from scaletrain.models.args import ModelArgs, count_active_params
from scaletrain.plan.estimate import plan_json
from scaletrain.plan.hardware import Device
from scaletrain.plan.layout import Layout, Plan
from scaletrain.plan.search.calibration.measured_range import calibration_note

GIB = 2**30
GB = 1e9


def _active_note(args: ModelArgs) -> str:
    """For Mixture-of-Experts models: the parameters one token goes through."""
    if not args.is_moe:
        return ""
    return (f"; {count_active_params(args):,} active per token ({args.n_experts_per_token} of "
            f"{args.n_experts} experts; FLOPs and MFU count these)")


def _grads_label(lay: Layout) -> str:
    """The gradient convention as the user reads it: `bf16` means 16-bit gradients, which are
    fp16 under an fp16 run."""
    return lay.stored_dtype if lay.grad_convention == "bf16" else lay.grad_convention


def format_plan(plan: Plan, device: Device | None = None) -> str:
    """The human-readable plan."""
    lay, d = plan.layout, plan.layout.dims
    lines = [
        f"layout: pp={d.pp} (vpp={lay.vpp}) dp={d.dp} (replicate {d.dp_replicate} x shard "
        f"{d.dp_shard}) cp={d.cp} tp={d.tp}{' +SP' if lay.sequence_parallel else ''}"
        f"{f' ep={d.ep}' if d.ep > 1 else ''} "
        f"zero={lay.zero}  mbs={lay.mbs} ga={lay.grad_accum} seq={lay.seq_len}  "
        f"{lay.precision} (params {lay.stored_dtype}"
        f"{', grads ' + _grads_label(lay) if lay.stored_dtype != 'fp32' else ''})  "
        f"recompute={_recompute_label(lay)}",
        f"parameters: {plan.params:,} total, {plan.params_per_rank:,} on the most loaded rank "
        f"(pipeline stage {plan.stage})" + _active_note(plan.args),
        *_finetune_lines(plan),
        f"FLOPs per token: {plan.flops_per_token:.4g} model ({_flops_rule(plan)}), "
        f"{plan.hardware_flops_per_token:.4g} hardware (with recomputation)",
        f"pipeline bubble: {plan.bubble_fraction:.1%} of compute; activations of "
        f"{plan.in_flight_microbatches:g} micro-batch(es) in flight"
        + (f"; {lay.pipeline_runs} schedule runs of {lay.pipeline_microbatches} micro-batches"
           if lay.pipeline_runs > 1 else ""),
        "",
        f"{'memory (most loaded rank)':<28}{'bytes':>18}{'GiB':>10}{'GB':>10}",
    ]
    for k, v in plan.memory_bytes.items():
        if k == "total":
            lines.append("-" * 66)
        lines.append(f"{k:<28}{v:>18,}{v / GIB:>10.2f}{v / GB:>10.2f}")
    lines += _stage_lines(plan)
    if lay.zero == 3 and lay.blocks_stay_gathered:
        lines.append(f"(ZeRO-3 under {lay.schedule}: the blocks stay gathered from forward to "
                     "backward, as in ZeRO-2, for the split backward: gathered_weights)")
    if lay.grads_stay_unsharded:
        lines.append("(FSDP under pipeline parallelism: torch's schedule leaves the stage "
                     "gathered after each backward and its gradients unsharded until the last: "
                     "gathered_weights, gradients)")
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


def plan_report(plan: Plan, device: Device | None, as_json: bool) -> str:
    """What `plan` and the dry runs print first: the plan as JSON with its `calibration_note`,
    or as text followed by the note's line when the layout relies on a regime the calibration
    table did not measure (`plan/search/calibration/measured_range.py`)."""
    note = calibration_note(plan.layout)
    if as_json:
        return json.dumps({**plan_json(plan, device), "calibration_note": note}, indent=2)
    text = format_plan(plan, device)
    return f"{text}\ncalibration: {note}" if note else text


def _stage_lines(plan: Plan) -> list[str]:
    """Under pipeline parallelism, one line per stage: what sets its peak (`--json`: `stages`)."""
    if not plan.stages:
        return []
    lines = ["", f"per pipeline stage ({plan.layout.schedule}; GiB; peak = max over its "
             "schedule's moments)",
             f"{'stage':>5}{'layers':>7}{'ends':>11}{'states':>9}{'activ.':>9}{'logits':>9}"
             f"{'peak':>9}  held at its peak (micro-batches per chunk, F forward, I input-grad)"]
    for s in plan.stages:
        mem = s["memory_bytes"]
        states = sum(mem[k] for k in ("weights", "gradients", "master_weights", "optimizer"))
        ends = "+".join(n for n, on in (("embed", s["embedding"]), ("head", s["head"])) if on)
        held = ", ".join(f"{k} x{v}" for k, v in s["held_at_peak"].items()) \
            or f"{s['in_flight_microbatches']:g} micro-batch(es)"
        mark = " *" if s["stage"] == plan.stage else ""
        lines.append(f"{s['stage']:>5}{s['layers']:>7}{ends or '-':>11}{states / GIB:>9.2f}"
                     f"{mem['activations'] / GIB:>9.2f}{mem['logits_loss'] / GIB:>9.2f}"
                     f"{mem['peak'] / GIB:>9.2f}  {held}{mark}")
    return lines


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
    acts = ("activations of what this method keeps for backward" if f.get("method_activations")
            else "activations as for full training (an upper bound when parts are frozen)")
    return [f"fine-tuning {f['method']}{rank}: {f['trainable']:,} trainable of {f['total']:,} "
            f"({f['trainable'] / f['total']:.2%}); {acts}", *_host_lines(f.get("host_load_bytes"))]


def _host_lines(host: dict | None) -> list[str]:
    """Host RAM per rank at the base's load (`plan.finetune.host`)."""
    if not host:
        return []
    if host.get("quantized_on_load"):
        how = ("its shards of the 4-bit base (NF4 block linears, the rest fp32)"
               if host["sharded"] else "the 4-bit base (NF4 block linears, the rest fp32)")
        cast = "read bf16, cast to fp32, quantized"
    else:
        dtype = host.get("base_dtype", "fp32")
        how = (f"its shards of the {dtype} base" if host["sharded"]
               else "the whole fp32 base (one process, or DDP without TP)")
        cast = "read bf16, cast to fp32" if dtype == "fp32" else "read bf16"
    return [f"host RAM per rank while loading the base: {host['peak'] / GIB:.2f} GiB = {how} "
            f"{host['weights'] / GIB:.2f} GiB + the largest read in flight "
            f"{host['in_flight'] / GIB:.2f} GiB ({cast})"]
