"""Model dimensions (`ModelArgs`), the named presets and exact parameter counts.

Every number that describes a model lives here; the trainer, the planner and the
Hugging Face adapter all read the same `ModelArgs`, so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

Arch = Literal["llama", "gpt2"]
Family = Literal["llama", "gpt2", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2",
                 "mixtral", "qwen3_moe"]
MlpAct = Literal["silu", "gelu_tanh"]
RouterScore = Literal["softmax", "sigmoid"]
ExpertCompute = Literal["grouped", "loop"]
MoeAuxLossScope = Literal["sequence", "micro_batch"]
MOE_AUX_LOSS_SCOPES: tuple[str, ...] = get_args(MoeAuxLossScope)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    `kind="llama3"`: Llama-3.1 frequency-dependent scaling (`rope_type: llama3` in HF configs).
    `kind="longrope"`: Phi-3 128k / Phi-3.5 LongRoPE: inverse frequencies divided per pair by
    `short_factor`, or by `long_factor` once a forward pass reaches beyond
    `original_max_seq_len` positions; cos/sin multiplied by `attention_factor`.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    kind: Literal["llama3", "longrope"] = "llama3"
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelArgs:
    """Dimensions of a decoder-only transformer.

    `arch="llama"`: RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases.
    `arch="gpt2"`: LayerNorm, learned positions, GELU MLP, biases, tied head.

    The RoPE families (Qwen2/2.5, Qwen3, Mistral, Phi-3, Gemma 2) are `arch="llama"` with
    `family` naming their Hugging Face format and the fields below stating how they differ;
    every field defaults to Llama's behaviour (see docs/models.md).
    """

    arch: Arch = "llama"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None
    vocab_size: int = 8192
    ffn_dim: int | None = None
    """Hidden size of the MLP; None applies the Llama rule (see `ffn_hidden_dim`)."""
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    family: Family = "llama"
    """Checkpoint format (Hugging Face `model_type`); the architecture is set by the fields."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2/2.5)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    head_dim_override: int | None = None
    """Attention head size when it is not dim // n_heads (Qwen3, Gemma 2)."""
    sliding_window: int | None = None
    """Local attention: a query sees itself and the window - 1 keys before it (Mistral, Phi-3,
    Gemma 2 local layers)."""
    sliding_window_pattern: int = 1
    """With a window: 1 = every layer is local; p > 1 = layers i with i % p != p - 1 are local,
    the others global (Gemma 2: p = 2, even layers local)."""
    norm_unit_offset: bool = False
    """RMSNorm scales by (1 + weight), weights start at zero (Gemma)."""
    post_norms: bool = False
    """Extra RMSNorms on the attention and MLP outputs before the residual add (Gemma 2)."""
    mlp_act: MlpAct = "silu"
    """Gated-MLP activation: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma)."""
    embed_scale: bool = False
    """Multiply the token embeddings by sqrt(dim) (Gemma)."""
    attn_softcap: float | None = None
    """Attention logits become cap * tanh(logits / cap) (Gemma 2)."""
    final_softcap: float | None = None
    """Output logits become cap * tanh(logits / cap) (Gemma 2)."""
    query_pre_attn_scalar: float | None = None
    """Attention scale 1 / sqrt(this) instead of 1 / sqrt(head_dim) (Gemma 2)."""
    # --- Mixture of Experts (`models/moe.py`); n_experts = 0 is a dense model -----------------
    n_experts: int = 0
    """Routed experts per MoE block (Mixtral 8, Qwen3-30B-A3B 128); 0 = dense MLP."""
    n_experts_per_token: int = 2
    """Experts each token is routed to (top-k)."""
    moe_ffn_dim: int | None = None
    """Hidden size of one expert; None = the dense `hidden_dim`."""
    n_shared_experts: int = 0
    """Experts every token goes through (DeepSeek-style), as one MLP of n * moe_ffn_dim."""
    router_score: RouterScore = "softmax"
    """Router probabilities: softmax over experts (Mixtral, Qwen3) or per-expert sigmoid."""
    router_norm_topk: bool = True
    """Renormalize the k chosen weights to sum to 1 (Mixtral: always; Qwen3-MoE: norm_topk_prob)."""
    moe_aux_loss_coef: float = 0.0
    """Weight of the load-balancing auxiliary loss (Mixtral 0.02, Qwen3-MoE 0.001); 0 = off."""
    moe_aux_loss_scope: MoeAuxLossScope = "sequence"
    """Tokens the auxiliary loss E * sum_i f_i * P_i counts together. `sequence`: each sequence
    (row) on its own, the loss is the mean over the step's sequences (DeepSeek-V3's
    sequence-wise loss, Megatron's `seq_aux_loss`); the objective is the same for every layout
    of a global batch (micro-batch size, accumulation, DP/EP/TP/PP/CP). `micro_batch`:
    Switch/Mixtral's statistic over one micro-batch of every data-parallel rank (transformers'
    and Megatron's `aux_loss`); it changes when the global batch is split differently into
    micro-batch x accumulation x data-parallel ranks."""
    moe_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): per-step move of the routing bias; 0 = off."""
    moe_capacity_factor: float | None = None
    """Keep at most factor * tokens * k / experts tokens per expert (drop the rest); None = no
    dropping."""
    expert_compute: ExpertCompute = "grouped"
    """Routed experts as one grouped GEMM (`torch._grouped_mm`) or one matmul per expert."""
    dropout: float = 0.0
    """Residual dropout in training (GPT-2's `resid_pdrop`/`embd_pdrop`): on the embeddings and
    on each block's attention and MLP outputs before the residual add; 0 = none (no module, no
    random draw)."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid model dimensions: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every violated constraint, as a message that says how to fix it."""
        out = []
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be positive (got {getattr(self, name)})")
        if out:
            return out
        if self.head_dim_override is None and self.dim % self.n_heads:
            out.append(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads:
            out.append(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})"
            )
        if self.arch == "llama" and self.head_dim % 2:
            out.append(f"head_dim ({self.head_dim}) must be even for RoPE")
        rs = self.rope_scaling
        if rs is not None and rs.kind == "longrope" and not (
                len(rs.short_factor) == len(rs.long_factor) == self.head_dim // 2):
            out.append(f"longrope short_factor and long_factor need head_dim / 2 "
                       f"({self.head_dim // 2}) entries each (got {len(rs.short_factor)} and "
                       f"{len(rs.long_factor)})")
        if self.head_dim_override is not None and self.head_dim_override <= 0:
            out.append(f"head_dim_override must be positive (got {self.head_dim_override})")
        if self.sliding_window is not None and self.sliding_window <= 0:
            out.append(f"sliding_window must be positive or unset (got {self.sliding_window})")
        if self.sliding_window_pattern < 1:
            out.append("sliding_window_pattern must be >= 1 "
                       f"(got {self.sliding_window_pattern})")
        for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                out.append(f"{name} must be positive or unset (got {value})")
        if (self.arch == "gpt2" and self.family not in ("gpt2", "llama")
                or self.arch != "gpt2" and self.family == "gpt2"):
            out.append(f"family {self.family!r} does not match arch {self.arch!r}")
        if self.ffn_dim is not None and self.ffn_dim <= 0:
            out.append(f"ffn_dim must be positive (got {self.ffn_dim})")
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"dropout must be in [0, 1) (got {self.dropout})")
        return out + self._moe_problems()

    def _moe_problems(self) -> list[str]:
        out = []
        if self.n_experts < 0 or self.n_shared_experts < 0:
            out.append("n_experts and n_shared_experts must be >= 0")
        if self.n_experts == 0:
            if self.family in ("mixtral", "qwen3_moe"):
                out.append(f"family {self.family!r} needs n_experts > 0")
            return out
        if self.arch != "llama":
            out.append("Mixture of Experts needs arch 'llama' (SwiGLU experts)")
        if not 1 <= self.n_experts_per_token <= self.n_experts:
            out.append(f"n_experts_per_token must be in 1..n_experts ({self.n_experts}); "
                       f"got {self.n_experts_per_token}")
        if self.moe_ffn_dim is not None and self.moe_ffn_dim <= 0:
            out.append(f"moe_ffn_dim must be positive (got {self.moe_ffn_dim})")
        if self.moe_aux_loss_coef < 0 or self.moe_bias_update_rate < 0:
            out.append("moe_aux_loss_coef and moe_bias_update_rate must be >= 0")
        if self.moe_aux_loss_scope not in MOE_AUX_LOSS_SCOPES:
            out.append(f"moe_aux_loss_scope must be one of {', '.join(MOE_AUX_LOSS_SCOPES)} "
                       f"(got {self.moe_aux_loss_scope!r})")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            out.append("moe_capacity_factor must be positive or unset")
        return out

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        if self.head_dim_override is not None:
            return self.head_dim_override
        return self.dim // self.n_heads

    def is_sliding(self, layer: int) -> bool:
        """Whether block `layer` attends only inside `sliding_window`."""
        if self.sliding_window is None:
            return False
        p = self.sliding_window_pattern
        return p == 1 or layer % p != p - 1

    def attention_span(self, layer: int, seq_len: int) -> int:
        """Keys the last query of a `seq_len` sequence sees in block `layer`."""
        return min(seq_len, self.sliding_window) if self.is_sliding(layer) else seq_len

    @property
    def attn_scale(self) -> float:
        """The factor on q.k: 1 / sqrt(query_pre_attn_scalar or head_dim)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def hidden_dim(self) -> int:
        return ffn_hidden_dim(self)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_hidden_dim(self) -> int:
        """Hidden size of one routed expert."""
        return self.moe_ffn_dim if self.moe_ffn_dim is not None else self.hidden_dim

    @property
    def shared_expert_hidden_dim(self) -> int:
        return self.n_shared_experts * self.expert_hidden_dim

    @property
    def has_bias(self) -> bool:
        return self.arch == "gpt2"

    def replace(self, **changes: Any) -> ModelArgs:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelArgs:
        data = dict(data)
        if data.get("rope_scaling") is not None:
            rope = dict(data["rope_scaling"])
            for key in ("short_factor", "long_factor"):
                if key in rope:
                    rope[key] = tuple(rope[key])
            data["rope_scaling"] = RopeScaling(**rope)
        return cls(**data)


def ffn_hidden_dim(args: ModelArgs) -> int:
    """MLP width: explicit `ffn_dim`, else 4*dim (GPT-2) or Llama's 8/3*dim rule rounded up."""
    if args.ffn_dim is not None:
        return args.ffn_dim
    if args.arch == "gpt2":
        return 4 * args.dim
    hidden = int(2 * (4 * args.dim) / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * math.ceil(hidden / args.multiple_of)


@dataclass(frozen=True)
class ParamCount:
    """Parameter count split by component (embedding counts the output head when untied)."""

    embedding: int
    positional: int
    attention: int
    mlp: int
    norms: int
    head: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding - self.positional - self.head


def count_params(args: ModelArgs) -> ParamCount:
    """Exact number of parameters of the model `args` describes, without building it."""
    d, hd, kv = args.dim, args.head_dim, args.kv_heads
    bias = args.has_bias
    q_out, kv_out = args.n_heads * hd, kv * hd
    attention = d * q_out + 2 * d * kv_out + q_out * d
    if bias:
        attention += q_out + 2 * kv_out + d
    elif args.qkv_bias:
        attention += q_out + 2 * kv_out
    if args.qk_norm:
        attention += 2 * hd
    hidden = args.hidden_dim
    # GELU MLP: two matrices with biases; SwiGLU: three matrices, no biases.
    mlp = 2 * d * hidden + (hidden + d) if args.arch == "gpt2" else 3 * d * hidden
    if args.is_moe:  # router + routed experts + shared experts
        mlp = d * args.n_experts + 3 * d * (args.n_experts * args.expert_hidden_dim
                                            + args.shared_expert_hidden_dim)
    norm = 2 * d if args.arch == "gpt2" else d  # LayerNorm has weight and bias
    norms_per_layer = 4 if args.post_norms else 2
    return ParamCount(
        embedding=args.vocab_size * d,
        positional=args.max_seq_len * d if args.arch == "gpt2" else 0,
        attention=args.n_layers * attention,
        mlp=args.n_layers * mlp,
        norms=args.n_layers * norms_per_layer * norm + norm,
        head=0 if args.tie_embeddings else args.vocab_size * d,
    )


def count_active_params(args: ModelArgs) -> int:
    """Parameters one token goes through: the total less the routed experts it skips (equal to
    the total for a dense model); FLOPs per token and MFU of MoE models count these."""
    if not args.is_moe:
        return count_params(args).total
    skipped = args.n_experts - args.n_experts_per_token
    return count_params(args).total - args.n_layers * skipped * 3 * args.dim \
        * args.expert_hidden_dim


def _llama3_rope(factor: float) -> RopeScaling:
    return RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_seq_len=8192)


