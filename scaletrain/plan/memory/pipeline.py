"""What each pipeline rank holds at its fullest moment, for the schedule torch runs.

A rank of a pipeline runs its chunks' (stages') passes in the order its schedule gives: F the
forward of a micro-batch, B its full backward, or, under the zero-bubble schedules, I its
input-gradient pass and W its deferred weight-gradient pass. Between F and its backward a
chunk keeps the micro-batch's activations; under a zero-bubble schedule, between I and W it
keeps what the W pass needs (`ChunkBytes.after_input`). This module walks each rank's order
and returns the moments that could be its fullest (the count of micro-batches of each chunk in
each state, none covered by another), so a peak in bytes is a maximum over a few dot
products whatever the bytes of each chunk.

The orders: GPipe (every forward, then every backward: m held) and 1F1B (p - r warm-up
forwards, then one backward per forward: p - r held) in closed form, as torch's
`ScheduleGPipe` / `Schedule1F1B` run them; the multi-chunk schedules (Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble) are read from torch's own schedule classes
(`pipeline_order`, built over stand-in stages: the schedule reads only their indices).
tests/plan/memory/test_plan_pipeline_memory.py checks the counts against Megatron's closed forms and
tests/helpers/pipeline_reference.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import numpy as np

FORWARD = "F"
"""A chunk's micro-batch after its forward, before any backward."""
INPUT_DONE = "I"
"""After its input-gradient pass, before its weight-gradient pass (zero-bubble schedules)."""
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")
SINGLE_CHUNK = ("GPipe", "1F1B")

State = tuple[int, str]
"""(global chunk index, FORWARD or INPUT_DONE)."""


def chunk_ids(rank: int, pp: int, vpp: int, schedule: str) -> list[int]:
    """Global chunk (stage) indices a pipeline rank holds: looped (r, r + p, ...) or, under
    ZBVZeroBubble, a V (r and 2p - 1 - r); the trainer's `parallel.pp.stage_ids`."""
    if schedule == "ZBVZeroBubble":
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(vpp)]


def chunks_per_rank(schedule: str, vpp: int) -> int:
    """Chunks each rank holds: `vpp` (a single-chunk schedule given more is estimated as
    Interleaved1F1B), and always 2 under ZBVZeroBubble."""
    return 2 if schedule == "ZBVZeroBubble" else vpp


def in_flight(pp: int, stage: int, microbatches: int, vpp: int, schedule: str) -> float:
    """Micro-batches of activations a stage holds at its peak, in units of its whole share.

    GPipe: all m. 1F1B: p - stage (at most m). Interleaved with v chunks: Megatron's warm-up of
    2(p-1) + (v-1)p + 1 chunk forwards on the first stage, each 1/v of the stage's layers.
    """
    if pp <= 1:
        return 1.0
    if schedule == "GPipe":
        return float(microbatches)
    if vpp > 1:
        chunks = 2 * (pp - 1 - stage) + (vpp - 1) * pp + 1
        return min(chunks, microbatches * vpp) / vpp
    return float(min(pp - stage, microbatches))


