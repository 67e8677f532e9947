"""Activation memory of one pipeline stage (rank) at its fullest moment, for its schedule.

Each chunk of the rank keeps, per micro-batch, its activations from its forward to its backward
(`activation_bytes` of its layers; the embedding's ids on the first chunk, the final norm, head
input and loss on the last, and the logits, the stage's output, which torch's stage keeps until
the micro-batch's backward: `held_logits_bytes`). Under a zero-bubble schedule the backward
is split: torch's input-gradient pass runs with the graph retained, so the activations stay
until the deferred weight-gradient pass, together with the gradients at every weight's node
(`deferred_weight_grad_bytes`), the stage input's gradient and the received output gradient;
only the loss's own tensors (log-softmax, targets) go with the detached loss. The first chunk
runs no input-gradient pass (torch's stage 0 does its whole backward in W). Checkpointed blocks
are counted as recomputed and kept (the retained graph holds what the recomputation saved).

The rank's peak is taken over the moments of its schedule's order (`pipeline_memory`); layouts
whose schedule torch would refuse (the planner still estimates them) use the closed forms of
`in_flight` over the stage's average chunk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scaletrain.models.args import ModelArgs
from scaletrain.parallel.feasibility import schedule_problems
from scaletrain.plan.memory.activations import (
    DTYPE_BYTES,
    ActivationBytes,
    ActivationSpec,
    activation_bytes,
    deferred_weight_grad_bytes,
    held_logits_bytes,
)
from scaletrain.plan.memory.pipeline import (
    FORWARD,
    SINGLE_CHUNK,
    ZERO_BUBBLE,
    ChunkBytes,
    chunk_ids,
    chunks_per_rank,
    in_flight,
    rank_peak,
)
from scaletrain.plan.memory.states import chunk_layers


@dataclass(frozen=True)
class StageActivations:
    """What one stage's activations come to at its fullest moment."""

    bytes: int
    """Held at the peak moment, plus the largest region rebuilt by recomputation."""
    per_microbatch: ActivationBytes
    """One micro-batch through all the stage's chunks (the breakdown `plan` prints)."""
    in_flight: float
    """Micro-batches held at the peak, in units of the stage's whole share of layers."""
    held: dict[str, int]
    """At the peak moment, micro-batches per chunk and state ('chunk 3 F', 'chunk 3 I')."""
    p2p_buffers: int = 0
    """torch's `PipelineStage` receive buffers: for every micro-batch of the step, one input
    buffer per chunk but the first and one output-gradient buffer per chunk but the last, each
    a boundary tensor (the residual stream of one micro-batch), allocated once and kept."""
    held_sends: int = 0
    """The multi-chunk schedules' runtime (`_PipelineScheduleRuntime`) waits for its sends only
    after the step's last action, so every output and input gradient a chunk sends to another
    rank stays alive until then: one boundary tensor per micro-batch and cross-rank send."""


def _sum(parts: list[ActivationBytes]) -> ActivationBytes:
    layers = {k: sum(p.layers[k] for p in parts) for k in parts[0].layers}
    return ActivationBytes(
        layers=layers, embedding=sum(p.embedding for p in parts),
        rope_tables=max(p.rope_tables for p in parts), head=sum(p.head for p in parts),
        loss=sum(p.loss for p in parts), recompute=max(p.recompute for p in parts),
        rope_tables_autograd=any(p.rope_tables_autograd for p in parts))


def _orders_schedule(schedule: str, pp: int, m: int, vpp: int) -> str | None:
    """The schedule whose order gives this layout's memory: its own, or Interleaved1F1B for a
    single-chunk schedule given virtual stages (as the planner always estimated them); None
    where torch would refuse it (the closed forms apply)."""
    if schedule in SINGLE_CHUNK and vpp > 1:
        schedule = "Interleaved1F1B"
    if schedule_problems(schedule, pp, vpp, m):
        return None
    return schedule


