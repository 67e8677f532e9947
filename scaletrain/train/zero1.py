"""ZeRO-1 in every layout: the optimizer state partitioned over the data-parallel ranks.

Each data-parallel rank owns whole parameters (greedy, largest first, to the least-loaded rank),
keeps optimizer state for its own ones only and steps only them; after the step every owner
broadcasts its updated parameters to the other ranks, in buckets of `bucket_cap_mb`. Gradients
arrive already summed over the data-parallel ranks (DDP's hooks, or
`Parallelism.sync_gradients` with tensor/pipeline parallelism), so clipping and the fp16 scaler
see the full gradients on every rank exactly as in ZeRO-0.

Parameters may be DTensors (tensor parallelism): ownership and broadcasts use each rank's
local shard, which the data-parallel peers of a rank hold with the same shape. The state dict
is keyed by parameter name (the FQNs of `get_model_state_dict`) in the layout of
`get_optimizer_state_dict`, each rank holding the entries of the parameters it owns, so DCP
writes every entry once and any layout (another world size, ZeRO-3, one process) loads it.

16-bit parameters (`masters=True`: `precision.param_dtype bf16` with several processes and no
FSDP; Megatron's distributed optimizer, DeepSpeed's ZeRO-1 with bf16 weights): the model holds
bf16 weights; each micro-batch's bf16 gradient is added into an fp32 buffer and freed at once
(Megatron's main_grad: 4 B per parameter), the fp32 buffers are summed over the data-parallel
ranks in fp32 (`Parallelism.sync_gradients` on `sync_params()`), clipping and the norm read
them, and only the owner of a parameter keeps its fp32 master weight and optimizer state,
steps them, rounds the master into its bf16 weight and broadcasts the bf16 weight. Per
parameter: 2 (weights) + 4 (gradients) + (4 + 8) / dp bytes. `shard=False` (ZeRO-0) lets every
rank own every parameter: the same recipe, nothing partitioned, nothing broadcast. The state
dict then also holds the owned masters under "master", the layout of the single-process
`MasterWeightOptimizer`, so checkpoints move between the two.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.config import OptimizerConfig
from scaletrain.parallel.parallelize import clean_name
from scaletrain.train.optim import create_state, make_optimizer, param_groups
from scaletrain.train.optim_state import group_settings, settings_by_name
from scaletrain.train.precision import cast_params_

_AMP_ATTRS = ("found_inf", "grad_scale")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def assign_owners(sizes: list[int], ranks: int) -> list[int]:
    """The owning rank of each parameter (by element count): largest first, each to the rank
    with the fewest elements so far (ties: the lowest rank)."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """`params` by dtype, in buckets of about `bucket_bytes` (of their local shards)."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    out: list[list[nn.Parameter]] = []
    for same in by_dtype.values():
        bucket: list[nn.Parameter] = []
        size = 0
        for p in same:
            bucket.append(p)
            size += _local(p).numel() * p.element_size()
            if size >= bucket_bytes:
                out.append(bucket)
                bucket, size = [], 0
        if bucket:
            out.append(bucket)
    return out


class GradHolder:
    """The fp32 gradient of a 16-bit parameter whose master another rank owns: clipping, the
    norm and the data-parallel reduction read `.grad` as they read a parameter's."""

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