@lru_cache(maxsize=256)
def rank_orders(schedule: str, pp: int, m: int, vpp: int) -> dict[int, tuple]:
    """Each rank's compute actions (chunk, kind, micro-batch) in the order a multi-chunk
    schedule runs them."""
    from torch import nn  # noqa: PLC0415 (torch only for the multi-chunk schedules)
    from torch.distributed.pipelining import schedules

    classes = {"Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
               "LoopedBFS": schedules.ScheduleLoopedBFS,
               "InterleavedZeroBubble": schedules.ScheduleInterleavedZeroBubble,
               "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble}
    if schedule not in classes:
        raise ValueError(f"unknown pipeline schedule '{schedule}'")

    class ComputeOrder(classes[schedule]):  # type: ignore[misc,valid-type]
        def _prepare_schedule_with_comms(self, actions: Any, format: str = "") -> None:
            """Only the compute order (`pipeline_order`, set before this is called) is read
            here: skip lowering it to a runtime schedule with communication (slow)."""

    v = chunks_per_rank(schedule, vpp)
    n = pp * v
    stand_ins = [SimpleNamespace(stage_index=s, num_stages=n, group_size=pp, group_rank=0,
                                 is_first=s == 0, is_last=s == n - 1, submod=nn.Identity())
                 for s in chunk_ids(0, pp, v, schedule)]
    sched = ComputeOrder(stand_ins, n_microbatches=m, loss_fn=lambda out, target: out)
    return {rank: tuple((a.stage_index, a.computation_type.value, a.microbatch_index)
                        for a in actions if a is not None
                        and a.computation_type.value in ("F", "I", "W", "B"))
            for rank, actions in sched.pipeline_order.items()}


PERIODIC = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
"""Schedules whose steady state repeats every p micro-batches: past 2p micro-batches (a
multiple of p) more of them add no new moment (tests/plan/memory/test_plan_pipeline_memory.py checks
it against the whole order), so their moments are read from an order of 2p."""


@dataclass(frozen=True)
class Moments:
    """Moments of a rank that could hold the most: micro-batches held per (chunk, state)."""

    states: tuple[State, ...]
    counts: np.ndarray
    """One row per moment, one column per state of `states`; no row covered by another."""


def peak_moments(schedule: str, pp: int, m: int, vpp: int, rank: int) -> Moments:
    """The moments of `rank` that could hold the most (after each action; none covered by
    another): with non-negative bytes per chunk and state, the rank's peak is one of them."""
    if schedule in PERIODIC and m > 2 * pp and m % pp == 0:
        m = 2 * pp
    return _peak_moments(schedule, pp, m, vpp, rank)


@lru_cache(maxsize=4096)
def _peak_moments(schedule: str, pp: int, m: int, vpp: int, rank: int) -> Moments:
    if schedule in SINGLE_CHUNK:  # GPipe: all m; 1F1B: its p - r warm-up forwards
        held_mbs = m if schedule == "GPipe" else min(pp - rank, m)
        return Moments(((rank, FORWARD),), np.array([[held_mbs]], dtype=np.int64))
    actions = rank_orders(schedule, pp, m, vpp)[rank]
    now: dict[State, int] = {}
    held: dict[tuple[int, int], str] = {}
    seen: set[tuple[tuple[State, int], ...]] = set()
    for i, (chunk, kind, mb) in enumerate(actions):
        before = held.pop((chunk, mb), None)
        if before is not None:
            now[(chunk, before)] -= 1
        if kind in ("F", "I"):  # B or W free the micro-batch's memory on this chunk
            state = FORWARD if kind == "F" else INPUT_DONE
            held[(chunk, mb)] = state
            now[(chunk, state)] = now.get((chunk, state), 0) + 1
        # a run of forwards only adds: the moment before the next other action covers it
        if kind == "F" and i + 1 < len(actions) and actions[i + 1][1] == "F":
            continue
        seen.add(tuple(sorted((k, n) for k, n in now.items() if n)))
    states = tuple(sorted({k for moment in seen for k, _ in moment}))
    column = {k: j for j, k in enumerate(states)}
    counts = np.zeros((len(seen), len(states)), dtype=np.int64)
    for row, moment in enumerate(seen):
        for k, n in moment:
            counts[row, column[k]] = n
    counts = np.unique(counts, axis=0)
    if len(counts) <= 4096:  # drop the moments another one covers (all counts >=)
        covers = (counts[:, None, :] >= counts[None, :, :]).all(axis=-1)
        np.fill_diagonal(covers, False)
        counts = counts[~covers.any(axis=0)]
    return Moments(states, counts)


@dataclass(frozen=True)
class ChunkBytes:
    """What one micro-batch keeps on one chunk: after its forward, and (zero-bubble schedules)
    between its input-gradient and weight-gradient passes."""

    forward: int
    after_input: int


def rank_peak(schedule: str, pp: int, m: int, vpp: int, rank: int,
              chunks: Mapping[int, ChunkBytes]) -> tuple[int, dict[State, int]]:
    """(the most bytes `rank` holds at once, the moment that holds them: micro-batches per
    chunk and state)."""
    moments = peak_moments(schedule, pp, m, vpp, rank)
    weights = np.array([chunks[c].forward if s == FORWARD else chunks[c].after_input
                        for c, s in moments.states], dtype=np.int64)
    totals = moments.counts @ weights
    best = int(totals.argmax())
    return max(int(totals[best]), 0), {k: int(n) for k, n in
                                       zip(moments.states, moments.counts[best]) if n}
