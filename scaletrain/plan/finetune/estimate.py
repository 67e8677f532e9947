"""Trainable parameters and memory per component of a fine-tuning method, from `ModelArgs`
alone (no model is built): what `scaletrain plan` needs to cover fine-tuning.

The same numbers the trainer reports after building the model (a test keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.models.args import ModelArgs, count_params
from scaletrain.models.linears import BLOCK_LINEARS as TARGETS

# NF4 block size (elements sharing one absmax), bitsandbytes' default: what finetune.qlora
# quantizes with (it takes it from here).
NF4_BLOCK_SIZE = 64


@dataclass(frozen=True)
class FinetuneEstimate:
    trainable: int
    total: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


def _linear_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in, out) of each target linear of one block."""
    d, q, kv, h = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim, \
        args.hidden_dim
    shapes = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, h), "down": (h, d)}
    if args.is_moe:  # the MLP is the experts (`_expert_lora`), the router is not a target
        del shapes["gate"], shapes["down"]
    elif args.arch == "llama":
        shapes["up"] = (d, h)
    return shapes


def _expert_lora(args: ModelArgs, rank: int, targets: tuple[str, ...]) -> int:
    """LoRA parameters on the routed experts of one MoE block (`finetune/lora_experts.py`):
    per expert, one adapter over [gate; up] (in dim, out 2 * hidden) and one over down."""
    if not args.is_moe:
        return 0
    d, h = args.dim, args.expert_hidden_dim
    out = 0
    if "gate" in targets or "up" in targets:
        out += rank * (d + 2 * h)
    if "down" in targets:
        out += rank * (h + d)
    return args.n_experts * out


COLUMN_PARALLEL = frozenset(("q", "k", "v", "gate", "up"))
"""Targets whose base is split by output rows under tensor parallelism (o, down: by input)."""


def lora_params_per_rank(args: ModelArgs, rank: int, targets: tuple[str, ...], tp: int) -> int:
    """LoRA parameters one tensor-parallel rank holds (`finetune/lora_tp.py`): B split by
    output rows on column-parallel targets and A by input columns on row-parallel ones, the
    other matrix whole; the routed experts' adapters as their experts (1/tp). tp=1: all."""
    shapes = _linear_shapes(args)
    per_block = 0
    for t in targets:
        if t not in shapes:
            continue
        i, o = shapes[t]
        per_block += rank * (i + o // tp) if t in COLUMN_PARALLEL else rank * (i // tp + o)
    return args.n_layers * (per_block + _expert_lora(args, rank, targets) // tp)


def estimate(args: ModelArgs, method: str, *, rank: int = 8,
             targets: tuple[str, ...] = tuple(TARGETS), num_labels: int | None = None,
             train_last: int | None = None, freeze_first: int = 0,
             freeze_embeddings: bool = True, train_norms: bool = False, weight_bytes: int = 4,
             optimizer_states: int = 2) -> FinetuneEstimate:
    """Parameters and bytes (weights, fp32 gradients, `optimizer_states` fp32 tensors per
    trainable parameter: 2 for AdamW) for `method` in full/freeze/lora/qlora.

    `num_labels` adds a classification head (trainable; the LM head is then frozen unless tied).
    `train_norms` (LoRA/QLoRA) also trains every block norm and the final norm.
    QLoRA: block linears at 4 bits + one 8-bit absmax per 64 weights (double quantization);
    the routers and routed experts of MoE blocks stay at `weight_bytes`.
    """
    pc = count_params(args)
    shapes = _linear_shapes(args)
    block_linear = sum(i * o for i, o in shapes.values())
    final_norm = 2 * args.dim if args.arch == "gpt2" else args.dim  # LayerNorm / RMSNorm
    per_block = (pc.attention + pc.mlp + pc.norms - final_norm) // args.n_layers
    head = 0 if num_labels is None else num_labels * args.dim
    lora = 0
    if method in ("lora", "qlora"):
        lora = args.n_layers * (sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets
                                    if t in shapes) + _expert_lora(args, rank, targets))
    total = pc.total + lora + head
    lm_head_frozen = num_labels is not None and not args.tie_embeddings
    if method == "full":
        trainable = pc.total - (pc.head if lm_head_frozen else 0)
    elif method == "freeze":
        n = args.n_layers
        frozen_blocks = n - train_last if train_last is not None else freeze_first
        frozen = frozen_blocks * per_block
        if freeze_embeddings or train_last is not None:
            frozen += pc.embedding + pc.positional
        if lm_head_frozen:
            frozen += pc.head
        trainable = pc.total - frozen
    elif method in ("lora", "qlora"):
        trainable = lora + (pc.norms if train_norms else 0)
    else:
        raise ValueError(f"unknown fine-tuning method '{method}' (full, freeze, lora, qlora)")
    trainable += head
    weights = total * weight_bytes
    if method == "qlora":
        quantized = args.n_layers * block_linear
        weights -= quantized * weight_bytes
        weights += quantized // 2 + quantized // NF4_BLOCK_SIZE  # 4-bit codes + 8-bit absmax
    return FinetuneEstimate(trainable, total, weights, trainable * 4,
                            optimizer_states * trainable * 4)


__all__ = ["FinetuneEstimate", "estimate", "lora_params_per_rank"]
