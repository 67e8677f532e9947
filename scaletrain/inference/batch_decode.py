"""Batched decoding where every row keeps its own budget, stop conditions and logit controls.

Rows share one left-padded batch and one KV cache, and the sampling settings that cannot differ
inside one `filter_logits` call (temperature, top-k, top-p). Everything else is per row: the
number of new tokens, the stop condition (end-of-sequence ids and a callback that sees the row's
new ids, e.g. for stop strings), logit bias, presence/frequency penalties, the random generator,
and what to record (log-probabilities of the generated tokens, of the prompt tokens, and the
top alternatives). A row that has finished is masked: it no longer grows, its output is final,
and decoding ends as soon as every row has finished. Rows whose prompt + budget do not fit one
cache of `max_seq_len` positions together are decoded in separate groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from scaletrain.inference.sampling import check_request, filter_logits, rope_switches_at, stop_set
from scaletrain.models.transformer import Transformer


@dataclass
class Row:
    """One sequence to continue."""

    prompt: list[int]
    max_new_tokens: int
    seed: int | None = None
    stop: Callable[[list[int]], bool] | None = None
    """Called with the row's new ids after each token; True ends the row ("stop")."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    """Record log-probabilities of the generated tokens and this many top alternatives
    (0: the chosen token's only); None records nothing."""
    echo_logprobs: bool = False
    """Also score the prompt tokens (the first has no log-probability)."""
    on_token: Callable[[int], None] | None = None
    """Called with each new token id as it is decoded (streaming)."""


@dataclass
class Decoded:
    ids: list[int]
    finish_reason: str  # "stop" (eos or the row's stop callback) or "length"
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top: list[dict[int, float]] = field(default_factory=list)


def _top(logp: torch.Tensor, k: int) -> dict[int, float]:
    if k <= 0:
        return {}
    vals, idx = torch.topk(logp, min(k, logp.shape[-1]))
    return {int(i): float(v) for i, v in zip(idx.tolist(), vals.tolist())}


def apply_controls(logits: torch.Tensor, bias: torch.Tensor, presence: torch.Tensor,
                   frequency: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Logit bias, presence and frequency penalties (OpenAI's definitions) on raw logits;
    `counts`: how often each token was generated so far."""
    return logits + bias - presence * (counts > 0) - frequency * counts


def _groups(model: Transformer, rows: list[Row], budgets: list[int]) -> list[list[int]]:
    """Row indices in groups whose longest prompt + largest budget fit `max_seq_len` (and, for
    absolute position embeddings, of one prompt length), longest prompts first."""
    limit = model.args.max_seq_len
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].prompt))
    groups: list[list[int]] = []
    longest = most = 0
    for i in order:
        n, b = len(rows[i].prompt), budgets[i]
        same_len = model.pos_embeddings is None or n == longest
        if groups and same_len and longest + max(most, b) <= limit:
            groups[-1].append(i)
            most = max(most, b)
        else:
            groups.append([i])
            longest, most = n, b
    return groups


@torch.inference_mode()
def decode_rows(
    model: Transformer,
    rows: list[Row],
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Iterable[int] | None = None,
    pad_id: int = 0,
) -> list[Decoded]:
    """Decode every row; results in the order of `rows`. See the module docstring."""
    budgets = [check_request(model, r.prompt, r.max_new_tokens, temperature, top_k, top_p)
               for r in rows]
    stop_ids = stop_set(eos_id)
    out: list[Decoded | None] = [None] * len(rows)
    for idx in _groups(model, rows, budgets):
        res = _decode_group(model, [rows[i] for i in idx], [budgets[i] for i in idx],
                            temperature, top_k, top_p, stop_ids, pad_id)
        for i, r in zip(idx, res):
            out[i] = r
    return out  # type: ignore[return-value]


def _decode_group(model: Transformer, rows: list[Row], budgets: list[int], temperature: float,
                  top_k: int | None, top_p: float | None, stop_ids: set[int],
                  pad_id: int) -> list[Decoded]:
    device = model.tok_embeddings.weight.device
    batch, longest, most = len(rows), max(len(r.prompt) for r in rows), max(budgets)
    vocab = model.args.vocab_size
    tokens = torch.full((batch, longest), pad_id, dtype=torch.long, device=device)
    key_mask = torch.ones((batch, longest + most), dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        tokens[i, longest - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.long)
        key_mask[i, : longest - len(r.prompt)] = False
    mask = None if bool(key_mask.all()) else key_mask
    results = [Decoded([], "length") for _ in rows]
    controls = any(r.logit_bias or r.presence_penalty or r.frequency_penalty for r in rows)
    bias = torch.zeros((batch, vocab), device=device)
    presence = torch.tensor([[r.presence_penalty] for r in rows], device=device)
    frequency = torch.tensor([[r.frequency_penalty] for r in rows], device=device)
    counts = torch.zeros((batch, vocab), device=device)
    for i, r in enumerate(rows):
        for tok, b in r.logit_bias.items():
            bias[i, tok] = b
    generators: list[torch.Generator] = []
    if temperature > 0:
        for r in rows:
            g = torch.Generator(device=device)
            g.manual_seed(r.seed) if r.seed is not None else g.seed()
            generators.append(g)

    def head(h: torch.Tensor) -> torch.Tensor:
        return model.logits(h).float()

    model.setup_cache(batch, max(longest + most - 1, longest))
    try:
        hidden = model.forward_part(tokens, model.layers.keys(), embed=True, head=False,
                                    start_pos=0, key_mask=mask)
        for i, r in enumerate(rows):
            if r.echo_logprobs:
                start = longest - len(r.prompt)
                logp = head(hidden[i, start : longest - 1]).log_softmax(-1)
                nxt = torch.tensor(r.prompt[1:], dtype=torch.long, device=device)
                chosen = logp.gather(-1, nxt[:, None])[:, 0].tolist() if len(nxt) else []
                results[i].prompt_logprobs = [None, *chosen]
                k = r.logprobs or 0
                results[i].prompt_top = [{}] + [_top(lp, k) for lp in logp]
        logits = head(hidden[:, -1])
        del hidden
        done = [b == 0 for b in budgets]
        pos = longest
        while not all(done):
            adjusted = logits
            if controls:
                adjusted = apply_controls(logits, bias, presence, frequency, counts)
            if temperature == 0:
                picked = adjusted.argmax(dim=-1).tolist()
            else:
                probs = filter_logits(adjusted / temperature, top_k, top_p).softmax(dim=-1)
                picked = [int(torch.multinomial(probs[i], 1, generator=g))
                          for i, g in enumerate(generators)]
            logp = logits.log_softmax(-1) if any(r.logprobs is not None for r in rows) else None
            for i, (r, tok) in enumerate(zip(rows, picked)):
                if done[i]:
                    continue
                res = results[i]
                res.ids.append(tok)
                counts[i, tok] += 1
                if logp is not None and r.logprobs is not None:
                    res.logprobs.append(float(logp[i, tok]))
                    res.top.append(_top(logp[i], r.logprobs))
                if r.on_token is not None:
                    r.on_token(tok)
                if tok in stop_ids or (r.stop is not None and r.stop(res.ids)):
                    res.finish_reason, done[i] = "stop", True
                elif len(res.ids) == budgets[i]:
                    done[i] = True
            if all(done):
                break
            if rope_switches_at(model, pos):  # LongRoPE: recompute the cache, long factors
                fed = pos - longest + 1  # a finished row kept feeding its last token
                new = torch.tensor([r.ids + [r.ids[-1] if r.ids else pad_id] * (fed - len(r.ids))
                                    for r in results], dtype=torch.long, device=device)
                full = torch.cat([tokens, new], dim=1)
                logits = model(full, 0, key_mask=mask)[:, -1].float()
            else:
                step = torch.tensor([[r.ids[-1] if r.ids else pad_id] for r in results],
                                    dtype=torch.long, device=device)
                logits = model(step, pos, key_mask=mask)[:, -1].float()
            pos += 1
    finally:
        model.clear_cache()
    return results


__all__ = ["Row", "Decoded", "decode_rows"]
