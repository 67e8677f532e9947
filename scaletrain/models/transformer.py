"""A decoder-only transformer: Llama-style by default, GPT-2-style with `arch="gpt2"`.

Plain `nn.Module`s with no distributed code. Build on the meta device for large models,
then `to_empty(device=...)` and `init_weights()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.args import ModelArgs
from scaletrain.models.rope import apply_rope, inverse_frequencies, rope_cos_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def make_norm(args: ModelArgs) -> nn.Module:
    if args.arch == "gpt2":
        return nn.LayerNorm(args.dim, eps=args.norm_eps)
    return RMSNorm(args.dim, args.norm_eps)


class KVCache(nn.Module):
    """Pre-allocated keys and values of one attention layer for incremental decoding."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; asked for {end}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        bias = args.has_bias
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=bias)
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
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        if self.use_rope:
            assert rope is not None
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.cache is not None:
            k, v = self.cache.update(start_pos, k, v)
        # Grouped-query attention: SDPA shares each K/V head among n_heads / n_kv_heads query
        # heads itself, without materializing repeated K/V.
        gqa = self.n_heads != self.n_kv_heads
        if mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        elif self.attention_fn is not None and self.cache is None:
            out = self.attention_fn(q, k, v)
        elif start_pos == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:  # decoding: query i sits at absolute position start_pos + i
            keys = torch.arange(k.shape[2], device=x.device)
            queries = torch.arange(start_pos, start_pos + seqlen, device=x.device)
            mask = keys[None, :] <= queries[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU (`w2(silu(w1 x) * w3 x)`) for Llama; GELU MLP (`w2(gelu(w1 x))`) for GPT-2."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden, bias = args.hidden_dim, args.has_bias
        self.gated = args.arch == "llama"
        self.w1 = nn.Linear(args.dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, args.dim, bias=bias)
        self.w3 = nn.Linear(args.dim, hidden, bias=False) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = make_norm(args)
        self.attention = Attention(args)
        self.ffn_norm = make_norm(args)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                start_pos: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, start_pos, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


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
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `tokens` (B, S) at positions start_pos.. (with a KV cache: after it).

        `segment_ids`: see `hidden_states`. `positions` (seq,) overrides
        `start_pos + arange(seq)` for the RoPE/position tables (a rank holding a non-contiguous
        slice of the sequence passes its own positions). `key_mask` (B, >= start_pos + S) bool
        marks real tokens of a padded batch; False entries (padding) are never attended to.
        """
        return self.forward_part(tokens, self.layers.keys(), embed=True, head=True,
                                 start_pos=start_pos, positions=positions, segment_ids=segment_ids,
                                 key_mask=key_mask)

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
        return self.output(self.norm(h)) if head else h

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
        elif positions is None:
            if start_pos + seqlen > self.args.max_seq_len:
                raise ValueError(
                    f"sequence of {start_pos + seqlen} tokens exceeds max_seq_len "
                    f"{self.args.max_seq_len}"
                )
            positions = torch.arange(start_pos, start_pos + seqlen, device=x.device)
            if key_mask is not None:
                mask = padded_causal_mask(key_mask, start_pos, seqlen)
        h = self.tok_embeddings(x) if embed else x
        rope = None
        if self.pos_embeddings is not None:
            if embed:
                h = h + self.pos_embeddings(positions)
        else:
            if self.inv_freq.dtype != torch.float32:  # `.to(bf16)` rounded them: recompute
                self.reset_buffers()
            cos, sin = rope_cos_sin(self.inv_freq, positions, h.dtype)
            rope = (cos, sin) if positions.ndim == 1 else (cos[:, None], sin[:, None])
        for layer_id in layer_ids:  # mask by keyword: TP's input plans cover positional inputs
            h = self.layers[layer_id](h, rope, start_pos, mask=mask)
        return h

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
            if isinstance(module, nn.Linear):
                is_residual = name.endswith(("attention.wo", "feed_forward.w2"))
                if module is not self.output or not args.tie_embeddings:
                    plan.append((f"{name}.weight", "normal", out_std if is_residual else std))
                if module.bias is not None:
                    plan.append((f"{name}.bias", "zeros", 0.0))
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                plan.append((f"{name}.weight", "ones", 0.0))
                if getattr(module, "bias", None) is not None:
                    plan.append((f"{name}.bias", "zeros", 0.0))
        return plan

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Initialize every parameter and buffer (also after `to_empty` from the meta device)."""
        self.reset_buffers()
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
    return model


def build_model(args: ModelArgs, device: torch.device | str = "cpu", seed: int | None = None,
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Build on the meta device, materialize on `device` and initialize (seeded if given)."""
    model = empty_model(args, device)
    if seed is not None:
        torch.manual_seed(seed)
    model.init_weights()
    return model.to(dtype)  # RoPE frequencies cast with it are recomputed in fp32 on use
