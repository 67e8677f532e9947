"""Tiny transformers models of each family with random, scaled weights (no downloads)."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=None,
              attn_implementation="eager")
# Windows shorter than the 80-token test sequences, soft-caps small enough to bend the logits,
# a head_dim that differs from hidden_size / heads: every difference shows in the logits.
FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True, rope_theta=1e6)),
    "mistral": ("MistralConfig", dict(sliding_window=16, head_dim=16)),
    "phi3": ("Phi3Config", dict(sliding_window=20, num_key_value_heads=4)),
    "gemma": ("GemmaConfig", dict(head_dim=24, hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", dict(head_dim=24, sliding_window=16, query_pre_attn_scalar=20,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=6.0,
                                    hidden_activation="gelu_pytorch_tanh")),
}


def randomize(model: torch.nn.Module, seed: int, unit_offset: bool = False) -> None:
    """Matrices ~ N(0, 0.15), biases ~ N(0, 0.1), norm scales around 1 (around 0 for (1 + w)
    norms): attention is far from uniform and a wrong norm or RoPE shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim >= 2:
                p.copy_(0.15 * noise)
            elif "norm" in name:
                p.copy_((0.0 if unit_offset else 1.0) + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)


def hf_model(family: str, seed: int = 0):
    import transformers

    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomize(model, seed, unit_offset=family.startswith("gemma"))
    return model.eval()


def tokens(seq: int = 80, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
