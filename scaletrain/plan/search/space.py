"""Layout search: the layouts that fit a cluster, ranked by an estimated step time.

The space practitioners use: fix the global batch (in tokens) and the sequence length; tensor
parallel 1, 2, 4, 8 inside a node, each with every pipeline degree (and 1, 2, 4 virtual
stages, under 1F1B / Interleaved1F1B and the zero-bubble schedules), context parallel for
long sequences, ZeRO 0-3, recomputation, every micro-batch that divides the batch; data
parallel takes the rest and gradient accumulation is GBS / (MBS x DP).
Layouts are pruned by memory before they are timed; ties go to the simpler layout.

Step time = (compute + exposed tensor/context/pipeline communication) x (1 + bubble) +
data-parallel communication not hidden behind compute (`step_time`); compute at the device's
attainable matmul and attention rates (`compute_time`); communication by the alpha-beta model
of `plan.timing.collectives` (across nodes, a group gets the NICs of its GPUs in each node).
Calibrated against published measured runs: `plan/search/calibration/`, docs/plan.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from scaletrain.models.args import ModelArgs
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate
from scaletrain.plan.layout import (
    Layout,
    Plan,
    PlanError,
    layout_problems,
    trainer_problems,
)
from scaletrain.plan.memory.states import stage_params
from scaletrain.plan.search.command import train_command
from scaletrain.plan.timing.step_time import Cluster, dp_comm_exposed, step_time

RECOMPUTE_COST = {"none": 0, "partial": 1, "full": 2}
ZERO_OF_MODE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


@dataclass
class Candidate:
    plan: Plan
    fits: bool
    step_time_s: float
    mfu: float
    times: dict[str, float]
    model: str = "MODEL"
    """The name (preset or Hugging Face config path) `command` trains."""
    gpus: int = 1
    gpus_per_node: int = 8

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def command(self) -> str:
        """The `torchrun ... -m scaletrain train ...` line that runs this layout (built when
        asked: the search evaluates thousands of layouts and prints a few)."""
        return train_command(self.model, self.plan.args, self.layout, self.gpus,
                             self.gpus_per_node)

    def to_json(self) -> dict:
        lay = self.layout
        d = lay.dims
        return {
            "dp": d.dp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp,
            "pp": d.pp, "vpp": lay.vpp, "cp": d.cp, "ep": d.ep, "zero": self.zero_label,
            "mbs": lay.mbs,
            "ga": lay.grad_accum, "recompute": lay.recompute,
            "memory_bytes_per_gpu": self.plan.peak_bytes, "step_time_s": self.step_time_s,
            "mfu": self.mfu, "bubble_fraction": self.plan.bubble_fraction,
            "tflops_per_gpu": self.tflops_per_gpu, "time_breakdown_s": self.times,
            "data_parallel": lay.data_parallel, "fsdp_param_dtype": lay.fsdp_param_dtype,
            "schedule": lay.schedule, "command": self.command,
        }

    @property
    def zero_label(self) -> int:
        """The ZeRO stage the command runs: with one data-parallel rank the stage changes
        nothing and the trainer's `auto` mode picks it (zero3 under TP or PP), so the label
        follows the command's `parallel.data_parallel`."""
        return ZERO_OF_MODE[self.layout.data_parallel]

    @property
    def tflops_per_gpu(self) -> float:
        """Predicted achieved model TFLOP/s per GPU (the trainer's `tflops`)."""
        lay = self.layout
        tokens = (lay.gbs or lay.mbs * lay.dims.dp) * lay.seq_len
        return self.plan.flops_per_token * tokens / (self.step_time_s * lay.dims.world_size) \
            / 1e12


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _model_parallel_ladder(args: ModelArgs, cluster: Cluster) -> list[tuple[int, int]]:
    """(tp, pp) pairs: tensor parallel inside a node (1, 2, 4, 8: the divisors of the node's
    GPUs that divide the heads) combined with every pipeline degree that divides the rest and
    leaves each stage a layer (BLOOM's TP 4 x PP 12 as well as Megatron's TP 8 x PP n)."""
    n = cluster.gpus
    tps = [t for t in _divisors(cluster.gpus_per_node) if n % t == 0
           and args.n_heads % t == 0 and args.kv_heads % t == 0]
    return [(t, p) for t in tps for p in _divisors(n // t) if p <= args.n_layers]


MICRO_BATCHES = (1, 2, 4, 8, 16)
RECOMPUTE_BY_MEMORY = ("full", "partial", "none")
"""Recomputation from the least memory to the most: once one does not fit, the next won't."""


def candidates(args: ModelArgs, cluster: Cluster, seq_len: int, gbs_tokens: int,
               base: Layout | None = None, max_cp: int = 32,
               max_zero: int = 3, model: str = "MODEL",
               refused: dict[str, int] | None = None, hsdp: bool = True) -> list[Candidate]:
    """Every layout the search evaluates, fitting or not: TP x PP x virtual stages x CP x EP x
    ZeRO stage x recomputation x micro-batch, pruned by memory before the step time is ranked
    (the micro-batches of a layout stop at the first that does not fit even with full
    recomputation; lighter recomputation is tried only while the heavier one fits).

    Context parallel is added (2, 4, ... up to `max_cp`) only when no layout without it fits:
    it is the tool for sequences whose activations do not fit otherwise. `refused` (if given)
    counts the layouts the trainer refuses, by reason. ZeRO-2/3 layouts that fit are tried as
    HSDP too (`_hsdp_variants`) unless `hsdp` is False.
    """
    if gbs_tokens % seq_len:
        raise PlanError(f"--gbs-tokens ({gbs_tokens}) must be a multiple of --seq-len "
                        f"({seq_len})")
    gbs = gbs_tokens // seq_len
    base = base or Layout()
    out: list[Candidate] = []
    for cp in (1, 2, 4, 8, 16, 32, 64):
        if cp > max_cp or cluster.gpus % cp:
            break
        for tp, pp in _model_parallel_ladder(args, cluster):
            if cluster.gpus % (tp * pp * cp):
                continue
            dp = cluster.gpus // (tp * pp * cp)
            if gbs % dp:
                continue
            for zero, vpp, ep in itertools.product(range(max_zero + 1), (1, 2, 4),
                                                   _ep_degrees(args, dp)):
                for schedule in pipeline_schedules(pp, vpp):
                    for mbs in MICRO_BATCHES:
                        evaluated = fitted = False
                        for recompute in RECOMPUTE_BY_MEMORY:
                            cand = _evaluate(args, cluster, base, gbs, gbs_tokens, tp, cp, pp,
                                             dp, zero, recompute, mbs, vpp, model, ep, refused,
                                             schedule)
                            if cand is None:
                                continue
                            out.append(cand)
                            evaluated = True
                            if not cand.fits:
                                break
                            fitted = True
                            if hsdp:
                                out += _hsdp_variants(args, cluster, cand, gbs_tokens, refused)
                        if evaluated and not fitted:
                            break  # a larger micro-batch holds more still
        if any(c.fits for c in out):
            break
    return out


def _evaluate(args: ModelArgs, cluster: Cluster, base: Layout, gbs: int, gbs_tokens: int,
              tp: int, cp: int, pp: int, dp: int, zero: int, recompute: str, mbs: int,
              vpp: int, model: str = "MODEL", ep: int = 1,
              refused: dict[str, int] | None = None,
              schedule: str | None = None) -> Candidate | None:
    if (zero > 0 and dp * cp == 1) or gbs % (mbs * dp) or (ep > 1 and zero < 2):
        return None
    ga = gbs // (mbs * dp)
    if (pp == 1 and vpp > 1) or (pp > 1 and ga < pp) or (vpp > 1 and ga % pp):
        return None
    dims = ParallelDims(pp=pp, dp_replicate=dp if zero == 0 else 1,
                        dp_shard=1 if zero == 0 else dp, cp=cp, tp=tp, ep=ep)
    # The parameters as `base` stores them (the trainer's default, or --param-dtype); FSDP
    # gathers fp32 parameters in the compute dtype (no autocast copies, half the all-gather
    # bytes; the command carries --parallel.fsdp_param_dtype).
    fsdp_dtype = "bf16" if zero >= 2 and base.precision == "bf16" else "fp32"
    lay = base.replace(dims=dims, mbs=mbs, seq_len=base.seq_len, gbs=gbs, zero=zero,
                       recompute=recompute, vpp=vpp, param_dtype=base.param_dtype,
                       sequence_parallel=base.sequence_parallel
                       and args.arch in SEQUENCE_PARALLEL_ARCHS,
                       fsdp_param_dtype=fsdp_dtype,
                       schedule=schedule or pipeline_schedules(pp, vpp)[0])
    if layout_problems(args, lay):
        return None
    return _candidate(args, cluster, lay, gbs_tokens, model, refused)


def _candidate(args: ModelArgs, cluster: Cluster, lay: Layout, gbs_tokens: int, model: str,
               refused: dict[str, int] | None) -> Candidate | None:
    """`lay` planned and (if it fits) timed; None where the trainer refuses it."""
    problems = trainer_problems(args, lay)
    if problems:  # never propose what the trainer refuses
        if refused is not None:
            for problem in problems:
                refused[problem] = refused.get(problem, 0) + 1
        return None
    plan = estimate(args, lay)
    fits = plan.peak_bytes <= cluster.usable_bytes
    if not fits:  # pruned by memory: no step time needed
        return Candidate(plan, False, math.inf, 0.0, {}, model, cluster.gpus,
                         cluster.gpus_per_node)
    t, times = step_time(plan, cluster, gbs_tokens)
    peak = cluster.device.peak_tflops[lay.precision] * 1e12
    mfu = plan.flops_per_token * gbs_tokens / (t * cluster.gpus * peak)
    return Candidate(plan, True, t, mfu, times, model, cluster.gpus, cluster.gpus_per_node)


def shard_groups(cluster: Cluster, tp: int, cp: int, dp: int) -> list[int]:
    """HSDP shard-group sizes (`dp_shard`) to try beside FSDP over all `dp` ranks, largest
    first: the data-parallel ranks of one node (gpus_per_node / (tp x cp), when at least 2;
    the mesh puts dp_shard inside tp and cp, so such a group stays on NVLink) and that times
    2, 4, ... below `dp` and dividing it; the rest of `dp` replicates (dp_replicate > 1)."""
    if cluster.gpus_per_node % (tp * cp):
        return []
    node = cluster.gpus_per_node // (tp * cp)
    out, s = [], node
    while node >= 2 and s < dp:
        if dp % s == 0:
            out.append(s)
        s *= 2
    return out[::-1]


def _hsdp_variants(args: ModelArgs, cluster: Cluster, fsdp: Candidate, gbs_tokens: int,
                   refused: dict[str, int] | None) -> list[Candidate]:
    """The fastest HSDP layout that fits, of a fitting FSDP layout (`shard_groups`), if it is
    faster than the FSDP layout beyond a tie; and the ones planned on the way that did not fit.

    Only the data-parallel communication differs from the FSDP layout, so every shard group is
    timed on the FSDP layout's plan first and planned (memory) in order of speed: a smaller
    group holds more per rank (the states are sharded over fewer ranks), so one that does not
    fit rules out every smaller one; the first that fits is the layout's best HSDP (a slower
    one with less memory would rank below it and fits no better). Expert parallelism runs
    without replicas (the trainer's rule): MoE layouts with EP keep plain FSDP."""
    lay = fsdp.layout
    d = lay.dims
    if not lay.fsdp or d.ep > 1 or d.dp_replicate > 1:
        return []
    timed = []
    sp = stage_params(args, d.pp, d.tp, fsdp.plan.stage, lay.vpp, lay.schedule)
    rest = fsdp.step_time_s - fsdp.times["dp_comm_exposed"]  # what HSDP leaves as it is
    for s in shard_groups(cluster, d.tp, d.cp, d.dp):
        hsdp = lay.replace(dims=dataclasses.replace(d, dp_replicate=d.dp // s, dp_shard=s))
        t = rest + dp_comm_exposed(dataclasses.replace(fsdp.plan, layout=hsdp), cluster,
                                   fsdp.times["compute"], sp)
        if t < fsdp.step_time_s * TIE:
            timed.append((t, -s, hsdp))
    out: list[Candidate] = []
    too_small = 0  # shard groups this size and below do not fit
    for _, neg_s, hsdp in sorted(timed, key=lambda x: x[:2]):
        if -neg_s <= too_small:
            continue
        cand = _candidate(args, cluster, hsdp, gbs_tokens, fsdp.model, refused)
        if cand is None:
            continue
        out.append(cand)
        if cand.fits:
            break
        too_small = -neg_s
    return out


TIE = 0.995
"""Step times within ~0.5 % compare equal (`_bucket`)."""


def pipeline_schedules(pp: int, vpp: int) -> tuple[str, ...]:
    """The schedules tried for `pp` stages of `vpp` chunks per rank: 1F1B (Interleaved1F1B
    with chunks) and the zero-bubble ones, whose memory per stage the planner counts within
    10 % of the measured peak (docs/plan.md, "Pipeline memory per stage"):
    InterleavedZeroBubble (any chunks) and ZBVZeroBubble (2 chunks in a V)."""
    if pp == 1:
        return ("1F1B",)
    if vpp == 1:
        return ("1F1B", "InterleavedZeroBubble")
    return ("Interleaved1F1B", "InterleavedZeroBubble") + (("ZBVZeroBubble",) if vpp == 2
                                                           else ())


def _ep_degrees(args: ModelArgs, dp: int) -> list[int]:
    """Expert-parallel degrees to try: 1, and for an MoE model the powers of two that divide
    both the data-parallel degree (EP borrows its ranks) and the number of experts."""
    if not args.is_moe:
        return [1]
    out, ep = [1], 2
    while ep <= dp and dp % ep == 0 and args.n_experts % ep == 0:
        out.append(ep)
        ep *= 2
    return out


def rank_key(c: Candidate) -> tuple:
    """Fastest first; among equal times (within ~0.5 %) the simpler layout."""
    lay = c.layout
    return (_bucket(c.step_time_s), lay.zero, lay.dims.dp_replicate > 1 and lay.fsdp,
            RECOMPUTE_COST[lay.recompute], lay.dims.cp,
            lay.dims.pp, lay.vpp, lay.dims.tp, -lay.mbs)


SEQUENCE_PARALLEL_ARCHS = ("llama",)
"""The architectures the search runs sequence parallel. The trainer runs GPT-2 sequence
parallel too (`parallel/tp.py`), but the search keeps it off there until the trainer overlaps
its TP and ZeRO-0/1 collectives: with it, the published GPT layouts, timed with those
collectives exposed, rank far lower (docs/plan.md, "GPT-2 and sequence parallelism in the
search"; `bench/plan_calibration.py --gpt2-sp`)."""


def search(args: ModelArgs, cluster: Cluster, seq_len: int, gbs_tokens: int,
           base: Layout | None = None, max_zero: int = 3, model: str = "MODEL",
           refused: dict[str, int] | None = None,
           hsdp: bool = True) -> tuple[list[Candidate], list[Candidate]]:
    """(fitting layouts best first, all evaluated layouts). `max_zero` 1 restricts the search to
    replicated weights (DDP, ZeRO-1). Only layouts the trainer runs are evaluated; `model` is
    the name (preset or Hugging Face config path) the commands train."""
    base = (base or Layout()).replace(seq_len=seq_len)
    every = candidates(args, cluster, seq_len, gbs_tokens, base, max_zero=max_zero, model=model,
                       refused=refused, hsdp=hsdp)
    fitting = sorted((c for c in every if c.fits), key=rank_key)
    return fitting, every


def _bucket(t: float) -> float:
    """Step times within ~0.5 % compare equal, so ties go to the simpler layout."""
    return round(math.log(t) / 0.005) if t > 0 else 0.0


KNOBS = ("tp", "pp", "cp", "ep", "zero", "dp_shard", "recompute", "mbs", "vpp")


def knob(c: Candidate, name: str) -> object:
    lay = c.layout
    if name == "zero":
        return c.zero_label
    if name in ("tp", "pp", "cp", "ep", "dp_shard"):
        return getattr(lay.dims, name)
    return getattr(lay, name)


def alternatives(best: Candidate, every: list[Candidate]) -> list[tuple[str, Candidate]]:
    """For each knob, the best layout that differs from `best` in that knob only if one exists,
    else in that knob at least (fitting ones first)."""
    out = []
    for name in KNOBS:
        others = [c for c in every if knob(c, name) != knob(best, name)]
        if not others:
            continue
        same_rest = [c for c in others if all(knob(c, k) == knob(best, k)
                                              for k in KNOBS if k != name)]
        pool = same_rest or others
        pool.sort(key=lambda c: (not c.fits, c.step_time_s))
        out.append((name, pool[0]))
    return out


def why_lost(best: Candidate, alt: Candidate, usable_bytes: float) -> str:
    """One sentence: why `alt` ranks below `best`."""
    gib = 2**30
    if not alt.fits:
        return (f"does not fit: {alt.plan.peak_bytes / gib:.1f} GiB > "
                f"{usable_bytes / gib:.1f} GiB usable")
    if alt.step_time_s <= best.step_time_s * 1.005:
        return "as fast, but more complex (ties go to fewer sharding/recompute features)"
    deltas = {k: alt.times[k] - best.times.get(k, 0.0) for k in alt.times}
    worst = max(deltas, key=deltas.get)  # type: ignore[arg-type]
    slower = alt.step_time_s / best.step_time_s - 1
    extra = deltas[worst]
    amount = f"{extra:.2f} s" if extra >= 0.1 else f"{extra * 1e3:.3g} ms"
    return f"{slower:.0%} slower, mostly {worst.replace('_', ' ')} (+{amount})"
