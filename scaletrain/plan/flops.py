"""FLOPs per token of training from the model's dimensions (shared by planner and trainer)."""

from __future__ import annotations

from functools import lru_cache

from scaletrain.models.args import ModelArgs, count_active_params, count_params


@lru_cache(maxsize=256)
def matmul_params(args: ModelArgs) -> int:
    """Parameters that take part in a matmul per token: all but the embedding lookups.

    A tied output head still multiplies every token, so it is counted once as the head. A
    Mixture-of-Experts model counts the active parameters: the router and the k routed experts
    (plus shared experts) a token goes through, not the experts it skips.
    """
    p = count_params(args)
    skipped = p.total - count_active_params(args)
    return p.non_embedding - skipped + args.vocab_size * args.dim


@lru_cache(maxsize=1024)
def attention_forward_flops(args: ModelArgs, seq_len: int) -> float:
    """Forward FLOPs per token of attention scores and values, summed over the layers:
    2 x 2 x keys x head_dim x heads, where keys is the sequence, or the sliding window of a
    local layer when it is shorter (Mistral, Phi-3, Gemma 2's local layers)."""
    spans = sum(args.attention_span(i, seq_len) for i in range(args.n_layers))
    return 4 * args.n_heads * args.head_dim * spans


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Model FLOPs per trained token: 6N (forward + backward matmuls) + the attention term.

    Attention scores and values cost 2 x 2 x seq x head_dim x heads per layer forward, times 3 for
    forward + backward: 12 * n_layers * n_heads * head_dim * seq_len (PaLM's convention; the causal
    mask is not discounted, as in Megatron-LM and torchtitan). Recomputation is not counted (MFU).
    A sliding window shorter than the sequence counts the window's keys instead.
    """
    return 6 * matmul_params(args) + 3 * attention_forward_flops(args, seq_len)
