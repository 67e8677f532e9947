"""What every decoder shares: argument checks, the top-k/top-p filter, the stop-id set and
LongRoPE's switch point. `generation` (one prompt), `batch_decode` (left-padded rows) and
`slot_decode` (continuous batching) build on it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from scaletrain.models.transformer import Transformer

logger = logging.getLogger(__name__)


def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Set logits outside the top-k set and outside the top-p nucleus to -inf (last dim).

    The nucleus is the smallest set of most likely tokens whose probability reaches `top_p`;
    the most likely token is always kept.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def check_request(
    model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float,
    top_k: int | None, top_p: float | None,
) -> int:
    """Validate the arguments; returns how many tokens may be generated."""
    args = model.args
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token id")
    bad = [t for t in prompt_ids if not 0 <= int(t) < args.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, "
                         f"{args.vocab_size})")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (got {temperature}); 0 means greedy")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (got {top_k})")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (got {top_p})")
    room = args.max_seq_len - len(prompt_ids)
    if room < 0:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens, more than the model's "
                         f"max_seq_len {args.max_seq_len}")
    if max_new_tokens > room:
        logger.warning("generating %d new tokens instead of %d: prompt + output may not exceed "
                       "max_seq_len %d", room, max_new_tokens, args.max_seq_len)
        return room
    return max_new_tokens


def stop_set(eos_id: int | Iterable[int] | None) -> set[int]:
    """The ids decoding stops at, from one end-of-sequence id, several, or none."""
    if eos_id is None:
        return set()
    return {eos_id} if isinstance(eos_id, int) else set(eos_id)


def rope_switches_at(model: Transformer, pos: int) -> bool:
    """LongRoPE (Phi-3) uses its long factors once the sequence passes the original context;
    keys cached with the short ones are then recomputed, at the step that feeds position
    `original_max_seq_len` (what transformers' Phi-3 generation does)."""
    s = model.args.rope_scaling
    return s is not None and s.kind == "longrope" and pos == s.original_max_seq_len


__all__ = ["check_request", "filter_logits", "rope_switches_at", "stop_set"]
