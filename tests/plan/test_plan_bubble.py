"""The planner's pipeline bubble against the schedules the trainer runs: the action order of
torch's own schedule classes, timed by an event simulation (tests/helpers/pipeline_reference.py),
for every schedule `parallel.pp_schedule` offers at a few (p, m, v).

Stated costs: a forward, an input-gradient and a weight-gradient pass of a micro-batch take
equal time on a stage (T_F = T_B = T_W, the zero-bubble paper's assumption and the planner's
`ZERO_BUBBLE_COSTS`); a full backward takes T_B + T_W; a chunk of v takes 1/v of that;
communication is free. Tolerance: 1e-9 (the formulas are exact for these orders).
"""

from __future__ import annotations

import pytest

from scaletrain.models.args import get_preset
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.feasibility import SCHEDULE_NAMES
from scaletrain.plan.estimate import ZERO_BUBBLE_COSTS, bubble_fraction, estimate
from scaletrain.plan.layout import Layout
from tests.helpers.pipeline_reference import torch_bubble, torch_order

# (schedule, v): every schedule the trainer offers, with the chunks per rank it accepts
SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 4),
             ("LoopedBFS", 2), ("InterleavedZeroBubble", 1), ("InterleavedZeroBubble", 2),
             ("InterleavedZeroBubble", 4), ("ZBVZeroBubble", 2)]
PM = [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 24)]


def test_every_schedule_the_trainer_offers_is_covered() -> None:
    assert {name for name, _ in SCHEDULES} == set(SCHEDULE_NAMES)


@pytest.mark.parametrize("schedule,v", SCHEDULES, ids=[f"{s}-v{v}" for s, v in SCHEDULES])
@pytest.mark.parametrize("p,m", PM, ids=[f"p{p}-m{m}" for p, m in PM])
def test_bubble_equals_torchs_schedule(schedule: str, v: int, p: int, m: int) -> None:
    simulated = torch_bubble(schedule, p, m, v, *ZERO_BUBBLE_COSTS)
    assert bubble_fraction(p, m, v, schedule) == pytest.approx(simulated, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("costs", [(1.0, 1.5, 0.5), (1.0, 2.0, 1.0), (1.0, 1.0, 0.5)])
@pytest.mark.parametrize("p,m,v", [(4, 8, 1), (4, 8, 2), (8, 16, 2)])
def test_zb1p_formula_holds_for_unequal_pass_times(costs: tuple[float, float, float], p: int,
                                                   m: int, v: int) -> None:
    """Qi et al.'s ZB-H1 bubble, (p-1)(T_F + T_B - T_W), is what torch's ZB1P order gives
    whatever the three times; 1F1B's does not depend on them."""
    f, b, w = costs
    want = bubble_fraction(p, m, v, "InterleavedZeroBubble", costs)
    assert want == pytest.approx((p - 1) * (f + b - w) / (v * m * (f + b + w)))
    assert torch_bubble("InterleavedZeroBubble", p, m, v, f, b, w) == pytest.approx(want)
    assert torch_bubble("1F1B", p, m, 1, f, b, w) == pytest.approx((p - 1) / m)


def test_zero_bubble_schedules_split_the_backward_and_1f1b_does_not() -> None:
    """The reference reads what torch runs: I and W actions for the zero-bubble schedules,
    full backwards (B) for the others, every micro-batch once per stage."""
    for schedule, v in SCHEDULES:
        order, owner = torch_order(schedule, 4, 8, v)
        kinds = {a.kind for actions in order.values() for a in actions}
        split = schedule in ("InterleavedZeroBubble", "ZBVZeroBubble")
        assert kinds == ({"F", "I", "W"} if split else {"F", "B"}), schedule
        forwards = sorted((a.stage, a.microbatch) for acts in order.values() for a in acts
                          if a.kind == "F")
        assert forwards == [(s, i) for s in range(len(owner)) for i in range(8)]


def test_the_plan_and_the_search_charge_zero_bubble_schedules_less() -> None:
    """A plan under a zero-bubble schedule states its own bubble (it was charged 1F1B's)."""
    args = get_preset("llama3-8b")
    base = Layout(dims=ParallelDims(pp=4, dp_shard=2), zero=1, mbs=1, seq_len=4096, gbs=32)
    one = estimate(args, base)
    zb = estimate(args, base.replace(schedule="InterleavedZeroBubble"))
    assert one.bubble_fraction == pytest.approx(3 / 16)
    assert zb.bubble_fraction == pytest.approx(3 / 16 / 3)
    zbv = estimate(args, base.replace(schedule="ZBVZeroBubble", vpp=2))
    assert zbv.bubble_fraction == pytest.approx(3 / (3 * 2 * 16))
