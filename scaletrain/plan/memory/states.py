"""Model-state memory: bytes per parameter by precision and optimizer, parameters per rank.

Conventions (bytes per parameter; Adam keeps two fp32 moments = 8 B):
- fp32 training: weights 4 + gradients 4 + Adam 8 = 16 (the Ultra-Scale Playbook's table).
- bf16/fp16 mixed precision: 16-bit weights 2 + fp32 master weights 4 + Adam 8, and gradients
  by `grad_convention`:
    `playbook`  16-bit gradients 2 + an fp32 accumulation copy 4 -> 20 B in all (the Playbook);
    `megatron`  fp32 main gradients only, accumulated in place 4   -> 18 B (Megatron-LM);
    `bf16`      16-bit gradients only 2                             -> 16 B.
- autocast over fp32 parameters (`param_dtype fp32`, scaletrain's default): weights 4 +
  gradients 4 + Adam 8 = 16, plus the 16-bit copies autocast keeps for backward (2, transient).

ZeRO (Rajbhandari et al. 2020) over a sharding group of size n: stage 1 divides optimizer state
and master weights by n, stage 2 also gradients, stage 3 also weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from scaletrain.models.args import ModelArgs, count_params
from scaletrain.plan.memory.pipeline import chunk_ids, chunks_per_rank

GradConvention = Literal["playbook", "megatron", "bf16"]
OPTIMIZER_BYTES = {"adamw": 8.0, "sgd": 4.0, "adamw8bit": 2.0, "adafactor": 0.0}
"""Optimizer state per parameter: Adam's two fp32 moments, SGD's momentum, two 8-bit moments;
Adafactor's factored moments (rows + columns per matrix) are counted as negligible."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each kind of model state."""

    weights: float
    gradients: float
    master_weights: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.master_weights + self.optimizer


def state_bytes(precision: str, param_dtype: str, optimizer: str = "adamw",
                grad_convention: GradConvention = "playbook") -> StateBytes:
    """Bytes per parameter for a precision (`fp32`, `bf16`, `fp16`: the compute dtype), the
    dtype the parameters are stored in (`fp32`, or 16-bit with fp32 master weights) and the
    optimizer."""
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"unknown optimizer '{optimizer}'; use one of "
                         f"{', '.join(OPTIMIZER_BYTES)}")
    opt = OPTIMIZER_BYTES[optimizer]
    if param_dtype == "fp32":
        return StateBytes(4.0, 4.0, 0.0, opt)
    if precision == "fp32":
        raise ValueError("16-bit parameters need a 16-bit precision (use --precision bf16)")
    grads = {"playbook": 2.0 + 4.0, "megatron": 4.0, "bf16": 2.0}
    if grad_convention not in grads:
        raise ValueError(f"unknown gradient convention '{grad_convention}'; use one of "
                         f"{', '.join(grads)}")
    return StateBytes(2.0, grads[grad_convention], 4.0, opt)


def sharded_state(per_param: StateBytes, params: int, zero: int, shard: int) -> dict[str, float]:
    """Bytes of each state for `params` parameters under ZeRO stage `zero` over `shard` ranks."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3 (got {zero})")
    div = {k: 1 for k in ("weights", "gradients", "master_weights", "optimizer")}
    if zero >= 1:
        div["optimizer"] = div["master_weights"] = shard
    if zero >= 2:
        div["gradients"] = shard
    if zero >= 3:
        div["weights"] = shard
    return {k: getattr(per_param, k) * params / div[k] for k in div}


def offload_states(states: dict[str, float], offload: bool) -> int:
    """With CPU offload, move optimizer state and master weights off the device: zero them
    in `states` and return their bytes (0 without offload)."""
    if not offload:
        return 0
    moved = int(states["optimizer"] + states["master_weights"])
    states["optimizer"] = states["master_weights"] = 0
    return moved


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of a pipeline stage holds (after tensor parallelism)."""

    layers: int
    per_layer: int
    embedding: int
    head: int

    @property
    def total(self) -> int:
        return self.layers * self.per_layer + self.embedding + self.head


def chunk_layers(args: ModelArgs, chunks: int) -> list[range]:
    """The layer indices of each of `chunks` pipeline chunks: contiguous runs whose sizes
    differ by at most one, earlier chunks larger (the trainer's `parallel.pp.split_layers`)."""
    n = args.n_layers
    out, start = [], 0
    for i in range(chunks):
        size = n // chunks + (1 if i < n % chunks else 0)
        out.append(range(start, start + size))
        start += size
    return out


def stage_params(args: ModelArgs, pp: int = 1, tp: int = 1, stage: int = 0,
                 vpp: int = 1, schedule: str = "1F1B") -> StageParams:
    """Parameters on one rank of pipeline stage `stage` of `pp`.

    Layers are split into pp * vpp chunks as evenly as possible (stage i holds chunks i, i+pp,
    ...; under ZBVZeroBubble chunks i and 2pp - 1 - i, so its first stage holds both ends); the
    stage with the first chunk holds the embedding, the one with the last chunk the final norm
    and the head (a tied head is repeated there when pp > 1). Tensor parallelism divides
    projections, embedding and head by tp; norms and biases of row-parallel layers stay whole.
    """
    c = count_params(args)
    n = args.n_layers
    norm_per_layer = c.norms // (2 * n + 1) * 2
    final_norm = c.norms - n * norm_per_layer
    per_layer = (c.attention + c.mlp) // n // tp + norm_per_layer
    v = chunks_per_rank(schedule, vpp) if pp > 1 else 1
    mine = chunk_ids(stage, pp, v, schedule) if pp > 1 else [0]
    runs = chunk_layers(args, pp * v)
    layers = sum(len(runs[i]) for i in mine)
    embedding = (c.embedding // tp + c.positional) if 0 in mine else 0
    head = 0
    if pp * v - 1 in mine:
        tied_elsewhere = args.tie_embeddings and pp > 1 and 0 not in mine
        head = final_norm + (c.head or (args.vocab_size * args.dim if tied_elsewhere else 0)) // tp
    return StageParams(layers, per_layer, embedding, head)


def layer_range(args: ModelArgs, pp: int, stage: int, vpp: int = 1,
                schedule: str = "1F1B") -> range:
    """Indices of a contiguous block of layers of the same count as stage `stage` holds (the
    activation estimate only needs how many layers, and which are checkpointed)."""
    count = stage_params(args, pp, 1, stage, vpp, schedule).layers
    start = math.floor(stage * args.n_layers / pp)
    return range(start, start + count)


def model_state_bytes(n_params: float, precision: str, param_dtype: str, optimizer: str = "adamw",
                      grad_convention: GradConvention = "playbook") -> float:
    """Total model-state bytes of `n_params` parameters without sharding (the Playbook table)."""
    return n_params * state_bytes(precision, param_dtype, optimizer, grad_convention).total


def grad_sync_bucket_bytes(grad_bytes: float, bucket_cap_mb: float,
                           largest_grad_bytes: float) -> int:
    """The flat copy `Parallelism.sync_gradients` all-reduces at a time (data parallelism next
    to tensor or pipeline parallelism): gradients are concatenated until a bucket reaches
    `bucket_cap_mb`, so one bucket holds at most the cap plus one more gradient, and never more
    than the gradients. It lives only while gradients are synchronized, before the optimizer
    step."""
    cap = bucket_cap_mb * 2**20
    return int(min(grad_bytes, cap + largest_grad_bytes))
