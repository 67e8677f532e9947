"""Parallelism's pipeline-parallel part: the tied embedding's groups and gradient sum over the
first and last stage, the schedule attached to the stages, a step's micro-batches through it
(the loss normalized by the step's global valid-token count) and the forward-only pass of
evaluation with point-to-point hand-overs.

`PipelineParallelism` is a base of `Parallelism` (`parallel/parallelize.py`), which builds
the mesh, the model and its stages that these methods use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.parallel.pp import build_schedule, embedding_group_ranks, tied_stage_ranks

Batch = tuple[torch.Tensor, torch.Tensor]


class PipelineLoss:
    """Loss of one pipeline micro-batch: token-loss sum over the step's global token count,
    scaled for fp16 by `scale`; it records the unscaled sums (the step's loss)."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.n_valid: torch.Tensor | float = 1.0
        self.scale: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self.sums: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        token_loss = self.loss_fn(logits, targets)
        self.sums.append(token_loss.detach())
        return self.scale(token_loss / self.n_valid)


class PipelineParallelism:
    """`Parallelism`'s pipeline methods."""

    def _embedding_group(self, model: nn.Module) -> None:
        """Create the embedding groups (every rank takes part in creating each one) and keep
        this rank's."""
        assert self.mesh is not None
        cfg, root = self.cfg, self.mesh.root
        pp_dim = root.mesh_dim_names.index("pp")
        me = dist.get_rank()
        for ranks in embedding_group_ranks(root.mesh, pp_dim, self.dims.pp,
                                           cfg.pp_virtual_stages, cfg.pp_schedule):
            group = dist.new_group(ranks)
            if me in ranks:
                self.tied_group = group
        first, last = tied_stage_ranks(self.dims.pp, cfg.pp_virtual_stages, cfg.pp_schedule)
        self.tied_copy = self.pp_rank == last and first != last
        self._tied_model = model

    def tied_parameters(self) -> list[nn.Parameter]:
        """The tied embedding weight on a rank of the embedding group (else nothing)."""
        if self.tied_group is None or self._tied_model is None:
            return []
        return [self._tied_model.tok_embeddings.weight]

    @torch.no_grad()
    def reduce_tied_gradients(self, holder_of: Callable[[torch.Tensor], Any]) -> None:
        """Pipeline parallelism with a tied head: sum the embedding's and the head's gradients
        over the first and last stage, so both copies take the same update. `holder_of(p)`:
        what holds p's gradient in `.grad` (p, or an optimizer's fp32 buffer). A DTensor
        gradient is first given its parameter's placements (the embedding's can come back
        replicated or partial under TP), so both ends hold shards of the same shape."""
        for p in self.tied_parameters():
            holder = holder_of(p)
            g = holder.grad
            if g is None:  # no gradient on one end would desynchronize the copies
                raise RuntimeError("the tied embedding has no gradient on this pipeline rank")
            if isinstance(g, DTensor) and isinstance(p, DTensor) \
                    and tuple(g.placements) != tuple(p.placements):
                g = holder.grad = g.redistribute(p.device_mesh, p.placements)
            dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g,
                            group=self.tied_group)

    def attach_pipeline(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
                        microbatches: int,
                        autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                        hidden: bool = False) -> None:
        """Build the pipeline stages and a schedule of `microbatches` per run (after the model
        is materialized); each stage forward runs under `autocast` (the run's mixed
        precision). `hidden`: the last stage hands `loss_fn` the final-norm hidden states
        instead of the logits (the fused loss)."""
        assert self.mesh is not None
        for m in self.stage_modules:
            m.autocast = autocast or contextlib.nullcontext
            m.hidden = hidden
        self.pipe_loss = PipelineLoss(loss_fn)
        self.run_microbatches = microbatches  # per schedule run (`pipeline_forward_backward`)
        self.schedule, self.stages = build_schedule(
            self.stage_modules, self.mesh["pp"], self.cfg.pp_schedule, microbatches,
            self.pipe_loss, self.device)

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline group (None without pipeline parallelism)."""
        return self.mesh.group("pp") if self.mesh is not None and self.dims.pp > 1 else None

    def pipeline_forward_backward(self, batches: list[Batch], n_valid: torch.Tensor,
                                  scale: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The step's micro-batches through the schedule, `parallel.pp_microbatches` of them
        per run (all in one run by default); this rank's sum of token losses (zero outside the
        last stage). Gradients accumulate over the runs (FSDP reduces after each run's last
        backward and sums the reduced shards)."""
        batches = [self.shard_batch(x, y)[:2] for x, y in batches]  # context parallel
        per_run = self.run_microbatches
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for start in range(0, len(batches), per_run):
            total += self._pipeline_run(batches[start:start + per_run], n_valid, scale)
        return total

    def _pipeline_run(self, batches: list[Batch], n_valid: torch.Tensor,
                      scale: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One schedule step over `batches`; this rank's sum of their token losses."""
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        self.pipe_loss.n_valid, self.pipe_loss.scale, self.pipe_loss.sums = n_valid, scale, []
        first = any(s.embed for s in self.stage_specs)
        last = any(s.head for s in self.stage_specs)
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": []} if last else {}
        # return_outputs=False: the last stage keeps no micro-batch's output (its logits) for
        # a merged return nobody reads (torch keeps them all by default: m x the logits)
        self.schedule.step(*args, return_outputs=False, **kwargs)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        # The first run also calls the loss during shape inference: the last n calls count.
        for loss in self.pipe_loss.sums[len(self.pipe_loss.sums) - len(batches):]:
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).float()
        return total

    def pipeline_eval_batch(self, x: torch.Tensor, y: torch.Tensor,
                            loss_fn: Callable[..., torch.Tensor], hidden: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward-only pass of one batch through the stages in order, with point-to-point
        hand-overs (torch's schedule `eval` runs backward actions for multi-stage schedules).
        Returns (token-loss sum, valid-token count) of this rank's context-parallel share, both
        zero outside the last stage. `hidden`: the last stage gives `loss_fn` the final-norm
        hidden states (the fused loss applies the head), else the logits."""
        assert self.mesh is not None
        x, y, _ = self.shard_batch(x, y)  # context parallel: this rank's chunks
        group = self.mesh.group("pp")
        n_stages = self.dims.pp * len(self.stage_modules)
        owner = {sid: dist.get_global_rank(group, r) for r in range(self.dims.pp)
                 for sid in _stage_ids_of(r, self)}
        mine = {m.spec.index: m for m in self.stage_modules}
        me = dist.get_rank()
        shards = self.stage_modules[0].seq_shards
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        valid = torch.zeros((), dtype=torch.float64, device=self.device)
        h: torch.Tensor | None = None
        for sid in sorted(mine):
            if sid > 0 and owner[sid - 1] != me:
                shape = (x.shape[0], x.shape[1] // shards, self.hidden_dim)
                h = torch.empty(shape, dtype=torch.float32, device=self.device)
                dist.recv(h, src=owner[sid - 1], group=group)
            stage, kept = mine[sid], mine[sid].hidden
            stage.hidden = hidden
            try:
                out = stage(x if sid == 0 else h)
            finally:
                stage.hidden = kept
            if sid == n_stages - 1:
                part = loss_fn(out, y)
                loss = (part.full_tensor() if isinstance(part, DTensor) else part).double()
                valid = (y != -100).sum().double()
            else:
                h = out.float().contiguous()
                if owner[sid + 1] != me:
                    dist.send(h, dst=owner[sid + 1], group=group)
        return loss, valid


def _stage_ids_of(pp_rank: int, par: PipelineParallelism) -> list[int]:
    from scaletrain.parallel.pp import stage_ids

    return stage_ids(pp_rank, par.dims.pp, par.cfg.pp_virtual_stages, par.cfg.pp_schedule)
