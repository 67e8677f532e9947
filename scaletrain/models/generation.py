"""Autoregressive decoding with the model's KV cache: greedy, temperature, top-k, top-p."""

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


def _check(
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


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Iterable[int] | None = None,
    seed: int | None = None,
) -> list[int]:
    """Continue `prompt_ids` by up to `max_new_tokens` tokens; returns the new ids only.

    The prompt is run once (prefill) and then one token per step through the KV cache.
    `temperature=0` is greedy decoding (top-k/top-p are then irrelevant). Generation stops after
    an end-of-sequence token, which is included in the output (the transformers convention).
    Prompt + output never exceed `model.args.max_seq_len`: `max_new_tokens` is cut with a
    warning. `seed` makes sampling reproducible without touching the global RNG.
    """
    n_new = _check(model, prompt_ids, max_new_tokens, temperature, top_k, top_p)
    if n_new == 0:
        return []
    stop = stop_set(eos_id)
    device = model.tok_embeddings.weight.device
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()

    def pick(logits: torch.Tensor) -> int:
        if temperature == 0:
            return int(logits.argmax(dim=-1))
        scaled = filter_logits(logits.float() / temperature, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    # The last new token is never fed back, so the cache needs one position less than the total.
    model.setup_cache(1, len(prompt_ids) + n_new - 1)
    try:
        tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        logits = model(tokens, start_pos=0)[0, -1]
        out: list[int] = []
        pos = len(prompt_ids)
        while True:
            token = pick(logits)
            out.append(token)
            if token in stop or len(out) == n_new:
                return out
            if rope_switches_at(model, pos):  # recompute the cache with the long factors
                full = torch.tensor([prompt_ids + out], dtype=torch.long, device=device)
                logits = model(full, start_pos=0)[0, -1]
            else:
                step = torch.tensor([[token]], dtype=torch.long, device=device)
                logits = model(step, start_pos=pos)[0, -1]
            pos += 1
    finally:
        model.clear_cache()


def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Iterable[int] | None = None,
    seeds: list[int | None] | None = None,
    pad_id: int = 0,
) -> list[list[int]]:
    """`generate` for several prompts at once: left-padded batches through one KV cache.

    Shorter prompts are padded on the left and the padding is masked out of attention, so each
    row continues its own prompt. Every row keeps its own budget (`max_new_tokens`, one for all
    or one per prompt, cut to what fits `max_seq_len` after that row's prompt) and stops at its
    own end-of-sequence; row i samples from its own generator seeded with `seeds[i]`, so a row's
    output does not depend on its batch-mates. See `batch_decode.decode_rows` for stop strings,
    logit controls and log-probabilities.
    """
    from scaletrain.models.batch_decode import Row, decode_rows

    if not prompts:
        return []
    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(
        prompts)
    if len(budgets) != len(prompts):
        raise ValueError(f"{len(budgets)} budgets for {len(prompts)} prompts")
    rows = [Row(p, b, s) for p, b, s in zip(prompts, budgets, seeds)]
    return [d.ids for d in decode_rows(model, rows, temperature, top_k, top_p, eos_id, pad_id)]


def rope_switches_at(model: Transformer, pos: int) -> bool:
    """LongRoPE (Phi-3) uses its long factors once the sequence passes the original context;
    keys cached with the short ones are then recomputed, at the step that feeds position
    `original_max_seq_len` (what transformers' Phi-3 generation does)."""
    s = model.args.rope_scaling
    return s is not None and s.kind == "longrope" and pos == s.original_max_seq_len


__all__ = ["generate", "generate_batch", "filter_logits"]
