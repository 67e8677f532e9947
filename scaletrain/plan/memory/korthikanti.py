"""Activation memory of GPT-2/3-style blocks after Korthikanti et al. 2022 (arXiv:2205.05198).

The paper's block: LayerNorm, GELU MLP of width 4h, dropout after attention scores, attention
output and MLP, attention scores materialized (a x s x s per sequence), 16-bit activations with
1-byte dropout masks. Per layer and micro-batch, in bytes (s sequence, b micro-batch, h hidden,
a heads, t tensor-parallel degree):

- no parallelism:                 s b h (34 + 5 a s / h)
- tensor parallel:                s b h (10 + 24 / t + 5 a s / (h t))
- tensor + sequence parallel:     s b h / t (34 + 5 a s / h)
- selective recomputation (the attention core is recomputed): drop the 5 a s / h term
- full recomputation:             2 s b h (the block input only; / t with sequence parallel)

Pipeline rules: with 1F1B the first stage holds p micro-batches of L/p layers, so L layers of
activations whatever p; interleaving with m model chunks multiplies that by 1 + (p-1)/(p m).
These formulas describe Megatron-LM's GPT and are kept as a reference; the planner's estimate
for scaletrain's own model is in `activations.py`.
"""

from __future__ import annotations

from typing import Literal

from scaletrain.models.args import ModelArgs

Recompute = Literal["none", "selective", "full"]


def layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                recompute: Recompute = "none") -> float:
    """Activation bytes one transformer layer keeps for backward (per micro-batch)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    attention_core = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + attention_core)
    return s * b * h * (10 + 24 / t + attention_core / t)


def first_stage_bytes(n_layers: int, per_layer: float, pp: int = 1,
                      interleave: int = 1) -> float:
    """Activations held by the first pipeline stage under 1F1B (interleaved when m > 1)."""
    if pp <= 1:
        return n_layers * per_layer
    factor = 1 + (pp - 1) / (pp * interleave) if interleave > 1 else 1.0
    return n_layers * per_layer * factor


def llama_layer_bytes(args: ModelArgs, tokens: int, t: int = 1,
                      sequence_parallel: bool = False) -> float:
    """The paper's per-layer count (section 4.1, 16-bit activations) adapted to a Llama block
    with flash attention (no s x s scores: the 5 a s / h term goes), no dropout (the masks go),
    grouped-query attention (K, V of g heads of size d) and a gated MLP of width f: the two
    norms' inputs 2 x 2sbh; attention: QKV input 2sbh, Q 2sbh, K and V 2 x 2 s b g d, the output
    projection's input 2sbh; MLP: its input 2sbh, the gate's two f-wide inputs 4 s b f, the down
    projection's input 2 s b f. Total (12 h + 4 g d + 6 f) bytes per token (`tokens` = s b).

    Tensor parallel over t ranks (the paper's table 2, s b h (10 + 24/t) without the attention
    scores): the norms' inputs and the QKV and MLP inputs stay whole on every rank (8 h; the
    paper's 10 also counts two dropout masks), the rest is divided by t: 8 h + (4 h + 4 g d +
    6 f) / t. With sequence parallelism everything is divided by t: (12 h + 4 g d + 6 f) / t
    (the paper's s b h 34 / t)."""
    h, f, gd = args.dim, args.hidden_dim, args.kv_heads * args.head_dim
    if sequence_parallel and t > 1:
        return tokens * (12 * h + 4 * gd + 6 * f) / t
    return tokens * (8 * h + (4 * h + 4 * gd + 6 * f) / t)
