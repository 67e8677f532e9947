"""A decoder-only transformer: Llama-style by default, GPT-2-style with `arch="gpt2"`; the
other RoPE families (Qwen, Mistral, Phi-3, Gemma 2) are the same block with the differences
`ModelArgs` states (see `models/layers.py`).

Plain `nn.Module`s with no distributed code. Build on the meta device for large models,
then `to_empty(device=...)` and `init_weights()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from scaletrain.models.args import ModelArgs
from scaletrain.models.layers import (  # noqa: F401  (FeedForward, make_norm: old import path)
    FeedForward,
    RMSNorm,
    attend,
    make_mlp,
    make_norm,
)
from scaletrain.models.moe import GroupedExperts, MoE
from scaletrain.models.rope import apply_rope, inverse_frequencies, rope_cos_sin


class KVCache(nn.Module):
    """Pre-allocated keys and values of one attention layer for incremental decoding."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.rows: slice | torch.Tensor = slice(None)
        """The batch rows the forward pass runs on (all by default): a slot-batching decoder
        runs the newcomers' prefill on their slots, a step on the occupied prefix. A slice
        keeps reads and writes views of the cache; an index tensor gathers those rows."""

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; asked for {end}")
        self.k[self.rows, :, start:end] = k
        self.v[self.rows, :, start:end] = v
        return self.k[self.rows, :, :end], self.v[self.rows, :, :end]