class PartitionedOptimizer:
    """ZeRO-1 around a torch optimizer (see the module docstring). `param_groups` lists every
    parameter (the LR schedule and the fp16 scaler act on it); the inner optimizer holds the
    owned ones (their fp32 masters with `masters`) and takes its hyperparameters from
    `param_groups` at each step."""

    def __init__(self, model: nn.Module, cfg: OptimizerConfig, device: torch.device,
                 group: dist.ProcessGroup, bucket_cap_mb: float = 25.0,
                 masters: bool = False, shard: bool = True) -> None:
        self.group = group
        self.rank, self.ranks = dist.get_rank(group), dist.get_world_size(group)
        groups = param_groups(model, cfg.weight_decay)
        names = {id(p): clean_name(n) for n, p in model.named_parameters()}
        self.params = [p for g in groups for p in g["params"]]
        self.names = [names[id(p)] for p in self.params]
        owners = (assign_owners([_local(p).numel() for p in self.params], self.ranks) if shard
                  else [self.rank] * len(self.params))
        owner = {id(p): r for p, r in zip(self.params, owners, strict=True)}
        # With masters: the fp32 copy of each owned parameter (then the model is cast to
        # bf16), which also holds that parameter's fp32 gradient; a holder for every other
        # one.
        self.master: dict[int, torch.Tensor] = {}
        self.holders: dict[int, Any] = {}
        if masters:
            for p in self.params:
                if owner[id(p)] == self.rank:
                    m = p.detach().to(torch.float32, copy=True).requires_grad_(True)
                    self.master[id(p)] = self.holders[id(p)] = m
                else:
                    self.holders[id(p)] = GradHolder()
            cast_params_(self.params, torch.bfloat16)  # the masters hold the fp32 values
            self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate)
                           for p in self.params]
        inner_groups = [{**g, "params": [self.master.get(id(p), p) for p in g["params"]
                                         if owner[id(p)] == self.rank]}
                        for g in groups]
        self.inner = make_optimizer(inner_groups, cfg, device)
        self.inner_names = [names[id(p)] for g in groups for p in g["params"]
                            if owner[id(p)] == self.rank]
        self.owned = [p for p in self.params if owner[id(p)] == self.rank]
        self.param_groups = [{**self.inner.defaults, **g} for g in groups]
        bucket_bytes = max(1, int(bucket_cap_mb * 2**20))
        self.buckets = [(r, bucket) for r in range(self.ranks) for bucket in _buckets(
            [p for p in self.params if owner[id(p)] == r], bucket_bytes)] if shard else []
        """(owner, parameters) broadcast together after each step: one owner, one dtype."""

    # --- fp32 gradients of 16-bit parameters ------------------------------------------------
    @torch.no_grad()
    def _accumulate(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: add a 16-bit parameter's fresh gradient into its fp32
        buffer and free it (fp32 parameters keep theirs in `p.grad`)."""
        g = p.grad
        if g is None or p.dtype == torch.float32:
            return
        if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
            # the embedding's gradient comes back whole (replicated or partial) under TP: keep
            # only this rank's shard, as the parameter is sharded
            g = g.redistribute(p.device_mesh, p.placements)
        holder = self.holders[id(p)]
        if holder.grad is None:
            holder.grad = g.to(torch.float32, copy=True)
        else:
            holder.grad.add_(g)  # upcast inside add_: an fp32 sum
        p.grad = None

    def grad_holder(self, p: torch.Tensor) -> Any:
        """What holds p's gradient in `.grad` (p itself without masters)."""
        if not self.holders or p.dtype == torch.float32:
            return p
        return self.holders[id(p)]

    def sync_params(self) -> list[Any]:
        """The gradient holders of every parameter, for the data-parallel reduction, the norm
        and clipping. A gradient no hook took (a backward that set `.grad` directly) is taken
        here."""
        for p in self.params:
            if p.grad is not None and p.dtype != torch.float32 and self.holders:
                self._accumulate(p)
        return [self.grad_holder(p) for p in self.params]

    def grad_params(self) -> list[Any]:
        return self.sync_params()

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """The inner optimizer can skip an inf/NaN step on the device (`found_inf`)."""
        return getattr(self.inner, "_step_supports_amp_scaling", False)

    @property
    def state(self) -> dict[Any, Any]:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for h in self.holders.values():
            h.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Step the owned parameters, then hand every updated parameter to all ranks."""
        for full, mine in zip(self.param_groups, self.inner.param_groups, strict=True):
            mine.update({k: v for k, v in full.items() if k != "params"})
        passed = [a for a in _AMP_ATTRS if hasattr(self, a)]
        for a in passed:
            setattr(self.inner, a, getattr(self, a))
        try:
            self.inner.step()
        finally:
            for a in passed:
                delattr(self.inner, a)
        for p in self.owned:  # the updated masters, rounded into the 16-bit weights
            m = self.master.get(id(p))
            if m is not None and p.dtype != torch.float32:
                _local(p).copy_(_local(m))
        self._broadcast_params()

    def _broadcast_params(self) -> None:
        for owner, params in self.buckets:
            bucket = [_local(p) for p in params]
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.broadcast(flat, group=self.group, group_src=owner)
            if owner != self.rank:
                for t, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                    t.copy_(part.view_as(t))

    # --- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{"state": {name: state of an owned parameter}, "param_groups": {name: its group's
        settings}} for every parameter (`train.optim_state`: keyed by name in every layout)."""
        inner = self.inner.state_dict()
        names = {id(p): n for p, n in zip(self.params, self.names, strict=True)}
        out = {
            "state": {self.inner_names[i]: s for i, s in inner["state"].items()},
            "param_groups": settings_by_name(self.param_groups, self.group_names()),
        }
        if self.master:
            out["master"] = {names[id(p)]: self.master[id(p)] for p in self.owned
                             if id(p) in self.master}
        return out

    def group_names(self) -> list[list[str]]:
        """The names of each parameter group's parameters."""
        names = {id(p): n for p, n in zip(self.params, self.names, strict=True)}
        return [[names[id(p)] for p in g["params"]] for g in self.param_groups]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the owned parameters' entries of a name-keyed optimizer state (from any
        layout) and the saved hyperparameters."""
        index = {n: i for i, n in enumerate(self.inner_names)}
        missing = [n for n in self.inner_names if n not in state["state"]]
        if missing:
            raise KeyError(f"optimizer state has no entry for {missing[:3]}")
        saved = group_settings(state["param_groups"], self.group_names())
        for g, s in zip(self.param_groups, saved, strict=True):
            g.update(s)
        start = 0
        inner_groups = []
        for g, s in zip(self.inner.param_groups, saved, strict=True):
            n = len(g["params"])
            inner_groups.append({**s, "params": list(range(start, start + n))})
            start += n
        self.inner.load_state_dict({
            "state": {index[n]: state["state"][n] for n in self.inner_names},
            "param_groups": inner_groups,
        })
        if self.master:
            names = {id(p): n for p, n in zip(self.params, self.names, strict=True)}
            with torch.no_grad():
                for p in self.owned:
                    m = self.master.get(id(p))
                    if m is not None:
                        _local(m).copy_(_local(state["master"][names[id(p)]]))
                        _local(p).copy_(_local(m))

    def init_state(self) -> None:
        """Create the owned parameters' optimizer state so a checkpoint can be loaded into
        it."""
        create_state(self.inner)
