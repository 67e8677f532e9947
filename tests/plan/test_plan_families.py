"""The planner on the model families: parameters of the built model, window-aware FLOPs."""

from __future__ import annotations

import pytest

from scaletrain.models.args import PRESETS
from scaletrain.models.transformer import Transformer
from scaletrain.plan.flops import flops_per_token, matmul_params


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b", "mistral-7b-v0.3", "phi3-mini",
                                  "gemma2-2b"])
def test_plan_counts_the_parameters_of_the_built_model(name):
    import torch

    from scaletrain.plan.estimate import count_params

    with torch.device("meta"):
        model = Transformer(PRESETS[name])
    built = sum(p.numel() for p in model.parameters())  # a tied head is one parameter
    assert count_params(PRESETS[name]).total == built


def test_sliding_windows_cut_attention_flops_only_beyond_the_window():
    gemma = PRESETS["gemma2-2b"]  # window 4096 on every other layer
    full = gemma.replace(sliding_window=None)
    assert flops_per_token(gemma, 4096) == flops_per_token(full, 4096)
    saved = flops_per_token(full, 8192) - flops_per_token(gemma, 8192)
    local_layers = gemma.n_layers // 2
    assert saved == 12 * gemma.n_heads * gemma.head_dim * (8192 - 4096) * local_layers
    assert matmul_params(gemma) == matmul_params(full)
