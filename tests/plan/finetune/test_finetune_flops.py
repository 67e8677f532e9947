"""The fine-tuning FLOP formula (`plan/finetune/flops.py`) against an independent count of the
matmuls a real step runs: `torch.utils.flop_counter.FlopCounterMode` over forward + backward
of a tiny model prepared by each method (attention on SDPA's math backend, whose matmuls the
counter sees; it does not count the CPU flash kernel). Full fine-tuning of a language model
counts 6N + attention with N the matmul weights (`flops_per_token` also counts the norm weights
in N, as the 6N convention does: 6 x 448 FLOPs per token more here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from scaletrain.finetune.lora import LoRASettings
from scaletrain.finetune.methods import apply_method, with_head
from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import build_model
from scaletrain.plan.finetune.flops import finetune_flops_per_token
from scaletrain.plan.flops import flops_per_token

SEQ, BATCH = 32, 2
CASES = {  # name: (method, apply_method options, formula options, labels)
    "lora": ("lora", {"lora": LoRASettings(rank=4)}, {"rank": 4}, None),
    "lora-qv-norms": ("lora", {"lora": LoRASettings(rank=4, targets=("q", "v")),
                               "norms": True},
                      {"rank": 4, "targets": ("q", "v"), "train_norms": True}, None),
    "freeze-first": ("freeze", {"freeze_first": 1}, {"freeze_first": 1}, None),
    "full": ("full", {}, {}, None),
    "full-classification": ("full", {}, {}, 3),
    "lora-classification": ("lora", {"lora": LoRASettings(rank=2, targets=("o", "down"))},
                            {"rank": 2, "targets": ("o", "down")}, 3),
}


def _addmm(self_shape: tuple, a_shape: tuple, b_shape: tuple, **_: object) -> int:
    (m, k), (_k, n) = a_shape, b_shape
    return 2 * m * k * n


def _counted(args: ModelArgs, method: str, options: dict, labels: int | None) -> int:
    backbone = build_model(args, seed=0)
    apply_method(backbone, method, **options)
    model = with_head(backbone, labels)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ))
    # The fused LoRA layer adds its update with the in-place `addmm_`, which the counter's
    # table lacks: it gets the out-of-place `addmm`'s count (the same matmul).
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm})
    with sdpa_kernel(SDPBackend.MATH), counter:
        if labels is None:
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        else:
            logits = model(tokens, torch.full((BATCH,), SEQ))
            loss = F.cross_entropy(logits, torch.zeros(BATCH, dtype=torch.long))
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("case", CASES)
def test_step_flops_equal_the_counted_matmuls(case: str) -> None:
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96,
                     max_seq_len=SEQ)
    method, options, formula, labels = CASES[case]
    expected = _counted(args, method, options, labels)
    got = finetune_flops_per_token(args, SEQ, method, num_labels=labels, **formula)
    assert got * BATCH * SEQ == pytest.approx(expected, rel=1e-12), case


def test_frozen_base_is_about_two_thirds_of_pretraining() -> None:
    """A LoRA run does no weight-gradient matmuls for its base: ~4N + adapters, not 6N."""
    args = dataclasses.replace(ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                         vocab_size=128256, ffn_dim=14336), max_seq_len=4096)
    lora = finetune_flops_per_token(args, 4096, "lora", rank=16)
    assert 0.6 < lora / flops_per_token(args, 4096) < 0.72
    full = finetune_flops_per_token(args, 4096, "full")
    assert full == pytest.approx(flops_per_token(args, 4096), rel=1e-4)
