"""Continuous (in-flight) batching: rows join and leave a running batch at token boundaries.

`SlotBatch` decodes up to `slots` rows through one KV cache. Every row writes its next token
at the same cache column `pos`. A newcomer's prompt is prefilled into a free slot
right-aligned to `pos` (columns `pos - n .. pos - 1`), the columns left of it masked out of
attention, and from the next step on it decodes alongside the others. Each row carries its
own RoPE positions: cache column c of a row whose first token sits in column `start` has
position c - start, so a row sees exactly the positions it has alone (0, 1, ...), wherever
its columns lie, and computes what it computes alone up to float rounding of the batched
matrix products. A row that finishes, or is dropped, frees its slot at once for the next
newcomer.

Per row, exactly as `batch_decode.decode_rows`: the budget, end-of-sequence ids and the stop
callback, logit bias, presence/frequency penalties, a seeded generator, log-probabilities
(generated, prompt and top alternatives) and `on_token` streaming. The sampling settings
(temperature, top-k, top-p) are per row as well, so rows with different settings share a
batch.

Admission (`try_join`): the cache has up to twice `max_seq_len` columns (allocated as they
are needed). A newcomer fits when, with the live columns (from the first column of the oldest
row to `pos`) moved as far left as they go, its prompt fits left of the column it would start
decoding at and every row's remaining tokens fit right of it. Since positions are per row,
the live columns may move: left (compaction), or right, so that a prompt longer than `pos`
joins at once. The live columns are at most `max_seq_len` and a row that fits the context
alone needs at most `max_seq_len` more, so every valid row joins as soon as a slot is free:
no row waits for the batch to drain. Compaction: once every row's first column lies right of half
the used columns, the live columns move to the left of the cache, so attention never spans
columns that no row uses any more. Learned absolute position embeddings and LongRoPE are not
shift-invariant: `supports(model)` is False for them and callers decode static batches
(`decode_rows`) instead.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from scaletrain.inference.batch_decode import Decoded, Row, _top, apply_controls
from scaletrain.inference.sampling import check_request, filter_logits, stop_set
from scaletrain.models.transformer import KVCache, Transformer


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None


@dataclass
class _Slot:
    row: Row
    tag: Hashable
    budget: int
    sampling: Sampling
    generator: torch.Generator | None
    result: Decoded
    controls: bool
    started: bool = False  # prefilled
    start: int = 0  # the cache column of its first prompt token (once prefilled)


def supports(model: Transformer) -> bool:
    """Whether rows may sit at shifted positions: relative positions only (no learned absolute
    position table, no LongRoPE switch to long factors)."""
    s = model.args.rope_scaling
    return model.pos_embeddings is None and (s is None or s.kind != "longrope")


class SlotBatch:
    """Up to `slots` rows decoded together; see the module docstring. Not thread-safe: one
    owner calls `try_join`, `step` and `drop`."""

    def __init__(self, model: Transformer, slots: int, eos_id: int | Iterable[int] | None = None,
                 pad_id: int = 0):
        if not supports(model):
            raise ValueError("continuous batching needs relative positions (RoPE without "
                             "LongRoPE); decode this model with decode_rows")
        if slots < 1:
            raise ValueError(f"slots must be >= 1 (got {slots})")
        self.model, self.pad_id = model, pad_id
        self.stop_ids = stop_set(eos_id)
        self.limit = model.args.max_seq_len
        # Cache columns: a row alone needs at most `limit`, and a newcomer placed right of the
        # live columns (at most `limit` of them) needs at most `limit` more, so with twice the
        # context every row that fits alone joins as soon as a slot is free.
        self.columns = 2 * self.limit
        self.device = model.tok_embeddings.weight.device
        vocab = model.args.vocab_size
        self.slots: list[_Slot | None] = [None] * slots
        self.pos = 0  # the cache column the next fed token is written to
        self.compact_min = 64  # compact once this many columns at least are dead
        self.compactions = 0
        self.key_mask = torch.zeros((slots, self.columns), dtype=torch.bool, device=self.device)
        self.logits = torch.zeros((slots, vocab), device=self.device)
        self.bias = torch.zeros((slots, vocab), device=self.device)
        self.counts = torch.zeros((slots, vocab), device=self.device)
        self.presence = torch.zeros((slots, 1), device=self.device)
        self.frequency = torch.zeros((slots, 1), device=self.device)
        self._caches: list[KVCache] = []
        self.steps = 0  # forward steps run (prefills not counted)
        self.tokens = 0  # tokens picked

    # --- occupancy ------------------------------------------------------------------------
    @property
    def occupied(self) -> int:
        return sum(s is not None for s in self.slots)

    def tags(self) -> list[Hashable]:
        return [s.tag for s in self.slots if s is not None]

    # --- joining and leaving --------------------------------------------------------------
    def try_join(self, row: Row, sampling: Sampling, tag: Hashable) -> bool:
        """Take `row` into a free slot (prefilled at the next `step`); False when no slot is
        free or it does not fit the cache now. Raises ValueError for an invalid row."""
        budget = check_request(self.model, row.prompt, row.max_new_tokens, sampling.temperature,
                        sampling.top_k, sampling.top_p)
        free = next((i for i, s in enumerate(self.slots) if s is None), None)
        if free is None:
            return False
        if not self._fits(len(row.prompt), budget):
            return False
        generator = None
        if sampling.temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(row.seed) if row.seed is not None else generator.seed()
        controls = bool(row.logit_bias or row.presence_penalty or row.frequency_penalty)
        self.slots[free] = _Slot(row, tag, budget, sampling, generator, Decoded([], "length"),
                                 controls)
        self.bias[free] = 0
        for tok, b in row.logit_bias.items():
            self.bias[free, tok] = b
        self.counts[free] = 0
        self.presence[free] = row.presence_penalty
        self.frequency[free] = row.frequency_penalty
        return True

    def _remaining(self, s: _Slot) -> int:
        """Tokens row `s` may still pick (each but the last is fed at a later column)."""
        return s.budget - len(s.result.ids)

    def _span(self) -> int:
        """Columns the decoding rows occupy (from the oldest row's first column to pos)."""
        starts = [s.start for s in self.slots if s is not None and s.started]
        return self.pos - min(starts) if starts else 0

    def _fits(self, n: int, budget: int) -> bool:
        """Whether a newcomer with an n-token prompt and `budget` fits next to the rows here,
        once the live columns are moved as far left as they go (`_layout`)."""
        waiting = [len(s.row.prompt) for s in self.slots if s is not None and not s.started]
        pos = max(self._span(), n, *waiting)
        most = max([budget] + [self._remaining(s) for s in self.slots if s is not None])
        return pos + most - 1 <= self.columns

    def drop(self, tag: Hashable) -> Decoded | None:
        """Remove the row `tag` (its slot is free for the next step); what it had decoded, or
        None when no such row is here."""
        for i, s in enumerate(self.slots):
            if s is not None and s.tag == tag:
                self._free(i)
                return s.result
        return None

    def clear(self) -> list[Hashable]:
        """Remove every row (after a failed step); their tags."""
        tags = self.tags()
        for i in range(len(self.slots)):
            self._free(i)
        return tags

    def _free(self, i: int) -> None:
        self.slots[i] = None
        if self.occupied == 0:  # restart at column 0 and give the cache memory back
            self.pos = 0
            self._caches = []

    # --- decoding -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, Decoded | Exception]]:
        """Prefill the newcomers, pick one token for every row, feed the tokens of the rows
        that go on. Returns the rows that finished, with their result (or the exception their
        own callbacks raised). A failing forward pass raises: `clear` the batch then."""
        finished: list[tuple[Hashable, Decoded | Exception]] = []
        self._layout()
        self._prefill()
        need_logp = [i for i, s in enumerate(self.slots) if s is not None
                     and s.row.logprobs is not None and s.budget > 0]
        logp = self.logits[need_logp].log_softmax(-1) if need_logp else None
        for i, s in enumerate(self.slots):
            if s is None:
                continue
            try:
                done = s.budget == 0 or self._advance(i, s, logp, need_logp)
            except Exception as e:  # a row's own callback: it fails alone
                finished.append((s.tag, e))
                self._free(i)
                continue
            if done:
                finished.append((s.tag, s.result))
                self._free(i)
        if self.occupied:
            self._feed()
        return finished

    def _advance(self, i: int, s: _Slot, logp: torch.Tensor | None, need_logp: list[int]
                 ) -> bool:
        """Pick, record and stream row i's next token; True when the row has finished."""
        tok = self._pick(i, s)
        self.tokens += 1
        res, row = s.result, s.row
        res.ids.append(tok)
        if s.controls:
            self.counts[i, tok] += 1
        if logp is not None and row.logprobs is not None:
            lp = logp[need_logp.index(i)]
            res.logprobs.append(float(lp[tok]))
            res.top.append(_top(lp, row.logprobs))
        if row.on_token is not None:
            row.on_token(tok)
        if tok in self.stop_ids or (row.stop is not None and row.stop(res.ids)):
            res.finish_reason = "stop"
            return True
        return len(res.ids) == s.budget

    def _pick(self, i: int, s: _Slot) -> int:
        logits = self.logits[i]
        if s.controls:  # as decode_rows: bias, presence and frequency from the raw logits
            logits = apply_controls(logits, self.bias[i], self.presence[i], self.frequency[i],
                                    self.counts[i])
        sp = s.sampling
        if sp.temperature == 0:
            return int(logits.argmax(dim=-1))
        probs = filter_logits(logits / sp.temperature, sp.top_k, sp.top_p).softmax(dim=-1)
        return int(torch.multinomial(probs, 1, generator=s.generator))

    def _prefill(self) -> None:
        """Run the prompts of the newcomers in one left-padded pass over their slots; their
        next-token logits (and prompt log-probabilities) come from it."""
        run = [i for i, s in enumerate(self.slots) if s is not None and not s.started]
        if not run:
            return
        self._ensure(self.pos)  # the prompts' columns; `_feed` grows the cache as pos advances
        slots = [self.slots[i] for i in run]
        assert all(s is not None for s in slots)
        longest = max(len(s.row.prompt) for s in slots)  # type: ignore[union-attr]
        start = self.pos - longest
        tokens = torch.full((len(run), longest), self.pad_id, dtype=torch.long,
                            device=self.device)
        for j, (i, s) in enumerate(zip(run, slots)):
            prompt = s.row.prompt  # type: ignore[union-attr]
            n = len(prompt)
            tokens[j, longest - n:] = torch.tensor(prompt, dtype=torch.long)
            s.start = self.pos - n  # type: ignore[union-attr]
            self.key_mask[i] = False
            self.key_mask[i, self.pos - n:self.pos] = True
        adjacent = run == list(range(run[0], run[-1] + 1))
        rows = (slice(run[0], run[-1] + 1) if adjacent  # a view; else a gather of these rows
                else torch.tensor(run, dtype=torch.long, device=self.device))
        with self._attached(rows):
            firsts = torch.tensor([s.start for s in slots], device=self.device)  # type: ignore[union-attr]
            positions = torch.arange(start, self.pos, device=self.device) - firsts[:, None]
            hidden = self.model.forward_part(tokens, self.model.layers.keys(), embed=True,
                                             head=False, start_pos=start, positions=positions,
                                             key_mask=self.key_mask[rows])
        for j, s in enumerate(slots):
            assert s is not None
            s.started = True
            if s.row.echo_logprobs:
                n = len(s.row.prompt)
                lp = self.model.logits(hidden[j, longest - n:longest - 1]).float().log_softmax(-1)
                nxt = torch.tensor(s.row.prompt[1:], dtype=torch.long, device=self.device)
                chosen = lp.gather(-1, nxt[:, None])[:, 0].tolist() if len(nxt) else []
                s.result.prompt_logprobs = [None, *chosen]
                s.result.prompt_top = [{}] + [_top(x, s.row.logprobs or 0) for x in lp]
        self.logits[rows] = self.model.logits(hidden[:, -1]).float()

    def _feed(self) -> None:
        """One forward step: every occupied slot's last token at column `pos` (free slots
        inside the occupied prefix feed padding; their output is ignored)."""
        hi = max(i for i, s in enumerate(self.slots) if s is not None) + 1
        step = [[s.result.ids[-1] if s is not None else self.pad_id] for s in self.slots[:hi]]
        self.key_mask[:hi, self.pos] = True  # a free slot's mask is reset when a row joins it
        self._ensure(self.pos + 1)
        rows = slice(0, hi)
        tokens = torch.tensor(step, dtype=torch.long, device=self.device)
        with self._attached(rows):
            out = self.model(tokens, self.pos, key_mask=self.key_mask[rows],
                             positions=self._positions(hi))
        self.logits[rows] = out[:, -1].float()
        self.pos += 1
        self.steps += 1

    def _positions(self, hi: int) -> torch.Tensor:
        """(hi, 1): each of the first `hi` slots' own RoPE position of column `pos` (free
        slots: 0)."""
        return torch.tensor([[self.pos - s.start if s is not None else 0]
                             for s in self.slots[:hi]], device=self.device)

    # --- the KV cache ---------------------------------------------------------------------
    def _layout(self) -> None:
        """Before a step: place the live columns so that every newcomer's prompt fits left of
        `pos` and every row's remaining tokens right of it (moving them left or right, as
        `_fits` promised); without newcomers, drop dead columns once they are at least half
        of the used ones (and `compact_min`). Positions are per row, so a move changes
        nothing a row computes."""
        waiting = [len(s.row.prompt) for s in self.slots if s is not None and not s.started]
        need = max([self._span(), *waiting])  # the smallest pos that holds them all
        most = max((self._remaining(s) for s in self.slots if s is not None), default=0)
        dead = self.pos - need
        must = bool(waiting) and (max(waiting) > self.pos or self.pos + most - 1 > self.columns)
        if must or (dead >= self.compact_min and 2 * dead >= self.pos):
            self._move(need - self.pos)

    def _move(self, shift: int) -> None:
        """Move the live columns (and `pos`) by `shift` columns."""
        span = self._span()
        low, target = self.pos - span, self.pos + shift
        if shift > 0:
            self._ensure(target)
        for c in self._caches:
            c.k[:, :, low + shift:target] = c.k[:, :, low:self.pos].clone()
            c.v[:, :, low + shift:target] = c.v[:, :, low:self.pos].clone()
        live = self.key_mask[:, low:self.pos].clone()
        self.key_mask[:] = False
        self.key_mask[:, low + shift:target] = live
        for s in self.slots:
            if s is not None and s.started:
                s.start += shift
        self.pos = target
        if shift < 0:
            self.compactions += 1

    def _ensure(self, cols: int) -> None:
        """Caches of at least `cols` columns (grown by doubling, at most `columns`)."""
        have = self._caches[0].k.shape[2] if self._caches else 0
        if cols <= have:
            return
        size = min(self.columns, max(cols, 2 * have))
        param = self.model.tok_embeddings.weight
        grown = []
        for i, layer in enumerate(self.model.layers.values()):
            attn = layer.attention
            c = KVCache(len(self.slots), attn.n_kv_heads, size, attn.head_dim, param.dtype,
                        param.device)
            if have:
                c.k[:, :, :have] = self._caches[i].k
                c.v[:, :, :have] = self._caches[i].v
            grown.append(c)
        self._caches = grown

    @contextmanager
    def _attached(self, rows: slice | torch.Tensor) -> Iterator[None]:
        """The batch's caches on the model's attention layers for one pass over `rows`
        (detached after it, so the model is free for other users between steps)."""
        layers = list(self.model.layers.values())
        for layer, cache in zip(layers, self._caches):
            cache.rows = rows
            layer.attention.cache = cache
        try:
            yield
        finally:
            for layer in layers:
                layer.attention.cache = None


__all__ = ["SlotBatch", "Sampling", "supports"]
