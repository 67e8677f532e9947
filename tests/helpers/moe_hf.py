"""Tiny transformers Mixtral and Qwen3-MoE models with random, scaled weights (no downloads)."""

from __future__ import annotations

import torch

from tests.helpers.family import COMMON, randomize

# 4 experts, top-2: every routing choice shows in the logits. Qwen3-MoE with its own expert
# width, a head_dim other than hidden / heads, both norm_topk_prob settings, and a window shorter
# than the test sequences (Qwen3-MoE's window covers every layer).
MOE_FAMILIES: dict[str, tuple[str, dict]] = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                      router_aux_loss_coef=0.02, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=40, head_dim=24,
                                         norm_topk_prob=True, tie_word_embeddings=True)),
    "qwen3_moe_unnormed": ("Qwen3MoeConfig", dict(num_experts=5, num_experts_per_tok=3,
                                                  moe_intermediate_size=32,
                                                  norm_topk_prob=False,
                                                  use_sliding_window=True, sliding_window=16)),
}


def hf_moe_model(name: str, seed: int = 0):
    import transformers

    cls_name, extra = MOE_FAMILIES[name]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomize(model, seed)
    return model.eval()
