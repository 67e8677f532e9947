"""Mixture of Experts: the MLP slot of a sparse block (Mixtral, Qwen3-MoE, DeepSeek-style).

Token-choice top-k routing: a linear router scores every expert per token (softmax or sigmoid),
each token goes to its k best experts, and the block's output is the weighted sum of those
experts' SwiGLU outputs (plus shared experts every token goes through). No token is dropped
unless `moe_capacity_factor` is set.

The routed experts are computed as one grouped GEMM over the tokens sorted by expert
(`torch._grouped_mm`, on CPU as on GPU; `expert_compute="loop"` runs one matmul per expert, the
reference). With expert parallelism the sorted tokens are exchanged with an all-to-all between
the ranks that own the experts (`MoE.dispatcher`, installed by `parallel/ep.py`).

Load balancing, two options that can be combined:
- the auxiliary loss `E * sum_i f_i * P_i` per layer (f_i: fraction of the tokens that chose
  expert i, times k; P_i: mean router probability of i; k when perfectly balanced), added to the
  objective with weight `moe_aux_loss_coef`. `moe_aux_loss_scope` says which tokens one term
  counts: `sequence` (default, `sequence_balancing_loss`) one sequence (row), the step's term
  being the mean over its sequences, so the objective is the same for every layout of a global
  batch; `micro_batch` (`balancing_loss`, Switch/Mixtral) one micro-batch of every
  data-parallel rank, which changes with how the global batch splits into micro-batch x
  accumulation x data parallelism. Its gradient is injected in backward at the MoE output
  (`_InjectAuxGrad`), so it works unchanged under pipeline parallelism; the training step
  weights each forward's term by its share of the step's tokens (`aux_loss_weighting`).
  Only context parallelism splits a sequence over ranks: `balance_group` sums the counts
  over the ranks that share the tokens (the cp ranks for `sequence`, the data-parallel and cp
  ranks for `micro_batch`).
- the auxiliary-loss-free bias of DeepSeek-V3: a per-expert bias added to the scores for the
  top-k choice only (not to the weights), moved by `moe_bias_update_rate * sign(mean load -
  load)` after each optimizer step (`update_expert_bias`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.models.args import ModelArgs
from scaletrain.models.layers import MLP_BUILDERS, FeedForward

log = logging.getLogger(__name__)

# --- how the training step weights the auxiliary loss ----------------------------------------
_AUX_WEIGHTING: dict[str, Any] = {"tokens": None, "scale": None}


@contextlib.contextmanager
def aux_loss_weighting(step_tokens: int, loss_scale: torch.Tensor | None = None
                       ) -> Iterator[None]:
    """Inside, each forward's auxiliary loss is weighted by (its tokens / `step_tokens`), the
    tokens of the whole step over every data-parallel rank and micro-batch, so the step's
    objective holds the token-weighted mean of the forwards' auxiliary losses (with scope
    `sequence` and rows of one length: the mean over the step's sequences); and by
    `loss_scale` (the fp16 loss scale) like the main loss. Outside, the weight is 1."""
    old = dict(_AUX_WEIGHTING)
    _AUX_WEIGHTING.update(tokens=step_tokens, scale=loss_scale)
    try:
        yield
    finally:
        _AUX_WEIGHTING.update(old)


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on `out`; in backward, d(weight * aux)/d(aux) = weight flows into `aux`."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, weight: torch.Tensor
                ) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad, weight.to(torch.float32).expand(()), None


def _aux_weight(coef: float, local_tokens: int, device: torch.device) -> torch.Tensor:
    w = torch.tensor(coef, dtype=torch.float32, device=device)
    if _AUX_WEIGHTING["tokens"] is not None:
        w = w * (local_tokens / _AUX_WEIGHTING["tokens"])
    if _AUX_WEIGHTING["scale"] is not None:
        w = w * _AUX_WEIGHTING["scale"].to(device=device, dtype=torch.float32)
    return w


# --- experts ----------------------------------------------------------------------------------
class GroupedExperts(nn.Module):
    """`n` SwiGLU experts stored as stacked weights, like `nn.Linear`'s (out, in) per expert:
    w1, w3 (n, hidden, dim) and w2 (n, dim, hidden). With expert parallelism each rank holds a
    contiguous slice of the experts (the first dimension)."""

    def __init__(self, n: int, dim: int, hidden: int, compute: str = "grouped") -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.compute = compute

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x` (tokens, dim) sorted by expert, `counts` (local experts,) tokens per expert."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        dtype = _compute_dtype(x, w1)
        x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        # Traced by torch.compile, the grouped GEMM's shape check wants bf16 (its CUDA kernel's
        # rule) even where the eager CPU kernel takes fp32, and a failure there cannot fall back.
        grouped = self.compute == "grouped" and (
            dtype == torch.bfloat16 or not torch.compiler.is_compiling())
        if grouped:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            try:
                h = F.silu(_gmm(x, w1, offs)) * _gmm(x, w3, offs)
                return _gmm(h, w2, offs)
            except RuntimeError as e:  # a device/dtype without a grouped-GEMM kernel
                log.warning("grouped GEMM unavailable for %s on %s (%s); computing the "
                            "experts one by one", dtype, x.device, e)
                self.compute = "loop"
        return _loop_swiglu(x, counts, w1, w2, w3)


def _local(w: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter (FSDP gathers before forward; EP shards stay)."""
    # isinstance, not hasattr: torch.compile traces hasattr on a DTensor parameter as False.
    return w.to_local() if isinstance(w, DTensor) else w


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return w.dtype