def _gpt2(dim: int, n_layers: int, n_heads: int) -> ModelArgs:
    return ModelArgs(arch="gpt2", dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=50257,
                     max_seq_len=1024, tie_embeddings=True, norm_eps=1e-5)


_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5)
_QWEN = dict(family="qwen2", qkv_bias=True, vocab_size=151936, rope_theta=1e6, norm_eps=1e-6)
_QWEN3 = dict(family="qwen3", qk_norm=True, head_dim_override=128, vocab_size=151936,
              rope_theta=1e6, norm_eps=1e-6, max_seq_len=40960)
_GEMMA = dict(family="gemma", head_dim_override=256, vocab_size=256000, max_seq_len=8192,
              norm_eps=1e-6, tie_embeddings=True, norm_unit_offset=True, mlp_act="gelu_tanh",
              embed_scale=True)
_GEMMA2 = dict(family="gemma2", head_dim_override=256, vocab_size=256000, max_seq_len=8192,
               norm_eps=1e-6, tie_embeddings=True, sliding_window=4096, sliding_window_pattern=2,
               norm_unit_offset=True, post_norms=True, mlp_act="gelu_tanh", embed_scale=True,
               attn_softcap=50.0, final_softcap=30.0, query_pre_attn_scalar=256.0)

PRESETS: dict[str, ModelArgs] = {
    # Tiny model for CPU runs, CI and the demo (vocabulary matches the default corpus tokenizer).
    "debug": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192,
                       ffn_dim=768, max_seq_len=1024, rope_theta=10000.0),
    "llama3.2-1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                             max_seq_len=131072, tie_embeddings=True,
                             rope_scaling=_llama3_rope(32.0), **_LLAMA3),
    "llama3.2-3b": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
                             max_seq_len=131072, tie_embeddings=True,
                             rope_scaling=_llama3_rope(32.0), **_LLAMA3),
    "llama2-7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                           multiple_of=256, max_seq_len=4096, norm_eps=1e-5),
    "llama2-13b": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000,
                            ffn_dim=13824, max_seq_len=4096, norm_eps=1e-5),
    "llama3-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024,
                           ffn_dim_multiplier=1.3, max_seq_len=8192, **_LLAMA3),
    "llama3.1-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024,
                             ffn_dim_multiplier=1.3, max_seq_len=131072,
                             rope_scaling=_llama3_rope(8.0), **_LLAMA3),
    "llama3-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096,
                            ffn_dim_multiplier=1.3, max_seq_len=8192, **_LLAMA3),
    "llama3.1-405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                               multiple_of=4096, ffn_dim_multiplier=1.2, max_seq_len=131072,
                               rope_scaling=_llama3_rope(8.0), **_LLAMA3),
    # Dimensions of the published Hugging Face config.json of each model (docs/models.md).
    "qwen2.5-0.5b": ModelArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864,
                              max_seq_len=32768, tie_embeddings=True, **_QWEN),
    "qwen2.5-1.5b": ModelArgs(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960,
                              max_seq_len=131072, tie_embeddings=True, **_QWEN),
    "qwen2.5-7b": ModelArgs(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944,
                            max_seq_len=131072, **{**_QWEN, "vocab_size": 152064}),
    "qwen3-0.6b": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072,
                            tie_embeddings=True, **_QWEN3),
    "qwen3-8b": ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288,
                          **_QWEN3),
    "mistral-7b-v0.3": ModelArgs(family="mistral", dim=4096, n_layers=32, n_heads=32,
                                 n_kv_heads=8, ffn_dim=14336, vocab_size=32768,
                                 rope_theta=1e6, norm_eps=1e-5, max_seq_len=32768),
    "phi3-mini": ModelArgs(family="phi3", dim=3072, n_layers=32, n_heads=32, n_kv_heads=32,
                           ffn_dim=8192, vocab_size=32064, rope_theta=10000.0, norm_eps=1e-5,
                           max_seq_len=4096, sliding_window=2047),
    "gemma-2b": ModelArgs(dim=2048, n_layers=18, n_heads=8, n_kv_heads=1, ffn_dim=16384,
                          **_GEMMA),
    "gemma-7b": ModelArgs(dim=3072, n_layers=28, n_heads=16, n_kv_heads=16, ffn_dim=24576,
                          **_GEMMA),
    "gemma2-2b": ModelArgs(dim=2304, n_layers=26, n_heads=8, n_kv_heads=4, ffn_dim=9216,
                           **_GEMMA2),
    "gemma2-9b": ModelArgs(dim=3584, n_layers=42, n_heads=16, n_kv_heads=8, ffn_dim=14336,
                           **_GEMMA2),
    # Tiny members of each family (dimensions of `debug`) for CPU runs and the parity tests.
    **{f"debug-{fam}": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192,
                                 ffn_dim=768, max_seq_len=1024, **extra)
       for fam, extra in {
           "qwen2": dict(family="qwen2", qkv_bias=True),
           "qwen3": dict(family="qwen3", qk_norm=True, head_dim_override=48),
           "mistral": dict(family="mistral", sliding_window=24),
           "phi3": dict(family="phi3", sliding_window=20),
           "gemma": dict(family="gemma", head_dim_override=48, norm_unit_offset=True,
                         mlp_act="gelu_tanh", embed_scale=True),
           "gemma2": dict(family="gemma2", head_dim_override=48, norm_unit_offset=True,
                          post_norms=True, mlp_act="gelu_tanh", embed_scale=True,
                          sliding_window=24, sliding_window_pattern=2, attn_softcap=50.0,
                          final_softcap=30.0, query_pre_attn_scalar=32.0),
       }.items()},
    # Mixture of Experts (dimensions of the published config.json files).
    "debug-moe": ModelArgs(family="mixtral", dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                           vocab_size=8192, ffn_dim=512, max_seq_len=1024, n_experts=8,
                           n_experts_per_token=2, moe_aux_loss_coef=0.01),
    "mixtral-8x7b": ModelArgs(family="mixtral", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                              ffn_dim=14336, vocab_size=32000, rope_theta=1e6, norm_eps=1e-5,
                              max_seq_len=32768, n_experts=8, n_experts_per_token=2,
                              moe_aux_loss_coef=0.02),
    "mixtral-8x22b": ModelArgs(family="mixtral", dim=6144, n_layers=56, n_heads=48,
                               n_kv_heads=8, ffn_dim=16384, vocab_size=32768, rope_theta=1e6,
                               norm_eps=1e-5, max_seq_len=65536, n_experts=8,
                               n_experts_per_token=2, moe_aux_loss_coef=0.001),
    "qwen3-30b-a3b": ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144,
                               moe_ffn_dim=768, n_experts=128, n_experts_per_token=8,
                               moe_aux_loss_coef=0.001,
                               **{**_QWEN3, "family": "qwen3_moe"}),
    "qwen3-235b-a22b": ModelArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4,
                                 ffn_dim=12288, moe_ffn_dim=1536, n_experts=128,
                                 n_experts_per_token=8, moe_aux_loss_coef=0.001,
                                 **{**_QWEN3, "family": "qwen3_moe"}),
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
}


