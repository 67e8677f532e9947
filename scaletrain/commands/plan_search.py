"""`scaletrain plan search`: the layouts that fit a cluster, best first, with reasons."""

from __future__ import annotations

import argparse
import dataclasses
import json

from scaletrain.commands._plan_args import (
    GIB,
    add_common_args,
    fill_train_defaults,
    parse_device,
    parse_model,
    positive_int,
    resolve_kernels,
    resolve_precision,
    train_defaults,
)
from scaletrain.plan.from_config import host_process
from scaletrain.plan.layout import Layout, PlanError
from scaletrain.plan.search.calibration.measured_range import calibration_note
from scaletrain.plan.search.space import Candidate, alternatives, search, why_lost
from scaletrain.plan.timing.step_time import Cluster

SCHEDULE_SHORT = {"1F1B": "1F1B", "Interleaved1F1B": "I1F1B", "InterleavedZeroBubble": "ZB",
                  "ZBVZeroBubble": "ZBV", "GPipe": "GPipe", "LoopedBFS": "BFS"}
"""The `sched` column of the table (the commands spell the schedule out)."""


def main(argv: list[str]) -> int:
    # No abbreviations: `--gbs` must not silently become `--gbs-tokens`.
    p = argparse.ArgumentParser(prog="scaletrain plan search", description="Search the "
                                "layouts that fit, ranked by estimated step time.",
                                allow_abbrev=False)
    add_common_args(p)
    p.add_argument("--gpus", type=positive_int, required=True, help="number of GPUs")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs (or, with --gpu cpu, processes) per node; default 8, with "
                        "--gpu cpu all of --gpus on this host")
    batch = p.add_mutually_exclusive_group(required=True)
    batch.add_argument("--gbs-tokens", type=positive_int, help="global batch in tokens")
    batch.add_argument("--gbs", type=positive_int,
                       help="global batch in sequences (--gbs-tokens = GBS x --seq-len)")
    p.add_argument("--max-zero", type=int, choices=[0, 1, 2, 3], default=3,
                   help="highest ZeRO stage to consider (1: Megatron-style)")
    p.add_argument("--efficiency", type=float, default=None,
                   help="fraction of peak a large matmul reaches (default: the device's, "
                        "fitted to published runs: docs/plan.md)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="override the device's peak TFLOP/s in --precision")
    p.add_argument("--intra-node-gbs", type=float, default=None,
                   help="override the intra-node bandwidth (GB/s per GPU and direction)")
    p.add_argument("--inter-node-gbs", type=float, default=None,
                   help="override the inter-node bandwidth (GB/s per GPU and direction)")
    p.add_argument("--fsdp-reduce-dtype", choices=["fp32", "bf16"], default=None,
                   help="ZeRO-2/3: dtype FSDP reduce-scatters (and HSDP all-reduces) gradients "
                        "in (parallel.fsdp_reduce_dtype; default: the model's training default)")
    p.add_argument("--top", type=positive_int, default=5)
    a = p.parse_args(argv)
    if a.gpu is None:
        raise PlanError("--gpu is required for a search (e.g. --gpu H100, or cpu)")
    on_host = a.gpu.lower() == "cpu"
    if on_host:  # this host, measured, shared by the ranks of one host
        from scaletrain.plan.search.cpu_device import cpu_device

        if a.gpus_per_node is None:
            a.gpus_per_node = a.gpus
        device = cpu_device(a.gpus_per_node)
        if a.gpu_mem is not None:
            device = dataclasses.replace(device, memory_gib=a.gpu_mem)
    else:
        device = parse_device(a.gpu, a.gpu_mem)
    assert device is not None
    if a.gpus_per_node is None:
        a.gpus_per_node = 8
    defaults = train_defaults(a.model)
    a.seq_len = a.seq_len or defaults.data.seq_len
    a.precision = resolve_precision(a.precision, defaults, device)
    kept = a.grad_convention
    a.grad_convention = None
    fill_train_defaults(a, defaults, offload=defaults.optimizer.offload)
    if kept is not None and kept != a.grad_convention and a.param_dtype != "fp32":
        # each proposal's command must give the memory it shows
        raise PlanError(f"--grad-convention {kept}: the trainer keeps {a.grad_convention} "
                        "gradients for these parameters, so the search's commands could not "
                        "run what it would plan; use it with `scaletrain plan`")
    if a.gbs is not None:
        a.gbs_tokens = a.gbs * a.seq_len
    for flag, value in (("--peak-tflops", a.peak_tflops), ("--intra-node-gbs", a.intra_node_gbs),
                        ("--inter-node-gbs", a.inter_node_gbs)):
        if value is not None and value <= 0:
            raise PlanError(f"{flag} must be positive (got {value})")
    if a.peak_tflops is not None:
        device = dataclasses.replace(
            device, peak_tflops={**device.peak_tflops, a.precision: a.peak_tflops})
    if a.intra_node_gbs is not None:
        device = dataclasses.replace(device, intra_node_gbs=a.intra_node_gbs)
    if a.inter_node_gbs is not None:
        device = dataclasses.replace(device, inter_node_gbs=a.inter_node_gbs)
    if a.efficiency is not None and not 0 < a.efficiency <= 1:
        raise PlanError(f"--efficiency must be in (0, 1] (got {a.efficiency})")
    args = parse_model(a.model, a.set)
    cluster = Cluster(device, a.gpus, a.gpus_per_node, efficiency=a.efficiency)
    base = Layout(precision=a.precision, param_dtype=a.param_dtype,
                  grad_convention=a.grad_convention, optimizer=a.optimizer,
                  fsdp_reduce_dtype=a.fsdp_reduce_dtype or defaults.parallel.fsdp_reduce_dtype,
                  fused_loss=defaults.training.fused_loss,
                  loss_chunk=defaults.training.loss_chunk_tokens,
                  # this host: its kernels' saved tensors, the process's own memory and batches,
                  # as `train --dry-run` on a CPU counts them
                  kernels="cpu" if on_host else resolve_kernels(a.kernels, defaults, device),
                  host=host_process(defaults) if on_host else None)
    refused: dict[str, int] = {}
    fitting, every = search(args, cluster, a.seq_len, a.gbs_tokens, base, max_zero=a.max_zero,
                            model=a.model, refused=refused)
    if a.json:
        print(json.dumps([{**c.to_json(), "calibration_note": calibration_note(c.layout)}
                          for c in fitting[:a.top]], indent=2))
        return 0 if fitting else 1
    if not every:
        reasons = "; ".join(f"{why} ({n} layouts)" for why, n in
                            sorted(refused.items(), key=lambda kv: -kv[1])[:3])
        print(f"no layout of {a.model} on {a.gpus} x {device.name} was evaluated: "
              + (f"scaletrain train refuses every candidate: {reasons}" if refused else
                 "no degree divides the model, the GPUs and the global batch"))
        return 1
    if not fitting:
        smallest = min(every, key=lambda c: c.plan.peak_bytes, default=None)
        need = "" if smallest is None else \
            f"; the smallest needs {smallest.plan.peak_bytes / GIB:.1f} GiB per GPU"
        print(f"no layout of {a.model} fits {a.gpus} x {device.name} "
              f"({cluster.usable_bytes / GIB:.1f} GiB usable){need}. More GPUs, a shorter "
              "sequence or a smaller global batch may help.")
        return 1
    print(f"{len(fitting)} of {len(every)} layouts fit {a.gpus} x {device.name} "
          f"({cluster.usable_bytes / GIB:.1f} GiB usable per GPU)\n")
    head = f"{'#':>2} {'dp':>7} {'tp':>3} {'pp':>3} {'vpp':>3} {'sched':>5} {'cp':>3} {'ep':>3} " \
           f"{'zero':>4} {'mbs':>4} {'ga':>5} {'recompute':>9} {'GiB/GPU':>8} {'step s':>8} " \
           f"{'MFU':>6}  largest overhead"
    print(head)
    for i, c in enumerate(fitting[:a.top], 1):
        j = c.to_json()
        sched = SCHEDULE_SHORT.get(j["schedule"], j["schedule"]) if j["pp"] > 1 else "-"
        print(f"{i:>2} {_dp(c):>7} {j['tp']:>3} {j['pp']:>3} {j['vpp']:>3} {sched:>5} "
              f"{j['cp']:>3} {j['ep']:>3} "
              f"{j['zero']:>4} {j['mbs']:>4} {j['ga']:>5} {j['recompute']:>9} "
              f"{j['memory_bytes_per_gpu'] / GIB:>8.1f} {j['step_time_s']:>8.2f} "
              f"{j['mfu']:>6.1%}  {_overhead(c)}")
        note = calibration_note(c.layout)
        if note:  # the layout relies on a regime the calibration table did not measure
            print(f"{'':>3}! {note}")
    if any(_hsdp(c) for c in fitting[:a.top]):
        print("\ndp RxS: HSDP, R replicas of FSDP over S ranks (--parallel.dp_replicate R "
              "--parallel.dp_shard S)")
    if any(c.layout.dims.pp > 1 for c in fitting[:a.top]):
        print("(sched: the pipeline schedule, " + ", ".join(
            f"{short} {name}" for name, short in SCHEDULE_SHORT.items()) + ")")
    print("\ncommands:")
    for i, c in enumerate(fitting[:a.top], 1):
        print(f"{i:>2} {c.command}")
    best = fitting[0]
    parts = ", ".join(f"{k.replace('_', ' ')} {_seconds(v)}" for k, v in best.times.items()
                      if v > 0.005 * best.step_time_s)
    print(f"\nwhy #1: fastest estimated step ({parts}); it fits with "
          f"{(cluster.usable_bytes - best.plan.peak_bytes) / GIB:.1f} GiB to spare.")
    print("nearest alternatives:")
    for name, alt in alternatives(best, every):
        value = alt.to_json().get(name, getattr(alt.layout, name, None))
        print(f"  {name}={value}: {why_lost(best, alt, cluster.usable_bytes)}")
    return 0


def _hsdp(c: Candidate) -> bool:
    return c.layout.fsdp and c.layout.dims.dp_replicate > 1


def _dp(c: Candidate) -> str:
    """The data-parallel degree; `RxS` for HSDP (R replicas of shard groups of S ranks)."""
    d = c.layout.dims
    return f"{d.dp_replicate}x{d.dp_shard}" if _hsdp(c) else str(d.dp)


def _seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 0.1 else f"{t * 1e3:.3g} ms"


def _overhead(c) -> str:
    """What besides compute costs this layout most (the reason it ranks where it does)."""
    extra = {k: v for k, v in c.times.items() if k != "compute"}
    if c.layout.recompute != "none":
        extra["recompute"] = c.times["compute"] * (
            1 - c.plan.flops_per_token / c.plan.hardware_flops_per_token)
    name = max(extra, key=extra.get)
    if extra[name] < 0.005 * c.step_time_s:
        return "none (compute bound)"
    return f"{name.replace('_', ' ')} {extra[name] / c.step_time_s:.1%}"
