"""What to turn on when a layout does not fit: the cheapest single changes that make it fit.

Each change is one knob the trainer has (recomputation, ZeRO stage, FSDP parameter dtype, CPU
offload, a smaller micro-batch with more accumulation steps for the same global batch, tensor
or pipeline parallelism taken from data parallelism, the pipeline schedule run over fewer
micro-batches at a time), re-planned with the same estimate (for a fine-tuning plan, as the
same fine-tuning method); the cost is the extra hardware FLOPs (recomputation), the extra
pipeline bubble or the extra bytes communicated per step. Changes the trainer would refuse are
not offered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.feasibility import schedule_problems
from scaletrain.plan.estimate import estimate
from scaletrain.plan.finetune import plan as finetune_plan
from scaletrain.plan.layout import Layout, Plan, PlanError, layout_problems

GIB = 2**30


@dataclass(frozen=True)
class Advice:
    change: str
    """The config flags to set."""
    plan: Plan
    flops_cost: float
    """Extra hardware FLOPs per token, relative (0.33 = a third more compute)."""
    comm_cost_bytes: int
    """Extra bytes this rank communicates per step."""
    bubble_cost: float = 0.0
    """Extra pipeline bubble, as a fraction of compute (0.1 = idle for a tenth more)."""

    def describe(self) -> str:
        costs = []
        if self.flops_cost > 0.005:
            costs.append(f"+{self.flops_cost:.0%} compute")
        if self.bubble_cost > 0.0005:
            costs.append(f"+{self.bubble_cost:.1%} pipeline bubble")
        if self.comm_cost_bytes > 0:
            costs.append(f"+{self.comm_cost_bytes / 1e9:.3g} GB communication per step")
        if self.plan.cpu_offload_bytes:
            costs.append(f"{self.plan.cpu_offload_bytes / GIB:.2f} GiB over PCIe each step")
        cost = ", ".join(costs) or "no extra compute or communication"
        return f"{self.change}: peak {self.plan.peak_bytes / GIB:.2f} GiB ({cost})"


def _changes(lay: Layout) -> Iterator[tuple[str, Layout]]:
    d = lay.dims
    for mode in ("partial", "full"):
        if lay.recompute != mode and not (lay.recompute == "full" and mode == "partial"):
            yield f"--activation_checkpoint.mode {mode}", lay.replace(recompute=mode)
    multi = d.world_size > 1
    if multi and d.dp * d.cp > 1:
        for zero, mode in ((1, "zero1"), (2, "zero2"), (3, "zero3")):
            if zero > lay.zero:
                dims = d if zero < 2 else ParallelDims(d.pp, 1, d.dp, d.cp, d.tp)
                yield (f"--parallel.data_parallel {mode}"
                       + (" --parallel.dp_shard -1 --parallel.dp_replicate 1"
                          if dims != d else ""),
                       lay.replace(zero=zero, dims=dims))
    if not lay.fused_loss:  # (a classification fine-tuning plan refuses it: skipped)
        yield "--training.fused_loss true", lay.replace(fused_loss=True)
    if lay.fsdp and lay.gather_dtype == "fp32" and lay.precision == "bf16":
        yield "--parallel.fsdp_param_dtype bf16", lay.replace(fsdp_param_dtype="bf16")
    if lay.fsdp and not lay.cpu_offload:
        yield "--parallel.cpu_offload true", lay.replace(cpu_offload=True)
    if not multi and not lay.offload and lay.precision != "fp16":
        yield "--optimizer.offload true", lay.replace(offload=True)
    yield from _smaller_micro_batches(lay)
    yield from _pipeline_runs(lay)
    for name in ("tp", "pp"):
        for k in (2, 4, 8):
            if d.dp_shard % k == 0 and d.dp_shard // k >= 1 and getattr(d, name) == 1:
                new = {**d.mesh_shape, name: k, "dp_shard": d.dp_shard // k}
                dims = ParallelDims(**new)
                gbs = lay.gbs if lay.gbs is not None else lay.mbs * d.dp
                yield (f"--parallel.{name} {k} (from data parallelism)",
                       lay.replace(dims=dims, gbs=gbs, sequence_parallel=name == "tp"
                                   or lay.sequence_parallel))
                break


MICRO_BATCH_FLAG = "--training.micro_batch_size"


def _smaller_micro_batches(lay: Layout) -> Iterator[tuple[str, Layout]]:
    """The micro-batch halved, again and again down to 1, accumulation raised to keep the
    global batch (GBS = MBS x GA x DP); `advise` keeps the largest one that fits."""
    gbs = lay.gbs if lay.gbs is not None else lay.mbs * lay.dims.dp
    mbs = lay.mbs
    while mbs > 1:
        mbs //= 2
        if gbs % (mbs * lay.dims.dp):  # an odd micro-batch: the global batch cannot stay
            return
        ga = gbs // (mbs * lay.dims.dp)
        yield (f"{MICRO_BATCH_FLAG} {mbs} --training.grad_accum_steps {ga}",
               lay.replace(mbs=mbs, gbs=gbs))


RUNS_FLAG = "--parallel.pp_microbatches"


def _pipeline_runs(lay: Layout) -> Iterator[tuple[str, Layout]]:
    """The step's micro-batches through the pipeline schedule k at a time, for each divisor k
    of them below the current run that the schedule accepts: a k-micro-batch step's receive
    buffers and held sends, its bubble; `advise` keeps the largest k that fits."""
    if lay.dims.pp == 1:
        return
    m = lay.grad_accum
    for k in range(lay.pipeline_microbatches - 1, 0, -1):
        if m % k == 0 and not schedule_problems(lay.schedule, lay.dims.pp, lay.vpp, k):
            yield f"{RUNS_FLAG} {k}", lay.replace(pp_microbatches=k)


def _keep_largest(found: list[Advice], budget_bytes: float, flag: str,
                  size: Callable[[Layout], int]) -> list[Advice]:
    """Of the changes setting `flag` (one knob at several sizes), only the largest size that
    fits (the least slowdown), or when none fits the one that saves the most."""
    sized = [a for a in found if a.change.startswith(flag)]
    if not sized:
        return found
    fitting = [a for a in sized if a.plan.peak_bytes <= budget_bytes]
    keep = (max(fitting, key=lambda a: size(a.plan.layout)) if fitting
            else min(sized, key=lambda a: a.plan.peak_bytes))
    return [a for a in found if a is keep or not a.change.startswith(flag)]


def advise(plan: Plan, budget_bytes: float, limit: int = 5) -> list[Advice]:
    """The single changes that bring `plan` under `budget_bytes`, cheapest first; when none
    does, the ones that save the most."""
    base = plan.layout
    out: list[Advice] = []
    for change, lay in _changes(base):
        if layout_problems(plan.args, lay):
            continue
        try:
            new = finetune_plan.like(estimate(plan.args, lay), plan)
        except PlanError:
            continue
        if new.trainer_problems or new.peak_bytes >= plan.peak_bytes:
            continue
        flops = new.hardware_flops_per_token / plan.hardware_flops_per_token - 1
        comm = sum(new.comm_bytes_per_step.values()) - sum(plan.comm_bytes_per_step.values())
        bubble = max(0.0, new.bubble_fraction - plan.bubble_fraction)
        out.append(Advice(change, new, flops, max(0, comm), bubble))
    out = _keep_largest(out, budget_bytes, MICRO_BATCH_FLAG, lambda lay: lay.mbs)
    out = _keep_largest(out, budget_bytes, RUNS_FLAG, lambda lay: lay.pipeline_microbatches)
    fitting = [a for a in out if a.plan.peak_bytes <= budget_bytes]
    if fitting:
        return sorted(fitting, key=lambda a: (a.flops_cost + a.bubble_cost, a.comm_cost_bytes,
                                              a.plan.cpu_offload_bytes))[:limit]
    return sorted(out, key=lambda a: a.plan.peak_bytes)[:limit]


def combine(plan: Plan, budget_bytes: float, steps: int = 4) -> list[Advice]:
    """Changes applied one after another, each time the one that saves the most, until the
    plan fits (or `steps` changes); empty when even that does not make it fit."""
    chosen: list[Advice] = []
    current = plan
    for _ in range(steps):
        found = advise(current, budget_bytes, limit=50)
        if not found:
            return []
        fitting = [a for a in found if a.plan.peak_bytes <= budget_bytes]
        best = fitting[0] if fitting else min(found, key=lambda a: a.plan.peak_bytes)
        chosen.append(best)
        current = best.plan
        if current.peak_bytes <= budget_bytes:
            return chosen
    return []


def advice_lines(plan: Plan, budget_bytes: float) -> list[str]:
    """The advice as text for `plan` and `train --dry-run`."""
    found = advise(plan, budget_bytes)
    if found and found[0].plan.peak_bytes <= budget_bytes:
        return ["", "to make it fit, change one of (cheapest first):",
                *(f"  {a.describe()}" for a in found)]
    steps = combine(plan, budget_bytes)
    if steps:
        return ["", "no single change makes it fit; these together do (in this order):",
                *(f"  {a.describe()}" for a in steps)]
    lines = ["", "no change the trainer offers makes it fit on this many devices: add devices, "
             "shorten the sequence or use a smaller model"]
    if found:
        lines += ["the single changes that save the most:", *(f"  {a.describe()}" for a in found)]
    return lines
