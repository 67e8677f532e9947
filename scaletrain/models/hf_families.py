"""The RoPE families in Hugging Face format: config.json <-> `ModelArgs`, and module names.

Llama, Qwen2/2.5, Qwen3, Mistral, Phi-3, Gemma and Gemma 2 checkpoints share one layout
(`model.layers.N.self_attn.q_proj` ...); each family's differences are stated here once:
its config fields, its norm names (Gemma 2 has four per block) and its fused projections
(Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, split at load and
fused again at export).
"""

from __future__ import annotations

import math
from typing import Any

from scaletrain.models.args import ModelArgs, RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gpt2",
                         "mixtral", "qwen3_moe")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                  "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
                  "gemma2": "Gemma2ForCausalLM"}

LLAMA_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORMS = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}
_GEMMA2_NORMS = {
    "attention_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffn_norm": "post_feedforward_layernorm",
}
# Phi-3: HF module -> our modules, concatenated along the output features in this order.
PHI3_FUSED = {
    "self_attn.qkv_proj": ("attention.wq", "attention.wk", "attention.wv"),
    "mlp.gate_up_proj": ("feed_forward.w1", "feed_forward.w3"),
}


def layer_map(args: ModelArgs) -> dict[str, str]:
    """Our block module names -> the family's HF names (fused Phi-3 projections left out)."""
    out = dict(LLAMA_LAYER)
    if args.qk_norm:
        out.update(_QK_NORMS)
    if args.post_norms:
        out.update(_GEMMA2_NORMS)
    if args.family == "phi3":
        for parts in PHI3_FUSED.values():
            for part in parts:
                del out[part]
    return out


def fused_map(args: ModelArgs) -> dict[str, tuple[str, ...]]:
    """HF fused module -> our modules, for families that fuse projections."""
    return PHI3_FUSED if args.family == "phi3" else {}


def unsupported_model_type(model_type: Any) -> ValueError:
    return ValueError(
        f"unsupported Hugging Face model_type {model_type!r}: scaletrain converts "
        f"{', '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)} checkpoints"
    )


# --- config.json -> ModelArgs ----------------------------------------------------------------
def rope_scaling_from_hf(rope: dict[str, Any], cfg: dict[str, Any] | None = None
                         ) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind in ("longrope", "su") and cfg is not None:
        return _longrope(rope, cfg)
    if kind != "llama3":
        raise ValueError(f"RoPE scaling type {kind!r} is not supported (supported: default, "
                         "llama3, longrope for phi3)")
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_seq_len=int(rope["original_max_position_embeddings"]),
    )


def _longrope(rope: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    """Phi-3 LongRoPE; the attention factor resolved as transformers does when absent."""
    original = int(rope.get("original_max_position_embeddings")
                   or cfg["original_max_position_embeddings"])
    factor = rope.get("factor") or int(cfg["max_position_embeddings"]) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(kind="longrope", factor=float(factor), original_max_seq_len=original,
                       short_factor=tuple(float(x) for x in rope["short_factor"]),
                       long_factor=tuple(float(x) for x in rope["long_factor"]),
                       attention_factor=float(attention))


def _window(cfg: dict[str, Any], family: str, n_layers: int) -> tuple[int | None, int]:
    """(sliding_window, sliding_window_pattern) from the config's window and layer types."""
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if family == "llama" or window is None:
        return None, 1
    types = cfg.get("layer_types")
    if types is None:
        if family == "gemma2":
            return int(window), 2
        if family in ("qwen2", "qwen3"):  # transformers: layers from max_window_layers on
            start = int(cfg.get("max_window_layers", n_layers))
            types = ["sliding_attention" if i >= start else "full_attention"
                     for i in range(n_layers)]
        else:
            return int(window), 1
    local = [t == "sliding_attention" for t in types]
    if not any(local):
        return None, 1
    for p in range(1, n_layers + 1):
        probe = ModelArgs(n_layers=n_layers, sliding_window=int(window),
                          sliding_window_pattern=p)
        if [probe.is_sliding(i) for i in range(n_layers)] == local:
            return int(window), p
    raise ValueError(f"layer_types {types} are not supported: scaletrain has all layers local "
                     "or every p-th layer global (layers i with i % p == p - 1)")


def rope_family_args(cfg: dict[str, Any]) -> ModelArgs:
    """`ModelArgs` of a Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma or Gemma 2 config.json."""
    family = cfg.get("model_type")
    if family not in _ARCHITECTURES:
        raise unsupported_model_type(family)
    dim, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    n_layers = int(cfg["num_hidden_layers"])
    head_dim = cfg.get("head_dim")
    gemma = family in ("gemma", "gemma2")
    # Gemma's MLP reads hidden_act, Gemma 2's hidden_activation; the Gemma 1 releases say
    # "gelu", which transformers maps to the tanh approximation the models were trained with.
    if family == "gemma2":
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    else:
        act = cfg.get("hidden_act") or "silu"
    if family == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
    if act not in acts or (not gemma and act != "silu"):
        raise ValueError(f"hidden_act {act!r} is not supported for {family} (supported: "
                         f"{'gelu_pytorch_tanh' if gemma else 'silu'})")
    if family != "qwen2" and cfg.get("attention_bias"):  # Qwen2's q/k/v biases are implied
        raise ValueError("attention_bias=true is not supported for this model_type")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported: scaletrain MLPs have no bias")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported (RoPE on every dim)")
    # transformers >= 5 nests rope_theta and the scaling in `rope_parameters`; older configs
    # have top-level `rope_theta` and `rope_scaling`.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    window, pattern = _window(cfg, family, n_layers)
    extra: dict[str, Any] = {}
    if family == "gemma":
        extra = dict(norm_unit_offset=True, embed_scale=True)
    if family == "gemma2":
        extra = dict(norm_unit_offset=True, post_norms=True, embed_scale=True,
                     attn_softcap=cfg.get("attn_logit_softcapping"),
                     final_softcap=cfg.get("final_logit_softcapping"),
                     query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)))
    return ModelArgs(
        arch="llama",
        family=family,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        vocab_size=int(cfg["vocab_size"]),
        ffn_dim=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=rope_scaling_from_hf(rope, cfg if family == "phi3" else None),
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        head_dim_override=(int(head_dim) if head_dim is not None and head_dim * n_heads != dim
                           else None),
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        sliding_window=window,
        sliding_window_pattern=pattern,
        mlp_act=acts[act],
        **extra,
    )