class Attention(nn.Module):
    """Grouped-query attention; per family: q/k/v biases, per-head q/k norms, a sliding window
    (this layer's, see `ModelArgs.is_sliding`), soft-capped logits and the query scale."""

    def __init__(self, args: ModelArgs, layer_id: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        bias = args.has_bias
        qkv_bias = bias or args.qkv_bias
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=bias)
        self.q_norm = make_norm(args, self.head_dim) if args.qk_norm else None
        self.k_norm = make_norm(args, self.head_dim) if args.qk_norm else None
        self.scale = args.attn_scale
        self.window = args.sliding_window if args.is_sliding(layer_id) else None
        self.softcap = args.attn_softcap
        self.use_rope = args.arch == "llama"
        self.cache: KVCache | None = None
        # Optional replacement for causal SDPA in training (q, k, v) -> out, all shaped
        # (batch, heads, seq, head_dim); e.g. ring attention when the sequence is split.
        self.attention_fn: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                start_pos: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: optional boolean (batch, 1, seq, keys) attention mask (True = attend) that
        replaces the causal mask (packed segments; a left-padded batch, also with a KV cache)."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:  # (batch, seq, heads, head_dim): TP shards dim 2
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        if self.use_rope:
            assert rope is not None
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.cache is not None:
            k, v = self.cache.update(start_pos, k, v)
        # Grouped-query attention: SDPA shares each K/V head among n_heads / n_kv_heads query
        # heads itself, without materializing repeated K/V.
        if mask is None and self.attention_fn is not None and self.cache is None:
            out = self.attention_fn(q, k, v)
        else:
            out = attend(q, k, v, scale=self.scale, start_pos=start_pos, mask=mask,
                         window=self.window, softcap=self.softcap)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = make_norm(args)
        self.attention = Attention(args, layer_id)
        self.ffn_norm = make_norm(args)
        self.feed_forward = make_mlp(args)
        # Gemma 2 normalizes the attention and MLP outputs too, before the residual add.
        self.post_attention_norm = make_norm(args) if args.post_norms else None
        self.post_ffn_norm = make_norm(args) if args.post_norms else None
        # Residual dropout (GPT-2): modules only when p > 0, so a model without dropout keeps its
        # module tree and draws no random numbers; activation checkpointing sees them
        # (`parallel/activation_checkpoint.py`) and restores the RNG state for recomputation.
        self.attention_dropout = nn.Dropout(args.dropout) if args.dropout > 0 else None
        self.ffn_dropout = nn.Dropout(args.dropout) if args.dropout > 0 else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                start_pos: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        a = self.attention(self.attention_norm(x), rope, start_pos, mask=mask)
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        if self.attention_dropout is not None:
            a = self.attention_dropout(a)
        h = x + a
        m = self.feed_forward(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            m = self.post_ffn_norm(m)
        if self.ffn_dropout is not None:
            m = self.ffn_dropout(m)
        return h + m


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = (
            nn.Embedding(args.max_seq_len, args.dim) if args.arch == "gpt2" else None
        )
        # A ModuleDict keyed by layer index keeps names stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.embedding_dropout = nn.Dropout(args.dropout) if args.dropout > 0 else None
        self.norm = make_norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer(
            "inv_freq",
            inverse_frequencies(args.head_dim, args.rope_theta, args.rope_scaling),
            persistent=False,
        )

    def forward(self, tokens: torch.Tensor, start_pos: int = 0,
                segment_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None, hidden: bool = False) -> torch.Tensor:
        """Logits for `tokens` (B, S) at positions start_pos.. (with a KV cache: after it).

        `segment_ids`: see `hidden_states`. `positions` (seq,) overrides
        `start_pos + arange(seq)` for the RoPE/position tables (a rank holding a non-contiguous
        slice of the sequence passes its own positions; a compacted KV cache, whose column
        `start_pos` holds a later position). `key_mask` (B, >= start_pos + S) bool marks real
        tokens (cache columns) of a padded batch; False entries (padding) are never attended to.
        `hidden`: return the final-norm hidden states (B, S, dim) instead of the logits (the
        fused loss applies the head itself; through `forward`, DDP and FSDP hooks still run).
        """
        h = self.forward_part(tokens, self.layers.keys(), embed=True, head=not hidden,
                              start_pos=start_pos, positions=positions, segment_ids=segment_ids,
                              key_mask=key_mask)
        return self.norm(h) if hidden else h

    def hidden_states(self, tokens: torch.Tensor, start_pos: int = 0,
                      segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states (batch, seq, dim).

        `segment_ids` (batch, seq), for several sequences packed into one row: a token attends
        only to earlier tokens of its own segment, and positions restart at 0 where a segment
        starts, so each packed sequence is computed as if it were alone.
        """
        h = self._trunk(tokens, self.layers.keys(), True, start_pos, None, segment_ids)
        return self.norm(h)

    def forward_part(self, x: torch.Tensor, layer_ids: Iterable[str], embed: bool, head: bool,
                     start_pos: int = 0, positions: torch.Tensor | None = None,
                     segment_ids: torch.Tensor | None = None,
                     key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run part of the model: the embedding (when `embed`, `x` are token ids; otherwise a
        hidden state), the listed layers, then norm and head (when `head`). Pipeline stages
        use it on a model whose other parts were removed."""
        h = self._trunk(x, layer_ids, embed, start_pos, positions, segment_ids, key_mask)
        return self.logits(h) if head else h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and (Gemma 2) the final logit soft-cap of hidden states."""
        logits = self.output(self.norm(h))
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _trunk(self, x: torch.Tensor, layer_ids: Iterable[str], embed: bool, start_pos: int,
               positions: torch.Tensor | None,
               segment_ids: torch.Tensor | None,
               key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Embedding (when `embed`) and the listed layers; see `forward_part`."""
        seqlen = x.shape[1]  # from the input, never from a sharded hidden state
        mask = None
        if segment_ids is not None:
            if start_pos != 0 or positions is not None:
                raise ValueError("segment_ids cannot be combined with a KV cache (start_pos > 0) "
                                 "or explicit positions")
            positions, mask = segment_positions_and_mask(segment_ids)
        else:
            if positions is None:
                if start_pos + seqlen > self.args.max_seq_len:
                    raise ValueError(
                        f"sequence of {start_pos + seqlen} tokens exceeds max_seq_len "
                        f"{self.args.max_seq_len}"
                    )
                positions = torch.arange(start_pos, start_pos + seqlen, device=x.device)
            if key_mask is not None:  # over cache columns, whatever the RoPE positions
                mask = padded_causal_mask(key_mask, start_pos, seqlen)
        h = self.tok_embeddings(x) if embed else x
        if embed and self.args.embed_scale:  # Gemma: sqrt(dim), rounded to the hidden dtype
            h = h * torch.tensor(self.args.dim ** 0.5, dtype=h.dtype)
        rope = None
        if self.pos_embeddings is not None:
            if embed:
                h = h + self.pos_embeddings(positions)
        else:
            if self.inv_freq.dtype != torch.float32:  # `.to(bf16)` rounded them: recompute
                self.reset_buffers()
            cos, sin = self._rope_tables(positions, h.dtype)
            rope = (cos, sin) if positions.ndim == 1 else (cos[:, None], sin[:, None])
        if embed and self.embedding_dropout is not None:
            h = self.embedding_dropout(h)
        for layer_id in layer_ids:  # mask by keyword: TP's input plans cover positional inputs
            h = self.layers[layer_id](h, rope, start_pos, mask=mask)
        return h

    def _rope_tables(self, positions: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for `positions`; LongRoPE switches to its long factors for the whole pass
        once it reaches beyond the original context (as transformers does)."""
        s = self.args.rope_scaling
        if s is None or s.kind != "longrope":
            return rope_cos_sin(self.inv_freq, positions, dtype)
        inv_freq = self.inv_freq
        if int(positions.max()) + 1 > s.original_max_seq_len:
            inv_freq = inverse_frequencies(self.args.head_dim, self.args.rope_theta, s,
                                           long=True).to(positions.device)
        return rope_cos_sin(inv_freq, positions, dtype, s.attention_factor)

    # --- initialization -------------------------------------------------------------------
    def reset_buffers(self) -> None:
        """Tie the head again (`to_empty` unties shared parameters) and rebuild the RoPE table
        in fp32, whatever the dtype of the weights."""
        args = self.args
        if args.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight
        self.inv_freq = inverse_frequencies(args.head_dim, args.rope_theta, args.rope_scaling).to(
            self.inv_freq.device if self.inv_freq.device.type != "meta" else _device_of(self)
        )

    def reset_moe_state(self) -> None:
        """Zero the routing biases and load counters of MoE blocks (after `to_empty`)."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_state()

    def init_plan(self, std: float = 0.02) -> list[tuple[str, str, float]]:
        """(parameter name, "normal" | "ones" | "zeros", std) in the order `init_weights`
        draws them from the RNG (tied parameters once).

        Projections into the residual stream (`wo`, `w2`) use std / sqrt(2 * n_layers).
        """
        args = self.args
        out_std = std / math.sqrt(2 * args.n_layers)
        plan: list[tuple[str, str, float]] = []
        if self.tok_embeddings is not None:
            plan.append(("tok_embeddings.weight", "normal", std))
        if self.pos_embeddings is not None:
            plan.append(("pos_embeddings.weight", "normal", std / 2))
        for name, module in self.named_modules():
            if isinstance(module, GroupedExperts):
                plan += [(f"{name}.w1", "normal", std), (f"{name}.w2", "normal", out_std),
                         (f"{name}.w3", "normal", std)]
            elif isinstance(module, nn.Linear):
                is_residual = name.endswith(("attention.wo", ".w2"))
                if module is not self.output or not args.tie_embeddings:
                    plan.append((f"{name}.weight", "normal", out_std if is_residual else std))
                if module.bias is not None:
                    plan.append((f"{name}.bias", "zeros", 0.0))
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                unit = getattr(module, "unit_offset", False)
                plan.append((f"{name}.weight", "zeros" if unit else "ones", 0.0))
                if getattr(module, "bias", None) is not None:
                    plan.append((f"{name}.bias", "zeros", 0.0))
        return plan

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Initialize every parameter and buffer (also after `to_empty` from the meta device)."""
        self.reset_buffers()
        self.reset_moe_state()
        params = dict(self.named_parameters())
        for name, kind, s in self.init_plan(std):
            _fill(params[name], kind, s)

    # --- generation support ------------------------------------------------------------------
    def setup_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> None:
        """Attach a KV cache of `max_len` positions to every attention layer."""
        param = self.tok_embeddings.weight
        for layer in self.layers.values():
            attn = layer.attention
            attn.cache = KVCache(batch, attn.n_kv_heads, max_len, attn.head_dim,
                                 dtype or param.dtype, param.device)

    def clear_cache(self) -> None:
        for layer in self.layers.values():
            layer.attention.cache = None


def padded_causal_mask(key_mask: torch.Tensor, start_pos: int, seqlen: int) -> torch.Tensor:
    """The (batch, 1, seq, start_pos + seq) boolean mask of a left-padded batch: causal, and
    only real keys (`key_mask` True), except that a query always sees itself (a padding query
    would otherwise attend to nothing)."""
    n_keys = start_pos + seqlen
    keys = torch.arange(n_keys, device=key_mask.device)
    queries = torch.arange(start_pos, n_keys, device=key_mask.device)
    causal = keys[None, :] <= queries[:, None]
    return causal & (key_mask[:, None, None, :n_keys] | (keys[None, :] == queries[:, None]))


def segment_positions_and_mask(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token positions that restart at each segment, and the boolean (batch, 1, seq, seq)
    attention mask that is causal inside a segment and closed across segments."""
    bsz, seqlen = segment_ids.shape
    index = torch.arange(seqlen, device=segment_ids.device).expand(bsz, seqlen)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=segment_ids.device).tril()
    return index - first, (same & causal)[:, None]


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _fill(t: torch.Tensor, kind: str, std: float) -> None:
    if kind == "normal":
        nn.init.normal_(t, std=std)
    else:
        (nn.init.ones_ if kind == "ones" else nn.init.zeros_)(t)


def init_values(args: ModelArgs, seed: int, std: float = 0.02
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, value) of every parameter of `build_model(args, "cpu", seed=seed)`, the same
    values, made one at a time on the CPU: peak memory is one parameter, not the model."""
    with torch.device("meta"):
        model = Transformer(args)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    torch.manual_seed(seed)
    for name, kind, s in model.init_plan(std):
        value = torch.empty(shapes[name])
        _fill(value, kind, s)
        yield name, value


def empty_model(
    args: ModelArgs, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """A model with uninitialized weights (to be loaded into), ties and RoPE table in place.

    Cheaper than `build_model` for big models: nothing is randomly initialized.
    """
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.to(dtype)
    model.reset_buffers()
    model.reset_moe_state()
    return model


def build_model(args: ModelArgs, device: torch.device | str = "cpu", seed: int | None = None,
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Build on the meta device, materialize on `device` and initialize (seeded if given)."""
    model = empty_model(args, device)
    if seed is not None:
        torch.manual_seed(seed)
    model.init_weights()
    return model.to(dtype)  # RoPE frequencies cast with it are recomputed in fp32 on use
