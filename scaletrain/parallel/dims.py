"""Parallel degrees (`ParallelDims`): one source of truth for the trainer and the planner.

The mesh is laid out outermost first as `pp, dp_replicate, dp_shard, cp, tp` (tensor parallel
innermost, so it stays inside a node). This module checks the arithmetic only; it imports no
torch.distributed, so `scaletrain plan` can use it without a process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.models.args import ModelArgs

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class ParallelDimsError(ValueError):
    """A layout that cannot run; the message names the degree and the fix."""


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees (no -1 left); their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert parallel: borrowed from dp_shard (not a factor of the world size)."""

    @classmethod
    def resolve(
        cls,
        world_size: int,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
    ) -> ParallelDims:
        """Fill the one degree given as -1 with what the world size leaves, then check."""
        if ep < 1:
            raise ParallelDimsError(f"parallel.ep must be positive (got {ep})")
        degrees = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp}
        if world_size <= 0:
            raise ParallelDimsError(f"world size must be positive (got {world_size})")
        rest = [k for k, v in degrees.items() if v == -1]
        bad = [f"parallel.{k} = {v}" for k, v in degrees.items() if v == 0 or v < -1]
        if bad:
            raise ParallelDimsError(f"parallel degrees must be positive or -1: {', '.join(bad)}")
        if len(rest) > 1:
            raise ParallelDimsError(
                f"only one parallel degree may be -1 (the rest of the world); got "
                f"{', '.join('parallel.' + k for k in rest)}"
            )
        fixed = math.prod(v for v in degrees.values() if v != -1)
        if rest:
            if world_size % fixed:
                raise ParallelDimsError(
                    f"the world size {world_size} is not divisible by the product of the fixed "
                    f"degrees ({_describe(degrees)} = {fixed}), so parallel.{rest[0]} = -1 has "
                    "no integer value"
                )
            degrees[rest[0]] = world_size // fixed
        dims = cls(**degrees, ep=ep)
        if dims.dp_shard % ep:
            raise ParallelDimsError(
                f"parallel.ep ({ep}) borrows its ranks from parallel.dp_shard "
                f"({dims.dp_shard}) and must divide it; e.g. --parallel.dp_shard {ep} "
                f"--parallel.ep {ep}")
        if dims.world_size != world_size:
            raise ParallelDimsError(
                f"the parallel degrees multiply to {dims.world_size} ({_describe(degrees)}) but "
                f"the world size is {world_size}; make the product equal the number of processes "
                "or set one degree to -1"
            )
        return dims

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_mod_ep(self) -> int:
        """FSDP degree of the experts: dp_shard ranks that hold the same experts."""
        return self.dp_shard // self.ep

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    def model_problems(
        self, args: ModelArgs, seq_len: int, pp_virtual_stages: int = 1
    ) -> list[str]:
        """Every way the model or sequence does not divide as these degrees need."""
        out: list[str] = []
        if self.ep > 1 and not args.is_moe:
            out.append(f"parallel.ep ({self.ep}) needs a Mixture-of-Experts model "
                       "(model.n_experts > 0); use parallel.ep 1")
        elif self.ep > 1 and args.n_experts % self.ep:
            out.append(f"model.n_experts ({args.n_experts}) must be divisible by parallel.ep "
                       f"({self.ep})")
        if self.tp > 1 and args.is_moe and args.n_experts % (self.tp * self.ep):
            split = (f"parallel.ep x parallel.tp ({self.ep} x {self.tp})" if self.ep > 1
                     else f"parallel.tp ({self.tp})")
            out.append(f"model.n_experts ({args.n_experts}) must be divisible by {split}: "
                       "tensor (and expert) parallelism split the experts over their ranks")
        ffn = args.shared_expert_hidden_dim if args.is_moe else args.hidden_dim
        if self.tp > 1:
            for name, value in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads),
                                ("ffn_dim", ffn),
                                ("vocab_size", args.vocab_size)):
                if value % self.tp:
                    out.append(f"model.{name} ({value}) must be divisible by parallel.tp "
                               f"({self.tp})")
            if seq_len % self.tp:
                out.append(f"data.seq_len ({seq_len}) must be divisible by parallel.tp "
                           f"({self.tp}) for sequence parallelism")
        if self.cp > 1 and seq_len % (2 * self.cp):
            out.append(f"data.seq_len ({seq_len}) must be divisible by 2 x parallel.cp "
                       f"({2 * self.cp}) for load-balanced context parallelism")
        if self.cp > 1:
            out.extend(cp_attention_problems(args, seq_len))
        stages = self.pp * pp_virtual_stages
        if self.pp > 1 and args.n_layers < stages:
            out.append(f"model.n_layers ({args.n_layers}) must be at least parallel.pp x "
                       f"virtual stages ({stages}): every pipeline stage needs a layer")
        return out


def _describe(degrees: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in degrees.items() if v != 1) or "all 1"


def cp_attention_problems(args: ModelArgs, seq_len: int) -> list[str]:
    """What the ring attention of context parallelism cannot compute for this model: it is
    plain causal softmax attention scaled by 1 / sqrt(head_dim)."""
    out = []
    if any(args.attention_span(i, seq_len) < seq_len for i in range(args.n_layers)):
        out.append(f"parallel.cp > 1 does not support sliding-window attention shorter than "
                   f"the sequence (window {args.sliding_window} < data.seq_len {seq_len}); "
                   "use parallel.cp 1 or a seq_len within the window")
    if args.attn_softcap is not None:
        out.append("parallel.cp > 1 does not support soft-capped attention logits "
                   "(Gemma 2); use parallel.cp 1")
    if args.query_pre_attn_scalar not in (None, float(args.head_dim)):
        out.append("parallel.cp > 1 needs the attention scale 1/sqrt(head_dim) "
                   f"(query_pre_attn_scalar is {args.query_pre_attn_scalar}); use parallel.cp 1")
    return out