def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (tokens, in) times each group's w[e]^T (in -> out), groups ending at `offs`."""
    return _GroupedMM.apply(x, w, offs)


class _GroupedMM(torch.autograd.Function):
    """`torch._grouped_mm` with contiguous incoming gradients (its CPU backward rejects the
    broadcast gradients autograd may pass) and an exact zero gradient for empty experts."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, w, offs=offs)
        # dW_e = grad_e^T x_e: one grouped GEMM over the token dimension, whose stride must be
        # a multiple of 16 bytes: pad the tokens with zero rows (after the last group).
        pad = -x.shape[0] % (16 // x.element_size())
        if pad:
            grad, x = F.pad(grad, (0, 0, 0, pad)), F.pad(x, (0, 0, 0, pad))
        grad_w = torch._grouped_mm(grad.t().contiguous(), x, offs=offs)
        return grad_x, grad_w, None


def _loop_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 w3: torch.Tensor) -> torch.Tensor:
    """One matmul per expert (the reference path; reads `counts` on the host)."""
    outs = []
    for e, part in enumerate(torch.split(x, counts.tolist())):
        outs.append((F.silu(part @ w1[e].t()) * (part @ w3[e].t())) @ w2[e].t())
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


# --- routing ----------------------------------------------------------------------------------
@dataclass
class Routing:
    """Where each token goes: `experts` (tokens, k) chosen expert ids, `weights` (tokens, k)
    their gate values, `probs` (tokens, experts) the router probabilities."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor


class Router(nn.Module):
    """Linear scores per expert, top-k choice (with the balancing bias) and gate weights."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        self.top_k, self.score = args.n_experts_per_token, args.router_score
        self.normalize = args.router_norm_topk
        # DeepSeek-V3 balancing bias: steers the choice, never the weights. A buffer, kept in
        # checkpoints, moved by `update_expert_bias` (not by the optimizer).
        self.register_buffer("expert_bias", torch.zeros(args.n_experts))

    def forward(self, x: torch.Tensor) -> Routing:
        with torch.autocast(x.device.type, enabled=False):  # routing decisions in fp32
            logits = F.linear(x.float(), _local(self.gate.weight).float())
        probs = torch.sigmoid(logits) if self.score == "sigmoid" else torch.softmax(logits, -1)
        choose = probs + self.expert_bias.to(probs.dtype)
        experts = torch.topk(choose, self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(experts, weights, probs)


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens per expert (int64) of expert ids `experts`; unlike `torch.bincount`, it never
    reads the ids' maximum back to the host on a GPU."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def balancing_loss(routing: Routing, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Switch/Mixtral auxiliary loss of one layer over one micro-batch (scope `micro_batch`):
    E * sum_i (tokens to i / tokens) * P_i (k when perfectly balanced).

    With `group` (the data-parallel ranks, set by the parallel layout), the load fractions
    count the micro-batch of every rank of the group (equal-sized micro-batches), so a
    data- or expert-parallel run optimizes the same term as one process on the whole
    micro-batch (P_i stays local; the step's token weighting averages it over the ranks)."""
    n_experts = routing.probs.shape[-1]
    counts = expert_counts(routing.experts, n_experts)
    tokens = routing.experts.shape[0]
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
        tokens *= dist.get_world_size(group)
    fraction = counts.to(routing.probs.dtype) / tokens
    return n_experts * (fraction * routing.probs.mean(0)).sum()


