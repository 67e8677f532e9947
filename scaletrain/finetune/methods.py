"""What a fine-tuning method does to the base model before training: the one path the trainer
and the activation measurement (`train/saved_bytes.py`) share."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from scaletrain.finetune.freeze import freeze_layers, train_norms
from scaletrain.finetune.heads import SequenceClassifier
from scaletrain.finetune.lora import LoRASettings, apply_lora


def apply_method(backbone: nn.Module, method: str, *, lora: LoRASettings | None = None,
                 freeze_embeddings: bool = True, freeze_first: int = 0,
                 train_last: int | None = None, norms: bool = False,
                 quant_dtype: torch.dtype | None = None, device: torch.device | None = None,
                 seed: int = 0, load_quantized: Callable[[nn.Module], None] | None = None
                 ) -> None:
    """Freeze (`freeze`), or quantize the block linears to NF4 (`qlora`, compute dtype
    `quant_dtype`) and wrap the targets with adapters (`lora`, `qlora`; `norms`: train the
    norms too), in place; `full` changes nothing. A QLoRA `backbone` on the meta device gets
    empty NF4 layers; `load_quantized` (one process: `qlora_load.materialize_qlora`) then fills
    it before the adapters are made, on the device of its weights as from a loaded base;
    without it the adapters are made on the CPU and the base is read once the layout is
    applied."""
    if method == "freeze":
        freeze_layers(backbone, embeddings=freeze_embeddings, first=freeze_first,
                      train_last=train_last)
    elif method in ("lora", "qlora"):
        if method == "qlora":
            from scaletrain.finetune.qlora import quantize_blocks

            if any(p.is_meta for p in backbone.parameters()):  # read later: `qlora_load`
                from scaletrain.finetune.qlora_load import empty_nf4

                quantize_blocks(backbone, quant_dtype or torch.float32, make=empty_nf4)
                if load_quantized is not None:
                    load_quantized(backbone)
            else:
                quantize_blocks(backbone, quant_dtype or torch.float32)
                if device is not None:
                    backbone.to(device)
        torch.manual_seed(seed)
        apply_lora(backbone, lora or LoRASettings())
        if norms:
            train_norms(backbone)


def with_head(backbone: nn.Module, num_labels: int | None, seed: int = 0) -> nn.Module:
    """The model a task trains: `backbone` (language modelling, SFT) or a
    `SequenceClassifier` over it (`num_labels`)."""
    if num_labels is None:
        return backbone
    torch.manual_seed(seed)
    return SequenceClassifier(backbone, num_labels)


__all__ = ["apply_method", "with_head"]
