"""Pipeline parallelism: split the model into stages and run a torch.distributed.pipelining
schedule over micro-batches.

Stage `s` of `S = pp x virtual_stages` holds a contiguous, balanced run of layers; stage 0 also
holds the embedding, stage S-1 the final norm and head. A rank keeps one copy of the model with
every other part removed (parameter names stay those of the full model, so checkpoints reshard
across layouts), and each of its stages is a thin view over that copy.

A tied head (`model.tie_embeddings`) is held by both ends, as Megatron does: the rank of the
last stage keeps the embedding module too (unused in its forward), so its head shares that
weight under the same name as in one process; after backward the two copies' gradients are
summed over the embedding group (`embedding_group_ranks`, `Parallelism.reduce_tied_gradients`)
and both ranks take the same update, so the copies stay equal. A checkpoint holds the tensor
once (both ranks write it under `tok_embeddings.weight`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from scaletrain.parallel.feasibility import SINGLE_STAGE, schedule_problems  # noqa: F401

log = logging.getLogger(__name__)

SCHEDULES: dict[str, type] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
}


def stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """Global stage indices of this rank: looped (r, r+p, ...) or V-shaped for ZBV."""
    if schedule == "ZBVZeroBubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual)]


def tied_stage_ranks(pp: int, virtual: int, schedule: str) -> tuple[int, int]:
    """The pipeline ranks holding the first stage (the embedding) and the last one (the
    head)."""
    last = pp * virtual - 1
    owner = next(r for r in range(pp) if last in stage_ids(r, pp, virtual, schedule))
    return 0, owner


def embedding_group_ranks(mesh_ranks: torch.Tensor, pp_dim: int, pp: int, virtual: int,
                          schedule: str) -> list[list[int]]:
    """For each pipeline (every coordinate of the other mesh dimensions), the global ranks of
    its first and last stage: the groups that sum a tied embedding's gradients (Megatron's
    embedding group). Empty when one rank holds both ends."""
    first, last = tied_stage_ranks(pp, virtual, schedule)
    if first == last:
        return []
    rows = mesh_ranks.movedim(pp_dim, -1).reshape(-1, pp)
    return [[int(row[first]), int(row[last])] for row in rows]


def split_layers(layer_ids: list[str], n_stages: int) -> list[list[str]]:
    """Contiguous runs of layers, sizes differing by at most one (earlier stages get more)."""
    base, extra = divmod(len(layer_ids), n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(layer_ids[start:start + size])
        start += size
    return out


@dataclass(frozen=True)
class StageSpec:
    index: int
    layers: tuple[str, ...]
    embed: bool
    head: bool


def prune_for_stages(model: nn.Module, pp_rank: int, pp: int, virtual: int,
                     schedule: str) -> list[StageSpec]:
    """Remove from `model` every part no stage of this rank holds; return this rank's stages."""
    n_stages = pp * virtual
    runs = split_layers(list(model.layers.keys()), n_stages)
    specs = [StageSpec(s, tuple(runs[s]), s == 0, s == n_stages - 1)
             for s in stage_ids(pp_rank, pp, virtual, schedule)]
    keep = {layer for spec in specs for layer in spec.layers}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    tied_head = model.args.tie_embeddings and any(spec.head for spec in specs)
    if not any(spec.embed for spec in specs) and not tied_head:
        model.tok_embeddings = None
    if not any(spec.head for spec in specs):
        model.norm = None
        model.output = None
    return specs


class StageModule(nn.Module):
    """One pipeline stage: a view over the rank's (pruned) model running some of its layers."""

    def __init__(self, model: nn.Module, spec: StageSpec, seq_shards: int = 1,
                 cp: tuple[int, int, bool] | None = None) -> None:
        super().__init__()
        # Under sequence parallelism the hidden state between stages is this rank's slice of
        # the sequence: RoPE positions must span the full length.
        self.seq_shards = seq_shards
        # The run's autocast, entered around each stage forward (the schedule runs backward
        # outside it): set by `Parallelism.attach_pipeline`.
        self.autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        # Under context parallelism (rank, degree, load balance) the stage sees this rank's
        # chunks of the sequence, at their absolute positions.
        self.cp = cp
        # The last stage returns the final-norm hidden states instead of the logits when the
        # loss applies the head itself (`training.fused_loss`); set by `attach_pipeline`.
        self.hidden = False
        object.__setattr__(self, "_model", model)  # not a child: its names stay the model's
        self.spec = spec
        self.layers = nn.ModuleDict({i: model.layers[i] for i in spec.layers})
        if spec.embed:
            self.tok_embeddings = model.tok_embeddings
        if spec.head:
            self.norm, self.output = model.norm, model.output
            if model.args.tie_embeddings and not spec.embed:
                # the head's weight is the embedding's: FSDP sees both names of the shared
                # parameter in this stage (the module is never called here)
                self.tok_embeddings = model.tok_embeddings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_len = x.shape[1] * (1 if self.spec.embed else self.seq_shards)
        if self.cp is not None:
            from scaletrain.parallel.cp import local_positions

            rank, degree, balance = self.cp
            positions = local_positions(seq_len * degree, rank, degree, balance, x.device)
        else:
            positions = torch.arange(seq_len, device=x.device)
        hidden = self.hidden and self.spec.head
        with self.autocast():
            h = self._model.forward_part(x, self.spec.layers, embed=self.spec.embed,
                                         head=self.spec.head and not hidden, positions=positions)
            return self._model.norm(h) if hidden else h


def build_schedule(modules: list[StageModule], pp_mesh: DeviceMesh, name: str,
                   microbatches: int, loss_fn: Callable[..., torch.Tensor],
                   device: torch.device) -> tuple[PipelineScheduleSingle | PipelineScheduleMulti,
                                                  list[PipelineStage]]:
    """PipelineStages for `specs` and the schedule `name` over them (grads are not rescaled:
    the loss function already divides by the global token count)."""
    n_stages = pp_mesh.size() * len(modules)
    group = pp_mesh.get_group()
    stages = [PipelineStage(m, m.spec.index, n_stages, device, group=group) for m in modules]
    cls = SCHEDULES[name]
    if name in SINGLE_STAGE:
        schedule = cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn,
                       scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    log.info("pipeline: %s, %d stages (this rank: %s), %d micro-batches", name, n_stages,
             [m.spec.index for m in modules], microbatches)
    return schedule, stages
