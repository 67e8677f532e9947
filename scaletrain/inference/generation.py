"""Autoregressive decoding with the model's KV cache: greedy, temperature, top-k, top-p."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from scaletrain.inference.batch_decode import Row, decode_rows
from scaletrain.inference.sampling import check_request, filter_logits, rope_switches_at, stop_set
from scaletrain.models.transformer import Transformer


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
    n_new = check_request(model, prompt_ids, max_new_tokens, temperature, top_k, top_p)
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


__all__ = ["generate", "generate_batch", "filter_logits"]
