"""Kept for existing imports: the loader lives in `scaletrain.loader`."""

from scaletrain.loader import (
    find_checkpoint,
    hf_eos_id,
    load_for_inference,
    load_model,
    tokenizer_eos_id,
)

__all__ = ["find_checkpoint", "load_for_inference", "load_model", "hf_eos_id",
           "tokenizer_eos_id"]
