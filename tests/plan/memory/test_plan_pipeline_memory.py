"""Pipeline memory per stage (issue 33): each stage's peak under its schedule, the most loaded
rank's peak their maximum, and the zero-bubble schedules' deferred weight-gradient inputs.

References: Megatron's closed forms for 1F1B and interleaved in-flight micro-batches; the action
order torch's own schedule classes run (tests/helpers/pipeline_reference.py, which runs the
single-chunk schedules' `_step_microbatches`), walked here independently of the planner's walk;
torch's `stage_backward_input`, whose kept gradients are counted tensor by tensor. The measured
peaks per rank are bench/pp_schedule_memory_cpu.py's (2 CPU ranks; too slow for a test).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input

from scaletrain.models.args import get_preset
from scaletrain.models.transformer import Transformer
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.pp import stage_ids
from scaletrain.plan.estimate import estimate
from scaletrain.plan.layout import Layout, PlanError
from scaletrain.plan.memory.activations import ActivationSpec, deferred_weight_grad_bytes
from scaletrain.plan.memory.pipeline import FORWARD, INPUT_DONE, ChunkBytes, chunk_ids, rank_peak
from tests.helpers.pipeline_reference import torch_order

# (schedule, v) the trainer runs, at (p, m) torch accepts for all of them
SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 4),
             ("LoopedBFS", 2), ("InterleavedZeroBubble", 1), ("InterleavedZeroBubble", 2),
             ("ZBVZeroBubble", 2)]
PM = [(2, 4), (4, 8), (4, 12)]


def _reference_peak(schedule: str, p: int, m: int, v: int, rank: int,
                    weights: dict[tuple[int, str], int]) -> int:
    """The most bytes `rank` holds after any action of torch's order (the reference's)."""
    order, _ = torch_order(schedule, p, m, v)
    held: dict[tuple[int, int], str] = {}
    best = 0
    for a in order[rank]:
        if a.kind in ("F", "I"):
            held[(a.stage, a.microbatch)] = FORWARD if a.kind == "F" else INPUT_DONE
        else:
            held.pop((a.stage, a.microbatch), None)
        best = max(best, sum(weights[(c, s)] for (c, _), s in held.items()))
    return best


@pytest.mark.parametrize("schedule,v", SCHEDULES, ids=[f"{s}-v{v}" for s, v in SCHEDULES])
@pytest.mark.parametrize("p,m", PM, ids=[f"p{p}-m{m}" for p, m in PM])
def test_rank_peak_equals_torchs_order_walked(schedule: str, v: int, p: int, m: int) -> None:
    """Whatever each chunk and state weighs, the planner's peak of every rank is the largest
    total the reference's walk of torch's order reaches."""
    rng = random.Random(f"{schedule}{v}{p}{m}")
    for rank in range(p):
        chunks = {c: ChunkBytes(rng.randint(1, 1000), rng.randint(1, 1000))
                  for c in chunk_ids(rank, p, v, schedule)}
        weights = {(c, s): (b.forward if s == FORWARD else b.after_input)
                   for c, b in chunks.items() for s in (FORWARD, INPUT_DONE)}
        peak, moment = rank_peak(schedule, p, m, v, rank, chunks)
        assert peak == _reference_peak(schedule, p, m, v, rank, weights)
        assert all(c in chunks for c, _ in moment)


@pytest.mark.parametrize("schedule,v", [("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2),
                                        ("ZBVZeroBubble", 2)])
def test_long_steps_peak_as_their_first_2p_microbatches(schedule: str, v: int) -> None:
    """The planner reads the periodic schedules' moments from an order of 2p micro-batches:
    the peak of the whole order (walked by the reference) is the same."""
    p, m = 4, 24
    rng = random.Random(schedule)
    for rank in range(p):
        chunks = {c: ChunkBytes(rng.randint(1, 1000), rng.randint(1, 1000))
                  for c in chunk_ids(rank, p, v, schedule)}
        weights = {(c, s): (b.forward if s == FORWARD else b.after_input)
                   for c, b in chunks.items() for s in (FORWARD, INPUT_DONE)}
        assert rank_peak(schedule, p, m, v, rank, chunks)[0] \
            == _reference_peak(schedule, p, m, v, rank, weights)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_unit_chunks_give_megatrons_in_flight_counts(p: int, m: int) -> None:
    """1F1B stage s holds p - s micro-batches, GPipe all m, Interleaved1F1B with v chunks
    2(p - 1 - s) + (v - 1)p + 1 chunk micro-batches (Narayanan et al. 2021)."""
    for s in range(p):
        one = {s: ChunkBytes(1, 1)}
        assert rank_peak("1F1B", p, m, 1, s, one)[0] == p - s
        assert rank_peak("GPipe", p, m, 1, s, one)[0] == m
        for v in (2, 4):
            unit = {c: ChunkBytes(1, 1) for c in chunk_ids(s, p, v, "Interleaved1F1B")}
            assert rank_peak("Interleaved1F1B", p, m, v, s, unit)[0] \
                == 2 * (p - 1 - s) + (v - 1) * p + 1


def test_the_planners_chunks_are_the_trainers() -> None:
    for schedule, v in SCHEDULES:
        for r in range(4):
            want = stage_ids(r, 4, v, schedule)
            assert chunk_ids(r, 4, v if schedule != "ZBVZeroBubble" else 2, schedule) == want


def _pp_plan(schedule: str, vpp: int = 1, pp: int = 4, gbs: int = 16):
    args = get_preset("llama3-8b")
    lay = Layout(dims=ParallelDims(pp=pp), mbs=1, gbs=gbs, seq_len=4096, zero=0,
                 schedule=schedule, vpp=vpp)
    return estimate(args, lay)


def test_each_stage_planned_and_the_peak_is_their_maximum() -> None:
    plan = _pp_plan("1F1B")
    stages = plan.stages
    assert [s["stage"] for s in stages] == [0, 1, 2, 3]
    peaks = [s["memory_bytes"]["peak"] for s in stages]
    assert plan.peak_bytes == max(peaks)
    assert plan.memory_bytes == stages[plan.stage]["memory_bytes"]
    first, last = stages[0], stages[-1]
    # the embedding on the first stage, final norm + head and the loss buffers on the last
    assert first["embedding"] and not first["head"] and first["memory_bytes"]["logits_loss"] == 0
    assert last["head"] and not last["embedding"] and last["memory_bytes"]["logits_loss"] > 0
    # 1F1B: stage s holds p - s micro-batches, so the activations fall stage by stage
    assert [s["in_flight_microbatches"] for s in stages] == [4, 3, 2, 1]
    acts = [s["memory_bytes"]["activations"] for s in stages]
    assert acts[0] > acts[1] > acts[2] > acts[3]
    # stage 0's four micro-batches are not added to the last stage's loss (two ranks)
    assert plan.peak_bytes < first["memory_bytes"]["peak"] + last["memory_bytes"]["logits_loss"]
    assert plan.to_json()["stages"] == stages


def test_zbv_holds_both_ends_on_the_first_rank() -> None:
    """ZBVZeroBubble's V puts the first and the last chunk on rank 0, as the trainer does: the
    embedding, the head and the loss buffers are all there."""
    plan = _pp_plan("ZBVZeroBubble", vpp=2)
    first = plan.stages[0]
    assert first["embedding"] and first["head"] and first["memory_bytes"]["logits_loss"] > 0
    assert not any(s["head"] or s["embedding"] for s in plan.stages[1:])
    assert plan.stage == 0


def test_zero_bubble_holds_more_than_1f1b_on_the_rank_with_the_last_chunk() -> None:
    """InterleavedZeroBubble keeps each micro-batch's activations and weight-gradient inputs
    from its input-gradient pass to its deferred weight-gradient pass."""
    one = _pp_plan("Interleaved1F1B", vpp=2)
    zb = _pp_plan("InterleavedZeroBubble", vpp=2)
    assert zb.stages[-1]["memory_bytes"]["activations"] \
        > one.stages[-1]["memory_bytes"]["activations"]
    assert any(k.endswith(" I") for k in zb.stages[-1]["held_at_peak"])
    assert not any(k.endswith(" I") for s in one.stages for k in s["held_at_peak"])


@pytest.mark.parametrize("name,precision", [
    ("debug", "fp32"), ("debug", "autocast"), ("debug", "bf16"), ("debug-qwen3", "bf16"),
    ("debug-gemma2", "autocast"), ("debug-moe", "fp32")])
def test_deferred_weight_grad_bytes_equal_what_torch_keeps(name: str, precision: str) -> None:
    """torch's `stage_backward_input` keeps, for the deferred W pass, the gradient at every
    weight's node: counted tensor by tensor (each storage once) for a 2-block chunk without
    and with the head and loss."""
    args = dataclasses.replace(get_preset(name), n_layers=2)
    torch.manual_seed(0)
    model = Transformer(args)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = model.to(dtype)
    b, s = 2, 16
    spec = ActivationSpec(mbs=b, seq_len=s, kernels="cpu",
                          compute_dtype="fp32" if precision == "fp32" else "bf16",
                          residual_dtype="bf16" if precision == "bf16" else "fp32")
    for head in (False, True):
        x = torch.randn(b, s, args.dim, requires_grad=True, dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            out = model.forward_part(x, list(model.layers.keys()), embed=False, head=head)
            if head:
                targets = torch.randint(0, args.vocab_size, (b * s,))
                loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), targets)
        outputs, grads = ([loss], None) if head else ([out], [torch.randn_like(out)])
        _, groups = stage_backward_input(outputs, grads, [x], iter(list(model.parameters())))
        kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for g in groups for per_node in g["grads"] for t in per_node if t is not None}
        assert sum(kept.values()) == deferred_weight_grad_bytes(args, spec, 2, head), head


def test_receive_buffers_and_held_sends_grow_with_the_microbatches() -> None:
    """torch's PipelineStage keeps a receive buffer per micro-batch for each chunk's input
    (not the first chunk's) and output gradient (not the last's); the multi-chunk runtime
    holds what it sends to other ranks until the step ends, single-chunk 1F1B does not."""
    args = get_preset("llama3-8b")
    boundary = 4 * 4096 * args.dim  # fp32 residual stream of one 4096-token micro-batch
    for m in (8, 16):
        one = _pp_plan("1F1B", gbs=m).stages
        assert [s["memory_bytes"]["pipeline_buffers"] for s in one] == \
            [m * boundary, 2 * m * boundary, 2 * m * boundary, m * boundary]
        assert not any("pipeline_sends" in s["memory_bytes"] for s in one)
        inter = _pp_plan("Interleaved1F1B", vpp=2, gbs=m).stages
        # every chunk but the model's ends receives and sends both ways, across ranks
        assert [s["memory_bytes"]["pipeline_sends"] for s in inter] == \
            [3 * m * boundary, 4 * m * boundary, 4 * m * boundary, 3 * m * boundary]
        zbv = _pp_plan("ZBVZeroBubble", vpp=2, gbs=m).stages
        # the V's turn (chunks 3 and 4 on rank 3) passes on the same rank: no send there
        assert zbv[3]["memory_bytes"]["pipeline_sends"] == 2 * m * boundary


def test_schedule_runs_bound_what_a_stage_holds_at_a_bubble_per_run() -> None:
    """`parallel.pp_microbatches` k < m runs the schedule m / k times per step: a stage holds
    what a k-micro-batch step holds (receive buffers, in-flight micro-batches), the bubble is
    (p - 1) / k, and FSDP reduces once per run, its reduced shards beside the unsharded
    gradients of the run (`tests/parallel/distributed/test_reductions_per_step.py` counts the
    trainer's reductions and receive buffers; `test_parity.py` `pp-1f1b-runs`, `pp-x-fsdp-runs`)."""
    args = get_preset("llama3-8b")

    def plan(gbs: int, runs_of: int | None, zero: int = 0, dp: int = 1):
        lay = Layout(dims=ParallelDims(pp=4, dp_shard=dp), mbs=1, gbs=gbs * dp, seq_len=4096,
                     zero=zero, pp_microbatches=runs_of)
        return estimate(args, lay)

    whole, runs, short = plan(32, None), plan(32, 8), plan(8, None)
    buffers = "pipeline_buffers"
    assert runs.memory_bytes[buffers] == short.memory_bytes[buffers] \
        == whole.memory_bytes[buffers] // 4
    # 1F1B holds p - s micro-batches however many a run has
    assert runs.memory_bytes["activations"] == whole.memory_bytes["activations"]
    assert runs.bubble_fraction == short.bubble_fraction > whole.bubble_fraction
    fsdp_whole, fsdp_runs = plan(32, None, zero=3, dp=8), plan(32, 8, zero=3, dp=8)
    rs = fsdp_whole.comm_bytes_per_step["reduce_scatter"]
    assert fsdp_runs.comm_bytes_per_step["reduce_scatter"] == pytest.approx(4 * rs)
    sharded = fsdp_whole.memory_bytes["gradients"] / 8  # the fp32 gradients sharded over 8
    assert fsdp_runs.memory_bytes["gradients"] == pytest.approx(
        fsdp_whole.memory_bytes["gradients"] + sharded)
    with pytest.raises(PlanError, match="must divide the accumulation steps"):
        plan(32, 6)


def test_advice_runs_the_schedule_over_fewer_micro_batches_where_buffers_do_not_fit() -> None:
    """llama3-70b, TP 8 x PP 4 (v 2) x DP 2, 256 micro-batches of 8,192 tokens: torch's receive
    buffers and held sends (32 GiB each) do not fit an H100; the advice runs the schedule over
    the largest divisor of the micro-batches that fits, at its bubble's cost."""
    from scaletrain.plan.search.advice import RUNS_FLAG, advise

    args = get_preset("llama3-70b")
    lay = Layout(dims=ParallelDims(pp=4, dp_shard=2, tp=8), mbs=1, gbs=512, seq_len=8192,
                 zero=1, vpp=2, schedule="Interleaved1F1B", sequence_parallel=True,
                 recompute="partial")
    plan = estimate(args, lay)
    budget = 74 * 2**30
    assert plan.peak_bytes > budget
    runs = [a for a in advise(plan, budget, limit=50) if a.change.startswith(RUNS_FLAG)]
    assert len(runs) == 1
    (best,) = runs
    k = best.plan.layout.pipeline_microbatches
    assert best.plan.peak_bytes <= budget and 256 % k == 0 and k < 256
    assert best.bubble_cost > 0 and not best.plan.trainer_problems
    larger = lay.replace(pp_microbatches=2 * k) if 2 * k < 256 else lay
    assert estimate(args, larger).peak_bytes > budget  # the largest that fits