def stage_activations(args: ModelArgs, spec: ActivationSpec, pp: int, vpp: int,
                      schedule: str, microbatches: int, stage: int) -> StageActivations:
    """The activation bytes of pipeline stage `stage` at its peak under `schedule`."""
    v = chunks_per_rank(schedule, vpp) if pp > 1 else 1
    n = pp * v
    runs = chunk_layers(args, n)
    mine = chunk_ids(stage, pp, v, schedule) if pp > 1 else [0]
    acts = {c: activation_bytes(args, spec, runs[c], first_stage=c == 0, last_stage=c == n - 1)
            for c in mine}
    if pp > 1 and n - 1 in acts:  # torch's stage keeps its output, the logits, until backward
        last = acts[n - 1]
        acts[n - 1] = dataclasses.replace(last, head=last.head + held_logits_bytes(args, spec))
    whole = _sum(list(acts.values()))
    recompute = whole.recompute
    stage_layers = max(1, sum(len(runs[c]) for c in mine))
    boundary = _boundary(args, spec)
    buffers = 0
    sends = 0
    if pp > 1:
        ends = sum(c > 0 for c in mine) + sum(c < n - 1 for c in mine)
        buffers = boundary * microbatches * ends
        if schedule not in SINGLE_CHUNK or vpp > 1:  # the runtime holds what crosses ranks
            crossing = sum((c < n - 1 and c + 1 not in mine) + (c > 0 and c - 1 not in mine)
                           for c in mine)
            sends = boundary * microbatches * crossing
    order_of = _orders_schedule(schedule, pp, microbatches, vpp) if pp > 1 else None
    if order_of is None:
        flight = in_flight(pp, stage, microbatches, vpp, schedule)
        return StageActivations(int(whole.saved * flight) + recompute, whole, flight, {},
                                buffers, sends)
    # A held micro-batch's input on a chunk after the first is its receive buffer.
    received = {c: boundary if c > 0 else 0 for c in mine}
    chunks = {c: ChunkBytes(acts[c].saved - received[c], acts[c].saved - received[c])
              for c in mine}
    if schedule in ZERO_BUBBLE:
        chunks = _after_input(args, spec, runs, acts, received, mine)
    peak, moment = rank_peak(order_of, pp, microbatches, vpp, stage, chunks)
    flight = sum(k * len(runs[c]) for (c, _), k in moment.items()) / stage_layers
    held = {f"chunk {c} {'F' if s == FORWARD else 'I'}": k for (c, s), k in sorted(moment.items())}
    return StageActivations(peak + recompute, whole, flight, held, buffers, sends)


def _boundary(args: ModelArgs, spec: ActivationSpec) -> int:
    """Bytes of the tensor passed between stages: one micro-batch's residual stream."""
    return DTYPE_BYTES[spec.residual_dtype] * spec.norm_tokens * args.dim


def _after_input(args: ModelArgs, spec: ActivationSpec, runs: list[range],
                 acts: dict[int, ActivationBytes], received: dict[int, int],
                 mine: list[int]) -> dict[int, ChunkBytes]:
    """Each chunk's bytes after its forward and between its I and W passes (the output
    gradient it received stays in its receive buffer; an input gradient sent to another rank
    is in `held_sends`)."""
    boundary = _boundary(args, spec)
    plain = dataclasses.replace(spec, recompute="none")
    last = len(runs) - 1
    out = {}
    for c, act in acts.items():
        forward = act.saved - received[c]
        if c == 0:  # torch runs stage 0's whole backward in W: its activations wait for it
            out[c] = ChunkBytes(forward, forward)
            continue
        kept = activation_bytes(args, plain, runs[c], first_stage=False,
                                last_stage=c == last).saved - act.loss - received[c]
        w_inputs = deferred_weight_grad_bytes(args, spec, len(runs[c]), head=c == last)
        # ... and the stage input's gradient (`inp.grad`, kept with the input until W)
        local = boundary if c - 1 in mine else 0
        out[c] = ChunkBytes(forward, kept + w_inputs + local)
    return out