# --- ModelArgs -> config.json ----------------------------------------------------------------
def rope_family_config(args: ModelArgs) -> dict[str, Any]:
    """The config.json fields of `args.family` (ids and dtype are added by the caller)."""
    family = args.family
    _check_representable(args)
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "gelu_pytorch_tanh" if args.mlp_act == "gelu_tanh" else "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": args.qkv_bias,
        "mlp_bias": False,
    }
    layer_types = ["sliding_attention" if args.is_sliding(i) else "full_attention"
                   for i in range(args.n_layers)]
    if family in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=args.sliding_window is not None,
                   sliding_window=args.sliding_window, max_window_layers=args.n_layers,
                   layer_types=layer_types)
    elif family in ("mistral", "phi3"):
        cfg["sliding_window"] = args.sliding_window
        if family == "phi3":
            cfg["original_max_position_embeddings"] = args.max_seq_len
            cfg["pad_token_id"] = None
    elif family == "gemma":
        cfg["hidden_activation"] = cfg["hidden_act"]
    elif family == "gemma2":
        cfg.update(hidden_activation=cfg["hidden_act"], sliding_window=args.sliding_window,
                   layer_types=layer_types, query_pre_attn_scalar=_int_if_whole(
                       args.query_pre_attn_scalar or args.head_dim),
                   attn_logit_softcapping=args.attn_softcap,
                   final_logit_softcapping=args.final_softcap, pad_token_id=None)
    if args.rope_scaling is not None and args.rope_scaling.kind == "longrope":
        s = args.rope_scaling
        cfg["original_max_position_embeddings"] = s.original_max_seq_len
        cfg["rope_scaling"] = {"rope_type": "longrope", "short_factor": list(s.short_factor),
                               "long_factor": list(s.long_factor), "factor": s.factor,
                               "attention_factor": s.attention_factor,
                               "original_max_position_embeddings": s.original_max_seq_len}
    elif args.rope_scaling is not None:
        s = args.rope_scaling
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
    return cfg


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


# What each family's transformers class can express besides the common Llama fields.
_ALLOWED = {
    "llama": set(), "mistral": {"sliding_window"}, "phi3": {"sliding_window"},
    "qwen2": {"qkv_bias", "sliding_window"}, "qwen3": {"qk_norm", "sliding_window"},
    "gemma": {"norm_unit_offset", "mlp_act", "embed_scale"},
    "gemma2": {"norm_unit_offset", "post_norms", "mlp_act", "embed_scale", "attn_softcap",
               "final_softcap", "query_pre_attn_scalar", "sliding_window"},
}
_FEATURES = ("qkv_bias", "qk_norm", "sliding_window", "norm_unit_offset", "post_norms",
             "embed_scale", "attn_softcap", "final_softcap", "query_pre_attn_scalar")


def _check_representable(args: ModelArgs) -> None:
    """Refuse args the family's transformers class would silently compute differently."""
    allowed = _ALLOWED[args.family]
    used = [f for f in _FEATURES if getattr(args, f) not in (None, False)]
    if args.mlp_act != "silu":
        used.append("mlp_act")
    if args.sliding_window is not None and args.sliding_window_pattern != 1 and (
            args.family in ("mistral", "phi3")):
        used.append("sliding_window_pattern")
    required = {"qwen2": {"qkv_bias"}, "qwen3": {"qk_norm"},
                "gemma": {"norm_unit_offset", "mlp_act", "embed_scale"},
                "gemma2": {"norm_unit_offset", "post_norms", "mlp_act", "embed_scale"}}
    lacking = sorted(required.get(args.family, set()) - set(used))
    if lacking:
        raise ValueError(f"a {args.family} checkpoint needs {', '.join(lacking)} set "
                         "(see docs/models.md)")
    if args.rope_scaling is not None and args.rope_scaling.kind == "longrope" and (
            args.family != "phi3"):
        raise ValueError(f"a {args.family} checkpoint cannot hold longrope RoPE scaling "
                         "(phi3 only)")
    wrong = [f for f in used if f not in allowed]
    if wrong:
        raise ValueError(f"a {args.family} checkpoint cannot hold {', '.join(wrong)}; set "
                         "model family to one that has them (see docs/models.md)")


__all__ = ["SUPPORTED_MODEL_TYPES", "LLAMA_LAYER", "PHI3_FUSED", "layer_map", "fused_map",
           "rope_family_args", "rope_family_config", "rope_scaling_from_hf",
           "unsupported_model_type"]