def get_preset(name: str) -> ModelArgs:
    """The preset called `name`; an unknown name lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        import difflib

        near = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        raise KeyError(
            f"unknown model preset '{name}'.{hint} Known presets: {', '.join(PRESETS)}"
        ) from None


def preset_table() -> list[dict[str, Any]]:
    """One row per preset: name, dimensions and exact parameter count (for `scaletrain models`)."""
    rows = []
    for name, a in PRESETS.items():
        rows.append({
            "name": name, "arch": a.arch if a.arch == "gpt2" else a.family,
            "params": count_params(a).total, "active_params": count_active_params(a),
            "dim": a.dim, "n_experts": a.n_experts,
            "experts_per_token": a.n_experts_per_token if a.is_moe else 0,
            "expert_ffn_dim": a.expert_hidden_dim if a.is_moe else 0,
            "n_layers": a.n_layers, "n_heads": a.n_heads, "n_kv_heads": a.kv_heads,
            "head_dim": a.head_dim, "sliding_window": a.sliding_window,
            "ffn_dim": a.hidden_dim, "vocab_size": a.vocab_size, "max_seq_len": a.max_seq_len,
            "tie_embeddings": a.tie_embeddings,
        })
    return rows


__all__ = ["ModelArgs", "RopeScaling", "ParamCount", "PRESETS", "count_params",
           "count_active_params", "get_preset",
           "preset_table", "ffn_hidden_dim"]