def sequence_balancing_loss(routing: Routing, sequences: int,
                            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The auxiliary loss per sequence (scope `sequence`), averaged over the `sequences` rows
    of the routed tokens (row-major: each row's tokens are contiguous):
    mean_b E * sum_i f_bi * P_bi, f_bi = tokens of row b to expert i / tokens of row b (summed
    over the k choices), P_bi = mean router probability of i over row b's tokens.

    Under context parallelism each rank holds an equal part of every row: `group` (the
    context-parallel ranks) sums the rows' expert counts, so f_bi is the whole sequence's,
    while P_bi is the mean over this rank's part. The step's token weighting gives each rank
    (its tokens / the step's tokens), so the sum over the ranks holds the mean of the parts'
    P_bi, the whole sequence's P_bi: the sequence's loss exactly."""
    n_experts = routing.probs.shape[-1]
    choices = routing.experts.reshape(sequences, -1)  # (rows, local tokens x k)
    counts = torch.zeros(sequences, n_experts, dtype=torch.long, device=choices.device)
    counts.scatter_add_(1, choices, torch.ones_like(choices))
    tokens = routing.experts.shape[0] // sequences
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
        tokens *= dist.get_world_size(group)
    fraction = counts.to(routing.probs.dtype) / tokens
    probs = routing.probs.reshape(sequences, -1, n_experts).mean(1)
    return n_experts * (fraction * probs).sum(-1).mean()


# --- the block's MLP --------------------------------------------------------------------------
Dispatcher = Callable[[torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]], torch.Tensor]


class MoE(nn.Module):
    """Routed experts (+ shared experts): (batch, seq, dim) -> (batch, seq, dim)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.n_experts_per_token
        self.router = Router(args)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.expert_hidden_dim,
                                      args.expert_compute)
        self.shared = (FeedForward(args.replace(ffn_dim=args.shared_expert_hidden_dim))
                       if args.n_shared_experts else None)
        self.aux_coef = args.moe_aux_loss_coef
        self.aux_scope = args.moe_aux_loss_scope
        self.bias_rate = args.moe_bias_update_rate
        self.capacity_factor = args.moe_capacity_factor
        # Expert parallelism replaces this: (sorted tokens, tokens per expert, experts) -> out.
        self.dispatcher: Dispatcher | None = None
        # Tensor parallelism: sums the partial outputs of the TP ranks' experts (identity else).
        self.output_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The ranks whose expert counts the balancing loss sums (set by the parallel layout):
        # those holding parts of the same sequences (context parallel) for scope `sequence`,
        # the data-parallel ranks (context parallel included) for scope `micro_batch`.
        self.balance_group: dist.ProcessGroup | None = None
        # Statistics since they were last read (see `moe_stats`); device tensors, no host sync.
        # Integer counts, so that `model.to(bf16)` leaves them exact.
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts, dtype=torch.long),
                             persistent=False)
        self.register_buffer("step_load", torch.zeros(args.n_experts, dtype=torch.long),
                             persistent=False)
        self.last_aux_loss: torch.Tensor | None = None
        self.last_entropy: torch.Tensor | None = None

    def reset_state(self) -> None:
        """Zero the routing bias and the load counters (a new model, after `to_empty`)."""
        with torch.no_grad():
            self.router.expert_bias.zero_()
            self.tokens_per_expert.zero_()
            self.step_load.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        out = self._routed(flat, routing).to(x.dtype).view(shape)
        if self.output_reduce is not None:
            out = self.output_reduce(out)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.training:
            self._record(routing)
        if self.aux_coef > 0 and self.training and torch.is_grad_enabled():
            rows = shape[0] if x.dim() == 3 else 1  # (batch, seq, dim): one row per sequence
            aux = (sequence_balancing_loss(routing, rows, self.balance_group)
                   if self.aux_scope == "sequence"
                   else balancing_loss(routing, self.balance_group))
            self.last_aux_loss = aux.detach()
            out = _InjectAuxGrad.apply(out, aux, _aux_weight(self.aux_coef, flat.shape[0],
                                                             x.device))
        return out

    def _routed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Sort the (token, choice) pairs by expert, run the experts, scatter-add back."""
        n_tokens = x.shape[0]
        flat_experts = routing.experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = expert_counts(flat_experts, self.n_experts)
        token_of = order // self.top_k
        if self.capacity_factor is not None:
            order_keep, counts = self._capacity(flat_experts[order], counts, n_tokens)
            token_of = token_of[order_keep]
        sorted_x = x[token_of]
        if self.dispatcher is not None:
            y = self.dispatcher(sorted_x, counts, self.experts)
        else:
            y = self.experts(sorted_x, counts)
        # Back to (token, choice) order, then each token's weighted sum over its k outputs as
        # one batched matmul: autograd keeps the outputs once, in the compute dtype.
        if self.capacity_factor is not None:  # dropped choices contribute zero
            y = y.new_zeros(order.numel(), y.shape[1]).index_put((order_keep,), y)
        unsorted = y[torch.argsort(order)].view(n_tokens, self.top_k, -1)
        gate = routing.weights.to(unsorted.dtype).unsqueeze(1)
        if self.output_reduce is not None:  # TP: each rank's outputs give a part of the
            gate = self.dispatcher.copy_to_region(gate)  # gate gradient: sum them
        return torch.bmm(gate, unsorted).squeeze(1)

    def _capacity(self, sorted_experts: torch.Tensor, counts: torch.Tensor, n_tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep at most capacity = ceil(factor * tokens * k / experts) tokens per expert (the
        first ones in token order); the others skip the expert (their weight is lost)."""
        capacity = math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(sorted_experts.numel(), device=counts.device) \
            - starts[sorted_experts]
        keep = torch.nonzero(rank_in_expert < capacity).squeeze(1)
        return keep, counts.clamp(max=capacity)

    @torch.no_grad()
    def _record(self, routing: Routing) -> None:
        counts = expert_counts(routing.experts, self.n_experts)
        self.tokens_per_expert += counts
        self.step_load += counts
        p = routing.probs if self.router.score == "softmax" else \
            routing.probs / routing.probs.sum(-1, keepdim=True)
        self.last_entropy = -(p * torch.log(p.clamp_min(1e-20))).sum(-1).mean()


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    """(name, module) of every MoE block MLP of `model` (possibly wrapped)."""
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            yield name, module


@torch.no_grad()
def update_expert_bias(model: nn.Module,
                       all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each router's
    bias rises by `moe_bias_update_rate` for experts that got fewer tokens than the mean over
    the step, and falls by as much for those that got more.
    `all_reduce` sums the counts over the ranks that routed different tokens, so every replica
    moves its bias identically. Reads and zeroes each layer's `step_load`."""
    layers = [m for _, m in moe_layers(model) if m.bias_rate > 0]
    if not layers:
        return
    loads = torch.stack([m.step_load for m in layers]).float()
    if all_reduce is not None:
        loads = all_reduce(loads)
    for m, load in zip(layers, loads, strict=True):
        bias = m.router.expert_bias
        bias += (m.bias_rate * torch.sign(load.mean() - load)).to(bias.dtype)
        m.step_load.zero_()


MLP_BUILDERS.append((lambda args: args.is_moe, MoE))

__all__ = ["MoE", "Router", "Routing", "GroupedExperts", "balancing_loss", "expert_counts",
           "moe_layers", "sequence_balancing_loss",
           "update_expert_bias", "aux_loss_weighting"]
