"""An independent reference for the planner's pipeline bubble: the action order PyTorch's own
schedule classes (`torch.distributed.pipelining.schedules`, the ones the trainer runs) execute,
timed by a small event simulation.

- Multi-stage schedules (Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, LoopedBFS)
  compute their whole per-rank order when built (`pipeline_order`: F forward, I input-gradient,
  W weight-gradient, B full backward); they are built here over stand-in stages (the schedule
  reads only their indices and group), no process group and no model.
- Single-stage schedules (GPipe, 1F1B) decide their order while they run: each rank's
  `_step_microbatches` is run over a stage that records the forward and backward calls it gets
  (no communication: every send and receive is empty). Their `_get_pipeline_order` is only a
  drawing, and for 1F1B it differs from what runs (its last rank starts at micro-batch 1).

The simulation: a rank runs its actions in order, each as soon as the rank is free and its
inputs exist: F(s, i) after F(s-1, i); the backward (B or I) of (s, i) after its own F and the
backward of (s+1, i); W(s, i) after I(s, i). Costs per action (a chunk holds 1/v of a rank's
layers): F = `f`/v, I = `i`/v, W = `w`/v, B = (`i` + `w`)/v. Communication is free. The bubble
is the planner's quantity: idle time over busy time, (makespan - busy) / busy, with busy the
most loaded rank's compute (every rank does the same work here).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.pipelining import schedules as S

SCHEDULES = {"GPipe": S.ScheduleGPipe, "1F1B": S.Schedule1F1B,
             "Interleaved1F1B": S.ScheduleInterleaved1F1B,
             "LoopedBFS": S.ScheduleLoopedBFS,
             "InterleavedZeroBubble": S.ScheduleInterleavedZeroBubble,
             "ZBVZeroBubble": S.ScheduleZBVZeroBubble}


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str
    """F, I, W or B."""
    microbatch: int


def _stand_in(index: int, stages: int, pp: int, rank: int) -> SimpleNamespace:
    return SimpleNamespace(stage_index=index, num_stages=stages, group_size=pp,
                           group_rank=rank, is_first=index == 0, is_last=index == stages - 1,
                           submod=torch.nn.Identity())


class _RecordingStage:
    """A single-stage schedule's stage that records what it is asked to compute."""

    def __init__(self, index: int, pp: int, log: list[Action]) -> None:
        self.stage_index, self.num_stages, self.group_size = index, pp, pp
        self.group_rank, self.is_first, self.is_last = index, index == 0, index == pp - 1
        self.submod = torch.nn.Identity()
        self.log = log

    def forward_one_chunk(self, i: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.log.append(Action(self.stage_index, "F", i))
        return torch.zeros(())

    def backward_one_chunk(self, i: int, *args: Any, **kwargs: Any) -> None:
        self.log.append(Action(self.stage_index, "B", i))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("get_") and name.endswith("_ops"):
            return lambda *a, **k: []  # no communication
        return lambda *a, **k: None


def torch_order(schedule: str, pp: int, microbatches: int, vpp: int = 1
                ) -> tuple[dict[int, list[Action]], dict[int, int]]:
    """(each rank's compute actions in the order torch's schedule runs them, the rank of each
    stage)."""
    cls = SCHEDULES[schedule]
    loss = lambda out, target: out  # noqa: E731
    if issubclass(cls, S.PipelineScheduleSingle):
        order: dict[int, list[Action]] = {}
        for rank in range(pp):
            log: list[Action] = []
            sched = cls(_RecordingStage(rank, pp, log), n_microbatches=microbatches,
                        loss_fn=loss)
            sched._initialize_stage = lambda *a, **k: None  # nothing to shape-infer
            sched._internal_losses = [torch.zeros(())] * microbatches if rank == pp - 1 else []
            sched._maybe_compute_loss = lambda *a, **k: None
            sched._step_microbatches([()] * microbatches, [{}] * microbatches)
            order[rank] = log
        return order, {s: s for s in range(pp)}
    n = pp * vpp
    if schedule == "ZBVZeroBubble":  # V shape: rank r holds stages r and 2p - 1 - r
        owner = {s: (s if s < pp else n - 1 - s) for s in range(n)}
    else:  # looped: stage s on rank s mod p
        owner = {s: s % pp for s in range(n)}
    mine = [s for s in range(n) if owner[s] == 0]
    sched = cls([_stand_in(s, n, pp, 0) for s in mine], n_microbatches=microbatches,
                loss_fn=loss)
    order = {}
    for rank, actions in sched.pipeline_order.items():
        order[rank] = [Action(a.stage_index, a.computation_type.value, a.microbatch_index)
                       for a in actions if a is not None
                       and a.computation_type.value in ("F", "I", "W", "B")]
    return order, owner


def simulate(order: dict[int, list[Action]], owner: dict[int, int], vpp: int,
             f: float = 1.0, i: float = 1.0, w: float = 1.0) -> float:
    """The bubble of `order`: (makespan - busy) / busy of the most loaded rank."""
    cost = {"F": f / vpp, "I": i / vpp, "W": w / vpp, "B": (i + w) / vpp}
    stages = len(owner)
    done: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(order, 0.0)
    nxt = dict.fromkeys(order, 0)

    def ready(a: Action) -> float | None:
        need = []
        if a.kind == "F" and a.stage > 0:
            need.append(("F", a.stage - 1, a.microbatch))
        if a.kind in ("B", "I"):
            need.append(("F", a.stage, a.microbatch))
            if a.stage < stages - 1:
                need.append(("G", a.stage + 1, a.microbatch))  # its input gradient
        if a.kind == "W":
            need.append(("G", a.stage, a.microbatch))
        times = [done.get(k) for k in need]
        return None if any(t is None for t in times) else max(times, default=0.0)

    remaining = sum(len(v) for v in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while nxt[rank] < len(actions):
                a = actions[nxt[rank]]
                t = ready(a)
                if t is None:
                    break
                end = max(t, free[rank]) + cost[a.kind]
                free[rank] = end
                done[(a.kind, a.stage, a.microbatch)] = end
                if a.kind in ("B", "I"):
                    done[("G", a.stage, a.microbatch)] = end
                nxt[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's order deadlocks")
    busy = max(sum(cost[a.kind] for a in actions) for actions in order.values())
    return (max(free.values()) - busy) / busy


def torch_bubble(schedule: str, pp: int, microbatches: int, vpp: int = 1,
                 f: float = 1.0, i: float = 1.0, w: float = 1.0) -> float:
    """The simulated bubble of torch's `schedule` (module docstring)."""
    order, owner = torch_order(schedule, pp, microbatches, vpp)
    return simulate(order, owner, vpp, f, i, w)
